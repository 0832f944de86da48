"""The zoo's norms (``ModelConfig.norm_type``): LayerNorm, RMSNorm and Gemma's RMSNorm, each with the
model's epsilon ``ln_eps`` (part of the model: the same on both sides of every identity)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linicl.config import ModelConfig


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + w) over the last axis, w (param ``scale``) initialised to 0:
    Gemma's RMSNorm, whose stored weight is the offset from 1."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("scale", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        x = x.astype(self.dtype)
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * (1 + w)


def make_norm(cfg: ModelConfig, name: str) -> nn.Module:
    """LayerNorm (scale and bias), RMSNorm (scale only) or Gemma's RMSNorm (1 + scale), with the
    model's epsilon (part of the model: it is the same on both sides of every identity)."""
    dt = cfg.jnp_dtype
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(epsilon=cfg.ln_eps, dtype=dt, param_dtype=dt, name=name)
    if cfg.norm_type == "gemma_rmsnorm":
        return GemmaRMSNorm(eps=cfg.ln_eps, dtype=dt, name=name)
    return nn.LayerNorm(epsilon=cfg.ln_eps, dtype=dt, param_dtype=dt, name=name)
