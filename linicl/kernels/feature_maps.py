"""Feature maps phi for linear attention: exp(q.k) is replaced by phi(q).phi(k).

Each map acts on the last axis: ``f[..., d] -> f[..., d_phi]``. The fixed maps are functions of x
alone (``get``); the learned ``hedgehog`` map also takes its per-head parameters (W, b).
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


def none(x: jax.Array) -> jax.Array:
    """No linear part: one zero feature, ``f[..., 1]``. In a hybrid layer (window or sinks) every
    linear term vanishes and the layer is softmax attention over its sinks and window alone (a
    sliding window with attention sinks, StreamingLLM): the baseline of a linearized model."""
    return jnp.zeros(x.shape[:-1] + (1,), x.dtype)


FEATURE_MAPS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "elu+1": elu_plus_one,
    "relu": relu,
    "identity": identity,
    "taylor2": taylor2,
    "none": none,
}


def hedgehog(x: jax.Array, W: jax.Array, b: jax.Array) -> jax.Array:
    """Hedgehog's learned map (Zhang et al. 2024): phi(x) = [softmax(xW + b), softmax(-(xW + b))].

    Both softmaxes run over the feature axis, so phi(x) > 0 and each half sums to one; phi(q).phi(k)
    is positive, hence a normalised attention has a positive denominator.
    Shapes: ``x: f[batch, heads, seq, d]``, ``W: f[heads, d, m]``, ``b: f[heads, m]`` ->
    ``f[batch, heads, seq, 2m]`` (one map per head).
    """
    a = jnp.einsum("bhtd,hdm->bhtm", x, W.astype(x.dtype)) + b.astype(x.dtype)[:, None, :]
    return jnp.concatenate([jax.nn.softmax(a, axis=-1), jax.nn.softmax(-a, axis=-1)], axis=-1)


def hedgehog_init_weight(d: int, m: int, dtype) -> jax.Array:
    """The deterministic initial W: ``f[d, m]`` with W[i, j] = 1 where i = j (mod min(d, m)), else 0.

    For m = d it is the identity (phi(x) = [softmax(x), softmax(-x)], a sensible kernel from the
    start); for m > d the identity is tiled (every feature reads one coordinate); for m < d the
    coordinates are folded onto the m features (feature j sums coordinates j, j + m, ...).
    """
    r = min(d, m)
    i, j = jnp.arange(d)[:, None], jnp.arange(m)[None, :]
    return ((i % r) == (j % r)).astype(dtype)


def get(name: str) -> Callable[[jax.Array], jax.Array]:
    if name == "hedgehog":
        raise ValueError("feature_map 'hedgehog' is learned: call feature_maps.hedgehog(x, W, b) with "
                         "the layer's parameters")
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {name!r}")
    return FEATURE_MAPS[name]


def feature_dim(name: str, d: int, size: int = 0) -> int:
    """Width d_phi of phi applied to vectors of width d (``size``: hedgehog's m, 0 meaning m = d)."""
    if name == "hedgehog":
        return 2 * (size or d)
    get(name)
    return {"taylor2": 1 + d + d * d, "none": 1}.get(name, d)
