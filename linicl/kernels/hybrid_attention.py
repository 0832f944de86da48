"""Linear attention with an exact softmax window and attention sinks (LoLCATs' hybrid), in exact forms.

For one head, a query at absolute position t, keys i <= t (rotated q_t, k_i for the exact logits;
numerator features f_t = phi(q_t), f_i = phi(k_i) and denominator features f~_t, f~_i; values v_i):

    E(t) = {i <= t : i < sinks  or  t - i < window}          (exact: sinks and the window)
    L(t) = {i <= t : i not in E(t)}                          (linear: everything older)
    y_t  = [sum_{E} g gamma^(t-i) e^{q_t.k_i/sqrt(d) - c_t} v_i + sum_{L} gamma^(t-i) f_t.f_i v_i]
         / [sum_{E} g gamma^(t-i) e^{q_t.k_i/sqrt(d) - c_t}   + sum_{L} gamma^(t-i) f~_t.f~_i + eps]

with g = sigmoid(gate) per head and c_t = max_{i in E(t)} q_t.k_i/sqrt(d) (part of the model, so the
same in every form and on both sides of any identity). Positions are absolute: every form takes the
positions of its tokens, and the state remembers those of the keys it holds.

The state (``HybridState``), all bounded: (S, z) of the non-sink tokens that have left the window, the
window's last ``window - 1`` tokens (rotated key, features, value, position) and the sinks' keys,
values and positions. Keys and values are stored once per key/value head (grouped-query attention
shares them among a group of query heads); features and (S, z) once per query head, because a feature
map may have per-query-head parameters (hedgehog's key map, applied to the repeated keys). Empty
slots have position -1 (shapes are static). The window buffer holds the last tokens read, sinks
included; a buffered token at a position < sinks is skipped (the sink buffer counts it). A token
leaving the buffer enters (S, z) unless it is a sink. S holds sum gamma^(t_last - i) f_i v_i^T up to
the last position read, like ``linear_attention``'s state.

Every form returns the outputs and the final state; they agree to rounding:

* ``parallel``: quadratic masks over [sinks, window buffer, this call's tokens];
* ``chunked``: ``parallel`` inside chunks, a ``lax.scan`` of the state across them;
* ``recurrent``: a ``lax.scan`` over tokens (the decode form), pushing and popping the buffers.

Shapes, with H = heads (query heads) and G = kv_heads (key/value heads; G divides H and query head h
reads key/value head h // (H // G), the HF ``repeat_kv`` order; G = H is plain multi-head attention):
q: ``f[batch, heads, seq, d]``; k: ``f[batch, kv_heads, seq, d]``; v: ``f[batch, kv_heads, seq, d_v]``;
fq, fk (and fq_den, fk_den): ``f[batch, heads, seq, F]``; positions: ``int[seq]`` (consecutive); gate,
log_gamma: ``f[heads]``. Values are repeated to the query heads inside the kernel where they meet
per-query-head weights (the outputs, (S, z)); only the G-head copies are stored. The kernel needs
an exact part (window >= 1 or sinks >= 1): every query then has at least one exact key (itself, or
the sinks before it).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from linicl.errors import LiniclError
from linicl.kernels.softmax_attention import repeat_kv
from linicl.names import FORMS


class HybridState(NamedTuple):
    """The state of a hybrid layer (W' = max(window - 1, 0) buffered tokens, s = sinks). Keys and
    values have the key/value heads, everything else the query heads (module docstring)."""

    S: jax.Array        # f[batch, heads, F, d_v]: linear part, sum gamma^(t-i) phi(k_i) v_i^T
    z: jax.Array        # f[batch, heads, F]: sum gamma^(t-i) phi~(k_i)
    win_k: jax.Array    # f[batch, kv_heads, W', d]: rotated keys of the last W' tokens
    win_fk: jax.Array   # f[batch, heads, W', F]: their numerator features
    win_fkd: jax.Array  # f[batch, heads, W', F]: their denominator features
    win_v: jax.Array    # f[batch, kv_heads, W', d_v]
    win_pos: jax.Array  # int32[W']: their positions, -1 for an empty slot (oldest first)
    sink_k: jax.Array   # f[batch, kv_heads, s, d]
    sink_v: jax.Array   # f[batch, kv_heads, s, d_v]
    sink_pos: jax.Array  # int32[s]: slot j holds position j once read, else -1


def empty_state(batch: int, heads: int, d: int, d_phi: int, d_v: int, window: int, sinks: int,
                dtype, kv_heads: Optional[int] = None) -> HybridState:
    """The state before any token: zeros, every slot empty; keys and values for ``kv_heads`` heads
    (default ``heads``), which must divide ``heads``."""
    G = check_kv_heads("empty_state", heads, heads if kv_heads is None else kv_heads)
    w = max(window - 1, 0)
    z = lambda *s: jnp.zeros((batch, heads) + s, dtype)  # noqa: E731
    kv = lambda *s: jnp.zeros((batch, G) + s, dtype)  # noqa: E731
    return HybridState(z(d_phi, d_v), z(d_phi), kv(w, d), z(w, d_phi), z(w, d_phi), kv(w, d_v),
                       jnp.full((w,), -1, jnp.int32), kv(sinks, d), kv(sinks, d_v),
                       jnp.full((sinks,), -1, jnp.int32))


def check_kv_heads(fn: str, heads: int, kv_heads, what: str = "kv_heads") -> int:
    """``kv_heads`` if it is an int >= 1 dividing ``heads``, else a LiniclError naming ``what``."""
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise LiniclError(f"{fn}: {what} must divide the {heads} query heads (grouped-query attention: "
                          f"query head h reads key/value head h // (heads // kv_heads)), got {kv_heads!r}")
    return kv_heads


def check_heads(fn: str, q, k, v, state) -> int:
    """The key/value heads G of ``k``, ``v`` (and the state's stored keys and values), checked against
    the query heads of ``q`` and the state. Returns G."""
    H = q.shape[1]
    G = check_kv_heads(fn, H, int(k.shape[1]), f"k's heads (k{tuple(k.shape)}, q{tuple(q.shape)})")
    if v.shape[1] != G:
        raise LiniclError(f"{fn}: v must have k's {G} key/value heads, got v{tuple(v.shape)}")
    for name in ("win_k", "win_v", "sink_k", "sink_v"):
        a = getattr(state, name)
        if a.shape[1] != G:
            raise LiniclError(f"{fn}: the state's {name}{tuple(a.shape)} holds {a.shape[1]} key/value heads, "
                              f"but k has {G} (k{tuple(k.shape)}); make the state with kv_heads={G}")
    if state.S.shape[1] != H:
        raise LiniclError(f"{fn}: the state's S{tuple(state.S.shape)} holds {state.S.shape[1]} heads, but q has "
                          f"{H} (q{tuple(q.shape)})")
    return G


def _decay(log_gamma: Optional[jax.Array], age: jax.Array, valid: jax.Array, dtype) -> jax.Array:
    """gamma_h^age where valid, else 0: ``f[heads, *age.shape]`` (``f[1, ...]`` without decay)."""
    if log_gamma is None:
        return valid[None].astype(dtype)
    safe = jnp.where(valid, age, 0)[None].astype(dtype)  # gamma^(negative) could overflow
    return jnp.where(valid[None], jnp.exp(safe * log_gamma.reshape((-1,) + (1,) * age.ndim)), 0)


def _exact_weights(q, k, mask, gate, D):
    """g gamma^(t-i) e^{q.k/sqrt(d) - c_t} on the masked entries: ``f[batch, heads, T, n]``."""
    logits = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    logits = jnp.where(mask, logits, -jnp.inf)
    c = jnp.max(logits, axis=-1, keepdims=True)
    c = jnp.where(jnp.isfinite(c), c, 0)  # a row with no exact key (never, given the contract)
    e = jnp.where(mask, jnp.exp(logits - c), 0)
    return jax.nn.sigmoid(gate)[:, None, None] * D * e


def _sink_update(sink, pos_sink, x, positions):
    """Write the tokens at positions < sinks into their slots: ``x: f[b, h, T, .]``."""
    slots = jnp.arange(pos_sink.shape[0], dtype=jnp.int32)
    match = positions[None, :] == slots[:, None]  # [s, T]
    hit = match.any(axis=1)
    new = jnp.einsum("jt,bhtd->bhjd", match.astype(x.dtype), x)
    return jnp.where(hit[:, None], new, sink), jnp.where(hit, slots, pos_sink)


def parallel(q, k, fq, fk, v, positions, state: HybridState, *, gate, window: int, sinks: int,
             fq_den=None, fk_den=None, log_gamma=None, eps: float = 0.0):
    """Quadratic masked form. Returns ``(o: f[batch, heads, seq, d_v], final_state)``."""
    check_heads("hybrid_attention", q, k, v, state)
    H = q.shape[1]
    fq_den = fq if fq_den is None else fq_den
    fk_den = fk if fk_den is None else fk_den
    T, w = q.shape[2], state.win_pos.shape[0]
    t = positions.astype(jnp.int32)
    # Window candidates: the buffer, then this call's tokens (oldest first).
    c_pos = jnp.concatenate([state.win_pos, t])
    c_k, c_fk, c_fkd, c_v = (jnp.concatenate([a, b], 2) for a, b in (
        (state.win_k, k), (state.win_fk, fk), (state.win_fkd, fk_den), (state.win_v, v)))
    age = t[:, None] - c_pos[None, :]
    visible = (c_pos[None, :] >= 0) & (age >= 0)
    in_buffer = jnp.arange(w + T) < w
    exact = visible & ~(in_buffer & (c_pos < sinks))[None, :] & ((c_pos < sinks)[None, :] | (age < window))
    linear = visible & (c_pos >= sinks)[None, :] & (age >= window)
    # Sinks read before this call: always visible, always exact.
    s_age = t[:, None] - state.sink_pos[None, :]
    s_exact = jnp.broadcast_to(state.sink_pos[None, :] >= 0, s_age.shape)

    dt = v.dtype
    # Keys and values per query head, for this call's sums only (the state keeps the G-head copies).
    c_vh = repeat_kv(c_v, H)
    ex = _exact_weights(q, repeat_kv(jnp.concatenate([state.sink_k, c_k], 2), H),
                        jnp.concatenate([s_exact, exact], 1), gate,
                        jnp.concatenate([_decay(log_gamma, s_age, s_exact, dt),
                                         _decay(log_gamma, age, exact, dt)], -1)[None])
    D_lin = _decay(log_gamma, age, linear, dt)[None]
    A = jnp.einsum("bhtf,bhsf->bhts", fq, c_fk) * D_lin
    A_den = jnp.einsum("bhtf,bhsf->bhts", fq_den, c_fkd) * D_lin
    g_in = _decay(log_gamma, jnp.arange(1, T + 1), jnp.ones((T,), bool), dt)  # the state's age
    num = (jnp.einsum("bhts,bhsd->bhtd", ex, jnp.concatenate([repeat_kv(state.sink_v, H), c_vh], 2))
           + jnp.einsum("bhts,bhsd->bhtd", A, c_vh)
           + jnp.einsum("bhtf,bhfd->bhtd", fq, state.S) * g_in[None, :, :, None])
    den = (ex.sum(-1) + A_den.sum(-1)
           + jnp.einsum("bhtf,bhf->bht", fq_den, state.z) * g_in[None])

    # Final state: the first T candidates leave the window (into S, z unless sinks), the last w stay.
    t_last = t[-1]
    leave_pos = c_pos[:T]
    enters = (leave_pos >= 0) & (leave_pos >= sinks)
    g_out = _decay(log_gamma, t_last - leave_pos, enters, dt)  # [heads or 1, T]
    g_T = _decay(log_gamma, jnp.asarray(T), jnp.asarray(True), dt)
    S = state.S * g_T[None, :, None, None] + jnp.einsum(
        "bhsf,bhsd->bhfd", c_fk[:, :, :T] * g_out[None, :, :, None], c_vh[:, :, :T])
    z = state.z * g_T[None, :, None] + (c_fkd[:, :, :T] * g_out[None, :, :, None]).sum(2)
    sink_k, sink_pos = _sink_update(state.sink_k, state.sink_pos, k, t)
    sink_v, _ = _sink_update(state.sink_v, state.sink_pos, v, t)
    final = HybridState(S, z, c_k[:, :, T:], c_fk[:, :, T:], c_fkd[:, :, T:], c_v[:, :, T:],
                        c_pos[T:], sink_k, sink_v, sink_pos)
    return num / (den + eps)[..., None], final


def recurrent(q, k, fq, fk, v, positions, state: HybridState, *, gate, window: int, sinks: int,
              fq_den=None, fk_den=None, log_gamma=None, eps: float = 0.0):
    """Token-by-token ``lax.scan``: the buffers shift by one token per step. Returns ``(o, final)``."""
    check_heads("hybrid_attention", q, k, v, state)
    H = q.shape[1]
    fq_den = fq if fq_den is None else fq_den
    fk_den = fk if fk_den is None else fk_den
    gamma = None if log_gamma is None else jnp.exp(log_gamma)
    g = jax.nn.sigmoid(gate)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def weight(age, valid):  # f[heads, n]: gamma^age where valid
        if gamma is None:
            return jnp.broadcast_to(valid, (1,) + valid.shape).astype(v.dtype)
        return jnp.where(valid[None], gamma[:, None] ** jnp.where(valid, age, 0)[None], 0)

    def step(st: HybridState, x):
        q_t, k_t, fq_t, fk_t, fqd_t, fkd_t, v_t, t = x  # f[batch, heads or kv_heads (k_t, v_t), .], int32[]
        S, z = (st.S, st.z) if gamma is None else (st.S * gamma[:, None, None], st.z * gamma[:, None])
        sink_t = t < sinks
        if window == 0:  # the current token is linear unless a sink: it enters before the output
            add = jnp.where(sink_t, 0, 1).astype(v.dtype)
            S = S + add * fk_t[..., :, None] * repeat_kv(v_t, H)[..., None, :]
            z = z + add * fkd_t
        keys = repeat_kv(jnp.concatenate([st.sink_k, st.win_k, k_t[:, :, None]], 2), H)
        vals = repeat_kv(jnp.concatenate([st.sink_v, st.win_v, v_t[:, :, None]], 2), H)
        pos = jnp.concatenate([st.sink_pos, st.win_pos, t[None]])
        n_s = st.sink_pos.shape[0]
        origin_win = (jnp.arange(pos.shape[0]) >= n_s) & (jnp.arange(pos.shape[0]) < pos.shape[0] - 1)
        mask = (pos >= 0) & ~(origin_win & (pos < sinks)) & ((pos < sinks) | (t - pos < window))
        logits = jnp.einsum("bhd,bhsd->bhs", q_t, keys) * scale
        logits = jnp.where(mask, logits, -jnp.inf)
        c = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(c), c, 0)), 0)
        e = g[:, None] * weight(t - pos, mask) * e
        num = jnp.einsum("bhs,bhsd->bhd", e, vals) + jnp.einsum("bhf,bhfd->bhd", fq_t, S)
        den = e.sum(-1) + jnp.einsum("bhf,bhf->bh", fqd_t, z)
        o = num / (den + eps)[..., None]
        # Push the current token into the window buffer; the token popped (the current one when the
        # buffer has no slots) enters the linear state unless it is a sink or empty.
        if st.win_pos.shape[0]:
            pop = (st.win_fk[:, :, 0], st.win_fkd[:, :, 0], st.win_v[:, :, 0], st.win_pos[0])
            shift = lambda buf, new: jnp.concatenate([buf[:, :, 1:], new[:, :, None]], 2)  # noqa: E731
            win = (shift(st.win_k, k_t), shift(st.win_fk, fk_t), shift(st.win_fkd, fkd_t),
                   shift(st.win_v, v_t), jnp.concatenate([st.win_pos[1:], t[None]]))
        else:
            pop = (fk_t, fkd_t, v_t, t)
            win = (st.win_k, st.win_fk, st.win_fkd, st.win_v, st.win_pos)
        if window > 0:
            p_fk, p_fkd, p_v, p_pos = pop
            enters = (p_pos >= 0) & (p_pos >= sinks)
            w_pop = weight(t - p_pos[None], enters[None])[:, 0]  # f[heads or 1]
            S = S + w_pop[:, None, None] * p_fk[..., :, None] * repeat_kv(p_v, H)[..., None, :]
            z = z + w_pop[:, None] * p_fkd
        slot = (jnp.arange(n_s) == t)
        sink_k = jnp.where(slot[:, None], k_t[:, :, None], st.sink_k)
        sink_v = jnp.where(slot[:, None], v_t[:, :, None], st.sink_v)
        sink_pos = jnp.where(slot, t, st.sink_pos)
        return HybridState(S, z, *win, sink_k, sink_v, sink_pos), o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, fq, fk, fq_den, fk_den, v)) + (positions.astype(jnp.int32),)
    final, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 2), final


def chunked(q, k, fq, fk, v, positions, state: HybridState, *, gate, window: int, sinks: int,
            fq_den=None, fk_den=None, log_gamma=None, eps: float = 0.0, chunk_size: int = 64):
    """``parallel`` inside chunks of ``chunk_size`` tokens, a ``lax.scan`` of the state across them
    (the remainder in one more parallel call). Returns ``(o, final_state)``."""
    check_heads("hybrid_attention", q, k, v, state)
    fq_den = fq if fq_den is None else fq_den
    fk_den = fk if fk_den is None else fk_den
    kw = dict(gate=gate, window=window, sinks=sinks, log_gamma=log_gamma, eps=eps)
    T = q.shape[2]
    n_chunks, rest = divmod(T, chunk_size)
    args = (q, k, fq, fk, v)
    if n_chunks <= 1:
        return parallel(*args, positions, state, fq_den=fq_den, fk_den=fk_den, **kw)
    cut = n_chunks * chunk_size

    def split(a):  # [B, H or G, n*C, F] -> [n, B, H or G, C, F]
        return jnp.moveaxis(a[:, :, :cut].reshape(*a.shape[:2], n_chunks, chunk_size, a.shape[-1]), 2, 0)

    def body(carry, x):
        *arrays, qd, kd, pos = x
        o_c, carry = parallel(*arrays, pos, carry, fq_den=qd, fk_den=kd, **kw)
        return carry, o_c

    xs = tuple(split(a) for a in args + (fq_den, fk_den)) + (positions[:cut].reshape(n_chunks, chunk_size),)
    final, o = jax.lax.scan(body, state, xs)
    o = jnp.moveaxis(o, 0, 2).reshape(*q.shape[:2], cut, v.shape[-1])
    if rest:
        o_tail, final = parallel(*(a[:, :, cut:] for a in args), positions[cut:], final,
                                 fq_den=fq_den[:, :, cut:], fk_den=fk_den[:, :, cut:], **kw)
        o = jnp.concatenate([o, o_tail], axis=2)
    return o, final


def hybrid_attention(q, k, fq, fk, v, positions, state: HybridState, *, gate, window: int, sinks: int,
                     fq_den=None, fk_den=None, log_gamma=None, eps: float = 0.0, form: str = "auto",
                     chunk_size: int = 64):
    """The hybrid in the given form (``"auto"``: parallel while short, chunked after)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if window < 1 and sinks < 1:
        raise ValueError("hybrid_attention needs an exact part (window >= 1 or sinks >= 1); plain "
                         "linear attention is linicl.kernels.linear_attention")
    if form == "auto":
        form = "parallel" if q.shape[2] <= 2 * chunk_size else "chunked"
    kw = dict(gate=gate, window=window, sinks=sinks, fq_den=fq_den, fk_den=fk_den, log_gamma=log_gamma,
              eps=eps)
    if form == "parallel":
        return parallel(q, k, fq, fk, v, positions, state, **kw)
    if form == "recurrent":
        return recurrent(q, k, fq, fk, v, positions, state, **kw)
    return chunked(q, k, fq, fk, v, positions, state, chunk_size=chunk_size, **kw)
