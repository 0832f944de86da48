"""The sparse cache (``ModelConfig.cache``, LoLA) in the model: a prompt still converts exactly (the
query alone equals the prompted model, converting twice equals converting the concatenation, decoding
continues it), a cache of 0 is the hybrid unchanged, the stored state is bounded and counted, and
options the cache cannot serve are refused naming it. float64; exact identities <= EXACT_RTOL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl import iclca, linearize as LZ, memory
from linicl.errors import ConfigError, LiniclError
from linicl.kernels import HybridState, SparseState
from linicl.names import PROMPT_STATE
from helpers import (BASELINE_MIN, EXACT_RTOL, OFFSET_FAMILIES, apply, check_converting_twice, examples, init,
                     per_stratum, perturb_learned_maps, position_family, prompt_and_query, prompted, rel_err,
                     tokens)


@st.composite
def cache_configs(draw, family: str = None, **fixed) -> linicl.ModelConfig:
    """Float64 hybrid configs with a cache: hedgehog maps (m = d_head or not), window in {1, 3}, sinks
    in {0, 1, 4}, cache in {1, 2, 5} chosen by either rule, positions none / learned / rope (on the features or the
    inputs; ``family``: one of ``helpers.OFFSET_FAMILIES``, else drawn), decay (one or per head) or
    none, grouped-query heads, trainable biases."""
    n_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4])) if n_heads == 2 else 4  # d_model >= 4: see helpers
    if family is not None:
        fixed = {**OFFSET_FAMILIES[family], **fixed}
    positions = fixed.get("positions") or draw(st.sampled_from(["none", "learned", "rope"]))
    values = dict(
        vocab_size=draw(st.integers(6, 40)), d_model=n_heads * head_dim, n_layers=draw(st.integers(1, 2)),
        n_heads=n_heads, n_kv_heads=draw(st.sampled_from([h for h in (1, 2) if n_heads % h == 0])), d_ff=8,
        max_len=128, attention="linear", feature_map="hedgehog", feature_size=draw(st.sampled_from([0, 3])),
        normalize=True, positions=positions,
        rope_on=draw(st.sampled_from(["features", "inputs"])) if positions == "rope" else "features",
        decay=draw(st.one_of(st.none(), st.floats(0.5, 1.0),
                             st.lists(st.floats(0.5, 1.0), min_size=n_heads, max_size=n_heads))),
        window=draw(st.sampled_from([1, 3])), sinks=draw(st.sampled_from([0, 1, 4])),
        cache=draw(st.sampled_from([1, 2, 5])), cache_rule=draw(st.sampled_from(["recall", "attention"])),
        form=draw(st.sampled_from(["auto", "recurrent"])),
        norm_type=draw(st.sampled_from(["layernorm", "rmsnorm"])), trainable_bias=draw(st.booleans()),
        dtype="float64")
    values.update(fixed)
    return linicl.ModelConfig(**values)


def _model(cfg, seed):
    model, variables = init(cfg, seed)
    return model, perturb_learned_maps(variables, seed + 5)


def _cached(cfg, n: int) -> int:
    """Tokens in the cache after n tokens: every non-sink token that left the window, up to cache."""
    return min(cfg.cache, max(0, n - (cfg.window - 1) - cfg.sinks))


# ---------------------------------------------------------------------------- (1) conversion
@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(0.6, len(OFFSET_FAMILIES))
@given(data=st.data(), n=st.integers(1, 14), m=st.integers(1, 5), rows=st.sampled_from([(1, 1), (1, 2), (2, 2)]),
       seed=st.integers(0, 2**16))
def test_converted_equals_prompted(family, data, n, m, rows, seed):
    """The query alone, from the converted state (a batch-1 prompt serves any batch; a batch-2 prompt
    has a cache per row), equals the prompted model at the query."""
    cfg = data.draw(cache_configs(family=family), label="cfg")
    assert position_family(cfg) == family  # every config here has a window or sinks
    model, variables = _model(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, rows[0], n, rows[1], m, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)
    converted = iclca.convert(model, variables, prompt)
    assert rel_err(apply(model, converted, query), reference) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN
    assert int(converted["position"]["offset"]) == n
    cache_pos = converted[PROMPT_STATE]["layers_0"]["attn"]["cache_pos"]
    assert cache_pos.shape == (rows[0], cfg.kv_heads, cfg.cache)  # a cache per key/value head
    np.testing.assert_array_equal((cache_pos >= 0).sum(-1), _cached(cfg, n))


# ------------------------------------------------------------------- (2) repeated conversion
@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(0.4, len(OFFSET_FAMILIES))
@given(data=st.data(), n1=st.integers(1, 9), n2=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_converting_twice_equals_converting_the_concatenation(family, data, n1, n2, seed):
    cfg = data.draw(cache_configs(family=family), label="cfg")
    assert position_family(cfg) == family  # every config here has a window or sinks
    model, variables = _model(cfg, seed)
    check_converting_twice(model, variables, n1, n2, seed, query_len=3)


# ----------------------------------------------------------------------------- (3) generation
@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@per_stratum(0.3, len(OFFSET_FAMILIES))
@given(data=st.data(), n=st.integers(1, 10), m=st.integers(1, 4), n_new=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_generation_after_conversion_equals_generation_after_the_prompt(family, data, n, m, n_new, seed):
    cfg = data.draw(cache_configs(family=family), label="cfg")
    assert position_family(cfg) == family  # every config here has a window or sinks
    model, variables = _model(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, 2, m, cfg.vocab_size)
    converted = iclca.convert(model, variables, prompt)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (2, n)), query], axis=1)
    np.testing.assert_array_equal(linicl.generate(model, converted, query, n_new),
                                  linicl.generate(model, variables, full, n_new))
    key = jax.random.PRNGKey(seed)
    np.testing.assert_array_equal(linicl.generate(model, converted, query, n_new, key=key),
                                  linicl.generate(model, variables, full, n_new, key=key))


# ------------------------------------------------------------------------ (4) cache 0 unchanged
@examples(0.3)
@given(cfg=cache_configs(), T=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_no_cache_is_the_hybrid_unchanged(cfg, T, seed):
    """cache=0 is the config without the field (equal, same hash, same description) and stores a
    HybridState; a cache changes the outputs once a non-sink token has left the window."""
    fields = {f: getattr(cfg, f) for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                                           "max_len", "attention", "feature_map", "feature_size", "positions",
                                           "rope_on", "decay", "window", "sinks", "norm_type",
                                           "trainable_bias", "dtype")}
    plain = linicl.ModelConfig(**fields)
    no_cache = cfg.replace(cache=0, cache_rule="recall", form="auto")
    assert no_cache == plain and hash(no_cache) == hash(plain)
    assert "cache" not in plain.describe() and f"cache={cfg.cache}" in cfg.describe()
    model, variables = _model(cfg, seed)
    hybrid = linicl.Transformer(plain)  # the same parameters: the cache has none
    x = tokens(seed + 1, 1, T, cfg.vocab_size)
    stored = iclca.convert(hybrid, variables, x)[PROMPT_STATE]["layers_0"]["attn"]
    assert set(stored) == set(HybridState._fields)
    assert set(iclca.convert(model, variables, x)[PROMPT_STATE]["layers_0"]["attn"]) == set(SparseState._fields)
    if _cached(cfg, T - 1):  # a token was cached before the last query read it
        assert rel_err(apply(model, variables, x), apply(hybrid, variables, x)) >= BASELINE_MIN
    else:  # nothing cached yet: the same formula
        assert rel_err(apply(model, variables, x), apply(hybrid, variables, x)) <= EXACT_RTOL


@pytest.mark.parametrize("rule", ["recall", "attention"])
def test_state_is_bounded_and_counted(rule):
    cfg = linicl.ModelConfig(window=3, sinks=2, cache=4, cache_rule=rule, feature_map="hedgehog", dtype="float64")
    model, variables = _model(cfg, 0)
    short, long = (iclca.convert(model, variables, tokens(1, 1, n, cfg.vocab_size)) for n in (4, 30))
    assert jax.tree.map(jnp.shape, short[PROMPT_STATE]) == jax.tree.map(jnp.shape, long[PROMPT_STATE])
    attn = long[PROMPT_STATE]["layers_0"]["attn"]
    np.testing.assert_array_equal(attn["win_pos"], [28, 29])
    pos = np.asarray(attn["cache_pos"])
    assert pos.shape == (1, cfg.kv_heads, 4) and ((pos >= 2) & (pos < 28)).all()
    floats = sum(a.size for a in jax.tree.leaves(long[PROMPT_STATE]) if jnp.issubdtype(a.dtype, jnp.floating))
    assert iclca.state_floats(cfg) == floats == memory.prompt_floats({PROMPT_STATE: long[PROMPT_STATE]})
    assert iclca.state_floats(cfg) > iclca.state_floats(cfg.replace(cache=0, cache_rule="recall"))
    scores = (2 + 4) * cfg.n_layers * cfg.kv_heads  # a score per window (W - 1 = 2) and cache slot
    other = cfg.replace(cache_rule="recall" if rule == "attention" else "attention")
    assert abs(iclca.state_floats(cfg) - iclca.state_floats(other)) == scores


def test_a_state_stored_with_another_cache_size_is_refused():
    cfg = linicl.ModelConfig(window=2, sinks=1, cache=2, feature_map="hedgehog", dtype="float64")
    model, variables = _model(cfg, 0)
    x = tokens(1, 1, 6, cfg.vocab_size)
    for other in (cfg.replace(cache=0), cfg.replace(cache=3), cfg.replace(cache_rule="attention")):
        converted = iclca.convert(linicl.Transformer(other), variables, x)
        with pytest.raises(LiniclError, match="cache"):
            apply(model, converted, x)


def test_student_config_passes_the_cache_and_the_maps_do_not_change():
    teacher = linicl.ModelConfig(attention="softmax", positions="rope", n_layers=1, dtype="float64")
    student = LZ.student_config(teacher, window=4, sinks=1, cache=3)
    assert student.cache == 3 and student.replace(cache=0) == LZ.student_config(teacher, window=4, sinks=1)
    shapes = lambda cfg: jax.eval_shape(  # noqa: E731
        linicl.Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    assert shapes(student) == shapes(student.replace(cache=0))


# --------------------------------------------------------------------------- (5) bad configs
@pytest.mark.parametrize("changes", [
    dict(cache=2),                                                          # no window or sinks
    dict(cache=2, attention="softmax"),
    dict(cache=2, window=3, feature_map="identity", normalize=False),
    dict(cache=2, window=3, form="parallel"),
    dict(cache=2, sinks=1, form="chunked"),
    dict(cache=-1, window=3),
    dict(cache=1.5, window=3),
    dict(cache=True, window=3),
    dict(cache_rule="oldest", cache=2, window=3),
    dict(cache_rule="attention", window=3),                                 # a rule without a cache
    dict(cache_rule="attention", cache=2, sinks=1),                         # attention needs a window
])
def test_bad_cache_options_raise_config_errors_naming_it(changes):
    with pytest.raises(ConfigError, match="ModelConfig.cache"):
        linicl.ModelConfig(**changes)


def test_window_config_can_keep_a_cache():
    """The window baseline with a cache (no linear part): the attention rule by default, the config
    otherwise the plain window's."""
    teacher = linicl.ModelConfig(attention="softmax", positions="rope", n_layers=1, dtype="float64")
    plain = LZ.window_config(teacher, window=4, sinks=1)
    cached = LZ.window_config(teacher, window=4, sinks=1, cache=3)
    assert (cached.cache, cached.cache_rule) == (3, "attention") and plain.cache == 0
    assert cached.replace(cache=0, cache_rule="recall", form="auto") == plain
