"""Feature maps phi for linear attention: exp(q.k) is replaced by phi(q).phi(k).

Each map acts on the last axis: ``f[..., d] -> f[..., d_phi]``.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp


def elu_plus_one(x: jax.Array) -> jax.Array:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020)."""
    return jax.nn.elu(x) + 1


def relu(x: jax.Array) -> jax.Array:
    return jax.nn.relu(x)


def identity(x: jax.Array) -> jax.Array:
    """phi(x) = x: the unnormalised linear attention of the ICL theory papers."""
    return x


def taylor2(x: jax.Array) -> jax.Array:
    """Second-order Taylor features of exp(q.k / sqrt(d)).

    phi(x) = [1, x~, vec(x~ x~^T) / sqrt(2)] with x~ = x / d^(1/4), so that
    phi(q).phi(k) = 1 + s + s^2 / 2 with s = q.k / sqrt(d); it is positive for every s.
    ``f[..., d] -> f[..., 1 + d + d^2]``.
    """
    d = x.shape[-1]
    x = x / math.sqrt(math.sqrt(d))
    outer = (x[..., :, None] * x[..., None, :]).reshape(*x.shape[:-1], d * d)
    return jnp.concatenate([jnp.ones_like(x[..., :1]), x, outer / math.sqrt(2.0)], axis=-1)


FEATURE_MAPS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "elu+1": elu_plus_one,
    "relu": relu,
    "identity": identity,
    "taylor2": taylor2,
}


def get(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {name!r}")
    return FEATURE_MAPS[name]


def feature_dim(name: str, d: int) -> int:
    """Width d_phi of phi applied to vectors of width d."""
    get(name)
    return 1 + d + d * d if name == "taylor2" else d
