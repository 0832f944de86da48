"""Rotary position embeddings (RoPE) as a plain function of positions.

A rotation by angle p * theta_j acts on each pair of coordinates. Two pairing conventions exist:
``"interleaved"`` pairs (0, 1), (2, 3), ... (GPT-J, llama.cpp); ``"half"`` pairs (j, j + d/2)
(GPT-NeoX, HF Llama). With an odd width the last coordinate is left unrotated.
Rotations compose: rope(rope(x, a), b) == rope(x, a + b), and rope(x, -p) undoes rope(x, p); ICLCA
re-bases a linear-attention state with that.

Accurate angles in float32. The plain product p * theta_j is ~3e4 rad at p = 32k, and float32 holds
it only to ~2e-3 rad (its spacing there), besides the rounding of theta_j itself: rotated vectors
were off by 6e-4 relative at 32k positions. Only the angle modulo a full turn matters, so
``rope_angles`` works in turns, f_j = theta_j / 2 pi (known to float64 on the host: ``base`` and the
width are static), and splits both factors into parts of 12 significant bits, p = p1 + p2 and
f_j = f1 + f2 + f3 (f3 the small rest). A product of two 12-bit parts fits float32's 24-bit
significand, so p1 f1, p1 f2, p2 f1, p2 f2 are exact, and so is the fraction x - round(x) of each;
only the tiny p f3 and the sums of fractions (each in [-1, 1]) round. Measured against float64 up to
|p| = 2^20 (bases 1e4 and 5e5, widths 64 and 128): angles within 6.3e-7 rad, rotated vectors within
2.4e-7 relative. It needs no float64 at run time (``jax_enable_x64`` is off by default) and holds
for positions |p| < 2^24 (the integers float32 holds); in float64 the same steps are as exact (p2
keeps 41 bits there: still exact products).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from linicl.names import ROPE_STYLES

_PART_BITS = 12  # significant bits per part: a product of two parts is exact in float32 (24 bits)
_UINT = {4: jnp.uint32, 8: jnp.uint64}  # same-width unsigned type per float itemsize, for bit masks


def rope_frequencies(dim: int, base: float, dtype) -> jax.Array:
    """theta_j = base^(-2j / d_rot) for the d_rot // 2 rotated pairs, ``f[d_rot // 2]``."""
    d_rot = dim - dim % 2
    return base ** (-jnp.arange(0, d_rot, 2, dtype=dtype) / d_rot)


def _check_base(base) -> float:
    """``base`` as a Python float: the angles are prepared on the host, so it must be concrete."""
    try:
        b = float(base)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"base must be a concrete number > 0 (the rope base, a static setting), got "
                         f"{base!r}") from None
    if not (math.isfinite(b) and b > 0):
        raise ValueError(f"base must be a finite number > 0, got {base!r}")
    return b


def _leading(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` rounded toward zero to 12 significant bits (exactly representable in float32)."""
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(np.ldexp(m, _PART_BITS)), e - _PART_BITS)


def _turn_parts(dim: int, base: float) -> tuple:
    """(f1, f2, f3), float64 ``[dim // 2]`` each: f_j = theta_j / 2 pi = f1 + f2 + f3 turns per
    position, f1 and f2 of 12 significant bits (f1 + f2 holds f_j to ~2^-23 relative)."""
    d_rot = dim - dim % 2
    f = base ** (-np.arange(0, d_rot, 2, dtype=np.float64) / d_rot) / (2 * np.pi)
    f1 = _leading(f)
    f2 = _leading(f - f1)
    return f1, f2, f - f1 - f2


def _leading_bits(x: jax.Array) -> jax.Array:
    """``x`` (float32 or float64) with all but its 12 leading significant bits zeroed: same sign and
    exponent, so x - result is exact too. By bit mask, which no compiler rewrites."""
    uint = _UINT[x.dtype.itemsize]
    drop = jnp.finfo(x.dtype).nmant - (_PART_BITS - 1)    # explicit mantissa bits to clear
    mask = jnp.asarray(~((1 << drop) - 1) & ((1 << 8 * x.dtype.itemsize) - 1), uint)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, uint) & mask, x.dtype)


def _fraction(x: jax.Array) -> jax.Array:
    """x minus the nearest integer, in [-1/2, 1/2]: exact in floating point."""
    return x - jnp.round(x)


def rope_angles(positions, dim: int, base: float, dtype) -> jax.Array:
    """The rotation angles p * theta_j reduced to [-pi, pi], accurate in ``dtype`` at large |p|.

    Args:
      positions: integer or float positions, any shape ``[...]``.
      dim: the rotated width (``dim // 2`` pairs); base: the rope base (a concrete number > 0).
      dtype: float32 or float64, the arithmetic's precision.
    Returns:
      ``dtype[..., dim // 2]``, each within ~1e-6 rad (float32) of the exact angle mod 2 pi for
      |p| < 2^24 (see the module docstring).
    """
    f1, f2, f3 = (jnp.asarray(f, dtype) for f in _turn_parts(dim, _check_base(base)))
    p = jnp.asarray(positions, dtype)[..., None]
    p1 = _leading_bits(p)
    p2 = p - p1                                           # the other (at most) 12 bits, exact
    # Each exact product contributes its fraction of a turn; adding fractions keeps sums in [-1, 1].
    turns = _fraction(p1 * f1)
    for part in (p1 * f2, p2 * f1, p2 * f2, p * f3):
        turns = _fraction(turns + _fraction(part))
    return turns * jnp.asarray(2 * np.pi, dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10_000.0,
               style: str = "interleaved") -> jax.Array:
    """Rotate the last axis of ``x`` by its positions.

    Args:
      x: ``f[..., d]``.
      positions: integer or float positions broadcastable to ``x.shape[:-1]`` (e.g. ``[seq]`` for
        ``x: [batch, heads, seq, d]``).
      base: the rope base, a concrete number > 0.
    Returns:
      ``f[..., d]``, same dtype as ``x``. The angles are computed in float64 for float64 ``x``, else
      in float32 (``rope_angles``), then cos and sin are cast to ``x``'s dtype.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"style must be one of {ROPE_STYLES}, got {style!r}")
    d = x.shape[-1]
    n_pairs = d // 2
    if n_pairs == 0:
        return x
    angle = rope_angles(positions, d, base, jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
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
