"""Gated linear attention and the (gated) delta rule against plain NumPy references, one token at a
time from the recurrences: every form, the final states, chained calls, power, extreme gates.
float64; relative error <= 1e-12 (see helpers.EXACT_RTOL)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from linicl.kernels import delta_rule as dr
from linicl.kernels import gated_attention as ga
from linicl.kernels.linear_attention import LinearState
from helpers import BASELINE_MIN, EXACT_RTOL, examples, rel_err

FORMS = ["parallel", "chunked", "recurrent"]
GATES = ["none", "scalar", "vector"]
# Jitted: one compile per form and shape costs less than running every operation eagerly.
gated_attention = jax.jit(ga.gated_attention, static_argnames=("normalize", "eps", "form", "chunk_size"))
delta_rule = jax.jit(dr.delta_rule, static_argnames=("form", "chunk_size"))


# ------------------------------------------------------------------------------------ references
def reference_gated(q, k, v, S0, z0, log_alpha, q_den, k_den, normalize, eps):
    """S_t = diag(alpha_t) S_{t-1} + k_t v_t^T, z_t = alpha_t z_{t-1} + k~_t, o_t = q_t^T S_t (/ q~_t^T z_t + eps)."""
    B, H, T, _ = q.shape
    S, z = S0.copy(), z0.copy()
    out = np.zeros((B, H, T, v.shape[-1]))
    for t in range(T):
        for b in range(B):
            for h in range(H):
                if log_alpha is None:
                    alpha = np.ones(q.shape[-1])
                elif log_alpha.ndim == 3:                    # one gate per head and token
                    alpha = np.full(q.shape[-1], np.exp(log_alpha[b, h, t]))
                else:                                        # one per key feature
                    alpha = np.exp(log_alpha[b, h, t])
                S[b, h] = np.diag(alpha) @ S[b, h] + np.outer(k[b, h, t], v[b, h, t])
                z[b, h] = alpha * z[b, h] + k_den[b, h, t]
                num = q[b, h, t] @ S[b, h]
                out[b, h, t] = num / (q_den[b, h, t] @ z[b, h] + eps) if normalize else num
    return out, S, z


def reference_delta(q, k, v, beta, log_alpha, S0):
    """S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = q_t^T S_t."""
    B, H, T, F = q.shape
    S = S0.copy()
    out = np.zeros((B, H, T, v.shape[-1]))
    for t in range(T):
        for b in range(B):
            for h in range(H):
                alpha = 1.0 if log_alpha is None else np.exp(log_alpha[b, h, t])
                kt, bt = k[b, h, t], beta[b, h, t]
                S[b, h] = alpha * (np.eye(F) - bt * np.outer(kt, kt)) @ S[b, h] + bt * np.outer(kt, v[b, h, t])
                out[b, h, t] = q[b, h, t] @ S[b, h]
    return out, S


# ------------------------------------------------------------------------------------ problems
def gated_problem(seed, B, H, T, F, D, gate, normalize, separate_den, chunk, eps=0.0, strong=False):
    rng = np.random.default_rng(seed)
    # Positive features when normalised, so that the denominators are bounded away from zero.
    feat = (lambda *s: np.abs(rng.normal(size=s)) + 0.1) if normalize else (lambda *s: rng.normal(size=s))
    q, k = feat(B, H, T, F), feat(B, H, T, F)
    q_den, k_den = (feat(B, H, T, F), feat(B, H, T, F)) if separate_den else (q, k)
    shape = {"none": None, "scalar": (B, H, T), "vector": (B, H, T, F)}[gate]
    log_alpha = None if shape is None else rng.uniform(-2.0, 0.0, size=shape)
    if strong and log_alpha is not None:  # half the gates close the state almost shut
        log_alpha = np.where(rng.random(shape) < 0.5, -50.0, log_alpha)
    return dict(q=q, k=k, v=rng.normal(size=(B, H, T, D)), S0=rng.normal(size=(B, H, F, D)),
                z0=np.abs(rng.normal(size=(B, H, F))), log_alpha=log_alpha, q_den=q_den, k_den=k_den,
                separate_den=separate_den, normalize=normalize, eps=eps, chunk=chunk)


def delta_problem(seed, B, H, T, F, D, gated, chunk, strong=False):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, H, T, F))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # L2-normalised keys: the kernel's contract
    log_alpha = rng.uniform(-2.0, 0.0, size=(B, H, T)) if gated else None
    if strong and gated:
        log_alpha = np.where(rng.random((B, H, T)) < 0.5, -50.0, log_alpha)
    return dict(q=rng.normal(size=(B, H, T, F)), k=k, v=rng.normal(size=(B, H, T, D)),
                beta=rng.uniform(0.05, 1.0, size=(B, H, T)), log_alpha=log_alpha,
                S0=rng.normal(size=(B, H, F, D)), chunk=chunk)


SIZES = dict(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 40), F=st.integers(1, 5),
             D=st.integers(1, 4), chunk=st.sampled_from([1, 2, 3, 7, 16, 64]))


@st.composite
def gated_problems(draw):
    return gated_problem(draw(st.integers(0, 2**32 - 1)), **{n: draw(s) for n, s in SIZES.items()},
                         gate=draw(st.sampled_from(GATES)), normalize=draw(st.booleans()),
                         separate_den=draw(st.booleans()), eps=draw(st.sampled_from([0.0, 1e-6])))


@st.composite
def delta_problems(draw):
    return delta_problem(draw(st.integers(0, 2**32 - 1)), **{n: draw(s) for n, s in SIZES.items()},
                         gated=draw(st.booleans()))


def run_gated(p, form, state=None, sl=slice(None), log_alpha="as drawn"):
    j = lambda a: jnp.asarray(a[:, :, sl])
    state = LinearState(jnp.asarray(p["S0"]), jnp.asarray(p["z0"])) if state is None else state
    den = dict(q_den=j(p["q_den"]), k_den=j(p["k_den"])) if p["separate_den"] else {}
    gates = p["log_alpha"] if isinstance(log_alpha, str) else log_alpha
    return gated_attention(j(p["q"]), j(p["k"]), j(p["v"]), state,
                              log_alpha=None if gates is None else j(gates), normalize=p["normalize"],
                              eps=p["eps"], form=form, chunk_size=p["chunk"], **den)


def run_delta(p, form, state=None, sl=slice(None), log_alpha="as drawn"):
    j = lambda a: jnp.asarray(a[:, :, sl])
    state = dr.DeltaState(jnp.asarray(p["S0"])) if state is None else state
    gates = p["log_alpha"] if isinstance(log_alpha, str) else log_alpha
    return delta_rule(j(p["q"]), j(p["k"]), j(p["v"]), state, beta=j(p["beta"]),
                         log_alpha=None if gates is None else j(gates), form=form, chunk_size=p["chunk"])


def ref_gated(p):
    return reference_gated(p["q"], p["k"], p["v"], p["S0"], p["z0"], p["log_alpha"], p["q_den"],
                           p["k_den"], p["normalize"], p["eps"])


def ref_delta(p):
    return reference_delta(p["q"], p["k"], p["v"], p["beta"], p["log_alpha"], p["S0"])


def check_gated_forms(p, forms=FORMS):
    ref_o, ref_S, ref_z = ref_gated(p)
    for form in forms:
        o, (S, z) = run_gated(p, form)
        assert rel_err(o, ref_o) <= EXACT_RTOL, form
        assert rel_err(S, ref_S) <= EXACT_RTOL and rel_err(z, ref_z) <= EXACT_RTOL, form
    return ref_o


def check_delta_forms(p, forms=FORMS):
    ref_o, ref_S = ref_delta(p)
    for form in forms:
        o, (S,) = run_delta(p, form)
        assert rel_err(o, ref_o) <= EXACT_RTOL, form
        assert rel_err(S, ref_S) <= EXACT_RTOL, form
    return ref_o


# ------------------------------------------------------------------------------------ gated attention
@given(p=gated_problems())
def test_gated_forms_match_the_reference(p):
    ref_o = check_gated_forms(p)
    # Power: the initial state matters, and so does the gate.
    zero = LinearState(jnp.zeros_like(p["S0"]), jnp.zeros_like(p["z0"]))
    assert rel_err(run_gated(p, "parallel", state=zero)[0], ref_o) >= BASELINE_MIN
    if p["log_alpha"] is not None:
        assert rel_err(run_gated(p, "parallel", log_alpha=None)[0], ref_o) >= BASELINE_MIN


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk", [(1, 4), (4, 4), (5, 4), (9, 4), (6, 1)])
def test_gated_edge_lengths(gate, T, chunk):
    """One token, exactly one chunk, one token past a chunk, a remainder, chunks of one token."""
    p = gated_problem(T * 7 + chunk, 2, 2, T, 3, 2, gate, normalize=True, separate_den=gate == "vector",
                      chunk=chunk, eps=1e-6)
    ref_o = check_gated_forms(p, FORMS + ["auto"])
    # The decode step from the state after T-1 tokens gives the last output.
    _, state = run_gated(p, "recurrent", sl=slice(0, T - 1))
    last = lambda a: None if a is None else jnp.asarray(a[:, :, -1])
    o, _ = ga.step(last(p["q"]), last(p["k"]), last(p["v"]), state, log_alpha=last(p["log_alpha"]),
                   q_den=last(p["q_den"]), k_den=last(p["k_den"]), normalize=True, eps=1e-6)
    assert rel_err(o, ref_o[:, :, -1]) <= EXACT_RTOL


@examples(0.6)
@given(p=gated_problems(), split=st.floats(0.0, 1.0))
def test_gated_state_carries_everything_a_prefix_contributes(p, split):
    """Running [x1; x2] equals running x2 from x1's final state (what prompt conversion relies on)."""
    T = p["q"].shape[2]
    n = int(split * (T - 1)) if T > 1 else 0
    if n == 0:
        return
    ref_o, ref_S, ref_z = ref_gated(p)
    for form in FORMS:
        _, state = run_gated(p, form, sl=slice(0, n))
        rest, (S, z) = run_gated(p, form, state=state, sl=slice(n, None))
        assert rel_err(rest, ref_o[:, :, n:]) <= EXACT_RTOL, form
        assert rel_err(S, ref_S) <= EXACT_RTOL and rel_err(z, ref_z) <= EXACT_RTOL, form


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_gated_extreme_gates_stay_finite_and_exact(gate):
    """log alpha = -50 on half the tokens: the chunked form has no overflow (no inf, no NaN)."""
    p = gated_problem(3, 1, 2, 150, 4, 3, gate, normalize=False, separate_den=False, chunk=64, strong=True)
    o, (S, z) = run_gated(p, "chunked")
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all() and np.isfinite(np.asarray(z)).all()
    ref_o, ref_S, _ = ref_gated(p)
    assert rel_err(o, ref_o) <= EXACT_RTOL and rel_err(S, ref_S) <= EXACT_RTOL
    # float32 too: nothing overflows in single precision either.
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
    o32, (S32, _) = gated_attention(f32(p["q"]), f32(p["k"]), f32(p["v"]),
                                    LinearState(f32(p["S0"]), f32(p["z0"])), log_alpha=f32(p["log_alpha"]),
                                    normalize=False, form="chunked", chunk_size=64)
    assert np.isfinite(np.asarray(o32)).all() and np.isfinite(np.asarray(S32)).all()


