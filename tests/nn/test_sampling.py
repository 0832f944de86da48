"""Sampling in ``linicl.generate`` is pinned to its definition, not only compared between two models
through the same function: token t is ``jax.random.categorical(keys[t], logits / temperature)`` with
``keys = jax.random.split(key, n_new)``, and the empirical frequencies at two temperatures match
softmax(logits / T). (Before, ``logits * temperature`` passed every test.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from helpers import init, tokens

CFG = linicl.ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16,
                         attention="softmax", positions="rope", dtype="float64")


def _model():
    """The model and variables of ``helpers.init`` (unit-scale tied embeddings, so the logits spread
    over several nats and T, 1/T give visibly different distributions)."""
    return init(CFG, 0)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampled_tokens_are_categorical_of_logits_over_temperature(temperature):
    model, variables = _model()
    prompt = tokens(1, 64, 5, CFG.vocab_size)
    key = jax.random.PRNGKey(7)
    out = np.asarray(linicl.generate(model, variables, prompt, 3, key=key, temperature=temperature))
    keys = jax.random.split(key, 3)
    seq = prompt
    for t in range(3):  # each step's logits from the full sequence so far (no decode cache involved)
        logits = model.apply(variables, seq)[:, -1]
        want = np.asarray(jax.random.categorical(keys[t], logits / temperature, axis=-1))
        np.testing.assert_array_equal(out[:, t], want)
        wrong = np.asarray(jax.random.categorical(keys[t], logits * temperature, axis=-1))
        assert (wrong != want).any(), "power: the inverted temperature must pick other tokens somewhere"
        seq = jnp.concatenate([seq, jnp.asarray(out[:, t:t + 1])], axis=1)


def test_sample_frequencies_follow_softmax_of_logits_over_temperature():
    """4,000 rows with the same prompt, one draw each: every token's frequency lies within 5 binomial
    standard errors of softmax(l / T)_i at T = 0.5 and 2 (a fixed key, so the test is deterministic;
    the two distributions differ by many standard errors, so swapping T for 1/T fails)."""
    model, variables = _model()
    n = 4000
    prompt = jnp.repeat(tokens(3, 1, 5, CFG.vocab_size), n, axis=0)
    logits = model.apply(variables, prompt[:1])[0, -1]
    for temperature in (0.5, 2.0):
        p = np.asarray(jax.nn.softmax(logits / temperature))
        q = np.asarray(jax.nn.softmax(logits * temperature))
        out = np.asarray(linicl.generate(model, variables, prompt, 1, key=jax.random.PRNGKey(11),
                                         temperature=temperature))[:, 0]
        freq = np.bincount(out, minlength=CFG.vocab_size) / n
        se = np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(freq - p) <= 5 * se + 1e-12), (temperature, freq, p)
        assert np.max(np.abs(q - p) / np.maximum(se, 1e-3)) > 10, "power: T and 1/T must be far apart"


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_new=True), "n_new must be a positive int, got True"),  # was read as 1: one token
    (dict(n_new=2.0), "n_new must be a positive int, got 2.0"),
    (dict(temperature=float("inf")), "temperature must be > 0 and finite"),  # was a uniform draw
    (dict(temperature=float("nan")), "temperature must be > 0 and finite"),
    (dict(temperature="1"), "temperature must be > 0 and finite.*got '1'"),  # was a TypeError
    (dict(temperature=True), "temperature must be > 0 and finite.*got True"),
    (dict(key=0), r"key must be a JAX PRNG key \(jax.random.PRNGKey\(0\)"),  # was jax's "invalid PRNG key data"
    (dict(key=np.zeros(2, np.float32)), r"key must be a JAX PRNG key.*got float32\[2\]"),
    (dict(key=jax.random.split(jax.random.PRNGKey(0), 2)), r"key must be a JAX PRNG key.*got uint32\[2, 2\]"),
])
def test_generate_refuses_bad_arguments_naming_them(kwargs, match):
    model, variables = _model()
    args = dict(n_new=2, key=jax.random.PRNGKey(0), temperature=1.0)
    args.update(kwargs)
    with pytest.raises(linicl.LiniclError, match=match):
        linicl.generate(model, variables, tokens(0, 1, 3, CFG.vocab_size), args.pop("n_new"), **args)


def test_generate_checks_temperature_before_tracing():
    """Under jit a traced temperature cannot be checked for inf, so it is refused with the fix."""
    model, variables = _model()
    run = jax.jit(lambda t: linicl.generate(model, variables, tokens(0, 1, 3, CFG.vocab_size), 2,
                                            key=jax.random.PRNGKey(0), temperature=t))
    with pytest.raises(linicl.LiniclError, match="temperature must be a concrete number"):
        run(0.5)


def test_generate_takes_typed_raw_and_numpy_keys_and_numpy_numbers():
    model, variables = _model()
    prompt = tokens(2, 2, 4, CFG.vocab_size)
    want = np.asarray(linicl.generate(model, variables, prompt, 3, key=jax.random.PRNGKey(5), temperature=2.0))
    for key, n_new, temperature in ((jax.random.key(5), 3, 2.0), (np.asarray(jax.random.PRNGKey(5)), np.int64(3),
                                                                   np.float32(2.0))):
        got = linicl.generate(model, variables, prompt, n_new, key=key, temperature=temperature)
        np.testing.assert_array_equal(got, want)
