"""The implicit update of one block: the rank-1 ΔW of its first MLP matrices and the bias shift Δb'.

For position i, with g_i, q_i from the block with context and f, p from the reference run alone::

    ΔW_i  = W (g_i - f) fᵀ / ‖f‖²  = u_i v_iᵀ,   u_i = W (g_i - f): f[h],   v_i = f / ‖f‖²: f[d]
    Δb'_i = q_i - p

``update`` keeps ΔW factored (``Update``: ``u[name]: f[..., T, h]``, ``v: f[..., 1 or T, d]``);
``dense`` builds the ``[..., T, h, d]`` matrices only on request. ``patch`` writes one position's
update into the block params and ``implied`` runs the patched block on the reference alone, which
gives the block's with-context output.

No epsilon: where ‖f‖ is too small to divide by (``degenerate``) an eager call raises
``DegenerateInputError``; under ``jit``/``vmap`` those updates are NaN and ``checkify`` reports why.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from linicl._validate import check_index, is_concrete
from linicl.config import ModelConfig
from linicl.errors import DegenerateInputError, LiniclError
from linicl.implicit.blocks import Pieces, alone


def first_matrices(cfg: ModelConfig, block_params) -> dict:
    """The MLP matrices that read f, in the papers' orientation ``W: f[h, d]`` (``fc_in.kernel.T``,
    and ``fc_gate.kernel.T`` for a gated MLP)."""
    mlp = block_params["mlp"]
    layers = ("fc_in", "fc_gate") if cfg.mlp == "gated" else ("fc_in",)
    return {n: mlp[n]["kernel"].T for n in layers}


def degenerate(g, f) -> jax.Array:
    """``bool[...]``: where ‖f‖ is too small to divide by, for each g (``f[..., d]`` broadcast).

    The update's entries grow like ‖g - f‖/‖f‖, and f itself carries an absolute rounding error of
    about eps times the scale of the values it is computed from (‖g‖ is that scale); the patched
    model's error is amplified by about ‖g‖/‖f‖. We refuse ‖f‖ <= sqrt(eps)·‖g‖ (at most half the
    significant digits lost; float64: 1.5e-8, float32: 3.5e-4), ‖f‖² below the smallest normal
    number (1/‖f‖² would lose precision), and non-finite f.
    """
    dtype = jnp.result_type(f)
    nf, ng = jnp.linalg.norm(f, axis=-1), jnp.linalg.norm(g, axis=-1)
    tau = jnp.sqrt(jnp.finfo(dtype).eps)
    ok = (nf > tau * ng) & (nf * nf >= jnp.finfo(dtype).tiny) & jnp.isfinite(nf)
    return ~ok


def factors(W, g, f):
    """ΔW = W (g - f) fᵀ / ‖f‖² as ``(u, v)``: ``u = W(g - f): f[..., h]``, ``v = f/‖f‖²: f[..., d]``
    (no epsilon: check ``degenerate`` first). ``W: f[h, d]``, g and f broadcast."""
    u = (g - f) @ W.T
    nf = jnp.linalg.norm(f, axis=-1, keepdims=True)
    return u, (f / nf) / nf  # f/‖f‖ first: no underflow of ‖f‖² for tiny f


def delta_b(q, p) -> jax.Array:
    """The last-MLP-bias shift ``f[..., d]``: q - p."""
    return q - p


class Update(NamedTuple):
    """Factored updates of one block: ΔW_i[name] = u[name]_i v_iᵀ, Δb'_i = delta_b_i."""

    u: dict            # {"fc_in": f[..., T, h], ("fc_gate": ...)}
    v: jax.Array       # f[..., 1 or T, d]
    delta_b: jax.Array  # f[..., T, d]

    def at(self, i) -> "Update":
        """The update of position ``i`` in [-T, T) (position axis removed; a traced ``i`` out of
        range gives NaN, never another position's update)."""
        T = self.delta_b.shape[-2]
        check_index("i", i, -T, T, f"the {T} positions of the update")
        take = functools.partial(jnp.take, indices=i, axis=-2, mode="fill", fill_value=jnp.nan)
        v = self.v[..., 0, :] if self.v.shape[-2] == 1 else take(self.v)
        return Update({k: take(a) for k, a in self.u.items()}, v, take(self.delta_b))


