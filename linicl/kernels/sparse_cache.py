"""The hybrid of ``hybrid_attention`` plus a bounded sparse cache of exact key/value pairs (LoLA,
arXiv 2505.23666), in its recurrent form.

For one head, a query at absolute position t (notation of ``hybrid_attention``: rotated q_t, k_i for the
exact logits, numerator features f_t, f_i, denominator features f~_t, f~_i, values v_i):

    E(t) = {i <= t : i < sinks  or  t - i < window}  u  C(t)    (exact: sinks, window, the cache)
    L(t) = {i <= t : i not in E(t)}                              (linear: everything else)
    y_t  = [sum_{E} g gamma^(t-i) e^{q_t.k_i/sqrt(d) - c_t} v_i + sum_{L} gamma^(t-i) f_t.f_i v_i]
         / [sum_{E} g gamma^(t-i) e^{q_t.k_i/sqrt(d) - c_t}   + sum_{L} gamma^(t-i) f~_t.f~_i + eps]

with c_t = max_{i in E(t)} q_t.k_i/sqrt(d), the cache included. The cache C(t) holds at most ``cache``
non-sink tokens that have left the window, chosen token by token with no parameters:

* A non-sink token i leaving the window (where the hybrid would add it to (S, z): after the output of
  step t for ``window >= 1``, before it for ``window = 0``, where the current token leaves at once) is
  a candidate. Every candidate and cached token j has a score, by one of two rules (``CACHE_RULES``):

  - ``"recall"`` (LoLA): with (S_t, z_t) the linear state at step t before anything is added
    (decayed to t), the self-recall error

        pred_j = f_j S_t / (f~_j . z_t + eps),    score_j = |v_j - pred_j|^2

    (eps the model's own normaliser epsilon; an empty state, f~_j . z_t + eps = 0, recalls nothing:
    pred_j = 0). A token the state recalls well loses least by being linear.
  - ``"attention"`` (the attention a token received while in the window, as H2O / TOVA score tokens
    but over a fixed span): score_j = sum_{t=j}^{j+window-1} a_{t,j}, with a_{t,j} the weight of the
    exact key j in y_t (its term of the denominator divided by the whole denominator + eps). Every
    token gets the same ``window`` queries, so old and new tokens compare fairly; the score is final
    when j leaves the window and is stored with it. Needs ``window >= 1``.
* If the cache has an empty slot, the candidate takes the first one (lowest slot index). Otherwise,
  of the ``cache`` cached tokens and the candidate, the one with the lowest score enters (S, z),
  weighted gamma^(t - j) like any token in S_t; a tie goes to the older (lower) position. If that
  token is a cached one, the candidate takes its slot. The rule is sequential, hence one form only.
* With grouped-query heads (G key/value heads for H query heads, G < H) the cache belongs to a key/value
  head, as its keys and values do, and serves the group's H / G query heads: a token's score is the sum
  of its scores in the group's query heads (each head's recall error, or the attention each head gave
  it), and the token that leaves enters the (S, z) of every query head of the group. With G = H each
  group is one head: the rule above.

The state (``SparseState``): the fields of ``HybridState``, the cache's rotated keys, features,
values and positions, and (rule ``"attention"``; empty arrays for ``"recall"``) the scores of the
window's and the cache's tokens. Unlike the window's positions, which every row and head share, the cache's
differ per row and key/value head (the selection depends on the values): ``cache_pos: int32[batch,
kv_heads, C]``, -1 for an empty slot. Keys, values, positions and scores are stored per key/value head,
features per query head (as ``HybridState``'s). With ``cache = 0`` every candidate enters (S, z): the
hybrid, to rounding.

Shapes (H = heads, G = kv_heads dividing H, query head h reading key/value head h // (H // G), as
``hybrid_attention``): q: ``f[batch, heads, seq, d]``; k: ``f[batch, kv_heads, seq, d]``; v: ``f[batch,
kv_heads, seq, d_v]``; fq, fk (and fq_den, fk_den): ``f[batch, heads, seq, F]``; positions: ``int[seq]``
(consecutive); gate, log_gamma: ``f[heads]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from linicl.errors import LiniclError
from linicl.kernels import hybrid_attention as hy
from linicl.kernels.softmax_attention import repeat_kv
from linicl.names import CACHE_FORMS, CACHE_RULES

# Position fields shared by every batch row and head (``int32[slots]``); every other field of a
# ``HybridState`` or ``SparseState`` has a leading batch axis (cache_pos included).
SHARED_POSITIONS = ("win_pos", "sink_pos")


class SparseState(NamedTuple):
    """The hybrid's state plus a cache of C exact tokens (W' = max(window - 1, 0), s = sinks). Keys,
    values, cache positions and scores have the key/value heads, features and (S, z) the query heads."""

    S: jax.Array          # f[batch, heads, F, d_v]: linear part, sum gamma^(t-i) phi(k_i) v_i^T
    z: jax.Array          # f[batch, heads, F]: sum gamma^(t-i) phi~(k_i)
    win_k: jax.Array      # f[batch, kv_heads, W', d]: rotated keys of the last W' tokens
    win_fk: jax.Array     # f[batch, heads, W', F]
    win_fkd: jax.Array    # f[batch, heads, W', F]
    win_v: jax.Array      # f[batch, kv_heads, W', d_v]
    win_pos: jax.Array    # int32[W']: -1 for an empty slot (oldest first)
    sink_k: jax.Array     # f[batch, kv_heads, s, d]
    sink_v: jax.Array     # f[batch, kv_heads, s, d_v]
    sink_pos: jax.Array   # int32[s]
    cache_k: jax.Array    # f[batch, kv_heads, C, d]: rotated keys of the cached tokens
    cache_fk: jax.Array   # f[batch, heads, C, F]: their numerator features
    cache_fkd: jax.Array  # f[batch, heads, C, F]: their denominator features
    cache_v: jax.Array    # f[batch, kv_heads, C, d_v]
    cache_pos: jax.Array  # int32[batch, kv_heads, C]: their positions, -1 for an empty slot (any order)
    win_score: jax.Array  # f[batch, kv_heads, W' or 0]: attention received so far, summed over the group
    cache_score: jax.Array  # f[batch, kv_heads, C or 0]: the cached tokens' final scores (rule "attention")

    def hybrid(self) -> hy.HybridState:
        """The fields the hybrid keeps (the state without its cache)."""
        return hy.HybridState(*self[:_N_HYBRID])

    def cached(self) -> tuple:
        """The cache as ``_select`` takes it: (k, fk, fkd, v, pos)."""
        return tuple(self[_N_HYBRID:_N_HYBRID + 5])


_N_HYBRID = len(hy.HybridState._fields)  # SparseState = HybridState's fields, the cache's, the scores


def empty_state(batch: int, heads: int, d: int, d_phi: int, d_v: int, window: int, sinks: int,
                cache: int, dtype, rule: str = "recall", kv_heads: Optional[int] = None) -> SparseState:
    """The state before any token: zeros, every slot empty (no score fields for rule "recall"); keys,
    values, cache positions and scores for ``kv_heads`` heads (default ``heads``)."""
    G = hy.check_kv_heads("empty_state", heads, heads if kv_heads is None else kv_heads)
    z = lambda *s: jnp.zeros((batch, heads) + s, dtype)  # noqa: E731
    kv = lambda *s: jnp.zeros((batch, G) + s, dtype)  # noqa: E731
    scored = rule == "attention"
    return SparseState(*hy.empty_state(batch, heads, d, d_phi, d_v, window, sinks, dtype, G),
                       kv(cache, d), z(cache, d_phi), z(cache, d_phi), kv(cache, d_v),
                       jnp.full((batch, G, cache), -1, jnp.int32),
                       kv(max(window - 1, 0) if scored else 0), kv(cache if scored else 0))


def _group_sum(x: jax.Array, kv_heads: int) -> jax.Array:
    """``f[batch, heads, ...]`` -> ``f[batch, kv_heads, ...]``: each key/value head's sum over the query
    heads that read it (heads h with h // (heads // kv_heads) equal, consecutive in ``repeat_kv``'s
    order). The identity when kv_heads = heads."""
    B, H = x.shape[:2]
    return x if H == kv_heads else x.reshape((B, kv_heads, H // kv_heads) + x.shape[2:]).sum(2)


def recall_error(fk, fkd, v, S, z, eps: float) -> jax.Array:
    """LoLA's score |v_j - f_j S / (f~_j . z + eps)|^2 of ``n`` tokens: ``f[batch, heads, n]``.

    fk, fkd: ``f[batch, heads, n, F]``; v: ``f[batch, heads, n, d_v]``; S, z: the linear state. A zero
    denominator (an empty state with eps = 0) recalls nothing: the prediction is 0, not 0/0."""
    num = jnp.einsum("bhnf,bhfd->bhnd", fk, S)
    den = jnp.einsum("bhnf,bhf->bhn", fkd, z) + eps
    empty = den == 0
    pred = jnp.where(empty[..., None], 0, num / jnp.where(empty, 1, den)[..., None])
    return jnp.sum((v - pred) ** 2, axis=-1)


def _powers(gamma: Optional[jax.Array], age: jax.Array, valid: jax.Array, dtype) -> jax.Array:
    """gamma_h^age where valid, else 0, for ``age: int[batch, heads, ...]`` (same shape out)."""
    if gamma is None:
        return valid.astype(dtype)
    g = gamma.reshape((1, -1) + (1,) * (age.ndim - 2))
    return jnp.where(valid, g ** jnp.where(valid, age, 0), 0)


def _select(cache, cand, valid, score_of):
    """One candidate meets the cache, per key/value head. ``cache``: k, v ``f[batch, kv_heads, C, .]``,
    fk, fkd ``f[batch, heads, C, F]`` and pos ``int32[batch, kv_heads, C]``; ``cand``: (k, fk, fkd, v)
    ``f[batch, kv_heads or heads, .]`` and pos ``int32[]``; ``valid``: ``bool[]`` (a real non-sink
    token); ``score_of(fk, fkd, v)``: the scores ``f[batch, kv_heads, C + 1]`` of the cached tokens and
    the candidate (last), from their features ``[batch, heads, C + 1, F]`` and values ``[batch,
    kv_heads, C + 1, d_v]``. Returns the new cache, the token leaving for the linear state (fk, fkd
    ``f[batch, heads, F]``, v ``f[batch, kv_heads, d_v]``, pos ``int32[batch, kv_heads]``), where one
    leaves (``bool[batch, kv_heads]``) and ``put``, the slot the candidate took (``bool[batch, kv_heads,
    C]``)."""
    *slots, pos = cache
    B, G, C = pos.shape
    H = slots[1].shape[1]
    c_pos = jnp.broadcast_to(cand[-1], (B, G))
    every = [jnp.concatenate([a, b[:, :, None]], 2) for a, b in zip(slots, cand[:-1])]  # [B, H or G, C+1, .]
    every_pos = jnp.concatenate([pos, c_pos[..., None]], -1)
    score = jax.lax.stop_gradient(score_of(*every[1:]))
    # The lowest score leaves; of equal scores the oldest (positions are distinct).
    lowest = score == score.min(-1, keepdims=True)
    out = jnp.argmin(jnp.where(lowest, every_pos, jnp.iinfo(jnp.int32).max), -1)  # [B, H] in [0, C]
    free = pos < 0
    has_free = free.any(-1)
    slot = jnp.where(has_free, jnp.argmax(free, -1), out)  # slot == C: the candidate itself leaves
    put = (jnp.arange(C) == slot[..., None]) & valid  # [B, G, C]
    # The features are per query head: each follows its key/value head's choice.
    heads = lambda a, x: repeat_kv(x, H) if a.shape[1] == H else x  # noqa: E731
    new = [jnp.where(heads(a, put)[..., None], b[:, :, None], a) for a, b in zip(slots, cand[:-1])]
    new_pos = jnp.where(put, c_pos[..., None], pos)
    take = lambda a: jnp.take_along_axis(a, heads(a, out)[:, :, None, None], 2)[:, :, 0]  # noqa: E731
    leaving = tuple(take(a) for a in every[1:]) + (jnp.take_along_axis(every_pos, out[..., None], -1)[..., 0],)
    return (*new, new_pos), leaving, valid & ~has_free, put


def _admit(S, z, cache, scores, cand, cand_score, valid, t, gamma, eps: float):
    """A token leaves the window: the cache keeps it or another token, the rest enters (S, z),
    weighted gamma^(t - i). ``cache``, ``cand``, ``valid``: as ``_select``; ``scores``: the cached
    tokens' stored scores ``f[batch, kv_heads, C]`` and ``cand_score`` the candidate's ``f[batch,
    kv_heads]`` (rule "attention"), or None (rule "recall": computed here from (S, z), each query
    head's error summed over its group). Returns ``(S, z, cache, scores)``."""
    B, H = S.shape[:2]
    G = cand[0].shape[1]
    if cache[-1].shape[-1]:
        if scores is None:
            score_of = lambda fk, fkd, v: _group_sum(  # noqa: E731
                recall_error(fk, fkd, repeat_kv(v, H), S, z, eps), G)
        else:
            score_of = lambda *_: jnp.concatenate([scores, cand_score[..., None]], -1)  # noqa: E731
        cache, (fk, fkd, v, pos), leaves, put = _select(cache, cand, valid, score_of)
        if scores is not None:
            scores = jnp.where(put, cand_score[..., None], scores)
    else:  # no cache: the candidate itself (the hybrid)
        (_, fk, fkd, v, pos), leaves = cand, jnp.broadcast_to(valid, (B, G))
    # The leaving token enters the (S, z) of every query head of its group.
    pos, leaves = repeat_kv(jnp.broadcast_to(pos, (B, G)), H), repeat_kv(leaves, H)
    w = _powers(gamma, t - pos, leaves, S.dtype)  # f[batch, heads]
    S = S + w[..., None, None] * fk[..., :, None] * repeat_kv(v, H)[..., None, :]
    return S, z + w[..., None] * fkd, cache, scores


def _read(q_t, fq_t, fqd_t, keys, vals, pos, mask, t, S, z, g, gamma, eps: float):
    """The output at position t from the exact keys (``keys: f[batch, kv_heads, n, d]``, ``pos,
    mask: [batch, kv_heads, n]``) and the linear state: ``f[batch, heads, d_v]``, and the exact keys'
    weights in it (their denominator terms over the whole denominator + eps): ``f[batch, heads, n]``."""
    H = q_t.shape[1]
    keys, vals, pos, mask = (repeat_kv(a, H) for a in (keys, vals, pos, mask))  # to the query heads
    logits = jnp.einsum("bhd,bhsd->bhs", q_t, keys) / math.sqrt(q_t.shape[-1])
    logits = jnp.where(mask, logits, -jnp.inf)
    c = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(c), c, 0)), 0)
    e = g[None, :, None] * _powers(gamma, t - pos, mask, vals.dtype) * e
    num = jnp.einsum("bhs,bhsd->bhd", e, vals) + jnp.einsum("bhf,bhfd->bhd", fq_t, S)
    den = e.sum(-1) + jnp.einsum("bhf,bhf->bh", fqd_t, z) + eps
    return num / den[..., None], e / den[..., None]


