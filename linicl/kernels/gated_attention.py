"""Causal gated linear attention with an initial state: a decay computed from each token.

For one head, with numerator features q_t, k_t, denominator features q~_t, k~_t (q and k unless
given, as in ``linear_attention``), values v_t and log-gates a_t = log alpha_t <= 0:

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,   z_t = alpha_t * z_{t-1} + k~_t,   (S_{-1}, z_{-1}) = (S0, z0)
    o_t = q_t^T S_t / (q~_t^T z_t + eps)   (normalize=True)       o_t = q_t^T S_t   (normalize=False)

The gate is one of three kinds, told apart by the shape of ``log_alpha``:

* ``None``: no gate (alpha_t = 1), plain causal linear attention;
* scalar, ``f[batch, heads, seq]``: one decay per head and token (Mamba-2, Gated DeltaNet); a fixed
  per-head decay gamma (RetNet, ``linear_attention``'s ``log_gamma``) is the constant gate log gamma_h;
* vector, ``f[batch, heads, seq, d_phi]``: one decay per key feature (GLA). It scales the rows of S
  (the key-feature axis) and z elementwise, so that S_t[f] = alpha_t[f] S_{t-1}[f] + k_t[f] v_t^T.

Unrolled, with the prefix sums P_t = a_0 + ... + a_t (per feature for vector gates),

    S_t = exp(P_t) S0 + sum_{i<=t} exp(P_t - P_i) k_i v_i^T,

and likewise for z. Every exponent the forms evaluate is a prefix sum P_t or a segment sum
P_t - P_i = a_{i+1} + ... + a_t with i <= t, both <= 0, so no exp of a large positive number occurs.
The segment sums are added up directly (``segment_sums``), never taken as the difference of two prefix
sums: that difference cancels (in float32 it is off by ~|P_i| 2^-24, 1e-2 relative error in the
outputs at log alpha = -1e6) and is NaN once a log-gate is -inf (-inf - (-inf)). Summed directly, a
gate of -inf, or one so strong that exp underflows, makes every weight across it exactly 0, as in the
recurrent form, and the other weights keep full precision.

The initial state is what ICLCA stores: a prompt enters later tokens only through it. Every form
returns the outputs and the final state (S_{T-1}, z_{T-1}) (z is carried even when
``normalize=False``, as in ``linear_attention``); the three forms agree to rounding:

* ``parallel``: the quadratic masked form (one chunk of T tokens), O(T^2 d) work; with vector gates
  it also holds the ``[T, T, d_phi]`` decay weights in memory, so it is meant for short sequences;
* ``chunked``: the parallel form inside chunks of C tokens, a ``lax.scan`` across chunks, each from
  the state the previous one left: O(T C d + T d_phi d_v) work (vector gates: O(T C d_phi) of it
  exps, and ``[C, C, d_phi]`` weights per chunk in memory). The last chunk is padded with tokens that
  leave the state unchanged (k = k~ = 0, v = 0, log-gate 0), and their outputs are dropped before
  the division;
* ``recurrent``: a ``lax.scan`` over tokens of ``step``, the one-token update (the decode form).

Shapes: q, k (and q_den, k_den): ``f[batch, heads, seq, d_phi]``; v: ``f[batch, heads, seq, d_v]``;
log_alpha: None, ``f[batch, heads, seq]`` or ``f[batch, heads, seq, d_phi]``; the state is a
``LinearState`` (the same as linear attention's): S ``f[batch, heads, d_phi, d_v]``, z
``f[batch, heads, d_phi]``. ``step`` takes the same arrays without the seq axis.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from linicl.kernels.linear_attention import LinearState, choose_form, zero_state
from linicl.names import FORMS

__all__ = ["LinearState", "zero_state", "gate_kind", "auto_form", "segment_sums", "step", "parallel", "chunked",
           "recurrent", "gated_attention"]


def gate_kind(q: jax.Array, log_alpha: Optional[jax.Array]) -> str:
    """``"none"``, ``"scalar"`` or ``"vector"``: the kind of gate ``log_alpha`` is for queries ``q``
    ``f[batch, heads, seq, d_phi]`` (or one token's ``f[batch, heads, d_phi]``)."""
    if log_alpha is None:
        return "none"
    if log_alpha.shape == q.shape[:-1]:
        return "scalar"
    if log_alpha.shape == q.shape:
        return "vector"
    raise ValueError(f"log_alpha must have shape {tuple(q.shape[:-1])} (one gate per head and token) or "
                     f"{tuple(q.shape)} (one per key feature), got {tuple(log_alpha.shape)}")


def _check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


# ---------------------------------------------------------------------------------- one token
def step(q, k, v, state: LinearState, *, log_alpha=None, q_den=None, k_den=None,
         normalize: bool = True, eps: float = 0.0):
    """One token: q, k ``f[batch, heads, d_phi]``, v ``f[batch, heads, d_v]``, log_alpha None,
    ``f[batch, heads]`` or ``f[batch, heads, d_phi]``. Returns ``(o: f[batch, heads, d_v], state)``."""
    q_den = q if q_den is None else q_den
    k_den = k if k_den is None else k_den
    S, z = state
    kind = gate_kind(q, log_alpha)
    if kind != "none":
        alpha = jnp.exp(jnp.asarray(log_alpha, S.dtype))
        if kind == "scalar":
            S, z = S * alpha[..., None, None], z * alpha[..., None]
        else:  # one decay per key feature: the rows of S
            S, z = S * alpha[..., :, None], z * alpha
    S = S + k[..., :, None] * v[..., None, :]
    z = z + k_den
    o = jnp.einsum("bhf,bhfd->bhd", q, S)
    if normalize:
        o = o / (jnp.einsum("bhf,bhf->bh", q_den, z) + eps)[..., None]
    return o, LinearState(S, z)


def recurrent(q, k, v, state: LinearState, *, log_alpha=None, q_den=None, k_den=None,
              normalize: bool = True, eps: float = 0.0):
    """Token-by-token ``lax.scan`` of ``step``. Returns ``(o, final_state)``."""
    q_den = q if q_den is None else q_den
    k_den = k if k_den is None else k_den
    kind = gate_kind(q, log_alpha)
    gates = jnp.zeros(q.shape[:3], q.dtype) if kind == "none" else log_alpha

    def body(carry: LinearState, x):
        q_t, k_t, v_t, qd_t, kd_t, a_t = x
        o_t, carry = step(q_t, k_t, v_t, carry, log_alpha=None if kind == "none" else a_t,
                          q_den=qd_t, k_den=kd_t, normalize=normalize, eps=eps)
        return carry, o_t

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, q_den, k_den, gates))
    final, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 2), final


