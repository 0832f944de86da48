"""Grouped-query storage of the hybrid and sparse-cache kernels (issue 53, item 3): with G key/value
heads for H query heads (query head h reads key/value head h // (H / G)), the exact part's keys and
values are taken and stored once per key/value head. Every hybrid form equals the same kernel given
the keys and values repeated to the H query heads and a direct NumPy sum; the sparse cache selects per
key/value head with the group's summed scores (a NumPy reference of that rule), which is the per-head
rule when the group's query heads are identical. float64; relative errors <= helpers.EXACT_RTOL."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from linicl.errors import LiniclError
from linicl.kernels import hybrid_attention as hy, sparse_cache as sc
from linicl.kernels.softmax_attention import repeat_kv
from helpers import BASELINE_MIN, EXACT_RTOL, examples, rel_err

KV_FIELDS = ("win_k", "win_v", "sink_k", "sink_v")  # HybridState's fields with kv_heads heads
CACHE_KV_FIELDS = ("cache_k", "cache_v", "cache_pos", "win_score", "cache_score")  # SparseState's others


@st.composite
def grouped(draw, min_len: int = 1, max_len: int = 16, cache: bool = False):
    """Random grouped heads (G in {1, 2}, H / G in {1, 2, 3}), lengths, decays, windows and sinks (and
    cache sizes and rules); positive features, separate denominator features or not."""
    B, G, r, T = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3)), \
        draw(st.integers(min_len, max_len))
    H, d, F, dv = G * r, draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    window, sinks = draw(st.sampled_from([0, 1, 2, 4])), draw(st.sampled_from([0, 1, 3]))
    if window == 0 and sinks == 0:
        sinks = 1  # the kernels need an exact part
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    feat = lambda: np.abs(rng.normal(size=(B, H, T, F)))  # noqa: E731
    fq, fk = feat(), feat()
    fqd, fkd = (feat(), feat()) if draw(st.booleans()) else (fq, fk)
    decay = draw(st.one_of(st.none(), st.lists(st.floats(0.5, 1.0), min_size=H, max_size=H)))
    p = dict(q=rng.normal(size=(B, H, T, d)), k=rng.normal(size=(B, G, T, d)), v=rng.normal(size=(B, G, T, dv)),
             fq=fq, fk=fk, fqd=fqd, fkd=fkd, gate=rng.normal(size=H), decay=decay, window=window, sinks=sinks,
             eps=draw(st.sampled_from([0.0, 1e-6])), cache=0, rule="recall")
    if cache:
        p["cache"] = draw(st.sampled_from([1, 2, 4]))
        p["rule"] = draw(st.sampled_from(["recall", "attention"])) if window else "recall"
    return p


def _kw(p, sl):
    log_gamma = None if p["decay"] is None else jnp.log(jnp.asarray(p["decay"]))
    return dict(gate=jnp.asarray(p["gate"]), window=p["window"], sinks=p["sinks"], log_gamma=log_gamma,
                eps=p["eps"], fq_den=jnp.asarray(p["fqd"][:, :, sl]), fk_den=jnp.asarray(p["fkd"][:, :, sl]))


def _hybrid(p, form, sl=slice(None), state=None, repeat=False, chunk_size=3):
    """The hybrid on tokens ``sl`` (positions are the indices) from ``state`` (default empty), with
    the keys and values as given (G heads) or repeated to the query heads (``repeat``)."""
    B, H, T, d = p["q"].shape
    k, v = (jnp.asarray(p[n][:, :, sl]) for n in ("k", "v"))
    if repeat:
        k, v = repeat_kv(k, H), repeat_kv(v, H)
    if state is None:
        state = hy.empty_state(B, H, d, p["fk"].shape[-1], v.shape[-1], p["window"], p["sinks"], jnp.float64,
                               kv_heads=k.shape[1])
    pos = jnp.arange(T)[sl]
    return hy.hybrid_attention(jnp.asarray(p["q"][:, :, sl]), k, jnp.asarray(p["fq"][:, :, sl]),
                               jnp.asarray(p["fk"][:, :, sl]), v, pos, state, form=form, chunk_size=chunk_size,
                               **_kw(p, sl))


def _repeated(state, H):
    """A grouped state with its key/value fields repeated to the H query heads."""
    return state._replace(**{n: repeat_kv(getattr(state, n), H) for n in KV_FIELDS})


def _assert_states_equal(a, b):
    """Field by field: positions equal, floats to the exact tolerance (all-zero fields exactly)."""
    for name, x, y in zip(a._fields, a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, name
        if np.issubdtype(x.dtype, np.integer) or not np.abs(y).max(initial=0.0) > 0:
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert rel_err(x, y) <= EXACT_RTOL, name


# ------------------------------------------------------------------------------ (a) the hybrid
@examples(0.5)
@given(p=grouped(min_len=2), cut=st.floats(0.0, 1.0))
def test_every_hybrid_form_equals_the_kernel_on_repeated_keys_and_values(p, cut):
    """Parallel, chunked (chunks of 3) and recurrent, from an empty state and from the state a prefix
    leaves (partly filled buffers): the same outputs and state as the kernel given k, v repeated to
    the query heads; the stored keys and values have G heads."""
    B, H, T, _ = p["q"].shape
    G = p["k"].shape[1]
    n = min(max(int(cut * T), 1), T - 1)
    for form in ("parallel", "chunked", "recurrent"):
        _, mid = _hybrid(p, form, slice(0, n))
        _, mid_h = _hybrid(p, form, slice(0, n), repeat=True)
        _assert_states_equal(_repeated(mid, H), mid_h)
        o, final = _hybrid(p, form, slice(n, T), state=mid)
        o_h, final_h = _hybrid(p, form, slice(n, T), state=mid_h, repeat=True)
        assert rel_err(o, o_h) <= EXACT_RTOL
        assert all(getattr(final, f).shape[1] == G for f in KV_FIELDS)
        assert final.S.shape[1] == final.win_fk.shape[1] == H
        _assert_states_equal(_repeated(final, H), final_h)


def _hybrid_reference(p):
    """Outputs ``[B, H, T, d_v]`` and the final (S, z) by direct sums over i <= t, query head h reading
    the keys and values of head h // (H / G): E(t) = sinks and the window, exact with weight
    g gamma^(t-i) e^{q.k/sqrt d - c_t}; everything older linear, gamma^(t-i) f_t.f_i."""
    B, H, T, d = p["q"].shape
    r = H // p["k"].shape[1]
    window, sinks, eps = p["window"], p["sinks"], p["eps"]
    out = np.zeros((B, H, T, p["v"].shape[-1]))
    S, z = np.zeros((B, H) + p["fk"].shape[-1:] + p["v"].shape[-1:]), np.zeros((B, H, p["fk"].shape[-1]))
    for b in range(B):
        for h in range(H):
            k, v = p["k"][b, h // r], p["v"][b, h // r]
            gam = 1.0 if p["decay"] is None else p["decay"][h]
            g = 1 / (1 + math.exp(-p["gate"][h]))
            for t in range(T):
                exact = [i for i in range(t + 1) if i < sinks or t - i < window]
                s = {i: p["q"][b, h, t] @ k[i] / math.sqrt(d) for i in exact}
                c = max(s.values())
                num, den = np.zeros(v.shape[1]), 0.0
                for i in range(t + 1):
                    if i in s:
                        w = g * gam ** (t - i) * math.exp(s[i] - c)
                        num, den = num + w * v[i], den + w
                    else:
                        num = num + gam ** (t - i) * (p["fq"][b, h, t] @ p["fk"][b, h, i]) * v[i]
                        den = den + gam ** (t - i) * (p["fqd"][b, h, t] @ p["fkd"][b, h, i])
                out[b, h, t] = num / (den + eps)
            # the state after T tokens: the non-sink tokens that left the window
            for i in range(sinks, T - max(window, 1) + 1):
                S[b, h] += gam ** (T - 1 - i) * np.outer(p["fk"][b, h, i], v[i])
                z[b, h] += gam ** (T - 1 - i) * p["fkd"][b, h, i]
    return out, S, z


def _close(a, b):
    b = np.asarray(b)
    if not np.abs(b).max(initial=0.0) > 0:
        return float(np.abs(np.asarray(a)).max(initial=0.0)) == 0
    return rel_err(a, b) <= EXACT_RTOL


@examples(0.4)
@given(p=grouped(max_len=12))
def test_every_hybrid_form_equals_a_direct_numpy_sum(p):
    """Outputs, (S, z) and the stored window and sinks (each key/value head's own tokens, the HF
    repeat_kv order) against direct sums; power: reading the wrong key/value head is far off."""
    o_ref, S, z = _hybrid_reference(p)
    T, w = p["q"].shape[2], max(p["window"] - 1, 0)
    for form in ("parallel", "chunked", "recurrent"):
        o, final = _hybrid(p, form)
        assert rel_err(o, o_ref) <= EXACT_RTOL
        assert _close(final.S, S) and _close(final.z, z)
        slots = [T - w + j for j in range(w)]
        for name, src, at in (("win_k", "k", slots), ("win_v", "v", slots),
                              ("sink_k", "k", range(p["sinks"])), ("sink_v", "v", range(p["sinks"]))):
            want = np.stack([p[src][:, :, i] if 0 <= i < T else np.zeros_like(p[src][:, :, 0]) for i in at], 2) \
                if len(at) else np.zeros(p[src].shape[:2] + (0, p[src].shape[-1]))
            np.testing.assert_array_equal(getattr(final, name), want, err_msg=name)
    G = p["k"].shape[1]
    if G > 1:  # power: key/value heads in the other order (query head h reading another head)
        swapped = {**p, "k": p["k"][:, ::-1], "v": p["v"][:, ::-1]}
        assert rel_err(_hybrid(swapped, "parallel")[0], o_ref) >= BASELINE_MIN


# ------------------------------------------------------------------------------ (b) the sparse cache
def _cache(p, sl=slice(None), state=None):
    B, H, T, d = p["q"].shape
    G = p["k"].shape[1]
    if state is None:
        state = sc.empty_state(B, H, d, p["fk"].shape[-1], p["v"].shape[-1], p["window"], p["sinks"],
                               p["cache"], jnp.float64, p["rule"], kv_heads=G)
    return sc.sparse_cache(*(jnp.asarray(p[n][:, :, sl]) for n in ("q", "k", "fq", "fk", "v")),
                           jnp.arange(T)[sl], state, cache=p["cache"], rule=p["rule"], **_kw(p, sl))


def _group_reference(p, b, g):
    """Row b, key/value head g and its r query heads, token by token with explicit sets: the outputs
    ``[r, T, d_v]``, the cache's positions by slot (-1 empty) and each head's final (S, z). A token
    leaving the window meets the cache with the group's score: the sum over its query heads of each
    head's recall error (|v_j - f_j S / (f~_j.z + eps)|^2, S, z that head's linear state) or of the
    attention each head gave it while in the window; the lowest score (then the oldest) leaves."""
    H, T = p["q"].shape[1], p["q"].shape[2]
    r = H // p["k"].shape[1]
    heads = range(g * r, (g + 1) * r)
    k, v = p["k"][b, g], p["v"][b, g]
    window, sinks, C, eps = p["window"], p["sinks"], p["cache"], p["eps"]
    gam = {h: 1.0 if p["decay"] is None else p["decay"][h] for h in heads}
    linear, slots = [], [-1] * C
    received = np.zeros(T)

    def state(h, t):
        S = sum((gam[h] ** (t - i) * np.outer(p["fk"][b, h, i], v[i]) for i in linear),
                np.zeros((p["fk"].shape[-1], v.shape[1])))
        z = sum((gam[h] ** (t - i) * p["fkd"][b, h, i] for i in linear), np.zeros(p["fk"].shape[-1]))
        return S, z

    def score(j, t):
        if p["rule"] == "attention":
            return float(received[j])
        total = 0.0
        for h in heads:
            S, z = state(h, t)
            den = p["fkd"][b, h, j] @ z + eps
            pred = np.zeros(v.shape[1]) if den == 0 else p["fk"][b, h, j] @ S / den
            total += float(np.sum((v[j] - pred) ** 2))
        return total

    def leave(j, t):
        if -1 in slots:
            slots[slots.index(-1)] = j
            return
        out = min(slots + [j], key=lambda i: (score(i, t), i))
        linear.append(out)
        if out != j:
            slots[slots.index(out)] = j

    out = np.zeros((r, T, v.shape[1]))
    for t in range(T):
        if window == 0 and t >= sinks:
            leave(t, t)
        exact = sorted({i for i in range(t + 1) if i < sinks or t - i < window} | {i for i in slots if i >= 0})
        for a, h in enumerate(heads):
            s = {i: p["q"][b, h, t] @ k[i] / math.sqrt(k.shape[1]) for i in exact}
            c = max(s.values())
            num, den, w = np.zeros(v.shape[1]), 0.0, {}
            for i in exact:
                w[i] = (1 / (1 + math.exp(-p["gate"][h]))) * gam[h] ** (t - i) * math.exp(s[i] - c)
                num, den = num + w[i] * v[i], den + w[i]
            for i in linear:
                num = num + gam[h] ** (t - i) * (p["fq"][b, h, t] @ p["fk"][b, h, i]) * v[i]
                den = den + gam[h] ** (t - i) * (p["fqd"][b, h, t] @ p["fkd"][b, h, i])
            out[a, t] = num / (den + eps)
            for i in w:
                if i >= sinks and t - i < window:
                    received[i] += w[i] / (den + eps)
        if window > 0 and t - window + 1 >= sinks:
            leave(t - window + 1, t)
    return out, slots, [state(h, T - 1) for h in heads]


def _cache_reference(p):
    B, G = p["k"].shape[:2]
    groups = [[_group_reference(p, b, g) for g in range(G)] for b in range(B)]
    o = np.asarray([np.concatenate([groups[b][g][0] for g in range(G)]) for b in range(B)])
    slots = np.asarray([[groups[b][g][1] for g in range(G)] for b in range(B)]).reshape(B, G, p["cache"])
    S = np.asarray([[s[0] for g in range(G) for s in groups[b][g][2]] for b in range(B)])
    z = np.asarray([[s[1] for g in range(G) for s in groups[b][g][2]] for b in range(B)])
    return o, slots, S, z


@examples(1.0)
@given(p=grouped(cache=True))
def test_the_grouped_cache_equals_the_reference_rule(p):
    """Outputs, cached positions per key/value head (the same selections) and every query head's
    final (S, z); the state's keys, values, positions and scores have G heads."""
    o, final = _cache(p)
    o_ref, slots, S, z = _cache_reference(p)
    assert rel_err(o, o_ref) <= EXACT_RTOL
    np.testing.assert_array_equal(final.cache_pos, slots)
    assert _close(final.S, S) and _close(final.z, z)
    G = p["k"].shape[1]
    assert all(getattr(final, n).shape[1] == G for n in KV_FIELDS + CACHE_KV_FIELDS)
    assert final.cache_fk.shape[1] == final.S.shape[1] == p["q"].shape[1]