def _exact_keys(st: SparseState, cache, k_t, v_t, t, window: int, sinks: int):
    """Keys, values, positions and mask of E(t): sinks, window buffer, the current token and the
    ``cache`` (as ``_select``'s) in that order, ``[batch, kv_heads, s + W' + 1 + C, .]``. A buffered
    sink is skipped (the sink buffer counts it)."""
    B, G = k_t.shape[:2]
    pos = jnp.concatenate([st.sink_pos, st.win_pos, t[None]])
    n_s, n = st.sink_pos.shape[0], pos.shape[0]
    in_win = (jnp.arange(n) >= n_s) & (jnp.arange(n) < n - 1)
    mask = (pos >= 0) & ~(in_win & (pos < sinks)) & ((pos < sinks) | (t - pos < window))
    c_k, _, _, c_v, c_pos = cache
    keys = jnp.concatenate([st.sink_k, st.win_k, k_t[:, :, None], c_k], 2)
    vals = jnp.concatenate([st.sink_v, st.win_v, v_t[:, :, None], c_v], 2)
    pos = jnp.concatenate([jnp.broadcast_to(pos, (B, G, n)), c_pos], -1)
    mask = jnp.concatenate([jnp.broadcast_to(mask, (B, G, n)), c_pos >= 0], -1)
    return keys, vals, pos, mask


