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


def _integer_dtype(value) -> bool:
    """Whether ``value`` holds integers: a Python or NumPy int, or an integer array (never a bool)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.integer)


def check_index(name: str, value, lo: int, hi: int, what: str):
    """``value`` must be one integer in [lo, hi) that indexes ``what`` (a noun phrase for the message):
    a Python or NumPy int or an integer 0-d array.

    A float (even 2.0) or a bool is refused: jnp indexing and ``astype(int32)`` would truncate or
    clamp it into a valid-looking index. A traced value is checked for dtype and shape only (its
    range is the caller's business under ``jit``: NaN, never a finite wrong answer). Returns it."""
    if not _integer_dtype(value) or getattr(value, "ndim", 0) != 0:
        raise LiniclError(f"{name} must be one int indexing {what}, got {value!r}")
    if is_concrete(value):
        i = int(value)
        if not lo <= i < hi:
            raise LiniclError(f"{name} must index {what}: an int in [{lo}, {hi}), got {i}")
    return value


def check_indices(name: str, value, length, lo: int, hi: int, what: str):
    """``value`` must be ``int[length]`` (``length=None``: any length) with entries in [lo, hi) that
    index ``what``; floats and bools are refused (a bool mask is not a list of indices). Entries are
    checked only when concrete. Returns it as an array."""
    try:
        arr = value if isinstance(value, (np.ndarray, jax.Array)) else np.asarray(value)
    except (TypeError, ValueError):  # ragged nesting, objects
        raise LiniclError(f"{name} must be a 1-d list of ints indexing {what}, got {value!r}") from None
    if arr.ndim != 1 or (length is not None and arr.shape[0] != length):
        want = f"int[{length}]" if length is not None else "a 1-d list of ints"
        raise LiniclError(f"{name} must be {want} indexing {what}, got shape {tuple(arr.shape)}")
    if arr.size and not _integer_dtype(arr):
        raise LiniclError(f"{name} must hold ints indexing {what}, got dtype {arr.dtype}")
    if arr.size and is_concrete(arr):
        a = np.asarray(arr)
        if a.min() < lo or a.max() >= hi:
            bad = sorted(set(a[(a < lo) | (a >= hi)].tolist()))
            raise LiniclError(f"{name} must index {what}: entries in [{lo}, {hi}), got {bad[:8]}"
                              f"{'...' if len(bad) > 8 else ''} in {a.tolist()[:16]}"
                              f"{'...' if a.size > 16 else ''}")
    return arr
