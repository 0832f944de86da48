"""Transformer block (attention + MLP in every form the zoo offers) and its MLP.

Block forms (``cfg.norm`` / ``cfg.skip``), with A the attention and N1, N2 the block's norms:

==================  ==================================  ======================  ====================
form                h (the residual the MLP adds to)    MLP input               output
==================  ==================================  ======================  ====================
pre                 x + A(N1(x))                        N2(h)                   h + MLP(N2(h))
sandwich            x + N1'(A(N1(x)))                   N2(h)                   h + N2'(MLP(N2(h)))
post                N1(x + A(x))                        h                       N2(h + MLP(h))
none / residual     x + A(x)                            h                       h + MLP(h)
none / dherin       x + A(x)                            A(x)                    h + MLP(A(x))
none / none         0 (Dherin's plain block)            A(x)                    MLP(A(x))
==================  ==================================  ======================  ====================

The sites ``hook_mlp_in`` (the MLP input, "g" of the implicit-update theory) and ``hook_resid_mid``
(the residual value h the MLP output is added to, "q") are named the same in every form, so the
implicit-update operators read them without knowing the form. In the sandwich form ``hook_attn_out``
and ``hook_mlp_out`` are what is added to the residual (after N1', N2'; params ``ln1_post``,
``ln2_post``).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.nn.attention import Attention
from linicl.nn.norms import make_norm
from linicl.names import ACTIVATIONS
from linicl.nn.hooks import site

# One function per name of linicl.names.ACTIVATIONS (ModelConfig validates the name).
ACTIVATION_FNS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
}
assert tuple(ACTIVATION_FNS) == ACTIVATIONS


class MLP(nn.Module):
    """``fc_out(act(fc_in(x)))`` (with hidden ``fc_mid_j`` layers when ``mlp_depth > 2``), or gated
    ``fc_out(act(fc_gate(x)) * fc_in(x))``.

    ``fc_in.kernel`` (and ``fc_gate.kernel``) is the "first MLP matrix" W (stored as W^T,
    ``[d_model, d_ff]``) and ``fc_out.bias`` the "last MLP bias" b' of the implicit-update theory.
    Sites: ``hook_pre`` (``fc_in(x)``) and ``hook_post`` (the input of the next dense layer).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        dense = functools.partial(nn.Dense, use_bias=cfg.has_mlp_bias, dtype=dt, param_dtype=dt)
        act = ACTIVATION_FNS[cfg.activation]
        pre = site(self, "hook_pre", dense(cfg.d_ff, name="fc_in")(x))
        if cfg.mlp == "gated":
            h = act(dense(cfg.d_ff, name="fc_gate")(x)) * pre
        else:
            h = act(pre)
            for j in range(cfg.mlp_depth - 2):
                h = act(dense(cfg.d_ff, name=f"fc_mid_{j}")(h))
        return dense(cfg.d_model, name="fc_out")(site(self, "hook_post", h))


class Block(nn.Module):
    """One block in the form ``cfg.norm`` / ``cfg.skip`` (see the module docstring).

    Sites: ``hook_resid_pre`` (x), ``hook_attn_out`` (A), ``hook_resid_mid`` (h), ``hook_mlp_in``,
    ``hook_mlp_out``, ``hook_resid_post`` (the output), all ``[batch, seq, d_model]``.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x: f[batch, seq, d_model]``, ``positions: int[seq]`` -> ``f[batch, seq, d_model]``."""
        cfg = self.cfg
        attn, mlp = Attention(cfg, name="attn"), MLP(cfg, name="mlp")
        x = site(self, "hook_resid_pre", x)
        pre = cfg.norm in ("pre", "sandwich")
        sandwich = cfg.norm == "sandwich"
        a = attn(make_norm(cfg, "ln1")(x) if pre else x, positions)
        a = site(self, "hook_attn_out", make_norm(cfg, "ln1_post")(a) if sandwich else a)
        if pre:
            h = x + a
            g = make_norm(cfg, "ln2")(site(self, "hook_resid_mid", h))
        elif cfg.norm == "post":
            h = g = site(self, "hook_resid_mid", make_norm(cfg, "ln1")(x + a))
        else:
            h = site(self, "hook_resid_mid", {"residual": x + a, "dherin": x + a,
                                              "none": jnp.zeros_like(a)}[cfg.skip])
            g = h if cfg.skip == "residual" else a
        m = mlp(site(self, "hook_mlp_in", g))
        out = h + site(self, "hook_mlp_out", make_norm(cfg, "ln2_post")(m) if sandwich else m)
        if cfg.norm == "post":
            out = make_norm(cfg, "ln2")(out)
        return site(self, "hook_resid_post", out)
