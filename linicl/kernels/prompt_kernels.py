"""Kernel approximations of a softmax prompt: the approximate ICLCA conversion's numerics (plain jnp).

Inside a softmax head a prompt enters only through its numerator and partition at each query,
N(q) = sum_i e^{s_i} v_i and Z(q) = sum_i e^{s_i} with s_i = q.k_i / sqrt(d). A feature map with
phi(q).phi(k) ~ e^{q.k/sqrt d} turns both into bias terms, N ~ phi(q)^T B and Z ~ phi(q)^T b with
B = sum_i phi(k_i) v_i^T and b = sum_i phi(k_i) (iclca.md, section 7):

* ``"taylor2"``: phi(q).phi(k) = 1 + s + s^2/2 (accurate for small logits);
* ``"prf"``: positive random features exp(w.x~ - |x~|^2/2)/sqrt(m), x~ = x / d^(1/4), whose inner
  products are unbiased estimates of e^s (Performer);
* ``"elu+1"``: elu(x~) + 1, the linear-attention map of the exact models (not an approximation of
  exp: its prompt weight has the wrong scale, kept as the baseline the paper may have used);
* ``"learned"``: a linearized student's hedgehog maps, one for queries and one for keys
  (``feature_maps.hedgehog`` with the layer's W, b). They were trained in LoLCATs' hybrid, where
  phi_q(q).phi_k(k) stands next to g_h e^{s - c_t}, not next to e^s, so their prompt terms join the
  input through ``hybrid_weights``.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from linicl.kernels.feature_maps import hedgehog, taylor2
from linicl.names import APPROX_KERNELS


def prf_projection(key: jax.Array, heads: int, n_features: int, d: int, dtype) -> jax.Array:
    """Gaussian projections ``f[heads, n_features, d]`` for positive random features (one draw per
    head, seeded by ``key``)."""
    return jax.random.normal(key, (heads, n_features, d), dtype)


def features(kernel: str, x: jax.Array, W: Optional[jax.Array] = None,
             b: Optional[jax.Array] = None) -> jax.Array:
    """``phi(x)`` for ``x: f[batch, heads, seq, d]`` -> ``f[batch, heads, seq, F]``. ``W``: the prf
    projections ``f[heads, m, d]``, or the learned map's ``f[heads, d, m]`` with its ``b: f[heads, m]``
    (F = 2m); the fixed kernels take neither."""
    d = x.shape[-1]
    if kernel == "taylor2":
        return taylor2(x)
    if kernel == "learned":
        if W is None or b is None:
            raise ValueError("the 'learned' kernel needs its map's W and b")
        return hedgehog(x, W, b)
    xs = x / math.sqrt(math.sqrt(d))
    if kernel == "elu+1":
        return jax.nn.elu(xs) + 1
    if kernel == "prf":
        if W is None:
            raise ValueError("the 'prf' kernel needs its projections W")
        proj = jnp.einsum("bhtd,hmd->bhtm", xs, W.astype(xs.dtype))
        return jnp.exp(proj - 0.5 * jnp.sum(xs * xs, axis=-1, keepdims=True)) / math.sqrt(W.shape[1])
    raise ValueError(f"kernel must be one of {APPROX_KERNELS}, got {kernel!r}")


def prompt_state(kernel: str, k: jax.Array, v: jax.Array, W: Optional[jax.Array] = None,
                 b: Optional[jax.Array] = None, weights: Optional[jax.Array] = None):
    """``B = sum_i w_i phi(k_i) v_i^T: f[batch, heads, F, d]`` and ``b = sum_i w_i phi(k_i): f[batch,
    heads, F]`` from prompt keys and values ``f[batch, heads, n, d]`` (``W``, ``b``: as for
    ``features``; the learned kernel's key map). ``weights: f[batch or 1, heads, n]`` (default 1):
    0 leaves a token out of one head's sums (it is kept exact there instead)."""
    fk = features(kernel, k, W, b)
    if weights is not None:
        fk = fk * weights[..., None].astype(fk.dtype)
    return jnp.einsum("bhnf,bhnd->bhfd", fk, v.astype(fk.dtype)), fk.sum(axis=2)


def prompt_terms(phi_q: jax.Array, B: jax.Array, b: jax.Array):
    """The approximated prompt numerator ``N: f[batch, heads, seq, d]`` and partition
    ``Z: f[batch, heads, seq]`` at queries with features ``phi_q: f[batch, heads, seq, F]``."""
    return jnp.einsum("bhtf,bhfd->bhtd", phi_q, B), jnp.einsum("bhtf,bhf->bht", phi_q, b)


def shared_softmax(logits: jax.Array, Z_prompt: jax.Array):
    """Weights of the visible keys and of the prompt terms when both share one normaliser:
    ``w_i = e^{s_i} / (Z + sum_j e^{s_j})`` and ``c = 1 / (Z + sum_j e^{s_j})``, so that the output is
    ``sum_i w_i v_i + c N`` and the prompt's share of the attention is ``rho = c Z``.

    ``logits: f[..., keys]`` with invisible keys at -inf (each query sees at least one key),
    ``Z_prompt: f[...]``. Both parts are scaled by one stabiliser m = max(max_j s_j, log Z), never by
    the input's maximum alone (iclca.md, section 7.4). A non-positive Z (possible for a fitted b) is
    used as given: the result is then not a convex mixture, which the caller reports.
    """
    m_in = jnp.max(logits, axis=-1)
    safe_log = jnp.log(jnp.where(Z_prompt > 0, Z_prompt, 1.0))
    m = jnp.where(Z_prompt > 0, jnp.maximum(m_in, safe_log), m_in)
    e = jnp.exp(logits - m[..., None])
    scale = jnp.exp(-m)
    den = Z_prompt * scale + e.sum(axis=-1)
    return e / den[..., None], scale / den


def hybrid_weights(logits: jax.Array, g: jax.Array, Z_prompt: jax.Array):
    """The weights of LoLCATs' hybrid, with the prompt as its linear part: the exact (visible) keys
    weigh ``g_h e^{s_i - c_t}``, c_t = max_j s_j, the prompt ``Z = phi_q(q).b``, under one normaliser
    ``D = sum_j g_h e^{s_j - c_t} + Z``. Returns ``(w_i = g_h e^{s_i - c_t} / D, 1 / D)``: the output is
    ``sum_i w_i v_i + N / D``.

    ``logits: f[batch, heads, T, keys]`` with invisible keys at -inf (each query sees itself),
    ``g: f[heads]``, ``Z_prompt: f[batch, heads, T]``. c_t is part of the formula, not a stabiliser:
    the learned maps were trained next to e^{s - c_t} (``hybrid_attention``), and a different shift
    would change the balance between the two parts.
    """
    c = jnp.max(logits, axis=-1, keepdims=True)
    e = g.astype(logits.dtype)[:, None, None] * jnp.exp(logits - c)
    den = e.sum(axis=-1) + Z_prompt
    return e / den[..., None], 1 / den
