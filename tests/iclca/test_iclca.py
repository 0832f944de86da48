"""The ICLCA contract: a converted model with no prompt equals the prompted model, exactly."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl import iclca
from linicl.nn.transformer import position_offset
from helpers import (BASELINE_MIN, EXACT_RTOL, OFFSET_FAMILIES, apply, init, linear_configs, offset_family,
                     per_stratum, prompt_and_query, rel_err, tokens)


def _trace(*example):
    """With LINICL_TRACE_EXAMPLES=path, append each example before running it (to find an example
    that crashes the process, which hypothesis cannot report)."""
    path = os.environ.get("LINICL_TRACE_EXAMPLES")
    if path:
        with open(path, "a") as f:
            f.write(repr(example) + "\n")


def prompted(model, variables, prompt, query):
    """Logits of the query positions when the model reads [prompt; query]."""
    n = prompt.shape[1]
    prompt = jnp.broadcast_to(prompt, (query.shape[0], n))
    return apply(model, variables, jnp.concatenate([prompt, query], axis=1))[:, n:]


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(1.0, len(OFFSET_FAMILIES))
@given(data=st.data(), n=st.integers(1, 40), m=st.integers(1, 12), batch=st.integers(1, 3),
       shared_prompt=st.booleans(), seed=st.integers(0, 2**16))
def test_converted_equals_prompted(family, data, n, m, batch, shared_prompt, seed):
    cfg = data.draw(linear_configs(family=family), label="cfg")
    assert offset_family(cfg) == family
    _trace(cfg, n, m, batch, shared_prompt, seed)
    model, variables = init(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1 if shared_prompt else batch, n, batch, m, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)

    converted = iclca.convert(model, variables, prompt)
    assert rel_err(apply(model, converted, query), reference) <= EXACT_RTOL
    # Power: without the converted state the same query is far from the prompted model.
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(0.6, len(OFFSET_FAMILIES))
@given(data=st.data(), n1=st.integers(1, 20), n2=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_converting_twice_equals_converting_the_concatenation(family, data, n1, n2, seed):
    cfg = data.draw(linear_configs(max_layers=2, family=family), label="cfg")
    assert offset_family(cfg) == family
    model, variables = init(cfg, seed)
    p1, query = prompt_and_query(seed + 1, 1, n1, 2, 5, cfg.vocab_size)
    p2 = tokens(seed + 3, 1, n2, cfg.vocab_size)
    twice = iclca.convert(model, iclca.convert(model, variables, p1), p2)
    once = iclca.convert(model, variables, jnp.concatenate([p1, p2], axis=1))
    for (S2, z2), (S1, z1) in zip(iclca.bias_terms(twice), iclca.bias_terms(once)):
        assert rel_err(S2, S1) <= EXACT_RTOL and rel_err(z2, z1) <= EXACT_RTOL
    assert rel_err(apply(model, twice, query), prompted(model, variables, jnp.concatenate([p1, p2], 1), query)) <= EXACT_RTOL
    # Power: the second prompt alone is not the same model.
    only_p2 = iclca.convert(model, variables, p2)
    assert rel_err(apply(model, only_p2, query), apply(model, once, query)) >= BASELINE_MIN


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(0.4, len(OFFSET_FAMILIES))
@given(data=st.data(), n=st.integers(1, 20), m=st.integers(1, 6),
       n_new=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_generation_from_converted_equals_generation_from_prompted(family, data, n, m, n_new, seed):
    cfg = data.draw(linear_configs(max_layers=2, family=family), label="cfg")
    assert offset_family(cfg) == family
    model, variables = init(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, 3, m, cfg.vocab_size)
    converted = iclca.convert(model, variables, prompt)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (3, n)), query], axis=1)
    greedy = linicl.generate(model, converted, query, n_new)
    np.testing.assert_array_equal(greedy, linicl.generate(model, variables, full, n_new))
    key = jax.random.PRNGKey(seed)
    sampled = linicl.generate(model, converted, query, n_new, key=key, temperature=0.7)
    np.testing.assert_array_equal(sampled, linicl.generate(model, variables, full, n_new, key=key, temperature=0.7))
    assert sampled.shape == (3, n_new) and sampled.dtype == jnp.int32


def test_gradients_through_the_converted_model_equal_the_prompted_gradients():
    """d loss / d params is the same whether the prompt is read or stored (the state is recomputed
    from the params inside the differentiated function)."""
    cfg = linicl.preset("tiny-linear-rope-decay", dtype="float64", n_layers=2)
    model, variables = init(cfg)
    prompt, query = tokens(1, 1, 9, cfg.vocab_size), tokens(2, 2, 4, cfg.vocab_size)

    def loss_converted(params):
        v = iclca.convert(model, {"params": params}, prompt)
        return jnp.sum(jax.nn.log_softmax(model.apply(v, query))[..., 0])

    def loss_prompted(params):
        return jnp.sum(jax.nn.log_softmax(prompted(model, {"params": params}, prompt, query))[..., 0])

    g_conv = jax.jit(jax.grad(loss_converted))(variables["params"])
    g_prompt = jax.jit(jax.grad(loss_prompted))(variables["params"])
    flat_c, flat_p = jax.tree.leaves(g_conv), jax.tree.leaves(g_prompt)
    assert rel_err(np.concatenate([x.ravel() for x in flat_c]), np.concatenate([x.ravel() for x in flat_p])) <= EXACT_RTOL


def test_convert_jits_and_vmaps_without_retracing():
    cfg = linicl.preset("tiny-linear", dtype="float64")
    model, variables = init(cfg)
    fn = iclca._absorb_fn(model)
    for seed in range(3):  # same shapes, different prompts: one trace
        iclca.convert(model, variables, tokens(seed, 1, 11, cfg.vocab_size))
    assert fn._cache_size() == 1
    # vmap over a stack of prompts: one converted state per prompt.
    prompts = jnp.stack([tokens(s, 1, 6, cfg.vocab_size) for s in range(4)])
    states = jax.vmap(lambda p: iclca.convert(model, variables, p)["prompt_state"])(prompts)
    S0 = iclca.convert(model, variables, prompts[2])["prompt_state"]["layers_1"]["attn"]["S"]
    assert rel_err(states["layers_1"]["attn"]["S"][2], S0) <= EXACT_RTOL


def test_trainable_bias_is_zero_initialised_and_receives_gradients():
    cfg = linicl.preset("tiny-linear", dtype="float64", trainable_bias=True)
    model = linicl.Transformer(cfg)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    attn = variables["params"]["layers_0"]["attn"]
    assert attn["S_bias"].shape == (cfg.n_heads, cfg.feature_dim, cfg.head_dim)
    assert not np.any(attn["S_bias"]) and not np.any(attn["z_bias"])
    # With a zero bias the model is the plain model.
    plain = linicl.Transformer(cfg.replace(trainable_bias=False))
    plain_params = jax.tree_util.tree_map_with_path(lambda p, x: x, variables["params"])
    for layer in range(cfg.n_layers):
        plain_params[f"layers_{layer}"]["attn"] = {k: v for k, v in plain_params[f"layers_{layer}"]["attn"].items()
                                                   if not k.endswith("_bias")}
    q = tokens(3, 2, 7, cfg.vocab_size)
    np.testing.assert_array_equal(apply(model, variables, q), apply(plain, {"params": plain_params}, q))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, q)[..., 1])))(variables["params"])
    assert np.any(grads["layers_0"]["attn"]["S_bias"]) and np.any(grads["layers_1"]["attn"]["z_bias"])


def test_nonnegative_z_bias_clips_only_z_bias():
    cfg = linicl.preset("tiny-linear", dtype="float64", trainable_bias=True)
    model = linicl.Transformer(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"]
    noisy = jax.tree.map(lambda a: a + jax.random.normal(jax.random.PRNGKey(1), a.shape, a.dtype), params)
    clipped = jax.jit(linicl.iclca.nonnegative_z_bias)(noisy)
    flat, flat_noisy = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (clipped, noisy))
    n_z = 0
    for path, leaf in flat.items():
        if path[-1].key == "z_bias":
            n_z += 1
            assert np.min(flat_noisy[path]) < 0  # power: there was something to clip
            np.testing.assert_array_equal(leaf, np.maximum(flat_noisy[path], 0))
        else:
            np.testing.assert_array_equal(leaf, flat_noisy[path])
    assert n_z == cfg.n_layers


def test_float32_conversion_is_exact_to_float32_rounding():
    """float32: eps = 1.2e-7. Prompted and converted models add the same ~n terms per state in a
    different order, so we expect errors of a few hundred eps at most; 1e-4 leaves a margin while the
    no-prompt baseline stays ~10^4 times larger."""
    cfg = linicl.preset("tiny-linear-rope-decay", dtype="float32")
    model, variables = init(cfg)
    prompt, query = prompt_and_query(1, 1, 200, 4, 16, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)
    converted = iclca.convert(model, variables, prompt)
    assert converted["prompt_state"]["layers_0"]["attn"]["S"].dtype == jnp.float32
    assert apply(model, converted, query).dtype == jnp.float32
    assert rel_err(apply(model, converted, query), reference) <= 1e-4
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN


def test_learned_positions_keep_the_offset():
    cfg = linicl.preset("tiny-linear-learned", dtype="float64")
    model, variables = init(cfg)
    converted = iclca.convert(model, variables, tokens(1, 1, 13, cfg.vocab_size))
    assert position_offset(converted) == 13
    assert position_offset(iclca.convert(model, converted, tokens(2, 1, 4, cfg.vocab_size))) == 17
    rope = linicl.preset("tiny-linear-rope-decay", dtype="float64")
    m2, v2 = init(rope)
    assert position_offset(iclca.convert(m2, v2, tokens(1, 1, 13, rope.vocab_size))) == 0  # re-based


def test_state_size_is_independent_of_prompt_length():
    cfg = linicl.preset("tiny-linear", dtype="float64", feature_map="taylor2")
    model, variables = init(cfg)
    sizes = {sum(x.size for x in jax.tree.leaves(iclca.convert(model, variables, tokens(0, 1, n, cfg.vocab_size))["prompt_state"]))
             for n in (1, 50)}
    assert sizes == {iclca.state_floats(cfg)}  # the offset lives in the "position" collection


@pytest.mark.parametrize("name", ["tiny-linear-rope-decay", "tiny-linear-learned"])
def test_to_trainable_moves_the_state_into_params_exactly(name):
    cfg = linicl.preset(name, dtype="float64")
    model, variables = init(cfg)
    prompt, query = prompt_and_query(4, 1, 21, 2, 6, cfg.vocab_size)
    converted = iclca.convert(model, variables, prompt)
    trainable, tvars = iclca.to_trainable(model, converted)
    assert trainable.cfg.trainable_bias and "S_bias" in tvars["params"]["layers_0"]["attn"]
    assert rel_err(apply(trainable, tvars, query), apply(model, converted, query)) <= EXACT_RTOL
    grads = jax.jit(jax.grad(lambda p: jnp.sum(trainable.apply({**tvars, "params": p}, query))))(tvars["params"])
    assert np.any(grads["layers_0"]["attn"]["S_bias"])
    with pytest.raises(linicl.LiniclError, match="batch-1 prompt"):
        iclca.to_trainable(model, iclca.convert(model, variables, tokens(0, 2, 3, cfg.vocab_size)))


def test_convert_refuses_nan_parameters_and_names_them():
    cfg = linicl.preset("tiny-linear-rope-decay", dtype="float64")
    model, variables = init(cfg)
    params = jax.tree_util.tree_map(lambda x: x, variables["params"])
    params["layers_0"]["attn"]["q"]["kernel"] = params["layers_0"]["attn"]["q"]["kernel"].at[0, 0].set(jnp.nan)
    prompt = tokens(0, 1, 5, cfg.vocab_size)
    with pytest.raises(linicl.LiniclError, match=r"not finite at \['layers_1'\].*params'\] hold NaN or inf at \['layers_0'\]\['attn'\]\['q'\]\['kernel'\]"):
        iclca.convert(model, {**variables, "params": params}, prompt)
    assert np.all(np.isfinite(jax.tree_util.tree_leaves(iclca.convert(model, variables, prompt))[0]))


@pytest.mark.parametrize("preset", ["tiny-linear-rope-decay", "tiny-softmax"])
def test_conversion_refuses_a_leftover_decode_cache(preset):
    """Variables carrying a decode collection (what model.apply(..., mutable=["decode"]) returns) would
    make the conversion continue from the decoded tokens: the stored state then silently holds them
    too (issue 52: converted logits 0.17 away from a clean conversion). Refused, naming the fix."""
    cfg = linicl.preset(preset, dtype="float64")
    model, variables = init(cfg)
    _, decode = model.apply(variables, tokens(1, 1, 6, cfg.vocab_size), mutable=["decode"])
    prompt = tokens(0, 1, 5, cfg.vocab_size)
    convert = iclca.convert if cfg.attention == "linear" else iclca.convert_approx
    with pytest.raises(linicl.LiniclError, match="'decode' collection .* k != 'decode'"):
        convert(model, {**variables, **decode}, prompt)
    # The fix the message names gives the clean conversion.
    clean = {k: v for k, v in {**variables, **decode}.items() if k != "decode"}
    query = tokens(2, 1, 3, cfg.vocab_size)
    assert rel_err(apply(model, convert(model, clean, prompt), query),
                   apply(model, convert(model, variables, prompt), query)) == 0


def test_convert_reports_a_misbehaving_compiled_program(monkeypatch):
    """A NaN state from finite parameters (the XLA CPU bug in the README's known issues) is refused with
    the workaround, not returned to poison every later query."""
    cfg = linicl.preset("tiny-linear-rope-decay", dtype="float64")
    model, variables = init(cfg)
    absorb = iclca._absorb_fn(model)

    def broken(model_):
        def run(v, p, e=None):
            state = absorb(v, p, e)
            return {**state, "prompt_state": jax.tree_util.tree_map(lambda x: x * jnp.nan, state["prompt_state"])}
        return run
    monkeypatch.setattr(iclca, "_absorb_fn", broken)
    with pytest.raises(linicl.LiniclError, match="XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type"):
        iclca.convert(model, variables, tokens(0, 1, 5, cfg.vocab_size))


def _embeds(seed: int, batch: int, n: int, d_model: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, n, d_model), jnp.float64)


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(0.5, len(OFFSET_FAMILIES))
@given(data=st.data(), n=st.integers(1, 30), m=st.integers(1, 8), batch=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_continuous_prompt_converts_exactly(family, data, n, m, batch, seed):
    """A prompt of continuous tokens (``embeds``: in-context regression) converts like a token prompt;
    the converted model answers an embeds query and a token query as the prompted model does."""
    cfg = data.draw(linear_configs(max_layers=2, family=family), label="cfg")
    assert offset_family(cfg) == family
    model, variables = init(cfg, seed)
    prompt, query = _embeds(seed, 1, n, cfg.d_model), _embeds(seed + 1, batch, m, cfg.d_model)
    fwd = jax.jit(lambda v, e: model.apply(v, embeds=e))
    reference = fwd(variables, jnp.concatenate([jnp.repeat(prompt, batch, 0), query], 1))[:, n:]
    converted = iclca.convert(model, variables, embeds=prompt)
    assert rel_err(fwd(converted, query), reference) <= EXACT_RTOL
    assert rel_err(fwd(variables, query), reference) >= BASELINE_MIN
    ids = tokens(seed + 2, batch, m, cfg.vocab_size)
    embed = variables["params"]["embed"] * (cfg.d_model ** 0.5 if cfg.scale_embeddings else 1.0)  # block 0's input
    mixed = fwd(variables, jnp.concatenate([jnp.repeat(prompt, batch, 0), embed[ids]], 1))[:, n:]
    assert rel_err(apply(model, converted, ids), mixed) <= EXACT_RTOL


@pytest.mark.parametrize("options", [dict(gate="scalar", feature_map="elu+1"),
                                     dict(update="delta", gate="scalar", feature_map="identity", normalize=False)])
def test_continuous_prompt_converts_exactly_with_gates_and_the_delta_rule(options):
    cfg = linicl.ModelConfig(vocab_size=16, d_model=12, n_layers=2, n_heads=3, d_ff=8, attention="linear",
                             positions="rope", dtype="float64", **options)
    model, variables = init(cfg, 3)
    prompt, query = _embeds(0, 1, 9, 12), _embeds(1, 2, 4, 12)
    fwd = jax.jit(lambda v, e: model.apply(v, embeds=e))
    reference = fwd(variables, jnp.concatenate([jnp.repeat(prompt, 2, 0), query], 1))[:, 9:]
    assert rel_err(fwd(iclca.convert(model, variables, embeds=prompt), query), reference) <= EXACT_RTOL
    assert rel_err(fwd(variables, query), reference) >= BASELINE_MIN


def test_convert_prompt_arguments_are_checked():
    cfg = linicl.preset("tiny-linear-rope-decay", dtype="float64")
    model, variables = init(cfg)
    d = cfg.d_model
    with pytest.raises(linicl.LiniclError, match="exactly one of prompt"):
        iclca.convert(model, variables)
    with pytest.raises(linicl.LiniclError, match="exactly one of prompt"):
        iclca.convert(model, variables, tokens(0, 1, 3, cfg.vocab_size), embeds=_embeds(0, 1, 3, d))
    with pytest.raises(linicl.LiniclError, match=rf"embeds must be float\[batch, n, {d}\], got float64\(1, 3, {d + 1}\)"):
        iclca.convert(model, variables, embeds=_embeds(0, 1, 3, d + 1))
    with pytest.raises(linicl.LiniclError, match=r"embeds must be float.*int32"):
        iclca.convert(model, variables, embeds=jnp.zeros((1, 3, d), jnp.int32))
    with pytest.raises(linicl.LiniclError, match="at least one row and one token"):
        iclca.convert(model, variables, embeds=_embeds(0, 1, 0, d))
    with pytest.raises(linicl.LiniclError, match="embeds hold NaN or inf"):
        iclca.convert(model, variables, embeds=_embeds(0, 1, 3, d).at[0, 1, 0].set(jnp.inf))