def test_gated_scalar_gate_equals_a_vector_gate_constant_over_features():
    p = gated_problem(5, 1, 2, 11, 3, 2, "scalar", normalize=True, separate_den=True, chunk=4)
    vec = np.repeat(p["log_alpha"][..., None], 3, axis=-1)
    for form in FORMS:
        o_s, (S_s, z_s) = run_gated(p, form)
        o_v, (S_v, z_v) = run_gated(p, form, log_alpha=vec)
        assert rel_err(o_v, o_s) <= EXACT_RTOL and rel_err(S_v, S_s) <= EXACT_RTOL, form


def test_gated_rejects_bad_arguments():
    q = jnp.zeros((1, 2, 5, 3))
    state = ga.zero_state(1, 2, 3, 4, q.dtype)
    v = jnp.zeros((1, 2, 5, 4))
    with pytest.raises(ValueError, match="log_alpha"):
        ga.gated_attention(q, q, v, state, log_alpha=jnp.zeros((1, 2, 5, 2)))
    with pytest.raises(ValueError, match="chunk_size"):
        ga.gated_attention(q, q, v, state, chunk_size=0)
    with pytest.raises(ValueError, match="form"):
        ga.gated_attention(q, q, v, state, form="quadratic")


# ------------------------------------------------------------------------------------ delta rule
@given(p=delta_problems())
def test_delta_forms_match_the_reference(p):
    ref_o = check_delta_forms(p)
    # Power: the initial state matters, the gate matters, and the delta rule is not the additive rule
    # (S_t = alpha_t S_{t-1} + beta_t k_t v_t^T, gated attention with keys beta_t k_t).
    zero = dr.DeltaState(jnp.zeros_like(p["S0"]))
    assert rel_err(run_delta(p, "parallel", state=zero)[0], ref_o) >= BASELINE_MIN
    if p["log_alpha"] is not None:
        assert rel_err(run_delta(p, "parallel", log_alpha=None)[0], ref_o) >= BASELINE_MIN
    T = p["q"].shape[2]
    if T > 1:
        additive, _ = gated_attention(jnp.asarray(p["q"]), jnp.asarray(p["k"] * p["beta"][..., None]),
                                      jnp.asarray(p["v"]),
                                      LinearState(jnp.asarray(p["S0"]), jnp.zeros(p["S0"].shape[:3])),
                                      log_alpha=None if p["log_alpha"] is None else jnp.asarray(p["log_alpha"]),
                                      normalize=False, form="parallel")
        assert rel_err(additive, ref_o) >= BASELINE_MIN


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("T,chunk", [(1, 4), (4, 4), (5, 4), (9, 4), (6, 1), (70, 64)])
def test_delta_edge_lengths(gated, T, chunk):
    """One token, exactly one chunk, one token past a chunk, a remainder, chunks of one token, and a
    chunk of 64 (the UT transform's block recursion at full depth, with padding)."""
    p = delta_problem(T * 7 + chunk, 2, 2, T, 4, 3, gated, chunk)
    ref_o = check_delta_forms(p, FORMS + ["auto"])
    _, state = run_delta(p, "recurrent", sl=slice(0, T - 1))
    last = lambda a: None if a is None else jnp.asarray(a[:, :, -1])
    o, _ = dr.step(last(p["q"]), last(p["k"]), last(p["v"]), state, beta=last(p["beta"]),
                   log_alpha=last(p["log_alpha"]))
    assert rel_err(o, ref_o[:, :, -1]) <= EXACT_RTOL


