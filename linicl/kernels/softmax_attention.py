"""Causal softmax attention over explicit query and key positions.

Causality is a comparison of positions (key position <= query position), so the same function serves
a full forward pass (both positions ``arange(T)``) and a decode step against a key-value cache whose
unfilled slots sit at positions later than every query.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp


def repeat_kv(a: jax.Array, n_heads: int) -> jax.Array:
    """Grouped-query attention: ``f[batch, kv_heads, seq, d]`` -> ``f[batch, n_heads, seq, d]``, query
    head h reading key/value head ``h // (n_heads // kv_heads)`` (the HF ``repeat_kv`` order)."""
    rep = n_heads // a.shape[1]
    return a if rep == 1 else jnp.repeat(a, rep, axis=1)


def causal_mask(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """``bool[q_seq, k_seq]``: True where the key may be attended."""
    return k_pos[None, :] <= q_pos[:, None]


def attention_logits(q, k, *, scale: Optional[float] = None) -> jax.Array:
    """Scaled scores q.k * scale, ``f[batch, heads, q_seq, k_seq]``, at least float32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    return jnp.einsum("bhtd,bhsd->bhts", q.astype(dtype), k.astype(dtype)) * scale


def attention_weights(logits, q_pos, k_pos, *, logit_bias=None) -> jax.Array:
    """Softmax over keys after an optional additive bias; the causal mask is applied after the bias."""
    if logit_bias is not None:
        logits = logits + logit_bias
    logits = jnp.where(causal_mask(q_pos, k_pos), logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)


def softmax_attention(q, k, v, q_pos, k_pos, *, logit_bias=None, scale: Optional[float] = None):
    """Causal softmax attention.

    Args:
      q: ``f[batch, heads, q_seq, d]``; k, v: ``f[batch, heads, k_seq, d]``.
      q_pos: ``int[q_seq]``; k_pos: ``int[k_seq]`` (the query at position p sees keys at <= p; every
        query must see at least one key).
      logit_bias: optional, broadcastable to ``f[batch, heads, q_seq, k_seq]``.
    Returns:
      ``f[batch, heads, q_seq, d]`` in v's dtype.
    """
    weights = attention_weights(attention_logits(q, k, scale=scale), q_pos, k_pos, logit_bias=logit_bias)
    return jnp.einsum("bhts,bhsd->bhtd", weights, v.astype(weights.dtype)).astype(v.dtype)
