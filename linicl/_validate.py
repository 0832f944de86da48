"""Eager input checks shared by the modules: clear errors naming the argument, before any tracing.

Checks that need values (token ranges) run only on concrete arrays; under ``jit`` the model turns
an out-of-range token or position into NaN instead (never a silently wrong finite answer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linicl.errors import LiniclError


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_tokens(name: str, tokens, vocab_size: int):
    """``tokens`` must be ``int[batch, seq]`` with batch, seq >= 1 and ids in [0, vocab_size)."""
    shape = getattr(tokens, "shape", None)
    if shape is None:
        raise LiniclError(f"{name} must be an int32[batch, seq] array, got {type(tokens).__name__}")
    if len(shape) != 2:
        raise LiniclError(f"{name} must be int32[batch, seq], got shape {tuple(shape)}"
                          + (" (add a batch axis: x[None])" if len(shape) == 1 else ""))
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise LiniclError(f"{name} must have an integer dtype (token ids), got {tokens.dtype}")
    if shape[0] < 1 or shape[1] < 1:
        raise LiniclError(f"{name} must have at least one row and one token, got shape {tuple(shape)}")
    if is_concrete(tokens) and shape[0] * shape[1]:
        arr = np.asarray(tokens)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            raise LiniclError(f"{name} holds token ids in [{lo}, {hi}], outside the vocabulary "
                              f"[0, {vocab_size})")
    return tokens


def check_fits(name: str, start, length: int, max_len: int, what: str):
    """Raise if positions start .. start + length - 1 do not fit below max_len (when start is known)."""
    from linicl.errors import SequenceTooLongError
    if is_concrete(start):
        end = int(np.asarray(start)) + length
        if end > max_len:
            raise SequenceTooLongError(
                f"{name}: {what} would reach position {end - 1}, past the model's max_len={max_len} "
                f"(start {end - length} + {length} tokens)")


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` along axis 0, with NaN rows for ids outside [0, len(table)) (negatives too)."""
    ids = jnp.where(ids < 0, table.shape[0], ids)
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
