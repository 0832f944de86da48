"""Causal linear attention with an initial state, in three exact forms.

For one head, with numerator features q_t, k_i (phi(q), phi(k), possibly rotated), denominator
features q~_t, k~_i (the unrotated phi), values v_i and per-head decay gamma:

    S_t = gamma S_{t-1} + k_t v_t^T,      z_t = gamma z_{t-1} + k~_t,      (S_{-1}, z_{-1}) = (S0, z0)
    o_t = q_t^T S_t / (q~_t^T z_t + eps)   (normalize=True)       o_t = q_t^T S_t   (normalize=False)

The initial state is what ICLCA stores: a prompt enters later tokens only through it. Every form
returns the outputs and the final state (S_{T-1}, z_{T-1}); the three forms agree to rounding:

* ``parallel``: the quadratic masked form, O(T^2) work, best for short sequences;
* ``chunked``: parallel inside chunks of C tokens and a ``lax.scan`` of the state across chunks;
* ``recurrent``: a ``lax.scan`` over tokens (the decode form).

Shapes: q, k: ``f[batch, heads, seq, d_phi]``; v: ``f[batch, heads, seq, d_v]``;
S: ``f[batch, heads, d_phi, d_v]``; z: ``f[batch, heads, d_phi]``; log_gamma: ``f[heads]`` or None.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from linicl.names import FORMS


class LinearState(NamedTuple):
    """The linear-attention state of every head: S = sum phi(k) v^T, z = sum phi(k)."""

    S: jax.Array  # f[batch, heads, d_phi, d_v]
    z: jax.Array  # f[batch, heads, d_phi]


def zero_state(batch: int, heads: int, d_phi: int, d_v: int, dtype) -> LinearState:
    return LinearState(jnp.zeros((batch, heads, d_phi, d_v), dtype), jnp.zeros((batch, heads, d_phi), dtype))


def _gamma_powers(log_gamma: jax.Array, exponents: jax.Array) -> jax.Array:
    """gamma_h ** e for every head and exponent e >= 0, ``f[heads, len(exponents)]``.

    gamma^0 is 1 by definition (no step, no decay), also for gamma = 0 (log_gamma = -inf, which the
    recurrent form takes): 0 * -inf would be NaN, so a zero exponent is never multiplied out.
    """
    e = exponents[None, :]
    return jnp.exp(jnp.where(e == 0, 0, log_gamma[:, None] * e.astype(log_gamma.dtype)))


def _decay_matrix(log_gamma: Optional[jax.Array], T: int, dtype) -> jax.Array:
    """D[t, i] = gamma^(t - i) for i <= t, else 0: ``f[heads, T, T]`` (``f[T, T]`` without decay)."""
    t = jnp.arange(T)
    diff = t[:, None] - t[None, :]
    causal = diff >= 0
    if log_gamma is None:
        return causal.astype(dtype)
    # The exponent is 0 on and above the diagonal: above it gamma^(negative) could overflow (those
    # entries are zeroed after the exp), and on it gamma^0 = 1 even for gamma = 0 (0 * -inf is NaN).
    later = (diff > 0)[None]
    w = jnp.exp(jnp.where(later, diff[None].astype(dtype) * log_gamma[:, None, None], 0))
    return jnp.where(causal[None], w, 0).astype(dtype)


def parallel(q, k, v, state: LinearState, *, q_den=None, k_den=None, log_gamma=None,
             normalize: bool = True, eps: float = 0.0):
    """Quadratic masked form. See the module docstring for shapes; returns ``(o, final_state)``."""
    q_den = q if q_den is None else q_den
    k_den = k if k_den is None else k_den
    T = q.shape[-2]
    D = _decay_matrix(log_gamma, T, q.dtype)
    A = jnp.einsum("bhtf,bhsf->bhts", q, k) * D
    num = jnp.einsum("bhts,bhsd->bhtd", A, v)
    num_init = jnp.einsum("bhtf,bhfd->bhtd", q, state.S)
    if log_gamma is None:
        S = state.S + jnp.einsum("bhsf,bhsd->bhfd", k, v)
        z = state.z + k_den.sum(axis=-2)
        num = num + num_init
    else:
        g_in = _gamma_powers(log_gamma, jnp.arange(1, T + 1))        # gamma^(t+1): the state's age
        g_out = _gamma_powers(log_gamma, jnp.arange(T - 1, -1, -1))  # gamma^(T-1-i): to the end
        g_T = _gamma_powers(log_gamma, jnp.asarray([T]))[:, 0]
        S = state.S * g_T[:, None, None] + jnp.einsum("bhsf,bhsd->bhfd", k * g_out[:, :, None], v)
        z = state.z * g_T[:, None] + (k_den * g_out[:, :, None]).sum(axis=-2)
        num = num + num_init * g_in[:, :, None]
    if not normalize:
        return num, LinearState(S, z)
    A_den = A if (q_den is q and k_den is k) else jnp.einsum("bhtf,bhsf->bhts", q_den, k_den) * D
    den_init = jnp.einsum("bhtf,bhf->bht", q_den, state.z)
    if log_gamma is not None:
        den_init = den_init * g_in
    den = A_den.sum(axis=-1) + den_init
    return num / (den + eps)[..., None], LinearState(S, z)


def recurrent(q, k, v, state: LinearState, *, q_den=None, k_den=None, log_gamma=None,
              normalize: bool = True, eps: float = 0.0):
    """Token-by-token ``lax.scan`` over the state. Returns ``(o, final_state)``."""
    q_den = q if q_den is None else q_den
    k_den = k if k_den is None else k_den
    gamma = None if log_gamma is None else jnp.exp(log_gamma)

    def step(carry: LinearState, x):
        q_t, k_t, v_t, qd_t, kd_t = x  # f[batch, heads, .]
        S, z = carry
        if gamma is not None:
            S, z = S * gamma[:, None, None], z * gamma[:, None]
        S = S + k_t[..., :, None] * v_t[..., None, :]
        z = z + kd_t
        o = jnp.einsum("bhf,bhfd->bhd", q_t, S)
        if normalize:
            o = o / (jnp.einsum("bhf,bhf->bh", qd_t, z) + eps)[..., None]
        return LinearState(S, z), o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, q_den, k_den))
    final, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 2), final


def chunked(q, k, v, state: LinearState, *, q_den=None, k_den=None, log_gamma=None,
            normalize: bool = True, eps: float = 0.0, chunk_size: int = 64):
    """Parallel form inside chunks of ``chunk_size`` tokens, ``lax.scan`` of the state across chunks.

    A remainder of T mod chunk_size tokens is handled by one more parallel call, so no padding (which
    would decay the state) is needed. Returns ``(o, final_state)``.
    """
    same_den = q_den is None and k_den is None
    q_den = q if q_den is None else q_den
    k_den = k if k_den is None else k_den
    T = q.shape[-2]
    n_chunks, rest = divmod(T, chunk_size)
    kw = dict(log_gamma=log_gamma, normalize=normalize, eps=eps)
    if n_chunks <= 1:
        return parallel(q, k, v, state, q_den=None if same_den else q_den,
                        k_den=None if same_den else k_den, **kw)

    def split(a):  # [B, H, n*C, F] -> [n, B, H, C, F]
        a = a[:, :, : n_chunks * chunk_size]
        return jnp.moveaxis(a.reshape(*a.shape[:2], n_chunks, chunk_size, a.shape[-1]), 2, 0)

    def body(carry, x):
        q_c, k_c, v_c, qd_c, kd_c = x
        if same_den:
            o_c, carry = parallel(q_c, k_c, v_c, carry, **kw)
        else:
            o_c, carry = parallel(q_c, k_c, v_c, carry, q_den=qd_c, k_den=kd_c, **kw)
        return carry, o_c

    final, o = jax.lax.scan(body, state, tuple(split(a) for a in (q, k, v, q_den, k_den)))
    o = jnp.moveaxis(o, 0, 2).reshape(*q.shape[:2], n_chunks * chunk_size, v.shape[-1])
    if rest:
        tail = slice(n_chunks * chunk_size, None)
        o_tail, final = parallel(q[:, :, tail], k[:, :, tail], v[:, :, tail], final,
                                 q_den=None if same_den else q_den[:, :, tail],
                                 k_den=None if same_den else k_den[:, :, tail], **kw)
        o = jnp.concatenate([o, o_tail], axis=2)
    return o, final


def choose_form(T: int, chunk_size: int) -> str:
    """The default form for a sequence of T tokens: quadratic while it is cheap, chunked after."""
    return "parallel" if T <= 2 * chunk_size else "chunked"


def linear_attention(q, k, v, state: LinearState, *, q_den=None, k_den=None, log_gamma=None,
                     normalize: bool = True, eps: float = 0.0, form: str = "auto",
                     chunk_size: int = 64):
    """Causal linear attention from an initial state, in the given form (see module docstring).

    Returns ``(o: f[batch, heads, seq, d_v], final_state: LinearState)``.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if form == "auto":
        form = choose_form(q.shape[-2], chunk_size)
    kw = dict(q_den=q_den, k_den=k_den, log_gamma=log_gamma, normalize=normalize, eps=eps)
    if form == "parallel":
        return parallel(q, k, v, state, **kw)
    if form == "recurrent":
        return recurrent(q, k, v, state, **kw)
    return chunked(q, k, v, state, chunk_size=chunk_size, **kw)