@examples(0.6)
@given(p=delta_problems(), split=st.floats(0.0, 1.0))
def test_delta_state_carries_everything_a_prefix_contributes(p, split):
    T = p["q"].shape[2]
    n = int(split * (T - 1)) if T > 1 else 0
    if n == 0:
        return
    ref_o, ref_S = ref_delta(p)
    for form in FORMS:
        _, state = run_delta(p, form, sl=slice(0, n))
        rest, (S,) = run_delta(p, form, state=state, sl=slice(n, None))
        assert rel_err(rest, ref_o[:, :, n:]) <= EXACT_RTOL, form
        assert rel_err(S, ref_S) <= EXACT_RTOL, form


def test_delta_extreme_gates_stay_finite_and_exact():
    p = delta_problem(4, 1, 2, 150, 4, 3, True, 64, strong=True)
    o, (S,) = run_delta(p, "chunked")
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all()
    ref_o, ref_S = ref_delta(p)
    assert rel_err(o, ref_o) <= EXACT_RTOL and rel_err(S, ref_S) <= EXACT_RTOL
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    o32, (S32,) = delta_rule(f32(p["q"]), f32(p["k"]), f32(p["v"]), dr.DeltaState(f32(p["S0"])),
                             beta=f32(p["beta"]), log_alpha=f32(p["log_alpha"]), form="chunked", chunk_size=64)
    assert np.isfinite(np.asarray(o32)).all() and np.isfinite(np.asarray(S32)).all()