# ---------------------------------------------------------------------------------- chunks
class _Decay(NamedTuple):
    """A chunk's decay factors (None where there is no gate)."""

    intra: Optional[jax.Array]  # exp(P_t - P_i) for i <= t, else 0: f[B, H, C, C] or f[B, H, C, C, F]
    into: Optional[jax.Array]   # exp(P_t), the decay since the chunk began: f[B, H, C] or f[B, H, C, F]
    out: Optional[jax.Array]    # exp(P_last - P_i), the decay to the chunk's end: as ``into``
    whole: Optional[jax.Array]  # exp(P_last), the whole chunk's decay: f[B, H] or f[B, H, F]


def _strict_running_sums(x: jax.Array, axis: int) -> jax.Array:
    """R[m', m] = x_{m+1} + ... + x_{m'} for m < m', else 0: the running sum along ``axis`` (length L)
    of x masked to the later entries, a new axis (the start m) inserted after ``axis``. Only terms of
    one sign are added; O(L^2) memory and, as a cumsum on a CPU, O(L^3) work: meant for short axes."""
    L = x.shape[axis]
    later = jnp.tril(jnp.ones((L, L), bool), -1)
    later = later.reshape(later.shape + (1,) * (x.ndim - axis - 1))  # broadcast over the trailing axes
    return jnp.cumsum(jnp.where(later, jnp.expand_dims(x, axis + 1), 0), axis=axis)


