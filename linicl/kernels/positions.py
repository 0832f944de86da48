"""Rotary position embeddings (RoPE) as a plain function of positions.

A rotation by angle p * theta_j acts on each pair of coordinates. Two pairing conventions exist:
``"interleaved"`` pairs (0, 1), (2, 3), ... (GPT-J, llama.cpp); ``"half"`` pairs (j, j + d/2)
(GPT-NeoX, HF Llama). With an odd width the last coordinate is left unrotated.
Rotations compose: rope(rope(x, a), b) == rope(x, a + b), and rope(x, -p) undoes rope(x, p); ICLCA
re-bases a linear-attention state with that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linicl.names import ROPE_STYLES


def rope_frequencies(dim: int, base: float, dtype) -> jax.Array:
    """theta_j = base^(-2j / d_rot) for the d_rot // 2 rotated pairs, ``f[d_rot // 2]``."""
    d_rot = dim - dim % 2
    return base ** (-jnp.arange(0, d_rot, 2, dtype=dtype) / d_rot)


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10_000.0,
               style: str = "interleaved") -> jax.Array:
    """Rotate the last axis of ``x`` by its positions.

    Args:
      x: ``f[..., d]``.
      positions: integer or float positions broadcastable to ``x.shape[:-1]`` (e.g. ``[seq]`` for
        ``x: [batch, heads, seq, d]``).
    Returns:
      ``f[..., d]``, same dtype as ``x``.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"style must be one of {ROPE_STYLES}, got {style!r}")
    d = x.shape[-1]
    n_pairs = d // 2
    if n_pairs == 0:
        return x
    theta = rope_frequencies(d, base, x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32)
    angle = jnp.asarray(positions, theta.dtype)[..., None] * theta  # [..., n_pairs]
    cos, sin = jnp.cos(angle).astype(x.dtype), jnp.sin(angle).astype(x.dtype)
    rot, rest = x[..., : 2 * n_pairs], x[..., 2 * n_pairs:]
    if style == "interleaved":
        pairs = rot.reshape(*rot.shape[:-1], n_pairs, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :n_pairs], rot[..., n_pairs:]
        out = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