def _push(st: SparseState, k_t, fk_t, fkd_t, v_t, t):
    """Shift the window buffer by the current token: ``(window fields, popped (k, fk, fkd, v, pos))``;
    without buffer slots the current token is popped."""
    if not st.win_pos.shape[0]:
        return st[2:7], (k_t, fk_t, fkd_t, v_t, t)
    popped = (st.win_k[:, :, 0], st.win_fk[:, :, 0], st.win_fkd[:, :, 0], st.win_v[:, :, 0], st.win_pos[0])
    shift = lambda buf, new: jnp.concatenate([buf[:, :, 1:], new[:, :, None]], 2)  # noqa: E731
    win = (shift(st.win_k, k_t), shift(st.win_fk, fk_t), shift(st.win_fkd, fkd_t), shift(st.win_v, v_t),
           jnp.concatenate([st.win_pos[1:], t[None]]))
    return win, popped


def _check(q, k, v, window: int, sinks: int, cache: int, rule: str, state: SparseState) -> None:
    if window < 1 and sinks < 1:
        raise LiniclError("sparse_cache needs an exact part (window >= 1 or sinks >= 1), got window="
                          f"{window}, sinks={sinks}")
    if not isinstance(cache, int) or cache < 0:
        raise LiniclError(f"sparse_cache: cache must be an int >= 0, got {cache!r}")
    if rule not in CACHE_RULES:
        raise LiniclError(f"sparse_cache: rule must be one of {CACHE_RULES}, got {rule!r}")
    if rule == "attention" and window < 1:
        raise LiniclError("sparse_cache: rule 'attention' scores a token by the attention it gets while "
                          f"in the window; it needs window >= 1, got window={window}")
    if state.cache_pos.shape[-1] != cache:
        raise LiniclError(f"sparse_cache: the state has {state.cache_pos.shape[-1]} cache slots "
                          f"(cache_pos{tuple(state.cache_pos.shape)}), but cache={cache}")
    want = (max(window - 1, 0), cache) if rule == "attention" else (0, 0)
    if (state.win_score.shape[-1], state.cache_score.shape[-1]) != want:
        raise LiniclError(f"sparse_cache: the state's scores (win_score{tuple(state.win_score.shape)}, "
                          f"cache_score{tuple(state.cache_score.shape)}) are not those of rule {rule!r} "
                          f"with window={window}, cache={cache}")
    G = hy.check_heads("sparse_cache", q, k, v, state)
    for name in ("cache_k", "cache_v", "cache_pos", "win_score", "cache_score"):
        a = getattr(state, name)
        if a.shape[1] != G:
            raise LiniclError(f"sparse_cache: the state's {name}{tuple(a.shape)} holds {a.shape[1]} key/value "
                              f"heads, but k has {G} (k{tuple(k.shape)}); make the state with kv_heads={G}")