@examples(0.6)
@given(p=grouped(min_len=2, cache=True), cut=st.floats(0.0, 1.0))
def test_a_carried_grouped_cache_state_is_everything_the_prefix_leaves(p, cut):
    T = p["q"].shape[2]
    n = min(max(int(cut * T), 1), T - 1)
    o, final = _cache(p)
    o1, mid = _cache(p, slice(0, n))
    o2, final2 = _cache(p, slice(n, T), state=mid)
    assert rel_err(jnp.concatenate([o1, o2], 2), o) <= EXACT_RTOL
    _assert_states_equal(final2, final)


@examples(0.6)
@given(p=grouped(cache=True))
def test_identical_query_heads_select_as_one_head(p):
    """When a group's query heads are copies of one head (queries, features, gate, decay), its summed
    score is r times that head's: the grouped cache is the per-head cache on repeated keys and values
    (the rule before grouping), with each key/value head's slots repeated to its query heads."""
    H = p["q"].shape[1]
    G = p["k"].shape[1]
    lead = np.arange(H) // (H // G) * (H // G)  # each query head copies the first of its group
    same = {**p, **{n: p[n][:, lead] for n in ("q", "fq", "fk", "fqd", "fkd")}, "gate": p["gate"][lead],
            "decay": None if p["decay"] is None else [p["decay"][h] for h in lead]}
    o, final = _cache(same)
    per_head = {**same, "k": np.asarray(repeat_kv(jnp.asarray(same["k"]), H)),
                "v": np.asarray(repeat_kv(jnp.asarray(same["v"]), H))}
    o_h, final_h = _cache(per_head)
    assert rel_err(o, o_h) <= EXACT_RTOL
    np.testing.assert_array_equal(repeat_kv(final.cache_pos, H), final_h.cache_pos)
    assert _close(final.S, final_h.S) and _close(final.z, final_h.z)


