"""Kernels against independent NumPy references: linear attention (three forms), feature maps, rope,
softmax attention. float64; relative error <= 1e-12 (see helpers.EXACT_RTOL)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from linicl.kernels import feature_maps
from linicl.kernels.linear_attention import LinearState, choose_form, linear_attention
from linicl.kernels.positions import apply_rope
from linicl.kernels.softmax_attention import softmax_attention
from helpers import BASELINE_MIN, EXACT_RTOL, examples, rel_err

FORMS = ["parallel", "chunked", "recurrent"]


def reference_linear(q, k, v, S0, z0, gamma, q_den, k_den, normalize, eps):
    """Direct sums, one position at a time: S_t = g^(t+1) S0 + sum_{i<=t} g^(t-i) k_i v_i^T."""
    B, H, T, _ = q.shape
    g = np.ones(H) if gamma is None else np.asarray(gamma)
    out = np.zeros((B, H, T, v.shape[-1]))
    for t in range(T):
        w = g[:, None] ** (t - np.arange(t + 1))[None, :]              # [H, t+1]
        S = g[None, :, None, None] ** (t + 1) * S0 + np.einsum("hi,bhif,bhid->bhfd", w, k[:, :, :t + 1], v[:, :, :t + 1])
        z = g[None, :, None] ** (t + 1) * z0 + np.einsum("hi,bhif->bhf", w, k_den[:, :, :t + 1])
        num = np.einsum("bhf,bhfd->bhd", q[:, :, t], S)
        out[:, :, t] = num / (np.einsum("bhf,bhf->bh", q_den[:, :, t], z) + eps)[..., None] if normalize else num
    return out, S, z


@st.composite
def linear_problems(draw):
    B, H, T = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    F, D = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    normalize, separate_den = draw(st.booleans()), draw(st.booleans())
    # Positive features when normalised, so that the denominators are bounded away from zero.
    feat = (lambda *s: np.abs(rng.normal(size=s)) + 0.1) if normalize else (lambda *s: rng.normal(size=s))
    q, k = feat(B, H, T, F), feat(B, H, T, F)
    q_den, k_den = (feat(B, H, T, F), feat(B, H, T, F)) if separate_den else (q, k)
    gamma = draw(st.one_of(st.none(), st.lists(st.floats(0.3, 1.0), min_size=H, max_size=H)))
    return dict(q=q, k=k, v=rng.normal(size=(B, H, T, D)), S0=rng.normal(size=(B, H, F, D)),
                z0=np.abs(rng.normal(size=(B, H, F))), gamma=gamma, q_den=q_den, k_den=k_den,
                separate_den=separate_den, normalize=normalize, eps=draw(st.sampled_from([0.0, 1e-6])),
                chunk=draw(st.sampled_from([1, 2, 3, 7, 64])))


def run_form(p, form, state=None, sl=slice(None)):
    j = lambda a: jnp.asarray(a[:, :, sl])
    state = LinearState(jnp.asarray(p["S0"]), jnp.asarray(p["z0"])) if state is None else state
    den = dict(q_den=j(p["q_den"]), k_den=j(p["k_den"])) if p["separate_den"] else {}
    log_gamma = None if p["gamma"] is None else jnp.log(jnp.asarray(p["gamma"]))
    return linear_attention(j(p["q"]), j(p["k"]), j(p["v"]), state, log_gamma=log_gamma,
                            normalize=p["normalize"], eps=p["eps"], form=form, chunk_size=p["chunk"], **den)


@given(p=linear_problems())
def test_every_form_matches_the_direct_sums(p):
    ref_o, ref_S, ref_z = reference_linear(p["q"], p["k"], p["v"], p["S0"], p["z0"], p["gamma"],
                                           p["q_den"], p["k_den"], p["normalize"], p["eps"])
    for form in FORMS + ["auto"]:
        o, (S, z) = run_form(p, form)
        assert rel_err(o, ref_o) <= EXACT_RTOL, form
        assert rel_err(S, ref_S) <= EXACT_RTOL and rel_err(z, ref_z) <= EXACT_RTOL, form
    # Power: the initial state matters.
    zero = LinearState(jnp.zeros_like(p["S0"]), jnp.zeros_like(p["z0"]))
    o0, _ = run_form(p, "parallel", state=zero)
    assert rel_err(o0, ref_o) >= BASELINE_MIN


@examples(0.6)
@given(p=linear_problems(), split=st.floats(0.0, 1.0))
def test_state_carries_everything_a_prefix_contributes(p, split):
    """Kernel-level ICLCA: running [x1; x2] equals running x2 from x1's final state."""
    T = p["q"].shape[2]
    n = int(split * (T - 1)) if T > 1 else 0
    if n == 0:
        return
    full, _ = run_form(p, "parallel")
    for form in FORMS:
        _, state = run_form(p, form, sl=slice(0, n))
        rest, _ = run_form(p, form, state=state, sl=slice(n, None))
        assert rel_err(rest, full[:, :, n:]) <= EXACT_RTOL, form


