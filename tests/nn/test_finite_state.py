"""Finite-state attention options (hedgehog maps, rope on the inputs, exact windows, sinks): the
ICLCA conversion stays exact, decoding continues it, the kernel forms agree, and the model computes
the hybrid formula (checked against an independent NumPy sum over keys)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl import iclca
from linicl.errors import ConfigError, LiniclError
from linicl.interventions import capture
from linicl.kernels import feature_maps, hybrid_attention as hy
from linicl.kernels.positions import apply_rope
from linicl.names import PROMPT_STATE, block_site, layer_scope
from helpers import (BASELINE_MIN, EXACT_RTOL, HYBRID_FAMILIES, apply, assert_same_state, check_converting_twice,
                     examples, finite_state_configs, init, offset_family, per_stratum, perturb_learned_maps,
                     prompt_and_query, prompted, rel_err, tokens)


def _model(cfg, seed):
    model, variables = init(cfg, seed)
    return model, perturb_learned_maps(variables, seed + 5)


# ------------------------------------------------------------------------- (a) the conversion
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@per_stratum(0.8, len(HYBRID_FAMILIES))
@given(data=st.data(), n=st.integers(1, 12), m=st.integers(1, 6), batch=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_converted_equals_prompted(family, data, n, m, batch, seed):
    """Prompts shorter and longer than the window and the sinks: the query alone, continuing at the
    stored offset, is the prompted model at the query."""
    cfg = data.draw(finite_state_configs(family=family), label="cfg")
    assert offset_family(cfg) == family
    model, variables = _model(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, batch, m, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)
    converted = iclca.convert(model, variables, prompt)
    assert rel_err(apply(model, converted, query), reference) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN
    offset = int(converted["position"]["offset"])
    assert offset == (n if cfg.keeps_offset else 0)


# ------------------------------------------------------------------- (b) repeated conversion
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@per_stratum(0.5, len(HYBRID_FAMILIES))
@given(data=st.data(), n1=st.integers(1, 9), n2=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_converting_twice_equals_converting_the_concatenation(family, data, n1, n2, seed):
    cfg = data.draw(finite_state_configs(family=family), label="cfg")
    assert offset_family(cfg) == family
    model, variables = _model(cfg, seed)
    check_converting_twice(model, variables, n1, n2, seed, query_len=4)


# ----------------------------------------------------------------------------- (c) generation
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@per_stratum(0.4, len(HYBRID_FAMILIES))
@given(data=st.data(), n=st.integers(1, 10), m=st.integers(1, 4), n_new=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_generation_after_conversion_equals_generation_after_the_prompt(family, data, n, m, n_new, seed):
    cfg = data.draw(finite_state_configs(family=family), label="cfg")
    assert offset_family(cfg) == family
    model, variables = _model(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, 2, m, cfg.vocab_size)
    converted = iclca.convert(model, variables, prompt)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (2, n)), query], axis=1)
    np.testing.assert_array_equal(linicl.generate(model, converted, query, n_new),
                                  linicl.generate(model, variables, full, n_new))
    key = jax.random.PRNGKey(seed)
    np.testing.assert_array_equal(linicl.generate(model, converted, query, n_new, key=key),
                                  linicl.generate(model, variables, full, n_new, key=key))


# ---------------------------------------------------------------------------- (d) kernel forms
def _random_inputs(rng, B, H, T, d, F, dv):
    arrays = [rng.normal(size=(B, H, T, x)) for x in (d, d, F, F, F, F, dv)]
    arrays[2:6] = [np.abs(a) for a in arrays[2:6]]  # positive features: positive denominators
    return [jnp.asarray(a) for a in arrays]


_FORMS = {}


def _forms(window, sinks, decay):
    """Jitted parallel / chunked(3) / recurrent, one per static (window, sinks, decay?) triple."""
    key = (window, sinks, decay)
    if key not in _FORMS:
        def run(form, chunk):
            def f(x, pos, state, gate, log_gamma):
                q, k, fq, fk, fqd, fkd, v = x
                return hy.hybrid_attention(q, k, fq, fk, v, pos, state, gate=gate, window=window,
                                           sinks=sinks, fq_den=fqd, fk_den=fkd,
                                           log_gamma=log_gamma if decay else None, eps=1e-6,
                                           form=form, chunk_size=chunk)
            return jax.jit(f)
        _FORMS[key] = {"parallel": run("parallel", 64), "chunked": run("chunked", 3),
                       "recurrent": run("recurrent", 64)}
    return _FORMS[key]


@examples(1.0)
@given(window=st.sampled_from([0, 1, 3, 8]), sinks=st.sampled_from([0, 1, 4]), decay=st.booleans(),
       n0=st.sampled_from([0, 2, 9]), seed=st.integers(0, 2**16))
def test_kernel_forms_agree(window, sinks, decay, n0, seed):
    """From an empty state and from a state left by n0 earlier tokens (partly filled buffers), the
    three forms give the same outputs and the same final state; running in two calls equals one."""
    if window == 0 and sinks == 0:
        sinks = 1  # the kernel needs an exact part
    rng = np.random.default_rng(seed)
    B, H, T, d, F, dv = 2, 2, 7, 3, 4, 3
    forms = _forms(window, sinks, decay)
    gate, log_gamma = jnp.asarray(rng.normal(size=H)), jnp.log(jnp.asarray(rng.uniform(0.6, 1.0, H)))
    state = hy.empty_state(B, H, d, F, dv, window, sinks, jnp.float64)
    if n0:
        prefix = _random_inputs(rng, B, H, n0, d, F, dv)
        _, state = forms["parallel"](prefix, jnp.arange(n0, dtype=jnp.int32), state, gate, log_gamma)
    x = _random_inputs(rng, B, H, T, d, F, dv)
    pos = n0 + jnp.arange(T, dtype=jnp.int32)
    o_par, s_par = forms["parallel"](x, pos, state, gate, log_gamma)
    for form in ("chunked", "recurrent"):
        o, s = forms[form](x, pos, state, gate, log_gamma)
        assert rel_err(o, o_par) <= EXACT_RTOL
        assert_same_state(s, s_par)
    # Two calls (3 + 4 tokens) from the same state equal one call.
    o1, s1 = forms["parallel"]([a[:, :, :3] for a in x], pos[:3], state, gate, log_gamma)
    o2, _ = forms["parallel"]([a[:, :, 3:] for a in x], pos[3:], s1, gate, log_gamma)
    assert rel_err(jnp.concatenate([o1, o2], 2), o_par) <= EXACT_RTOL


# --------------------------------------------------------------------- (e) NumPy reference
def _np_features(cfg, attn, x, which):
    """phi of ``x: [B, H, T, d]`` in NumPy (hedgehog written out; the fixed maps are jnp functions)."""
    if cfg.feature_map != "hedgehog":
        return np.asarray(feature_maps.get(cfg.feature_map)(jnp.asarray(x)))
    W, b = np.asarray(attn[f"phi_{which}_W"]), np.asarray(attn[f"phi_{which}_b"])
    a = np.einsum("bhtd,hdm->bhtm", x, W) + b[None, :, None, :]

    def softmax(u):
        e = np.exp(u - u.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return np.concatenate([softmax(a), softmax(-a)], -1)


def _np_norm(cfg, p, x):
    """The q/k norm over the last axis (``cfg.norm_type``, its params ``p``)."""
    if cfg.norm_type == "layernorm":
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + cfg.ln_eps) * p["scale"] + p["bias"]
    w = p["scale"] if cfg.norm_type == "rmsnorm" else 1.0 + p["scale"]
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.ln_eps) * w


def _np_reference(cfg, attn, q, k, v):
    """The attention output ``[B, T, H, d]`` from the sites hook_q/k/v ``[B, T, heads, d]``, by direct
    sums over keys i <= t: exact window/sink keys g gamma^(t-i) e^{q.k/sqrt d - c_t}, older keys
    gamma^(t-i) phi(q).phi(k), a trainable initial state decayed by gamma^(t+1). Gemma's q/k norms
    and query scale sqrt(d / s) come first."""
    H, T = cfg.n_heads, q.shape[1]
    if cfg.qk_norm:
        q, k = (_np_norm(cfg, jax.tree.map(np.asarray, attn[f"{n}_norm"]), a) for n, a in (("q", q), ("k", k)))
    if cfg.query_pre_attn_scalar is not None:
        q = q * math.sqrt(q.shape[-1] / cfg.query_pre_attn_scalar)
    q, k, v = (np.moveaxis(np.repeat(a, H // a.shape[2], axis=2), 1, 2) for a in (q, k, v))  # [B, H, T, d]
    rot = lambda x: np.asarray(apply_rope(jnp.asarray(x), jnp.arange(T), cfg.rope_base, cfg.rope_style))  # noqa: E731
    rope = cfg.positions == "rope"
    if rope and cfg.rope_on == "inputs":
        q, k = rot(q), rot(k)
    fq, fk = _np_features(cfg, attn, q, "q"), _np_features(cfg, attn, k, "k")
    fqd, fkd = fq, fk
    if rope and cfg.rope_on == "features":
        fq, fk = rot(fq), rot(fk)
    qe, ke = (rot(q), rot(k)) if rope and cfg.rope_on == "features" else (q, k)
    gammas = cfg.decay_per_head() or (1.0,) * H
    gate = 1 / (1 + np.exp(-np.asarray(attn["gate"]))) if cfg.hybrid else np.zeros(H)
    out = np.zeros(v.shape)
    for b in range(q.shape[0]):
        for h in range(H):
            gam = gammas[h]
            for t in range(T):
                exact = [i for i in range(t + 1) if cfg.hybrid and (i < cfg.sinks or t - i < cfg.window)]
                logits = {i: qe[b, h, t] @ ke[b, h, i] / math.sqrt(cfg.head_dim) for i in exact}
                c = max(logits.values()) if exact else 0.0
                num, den = np.zeros(v.shape[-1]), 0.0
                for i in range(t + 1):
                    if i in logits:
                        w = gate[h] * gam ** (t - i) * math.exp(logits[i] - c)
                        num, den = num + w * v[b, h, i], den + w
                    else:
                        num = num + gam ** (t - i) * (fq[b, h, t] @ fk[b, h, i]) * v[b, h, i]
                        den = den + gam ** (t - i) * (fqd[b, h, t] @ fkd[b, h, i])
                if cfg.trainable_bias:
                    num = num + gam ** (t + 1) * fq[b, h, t] @ np.asarray(attn["S_bias"][h])
                    den = den + gam ** (t + 1) * fqd[b, h, t] @ np.asarray(attn["z_bias"][h])
                out[b, h, t] = num / (den + cfg.attn_eps) if cfg.normalize else num
    return np.moveaxis(out, 1, 2)


_CAPTURE = {}


@examples(0.6)
@given(cfg=finite_state_configs(), T=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_model_computes_the_hybrid_formula(cfg, T, seed):
    model, variables = _model(cfg, seed)
    names = tuple(block_site(l, h) for l in range(cfg.n_layers) for h in ("hook_q", "hook_k", "hook_v", "hook_z"))
    run = _CAPTURE.setdefault(model, jax.jit(lambda v, x: capture(model, v, x, names=list(names))[1]))
    acts = {n: np.asarray(a) for n, a in run(variables, tokens(seed, 2, T, cfg.vocab_size)).items()}
    for l in range(cfg.n_layers):
        attn = variables["params"][layer_scope(l)]["attn"]
        q, k, v, z = (acts[block_site(l, h)] for h in ("hook_q", "hook_k", "hook_v", "hook_z"))
        # a local layer is the window-only hybrid of its layer_config (checked independently of
        # layer_config in tests/nn/test_reference.py)
        assert rel_err(z, _np_reference(cfg.layer_config(l), attn, q, k, v)) <= EXACT_RTOL


def test_the_reference_has_power():
    """The reference separates the options it checks: a model with another window, gate or rope
    placement computes something else (so test_model_computes_the_hybrid_formula can fail)."""
    cfg = linicl.ModelConfig(n_layers=1, n_heads=2, d_model=8, window=3, sinks=1, positions="rope",
                             rope_on="inputs", feature_map="hedgehog", decay=0.9, dtype="float64")
    model, variables = _model(cfg, 0)
    names = [block_site(0, h) for h in ("hook_q", "hook_k", "hook_v", "hook_z")]
    acts = [np.asarray(a) for a in capture(model, variables, tokens(0, 1, 10, cfg.vocab_size), names=names)[1].values()]
    attn = variables["params"]["layers_0"]["attn"]
    assert rel_err(acts[3], _np_reference(cfg, attn, *acts[:3])) <= EXACT_RTOL
    for other in (cfg.replace(window=2), cfg.replace(sinks=0), cfg.replace(rope_on="features"),
                  cfg.replace(decay=0.8)):
        assert rel_err(acts[3], _np_reference(other, attn, *acts[:3])) >= BASELINE_MIN
    attn2 = {**attn, "gate": attn["gate"] + 1.0}
    assert rel_err(acts[3], _np_reference(cfg, attn2, *acts[:3])) >= BASELINE_MIN


# -------------------------------------------------------------------------- hedgehog and state
def test_hedgehog_init_is_the_identity_and_the_map_is_positive():
    cfg = linicl.ModelConfig(feature_map="hedgehog", dtype="float64")
    assert cfg.feature_dim == 2 * cfg.head_dim
    assert linicl.ModelConfig(feature_map="hedgehog", feature_size=5).feature_dim == 10
    _, variables = init(cfg)
    attn = variables["params"]["layers_0"]["attn"]
    np.testing.assert_array_equal(attn["phi_q_W"], np.broadcast_to(np.eye(cfg.head_dim), attn["phi_q_W"].shape))
    np.testing.assert_array_equal(attn["phi_k_b"], 0)
    np.testing.assert_array_equal(feature_maps.hedgehog_init_weight(2, 3, jnp.float64), [[1, 0, 1], [0, 1, 0]])
    np.testing.assert_array_equal(feature_maps.hedgehog_init_weight(3, 2, jnp.float64), [[1, 0], [0, 1], [1, 0]])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 5, 4)) * 5)
    phi = feature_maps.hedgehog(x, attn["phi_q_W"][:2, :4, :4], attn["phi_q_b"][:2, :4])
    assert phi.shape == (1, 2, 5, 8) and bool(jnp.all(phi > 0))
    assert rel_err(phi[..., :4].sum(-1), jnp.ones((1, 2, 5))) <= EXACT_RTOL
    with pytest.raises(ValueError, match="hedgehog"):
        feature_maps.get("hedgehog")


def test_state_is_bounded_and_methods_refuse_what_they_cannot_hold():
    cfg = linicl.ModelConfig(window=3, sinks=2, dtype="float64")
    model, variables = _model(cfg, 0)
    short, long = (iclca.convert(model, variables, tokens(1, 1, n, cfg.vocab_size)) for n in (4, 30))
    assert jax.tree.map(jnp.shape, short[PROMPT_STATE]) == jax.tree.map(jnp.shape, long[PROMPT_STATE])
    attn = long[PROMPT_STATE]["layers_0"]["attn"]
    np.testing.assert_array_equal(attn["win_pos"], [28, 29])
    np.testing.assert_array_equal(attn["sink_pos"], [0, 1])
    np.testing.assert_array_equal(iclca.convert(model, variables, tokens(1, 1, 1, 64))[PROMPT_STATE]
                                  ["layers_0"]["attn"]["sink_pos"], [0, -1])
    floats = sum(a.size for a in jax.tree.leaves(long[PROMPT_STATE]) if jnp.issubdtype(a.dtype, jnp.floating))
    assert iclca.state_floats(cfg) == floats
    with pytest.raises(LiniclError, match="window"):
        iclca.to_trainable(model, long)
    with pytest.raises(LiniclError, match="buffers"):
        iclca.bias_terms(long)


@pytest.mark.parametrize("changes, field", [
    (dict(attention="softmax", window=4), "window"),
    (dict(attention="softmax", sinks=2), "sinks"),
    (dict(attention="softmax", feature_map="hedgehog"), "feature_map"),
    (dict(window=-1), "window"),
    (dict(sinks=1.5), "sinks"),
    (dict(window=4, feature_map="identity", normalize=False), "window"),
    (dict(sinks=2, normalize=False), "sinks"),
    (dict(feature_size=4), "feature_size"),
    (dict(feature_map="hedgehog", feature_size=-2), "feature_size"),
    (dict(rope_on="inputs"), "rope_on"),
    (dict(rope_on="outputs", positions="rope"), "rope_on"),
    (dict(attention="softmax", positions="rope", rope_on="inputs"), "rope_on"),
])
def test_nonsense_combinations_raise_config_errors_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        linicl.ModelConfig(**changes)
