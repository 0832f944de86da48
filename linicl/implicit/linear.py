"""The context term of unnormalised linear attention in closed form, from a stored prompt state.

For unnormalised linear attention A(C, x) = A(x) + ΔA with ΔA = W_O (γ ⊙ Sᵀ φ(q)): the context
enters only through the state S it leaves (``iclca.convert``). Feeding A(x) + ΔA to the block on x
alone reproduces the block with context, so ΔA determines the implicit update too.

The gated and delta-rule mixers (``ModelConfig.gate``, ``update``) keep ΔA linear in S, with the
gate α(x) and write strength β(x) of x itself (per head h; q̂, k̂ the unit features of the delta rule):

    scalar gate   ΔA_h = α_h Sᵀ φ(q)
    vector gate   ΔA_h = Sᵀ (α_h ⊙ φ(q))                      (α_h: one decay per key feature)
    delta rule    ΔA_h = α_h Sᵀ (q̂ - β_h (q̂ · k̂) k̂)           (α_h = 1 without a gate)

since x's own step decays S and, for the delta rule, first erases β (k̂ᵀS) along k̂: S ↦ α(I - β k̂ k̂ᵀ)S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.errors import NotExactError
from linicl.implicit.blocks import alone
from linicl.kernels import feature_maps
from linicl.names import PARAMS
from linicl.nn.attention import l2_normalize
from linicl.nn.norms import make_norm


def _as_read(cfg: ModelConfig, block_params, which: str, x) -> jax.Array:
    """The projection site ``hook_q`` / ``hook_k`` as the layer reads it: after the q/k norm
    (``qk_norm``) and, for queries, the scale sqrt(d_head / query_pre_attn_scalar)."""
    if cfg.qk_norm:
        name = f"{which}_norm"
        x = make_norm(cfg, name).apply({PARAMS: block_params["attn"][name]}, x)
    if which == "q" and cfg.query_pre_attn_scalar is not None:
        x = x * jnp.asarray(cfg.query_scale, x.dtype)
    return x


def context_term(cfg: ModelConfig, block_params, S, x) -> jax.Array:
    """ΔA = A(C, x) - A(x) in closed form from a stored linear-attention state (``iclca.convert``):
    W_O (γ ⊙ Sᵀ φ(q)) for unnormalised linear attention (gated and delta-rule forms: the module
    docstring), with S ``f[heads, d_phi, d_head]`` the block's state after the context and q the query
    projection of x alone. ``x: f[d]`` -> ``f[d]``."""
    if cfg.attention != "linear" or cfg.normalize:
        raise NotExactError("context_term needs unnormalised linear attention (attention='linear', "
                            "normalize=False): otherwise A(C, x) is not linear in the state")
    if cfg.short_conv:
        # The context reaches x through the convolution's state as well: x's own q, k, v mix in the
        # context's last projections, so A(C, x) is not a function of S and x alone.
        raise NotExactError(f"context_term reads the context through S alone; with short_conv="
                            f"{cfg.short_conv} x's q, k, v also mix in the context's last K - 1 "
                            f"projections (the convolution's state); use short_conv=0")
    if cfg.positions == "rope" and cfg.rope_on == "inputs":
        # The state is not re-based then: x would read it at the context's length, not position 0.
        raise NotExactError("context_term reads x at position 0 of a re-based state; with "
                            "rope_on='inputs' the state keeps absolute positions (use rope_on='features')")
    # The state is re-based so that the query sits at position 0, where rope is the identity.
    ref = alone(cfg, block_params, x)
    phi = feature_maps.get(cfg.feature_map)
    fq = phi(_as_read(cfg, block_params, "q", ref["hook_q"]))        # [heads, d_phi], before rope
    if cfg.update == "delta":
        # Keys repeated to the query heads (grouped-query attention), as the layer does.
        fk = phi(jnp.repeat(_as_read(cfg, block_params, "k", ref["hook_k"]), cfg.n_heads // cfg.kv_heads, axis=0))
        fq, fk = l2_normalize(fq, cfg.attn_eps), l2_normalize(fk, cfg.attn_eps)
        beta = jax.nn.sigmoid(ref["attn.beta_proj"])                  # [heads]
        fq = fq - (beta * jnp.sum(fq * fk, -1))[:, None] * fk         # (I - β k̂ k̂ᵀ) q̂
    if cfg.gate == "vector":
        fq = fq * jnp.exp(jax.nn.log_sigmoid(ref["attn.gate_proj"]))   # [heads, d_phi]
    z = jnp.einsum("hf,hfd->hd", fq, S)
    if cfg.gate == "scalar":
        z = z * jnp.exp(jax.nn.log_sigmoid(ref["attn.gate_proj"]))[:, None]
    gammas = cfg.decay_per_head()
    if gammas is not None:
        z = z * jnp.asarray(gammas, z.dtype)[:, None]
    return jnp.einsum("hd,hde->e", z, block_params["attn"]["o"]["kernel"])