def test_delta_with_orthonormal_keys_is_the_additive_rule():
    """Orthonormal keys and an empty state: k_t k_t^T removes nothing, so every form equals gated
    attention with keys beta_t k_t (a check of one kernel against the other)."""
    rng = np.random.default_rng(1)
    B, H, T, F, D = 1, 2, 5, 6, 3
    basis = np.linalg.qr(rng.normal(size=(B * H, F, F)))[0]               # orthonormal columns
    k = np.swapaxes(basis, 1, 2)[:, :T].reshape(B, H, T, F)
    p = dict(q=rng.normal(size=(B, H, T, F)), k=k, v=rng.normal(size=(B, H, T, D)),
             beta=rng.uniform(0.1, 1.0, size=(B, H, T)), log_alpha=rng.uniform(-1, 0, size=(B, H, T)),
             S0=np.zeros((B, H, F, D)), chunk=2)
    additive, _ = gated_attention(jnp.asarray(p["q"]), jnp.asarray(k * p["beta"][..., None]), jnp.asarray(p["v"]),
                                  ga.zero_state(B, H, F, D, jnp.float64), log_alpha=jnp.asarray(p["log_alpha"]),
                                  normalize=False, form="parallel")
    for form in FORMS:
        assert rel_err(run_delta(p, form)[0], additive) <= EXACT_RTOL, form


