"""linicl: the exact theory of in-context learning, in JAX/Flax.

* ``ModelConfig``, ``Transformer``: the model zoo (linear and softmax attention).
* ``linicl.iclca``: exact conversion of a prompt into linear-attention bias terms.
* ``generate``: greedy and sampled decoding with a state or a KV cache.
* ``linicl.lm``: pretrained checkpoints (HF GPT-2/Llama, GGUF, SmolLM2) and their tokenizers.
* ``linicl.interventions``: the activation cache and edits (TransformerLens-style names).
* ``linicl.data``: ICL data sets and prompts; ``linicl.evaluate``: accuracy by next-token scoring;
  ``linicl.routing``: In-Context Routing; ``linicl.implicit``: implicit weight updates (import them).
"""

from linicl import data, iclca, interventions, kernels, lm
from linicl.config import PRESETS, ModelConfig, preset
from linicl.errors import (ConfigError, DataError, DegenerateInputError, LiniclError, NotExactError,
                           SequenceTooLongError)
from linicl.generation import generate
from linicl.nn import Transformer

__version__ = "0.1.0"

__all__ = ["ModelConfig", "PRESETS", "preset", "Transformer", "iclca", "kernels", "generate",
           "LiniclError", "ConfigError", "NotExactError", "SequenceTooLongError",
           "DegenerateInputError", "DataError", "data", "interventions", "lm"]
