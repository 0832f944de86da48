"""Implicit weight updates: context as a rank-1 change of the first MLP matrix plus an MLP-bias shift.

Dherin et al. (arXiv 2507.16003) and Innocenti & Achour (arXiv 2512.11255): a block run with context
equals the same block run on one token alone with its first MLP matrix W changed by a rank-1 ΔW and
its last MLP bias b' shifted by Δb'. For block ℓ, with the inputs ``Z`` it receives in the
full-context forward pass, and for every position i::

    g_i = MLP input at position i with context         (site hook_mlp_in)
    q_i = residual the MLP output is added to, at i    (site hook_resid_mid; 0 for the plain block)
    f, p = the same two values for the reference token run through the block *alone*
    ΔW_i  = W (g_i - f) fᵀ / ‖f‖²        (rank 1; W is h×d, the paper's orientation)
    Δb'_i = q_i - p

    block_{W + ΔW_i, b' + Δb'_i}(reference alone) == block_W(Z)[i]

because (W + ΔW_i) f = W g_i, after which the MLP sees what it saw with context, and the residual
gets q_i. This holds for every block form of the zoo (``plain`` = norm none / skip none, Dherin's skip,
residual, pre-LN, post-LN, LayerNorm or RMSNorm) and for gated MLPs, whose two first matrices
``fc_in`` and ``fc_gate`` both read f and get one rank-1 update each (with the same right factor, so
the stacked [W_in; W_gate] change is rank 1 too).

References ("who is run alone"):

* ``"query"`` (the papers'): the block's last input x = Z[-1], one f for all positions. All ΔW_i then
  share the right factor f/‖f‖², so the stacked [ΔW_1; ...; ΔW_N] has rank 1.
* ``"own"``: each position's own input z_i, one f_i per position (the natural one for chaining).

A token alone is placed at ``position`` (default 0). A block run on one token does not depend on the
position: rope rotates its query and key alike, decay never acts, and learned positions are added
before the first block (``convert`` places the query where ``model.apply`` does).

Shapes: ``Z, g, q: f[..., T, d]``; with the ``"query"`` reference ``f, p: f[..., 1, d]`` (broadcast over
positions), with ``"own"`` ``f[..., T, d]``. Updates are kept factored: ``u[name]: f[..., T, h]`` =
W(g - f) and ``v: f[..., 1 or T, d]`` = f/‖f‖², so ΔW_i = u_i v_iᵀ; ``dense`` builds the
``[..., T, h, d]`` matrices only when asked.

No epsilon anywhere: when ‖f‖ is too small for the division (``degenerate``) an eager call raises
``DegenerateInputError``; under ``jit``/``vmap`` the affected updates are NaN (never a finite wrong
answer) and ``jax.experimental.checkify.checkify`` reports the message.
"""

from __future__ import annotations

import functools
from typing import Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from linicl._validate import check_tokens, is_concrete
from linicl.config import ModelConfig
from linicl.errors import DegenerateInputError, LiniclError, NotExactError
from linicl.interventions import capture
from linicl.kernels import feature_maps
from linicl.nn.attention import ICLCA
from linicl.nn.block import Block
from linicl.nn.hooks import INTERMEDIATES, INTERVENTIONS, Edit
from linicl.nn.transformer import config_of

REFERENCES = ("query", "own")
BLOCK_SITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out",
               "hook_resid_post")


# ------------------------------------------------------------------------------------- block runs
def _block_call(cfg: ModelConfig, block_params, Z, positions, interventions=None) -> dict:
    """Block on ``Z: f[batch, T, d]``: its output and every site it sows (one pass, the zoo's code)."""
    variables = {"params": block_params}
    if interventions:
        variables[INTERVENTIONS] = interventions
    out, state = Block(cfg).apply(variables, Z, positions, mutable=[INTERMEDIATES])
    sown = state[INTERMEDIATES]
    sites = {name: sown[name][-1] for name in BLOCK_SITES}
    sites["hook_q"] = sown["attn"]["hook_q"][-1]
    sites["hook_resid_post"] = out
    return sites