def recurrent(q, k, fq, fk, v, positions, state: SparseState, *, gate, window: int, sinks: int,
              cache: int, fq_den=None, fk_den=None, log_gamma=None, eps: float = 0.0, rule: str = "recall"):
    """Token-by-token ``lax.scan``. Returns ``(o: f[batch, heads, seq, d_v], final_state)``."""
    _check(q, k, v, window, sinks, cache, rule, state)
    fq_den = fq if fq_den is None else fq_den
    fk_den = fk if fk_den is None else fk_den
    gamma = None if log_gamma is None else jnp.exp(log_gamma)
    g = jax.nn.sigmoid(gate)
    scored = rule == "attention"
    n_s, n_w = state.sink_pos.shape[0], state.win_pos.shape[0]
    G = k.shape[1]

    def step(st: SparseState, x):
        q_t, k_t, fq_t, fk_t, fqd_t, fkd_t, v_t, t = x  # f[batch, heads or kv_heads (k_t, v_t), .], int32[]
        S, z = (st.S, st.z) if gamma is None else (st.S * gamma[:, None, None], st.z * gamma[:, None])
        kept, c_score = st.cached(), (st.cache_score if scored else None)
        if window == 0:  # the current token leaves at once: it is selected before the output (rule "recall")
            S, z, kept, _ = _admit(S, z, kept, None, (k_t, fk_t, fkd_t, v_t, t), None, t >= sinks, t, gamma, eps)
        keys, vals, pos, mask = _exact_keys(st, kept, k_t, v_t, t, window, sinks)
        o, a = _read(q_t, fq_t, fqd_t, keys, vals, pos, mask, t, S, z, g, gamma, eps)
        a = _group_sum(a, G) if scored else a  # a key/value head's tokens: the attention of its group
        win, popped = _push(st, k_t, fk_t, fkd_t, v_t, t)
        # The window's scores: this step's weights added, then shifted like the buffer.
        w_score = st.win_score + a[:, :, n_s:n_s + n_w] if scored else st.win_score
        now = a[:, :, n_s + n_w]  # the current token's own weight
        p_score = (w_score[:, :, 0] if n_w else now) if scored else None
        if scored and n_w:
            w_score = jnp.concatenate([w_score[:, :, 1:], now[:, :, None]], 2)
        if window > 0:
            p = popped[-1]
            S, z, kept, c_score = _admit(S, z, kept, c_score, popped, p_score, (p >= 0) & (p >= sinks), t,
                                         gamma, eps)
        slot = jnp.arange(n_s) == t
        sink_k = jnp.where(slot[:, None], k_t[:, :, None], st.sink_k)
        sink_v = jnp.where(slot[:, None], v_t[:, :, None], st.sink_v)
        return SparseState(S, z, *win, sink_k, sink_v, jnp.where(slot, t, st.sink_pos), *kept, w_score,
                           st.cache_score if c_score is None else c_score), o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, fq, fk, fq_den, fk_den, v)) + (positions.astype(jnp.int32),)
    final, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 2), final


def sparse_cache(q, k, fq, fk, v, positions, state: SparseState, *, gate, window: int, sinks: int,
                 cache: int, fq_den=None, fk_den=None, log_gamma=None, eps: float = 0.0,
                 form: str = "auto", rule: str = "recall"):
    """The layer in the given form: ``"recurrent"`` (``"auto"`` picks it; there is no other)."""
    if form not in CACHE_FORMS:
        raise LiniclError(f"sparse_cache: form must be one of {CACHE_FORMS} (the cache's selection is "
                          f"sequential), got {form!r}")
    return recurrent(q, k, fq, fk, v, positions, state, gate=gate, window=window, sinks=sinks, cache=cache,
                     fq_den=fq_den, fk_den=fk_den, log_gamma=log_gamma, eps=eps, rule=rule)
