"""linicl.memory.prompt_floats: the floats a converted model holds for its prompt, exact or approximate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca, names
from linicl.memory import prompt_floats

from helpers import init, tokens


def _approx_leaf_sizes(converted, fields):
    """The sizes of the given PromptApprox fields over every layer, read directly."""
    total = 0
    for scope in converted[names.PROMPT_APPROX].values():
        approx = scope["attn"]["approx"]
        total += sum(int(getattr(approx, f).size) for f in fields if getattr(approx, f) is not None)
    return total


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-linear-learned"])
def test_exact_prompt_holds_state_floats_per_row(preset):
    """The exact conversion stores S and z per layer: iclca.state_floats(cfg) per prompt row; the
    int32 offset (learned positions) and the params are not counted."""
    cfg = linicl.preset(preset, dtype="float64")
    model, variables = init(cfg)
    assert prompt_floats(variables) == 0
    for batch in (1, 3):
        converted = iclca.convert(model, variables, tokens(0, batch, 5, cfg.vocab_size))
        assert prompt_floats(converted) == batch * iclca.state_floats(cfg)
        assert prompt_floats(converted, projections=False) == batch * iclca.state_floats(cfg)


@pytest.mark.parametrize("kernel, sinks", [("taylor2", 0), ("prf", 2), ("elu+1", 1)])
def test_approximate_prompt_counts_bias_terms_sinks_and_projections(kernel, sinks):
    cfg = linicl.preset("tiny-softmax", dtype="float64")
    model, variables = init(cfg)
    converted = iclca.convert_approx(model, variables, tokens(1, 1, 6, cfg.vocab_size), kernel, sinks=sinks,
                                     n_features=16)
    kept = _approx_leaf_sizes(converted, ("B", "b", "sink_k", "sink_v"))
    projections = _approx_leaf_sizes(converted, ("W",))
    assert (projections > 0) == (kernel == "prf") and (kept > _approx_leaf_sizes(converted, ("B", "b"))) == (sinks > 0)
    assert prompt_floats(converted, projections=False) == kept  # sink positions are int32: not floats
    assert prompt_floats(converted) == kept + projections


def test_only_floating_leaves_of_the_prompt_collections_count():
    variables = {names.PARAMS: {"w": jnp.ones((100,))},
                 names.PROMPT_STATE: {"layers_0": {"attn": {"S": jnp.ones((1, 2, 3, 4)), "z": jnp.ones((1, 2, 3))}}},
                 names.POSITION: {"offset": jnp.zeros((), jnp.int32)},
                 names.DECODE: {"layers_0": {"attn": {"S": jnp.ones((7,))}}},
                 "other": np.ones(5)}
    assert prompt_floats(variables) == 24 + 6
    half = {names.PROMPT_STATE: {"x": jnp.ones((3,), jnp.bfloat16), "i": np.arange(4)}}
    assert prompt_floats(half) == 3
    with pytest.raises(TypeError, match="variables dict"):
        prompt_floats(jax.numpy.ones(3))


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_kv_cache_floats_counts_the_decode_cache_of_a_prompt(n_kv_heads):
    """Against the keys and values the decode cache really holds for the prompt (grouped-query heads
    share theirs)."""
    from linicl.memory import kv_cache_floats
    cfg = linicl.preset("tiny-gpt2", dtype="float64", n_heads=4, n_kv_heads=n_kv_heads)
    model, variables = init(cfg)
    n = 7
    kv, local = iclca._prompt_kv_fn(model)(variables, tokens(0, 1, n, cfg.vocab_size))
    assert not local and sorted(kv) == list(range(cfg.n_layers))
    assert kv_cache_floats(cfg, n) == sum(int(k.size + v.size) for k, v in kv.values())
