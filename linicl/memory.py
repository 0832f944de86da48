"""What a stored prompt costs in memory: the floats a converted model holds for it.

A prompt stored by ``linicl.iclca.convert`` (exact, linear attention) or ``convert_approx`` (kernel
approximation, softmax attention) lives in the collections ``linicl.names.PROMPT_COLLECTIONS`` of the
variables dict; ``params`` are the model's and are not counted. ``iclca.state_floats(cfg)`` is the
exact conversion's count from the config alone; ``prompt_floats`` counts what a given variables dict
actually holds, for any conversion; ``kv_cache_floats`` is what a softmax model keeps for a prompt
instead (its KV cache), the baseline every stored state is compared with.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from linicl import names
from linicl.config import ModelConfig

# The PromptApprox field holding the seeded positive-random-feature projections ("prf" kernel).
_PROJECTIONS = "W"


def prompt_floats(variables: Mapping, *, projections: bool = True) -> int:
    """The number of floats stored for a prompt: every floating-point leaf of the prompt collections
    (``names.PROMPT_COLLECTIONS``: exact states S, z and any window, sink or sparse-cache buffers;
    approximate bias terms B, b; exact sink keys and values), for every row of a batch of prompts.
    Integer leaves (positions, offsets) are not floats.

    Args:
      variables: a variables dict (0 when it holds no prompt).
      projections: count the random projections ``W`` of a ``"prf"`` approximation. They are drawn
        from the conversion's seed, so ``projections=False`` counts only what could not be re-drawn.
    """
    if not isinstance(variables, Mapping):
        raise TypeError(f"prompt_floats: variables must be a variables dict, got {type(variables).__name__}")
    total = 0
    for collection in names.PROMPT_COLLECTIONS:
        leaves, _ = jax.tree_util.tree_flatten_with_path(variables.get(collection, {}))
        for path, leaf in leaves:
            if not projections and path and getattr(path[-1], "name", None) == _PROJECTIONS:
                continue
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            if jnp.issubdtype(dtype, jnp.floating):  # bfloat16 too
                total += int(np.size(leaf))
    return total


def kv_cache_floats(cfg: ModelConfig, n_tokens: int) -> int:
    """Floats of a softmax KV cache holding ``n_tokens`` prompt tokens, per prompt row: a key and a
    value of ``head_dim`` for every layer and key-value head, ``2 * n_layers * kv_heads * head_dim *
    n_tokens`` (grouped-query heads share theirs); a local layer (``ModelConfig.layer_types``) needs
    only the last ``sliding_window - 1`` of them."""
    n = int(n_tokens)
    kinds = cfg.layer_types or ("global",) * cfg.n_layers
    return 2 * cfg.kv_heads * cfg.head_dim * sum(min(n, cfg.sliding_window - 1) if kind == "local" else n
                                                 for kind in kinds)