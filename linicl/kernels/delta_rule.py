"""The (gated) delta rule with an initial state: DeltaNet and Gated DeltaNet, in three exact forms.

For one head, with keys k_t, queries q_t, values v_t, write strengths beta_t in (0, 1] and optional
log-gates a_t = log alpha_t <= 0 (one per head and token; None: alpha_t = 1, plain DeltaNet):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   S_{-1} = S0,   o_t = q_t^T S_t.

S is ``[d_k, d_v]``, keys along the rows, as linear attention's S = sum k v^T; the papers'
S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t (Yang et al.
arXiv 2406.06484 and 2412.06464) is its transpose. The read-out is not normalised. Equivalently

    S_t = alpha_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t):

the write is beta_t times the error of the decayed state's prediction for k_t, one step of online
least squares with learning rate beta_t ("test-time learning").

**Keys are assumed L2-normalised by the caller** (the kernel neither normalises nor checks). Then
each I - beta_t k_t k_t^T has eigenvalues 1 - beta_t and 1, the recurrence is non-expansive and every
form is stable; with beta_t |k_t|^2 > 2 the state grows exponentially in any form.

Chunks (the WY / UT-transform representation of Yang et al. 2406.06484, gated as in 2412.06464). In a
chunk of C tokens that starts from S0, with the prefix sums P_t = a_0 + ... + a_t of the chunk's
log-gates,

    S_t = e^{P_t} S0 + sum_{i<=t} e^{P_t - P_i} k_i u_i^T,

and the u's solve the unit lower-triangular system

    u_t + beta_t sum_{i<t} e^{P_t - P_i} (k_t . k_i) u_i = beta_t (v_t - e^{P_t} S0^T k_t),

that is (I + L) U = diag(beta) V - diag(beta e^P) K S0 with L[t, i] = beta_t e^{P_t - P_i} k_t . k_i for
i < t. With the UT transform T = (I + L)^{-1}, U = U~ - W S0 where U~ = T diag(beta) V and
W = T diag(beta e^P) K. Then, with D[t, i] = e^{P_t - P_i} (i <= t, else 0),

    O = diag(e^P) Q S0 + (Q K^T * D) U,       S_C = e^{P_{C-1}} S0 + (K * e^{P_{C-1} - P})^T U.

T is formed by block recursion (``_unit_lower_inverse``: log2(C) levels of batched products, the
accuracy of forward substitution) and applied once to the right-hand side diag(beta) V -
diag(beta e^P) K S0, which is U~ - W S0 without forming U~ and W apart. A ``lax.scan`` runs the chunks
one after another, each from the state the previous one left. (On a 2-core CPU this measured faster
than computing every chunk's T, U~ and W at once, the usual layout on accelerators; it keeps each
chunk's arrays in cache and holds O(C^2) per head in memory, not O(T C).)

As in ``gated_attention``, every exponent is a prefix sum P_t or a segment sum P_t - P_i with i <= t,
never positive: strong gates underflow to 0, nothing overflows. The segment sums are added up
directly (``gated_attention.segment_sums``), not subtracted, which would cancel in float32 and give
NaN for a log-gate of -inf.

Forms (every one takes the initial state and returns the outputs and the final state S_{T-1}; they
agree to rounding):

* ``parallel``: one chunk of T tokens (a T x T UT transform); O(T^2 (T + d_k + d_v)) work;
* ``chunked``: chunks of C tokens as above, O(T C (d_k + d_v) + T d_k d_v) work. The last chunk is
  padded with tokens that leave the state unchanged (beta = 0, k = 0, v = 0, log-gate 0: u = 0),
  whose outputs are dropped;
* ``recurrent``: a ``lax.scan`` over tokens of ``step``, the one-token update (the decode form).

Shapes: q, k: ``f[batch, heads, seq, d_k]``; v: ``f[batch, heads, seq, d_v]``; beta:
``f[batch, heads, seq]``; log_alpha: None or ``f[batch, heads, seq]``; S: ``f[batch, heads, d_k, d_v]``
(``DeltaState``). ``step`` takes the same arrays without the seq axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linicl.kernels.gated_attention import segment_sums
from linicl.kernels.linear_attention import choose_form
from linicl.names import FORMS

__all__ = ["DeltaState", "zero_state", "step", "parallel", "chunked", "recurrent", "delta_rule"]


class DeltaState(NamedTuple):
    """The delta-rule state of every head: the fast weight S (keys along the rows); no normaliser."""

    S: jax.Array  # f[batch, heads, d_k, d_v]


def zero_state(batch: int, heads: int, d_k: int, d_v: int, dtype) -> DeltaState:
    return DeltaState(jnp.zeros((batch, heads, d_k, d_v), dtype))


def _check(q, beta, log_alpha) -> None:
    want = tuple(q.shape[:-1])
    if tuple(beta.shape) != want:
        raise ValueError(f"beta must have shape {want} (one write strength per head and token), "
                         f"got {tuple(beta.shape)}")
    if log_alpha is not None and tuple(log_alpha.shape) != want:
        raise ValueError(f"log_alpha must be None or have shape {want} (one gate per head and token; the "
                         f"delta rule takes no per-feature gates), got {tuple(log_alpha.shape)}")


def _check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


# ---------------------------------------------------------------------------------- one token
def step(q, k, v, state: DeltaState, *, beta, log_alpha=None):
    """One token: q, k ``f[batch, heads, d_k]``, v ``f[batch, heads, d_v]``, beta and log_alpha
    ``f[batch, heads]`` (log_alpha may be None). Returns ``(o: f[batch, heads, d_v], state)``."""
    _check(q, beta, log_alpha)
    S = state.S
    if log_alpha is not None:
        S = S * jnp.exp(jnp.asarray(log_alpha, S.dtype))[..., None, None]
    u = jnp.asarray(beta, S.dtype)[..., None] * (v - jnp.einsum("bhf,bhfd->bhd", k, S))
    S = S + k[..., :, None] * u[..., None, :]
    return jnp.einsum("bhf,bhfd->bhd", q, S), DeltaState(S)


def recurrent(q, k, v, state: DeltaState, *, beta, log_alpha=None):
    """Token-by-token ``lax.scan`` of ``step``. Returns ``(o, final_state)``."""
    _check(q, beta, log_alpha)
    gates = jnp.zeros(q.shape[:3], q.dtype) if log_alpha is None else log_alpha

    def body(carry: DeltaState, x):
        q_t, k_t, v_t, b_t, a_t = x
        o_t, carry = step(q_t, k_t, v_t, carry, beta=b_t, log_alpha=None if log_alpha is None else a_t)
        return carry, o_t

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, beta, gates))
    final, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 2), final


# ---------------------------------------------------------------------------------- chunks
def _unit_lower_inverse(L: jax.Array) -> jax.Array:
    """(I + L)^{-1} for strictly lower-triangular L ``f[..., C, C]``, by block recursion.

    The inverse of a unit lower-triangular [[A, 0], [B, D]] is [[A^-1, 0], [-D^-1 B A^-1, D^-1]].
    Starting from the 1 x 1 diagonal blocks (whose inverses are 1), each level joins neighbouring
    diagonal blocks, all at once: log2(C) levels of batched matrix products (C is padded to a power
    of 2 with an identity block, which leaves the leading C x C block of the inverse as it is). This
    is the standard recursive triangular inversion (as in LAPACK's trtri), with forward
    substitution's accuracy; a LAPACK triangular solve per chunk is far slower on a CPU.
    """
    C = L.shape[-1]
    C2 = 1 << (C - 1).bit_length()
    if C2 != C:
        L = jnp.pad(L, [(0, 0)] * (L.ndim - 2) + [(0, C2 - C), (0, C2 - C)])
    batch = L.shape[:-2]
    inv = jnp.ones(batch + (C2, 1, 1), L.dtype)        # [..., blocks, s, s]: inverted diagonal blocks
    s = 1
    while s < C2:
        m = C2 // (2 * s)                               # the blocks of the next level, 2s x 2s
        joined = L.reshape(batch + (m, 2 * s, m, 2 * s))
        joined = jnp.moveaxis(jnp.diagonal(joined, axis1=-4, axis2=-2), -1, -3)  # [..., m, 2s, 2s]
        inv = inv.reshape(batch + (m, 2, s, s))
        upper, lower = inv[..., 0, :, :], inv[..., 1, :, :]
        corner = -(lower @ joined[..., s:, :s] @ upper)
        inv = jnp.concatenate([jnp.concatenate([upper, jnp.zeros_like(upper)], -1),
                               jnp.concatenate([corner, lower], -1)], -2)
        s *= 2
    return inv[..., 0, :C, :C]


def _chunk(q, k, v, beta, a, S):
    """One chunk of C tokens from the state S: q, k ``f[B, H, C, F]``, v ``f[B, H, C, D]``, beta and the
    log-gates a ``f[B, H, C]`` (a may be None), S ``f[B, H, F, D]``. Returns ``(o: f[B, H, C, D], S_C)``."""
    C = q.shape[-2]
    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    if a is None:
        decay, e_in, e_out, g = causal.astype(q.dtype), None, None, None      # D[t, i]
    else:
        G = segment_sums(a)                                 # G[t, i] = P_t - P_i, 0 above the diagonal
        P = jnp.cumsum(a, axis=-1)                          # P_t <= 0
        decay = jnp.where(causal, jnp.exp(G), 0)
        e_in, e_out, g = jnp.exp(P), jnp.exp(G[..., C - 1, :]), jnp.exp(P[..., C - 1])
    # Q K^T over K K^T in one product, then every product with S in another.
    qk = jnp.einsum("bhtf,bhif->bhti", jnp.concatenate([q, k], axis=-2), k)  # f[B, H, 2C, C]
    A = qk[..., :C, :] * decay                                               # (Q K^T * D)
    L = jnp.where(strict, beta[..., :, None] * qk[..., C:, :] * decay, 0)
    q_in = q if e_in is None else q * e_in[..., None]
    k_in = k * (beta if e_in is None else beta * e_in)[..., None]             # diag(beta e^P) K
    p = jnp.einsum("bhcf,bhfd->bhcd", jnp.concatenate([q_in, k_in], axis=-2), S)
    # U = T (diag(beta) V - diag(beta e^P) K S) = U~ - W S.
    U = _unit_lower_inverse(L) @ (beta[..., None] * v - p[..., C:, :])
    o = p[..., :C, :] + A @ U
    k_out = k if e_out is None else k * e_out[..., None]
    S = S if g is None else S * g[..., None, None]
    return o, S + jnp.einsum("bhcf,bhcd->bhfd", k_out, U)


def _forward(q, k, v, state: DeltaState, beta, log_alpha, chunk_size):
    """Shared by ``parallel`` (one chunk of T tokens) and ``chunked``."""
    _check(q, beta, log_alpha)
    B, H, T, _ = q.shape
    if T == 0:
        return jnp.zeros((B, H, 0, v.shape[-1]), v.dtype), state
    beta = jnp.asarray(beta, q.dtype)
    a = None if log_alpha is None else jnp.asarray(log_alpha, q.dtype)
    C = T if chunk_size is None else min(chunk_size, T)
    if C == T:
        o, S = _chunk(q, k, v, beta, a, state.S)
        return o, DeltaState(S)
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):  # [B, H, T, ...] -> [n, B, H, C, ...], padded with zeros (no write, no decay)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(B, H, n, C, *x.shape[3:]), 2, 0)

    def body(S, x):
        q_c, k_c, v_c, b_c, a_c = x
        o_c, S = _chunk(q_c, k_c, v_c, b_c, None if a is None else a_c, S)
        return S, o_c

    gates = jnp.zeros_like(beta) if a is None else a
    S, o = jax.lax.scan(body, state.S, tuple(chunks(x) for x in (q, k, v, beta, gates)))
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * C, v.shape[-1])[:, :, :T]
    return o, DeltaState(S)


def parallel(q, k, v, state: DeltaState, *, beta, log_alpha=None):
    """One chunk of T tokens (a T x T UT transform). Returns ``(o, final_state)``."""
    return _forward(q, k, v, state, beta, log_alpha, None)


def chunked(q, k, v, state: DeltaState, *, beta, log_alpha=None, chunk_size: int = 64):
    """The UT-transform form in chunks of ``chunk_size`` tokens, ``lax.scan`` of the state across
    chunks. Any T: the last chunk is padded with tokens that leave the state unchanged. Returns
    ``(o, final_state)``."""
    _check_chunk_size(chunk_size)
    return _forward(q, k, v, state, beta, log_alpha, chunk_size)


def delta_rule(q, k, v, state: DeltaState, *, beta, log_alpha=None, form: str = "auto",
               chunk_size: int = 64):
    """The (gated) delta rule from an initial state, in the given form (see module docstring).

    ``form="auto"`` is ``linear_attention.choose_form``: parallel up to 2 chunks, chunked after.
    Returns ``(o: f[batch, heads, seq, d_v], final_state: DeltaState)``.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    _check_chunk_size(chunk_size)
    if form == "auto":
        form = choose_form(q.shape[-2], chunk_size)
    kw = dict(beta=beta, log_alpha=log_alpha)
    if form == "parallel":
        return parallel(q, k, v, state, **kw)
    if form == "recurrent":
        return recurrent(q, k, v, state, **kw)
    return chunked(q, k, v, state, chunk_size=chunk_size, **kw)
