"""Diagnostics of a normalised linear-attention model: the normalisers it divides by.

A normalised linear attention (``ModelConfig.normalize=True``) outputs, per head and position t,

    o_t = phi(q_t)^T S_t / (phi(q_t) . z_t + attn_eps),
    z_t = gamma^(t+1) (z_bias + z_prompt) + sum_{i<=t} gamma^(t-i) phi(k_i),

with the unrotated features phi (rope rotates the numerator's only), the trainable bias ``z_bias``
(``cfg.trainable_bias``) and the stored state ``z_prompt`` (a converted prompt's, ``names.PROMPT_STATE``, or
during a decode the running one, ``names.DECODE``, which superseded it); gamma is the head's decay (1
without). ``normalisers`` returns the denominator phi(q_t) . z_t of every layer
before the epsilon, split into the parts that come from the bias and from the prompt: a normaliser near
zero (or below, with a free ``z_bias``) is where the output blows up.

It is computed from the model's own activations (``hook_q``, ``hook_k``) and variables, so
``normalisers_from`` also works inside a training step that captures those sites anyway;
``normaliser_summary`` reduces it to the few minima a training curve records.
"""

from __future__ import annotations

import functools

from typing import Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from linicl import names
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.interventions import capture
from linicl.kernels import feature_maps
from linicl.kernels.softmax_attention import repeat_kv
from linicl.nn.transformer import config_of


class Normaliser(NamedTuple):
    """One layer's normaliser, each part ``f[batch, heads, seq]``."""

    value: jax.Array   # phi(q_t) . z_t: what the model divides by, before adding cfg.attn_eps
    bias: jax.Array    # the part phi(q_t) . gamma^(t+1) z_bias (zero without a trainable bias)
    prompt: jax.Array  # the part phi(q_t) . gamma^(t+1) z_prompt (zero without a stored state)


def normaliser_sites(cfg: ModelConfig) -> tuple[str, ...]:
    """The sites ``normalisers_from`` reads: every layer's ``hook_q`` and ``hook_k``."""
    return tuple(names.block_site(layer, hook) for layer in range(cfg.n_layers) for hook in ("hook_q", "hook_k"))


def _check(cfg: ModelConfig) -> None:
    if cfg.attention != "linear" or not cfg.normalize:
        raise LiniclError(f"normalisers: the model must be a normalised linear attention (attention='linear', "
                          f"normalize=True); it has attention={cfg.attention!r}, normalize={cfg.normalize}")
    if cfg.gate != "none":  # the decays here are fixed per head; a gate's are computed from each token
        raise LiniclError(f"normalisers: gate={cfg.gate!r} is not supported (the normaliser is rebuilt "
                          f"with fixed decays only); use a model with gate='none'")
    if cfg.qk_norm or cfg.query_pre_attn_scalar is not None or cfg.has_local_layers:
        raise LiniclError("normalisers: qk_norm, query_pre_attn_scalar and local layers are not supported "
                          "(the normaliser is rebuilt from hook_q / hook_k, read before the q/k norms and "
                          "the query scale, with one layer config)")
    if cfg.short_conv:
        raise LiniclError(f"normalisers: short_conv={cfg.short_conv} is not supported (the normaliser is "
                          f"rebuilt from hook_q / hook_k, read before the short convolution); use a model "
                          f"with short_conv=0")


def _decay(cfg: ModelConfig, T: int, dtype):
    """``(D: f[heads, T, T], age: f[heads, T])``: D[h, t, i] = gamma_h^(t-i) for i <= t (else 0) and
    age[h, t] = gamma_h^(t+1), the decay of the initial state at position t."""
    t = jnp.arange(T)
    diff = t[:, None] - t[None, :]
    gammas = cfg.decay_per_head()
    if gammas is None:
        return jnp.broadcast_to((diff >= 0).astype(dtype), (cfg.n_heads, T, T)), jnp.ones((cfg.n_heads, T), dtype)
    g = jnp.asarray(gammas, dtype)[:, None, None]
    return jnp.where(diff >= 0, g ** jnp.maximum(diff, 0), 0.0), g[:, :, 0] ** (t + 1)[None]


def _initial_part(q: jax.Array, z0: Optional[jax.Array], age: jax.Array) -> jax.Array:
    """phi(q_t) . gamma^(t+1) z0, ``f[batch, heads, seq]``; zero when ``z0`` is None. ``z0``: ``[heads,
    F]`` (a bias) or ``[batch or 1, heads, F]`` (a stored prompt)."""
    if z0 is None:
        return jnp.zeros(q.shape[:3], q.dtype)
    z0 = z0.astype(q.dtype)
    if z0.ndim == 2:
        return jnp.einsum("bhtf,hf->bht", q, z0) * age[None]
    z0 = jnp.broadcast_to(z0, (q.shape[0],) + z0.shape[1:])
    return jnp.einsum("bhtf,bhf->bht", q, z0) * age[None]


def _layer_entry(variables: Mapping, collection: str, layer: int, name: str):
    """``variables[collection]["layers_<layer>"]["attn"][name]``, or None."""
    return variables.get(collection, {}).get(names.layer_scope(layer), {}).get("attn", {}).get(name)