def segment_sums(a: jax.Array) -> jax.Array:
    """G[t, i] = a_{i+1} + ... + a_t for i <= t, else 0, summed directly (no difference of prefix sums).

    a: log-gates ``f[B, H, C]`` or ``f[B, H, C, F]`` (token axis 2, every entry <= 0, -inf allowed).
    Returns ``f[B, H, C, C]`` or ``f[B, H, C, C, F]`` (t, then i).

    Only terms of one sign are ever added, so there is no cancellation, and -inf stays -inf (never
    -inf - (-inf) = NaN). The tokens are cut into blocks of s ~ sqrt(C): within a block G is a
    running sum; across blocks K > k it is three pieces, the rest of i's block after i, the whole
    blocks between, and t's block up to t. That is O(C^2) work per feature, where one running sum
    over all C tokens would cost O(C^3) on a CPU (a cumsum is a windowed sum there).
    """
    C = a.shape[2]
    s = max(1, math.isqrt(C))
    n = -(-C // s)
    if n * s != C:  # pad with log-gates 0: they add nothing, and their rows and columns are cut off
        a = jnp.pad(a, [(0, 0), (0, 0), (0, n * s - C)] + [(0, 0)] * (a.ndim - 3))
    x = a.reshape(a.shape[:2] + (n, s) + a.shape[3:])                    # [B, H, block, token, (F)]
    upto = jnp.cumsum(x, axis=3)                                         # block start .. t
    rest = jnp.flip(jnp.cumsum(jnp.flip(x, 3), axis=3), 3)               # i .. block end
    after = jnp.concatenate([rest[:, :, :, 1:], jnp.zeros_like(rest[:, :, :, :1])], axis=3)  # i+1 ..
    blocks = _strict_running_sums(upto[:, :, :, s - 1], axis=2)          # [K, k]: blocks k+1 .. K
    between = jnp.concatenate([jnp.zeros_like(blocks[:, :, :1]), blocks[:, :, :-1]], axis=2)  # .. K-1
    # [B, H, K, t, k, i, (F)]: the three pieces across blocks, the running sum within one.
    across = upto[:, :, :, :, None, None] + between[:, :, :, None, :, None] + after[:, :, None, None]
    within = _strict_running_sums(x, axis=3)[:, :, :, :, None]
    K = jnp.arange(n)
    tail = (1,) * (a.ndim - 3)
    same = (K[:, None] == K[None, :]).reshape((n, 1, n, 1) + tail)
    later = (K[:, None] > K[None, :]).reshape((n, 1, n, 1) + tail)
    G = jnp.where(same, within, jnp.where(later, across, 0))
    return G.reshape(a.shape[:2] + (n * s, n * s) + a.shape[3:])[:, :, :C, :C]


def _decay(a: Optional[jax.Array], kind: str, C: int) -> _Decay:
    """The decay factors of a chunk of C tokens with log-gates a (``f[B, H, C]`` or ``f[B, H, C, F]``)."""
    if kind == "none":
        return _Decay(None, None, None, None)
    causal = jnp.tril(jnp.ones((C, C), bool))
    mask = causal if kind == "scalar" else causal[:, :, None]
    G = segment_sums(a)                                # G[t, i] = P_t - P_i <= 0 on and below the diagonal
    P = jnp.cumsum(a, axis=2)                          # P_t <= 0
    # G is 0 above the diagonal, so exp(G) is 1 there, never an overflow; those weights are zeroed.
    intra = jnp.where(mask, jnp.exp(G), 0)
    return _Decay(intra, jnp.exp(P), jnp.exp(G[:, :, C - 1]), jnp.exp(P[:, :, C - 1]))


def _chunk(q, k, v, S, decay: _Decay, kind: str):
    """The unnormalised recurrence S_t = diag(alpha_t) S_{t-1} + k_t v_t^T over one chunk of C tokens:
    q, k ``f[B, H, C, F]``, v ``f[B, H, C, D]``, S ``f[B, H, F, D]``. Returns ``(o: f[B, H, C, D], S_C)``."""
    C = q.shape[-2]
    if kind == "none":
        A = jnp.where(jnp.tril(jnp.ones((C, C), bool)), jnp.einsum("bhtf,bhif->bhti", q, k), 0)
        return jnp.einsum("bhtf,bhfd->bhtd", q, S) + A @ v, S + jnp.einsum("bhcf,bhcd->bhfd", k, v)
    if kind == "scalar":
        A = jnp.einsum("bhtf,bhif->bhti", q, k) * decay.intra
        q_in, k_out = q * decay.into[..., None], k * decay.out[..., None]
        whole = decay.whole[..., None, None]
    else:  # A[t, i] = sum_f q_t[f] k_i[f] exp(P_t[f] - P_i[f]); the gate scales the rows of S
        A = jnp.einsum("bhtf,bhif,bhtif->bhti", q, k, decay.intra)
        q_in, k_out = q * decay.into, k * decay.out
        whole = decay.whole[..., :, None]
    o = jnp.einsum("bhtf,bhfd->bhtd", q_in, S) + A @ v
    return o, S * whole + jnp.einsum("bhcf,bhcd->bhfd", k_out, v)


def _forward(q, k, v, state: LinearState, log_alpha, q_den, k_den, normalize, eps, chunk_size):
    """Shared by ``parallel`` (one chunk of T tokens) and ``chunked``."""
    kind = gate_kind(q, log_alpha)
    same_den = q_den is None and k_den is None
    q_den = q if q_den is None else q_den
    k_den = k if k_den is None else k_den
    B, H, T, _ = q.shape
    D = v.shape[-1]
    if T == 0:
        return jnp.zeros((B, H, 0, D), v.dtype), state
    a = jnp.zeros((B, H, T), q.dtype) if kind == "none" else jnp.asarray(log_alpha, q.dtype)
    ones = jnp.ones((B, H, T, 1), v.dtype)
    if same_den:
        # z is the state of the same recurrence with value 1: one pass with v augmented by ones.
        xs = (q, k, jnp.concatenate([v, ones], -1), a)
        init = jnp.concatenate([state.S, state.z[..., None]], -1)
    else:
        xs = (q, k, v, q_den, k_den, ones, a)
        init = (state.S, state.z[..., None])

    def one_chunk(carry, x):
        decay = _decay(x[-1], kind, x[0].shape[-2])
        if same_den:
            return _chunk(*x[:3], carry, decay, kind)
        o, S = _chunk(*x[:3], carry[0], decay, kind)
        o_den, z = _chunk(*x[3:6], carry[1], decay, kind)
        return (o, o_den), (S, z)

    C = T if chunk_size is None else min(chunk_size, T)
    if C == T:
        o, final = one_chunk(init, xs)
    else:
        n = -(-T // C)
        pad = n * C - T

        def chunks(x):  # [B, H, T, ...] -> [n, B, H, C, ...], padded with zeros (log-gate 0: no decay)
            if pad:
                x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
            return jnp.moveaxis(x.reshape(B, H, n, C, *x.shape[3:]), 2, 0)

        def body(carry, x):
            o, carry = one_chunk(carry, x)
            return carry, o

        final, o = jax.lax.scan(body, init, tuple(chunks(x) for x in xs))
        o = jax.tree_util.tree_map(lambda y: jnp.moveaxis(y, 0, 2).reshape(B, H, n * C, -1)[:, :, :T], o)
    if same_den:
        num, den, S, z = o[..., :D], o[..., D], final[..., :D], final[..., D]
    else:
        (num, den), (S, z) = (o[0], o[1][..., 0]), (final[0], final[1][..., 0])
    if not normalize:
        return num, LinearState(S, z)
    return num / (den + eps)[..., None], LinearState(S, z)


def parallel(q, k, v, state: LinearState, *, log_alpha=None, q_den=None, k_den=None,
             normalize: bool = True, eps: float = 0.0):
    """Quadratic masked form. See the module docstring for shapes; returns ``(o, final_state)``."""
    return _forward(q, k, v, state, log_alpha, q_den, k_den, normalize, eps, None)


def chunked(q, k, v, state: LinearState, *, log_alpha=None, q_den=None, k_den=None,
            normalize: bool = True, eps: float = 0.0, chunk_size: int = 64):
    """Parallel form inside chunks of ``chunk_size`` tokens, ``lax.scan`` of the state across chunks.

    Any T: the last chunk is padded with tokens that leave the state unchanged. Returns
    ``(o, final_state)``.
    """
    _check_chunk_size(chunk_size)
    return _forward(q, k, v, state, log_alpha, q_den, k_den, normalize, eps, chunk_size)


def auto_form(kind: str, T: int, chunk_size: int) -> str:
    """The default form. A vector gate's quadratic forms weigh every (t, i, feature) triple,
    ``f[C, C, F]`` per chunk: on 2 CPU cores (float32, 4 heads, d 64) the recurrent scan was the
    fastest at every length measured, 3-80x ahead of parallel and chunked at T = 32..8192 (chunk 16:
    2-4x; chunk 64: 5-16x), and under ``grad`` it keeps no more per token (F x D) than a chunk of 64
    does (C x F). A scalar gate or none: ``choose_form``."""
    return "recurrent" if kind == "vector" else choose_form(T, chunk_size)


def gated_attention(q, k, v, state: LinearState, *, log_alpha=None, q_den=None, k_den=None,
                    normalize: bool = True, eps: float = 0.0, form: str = "auto", chunk_size: int = 64):
    """Causal gated linear attention from an initial state, in the given form (see module docstring).

    ``form="auto"`` (``auto_form``): recurrent for a vector gate, else ``linear_attention.choose_form``
    (parallel up to 2 chunks, chunked after). Returns ``(o: f[batch, heads, seq, d_v], final_state:
    LinearState)``.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    _check_chunk_size(chunk_size)
    if form == "auto":
        form = auto_form(gate_kind(q, log_alpha), q.shape[-2], chunk_size)
    kw = dict(log_alpha=log_alpha, q_den=q_den, k_den=k_den, normalize=normalize, eps=eps)
    if form == "parallel":
        return parallel(q, k, v, state, **kw)
    if form == "recurrent":
        return recurrent(q, k, v, state, **kw)
    return chunked(q, k, v, state, chunk_size=chunk_size, **kw)
