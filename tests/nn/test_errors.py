"""Bad input gets a clear error naming the argument; under jit, out-of-range input becomes NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca
from linicl.errors import ConfigError, LiniclError, NotExactError, SequenceTooLongError
from helpers import init, tokens


@pytest.mark.parametrize("changes, match", [
    (dict(d_model=30, n_heads=4), "divisible by n_heads"),
    (dict(attention="rnn"), "attention must be one of"),
    (dict(feature_map="softplus"), "feature_map must be one of"),
    (dict(positions="alibi"), "positions must be one of"),
    (dict(norm="peri"), "norm must be one of"),
    (dict(decay=1.5), r"decay values must lie in \(0, 1\]"),
    (dict(decay=0.0), r"decay values must lie in \(0, 1\]"),
    (dict(decay=[0.9, 0.9]), "one per head"),
    (dict(feature_map="identity", normalize=True), "normalize=False"),
    (dict(attention="softmax", decay=0.9), "attention='linear' only"),
    (dict(n_layers=0), "n_layers must be a positive int"),
    (dict(vocab_size=3.5), "vocab_size must be a positive int"),
    (dict(dtype="float16"), "dtype must be one of"),
])
def test_bad_configs_name_the_field(changes, match):
    with pytest.raises(ConfigError, match=match):
        linicl.ModelConfig(**changes)


def test_config_is_hashable_and_decay_lists_become_tuples():
    cfg = linicl.ModelConfig(decay=[0.9, 0.8, 0.7, 0.6])
    assert cfg.decay == (0.9, 0.8, 0.7, 0.6) and hash(cfg) == hash(cfg.replace())
    with pytest.raises(ConfigError, match="unknown preset"):
        linicl.preset("gpt-5")


def test_softmax_model_is_refused_with_the_approximate_conversion_named():
    cfg = linicl.preset("tiny-softmax")
    model, variables = init(cfg)
    with pytest.raises(NotExactError, match="convert_approx"):
        iclca.convert(model, variables, tokens(0, 1, 4, cfg.vocab_size))


@pytest.mark.parametrize("prompt, match", [
    (np.zeros(5, np.int32), r"must be int32\[batch, seq\].*add a batch axis"),
    (np.zeros((1, 5), np.float32), "must have an integer dtype"),
    (np.zeros((1, 0), np.int32), "must have at least one row and one token"),
    (np.full((1, 3), 999, np.int32), r"holds token ids in \[999, 999\], outside the vocabulary \[0, 64\)"),
    (np.full((1, 3), -1, np.int32), r"holds token ids in \[-1, -1\], outside the vocabulary"),
    ([[1, 2, 3]], "must be an int32"),
])
def test_bad_prompts_name_the_argument(prompt, match):
    cfg = linicl.preset("tiny-linear")
    model, variables = init(cfg)
    with pytest.raises(LiniclError, match="prompt " + match):
        iclca.convert(model, variables, prompt)


def test_bad_query_tokens_name_the_argument():
    cfg = linicl.preset("tiny-linear")
    model, variables = init(cfg)
    with pytest.raises(LiniclError, match="tokens must be int32"):
        model.apply(variables, jnp.zeros((2, 3, 4), jnp.int32))


def test_bad_variables_are_refused():
    cfg = linicl.preset("tiny-linear")
    model, variables = init(cfg)
    with pytest.raises(LiniclError, match="'params'"):
        iclca.convert(model, variables["params"], tokens(0, 1, 3, cfg.vocab_size))
    with pytest.raises(LiniclError, match="linicl.Transformer"):
        iclca.convert(object(), variables, tokens(0, 1, 3, cfg.vocab_size))
    with pytest.raises(LiniclError, match="no converted prompt"):
        iclca.bias_terms(variables)


def test_state_batch_must_match_or_be_one():
    cfg = linicl.preset("tiny-linear")
    model, variables = init(cfg)
    converted = iclca.convert(model, variables, tokens(0, 2, 3, cfg.vocab_size))
    with pytest.raises(LiniclError, match="batch 2 but the tokens have batch 3"):
        model.apply(converted, tokens(1, 3, 3, cfg.vocab_size))


def test_learned_positions_past_max_len_are_refused():
    cfg = linicl.preset("tiny-linear-learned", max_len=16)
    model, variables = init(cfg)
    with pytest.raises(SequenceTooLongError, match="max_len=16"):
        iclca.convert(model, variables, tokens(0, 1, 17, cfg.vocab_size))
    converted = iclca.convert(model, variables, tokens(0, 1, 12, cfg.vocab_size))
    with pytest.raises(SequenceTooLongError, match="position 16, past the model's max_len=16"):
        model.apply(converted, tokens(1, 1, 5, cfg.vocab_size))
    with pytest.raises(SequenceTooLongError, match="max_len"):
        linicl.generate(model, converted, tokens(1, 1, 3, cfg.vocab_size), 3)
    with pytest.raises(SequenceTooLongError, match="max_len"):
        model.apply(variables, tokens(1, 1, 17, cfg.vocab_size))


def test_softmax_decode_cache_overflow_is_refused():
    cfg = linicl.preset("tiny-softmax-rope", max_len=8)
    model, variables = init(cfg)
    with pytest.raises(SequenceTooLongError, match="decode cache"):
        linicl.generate(model, variables, tokens(0, 1, 6, cfg.vocab_size), 4)


def test_under_jit_out_of_range_becomes_nan_not_a_wrong_answer():
    cfg = linicl.preset("tiny-linear-learned", max_len=16)
    model, variables = init(cfg)
    converted = iclca.convert(model, variables, tokens(0, 1, 14, cfg.vocab_size))
    out = jax.jit(model.apply)(converted, tokens(1, 1, 4, cfg.vocab_size))
    # Positions 16 and 17 do not exist. (NaN also reaches earlier positions through 0 * NaN in the
    # masked matrix products; what matters is that no finite wrong logit comes out for them.)
    assert np.all(np.isnan(out[:, 2:]))
    bad = jax.jit(model.apply)(variables, jnp.array([[1, -1, 2]], jnp.int32))
    assert np.all(np.isnan(bad[:, 1:]))
    soft = linicl.preset("tiny-softmax-rope", max_len=4)
    m2, v2 = init(soft)
    step = jax.jit(lambda v, t: m2.apply(v, t, mutable=["decode"]))
    _, state = step(v2, tokens(0, 1, 3, soft.vocab_size))
    out, _ = step({**v2, **state}, tokens(1, 1, 2, soft.vocab_size))
    assert np.all(np.isnan(out))


def test_generate_argument_checks():
    cfg = linicl.preset("tiny-linear")
    model, variables = init(cfg)
    x = tokens(0, 1, 3, cfg.vocab_size)
    with pytest.raises(LiniclError, match="n_new must be a positive int"):
        linicl.generate(model, variables, x, 0)
    with pytest.raises(LiniclError, match="temperature must be > 0"):
        linicl.generate(model, variables, x, 2, key=jax.random.PRNGKey(0), temperature=0.0)


def test_rel_err_refuses_a_zero_reference():
    from linicl.metrics import rel_err
    assert rel_err(np.array([1.0, 2.5]), np.array([1.0, 2.0])) == 0.25
    with pytest.raises(LiniclError, match="identically zero"):
        rel_err(np.ones(3), np.zeros(3))
