"""Implicit updates of a whole model: every block, every position, from one forward pass.

Block ℓ is taken with the inputs Z_ℓ it receives in the full-context pass (captured at its sites);
its reference is Z_ℓ[-1] (``"query"``) or each token's own input (``"own"``). The blocks' params are
stacked on a leading layer axis so that one block function is ``vmap``-ped over the layers: all the
reference runs are one call. Shapes gain a leading layer axis L: ``g: f[L, B, T, d]``, ...
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.implicit.blocks import Pieces, alone, check_reference
from linicl.implicit.operators import Update, implied, update
from linicl.interventions import capture
from linicl.names import PARAMS, block_site, layer_scope
from linicl.nn.transformer import config_of

CAPTURED = ("hook_resid_pre", "hook_mlp_in", "hook_resid_mid", "hook_resid_post")


def stack_blocks(cfg: ModelConfig, params):
    """Every block's params stacked on a leading layer axis (to ``vmap`` one block over layers)."""
    layers = [params[layer_scope(l)] for l in range(cfg.n_layers)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def capture_blocks(model, variables, tokens=None, *, embeds=None, names=CAPTURED) -> dict:
    """One forward pass; ``{site: f[layers, batch, ...]}`` for the named per-block sites (``hook_mlp_in``,
    ``hook_q``; a module prefix such as ``attn.hook_q`` is accepted too)."""
    L = config_of(model).n_layers

    def full(l, site):
        return block_site(l, site.rsplit(".", 1)[-1])
    _, acts = capture(model, variables, tokens, names=[full(l, s) for l in range(L) for s in names],
                      embeds=embeds, hidden=True)
    return {site: jnp.stack([acts[full(l, site)] for l in range(L)]) for site in names}


class ModelUpdates(NamedTuple):
    pieces: Pieces  # each with a leading layer axis: g f[L, B, T, d], f f[L, B, 1 or T, d], ...
    update: Update  # u[name] f[L, B, T, h], v f[L, B, 1 or T, d], delta_b f[L, B, T, d]


def updates(model, variables, tokens=None, *, embeds=None, reference: str = "query") -> ModelUpdates:
    """Every block's updates at every position for a batch, from one forward pass (pure: jit it).

    Block ℓ is taken with the inputs Z_ℓ it receives in the full-context pass; its reference is
    Z_ℓ[-1] (``"query"``, Innocenti & Achour Eq. 6) or each token's own input (``"own"``). Nothing of
    size [layers, batch, T, h, d] is built (``dense`` does that on request).
    """
    check_reference(reference)
    cfg = config_of(model)
    acts = capture_blocks(model, variables, tokens, embeds=embeds)
    Z = acts["hook_resid_pre"]
    X = Z[:, :, -1:] if reference == "query" else Z
    stacked = stack_blocks(cfg, variables[PARAMS])
    ref = jax.vmap(lambda bp, x: alone(cfg, bp, x))(stacked, X)
    pcs = Pieces(acts["hook_mlp_in"], acts["hook_resid_mid"], ref["hook_mlp_in"], ref["hook_resid_mid"],
                 acts["hook_resid_post"], X)
    upd = jax.vmap(lambda bp, pc: update(cfg, bp, pc, "implicit.updates"))(stacked, pcs)
    return ModelUpdates(pcs, upd)


def implied_all(model, variables, mu: ModelUpdates) -> jax.Array:
    """The implicit model of every block and position, ``f[L, B, T, d]`` (= ``mu.pieces.out``)."""
    cfg = config_of(model)
    stacked = stack_blocks(cfg, variables[PARAMS])
    return jax.vmap(lambda bp, u, x: implied(cfg, bp, u, x))(stacked, mu.update, mu.pieces.x)