def check_defined(flags, what: str) -> None:
    """Raise DegenerateInputError where a concrete ``flags`` (``degenerate``) is True; under tracing,
    register a ``checkify`` debug check (the updates themselves are NaN there)."""
    message = (f"{what}: ‖f‖ (the reference MLP input) is too small to divide by "
               f"(‖f‖ <= sqrt(eps)·‖g‖, or not finite); ΔW = W(g - f)fᵀ/‖f‖² is undefined and no "
               f"epsilon is added. For the plain and Dherin blocks f is the attention output A(x) of "
               f"the token alone; with a norm, f is a normalised vector whose scale and bias vanish")
    if is_concrete(flags):
        bad = np.argwhere(np.asarray(flags))
        if bad.size:
            raise DegenerateInputError(f"{message} (at indices {bad[:8].tolist()}"
                                       f"{'...' if len(bad) > 8 else ''})")
    else:
        checkify.debug_check(~jnp.any(flags), message)


def update(cfg: ModelConfig, block_params, pcs: Pieces, what: str = "implicit.update") -> Update:
    """The factored ΔW_i (every first matrix) and Δb'_i of one block from its ``Pieces``."""
    bad = degenerate(pcs.g, pcs.f)
    check_defined(bad, what)
    u = {}
    for name, W in first_matrices(cfg, block_params).items():
        u_name, v = factors(W, pcs.g, pcs.f)
        u[name] = jnp.where(bad[..., None], jnp.nan, u_name)  # NaN, never a finite wrong answer
    return Update(u, v, delta_b(pcs.q, pcs.p))


def dense(upd: Update) -> dict:
    """Materialise ``{name: ΔW f[..., T, h, d]}`` (only when the matrices themselves are needed)."""
    return {k: u[..., :, None] * upd.v[..., None, :] for k, u in upd.u.items()}


def has_bias_shift(cfg: ModelConfig) -> bool:
    """False only for Dherin's plain block (q = p = 0: the whole context effect goes into W)."""
    return not (cfg.norm == "none" and cfg.skip == "none")


def patch(cfg: ModelConfig, block_params, upd: Update):
    """Block params with ``upd`` (one position: ``u[name]: f[h]``, ``v: f[d]``, ``delta_b: f[d]``)
    applied: each first-matrix kernel (Wᵀ) += v uᵀ, ``fc_out.bias`` += Δb'. Nothing else changes."""
    mlp = dict(block_params["mlp"])
    for name, u in upd.u.items():
        mlp[name] = {**mlp[name], "kernel": mlp[name]["kernel"] + upd.v[:, None] * u[None, :]}
    if has_bias_shift(cfg):
        if "bias" not in mlp["fc_out"]:
            raise LiniclError("the implicit update shifts the last MLP bias, but this model has none: "
                              "use ModelConfig(mlp_bias=True) (a zero bias is the same model)")
        mlp["fc_out"] = {**mlp["fc_out"], "bias": mlp["fc_out"]["bias"] + upd.delta_b}
    return {**block_params, "mlp": mlp}


def implied(cfg: ModelConfig, block_params, upd: Update, x, position=0) -> jax.Array:
    """The implicit model: the block patched for each position i, run on its reference token alone.

    ``upd`` has a position axis (``u: f[..., T, h]``), ``x: f[..., 1 or T, d]`` (``Pieces.x``) ->
    ``f[..., T, d]``, which equals ``Pieces.out`` (the block with context)."""
    T = upd.delta_b.shape[-2]
    lead = upd.delta_b.shape[:-2]
    x = jnp.broadcast_to(x, lead + (T, x.shape[-1]))
    v = jnp.broadcast_to(upd.v, lead + (T, upd.v.shape[-1]))

    def one(u, v, db, xi):
        patched = patch(cfg, block_params, Update(u, v, db))
        return alone(cfg, patched, xi, position)["hook_resid_post"]

    def flat(a):  # [..., T, k] -> [n, k]: one vmap over tasks and positions together
        return a.reshape((-1,) + a.shape[len(lead) + 1:])
    out = jax.vmap(one)({k: flat(u) for k, u in upd.u.items()}, flat(v), flat(upd.delta_b), flat(x))
    return out.reshape(lead + (T, out.shape[-1]))