def block_sites(cfg: ModelConfig, block_params, Z, positions=None, interventions=None) -> dict:
    """Sites of one block run on ``Z: f[..., T, d]`` (leading axes: tasks), each ``f[..., T, d]``
    (``hook_q``: ``f[..., T, heads, d_head]``). ``positions``: ``int[T]``, default 0..T-1."""
    Z = jnp.asarray(Z)
    lead, (T, d) = Z.shape[:-2], Z.shape[-2:]
    positions = jnp.arange(T, dtype=jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
    sites = _block_call(cfg, block_params, Z.reshape((-1, T, d)), positions, interventions)
    return {k: v.reshape(lead + v.shape[1:]) for k, v in sites.items()}


def alone(cfg: ModelConfig, block_params, x, position=0, interventions=None) -> dict:
    """Sites of the block run on each token of ``x: f[..., d]`` as a one-token sequence at
    ``position``: each ``f[..., d]`` (the reference values f = ``hook_mlp_in``, p = ``hook_resid_mid``)."""
    x = jnp.asarray(x)
    positions = jnp.reshape(jnp.asarray(position, jnp.int32), (1,))
    sites = _block_call(cfg, block_params, x.reshape((-1, 1, x.shape[-1])), positions, interventions)
    return {k: v[:, 0].reshape(x.shape[:-1] + v.shape[2:]) for k, v in sites.items()}


# ------------------------------------------------------------------------------------- the pieces
class Pieces(NamedTuple):
    """What the operators need from one block (see the module docstring for shapes)."""

    g: jax.Array    # f[..., T, d]  MLP input with context
    q: jax.Array    # f[..., T, d]  residual the MLP output is added to, with context
    f: jax.Array    # f[..., 1 or T, d]  MLP input of the reference alone
    p: jax.Array    # f[..., 1 or T, d]  residual of the reference alone
    out: jax.Array  # f[..., T, d]  block output with context (what the patched block must give)
    x: jax.Array    # f[..., 1 or T, d]  the reference tokens (block inputs)


def pieces(cfg: ModelConfig, block_params, Z, reference: str = "query", *, position=0,
           positions=None) -> Pieces:
    """g, q (block on ``Z: f[..., T, d]``) and f, p (the reference alone at ``position``)."""
    if reference not in REFERENCES:
        raise LiniclError(f"reference must be one of {REFERENCES}, got {reference!r}")
    Z = jnp.asarray(Z)
    ctx = block_sites(cfg, block_params, Z, positions)
    x = Z[..., -1:, :] if reference == "query" else Z
    ref = alone(cfg, block_params, x, position)
    return Pieces(ctx["hook_mlp_in"], ctx["hook_resid_mid"], ref["hook_mlp_in"], ref["hook_resid_mid"],
                  ctx["hook_resid_post"], x)


# ------------------------------------------------------------------------------------- operators
def first_matrices(cfg: ModelConfig, block_params) -> dict:
    """The MLP matrices that read f, in the papers' orientation ``W: f[h, d]`` (``fc_in.kernel.T``,
    and ``fc_gate.kernel.T`` for a gated MLP)."""
    mlp = block_params["mlp"]
    names = ("fc_in", "fc_gate") if cfg.mlp == "gated" else ("fc_in",)
    return {n: mlp[n]["kernel"].T for n in names}


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


def delta_W(W, g, f) -> jax.Array:
    """The rank-1 update ``f[..., h, d]`` of ``W: f[h, d]``: W (g - f) fᵀ / ‖f‖²."""
    u, v = factors(W, g, f)
    return u[..., :, None] * v[..., None, :]


def delta_b(q, p) -> jax.Array:
    """The last-MLP-bias shift ``f[..., d]``: q - p."""
    return q - p


class Update(NamedTuple):
    """Factored updates of one block: ΔW_i[name] = u[name]_i v_iᵀ, Δb'_i = delta_b_i."""

    u: dict            # {"fc_in": f[..., T, h], ("fc_gate": ...)}
    v: jax.Array       # f[..., 1 or T, d]
    delta_b: jax.Array  # f[..., T, d]

    def at(self, i) -> "Update":
        """The update of position ``i`` (position axis removed)."""
        take = functools.partial(jnp.take, indices=i, axis=-2)
        v = self.v[..., 0, :] if self.v.shape[-2] == 1 else take(self.v)
        return Update({k: take(a) for k, a in self.u.items()}, v, take(self.delta_b))


def _guard(flags, what: str) -> None:
    """Raise DegenerateInputError for a concrete True flag; under tracing, a checkify debug check."""
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
    _guard(bad, what)
    u = {}
    for name, W in first_matrices(cfg, block_params).items():
        u_name, v = factors(W, pcs.g, pcs.f)
        u[name] = jnp.where(bad[..., None], jnp.nan, u_name)
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
        layer = dict(mlp[name])
        layer["kernel"] = layer["kernel"] + upd.v[:, None] * u[None, :]
        mlp[name] = layer
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
        p = patch(cfg, block_params, Update(u, v, db))
        return alone(cfg, p, xi, position)["hook_resid_post"]

    flat = lambda a: a.reshape((-1,) + a.shape[len(lead) + 1:])  # noqa: E731  [..., T, k] -> [n, k]
    out = jax.vmap(one)({k: flat(u) for k, u in upd.u.items()}, flat(v), flat(upd.delta_b), flat(x))
    return out.reshape(lead + (T, out.shape[-1]))


def vector_edits(pcs: Pieces, i) -> dict:
    """The vector form of the same patch, as a Block's ``interventions`` tree: add g_i - f at the MLP
    input and Δb'_i at the MLP output (``(W + ΔW) f = W (f + g - f)``). Unbatched pieces."""
    f = pcs.f[0] if pcs.f.shape[0] == 1 else pcs.f[i]
    p = pcs.p[0] if pcs.p.shape[0] == 1 else pcs.p[i]
    return {"hook_mlp_in": (Edit(pcs.g[i] - f),), "hook_mlp_out": (Edit(pcs.q[i] - p),)}


# ------------------------------------------------------------------------------------- metrics
def frobenius(upd: Update) -> jax.Array:
    """‖ΔW_i‖_F over every first matrix, ``f[..., T]`` (a rank-1 matrix: also its spectral norm)."""
    u2 = sum(jnp.sum(u * u, axis=-1) for u in upd.u.values())
    return jnp.sqrt(u2) * jnp.linalg.norm(upd.v, axis=-1)


def alignment(upd: Update) -> jax.Array:
    """DA(ΔW_i, ΔW_j) = ⟨ΔW_i, ΔW_j⟩_F / (‖ΔW_i‖_F ‖ΔW_j‖_F) for all pairs, ``f[..., T, T]``
    (Innocenti & Achour Eq. 36), from the factors: ⟨u_i v_iᵀ, u_j v_jᵀ⟩ = (u_i·u_j)(v_i·v_j). NaN
    where an update is zero (e.g. a causal first token with its own reference: no context)."""
    uu = sum(jnp.einsum("...ih,...jh->...ij", u, u) for u in upd.u.values())
    inner = uu * jnp.einsum("...id,...jd->...ij", upd.v, upd.v)
    n = frobenius(upd)
    return inner / (n[..., :, None] * n[..., None, :])


def msd(a, b) -> jax.Array:
    """Mean squared difference over every element (Innocenti & Achour Eq. 35)."""
    return jnp.mean(jnp.square(jnp.asarray(a) - jnp.asarray(b)))


# ------------------------------------------------------------------------------------- model level
def _layers(cfg: ModelConfig, params) -> list:
    return [params[f"layers_{l}"] for l in range(cfg.n_layers)]


def stack_blocks(cfg: ModelConfig, params):
    """Every block's params stacked on a leading layer axis (to ``vmap`` one block over layers)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *_layers(cfg, params))


def capture_blocks(model, variables, tokens=None, *, embeds=None,
                   names=("hook_resid_pre", "hook_mlp_in", "hook_resid_mid", "hook_resid_post")) -> dict:
    """One forward pass; ``{site: f[layers, batch, T, d]}`` for the named per-block sites."""
    cfg = config_of(model)
    full = [f"blocks.{l}.{n}" for l in range(cfg.n_layers) for n in names]
    _, acts = capture(model, variables, tokens, names=full, embeds=embeds, hidden=True)
    return {n: jnp.stack([acts[f"blocks.{l}.{n}"] for l in range(cfg.n_layers)]) for n in names}


class ModelUpdates(NamedTuple):
    pieces: Pieces  # each with a leading layer axis: g f[L, B, T, d], f f[L, B, 1 or T, d], ...
    update: Update  # u[name] f[L, B, T, h], v f[L, B, 1 or T, d], delta_b f[L, B, T, d]


def updates(model, variables, tokens=None, *, embeds=None, reference: str = "query") -> ModelUpdates:
    """Every block's updates at every position for a batch, from one forward pass (pure: jit it).

    Block ℓ is taken with the inputs Z_ℓ it receives in the full-context pass; its reference is
    Z_ℓ[-1] (``"query"``, Innocenti & Achour Eq. 6) or each token's own input (``"own"``). All blocks'
    reference runs are one call (the block vmapped over stacked layer params). Nothing of size
    [layers, batch, T, h, d] is built (``dense`` does that on request).
    """
    if reference not in REFERENCES:
        raise LiniclError(f"reference must be one of {REFERENCES}, got {reference!r}")
    cfg = config_of(model)
    acts = capture_blocks(model, variables, tokens, embeds=embeds)
    Z = acts["hook_resid_pre"]
    X = Z[:, :, -1:] if reference == "query" else Z
    stacked = stack_blocks(cfg, variables["params"])
    ref = jax.vmap(lambda bp, x: alone(cfg, bp, x))(stacked, X)
    pcs = Pieces(acts["hook_mlp_in"], acts["hook_resid_mid"], ref["hook_mlp_in"], ref["hook_resid_mid"],
                 acts["hook_resid_post"], X)
    upd = jax.vmap(lambda bp, pc: update(cfg, bp, pc, "implicit.updates"))(stacked, pcs)
    return ModelUpdates(pcs, upd)


def implied_all(model, variables, mu: ModelUpdates) -> jax.Array:
    """The implicit model of every block and position, ``f[L, B, T, d]`` (= ``mu.pieces.out``)."""
    cfg = config_of(model)
    return jax.vmap(lambda bp, u, x: implied(cfg, bp, u, x))(stack_blocks(cfg, variables["params"]),
                                                            mu.update, mu.pieces.x)


# ------------------------------------------------------------------------------------- conversion
def _check_variables(variables) -> None:
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise LiniclError("variables must be the dict returned by model.init (with a 'params' entry)")
    extra = set(variables) - {"params", ICLCA}
    stored = set(variables.get(ICLCA, {})) - {"offset"}
    if extra or stored:
        raise LiniclError(f"variables hold {sorted(extra | stored)} besides params: implicit.convert "
                          f"needs the plain model (strip a stored prompt state with iclca.strip, and "
                          f"pass edits after converting)")


def _inputs(cfg: ModelConfig, context, query):
    """(full, query, embeds?) as batch-1 arrays, with errors that name the argument."""
    context, query = jnp.asarray(context), jnp.asarray(query)
    floats = [jnp.issubdtype(a.dtype, jnp.floating) for a in (context, query)]
    if floats[0] != floats[1] and context.size:
        raise LiniclError(f"context and query must both be tokens or both embeddings; context is "
                          f"{context.dtype}, query {query.dtype}")
    if floats[1]:
        for name, a, n in (("context", context, None), ("query", query, 1)):
            if a.ndim != 2 or a.shape[1] != cfg.d_model or (n is not None and a.shape[0] != n):
                raise LiniclError(f"{name} as embeddings must be float[{n or 'n'}, {cfg.d_model}] "
                                  f"(unbatched: vmap for many), got {a.dtype}{tuple(a.shape)}")
        return jnp.concatenate([context.astype(query.dtype), query])[None], query[None], True
    for name, a, n in (("context", context, None), ("query", query, 1)):
        if a.ndim != 1 or (n is not None and a.shape[0] != n):
            raise LiniclError(f"{name} must be int32[{n or 'n'}] (unbatched: vmap for many), got "
                              f"{a.dtype}{tuple(a.shape)}")
    full = jnp.concatenate([context.astype(jnp.int32), query.astype(jnp.int32)])[None]
    check_tokens("query", query[None], cfg.vocab_size)
    if context.shape[0]:
        check_tokens("context", context[None], cfg.vocab_size)
    return full, query[None].astype(jnp.int32), False


def _references(model, variables, full, query, position, embeds: bool):
    """Per block ℓ: g_ℓ, q_ℓ at ``position`` of the full pass, and f_ℓ, p_ℓ of the chained stream
    (block 0: the query's own block input in ``model.apply(patched, query)``; block ℓ > 0: the
    full-context input Z_ℓ[position], which the patched blocks below reproduce)."""
    cfg = config_of(model)
    kw = dict(embeds=full) if embeds else dict(tokens=full)
    acts = capture_blocks(model, variables, **kw, names=("hook_resid_pre", "hook_mlp_in",
                                                         "hook_resid_mid"))
    take = lambda a: jnp.take(a[:, 0], position, axis=1)  # noqa: E731  [L, 1, T, d] -> [L, d]
    _, a0 = capture(model, variables, None if embeds else query, embeds=query if embeds else None,
                    names=["blocks.0.hook_resid_pre"], hidden=True)
    X = take(acts["hook_resid_pre"]).at[0].set(a0["blocks.0.hook_resid_pre"][0, 0])
    offset = jnp.asarray(variables.get(ICLCA, {}).get("offset", 0), jnp.int32)
    stacked = stack_blocks(cfg, variables["params"])
    ref = jax.vmap(lambda bp, x: alone(cfg, bp, x, offset))(stacked, X)
    return Pieces(take(acts["hook_mlp_in"]), take(acts["hook_resid_mid"]), ref["hook_mlp_in"],
                  ref["hook_resid_mid"], jnp.zeros_like(X), X)


@functools.lru_cache(maxsize=64)
def _convert_fn(model, embeds: bool):
    cfg = config_of(model)

    def run(variables, full, query, position):
        pcs = _references(model, variables, full, query, position, embeds)
        stacked = stack_blocks(cfg, variables["params"])
        bad = jax.vmap(degenerate)(pcs.g, pcs.f)
        upd = jax.vmap(lambda bp, pc: update(cfg, bp, pc, "implicit.convert"))(stacked, pcs)
        params = dict(variables["params"])
        for l in range(cfg.n_layers):
            one = jax.tree.map(lambda a: a[l], upd)
            params[f"layers_{l}"] = patch(cfg, params[f"layers_{l}"], one)
        return {**variables, "params": params}, pcs, bad
    return jax.jit(run)


def _position(position, T: int):
    if is_concrete(position):
        i = int(position)
        if not -T <= i < T:
            raise LiniclError(f"position must index the {T} tokens of [context; query] "
                              f"(in [-{T}, {T})), got {i}")
        return jnp.asarray(i % T, jnp.int32)
    position = jnp.asarray(position, jnp.int32)
    return jnp.where(position < 0, position + T, position)


def _prepare(model, variables, context, query, position):
    cfg = config_of(model)
    _check_variables(variables)
    if has_bias_shift(cfg) and not cfg.has_mlp_bias:
        raise LiniclError("implicit.convert shifts each block's last MLP bias (fc_out.bias), but this "
                          "model has none: use ModelConfig(mlp_bias=True); a zero bias is the same model")
    full, query, embeds = _inputs(cfg, context, query)
    return full, query, embeds, _position(-1 if position is None else position, full.shape[1])


def convert(model, variables, context, query, *, position: Optional[int] = None) -> dict:
    """The context as weights: ``variables`` with each block's first MLP matrix changed by a rank-1
    ΔW and its last MLP bias shifted, such that (tokens; ``embeds=`` for float inputs)::

        patched = convert(model, variables, context, query)          # context int32[n], query int32[1]
        model.apply(patched, query[None])[0, -1] == model.apply(variables, concat([context, query])[None])[0, -1]

    Args:
      model, variables: a ``linicl.Transformer`` (softmax or linear attention, any norm, block form,
        positions option) and its variables (no stored prompt state; a learned-positions offset is
        kept: the query alone sits at it).
      context: ``int32[n]`` token ids or ``float[n, d_model]`` embeddings (unbatched; ``vmap`` for
        many). query: ``int32[1]`` or ``float[1, d_model]``.
      position: the position i of [context; query] whose with-context output the patched model gives
        for the query alone (default: the last, the papers' case). Any i works: block 0 maps the query
        to token i's representation, blocks above use token i's own inputs as reference.
    Returns:
      a new variables dict; only ``layers_l/mlp/fc_in/kernel`` (and ``fc_gate/kernel``) and
      ``layers_l/mlp/fc_out/bias`` differ from ``variables``.
    Raises:
      LiniclError: bad arguments, or no MLP bias to shift (use ``mlp_bias=True``).
      DegenerateInputError: ‖f‖ too small in some block (eager calls; under vmap/jit: NaN weights).
    """
    full, q, embeds, i = _prepare(model, variables, context, query, position)
    patched, _, bad = _convert_fn(model, embeds)(dict(variables), full, q, i)
    _guard(bad, "implicit.convert (flags per block)")
    return patched


def convert_edits(model, variables, context, query, *, position: Optional[int] = None) -> list:
    """The vector form of ``convert``: ``(name, Edit)`` pairs for ``linicl.interventions.with_edits``
    that add g_ℓ - f_ℓ at each block's MLP input and Δb'_ℓ at its MLP output. Equivalent to the
    matrix patch; no weight changes (the bridge to thought/steering vectors)."""
    full, q, embeds, i = _prepare(model, variables, context, query, position)
    _, pcs, bad = _convert_fn(model, embeds)(dict(variables), full, q, i)
    _guard(bad, "implicit.convert_edits (flags per block)")
    edits = []
    for l in range(config_of(model).n_layers):
        edits.append((f"blocks.{l}.hook_mlp_in", Edit(pcs.g[l] - pcs.f[l])))
        edits.append((f"blocks.{l}.hook_mlp_out", Edit(pcs.q[l] - pcs.p[l])))
    return edits


# ------------------------------------------------------------------------------------- sub-context
_block_sites_jit = jax.jit(block_sites, static_argnums=0)


def subcontext(cfg: ModelConfig, block_params, Z, Y: Sequence[int]):
    """Dherin's ΔW(Y) for Y ⊂ C: the block on [C∖Y, x] patched with it gives, at x, the block on
    [C, x] (Theorem 2.2 with the reference A(C∖Y, x); plus Δb' for forms with a residual).

    ``Z: f[n + 1, d]`` = [C; x] (concrete), ``Y``: indices into C. Returns ``(pieces, rest)``:
    ``pieces`` for the last position (g, q from [C, x]; f, p from ``rest`` = [C∖Y; x] at its last
    position; shapes ``f[1, d]``) and ``rest: f[n + 1 - |Y|, d]``."""
    Z = np.asarray(Z)
    n = Z.shape[0] - 1
    Y = np.unique(np.asarray(Y, dtype=np.int64).reshape(-1))
    if Y.size and (Y.min() < 0 or Y.max() >= n):
        raise LiniclError(f"Y must index the context (0 <= j < {n}), got {Y.tolist()}")
    keep = np.setdiff1d(np.arange(n + 1), Y)
    rest = jnp.asarray(Z[keep])
    ctx = _block_sites_jit(cfg, block_params, jnp.asarray(Z))
    sub = _block_sites_jit(cfg, block_params, rest)
    pcs = Pieces(ctx["hook_mlp_in"][-1:], ctx["hook_resid_mid"][-1:], sub["hook_mlp_in"][-1:],
                 sub["hook_resid_mid"][-1:], ctx["hook_resid_post"][-1:], rest[-1:])
    return pcs, rest


# ------------------------------------------------------------------------------------- implicit GD
class Trajectory(NamedTuple):
    """Dherin's implicit gradient descent of one block as the context C = [c_1..c_n] is read with the
    query x fixed: W_i = W + ΔW(C_i), i = 0..n (C_0 = ∅). Shapes for one task; h = learning rate."""

    g: jax.Array        # f[n + 1, d]  g(C_i, x): MLP input of the block on [C_i, x] at x
    q: jax.Array        # f[n + 1, d]
    out: jax.Array      # f[n + 1, d]  block output on [C_i, x] at x
    update: Update      # u[name] f[n + 1, h] = W(g_i - f), v f[1, d], delta_b f[n + 1, d]
    lr: jax.Array       # f[]  h = 1/‖f‖² (1/‖A(x)‖² for the plain block)
    step_u: dict        # {name: f[n, h]}  W(g_i - g_{i-1}): ΔW(C_i) - ΔW(C_{i-1}) = step_u_i vᵀ
    step_norms: jax.Array  # f[n]  ‖ΔW(C_i) - ΔW(C_{i-1})‖_F


def _prefix_batch(Z, order):
    """Row i = [c_1..c_i, x, c_{i+1}..c_n]: causally, x at position i sees exactly [C_i, x]."""
    n = Z.shape[0] - 1
    C = Z[:-1] if order is None else Z[:-1][jnp.asarray(order)]
    rows = jnp.arange(n + 1)[:, None]
    t = jnp.arange(n + 1)[None, :]
    idx = jnp.where(t < rows, t, jnp.where(t == rows, n, t - 1))
    return jnp.concatenate([C, Z[-1:]])[idx]  # [n + 1, n + 1, d]


def trajectory(cfg: ModelConfig, block_params, Z, *, order=None, position=0,
               chunk: Optional[int] = None) -> Trajectory:
    """The implicit-GD trajectory of one block for ``Z: f[n + 1, d]`` = [C; x] (pure; vmap for tasks).

    Each step adds W(A(C_i, x) - A(C_{i-1}, x))fᵀ/‖f‖² = -h ∇_W L_i(W_{i-1}) with the linear loss
    L_i(W) = trace(Δ_iᵀ W), Δ_i = W (g_{i-1} - g_i) fᵀ (``gradient``), h = 1/‖f‖²; the steps telescope
    to ΔW(C). ``order``: read the context in this order (a permutation of 0..n-1). ``chunk``: prefixes
    per batch (memory O(chunk · n · d) instead of O(n² · d); default: all at once). Non-causal attention hides the tokens
    after x with an attention-logit mask.
    """
    Z = jnp.asarray(Z)
    n = Z.shape[0] - 1
    S = _prefix_batch(Z, order)

    def prefix(row_and_i):
        row, i = row_and_i
        edits = None
        if not cfg.causal:
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
    ``gd_loss(W, Δ_i)``. f is recovered from v = f/‖f‖² as v/h."""
    f = traj.update.v[0] / traj.lr
    return {k: jnp.outer(W @ (traj.g[i - 1] - traj.g[i]), f)
            for k, W in first_matrices(cfg, block_params).items()}


def gd_loss(W, Delta) -> jax.Array:
    """Dherin's per-token loss L_i(W) = trace(Δ_iᵀ W)."""
    return jnp.sum(Delta * W)


# ------------------------------------------------------------------------------------- linear attention
def context_term(cfg: ModelConfig, block_params, S, x) -> jax.Array:
    """ΔA = A(C, x) - A(x) in closed form from a stored linear-attention state (``iclca.convert``):
    W_O (γ ⊙ Sᵀ φ(q)) for unnormalised linear attention, with S ``f[heads, d_phi, d_head]`` the
    block's state after the context and q the query projection of x alone. ``x: f[d]`` -> ``f[d]``."""
    if cfg.attention != "linear" or cfg.normalize:
        raise NotExactError("context_term needs unnormalised linear attention (attention='linear', "
                            "normalize=False): otherwise A(C, x) is not linear in the state")
    # The state is re-based so that the query sits at position 0, where rope is the identity.
    qh = alone(cfg, block_params, x)["hook_q"]                      # [heads, d_head], before rope
    phi = feature_maps.get(cfg.feature_map)(qh)
    z = jnp.einsum("hf,hfd->hd", phi, S)
    gammas = cfg.decay_per_head()
    if gammas is not None:
        z = z * jnp.asarray(gammas, z.dtype)[:, None]
    return jnp.einsum("hd,hde->e", z, block_params["attn"]["o"]["kernel"])


__all__ = ["Pieces", "Update", "ModelUpdates", "Trajectory", "REFERENCES", "block_sites", "alone", "pieces",
           "first_matrices", "degenerate", "factors", "delta_W", "delta_b", "update", "dense", "patch",
           "implied", "vector_edits", "frobenius", "alignment", "msd", "stack_blocks", "capture_blocks",
           "updates", "implied_all", "convert", "convert_edits", "subcontext", "trajectory", "gradient",
           "gd_loss", "context_term", "has_bias_shift"]
