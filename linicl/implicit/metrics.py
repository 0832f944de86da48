"""Sizes and alignments of implicit updates, computed from their factors (no ΔW is materialised).

For rank-1 updates ΔW_i = u_i v_iᵀ: ‖ΔW_i‖_F = ‖u_i‖ ‖v_i‖ and ⟨ΔW_i, ΔW_j⟩_F = (u_i·u_j)(v_i·v_j),
summed over the first matrices of a gated MLP (the stacked [ΔW_in; ΔW_gate] is one rank-1 matrix).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linicl.implicit.operators import Update


def frobenius(upd: Update) -> jax.Array:
    """‖ΔW_i‖_F over every first matrix, ``f[..., T]`` (a rank-1 matrix: also its spectral norm)."""
    u2 = sum(jnp.sum(u * u, axis=-1) for u in upd.u.values())
    return jnp.sqrt(u2) * jnp.linalg.norm(upd.v, axis=-1)


def alignment(upd: Update) -> jax.Array:
    """DA(ΔW_i, ΔW_j) = ⟨ΔW_i, ΔW_j⟩_F / (‖ΔW_i‖_F ‖ΔW_j‖_F) for all pairs, ``f[..., T, T]``
    (Innocenti & Achour Eq. 36). NaN where an update is zero (e.g. a causal first token with its own
    reference: no context)."""
    uu = sum(jnp.einsum("...ih,...jh->...ij", u, u) for u in upd.u.values())
    inner = uu * jnp.einsum("...id,...jd->...ij", upd.v, upd.v)
    n = frobenius(upd)
    return inner / (n[..., :, None] * n[..., None, :])


def msd(a, b) -> jax.Array:
    """Mean squared difference over every element (Innocenti & Achour Eq. 35)."""
    return jnp.mean(jnp.square(jnp.asarray(a) - jnp.asarray(b)))
