"""Local (sliding-window softmax) layers among global ones (``ModelConfig.layer_types``, Gemma 2/3): a
local layer whose window covers the sequence is the global softmax layer, a shorter window is not; a
decode continues the full pass exactly while the local layers' decode state stays at the window's size;
a converted prompt of a model whose global layers are finite-state answers as the prompted model (the
finite-state strategies draw local layers too: tests/nn/test_finite_state.py); bad patterns are refused
naming the field. The forward pass against an independent NumPy reference: tests/nn/test_reference.py.
float64; exact identities <= EXACT_RTOL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca, memory
from linicl.errors import ConfigError
from linicl.names import DECODE, PROMPT_STATE
from helpers import BASELINE_MIN, EXACT_RTOL, apply, greedy_by_full_forwards, init, prompted, rel_err, tokens


def _softmax(**changes):
    base = dict(vocab_size=23, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=24, max_len=64,
                attention="softmax", positions="rope", rope_style="half", norm="sandwich",
                norm_type="gemma_rmsnorm", qk_norm=True, mlp="gated", activation="gelu_tanh", use_bias=False,
                layer_types=("local", "local", "global"), sliding_window=3, rope_local_base=100.0,
                dtype="float64")
    return linicl.ModelConfig(**{**base, **changes})


def test_a_window_as_long_as_the_sequence_is_the_global_layer():
    """With the local rope base equal to the global one, a local layer whose window covers all T tokens
    computes the global softmax layer (its window gate cancels); a window of 3 does not."""
    T = 12
    cfg = _softmax(rope_local_base=None, sliding_window=T)
    model, variables = init(cfg, 0)
    x = tokens(1, 2, T, cfg.vocab_size)
    plain = linicl.Transformer(cfg.replace(layer_types=None, sliding_window=0))
    params = {k: v for k, v in variables["params"].items()}
    for l in (0, 1):  # the global model has no window gates
        params[f"layers_{l}"] = {**params[f"layers_{l}"], "attn": {
            k: v for k, v in params[f"layers_{l}"]["attn"].items() if k != "gate"}}
    reference = apply(plain, {"params": params}, x)
    assert rel_err(apply(model, variables, x), reference) <= EXACT_RTOL
    short = linicl.Transformer(cfg.replace(sliding_window=3))
    assert rel_err(apply(short, variables, x), reference) >= BASELINE_MIN


def test_decoding_continues_the_full_pass_and_the_local_state_stays_bounded():
    cfg = _softmax()
    model, variables = init(cfg, 1)
    prompt = tokens(2, 2, 9, cfg.vocab_size)
    new = linicl.generate(model, variables, prompt, 6)
    np.testing.assert_array_equal(new, greedy_by_full_forwards(model, variables, prompt, 6))
    # the decode state after 5 and after 40 tokens: the local layers' fields have the same shapes
    shapes = []
    for n in (5, 40):
        _, state = model.apply(variables, tokens(3, 1, n, cfg.vocab_size), mutable=[DECODE])
        shapes.append(jax.tree.map(jnp.shape, state[DECODE]))
    for l in (0, 1):
        assert shapes[0][f"layers_{l}"] == shapes[1][f"layers_{l}"]
        assert shapes[0][f"layers_{l}"]["attn"]["win_k"][2] == cfg.sliding_window - 1
    assert shapes[0]["layers_2"]["attn"]["cached_k"][2] == cfg.max_len  # the global layer: a KV cache


def test_a_prompt_converts_exactly_when_the_global_layers_are_finite_state():
    """Local layers exact, global layers linearised (the student of a Gemma-style teacher)."""
    cfg = _softmax(attention="linear", feature_map="hedgehog", rope_on="inputs", window=2, sinks=1)
    model, variables = init(cfg, 2)
    prompt, query = tokens(4, 1, 11, cfg.vocab_size), tokens(5, 2, 3, cfg.vocab_size)
    reference = prompted(model, variables, prompt, query)
    converted = iclca.convert(model, variables, prompt)
    assert rel_err(apply(model, converted, query), reference) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN
    local = converted[PROMPT_STATE]["layers_0"]["attn"]
    np.testing.assert_array_equal(local["win_pos"], [9, 10])  # the last window - 1 tokens
    floats = sum(a.size for a in jax.tree.leaves(converted[PROMPT_STATE]) if jnp.issubdtype(a.dtype, jnp.floating))
    assert iclca.state_floats(cfg) == floats


def test_kv_cache_floats_count_the_local_layers_at_their_window():
    cfg = _softmax()
    per_token = 2 * cfg.kv_heads * cfg.head_dim
    assert memory.kv_cache_floats(cfg, 50) == per_token * (2 * (cfg.sliding_window - 1) + 50)
    assert memory.kv_cache_floats(cfg, 1) == per_token * 3


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=("local", "global")), "sequence of n_layers"),
    (dict(layer_types="local"), "sequence of n_layers"),
    (dict(layer_types=("local", "global", "loco")), "one of"),
    (dict(sliding_window=0), "sliding_window >= 1"),
    (dict(layer_types=None), "has none"),
    (dict(layer_types=None, sliding_window=0), "has none"),  # rope_local_base alone
    (dict(causal=False), "causal"),
    (dict(attention="linear", feature_map="elu+1"), "rope_on='inputs'"),
])
def test_bad_patterns_are_refused_naming_the_field(changes, match):
    with pytest.raises(ConfigError, match=match):
        _softmax(**changes)