def test_the_grouped_reference_has_power():
    """The group's summed score is its own rule: selecting by the first query head's score alone (the
    other heads ignored) picks other tokens and computes something else on the same problem."""
    rng = np.random.default_rng(2)
    B, G, H, T, d, F, dv = 1, 1, 3, 16, 3, 4, 3
    p = dict(q=rng.normal(size=(B, H, T, d)), k=rng.normal(size=(B, G, T, d)), v=rng.normal(size=(B, G, T, dv)),
             fq=np.abs(rng.normal(size=(B, H, T, F))), fk=np.abs(rng.normal(size=(B, H, T, F))),
             gate=rng.normal(size=H), decay=[0.9, 1.0, 0.8], window=2, sinks=1, cache=3, eps=1e-6, rule="recall")
    p["fqd"], p["fkd"] = p["fq"], p["fk"]
    o, final = _cache(p)
    o_ref, slots, _, _ = _cache_reference(p)
    assert rel_err(o, o_ref) <= EXACT_RTOL
    np.testing.assert_array_equal(final.cache_pos, slots)
    first = {**p, **{n: p[n][:, :1] for n in ("q", "fq", "fk", "fqd", "fkd")}, "gate": p["gate"][:1],
             "decay": p["decay"][:1]}
    _, slots_first, _, _ = _cache_reference(first)
    assert set(slots.ravel()) != set(slots_first.ravel())
    assert rel_err(o[:, :1], _cache(first)[0]) >= BASELINE_MIN


