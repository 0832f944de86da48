"""Mixed precision for the training loops: the model runs in a compute dtype (e.g. bfloat16) while the
trained weights and the optimiser's state stay in their own (float32 "master" weights).

    model_c, cast = in_compute_dtype(model, "bfloat16")
    logits = model_c.apply({"params": cast(params)}, tokens)   # bf16 matmuls; grads flow back to params

Used by ``linicl.linearize.train_maps`` / ``train_lora`` and ``linicl.routing.train_router``
(``compute_dtype=``). The cast is differentiable (``astype``), so gradients reach the master weights in
their own dtype; losses should be computed in float32 (the loops do).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from linicl.errors import LiniclError
from linicl.names import DTYPES


def in_compute_dtype(model, compute_dtype: Optional[str]) -> Tuple[object, Callable]:
    """``(model, cast)``: the zoo model as it runs each step (its config's dtype replaced by
    ``compute_dtype``), and the cast of a pytree's float leaves to that dtype (integer leaves kept).
    Without ``compute_dtype``: the model itself and the identity. A dtype outside ``names.DTYPES`` is
    refused, naming the argument."""
    if compute_dtype is None:
        return model, lambda tree: tree
    if compute_dtype not in DTYPES:
        raise LiniclError(f"compute_dtype must be None or one of {DTYPES}, got {compute_dtype!r}")
    run = model.clone(cfg=model.cfg.replace(dtype=compute_dtype))
    dt = jnp.dtype(compute_dtype)

    def cast(tree):
        return jax.tree_util.tree_map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
    return run, cast
