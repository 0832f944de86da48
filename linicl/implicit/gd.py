"""Dherin's implicit gradient descent: the update of one block as the context is read token by token.

With the query x fixed and C_i = [c_1..c_i], W_i = W + ΔW(C_i) (C_0 = ∅). Each step adds
W(g(C_i, x) - g(C_{i-1}, x)) fᵀ/‖f‖² = -h ∇_W L_i(W_{i-1}) for the linear loss
L_i(W) = trace(Δ_iᵀ W), Δ_i = W (g_{i-1} - g_i) fᵀ, with learning rate h = 1/‖f‖²; the steps telescope
to ΔW(C). ``subcontext`` is the same identity for any sub-context Y ⊂ C (Theorem 2.2).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import compiled
from linicl._validate import check_index, check_indices, is_concrete
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.implicit.blocks import Pieces, alone, block_sites, check_position
from linicl.implicit.operators import Update, first_matrices, update
from linicl.nn.hooks import Edit


def _sites_of(cfg: ModelConfig):
    """``block_sites`` of this config, jitted (one compiled function per config and shape)."""
    return compiled.get(("implicit.block_sites", cfg), lambda: jax.jit(functools.partial(block_sites, cfg)))


def subcontext(cfg: ModelConfig, block_params, Z, Y: Sequence[int]):
    """Dherin's ΔW(Y) for Y ⊂ C: the block on [C∖Y, x] patched with it gives, at x, the block on
    [C, x] (Theorem 2.2 with the reference A(C∖Y, x); plus Δb' for forms with a residual).

    ``Z: f[n + 1, d]`` = [C; x] (concrete), ``Y``: indices into C. Returns ``(pieces, rest)``:
    ``pieces`` for the last position (g, q from [C, x]; f, p from ``rest`` = [C∖Y; x] at its last
    position; shapes ``f[1, d]``) and ``rest: f[n + 1 - |Y|, d]``."""
    Z = np.asarray(Z)
    if Z.ndim != 2 or Z.shape[0] < 1:
        raise LiniclError(f"Z must be f[n + 1, d] = [C; x] (concrete, one task), got shape {Z.shape}")
    n = Z.shape[0] - 1
    if isinstance(Y, (set, frozenset, range)):
        Y = list(Y)
    elif isinstance(Y, (int, np.integer)) and not isinstance(Y, bool):
        Y = [Y]
    # A set: repeats are harmless; floats and bool masks are refused (astype would truncate them).
    Y = check_indices("Y", Y, None, 0, n, f"the context C ({n} tokens)")
    Y = np.unique(np.asarray(Y, dtype=np.int64))
    keep = np.setdiff1d(np.arange(n + 1), Y)
    rest = jnp.asarray(Z[keep])
    sites = _sites_of(cfg)
    ctx, sub = sites(block_params, jnp.asarray(Z)), sites(block_params, rest)
    pcs = Pieces(ctx["hook_mlp_in"][-1:], ctx["hook_resid_mid"][-1:], sub["hook_mlp_in"][-1:],
                 sub["hook_resid_mid"][-1:], ctx["hook_resid_post"][-1:], rest[-1:])
    return pcs, rest


class Trajectory(NamedTuple):
    """The implicit gradient descent of one block as the context C = [c_1..c_n] is read with the query
    x fixed: W_i = W + ΔW(C_i), i = 0..n (C_0 = ∅). Shapes for one task; h = learning rate."""

    g: jax.Array        # f[n + 1, d]  g(C_i, x): MLP input of the block on [C_i, x] at x
    q: jax.Array        # f[n + 1, d]
    out: jax.Array      # f[n + 1, d]  block output on [C_i, x] at x
    update: Update      # u[name] f[n + 1, h] = W(g_i - f), v f[1, d], delta_b f[n + 1, d]
    lr: jax.Array       # f[]  h = 1/‖f‖² (1/‖A(x)‖² for the plain block)
    step_u: dict        # {name: f[n, h]}  W(g_i - g_{i-1}): ΔW(C_i) - ΔW(C_{i-1}) = step_u_i vᵀ
    step_norms: jax.Array  # f[n]  ‖ΔW(C_i) - ΔW(C_{i-1})‖_F


def _check_order(order, n: int):
    """``order`` must be a permutation of 0..n-1 (``int[n]``, each index once). Concrete: checked here.
    Traced: returns a flag; the trajectory is NaN where it is False (jnp indexing would clamp an index
    past n, and a repeated index reads a wrong context: finite, wrong results)."""
    what = f"the context C once each (a permutation of 0..{n - 1})"
    order = check_indices("order", order, n, 0, n, what)
    if not is_concrete(order):
        return order, jnp.all(jnp.sort(order) == jnp.arange(n))
    seen, counts = np.unique(np.asarray(order), return_counts=True)
    if np.any(counts > 1):
        raise LiniclError(f"order must index {what}; it repeats {seen[counts > 1].tolist()} "
                          f"(and so misses {np.setdiff1d(np.arange(n), seen).tolist()})")
    return order, None


def _prefix_batch(Z, order):
    """Row i = [c_1..c_i, x, c_{i+1}..c_n]: causally, x at position i sees exactly [C_i, x]."""
    n = Z.shape[0] - 1
    C = Z[:-1]
    if order is not None:
        order, ok = _check_order(order, n)
        C = C[jnp.asarray(order, jnp.int32)]
        if ok is not None:
            C = jnp.where(ok, C, jnp.nan)
    rows = jnp.arange(n + 1)[:, None]
    t = jnp.arange(n + 1)[None, :]
    idx = jnp.where(t < rows, t, jnp.where(t == rows, n, t - 1))
    return jnp.concatenate([C, Z[-1:]])[idx]  # [n + 1, n + 1, d]


def trajectory(cfg: ModelConfig, block_params, Z, *, order=None, position=0,
               chunk: Optional[int] = None) -> Trajectory:
    """The implicit-GD trajectory of one block for ``Z: f[n + 1, d]`` = [C; x] (pure; vmap for tasks).

    ``order``: read the context in this order, ``int[n]``, a permutation of 0..n-1 (each index once;
    under ``jit`` a traced order that is not one makes the whole trajectory NaN). ``position``: the
    position of x run alone, an int in [0, max_len). ``chunk``: prefixes per batch (memory
    O(chunk · n · d) instead of O(n² · d); default: all at once). Non-causal attention hides the
    tokens after x with an attention-logit mask.
    """
    Z = jnp.asarray(Z)
    if Z.ndim != 2 or Z.shape[0] < 1:
        raise LiniclError(f"Z must be f[n + 1, d] = [C; x] (one task: vmap for many), got shape {Z.shape}")
    check_position(cfg, position)
    if chunk is not None and (not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1):
        raise LiniclError(f"chunk must be None or a positive int (prefixes per batch), got {chunk!r}")
    n = Z.shape[0] - 1
    S = _prefix_batch(Z, order)

    def prefix(row_and_i):
        row, i = row_and_i
        edits = None
        if not cfg.causal:  # row i puts x at position i: the keys after it are C's unread tokens
            hidden = jnp.where(jnp.arange(n + 1) > i, -jnp.inf, 0.0).astype(Z.dtype)
            edits = {"attn": {"hook_attn_scores": (Edit(hidden[None, None, None, :]),)}}
        s = block_sites(cfg, block_params, row, interventions=edits)
        return s["hook_mlp_in"][i], s["hook_resid_mid"][i], s["hook_resid_post"][i]

    rows = (S, jnp.arange(n + 1))
    g, q, out = jax.vmap(prefix)(rows) if chunk is None else jax.lax.map(prefix, rows, batch_size=chunk)
    ref = alone(cfg, block_params, Z[-1], position)
    f, p = ref["hook_mlp_in"][None], ref["hook_resid_mid"][None]
    upd = update(cfg, block_params, Pieces(g, q, f, p, out, Z[-1:]), "implicit.trajectory")
    step_u = {k: jnp.diff(u, axis=0) for k, u in upd.u.items()}
    step_norms = jnp.sqrt(sum(jnp.sum(s * s, axis=-1) for s in step_u.values())) * jnp.linalg.norm(upd.v)
    nf = jnp.linalg.norm(f)
    return Trajectory(g, q, out, upd, 1 / (nf * nf), step_u, step_norms)


def gradient(cfg: ModelConfig, block_params, traj: Trajectory, i: int) -> dict:
    """Δ_i = W (g_{i-1} - g_i) fᵀ for step i in 1..n, ``{name: f[h, d]}``: the (constant) gradient of
    ``gd_loss(W, Δ_i)``. f is recovered from v = f/‖f‖² as v/h. A traced ``i`` outside 1..n gives NaN
    (i = 0 would wrap to g_n - g_0, and jnp indexing clamps i > n)."""
    n = traj.g.shape[0] - 1
    check_index("i", i, 1, n + 1, f"a step 1..{n} of the trajectory")
    f = traj.update.v[0] / traj.lr
    ok = (i >= 1) & (i <= n)
    return {k: jnp.where(ok, jnp.outer(W @ (traj.g[i - 1] - traj.g[i]), f), jnp.nan)
            for k, W in first_matrices(cfg, block_params).items()}


def gd_loss(W, Delta) -> jax.Array:
    """Dherin's per-token loss L_i(W) = trace(Δ_iᵀ W)."""
    return jnp.sum(Delta * W)
