"""A BERT encoder as a Linen module: ``BertEncoder(cfg)(ids, mask) -> hidden f[batch, seq, d_model]``.

The original BERT layout (as HF ``BertModel`` computes it, without its pooler): the sum of a word, a
learned absolute position and a token-type embedding (every token of type 0), a LayerNorm, then
``n_layers`` post-LN blocks, each

    h = LN_attn(x + o(attention(x)))            bidirectional, padding keys masked out
    y = LN_mlp(h + fc_out(gelu(fc_in(h))))      GELU with erf (not the tanh approximation)

Padding: ``mask`` (True for a real token) removes the padding keys from every softmax (their weights
are exactly 0), so the hidden states of the real tokens do not depend on how much padding follows
them. Rows of padding tokens are computed too (they attend to the real tokens) and mean nothing.

Parameters (``params``), with d = ``d_model``, H = ``n_heads``, dh = d / H:

* ``word_embed: [vocab, d]``, ``pos_embed: [max_len, d]``, ``type_embed: [type_vocab, d]``,
  ``ln_embed`` (``scale``, ``bias: [d]``);
* ``layers_{l}``: ``attn`` with ``q``, ``k``, ``v`` (``kernel [d, H, dh]``, ``bias [H, dh]``) and ``o``
  (``kernel [H, dh, d]``, ``bias [d]``); ``ln_attn``; ``mlp`` with ``fc_in`` (``kernel [d, d_ff]``,
  ``bias [d_ff]``) and ``fc_out`` (``kernel [d_ff, d]``, ``bias [d]``); ``ln_mlp``.

Every product runs at full precision (``Precision.HIGHEST``: no TF32 or bfloat16 passes on an
accelerator), so a float32 encoder matches a float32 reference to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linicl.errors import ConfigError

BERT_DTYPES = ("float32", "float64")
_HIGHEST = jax.lax.Precision.HIGHEST
_EMBED_INIT = nn.initializers.normal(stddev=0.02)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value <= 0:
        raise ConfigError(f"BertConfig.{name} must be a positive int, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters of a BERT encoder (hashable: a static argument of jitted functions).

    ``max_len`` is the number of learned positions (HF ``max_position_embeddings``), ``type_vocab``
    the number of token types, ``ln_eps`` the epsilon of every LayerNorm; ``dtype`` the parameters'
    and the arithmetic's type, ``"float32"`` or ``"float64"`` (the latter needs ``jax_enable_x64``).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_len: int
    type_vocab: int = 2
    ln_eps: float = 1e-12
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len", "type_vocab"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.d_model % self.n_heads:
            raise ConfigError(f"BertConfig: d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        eps = self.ln_eps
        if (not isinstance(eps, (int, float, np.integer, np.floating)) or isinstance(eps, (bool, np.bool_))
                or not math.isfinite(eps) or eps <= 0):
            raise ConfigError(f"BertConfig.ln_eps must be a finite number > 0, got {eps!r}")
        object.__setattr__(self, "ln_eps", float(eps))
        if self.dtype not in BERT_DTYPES:
            raise ConfigError(f"BertConfig.dtype={self.dtype!r}; expected one of {BERT_DTYPES}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def describe(self) -> str:
        return (f"BERT encoder (vocab {self.vocab_size}, d_model {self.d_model}, {self.n_layers} layers, "
                f"{self.n_heads} heads, d_ff {self.d_ff}, {self.max_len} positions, "
                f"{self.type_vocab} token types)")


def _layer_norm(cfg: BertConfig, name: str) -> nn.LayerNorm:
    """LayerNorm over the last axis with the biased variance of the centred values (two passes, as
    torch computes it; the one-pass E[x^2] - E[x]^2 loses float32 digits when the mean is large)."""
    dt = cfg.jnp_dtype
    return nn.LayerNorm(epsilon=cfg.ln_eps, dtype=dt, param_dtype=dt, use_fast_variance=False, name=name)


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head attention, ``x f[batch, seq, d], mask bool[batch, seq] -> f[batch, seq, d]``:
    softmax(q k^T / sqrt(dh)) v per head, with the keys where ``mask`` is False given weight 0."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        proj = functools.partial(nn.DenseGeneral, features=(cfg.n_heads, cfg.head_dim), dtype=dt,
                                 param_dtype=dt, precision=_HIGHEST)
        q, k, v = (proj(name=n)(x) for n in "qkv")  # [batch, seq, H, dh]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) * jnp.asarray(cfg.head_dim ** -0.5, dt)
        # Masked keys get the most negative finite score (not -inf: no NaN even for a row of padding).
        scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(dt).min)
        weights = jax.nn.softmax(scores, axis=-1)
        z = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=_HIGHEST)
        return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=dt, param_dtype=dt, precision=_HIGHEST,
                               name="o")(z)


class BertLayer(nn.Module):
    """One post-LN block: ``LN_mlp(h + MLP(h))`` with ``h = LN_attn(x + attention(x))``;
    ``x f[batch, seq, d], mask bool[batch, seq] -> f[batch, seq, d]``."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = _layer_norm(cfg, "ln_attn")(x + BertSelfAttention(cfg, name="attn")(x, mask))
        return _layer_norm(cfg, "ln_mlp")(h + BertMLP(cfg, name="mlp")(h))


class BertMLP(nn.Module):
    """``fc_out(gelu(fc_in(x)))`` with the exact (erf) GELU, ``f[batch, seq, d] -> f[batch, seq, d]``."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        dense = functools.partial(nn.Dense, dtype=dt, param_dtype=dt, precision=_HIGHEST)
        pre = dense(cfg.d_ff, name="fc_in")(x)
        return dense(cfg.d_model, name="fc_out")(jax.nn.gelu(pre, approximate=False))


class BertEncoder(nn.Module):
    """The encoder: ``ids int[batch, seq], mask bool[batch, seq] -> hidden f[batch, seq, d_model]``
    (HF ``BertModel``'s ``last_hidden_state``). ``mask`` is True for real tokens and False for padding;
    ``seq <= max_len``; every token has type 0 and position 0, 1, ... from the left."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        seq = ids.shape[-1]
        if seq > cfg.max_len:
            raise ConfigError(f"BertEncoder: {seq} tokens exceed the model's {cfg.max_len} learned positions")
        word = self.param("word_embed", _EMBED_INIT, (cfg.vocab_size, cfg.d_model), dt)
        pos = self.param("pos_embed", _EMBED_INIT, (cfg.max_len, cfg.d_model), dt)
        kind = self.param("type_embed", _EMBED_INIT, (cfg.type_vocab, cfg.d_model), dt)
        x = jnp.take(word, ids, axis=0) + pos[:seq] + kind[0]
        x = _layer_norm(cfg, "ln_embed")(x)
        mask = mask.astype(bool)
        for l in range(cfg.n_layers):
            x = BertLayer(cfg, name=f"layers_{l}")(x, mask)
        return x
