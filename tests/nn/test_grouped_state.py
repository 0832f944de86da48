"""Grouped-query models store the hybrid's exact keys and values once per key/value head (issue 53,
item 3): the window's, the sinks' and the sparse cache's keys and values (and the cache's positions and
scores) of a converted prompt and of a decode have kv_heads heads; the conversion stays exact; and
``iclca.state_floats``, ``memory.prompt_floats`` and ``iclca.stored_floats`` count the arrays stored."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca, memory
from linicl.interventions import capture
from linicl.names import DECODE, PROMPT_STATE, block_site, layer_scope
from helpers import BASELINE_MIN, EXACT_RTOL, apply, init, perturb_learned_maps, prompt_and_query, prompted, rel_err

KV_FIELDS = ("win_k", "win_v", "sink_k", "sink_v", "cache_k", "cache_v", "cache_pos", "win_score", "cache_score")
HEAD_FIELDS = ("S", "z", "win_fk", "win_fkd", "cache_fk", "cache_fkd")  # per query head


def _linear(**changes):
    """tiny-llama (4 query heads, 2 key/value heads) as a linear hybrid with hedgehog maps."""
    return linicl.preset("tiny-llama", dtype="float64", attention="linear", feature_map="hedgehog",
                         **{"rope_on": "inputs", **changes})


CONFIGS = {
    "window-sinks": _linear(window=3, sinks=2),
    "one-kv-head/rope-features": _linear(n_kv_heads=1, rope_on="features", window=2, sinks=1),
    "sinks-only": _linear(sinks=2),
    "cache-recall": _linear(window=3, sinks=1, cache=2),
    "cache-attention": _linear(window=2, sinks=1, cache=2, cache_rule="attention"),
    "local-layers": _linear(layer_types=("local", "global"), sliding_window=3),
}


def _model(cfg, seed=0):
    model, variables = init(cfg, seed)
    return model, perturb_learned_maps(variables, seed + 5)


def _check_heads(cfg, state: dict) -> int:
    """Every layer's stored fields: keys, values and cache positions and scores at kv_heads, the rest at
    the query heads. Returns how many key/value fields were seen."""
    seen = 0
    for l in range(cfg.n_layers):
        layer = state[layer_scope(l)]["attn"]
        for name, a in layer.items():
            if name in KV_FIELDS:
                assert a.shape[1] == cfg.kv_heads, (l, name, a.shape)
                seen += 1
            elif name in HEAD_FIELDS:
                assert a.shape[1] == cfg.n_heads, (l, name, a.shape)
    return seen


def _stored_floats(state: dict) -> int:
    return sum(int(a.size) for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_prompt_is_exact_and_stores_kv_heads(name):
    """The converted model on a query equals the prompted one (power: the query alone is far off); the
    stored keys and values have kv_heads heads; state_floats and prompt_floats are the floats stored."""
    cfg = CONFIGS[name]
    assert cfg.kv_heads < cfg.n_heads
    model, variables = _model(cfg)
    prompt, query = prompt_and_query(11, 1, 9, 2, 5, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)
    converted = iclca.convert(model, variables, prompt)
    assert rel_err(apply(model, converted, query), reference) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN
    assert _check_heads(cfg, converted[PROMPT_STATE]) >= 2
    floats = _stored_floats(converted[PROMPT_STATE])
    assert iclca.state_floats(cfg) == floats == memory.prompt_floats(converted)


@pytest.mark.parametrize("name", ["window-sinks", "cache-attention", "local-layers"])
def test_state_floats_drop_the_repeated_copies(name):
    """Per hybrid layer the grouped state holds (H - G) fewer copies of each buffered, cached and sink
    token's key and value (and, rule "attention", its score) than the same model with H key/value heads."""
    cfg = CONFIGS[name]
    H, G, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    saved = 0
    for l in range(cfg.n_layers):
        c = cfg.layer_config(l)
        if c.hybrid:
            tokens = max(c.window - 1, 0) + c.cache
            saved += (H - G) * ((tokens + c.sinks) * 2 * d + (tokens if c.cache_rule == "attention" and c.cache else 0))
    assert saved > 0
    assert iclca.state_floats(cfg.replace(n_kv_heads=None)) - iclca.state_floats(cfg) == saved


@pytest.mark.parametrize("name", ["window-sinks", "cache-recall", "local-layers"])
def test_decoding_from_the_converted_prompt_keeps_kv_heads(name):
    """One token at a time from the converted prompt: the prompted logits, with the decode state's
    keys and values at kv_heads."""
    cfg = CONFIGS[name]
    model, variables = _model(cfg, 1)
    prompt, query = prompt_and_query(12, 1, 7, 2, 4, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)
    converted = iclca.convert(model, variables, prompt)
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=[DECODE]))
    out, state = [], {}
    for t in range(query.shape[1]):
        logits, state = step({**converted, **state}, query[:, t:t + 1])
        out.append(logits)
    assert rel_err(jnp.concatenate(out, 1), reference) <= EXACT_RTOL
    assert _check_heads(cfg, state[DECODE]) >= 2
    assert _stored_floats(state[DECODE]) == 2 * iclca.state_floats(cfg)  # batch 2, as the query


def test_approximate_conversion_counts_the_local_windows_as_stored():
    """A softmax model with local layers (Gemma-like, grouped heads): convert_approx stores each local
    layer's exact window with its keys and values at kv_heads; stored_floats' "local" is their size,
    W' keys and values per key/value head plus the window-only hybrid's feature slots and empty state."""
    cfg = linicl.preset("tiny-llama", dtype="float64", layer_types=("local", "global"), sliding_window=4)
    model, variables = init(cfg)
    prompt = prompt_and_query(13, 1, 8, 1, 1, cfg.vocab_size)[0]
    converted = iclca.convert_approx(model, variables, prompt, "none", sinks=8, window=0)
    local = converted[PROMPT_STATE]
    attn = local[layer_scope(0)]["attn"]
    H, G, d, w = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.sliding_window - 1
    assert attn["win_k"].shape == attn["win_v"].shape == (1, G, w, d)
    F = cfg.layer_config(0).feature_dim
    assert iclca.stored_floats(converted)["local"] == _stored_floats(local) == G * w * 2 * d + H * (F * d + F + w * 2 * F)
    # the stored window: the prompt's last w positions and values, each key/value head's own
    np.testing.assert_array_equal(attn["win_pos"], np.arange(8 - w, 8))
    v = capture(model, variables, prompt, names=[block_site(0, "hook_v")])[1][block_site(0, "hook_v")]
    assert rel_err(attn["win_v"], jnp.swapaxes(v, 1, 2)[:, :, 8 - w:]) <= EXACT_RTOL  # jit and eager round apart
