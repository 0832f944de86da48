"""linicl: the exact theory of in-context learning, in JAX/Flax.

* ``ModelConfig``, ``Transformer``: the model zoo (linear and softmax attention); ``generate``.
* ``linicl.iclca``: exact conversion of a prompt into linear-attention bias terms (and the
  approximate one for softmax models, with ``linicl.selection``: which exact prompt keys a long
  prompt keeps); ``linicl.approx``: the approximate conversion evaluated
  against the prompted model.
* ``linicl.implicit``: implicit weight updates; ``linicl.routing``: In-Context Routing.
* ``linicl.bias_training``: trainable bias terms (B, b) trained against the same model without them
  (ICLCA Figure 1).
* ``linicl.lm``: pretrained checkpoints (HF GPT-2/Llama, GGUF, SmolLM2) and their tokenizers.
* ``linicl.interventions``: the activation cache and edits (TransformerLens-style names);
  ``linicl.activations``: activations over many prompts.
* ``linicl.data``: ICL data sets and prompts; ``linicl.evaluate``: accuracy by next-token scoring;
  ``linicl.batching`` and ``linicl.parallel``: batches, length buckets, devices.
* ``linicl.names``: every enumeration, collection and site name; ``linicl.compiled``: the one cache of
  compiled functions; ``linicl.checkpoint``: the checkpoint format of every training loop.

Every submodule is importable as an attribute (``linicl.routing``) and loaded on first use, so
``import linicl`` stays fast.
"""

import importlib

from linicl.config import PRESETS, ModelConfig, preset
from linicl.errors import (BudgetError, ConfigError, DataError, DegenerateInputError, LiniclError, NotExactError,
                           SequenceTooLongError)
from linicl.generation import generate
from linicl.nn import Transformer

__version__ = "0.1.0"

# Public submodules, loaded on first attribute access.
SUBMODULES = ("activations", "approx", "batching", "benchmarking", "bias_training", "capacity", "checkpoint",
              "cli", "compiled", "config", "data", "diagnostics", "errors", "evaluate", "fidelity",
              "generation", "iclca", "implicit", "interventions", "kernels", "linearize", "lm", "memory",
              "metrics", "names", "nn", "parallel", "precision", "prompt_file", "recovery", "reporting", "routing", "selection",
              "stats", "timing", "training", "verify")


def __getattr__(name: str):
    if name in SUBMODULES:
        module = importlib.import_module(f"linicl.{name}")
        globals()[name] = module  # later lookups skip this function
        return module
    raise AttributeError(f"module 'linicl' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(SUBMODULES))


__all__ = ["ModelConfig", "PRESETS", "preset", "Transformer", "generate", "LiniclError", "ConfigError",
           "NotExactError", "SequenceTooLongError", "DegenerateInputError", "BudgetError", "DataError", *SUBMODULES]
