"""Kernel numerics in float32 at the extremes (issue 25, items 1 and 10).

* Gates: log alpha = -inf or very negative (-1e3 .. -1e6) on a few tokens. The parallel and chunked
  forms of gated attention and the gated delta rule must agree with the recurrent form (no NaN from
  -inf - (-inf), no cancellation in the segment sums of log-gates); linear attention with gamma = 0.
* Rope: angles p * theta_j at positions up to 2^20 in float32, the rotation itself and the re-basing
  R(-n) of the conversion path, against float64 references.

The session runs in float64 (conftest), so every float32 input is built explicitly and each result is
checked to be float32. u = 2^-24 ~ 6e-8 is float32's unit roundoff.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linicl.kernels import delta_rule as dr
from linicl.kernels import gated_attention as ga
from linicl.kernels.linear_attention import LinearState, linear_attention
from linicl.kernels.positions import apply_rope, rope_angles
from helpers import BASELINE_MIN, rel_err

EXTREMES = [-np.inf, -1e3, -1e5, -1e6]
B, H, T, F, D, CHUNK = 1, 2, 48, 4, 3, 16
# Extreme gates inside the first chunk, on the second chunk's first token and inside the third: the
# tokens after each one see a prefix sum that contains it.
STRONG = [3, 16, 37]
# A float32 form against the float64 recurrence: each weight is the exp of a sum of at most T = 48
# log-gates in [-0.5, 0] (|sum| <= 24), then at most T + 1 products are added; the errors measured were
# <= 3e-7, and 2e-6 (~30 u) leaves a margin. The old prefix-sum differences missed it by 10x or more
# (1e-5 at -1e3, 1e-2 at -1e6; NaN at -inf).
F32_RTOL = 2e-6


def f32(a):
    return jnp.asarray(a, jnp.float32)


def gates(rng, shape, extreme, vector: bool) -> np.ndarray:
    """Moderate log-gates in [-0.5, 0] (long memory: many weights matter) and ``extreme`` on the
    STRONG tokens (for a vector gate on every other feature only, so the rest of the state remains)."""
    a = rng.uniform(-0.5, 0.0, size=shape)
    if vector:
        a[:, :, STRONG, ::2] = extreme
    else:
        a[:, :, STRONG] = extreme
    return a


# ---------------------------------------------------------------------------------- gated attention
@pytest.mark.parametrize("extreme", EXTREMES)
@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_gated_attention_forms_agree_at_extreme_gates_in_float32(kind, extreme):
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, B, H, T, F))
    v = rng.normal(size=(B, H, T, D))
    state = ga.LinearState(rng.normal(size=(B, H, F, D)), np.abs(rng.normal(size=(B, H, F))))
    a = gates(rng, (B, H, T) if kind == "scalar" else (B, H, T, F), extreme, kind == "vector")
    # The same float32 inputs, evaluated token by token in float64: the reference.
    x32 = [f32(x) for x in (q, k, v)]
    s32 = ga.LinearState(*map(f32, state))
    ref_o, ref_state = ga.recurrent(*(jnp.asarray(x, jnp.float64) for x in x32),
                                    ga.LinearState(*(jnp.asarray(s, jnp.float64) for s in s32)),
                                    log_alpha=jnp.asarray(f32(a), jnp.float64), normalize=False)
    for form in ("recurrent", "parallel", "chunked"):
        o, (S, z) = ga.gated_attention(*x32, s32, log_alpha=f32(a), normalize=False, form=form,
                                       chunk_size=CHUNK)
        assert o.dtype == S.dtype == jnp.float32, form
        assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all(), form
        assert rel_err(o, ref_o) <= F32_RTOL, form
        assert rel_err(S, ref_state.S) <= F32_RTOL and rel_err(z, ref_state.z) <= F32_RTOL, form
    # Power: the strong gates matter (they erase what came before them).
    moderate = gates(np.random.default_rng(0), a.shape, -0.1, kind == "vector")
    o_mod, _ = ga.gated_attention(*x32, s32, log_alpha=f32(moderate), normalize=False, form="chunked",
                                  chunk_size=CHUNK)
    assert rel_err(o_mod, ref_o) >= BASELINE_MIN


@pytest.mark.parametrize("C", [1, 2, 7, 16, 17, 64, 150])
def test_segment_sums_add_the_log_gates_between_two_tokens(C):
    """G[t, i] = a_{i+1} + ... + a_t below the diagonal, 0 on and above it, -inf stays -inf, for
    lengths that fill the internal blocks and lengths that do not. Gates are multiples of 1/4, so every
    partial sum is exact in float64 and any order of summation must give the same numbers."""
    rng = np.random.default_rng(C)
    a = -rng.integers(0, 12, size=(1, 2, C)) / 4.0
    a[0, 1, C // 3] = -np.inf
    expect = np.zeros((1, 2, C, C))
    for t in range(C):
        for i in range(t):
            expect[:, :, t, i] = a[:, :, i + 1:t + 1].sum(-1)
    np.testing.assert_array_equal(np.asarray(ga.segment_sums(jnp.asarray(a))), expect)
    vec = np.asarray(ga.segment_sums(jnp.asarray(np.stack([a, 2 * a], -1))))  # one sum per feature
    np.testing.assert_array_equal(vec[..., 0], expect)
    np.testing.assert_array_equal(vec[..., 1], 2 * expect)


# ---------------------------------------------------------------------------------- gated delta rule
@pytest.mark.parametrize("extreme", EXTREMES)
def test_gated_delta_rule_forms_agree_at_extreme_gates_in_float32(extreme):
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(2, B, H, T, F))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # unit keys: the kernel's contract
    v = rng.normal(size=(B, H, T, D))
    beta = rng.uniform(0.05, 1.0, size=(B, H, T))
    a = gates(rng, (B, H, T), extreme, vector=False)
    x32 = [f32(x) for x in (q, k, v)]
    S0 = dr.DeltaState(f32(rng.normal(size=(B, H, F, D))))
    ref_o, (ref_S,) = dr.recurrent(*(jnp.asarray(x, jnp.float64) for x in x32),
                                   dr.DeltaState(jnp.asarray(S0.S, jnp.float64)),
                                   beta=jnp.asarray(f32(beta), jnp.float64), log_alpha=jnp.asarray(f32(a), jnp.float64))
    for form in ("recurrent", "parallel", "chunked"):
        o, (S,) = dr.delta_rule(*x32, S0, beta=f32(beta), log_alpha=f32(a), form=form, chunk_size=CHUNK)
        assert o.dtype == S.dtype == jnp.float32, form
        assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all(), form
        assert rel_err(o, ref_o) <= F32_RTOL and rel_err(S, ref_S) <= F32_RTOL, form


# ---------------------------------------------------------------------------------- linear attention
@pytest.mark.parametrize("form", ["parallel", "chunked"])
def test_linear_attention_with_gamma_zero_matches_the_recurrence(form):
    """gamma = 0 (log gamma = -inf): each token sees only itself. gamma^0 = 1, never 0 * -inf = NaN.
    float64: exact to rounding (EXACT_RTOL-level; the weights are 0 or 1 for that head)."""
    rng = np.random.default_rng(2)
    q, k = np.abs(rng.normal(size=(2, B, H, 20, F))) + 0.1
    v = rng.normal(size=(B, H, 20, D))
    state = LinearState(jnp.asarray(rng.normal(size=(B, H, F, D))), jnp.asarray(np.abs(rng.normal(size=(B, H, F)))))
    log_gamma = jnp.asarray([-np.inf, -0.1])
    kw = dict(log_gamma=log_gamma, form=form, chunk_size=8)
    ref_o, (ref_S, ref_z) = linear_attention(q, k, v, state, log_gamma=log_gamma, form="recurrent")
    o, (S, z) = linear_attention(q, k, v, state, **kw)
    assert rel_err(o, ref_o) <= 1e-12 and rel_err(S, ref_S) <= 1e-12 and rel_err(z, ref_z) <= 1e-12
    # The gamma = 0 head reads its own token only: o_t = v_t (normalised, one term).
    np.testing.assert_allclose(np.asarray(o[:, 0]), v[:, 0], rtol=1e-12)


# ---------------------------------------------------------------------------------- rope
def rope_reference(x: np.ndarray, positions: np.ndarray, base: float, style: str) -> np.ndarray:
    """float64 rotation by p * theta_j, x ``[n, d]`` (d even), positions ``[n]``."""
    n = x.shape[-1] // 2
    theta = base ** (-np.arange(0, 2 * n, 2, dtype=np.float64) / (2 * n))
    ang = positions[:, None].astype(np.float64) * theta
    c, s = np.cos(ang), np.sin(ang)
    if style == "half":
        a, b = x[:, :n], x[:, n:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)
    a, b = x[:, 0::2], x[:, 1::2]
    return np.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)


# Positions up to 2^15 (and down to -2^15: the re-basing R(-n)), every one near the ends.
POSITIONS = np.concatenate([np.arange(-32768, -32000), np.arange(-32000, 32000, 37), np.arange(32000, 32769)])
# float32 rope against float64: cos and sin of an angle within ~6e-7 rad of exact (rope_angles), then
# two products and a sum per coordinate: measured <= 2.4e-7 relative per vector; 1e-6 leaves a margin.
# The old float32 angles (p * theta_j rounded at |p| ~ 3e4) were off by ~1e-3 rad: 6e-4 per vector.
ROPE_F32_RTOL = 1e-6


def vector_rel_err(y, ref) -> float:
    return float(np.max(np.linalg.norm(np.asarray(y, np.float64) - ref, axis=-1) / np.linalg.norm(ref, axis=-1)))


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("d,base", [(64, 10_000.0), (128, 500_000.0)])
def test_float32_rope_is_accurate_at_32k_positions(d, base, style):
    x = np.asarray(np.random.default_rng(3).normal(size=(len(POSITIONS), d)), np.float32)
    y = apply_rope(jnp.asarray(x), jnp.asarray(POSITIONS, jnp.int32), base, style)
    assert y.dtype == jnp.float32
    assert vector_rel_err(y, rope_reference(x.astype(np.float64), POSITIONS, base, style)) <= ROPE_F32_RTOL


def test_float32_rope_angles_are_reduced_exactly_up_to_2_to_the_20():
    """rope_angles(p) is p * theta_j mod 2 pi within 1e-6 rad (measured 6.3e-7: a few roundings of
    fractions of a turn, u ~ 6e-8 each, times 2 pi) for |p| <= 2^20."""
    d, base = 128, 10_000.0
    p = np.concatenate([np.arange(0, 2**20, 97), [2**20, -(2**20), -1, 1]])
    got = np.asarray(rope_angles(jnp.asarray(p, jnp.int32), d, base, jnp.float32), np.float64)
    exact = p[:, None] * base ** (-np.arange(0, d, 2) / d)
    assert got.dtype == np.float64 and np.all(np.abs(got) <= np.pi + 1e-6)
    off = np.abs(np.mod(got - exact + np.pi, 2 * np.pi) - np.pi)   # angle difference modulo a turn
    assert off.max() <= 1e-6


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_float32_rebasing_a_rope_state_matches_the_relative_rotation(style):
    """The conversion path: keys rotated to absolute positions i of a long prompt, then re-based by
    R(-n) (``nn.attention.rebase_state``), must equal R(i - n) as computed in float64."""
    d, base, n = 64, 10_000.0, 32_000
    i = np.arange(n - 300, n)
    x = np.asarray(np.random.default_rng(4).normal(size=(len(i), d)), np.float32)
    rebased = apply_rope(apply_rope(jnp.asarray(x), jnp.asarray(i, jnp.int32), base, style), -n, base, style)
    assert rebased.dtype == jnp.float32
    # Two rotations in float32: twice the error of one.
    assert vector_rel_err(rebased, rope_reference(x.astype(np.float64), i - n, base, style)) <= 2 * ROPE_F32_RTOL


def test_float64_rope_keeps_float64_accuracy_at_large_positions():
    p = POSITIONS
    x = np.random.default_rng(5).normal(size=(len(p), 64))
    y = apply_rope(jnp.asarray(x), jnp.asarray(p), 10_000.0, "half")
    assert y.dtype == jnp.float64
    # The float64 reference itself rounds p * theta_j at ~3e4 rad: ~1e-12 absolute.
    assert vector_rel_err(y, rope_reference(x, p, 10_000.0, "half")) <= 1e-11


def test_rope_rejects_a_bad_base():
    x = jnp.zeros((3, 4))
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="base must be a finite number > 0"):
            apply_rope(x, jnp.arange(3), base=bad)
    with pytest.raises(ValueError, match="base must be a concrete number"):
        jax.jit(lambda b: apply_rope(x, jnp.arange(3), base=b))(10_000.0)
