"""Low-rank corrections of the attention projections (LoRA, Hu et al. arXiv 2106.09685): what stage 2
of linearization trains (linearization.md section 4; LoLCATs arXiv 2410.10254).

A projection's kernel (flax ``DenseGeneral``: its input axes, then its output axes) read as a matrix
``W: f[d_in, d_out]`` becomes

    W' = W + A B,   A: f[d_in, r],  B: f[r, d_out]

with ``q``, ``k``, ``v``: ``f[d_model, heads, d_head]`` (one input axis) and ``o``:
``f[heads, d_head, d_model]`` (two). ``B`` starts at zero, so a fresh correction changes nothing.

``apply`` merges the correction into an ordinary params tree: the corrected student is a zoo model like
any other (nothing in it knows about LoRA), so its attention state stays finite and
``iclca.convert`` stays exact on it. Only the merged weights are ever run.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl.errors import LiniclError
from linicl.names import scope_layer

TARGETS = ("q", "k", "v", "o")
_IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2}  # how many leading kernel axes are the input
_ATTN = "attn"


def _kernels(params: Mapping, targets: Sequence[str]):
    """``(scope, target, kernel)`` for every block's attention projection named in ``targets``."""
    for scope in sorted(params, key=lambda s: (scope_layer(s) is None, scope_layer(s) or 0, s)):
        if scope_layer(scope) is None:
            continue
        attn = params[scope].get(_ATTN, {})
        for t in targets:
            if t not in attn or "kernel" not in attn[t]:
                raise LiniclError(f"lora: block {scope} has no attention projection {t!r} with a kernel")
            yield scope, t, attn[t]["kernel"]


def _check_targets(targets) -> tuple:
    targets = tuple(targets)
    bad = [t for t in targets if t not in TARGETS]
    if not targets or bad or len(set(targets)) != len(targets):
        raise LiniclError(f"lora targets must be distinct names among {TARGETS}, got {targets!r}")
    return targets


def init(params: Mapping, *, rank: int = 8, seed: int = 0, targets: Sequence[str] = TARGETS) -> dict:
    """A fresh correction for ``params`` (a zoo model's params): ``{scope: {target: {"A", "B"}}}`` with
    ``A ~ N(0, 1/d_in)`` and ``B = 0`` (so ``apply`` returns ``params`` unchanged), in the kernels'
    dtype."""
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
        raise LiniclError(f"lora rank must be a positive int, got {rank!r}")
    targets = _check_targets(targets)
    out: dict = {}
    key = jax.random.PRNGKey(seed)
    found = False
    for scope, t, W in _kernels(params, targets):
        found = True
        n_in = _IN_AXES[t]
        d_in, d_out = int(np.prod(W.shape[:n_in])), int(np.prod(W.shape[n_in:]))
        key, sub = jax.random.split(key)
        A = jax.random.normal(sub, (d_in, rank), W.dtype) / np.sqrt(d_in)
        out.setdefault(scope, {}).setdefault(_ATTN, {})[t] = {"A": A, "B": jnp.zeros((rank, d_out), W.dtype)}
    if not found:
        raise LiniclError("lora.init: params has no blocks (expected scopes 'layers_0', ...)")
    return out


def rank_of(lora: Mapping) -> int:
    """The rank ``r`` of a correction made by ``init``."""
    for scope in lora.values():
        for factors in scope[_ATTN].values():
            return int(factors["A"].shape[1])
    raise LiniclError("lora: an empty correction")


def apply(params: Mapping, lora: Mapping) -> dict:
    """``params`` with every corrected kernel replaced by ``W + A B`` (reshaped to the kernel's shape).
    Differentiable in ``lora``; the rest of ``params`` is returned as is."""
    out = dict(params)
    for scope, by_target in lora.items():
        if scope not in params or _ATTN not in params[scope]:
            raise LiniclError(f"lora.apply: the correction names block {scope!r}, which params does not have")
        attn = dict(params[scope][_ATTN])
        for t, f in by_target[_ATTN].items():
            W = attn[t]["kernel"]
            delta = (f["A"] @ f["B"]).astype(W.dtype)
            if delta.size != W.size:
                raise LiniclError(f"lora.apply: the correction of {scope}/{t} has {f['A'].shape[0]} x "
                                  f"{f['B'].shape[1]} entries, its kernel has shape {W.shape}")
            attn[t] = {**attn[t], "kernel": W + delta.reshape(W.shape)}
        out[scope] = {**params[scope], _ATTN: attn}
    return out


__all__ = ["TARGETS", "init", "apply", "rank_of"]