@pytest.mark.parametrize("form", FORMS)
def test_linear_attention_is_causal(form):
    rng = np.random.default_rng(0)
    B, H, T, F, D, t = 2, 2, 23, 4, 3, 9
    q, k, v = (jnp.asarray(np.abs(rng.normal(size=(B, H, T, s)))) for s in (F, F, D))
    state = LinearState(jnp.zeros((B, H, F, D)), jnp.zeros((B, H, F)))
    kw = dict(log_gamma=jnp.log(jnp.array([0.9, 1.0])), normalize=True, eps=1e-6, form=form, chunk_size=4)
    o, _ = linear_attention(q, k, v, state, **kw)
    k2, v2 = k.at[:, :, t:].set(7.0), v.at[:, :, t:].set(-3.0)
    o2, _ = linear_attention(q, k2, v2, state, **kw)
    np.testing.assert_array_equal(o[:, :, :t], o2[:, :, :t])
    assert rel_err(o2[:, :, t:], o[:, :, t:]) >= BASELINE_MIN


def test_auto_form_is_parallel_when_short_and_chunked_when_long():
    assert choose_form(16, 64) == "parallel" and choose_form(4096, 64) == "chunked"


# ---------------------------------------------------------------------------------------- feature maps
@given(d=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_taylor2_inner_product_is_the_second_order_taylor_series(d, seed):
    q, k = np.random.default_rng(seed).normal(size=(2, d))
    s = q @ k / math.sqrt(d)
    fq, fk = feature_maps.taylor2(jnp.asarray(q)), feature_maps.taylor2(jnp.asarray(k))
    assert fq.shape == (feature_maps.feature_dim("taylor2", d),)
    assert abs(float(fq @ fk) - (1 + s + s * s / 2)) <= EXACT_RTOL * (1 + s * s)


def test_feature_maps_shapes_and_signs():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5)) * 4)
    for name, fn in feature_maps.FEATURE_MAPS.items():
        assert fn(x).shape == (3, feature_maps.feature_dim(name, 5))
    assert jnp.all(feature_maps.elu_plus_one(x) > 0) and jnp.all(feature_maps.relu(x) >= 0)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        feature_maps.get("softplus")


# ---------------------------------------------------------------------------------------- rope
@given(d=st.integers(1, 9), a=st.integers(-50, 50), b=st.integers(-50, 50), seed=st.integers(0, 2**16),
       style=st.sampled_from(["interleaved", "half"]))
def test_rope_composes_inverts_and_is_relative(d, a, b, seed, style):
    rng = np.random.default_rng(seed)
    x, y = jnp.asarray(rng.normal(size=d)), jnp.asarray(rng.normal(size=d))
    r = lambda v, p: apply_rope(v, jnp.asarray(p), style=style)
    assert rel_err(r(r(x, a), b), r(x, a + b)) <= EXACT_RTOL
    assert rel_err(r(r(x, a), -a), x) <= EXACT_RTOL
    # <R(a) x, R(b) y> depends on b - a only.
    assert abs(float(r(x, a) @ r(y, b) - x @ r(y, b - a))) <= EXACT_RTOL * float(jnp.linalg.norm(x) * jnp.linalg.norm(y))
    if d % 2:  # an odd last coordinate is left alone
        assert float(r(x, a)[-1]) == float(x[-1])


def test_rope_styles_differ_by_a_permutation_and_match_the_formula():
    d, p = 6, 5
    x = jnp.asarray(np.random.default_rng(1).normal(size=d))
    perm = np.array([0, 2, 4, 1, 3, 5])  # interleaved pairs (0,1),(2,3),(4,5) -> half layout
    inter = apply_rope(x, p, style="interleaved")
    half = apply_rope(x[perm], p, style="half")
    assert rel_err(half, inter[perm]) <= EXACT_RTOL
    theta0 = 1.0  # base^0
    expected0 = x[0] * math.cos(p * theta0) - x[1] * math.sin(p * theta0)
    assert abs(float(inter[0]) - expected0) <= 1e-14
    with pytest.raises(ValueError, match="style"):
        apply_rope(x, p, style="neox")


# ---------------------------------------------------------------------------------------- softmax
def reference_softmax(q, k, v):
    T, d = q.shape[-2], q.shape[-1]
    s = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(d)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bhsd->bhtd", w / w.sum(-1, keepdims=True), v)


@given(T=st.integers(1, 20), d=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_softmax_attention_matches_reference_and_any_key_order(T, d, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, 3, T, d)) for _ in range(3))
    pos = jnp.arange(T)
    o = softmax_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pos, pos)
    assert rel_err(o, reference_softmax(q, k, v)) <= EXACT_RTOL
    # A cache stores keys in slots with their positions; slot order and empty slots do not matter.
    perm = rng.permutation(T + 3)
    ks, vs = np.zeros((2, 3, T + 3, d)), np.zeros((2, 3, T + 3, d))
    kpos = np.full(T + 3, np.iinfo(np.int32).max)
    ks[:, :, perm[:T]], vs[:, :, perm[:T]], kpos[perm[:T]] = k, v, np.arange(T)
    o2 = softmax_attention(jnp.asarray(q), jnp.asarray(ks), jnp.asarray(vs), pos, jnp.asarray(kpos))
    assert rel_err(o2, o) <= EXACT_RTOL
