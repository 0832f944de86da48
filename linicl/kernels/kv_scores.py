"""Query-agnostic scores of a prompt's keys: which exact keys and values a stored prompt should keep.

A prompt converted into a state is read later by queries it has not seen. The scores here rank its
cached keys by what the whole prompt says about them (never by the later query); ``linicl.selection``
runs the model to get the queries these functions read, and allocates the budget.

Shapes: keys ``k: f[G, s, d]`` per KV head (G kv heads, rotated as the decode cache holds them) and
queries ``q: f[G, r, t, d]`` grouped by the KV head they read (r = heads / G query heads per group),
rotated and scaled as the model scores them: the model's logit is ``scale * q . k``.

* ``received``: the attention each key receives from a set of queries, reduced over those queries
  (``"max"``: KVzip's reconstruction score, arXiv 2505.23416; ``"sum"``: H2O's accumulated attention,
  arXiv 2306.14048; ``"mean"``: SnapKV's observation window, arXiv 2404.14469). Each query's softmax
  is over the keys it sees (``visible``); the query rows are processed ``chunk`` at a time with a
  running reduction, so no call holds more than ``chunk x s`` weights per head.
* ``expected``: Expected Attention (arXiv 2510.00636): the softmax over keys of the expected logit
  ``E[exp(scale q.k)] = exp(scale mu.k + scale^2 k^T Sigma k / 2)`` for future queries q ~ N(mu,
  Sigma) (their pre-rope statistics rotated by the mean rope rotation of the next positions),
  times ``||v||``.
* ``pool``: SnapKV's smoothing of a score along the tokens (a centred moving average).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from linicl.kernels.positions import apply_rope

REDUCTIONS = ("max", "sum", "mean")


def received(q: jax.Array, k: jax.Array, visible: jax.Array, scored: jax.Array, *, scale: float,
             reduce: str, chunk: int = 256) -> jax.Array:
    """Attention received by each key from the queries, reduced over the queries and a group's heads.

    Args:
      q: ``f[G, r, t, d]`` queries grouped by KV head; k: ``f[G, s, d]`` keys.
      visible: ``bool[t, s]``: which keys each query's softmax runs over (causality, and for KVzip the
        subset of the cache it normalises over). Every query must see at least one key.
      scored: ``bool[s]``: the key columns whose weight counts (other visible keys only normalise).
      scale: the model's logit scale (``1 / sqrt(d)`` unless the model says otherwise).
      reduce: ``"max"`` over queries and the group's heads; ``"sum"`` or ``"mean"`` over queries, then
        the mean over the group's heads.
    Returns:
      ``f[G, s]``: the score of every key; 0 at columns not ``scored``.
    """
    G, r, t, d = q.shape
    pad = (-t) % chunk
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    visible = jnp.pad(visible, ((0, pad), (0, 0)))  # padded rows see nothing and count nothing
    rows = jnp.arange(t + pad) < t
    qc = q.reshape(G, r, -1, chunk, d).transpose(2, 0, 1, 3, 4)  # [n_chunks, G, r, chunk, d]
    vc, rc = visible.reshape(-1, chunk, visible.shape[1]), rows.reshape(-1, chunk)
    dtype = jnp.promote_types(q.dtype, jnp.float32)

    def step(acc, xs):
        qi, vi, ri = xs
        logits = jnp.einsum("grtd,gsd->grts", qi.astype(dtype), k.astype(dtype)) * scale
        logits = jnp.where(vi[None, None], logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        w = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0))
        w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), jnp.finfo(dtype).tiny)
        w = jnp.where((ri[:, None] & scored[None, :])[None, None], w, 0)
        if reduce == "max":
            return jnp.maximum(acc, jnp.max(w, axis=(1, 2))), None
        return acc + jnp.mean(jnp.sum(w, axis=2), axis=1), None

    acc, _ = jax.lax.scan(step, jnp.zeros((G, k.shape[1]), dtype), (qc, vc, rc))
    if reduce == "mean":
        acc = acc / t
    return acc


def mean_rotation(positions: jax.Array, d: int, base: float, style: str, dtype) -> jax.Array:
    """``f[d, d]``: the mean over ``positions`` of the rope rotation R(p) (``apply_rope(x, p) = R(p) x``),
    built by rotating the identity, so it follows any rope style."""
    eye = jnp.eye(d, dtype=dtype)
    rotated = apply_rope(jnp.broadcast_to(eye, (positions.shape[0], d, d)), positions[:, None], base, style)
    return jnp.mean(rotated, axis=0).T  # rows of apply_rope(eye) are R(p) e_i, i.e. R(p)^T


def expected(mu: jax.Array, cov: Optional[jax.Array], k: jax.Array, v: jax.Array, *,
             scale: float) -> jax.Array:
    """Expected Attention scores ``f[G, s]``.

    Args:
      mu: ``f[G, r, d]`` the future queries' mean, cov: ``f[G, r, d, d]`` their covariance (or None:
        the mean alone), both already rotated to the future positions; k, v: ``f[G, s, d]``.
    Returns:
      Per query head the softmax over the keys of ``scale mu.k + scale^2 k^T Sigma k / 2`` (the log of
      E[exp(scale q.k)] under q ~ N(mu, Sigma)), averaged over the group's heads, times ``||v||``.
    """
    dtype = jnp.promote_types(k.dtype, jnp.float32)
    k = k.astype(dtype)
    logit = jnp.einsum("grd,gsd->grs", mu.astype(dtype), k) * scale
    if cov is not None:
        logit = logit + 0.5 * scale ** 2 * jnp.einsum("gsd,grde,gse->grs", k, cov.astype(dtype), k)
    w = jax.nn.softmax(logit, axis=-1).mean(axis=1)
    return w * jnp.linalg.norm(v.astype(dtype), axis=-1)


def pool(scores: jax.Array, width: int) -> jax.Array:
    """``scores: f[..., s]`` smoothed by a centred moving average over ``width`` tokens (odd), the
    window cut at both ends and divided by the full width, as a zero-padded average pool."""
    if width <= 1:
        return scores
    kernel = jnp.ones((width,), scores.dtype) / width
    flat = scores.reshape(-1, scores.shape[-1])
    out = jax.vmap(lambda x: jnp.convolve(x, kernel, mode="same"))(flat)
    return out.reshape(scores.shape)