def test_delta_rejects_bad_arguments():
    q = jnp.zeros((1, 2, 5, 3))
    state = dr.zero_state(1, 2, 3, 4, q.dtype)
    v, beta = jnp.zeros((1, 2, 5, 4)), jnp.ones((1, 2, 5))
    with pytest.raises(ValueError, match="beta"):
        dr.delta_rule(q, q, v, state, beta=jnp.ones((1, 2, 4)))
    with pytest.raises(ValueError, match="log_alpha"):
        dr.delta_rule(q, q, v, state, beta=beta, log_alpha=jnp.zeros((1, 2, 5, 3)))
    with pytest.raises(ValueError, match="chunk_size"):
        dr.delta_rule(q, q, v, state, beta=beta, chunk_size=0)
    with pytest.raises(ValueError, match="form"):
        dr.delta_rule(q, q, v, state, beta=beta, form="quadratic")


# ------------------------------------------------------------------------------------ gradients
def test_gradients_agree_across_forms_and_stay_finite():
    """Training differentiates the chunked form: its gradients (padding, gates of e^-50, the UT
    transform) equal the recurrent form's and are finite."""
    gp = gated_problem(6, 1, 2, 11, 3, 2, "vector", normalize=True, separate_den=False, chunk=4, strong=True)
    dp = delta_problem(7, 1, 2, 11, 3, 2, True, 4, strong=True)

    def gated_loss(form):
        def loss(q, k, v, a):
            o, (S, z) = ga.gated_attention(q, k, v, LinearState(jnp.asarray(gp["S0"]), jnp.asarray(gp["z0"])),
                                           log_alpha=a, normalize=True, form=form, chunk_size=4)
            return jnp.sum(o ** 2) + jnp.sum(S) + jnp.sum(z)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(gp[n]) for n in ("q", "k", "v", "log_alpha")))

    def delta_loss(form):
        def loss(q, k, v, beta, a):
            o, (S,) = dr.delta_rule(q, k, v, dr.DeltaState(jnp.asarray(dp["S0"])), beta=beta, log_alpha=a,
                                    form=form, chunk_size=4)
            return jnp.sum(o ** 2) + jnp.sum(S)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
            *(jnp.asarray(dp[n]) for n in ("q", "k", "v", "beta", "log_alpha")))

    for grads in (gated_loss, delta_loss):
        ref = grads("recurrent")
        assert all(np.isfinite(np.asarray(g)).all() for g in ref)
        for form in ("parallel", "chunked"):
            for g, r in zip(grads(form), ref):
                assert np.isfinite(np.asarray(g)).all() and rel_err(g, r) <= EXACT_RTOL, form


def test_auto_form_runs_a_vector_gate_recurrently():
    """The quadratic forms of a vector gate hold f[C, C, F] per chunk; the recurrent scan was faster at
    every measured length (``gated_attention.auto_form``); scalar gates keep ``choose_form``."""
    assert all(ga.auto_form("vector", T, 64) == "recurrent" for T in (1, 128, 129, 8192))
    for kind in ("none", "scalar"):
        assert [ga.auto_form(kind, T, 64) for T in (128, 129)] == ["parallel", "chunked"]