def _feature_maps(cfg: ModelConfig, variables: Mapping, layer: int):
    """``(phi_q, phi_k)`` of one layer: the fixed map twice, or hedgehog with the layer's learned
    ``phi_{q,k}_{W,b}`` (one map per query head, so keys are repeated to the query heads first)."""
    if cfg.feature_map != "hedgehog":
        phi = feature_maps.get(cfg.feature_map)
        return phi, phi
    p = variables.get(names.PARAMS, {}).get(names.layer_scope(layer), {}).get("attn", {})
    if "phi_q_W" not in p:
        raise LiniclError(f"normalisers_from: layer {layer} has a hedgehog map but variables['params'] "
                          f"lacks its phi_q_W / phi_k_W")
    return (functools.partial(feature_maps.hedgehog, W=p["phi_q_W"], b=p["phi_q_b"]),
            functools.partial(feature_maps.hedgehog, W=p["phi_k_W"], b=p["phi_k_b"]))


def normalisers_from(cfg: ModelConfig, variables: Mapping, acts: Mapping[str, jax.Array],
                     layers: Optional[Sequence[int]] = None) -> list[Normaliser]:
    """The normalisers of ``layers`` (default: all, in order) from captured activations.

    Args:
      cfg: the model's config (a normalised linear attention).
      variables: the variables of the call that produced ``acts``: ``params`` (for ``z_bias``) and
        the stored state, if any (``names.PROMPT_STATE`` or ``names.DECODE``).
      acts: ``{site: activation}`` holding at least ``normaliser_sites(cfg)`` of those layers
        (``linicl.interventions.capture``), each ``f[batch, seq, heads or kv_heads, d_head]``.
    Returns:
      One ``Normaliser`` per layer.
    """
    _check(cfg)
    layers = range(cfg.n_layers) if layers is None else layers
    missing = [n for layer in layers for n in (names.block_site(layer, "hook_q"), names.block_site(layer, "hook_k"))
               if n not in acts]
    if missing:
        raise LiniclError(f"normalisers_from: acts lack {missing}; capture normaliser_sites(cfg)")
    out = []
    for layer in layers:
        phi_q, phi_k = _feature_maps(cfg, variables, layer)
        # [batch, seq, heads, d] -> [batch, heads, seq, F]: the unrotated features, as in the normaliser
        q = phi_q(jnp.swapaxes(acts[names.block_site(layer, "hook_q")], 1, 2))
        k = phi_k(repeat_kv(jnp.swapaxes(acts[names.block_site(layer, "hook_k")], 1, 2), cfg.n_heads))
        D, age = _decay(cfg, q.shape[2], q.dtype)
        keys = jnp.einsum("bhts,hts->bht", jnp.einsum("bhtf,bhsf->bhts", q, k), D)  # the call's own keys
        bias = _initial_part(q, _layer_entry(variables, names.PARAMS, layer, "z_bias"), age)
        stored = _layer_entry(variables, names.DECODE, layer, "z")  # a decode supersedes the prompt's state
        if stored is None:
            stored = _layer_entry(variables, names.PROMPT_STATE, layer, "z")
        prompt = _initial_part(q, stored, age)
        out.append(Normaliser(keys + bias + prompt, bias, prompt))
    return out


def normalisers(model, variables: Mapping, tokens) -> list[Normaliser]:
    """The normaliser phi(q_t) . z_t of every layer of a normalised linear-attention model on ``tokens``
    (``int[batch, seq]``), bias and stored prompt included: one ``Normaliser`` per layer, each part
    ``f[batch, heads, seq]``. The model divides by ``value + cfg.attn_eps``."""
    cfg = config_of(model)
    _check(cfg)
    _, acts = capture(model, variables, tokens, names=normaliser_sites(cfg))
    return normalisers_from(cfg, variables, acts)


def normaliser_summary(cfg: ModelConfig, params: Mapping, acts: Mapping[str, jax.Array]) -> dict:
    """The smallest normalisers over every layer, head, position and row, as ``f[]`` scalars (jit-able,
    no gradient flows through them):

    * ``den_min``: the smallest phi(q_t) . z_t (bias included, ``attn_eps`` excluded);
    * ``den_first_min``: the smallest at t = 0, where z holds one key plus the bias;
    * ``bias_term_min``: the smallest bias part phi(q_t) . gamma^(t+1) z_bias (0 without a bias);
    * ``z_bias_min``: the most negative entry of any ``z_bias`` (0 without a bias, and at most 0).

    ``z_bias >= 0`` everywhere keeps every denominator positive for any input when the feature map is
    non-negative (``names.NONNEGATIVE_MAPS``, e.g. elu+1 > 0); a free ``z_bias`` can drive it to zero or
    below, which ``den_min`` shows.

    Args:
      cfg: the model's config (a normalised linear attention).
      params: the model's ``params`` (no stored prompt).
      acts: at least ``normaliser_sites(cfg)`` of the same call (``normalisers_from``).
    """
    acts = jax.lax.stop_gradient(acts)
    out = dict(den_min=jnp.inf, den_first_min=jnp.inf, bias_term_min=jnp.zeros(()), z_bias_min=jnp.zeros(()))
    for layer, n in enumerate(normalisers_from(cfg, {names.PARAMS: params}, acts)):
        out["den_min"] = jnp.minimum(out["den_min"], n.value.min())
        out["den_first_min"] = jnp.minimum(out["den_first_min"], n.value[:, :, 0].min())
        out["bias_term_min"] = jnp.minimum(out["bias_term_min"], n.bias.min())
        if cfg.trainable_bias:
            z_bias = params[names.layer_scope(layer)]["attn"]["z_bias"]
            out["z_bias_min"] = jnp.minimum(out["z_bias_min"], z_bias.min())
    return jax.lax.stop_gradient(out)
