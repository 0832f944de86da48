"""Transformer block (attention + MLP, pre- or post-LayerNorm) and its MLP."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from linicl.config import ModelConfig
from linicl.nn.attention import Attention

ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


class MLP(nn.Module):
    """``fc_out(act(fc_in(x)))``. ``fc_in.kernel`` is the "first MLP matrix" W (as W^T, ``[d_model,
    d_ff]``) and ``fc_out.bias`` the "last MLP bias" b' of the implicit-update theory."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        dense = functools.partial(nn.Dense, use_bias=cfg.use_bias, dtype=dt, param_dtype=dt)
        h = ACTIVATIONS[cfg.activation](dense(cfg.d_ff, name="fc_in")(x))
        return dense(cfg.d_model, name="fc_out")(h)


class Block(nn.Module):
    """pre-LN: h = x + attn(ln1(x)); out = h + mlp(ln2(h)).
    post-LN: h = ln1(x + attn(x)); out = ln2(h + mlp(h))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x: f[batch, seq, d_model]``, ``positions: int[seq]`` -> ``f[batch, seq, d_model]``."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        ln = functools.partial(nn.LayerNorm, epsilon=cfg.ln_eps, dtype=dt, param_dtype=dt)
        attn, mlp = Attention(cfg, name="attn"), MLP(cfg, name="mlp")
        if cfg.norm == "pre":
            h = x + attn(ln(name="ln1")(x), positions)
            return h + mlp(ln(name="ln2")(h))
        h = ln(name="ln1")(x + attn(x, positions))
        return ln(name="ln2")(h + mlp(h))
