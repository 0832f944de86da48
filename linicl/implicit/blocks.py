"""One block run on sequences and on single tokens, and the pieces the implicit update is made of.

``block_sites`` runs a block on ``Z: f[..., T, d]`` (the zoo's own ``Block``, so every block form is
covered) and returns the values it sows at its sites; ``alone`` runs it on each token as a one-token
sequence. ``pieces`` pairs the two: g, q with context and f, p for the reference run alone (see
``linicl.implicit`` for the theory and the references ``"query"`` / ``"own"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linicl import names
from linicl._validate import check_index, check_indices
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.nn.block import Block


# The attention's gate and write-strength projections (ModelConfig.gate, update): their outputs are
# returned as "attn.<name>" next to the sites (``linear.context_term`` reads them).
_GATE_PROJECTIONS = ("gate_proj", "beta_proj")


def check_block_form(cfg: ModelConfig, what: str) -> None:
    """Refuse what the block functions cannot serve, never approximate it: a model with local layers
    (its blocks have two configs; one config describes one block) and sandwich blocks (the theorem
    needs the MLP output added to the residual as it is, and N2'(MLP(g) + delta_b) != N2'(MLP(g)) +
    delta_b, so no rank-1 patch of the MLP reproduces the context)."""
    if cfg.has_local_layers:
        raise LiniclError(f"{what}: a model with local layers (layer_types) has blocks of two configs; pass "
                          f"one block's own config (ModelConfig.layer_config(layer)) to the block functions, "
                          f"and implicit.convert does not take such models yet")
    if cfg.norm == "sandwich":
        raise LiniclError(f"{what}: the implicit update needs the MLP output added to the residual "
                          f"unnormalised; norm='sandwich' (Gemma) normalises it after the MLP, so the "
                          f"rank-1 identity does not hold for this block form")


def check_block_params(cfg: ModelConfig, block_params) -> None:
    """``block_params`` must be one block's params (``variables["params"]["layers_<i>"]``): the tree
    ``Block(cfg)`` would initialise, with the same paths and shapes. Only shapes are compared, so
    traced params pass. A common slip, the whole model's params, is named as such."""
    check_block_form(cfg, "implicit block functions")
    if not isinstance(block_params, Mapping):
        raise LiniclError(f"block_params must be one block's params (a dict such as "
                          f"variables['params']['layers_0']), got {type(block_params).__name__}")
    if any(str(key).startswith("layers_") for key in block_params):
        raise LiniclError("block_params must be one block's params, got the whole model's params (keys "
                          f"{sorted(map(str, block_params))}): pass e.g. variables['params']['layers_0']")
    d = cfg.d_model
    expected = jax.eval_shape(lambda: Block(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1, d), cfg.jnp_dtype),
                                                      jnp.zeros((1,), jnp.int32)))[names.PARAMS]
    want = {jax.tree_util.keystr(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(p): tuple(jnp.shape(a)) for p, a in jax.tree_util.tree_leaves_with_path(block_params)}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if missing or extra or wrong:
        detail = "; ".join(part for part in (
            missing and f"missing {missing[:4]}", extra and f"unexpected {extra[:4]}",
            wrong and "shapes " + ", ".join(f"{k}: {got[k]} (expected {want[k]})" for k in wrong[:4])) if part)
        raise LiniclError(f"block_params is not one block of this config's model: {detail}")


def _block_call(cfg: ModelConfig, block_params, Z, positions, interventions=None) -> dict:
    """Block on ``Z: f[batch, T, d]``: its output and every site it sows (one pass), plus the logits
    ``attn.gate_proj`` / ``attn.beta_proj`` ``f[batch, T, heads(, d_phi)]`` of a gated or delta-rule
    attention."""
    check_block_params(cfg, block_params)
    variables = {names.PARAMS: block_params}
    if interventions:
        variables[names.INTERVENTIONS] = interventions
    out, state = Block(cfg).apply(variables, Z, positions, mutable=[names.INTERMEDIATES],
                                  capture_intermediates=lambda m, _: m.name in _GATE_PROJECTIONS)
    sown = state[names.INTERMEDIATES]
    sites = {site: sown[site][-1] for site in names.BLOCK_SITES}
    sites["hook_q"] = sown["attn"]["hook_q"][-1]
    sites["hook_k"] = sown["attn"]["hook_k"][-1]
    for name in _GATE_PROJECTIONS:
        if name in sown["attn"]:
            sites[f"attn.{name}"] = sown["attn"][name]["__call__"][-1]
    # The block's return value, not the sown one: that is what the next block (and the theorem) sees.
    sites["hook_resid_post"] = out
    return sites


def check_position(cfg: ModelConfig, position):
    """``position`` (of a token run alone) must be an int in [0, max_len): a float would be truncated
    by the int32 cast. Traced: dtype and shape only."""
    return check_index("position", position, 0, cfg.max_len, f"the model's positions (max_len={cfg.max_len})")


def block_sites(cfg: ModelConfig, block_params, Z, positions=None, interventions=None) -> dict:
    """Sites of one block run on ``Z: f[..., T, d]`` (leading axes: tasks), each ``f[..., T, d]``
    (``hook_q``: ``f[..., T, heads, d_head]``, ``hook_k``: ``f[..., T, kv_heads, d_head]``; gated or
    delta-rule attention: also ``attn.gate_proj``, ``attn.beta_proj``, see ``_block_call``).
    ``positions``: ``int[T]`` in [0, max_len), default 0..T-1."""
    Z = jnp.asarray(Z)
    if Z.ndim < 2:
        raise LiniclError(f"Z must be f[..., T, d] (a sequence of block inputs), got shape {Z.shape}")
    lead, (T, d) = Z.shape[:-2], Z.shape[-2:]
    if positions is None:
        positions = jnp.arange(T, dtype=jnp.int32)
    positions = check_indices("positions", positions, T, 0, cfg.max_len,
                              f"the model's positions (max_len={cfg.max_len}), one per token")
    positions = jnp.asarray(positions, jnp.int32)
    sites = _block_call(cfg, block_params, Z.reshape((-1, T, d)), positions, interventions)
    return {k: v.reshape(lead + v.shape[1:]) for k, v in sites.items()}


def alone(cfg: ModelConfig, block_params, x, position=0, interventions=None) -> dict:
    """Sites of the block run on each token of ``x: f[..., d]`` as a one-token sequence at
    ``position``: each ``f[..., d]`` (the reference values f = ``hook_mlp_in``, p = ``hook_resid_mid``)."""
    x = jnp.asarray(x)
    check_position(cfg, position)
    positions = jnp.reshape(jnp.asarray(position, jnp.int32), (1,))
    sites = _block_call(cfg, block_params, x.reshape((-1, 1, x.shape[-1])), positions, interventions)
    return {k: v[:, 0].reshape(x.shape[:-1] + v.shape[2:]) for k, v in sites.items()}


class Pieces(NamedTuple):
    """What the operators need from one block (shapes: see ``linicl.implicit``)."""

    g: jax.Array    # f[..., T, d]  MLP input with context
    q: jax.Array    # f[..., T, d]  residual the MLP output is added to, with context
    f: jax.Array    # f[..., 1 or T, d]  MLP input of the reference alone
    p: jax.Array    # f[..., 1 or T, d]  residual of the reference alone
    out: jax.Array  # f[..., T, d]  block output with context (what the patched block must give)
    x: jax.Array    # f[..., 1 or T, d]  the reference tokens (block inputs)


def check_reference(reference: str) -> None:
    if reference not in names.REFERENCES:
        raise LiniclError(f"reference must be one of {names.REFERENCES}, got {reference!r}")


def pieces(cfg: ModelConfig, block_params, Z, reference: str = "query", *, position=0,
           positions=None) -> Pieces:
    """g, q (block on ``Z: f[..., T, d]``) and f, p (the reference alone at ``position``)."""
    check_reference(reference)
    Z = jnp.asarray(Z)
    ctx = block_sites(cfg, block_params, Z, positions)
    x = Z[..., -1:, :] if reference == "query" else Z
    ref = alone(cfg, block_params, x, position)
    return Pieces(ctx["hook_mlp_in"], ctx["hook_resid_mid"], ref["hook_mlp_in"], ref["hook_resid_mid"],
                  ctx["hook_resid_post"], x)
