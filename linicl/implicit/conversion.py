"""A prompt as weights: every block's first MLP matrices get a rank-1 ΔW and its last MLP bias a shift,
so that the model run on the query alone gives the output it gives with the context.

Chaining: block 0 takes as reference the query's own input in ``model.apply(patched, query)``; each
block ℓ > 0 takes the full-context input Z_ℓ[i] at the chosen position i, which the patched blocks
below it reproduce exactly. g_ℓ, q_ℓ come from the full pass at i. One jitted function per (model,
float inputs?) computes all of it (``linicl.compiled``).
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from linicl import compiled
from linicl._validate import check_index, check_tokens, is_concrete
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.implicit.blocks import Pieces, alone, check_block_form
from linicl.implicit.model import capture_blocks, stack_blocks
from linicl.implicit.operators import check_defined, degenerate, has_bias_shift, patch, update
from linicl.interventions import capture
from linicl.names import PARAMS, POSITION, block_site, layer_scope
from linicl.nn.hooks import Edit
from linicl.nn.transformer import config_of


def _check_variables(variables) -> None:
    """Only params and a position offset: a stored prompt state would change what 'alone' means."""
    if not isinstance(variables, Mapping) or PARAMS not in variables:
        raise LiniclError("variables must be the dict returned by model.init (with a 'params' entry)")
    extra = set(variables) - {PARAMS, POSITION}
    stored = set(variables.get(POSITION, {})) - {"offset"}
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


def _references(model, variables, full, query, position, embeds: bool) -> Pieces:
    """Per block ℓ: g_ℓ, q_ℓ at ``position`` of the full pass, and f_ℓ, p_ℓ of the chained stream
    (block 0: the query's own block input in ``model.apply(patched, query)``; block ℓ > 0: the
    full-context input Z_ℓ[position], which the patched blocks below reproduce)."""
    cfg = config_of(model)
    kw = dict(embeds=full) if embeds else dict(tokens=full)
    acts = capture_blocks(model, variables, **kw, names=("hook_resid_pre", "hook_mlp_in", "hook_resid_mid"))
    # [L, 1, T, d] -> [L, d]; a (traced) position past the tokens gives NaN, not a clamped token
    take = lambda a: jnp.take(a[:, 0], position, axis=1, mode="fill", fill_value=jnp.nan)  # noqa: E731
    first = block_site(0, "hook_resid_pre")
    _, a0 = capture(model, variables, None if embeds else query, embeds=query if embeds else None,
                    names=[first], hidden=True)
    X = take(acts["hook_resid_pre"]).at[0].set(a0[first][0, 0])
    # The query alone sits where model.apply puts it: at the stored offset (learned positions).
    offset = jnp.asarray(variables.get(POSITION, {}).get("offset", 0), jnp.int32)
    stacked = stack_blocks(cfg, variables[PARAMS])
    ref = jax.vmap(lambda bp, x: alone(cfg, bp, x, offset))(stacked, X)
    return Pieces(take(acts["hook_mlp_in"]), take(acts["hook_resid_mid"]), ref["hook_mlp_in"],
                  ref["hook_resid_mid"], jnp.zeros_like(X), X)


def _build(model, embeds: bool):
    """The jitted conversion: ``(variables, full, query, position) -> (patched, pieces, degenerate)``."""
    cfg = config_of(model)

    def run(variables, full, query, position):
        pcs = _references(model, variables, full, query, position, embeds)
        stacked = stack_blocks(cfg, variables[PARAMS])
        bad = jax.vmap(degenerate)(pcs.g, pcs.f)
        upd = jax.vmap(lambda bp, pc: update(cfg, bp, pc, "implicit.convert"))(stacked, pcs)
        params = dict(variables[PARAMS])
        for l in range(cfg.n_layers):
            one = jax.tree.map(lambda a: a[l], upd)
            params[layer_scope(l)] = patch(cfg, params[layer_scope(l)], one)
        return {**variables, PARAMS: params}, pcs, bad
    return jax.jit(run)


def _converter(model, embeds: bool):
    return compiled.get(("implicit.convert", model, embeds), lambda: _build(model, embeds))


def _position(position, T: int):
    """``position`` in [-T, T) as an int32 in [0, T) (a float or bool is refused, not truncated; a
    traced one out of range makes ``jnp.take`` return NaN)."""
    check_index("position", position, -T, T, f"the {T} tokens of [context; query]")
    if is_concrete(position):
        return jnp.asarray(int(position) % T, jnp.int32)
    position = jnp.asarray(position, jnp.int32)
    position = jnp.where(position < 0, position + T, position)
    return jnp.where(position < 0, T, position)  # below -T: out of range (NaN), not wrapped twice


def _prepare(model, variables, context, query, position):
    cfg = config_of(model)
    check_block_form(cfg, "implicit.convert")
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
      model: a ``linicl.Transformer`` (softmax or linear attention, any norm, block form,
        positions option).
      variables: its variables (no stored prompt state; a learned-positions offset, the
        ``position`` collection, is kept: the query alone sits at it).
      context: ``int32[n]`` token ids or ``float[n, d_model]`` embeddings (unbatched; ``vmap`` for
        many).
      query: ``int32[1]`` or ``float[1, d_model]``.
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
    patched, _, bad = _converter(model, embeds)(dict(variables), full, q, i)
    check_defined(bad, "implicit.convert (flags per block)")
    return patched


def convert_edits(model, variables, context, query, *, position: Optional[int] = None) -> list:
    """The vector form of ``convert``: ``(name, Edit)`` pairs for ``linicl.interventions.with_edits``
    that add g_ℓ - f_ℓ at each block's MLP input and Δb'_ℓ at its MLP output (``(W + ΔW) f =
    W (f + g - f)``). Equivalent to the matrix patch; no weight changes (the bridge to thought and
    steering vectors)."""
    full, q, embeds, i = _prepare(model, variables, context, query, position)
    _, pcs, bad = _converter(model, embeds)(dict(variables), full, q, i)
    check_defined(bad, "implicit.convert_edits (flags per block)")
    edits = []
    for l in range(config_of(model).n_layers):
        edits.append((block_site(l, "hook_mlp_in"), Edit(pcs.g[l] - pcs.f[l])))
        edits.append((block_site(l, "hook_mlp_out"), Edit(pcs.q[l] - pcs.p[l])))
    return edits
