"""No retracing: repeated calls at the same shapes trace nothing, and decoding does not retrace per
prompt length.

Two counters, both read off the process while the calls run:
* ``model_traces``: Python-level runs of ``Transformer.__call__`` (a Flax method interceptor). A
  jitted function runs the model's Python only while it is traced, so this counts the traces of
  every compiled function that calls the model, once per call site in it (generate's prefill calls
  it once, its decode scan once).
* ``jit_traces``: every trace JAX reports (``jax.monitoring``, the jaxpr-trace event), of any jitted
  function, including the small ones behind eager operations on new shapes.

Each test first checks that the counters see the first call (so a zero later is not vacuous).
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

import linicl
from linicl import evaluate, iclca
from linicl.nn.transformer import Transformer

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


class Counts:
    def __init__(self):
        self.model_traces = 0
        self.jit_traces = 0
        self.traced = []  # names of the functions JAX traced, for the failure message

    def __repr__(self):
        return f"Counts(model_traces={self.model_traces}, jit_traces={self.jit_traces}, traced={self.traced})"


@contextlib.contextmanager
def counting():
    """Count model traces and JAX traces inside the block (see the module docstring)."""
    counts = Counts()

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, Transformer) and context.method_name == "__call__":
            counts.model_traces += 1
        return next_fun(*args, **kwargs)

    def listener(event, duration, **kwargs):
        if event == _TRACE_EVENT:
            counts.jit_traces += 1
            counts.traced.append(kwargs.get("fun_name", "?"))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        with nn.intercept_methods(interceptor):
            yield counts
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _model(**changes):
    cfg = linicl.ModelConfig(**{**dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=64,
                                       dtype="float64"), **changes})
    model = linicl.Transformer(cfg)
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))


def _tokens(batch: int, n: int, seed: int = 0):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, n), 0, 32, jnp.int32)


def test_the_counters_see_a_trace():
    model, variables = _model()
    fn = jax.jit(lambda v, t: model.apply(v, t))
    x, y = _tokens(2, 5), _tokens(2, 5, seed=1)
    with counting() as first:
        fn(variables, x)
    assert first.model_traces == 1 and first.jit_traces >= 1, first
    with counting() as again:
        fn(variables, y)
    assert again.model_traces == 0 and again.jit_traces == 0, again


def test_generate_twice_at_the_same_shape_traces_nothing():
    for attention in ("softmax", "linear"):
        model, variables = _model(attention=attention, positions="rope")
        x = _tokens(2, 5)
        key = jax.random.PRNGKey(3)
        with counting() as first:
            linicl.generate(model, variables, x, 4)
            linicl.generate(model, variables, x, 4, key=key)
        assert first.model_traces == 3, first  # the prefill, the greedy and the sampled decode
        with counting() as again:
            a = linicl.generate(model, variables, x, 4)
            b = linicl.generate(model, variables, x, 4, key=key)
        assert again.model_traces == 0 and again.jit_traces == 0, again
        assert a.shape == b.shape == (2, 4)


def test_generate_at_prompt_lengths_of_one_bucket_reuses_the_prefill():
    """Softmax (causal) prompts are right-padded to a length bucket (16, 24, 32, ...): lengths 5 and
    13 share the 16-token prefill, and the decode scan does not depend on the prompt length."""
    model, variables = _model(attention="softmax", positions="learned")
    x5, x13, x20 = _tokens(2, 5), _tokens(2, 13, seed=1), _tokens(2, 20, seed=2)
    with counting() as first:
        linicl.generate(model, variables, x5, 4)
    assert first.model_traces == 2, first
    with counting() as same_bucket:
        out = linicl.generate(model, variables, x13, 4)
    assert same_bucket.model_traces == 0 and same_bucket.jit_traces == 0, same_bucket
    # Padding is exact: the same tokens as full forward passes over the unpadded sequence.
    assert np.array_equal(out, _greedy_by_hand(model, variables, x13, 4))
    with counting() as next_bucket:
        linicl.generate(model, variables, x20, 4)
    assert next_bucket.model_traces == 1, next_bucket  # the 24-token prefill; not the decode


def test_generate_at_a_new_prompt_length_does_not_retrace_the_decode():
    """Linear attention cannot pad (its state would sum the padding): the prefill is traced per
    length, the decode scan once per batch and number of new tokens."""
    model, variables = _model(attention="linear", positions="rope")
    x5, x9 = _tokens(2, 5), _tokens(2, 9, seed=1)
    linicl.generate(model, variables, x5, 4)
    with counting() as other_length:
        linicl.generate(model, variables, x9, 4)
    assert other_length.model_traces == 1, other_length  # the prefill only
    with counting() as other_n_new:
        linicl.generate(model, variables, x9, 6)
    assert other_n_new.model_traces == 1, other_n_new  # the decode only


def _greedy_by_hand(model, variables, x, n_new):
    """Greedy continuation by full forward passes over the growing sequence (no cache, no padding)."""
    seq = x
    for _ in range(n_new):
        nxt = jnp.argmax(model.apply(variables, seq)[:, -1], axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    return np.asarray(seq[:, x.shape[1]:])


def test_convert_twice_traces_nothing():
    model, variables = _model(attention="linear", positions="rope")
    prompt, other = _tokens(1, 7), _tokens(1, 7, seed=1)
    with counting() as first:
        iclca.convert(model, variables, prompt)
    assert first.model_traces == 1, first
    with counting() as again:
        iclca.convert(model, variables, other)
    assert again.model_traces == 0 and again.jit_traces == 0, again


def test_run_logprobs_over_batches_of_one_bucket_traces_once():
    """Prompts of 3 to 14 tokens all pad to the 16-token bucket: three batches of 4, one trace; a
    second run traces nothing."""
    model, variables = _model(attention="softmax", positions="rope")
    prompts = [np.asarray(_tokens(1, n, seed=n)[0]) for n in range(3, 15)]
    with counting() as first:
        out = evaluate.run_logprobs(model, variables, prompts, batch_size=4)
    assert len(out) == len(prompts) and first.model_traces == 1, first
    with counting() as again:
        evaluate.run_logprobs(model, variables, prompts[::-1], batch_size=4)
    assert again.model_traces == 0 and again.jit_traces == 0, again
