"""The sparse-cache kernel (LoLA's exact key/value cache beside the hybrid's linear state): it is the
hybrid when the cache is empty, it equals an independent NumPy reference of each selection rule
("recall", "attention"; same outputs, same cached positions), a state carried between calls is
everything a prefix leaves, a cache as long as the sequence makes it a decayed softmax, and a pair the
linear state recalls badly (or the window attends to) is kept and retrieved. float64; relative errors
<= helpers.EXACT_RTOL."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from linicl.errors import LiniclError
from linicl.kernels import hybrid_attention as hy, sparse_cache as sc
from helpers import BASELINE_MIN, EXACT_RTOL, examples, rel_err


@st.composite
def problems(draw, min_len: int = 1, max_len: int = 24):
    """Random heads, lengths, decays, windows, sinks and cache sizes; positive features (positive
    denominators), separate denominator features or not, eps 0 or the default 1e-6."""
    B, H, T = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(min_len, max_len))
    d, F, dv = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    window, sinks = draw(st.sampled_from([0, 1, 2, 3, 5])), draw(st.sampled_from([0, 1, 3]))
    if window == 0 and sinks == 0:
        sinks = 1  # the kernel needs an exact part
    rule = draw(st.sampled_from(["recall", "attention"])) if window else "recall"  # attention: a window
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    feat = lambda: np.abs(rng.normal(size=(B, H, T, F)))  # noqa: E731
    fq, fk = feat(), feat()
    fqd, fkd = (feat(), feat()) if draw(st.booleans()) else (fq, fk)
    decay = draw(st.one_of(st.none(), st.lists(st.floats(0.5, 1.0), min_size=H, max_size=H)))
    return dict(q=rng.normal(size=(B, H, T, d)), k=rng.normal(size=(B, H, T, d)), fq=fq, fk=fk, fqd=fqd,
                fkd=fkd, v=rng.normal(size=(B, H, T, dv)), gate=rng.normal(size=H), decay=decay,
                window=window, sinks=sinks, cache=draw(st.sampled_from([0, 1, 2, 3, 5])),
                eps=draw(st.sampled_from([0.0, 1e-6])), rule=rule)


def _empty(p, cache=None):
    B, H, T, d = p["q"].shape
    return sc.empty_state(B, H, d, p["fk"].shape[-1], p["v"].shape[-1], p["window"], p["sinks"],
                          p["cache"] if cache is None else cache, jnp.float64, p.get("rule", "recall"))


def run(p, sl=slice(None), state=None, cache=None, kernel=sc.recurrent):
    """The kernel on the tokens ``sl`` (positions are the indices), from ``state`` (default empty)."""
    j = lambda name: jnp.asarray(p[name][:, :, sl])  # noqa: E731
    T = p["q"].shape[2]
    pos = jnp.arange(T)[sl]
    log_gamma = None if p["decay"] is None else jnp.log(jnp.asarray(p["decay"]))
    kw = dict(gate=jnp.asarray(p["gate"]), window=p["window"], sinks=p["sinks"], fq_den=j("fqd"),
              fk_den=j("fkd"), log_gamma=log_gamma, eps=p["eps"])
    if kernel is sc.recurrent:
        kw["cache"], kw["rule"] = p["cache"] if cache is None else cache, p.get("rule", "recall")
        state = _empty(p, cache) if state is None else state
    else:
        B, H, _, d = p["q"].shape
        state = hy.empty_state(B, H, d, p["fk"].shape[-1], p["v"].shape[-1], p["window"], p["sinks"],
                               jnp.float64)
    return kernel(j("q"), j("k"), j("fq"), j("fk"), j("v"), pos, state, **kw)


# --------------------------------------------------------------------------- NumPy reference
def _reference_head(p, b, h, leaves=min):
    """One row and head, token by token with explicit sets: the outputs ``[T, d_v]``, the cache's
    positions by slot (-1 empty) and the final (S, z) as direct sums over the linear set.
    ``leaves=max`` is the opposite rule (a wrong one, for the power check)."""
    q, k, fq, fk, fqd, fkd, v = (p[n][b, h] for n in ("q", "k", "fq", "fk", "fqd", "fkd", "v"))
    T, window, sinks, C, eps = q.shape[0], p["window"], p["sinks"], p["cache"], p["eps"]
    gam = 1.0 if p["decay"] is None else p["decay"][h]
    g = 1 / (1 + math.exp(-p["gate"][h]))
    linear, slots = [], [-1] * C
    received = np.zeros(T)  # rule "attention": the weight each token got while in the window

    def state(t):  # the linear state at step t: sums over the linear set, decayed to t
        S = sum((gam ** (t - i) * np.outer(fk[i], v[i]) for i in linear), np.zeros((fk.shape[1], v.shape[1])))
        z = sum((gam ** (t - i) * fkd[i] for i in linear), np.zeros(fk.shape[1]))
        return S, z

    def score(j, S, z):
        if p.get("rule", "recall") == "attention":
            return float(received[j])
        den = fkd[j] @ z + eps
        pred = np.zeros(v.shape[1]) if den == 0 else fk[j] @ S / den
        return float(np.sum((v[j] - pred) ** 2))

    def leave(j, t):  # token j leaves the window at step t
        if -1 in slots:
            slots[slots.index(-1)] = j
            return
        S, z = state(t)
        # The lowest score leaves; ties: the older. (``max`` with the negated position: the opposite.)
        out = leaves(slots + [j], key=lambda i: (score(i, S, z), i if leaves is min else -i))
        linear.append(out)
        if out != j:
            slots[slots.index(out)] = j

    out = np.zeros((T, v.shape[1]))
    for t in range(T):
        if window == 0 and t >= sinks:
            leave(t, t)
        exact = sorted({i for i in range(t + 1) if i < sinks or t - i < window} | {i for i in slots if i >= 0})
        assert sorted(exact + linear) == list(range(t + 1))  # the two sets partition the keys
        logits = {i: q[t] @ k[i] / math.sqrt(q.shape[1]) for i in exact}
        c = max(logits.values())
        num, den, w = np.zeros(v.shape[1]), 0.0, {}
        for i, s in logits.items():
            w[i] = g * gam ** (t - i) * math.exp(s - c)
            num, den = num + w[i] * v[i], den + w[i]
        for i in linear:
            num = num + gam ** (t - i) * (fq[t] @ fk[i]) * v[i]
            den = den + gam ** (t - i) * (fqd[t] @ fkd[i])
        out[t] = num / (den + eps)
        for i in w:
            if i >= sinks and t - i < window:  # in the window (not a sink, not cached)
                received[i] += w[i] / (den + eps)
        leaving = t - window + 1
        if window > 0 and leaving >= sinks:
            leave(leaving, t)
    return out, slots, state(T - 1)


def reference(p, leaves=min):
    """``(outputs, cache positions, S, z)`` of every row and head."""
    B, H = p["q"].shape[:2]
    heads = [[_reference_head(p, b, h, leaves) for h in range(H)] for b in range(B)]
    pick = lambda i: np.asarray([[heads[b][h][i] for h in range(H)] for b in range(B)])  # noqa: E731
    S = np.asarray([[heads[b][h][2][0] for h in range(H)] for b in range(B)])
    z = np.asarray([[heads[b][h][2][1] for h in range(H)] for b in range(B)])
    return pick(0), pick(1).reshape(B, H, p["cache"]), S, z


def _close(a, b):
    """Equal to the exact tolerance; an all-zero side (S before any token is linear) exactly."""
    if not float(np.abs(b).max(initial=0.0)) > 0:
        return float(np.abs(a).max(initial=0.0)) == 0
    return rel_err(a, b) <= EXACT_RTOL


def _assert_same_state(a, b):
    """Two states field by field: positions equal, floats to the exact tolerance."""
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.integer):
            np.testing.assert_array_equal(x, y)
        else:
            assert _close(x, y)


# ------------------------------------------------------------------------------------ (a)
@examples(0.8)
@given(p=problems())
def test_no_cache_is_the_hybrid(p):
    """cache = 0: every token leaving the window enters (S, z), as in hybrid_attention."""
    o, final = run(p, cache=0)
    o_hy, final_hy = run(p, kernel=hy.recurrent)
    assert rel_err(o, o_hy) <= EXACT_RTOL
    _assert_same_state(final.hybrid(), final_hy)


# ------------------------------------------------------------------------------------ (b)
@examples(1.0)
@given(p=problems())
def test_kernel_equals_the_reference_rule(p):
    """Outputs, the cached positions slot by slot (the same selections) and the final (S, z)."""
    o, final = run(p)
    o_ref, slots, S, z = reference(p)
    assert rel_err(o, o_ref) <= EXACT_RTOL
    np.testing.assert_array_equal(final.cache_pos, slots)
    assert _close(np.asarray(final.S), S) and _close(np.asarray(final.z), z)


def test_the_reference_has_power():
    """The reference separates the rule from its neighbours: no cache, another cache size, or the
    opposite choice (keeping the best-recalled tokens) computes something else."""
    rng = np.random.default_rng(0)
    B, H, T, d, F, dv = 1, 2, 16, 3, 4, 3
    p = dict(q=rng.normal(size=(B, H, T, d)), k=rng.normal(size=(B, H, T, d)), v=rng.normal(size=(B, H, T, dv)),
             fq=np.abs(rng.normal(size=(B, H, T, F))), fk=np.abs(rng.normal(size=(B, H, T, F))),
             gate=rng.normal(size=H), decay=[0.9, 1.0], window=2, sinks=1, cache=3, eps=1e-6)
    p["fqd"], p["fkd"] = p["fq"], p["fk"]
    o, final = run(p)
    o_ref, slots, _, _ = reference(p)
    assert rel_err(o, o_ref) <= EXACT_RTOL
    for other in (dict(cache=0), dict(cache=2)):
        assert rel_err(o, reference({**p, **other})[0]) >= BASELINE_MIN
    o_flip, slots_flip, _, _ = reference(p, leaves=max)
    assert rel_err(o, o_flip) >= BASELINE_MIN and not np.array_equal(slots, slots_flip)


def test_the_attention_rule_has_power():
    """The attention rule is its own rule: the kernel matches its reference, and the recall rule, the
    opposite choice and no cache compute something else on the same problem."""
    rng = np.random.default_rng(1)
    B, H, T, d, F, dv = 1, 2, 16, 3, 4, 3
    p = dict(q=2 * rng.normal(size=(B, H, T, d)), k=rng.normal(size=(B, H, T, d)), v=rng.normal(size=(B, H, T, dv)),
             fq=np.abs(rng.normal(size=(B, H, T, F))), fk=np.abs(rng.normal(size=(B, H, T, F))),
             gate=rng.normal(size=H), decay=[0.9, 1.0], window=3, sinks=1, cache=3, eps=1e-6, rule="attention")
    p["fqd"], p["fkd"] = p["fq"], p["fk"]
    o, final = run(p)
    o_ref, slots, _, _ = reference(p)
    assert rel_err(o, o_ref) <= EXACT_RTOL
    np.testing.assert_array_equal(final.cache_pos, slots)
    recall = {**p, "rule": "recall"}
    assert rel_err(o, run(recall)[0]) >= BASELINE_MIN and not np.array_equal(slots, reference(recall)[1])
    o_flip, slots_flip, _, _ = reference(p, leaves=max)
    assert rel_err(o, o_flip) >= BASELINE_MIN and not np.array_equal(slots, slots_flip)
    assert rel_err(o, run(p, cache=0)[0]) >= BASELINE_MIN


def test_an_attended_token_is_kept_by_the_attention_rule_and_a_badly_recalled_one_by_recall():
    """Token 2 (key 3 e1, value e2) is what query 3 looks at; token 7 (value -3 e2, features e2) is
    what the linear state recalls worst and nobody looks at. With one slot the attention rule keeps 2
    and the last query (which looks for key 3 e1) reads its value; the recall rule keeps 7."""
    T = 12
    q, k = np.zeros((1, 1, T, 2)), np.zeros((1, 1, T, 2))
    v, fk = np.tile([1.0, 0.0], (1, 1, T, 1)), np.tile([1.0, 0.0], (1, 1, T, 1))
    k[0, 0, 2], v[0, 0, 2] = [3.0, 0.0], [0.0, 1.0]
    v[0, 0, 7], fk[0, 0, 7] = [0.0, -3.0], [0.0, 1.0]
    q[0, 0, 3] = q[0, 0, -1] = [3.0, 0.0]
    fq = np.tile([1e-3, 0.0], (1, 1, T, 1))
    p = dict(q=q, k=k, fq=fq, fk=fk, fqd=fq, fkd=fk, v=v, gate=np.zeros(1), decay=None, window=2, sinks=1,
             cache=1, eps=1e-6, rule="attention")
    o, final = run(p)
    np.testing.assert_array_equal(final.cache_pos, [[[2]]])
    # Token 2's weight against three keys e^{-9/sqrt 2} smaller and the fillers' linear mass 1e-3 each.
    assert rel_err(o[0, 0, -1], np.asarray([0.0, 1.0])) < 0.05
    assert rel_err(o, reference(p)[0]) <= EXACT_RTOL
    o_recall, final_recall = run({**p, "rule": "recall"})
    np.testing.assert_array_equal(final_recall.cache_pos, [[[7]]])
    assert rel_err(o_recall[0, 0, -1], np.asarray([0.0, 1.0])) > 0.9


# ------------------------------------------------------------------------------------ (c)
@examples(0.8)
@given(p=problems(min_len=2), cut=st.floats(0.0, 1.0))
def test_a_carried_state_is_everything_the_prefix_leaves(p, cut):
    """Two calls with the state carried equal one call: outputs and final state (ICLCA, per layer)."""
    T = p["q"].shape[2]
    n = min(max(int(cut * T), 1), T - 1)
    o, final = run(p)
    o1, mid = run(p, slice(0, n))
    o2, final2 = run(p, slice(n, T), state=mid)
    assert rel_err(jnp.concatenate([o1, o2], 2), o) <= EXACT_RTOL
    _assert_same_state(final2, final)
    # Power: the second call without the prefix's state is far off.
    assert rel_err(run(p, slice(n, T))[0], o[:, :, n:]) >= BASELINE_MIN


# ------------------------------------------------------------------------------------ (d)
@examples(0.5)
@given(p=problems(max_len=12))
def test_a_cache_as_long_as_the_sequence_is_softmax_with_the_window_weights(p):
    """No token ever reaches (S, z): y_t = sum_i g gamma^(t-i) e^{q.k/sqrt d - c_t} v_i / (... + eps)
    over every i <= t, with c_t the row maximum."""
    T = p["q"].shape[2]
    p = {**p, "cache": T}
    o, final = run(p)
    gam = np.ones(len(p["gate"])) if p["decay"] is None else np.asarray(p["decay"])
    age = np.arange(T)[:, None] - np.arange(T)[None, :]
    s = np.einsum("bhtd,bhsd->bhts", p["q"], p["k"]) / math.sqrt(p["q"].shape[-1])
    s = np.where(age >= 0, s, -np.inf)
    w = (1 / (1 + np.exp(-p["gate"])))[:, None, None] * gam[:, None, None] ** np.maximum(age, 0)
    e = w * np.exp(s - s.max(-1, keepdims=True))
    expected = np.einsum("bhts,bhsd->bhtd", e, p["v"]) / (e.sum(-1) + p["eps"])[..., None]
    assert rel_err(o, expected) <= EXACT_RTOL
    np.testing.assert_array_equal(final.S, 0)
    if T > p["window"] + p["sinks"]:  # power: some token would be linear without the cache
        assert rel_err(run(p, cache=0)[0], expected) >= BASELINE_MIN


def _passkey(T=12, p_key=2):
    """One head: filler tokens (key 0, value e1, features e1) that the linear state recalls almost
    exactly, and a passkey (key 3 e1, value e2, features e2) it cannot recall (its features meet no
    filler's). The last query points at the passkey's key, its features at the fillers' (the map
    fails on it, as on a real passkey), scaled down so that the linear part weighs little."""
    q, k = np.zeros((1, 1, T, 2)), np.zeros((1, 1, T, 2))
    v, fk = np.tile([1.0, 0.0], (1, 1, T, 1)), np.tile([1.0, 0.0], (1, 1, T, 1))
    k[0, 0, p_key], v[0, 0, p_key], fk[0, 0, p_key] = [3.0, 0.0], [0.0, 1.0], [0.0, 1.0]
    q[0, 0, -1] = [3.0, 0.0]
    fq = np.tile([1e-3, 0.0], (1, 1, T, 1))
    return dict(q=q, k=k, fq=fq, fk=fk, fqd=fq, fkd=fk, v=v, gate=np.zeros(1), decay=None, window=2,
                sinks=0, cache=1, eps=1e-6)


def test_a_badly_recalled_pair_is_kept_and_retrieved():
    p = _passkey()
    o, final = run(p)
    np.testing.assert_array_equal(final.cache_pos, [[[2]]])  # the passkey, and only it, is cached
    passkey = np.asarray([0.0, 1.0])
    # The passkey's weight g (its logit is the row maximum) against the fillers' linear mass
    # 9 * 1e-3 and the window's e^{-9/sqrt 2} g: the output is the passkey's value to about 2 % (max norm).
    assert rel_err(o[0, 0, -1], passkey) < 0.05
    o_hy, _ = run(p, kernel=hy.recurrent)  # the hybrid: the passkey went into (S, z), unread
    assert rel_err(o_hy[0, 0, -1], passkey) > 0.9
    assert rel_err(o, reference(p)[0]) <= EXACT_RTOL


def test_ties_send_the_older_token_to_the_state():
    """An empty state recalls nothing: two values of equal norm tie, and the older one leaves."""
    p = dict(q=np.zeros((1, 1, 2, 1)), k=np.zeros((1, 1, 2, 1)), fq=np.ones((1, 1, 2, 1)),
             fk=np.ones((1, 1, 2, 1)), v=np.asarray([[[[1.0, 0.0], [0.0, 1.0]]]]), gate=np.zeros(1),
             decay=[0.5], window=1, sinks=0, cache=1, eps=0.0)
    p["fqd"], p["fkd"] = p["fq"], p["fk"]
    _, final = run(p)
    np.testing.assert_array_equal(final.cache_pos, [[[1]]])
    np.testing.assert_array_equal(final.S, [[[[0.5, 0.0]]]])  # token 0, decayed once: gamma^(1-0) v_0


def test_bad_arguments_are_refused():
    p = _passkey()
    with pytest.raises(LiniclError, match="exact part"):
        run({**p, "window": 0})
    with pytest.raises(LiniclError, match="cache slots"):
        run(p, state=_empty(p, cache=2))
    with pytest.raises(LiniclError, match="rule"):
        run({**p, "rule": "oldest"}, state=_empty({**p, "rule": "attention"}))
    with pytest.raises(LiniclError, match="window >= 1"):
        run({**p, "window": 0, "sinks": 1, "rule": "attention"}, state=_empty({**p, "window": 1}))
    with pytest.raises(LiniclError, match="scores"):  # a state of the other rule
        run({**p, "rule": "attention"}, state=_empty(p))
    with pytest.raises(LiniclError, match="form"):
        sc.sparse_cache(*(jnp.asarray(p[n]) for n in ("q", "k", "fq", "fk", "v")), jnp.arange(12), _empty(p),
                        gate=jnp.zeros(1), window=2, sinks=0, cache=1, form="chunked")