# ------------------------------------------------------------------------------ (c) bad input
def test_heads_that_do_not_divide_are_refused_by_name():
    B, H, T, d, F = 1, 4, 3, 2, 2
    q, fq = jnp.zeros((B, H, T, d)), jnp.ones((B, H, T, F))
    kw = dict(gate=jnp.zeros(H), window=2, sinks=1)
    state = hy.empty_state(B, H, d, F, d, 2, 1, jnp.float64, kv_heads=2)
    with pytest.raises(LiniclError, match="k's heads"):  # 3 key/value heads for 4 query heads
        hy.hybrid_attention(q, jnp.zeros((B, 3, T, d)), fq, fq, jnp.zeros((B, 3, T, d)), jnp.arange(T),
                            state, **kw)
    with pytest.raises(LiniclError, match="v must have k's 2"):
        hy.hybrid_attention(q, jnp.zeros((B, 2, T, d)), fq, fq, jnp.zeros((B, 4, T, d)), jnp.arange(T),
                            state, **kw)
    for form in ("parallel", "chunked", "recurrent"):  # a state made for other key/value heads
        with pytest.raises(LiniclError, match="kv_heads=1"):
            hy.hybrid_attention(q, jnp.zeros((B, 1, T, d)), fq, fq, jnp.zeros((B, 1, T, d)), jnp.arange(T),
                                state, form=form, **kw)
    with pytest.raises(LiniclError, match="kv_heads must divide"):
        hy.empty_state(B, H, d, F, d, 2, 1, jnp.float64, kv_heads=3)
    with pytest.raises(LiniclError, match="kv_heads must divide"):
        sc.empty_state(B, H, d, F, d, 2, 1, 2, jnp.float64, kv_heads=0)
    cached = sc.empty_state(B, H, d, F, d, 2, 1, 2, jnp.float64)  # every field at 4 heads
    with pytest.raises(LiniclError, match="kv_heads=2"):
        sc.sparse_cache(q, jnp.zeros((B, 2, T, d)), fq, fq, jnp.zeros((B, 2, T, d)), jnp.arange(T),
                        cached._replace(**{n: getattr(hy.empty_state(B, H, d, F, d, 2, 1, jnp.float64, kv_heads=2), n)
                                           for n in KV_FIELDS}), cache=2, **kw)
