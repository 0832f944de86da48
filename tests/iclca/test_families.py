"""The ICLCA identities at volume: a fixed set of model families, each compiled once per prompt length.

The property tests in ``test_iclca.py`` draw a new config (and so new XLA programs) for every example,
which costs seconds per example: the thorough profile cannot reach a large budget that way. Here the
configs are a fixed list spanning the finite-state options (feature maps, learned hedgehog maps, per-head
decays, positions and where rope sits, norms, grouped-query heads, windows and sinks, kernel forms,
trainable biases) and the shapes a few fixed lengths, so every compiled function is reused across
examples; hypothesis spends its budget on what changes the numbers (parameters, tokens, which prompt).

``HYPOTHESIS_PROFILE=thorough`` runs ``THOROUGH_EXAMPLES`` examples of each identity; the default (ci)
profile a handful. Time per example once compiled is printed with ``-s``.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import linicl
from linicl import iclca
from helpers import BASELINE_MIN, EXACT_RTOL, init, perturb_learned_maps, prompt_and_query, rel_err, tokens

THOROUGH_EXAMPLES = 1000
N_EXAMPLES = THOROUGH_EXAMPLES if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 4
PROMPT_LENS = (1, 6, 23)  # one token, shorter and longer than the windows and chunks below
QUERY_LEN, BATCH = 5, 2

_BASE = dict(vocab_size=24, d_model=12, n_layers=2, n_heads=3, d_ff=8, max_len=64, attention="linear",
             dtype="float64")
FAMILIES = [
    dict(feature_map="elu+1", normalize=True, decay=None, positions="none"),
    dict(feature_map="relu", normalize=True, attn_eps=1e-3, decay=[0.6, 0.9, 1.0], positions="learned",
         form="recurrent"),
    dict(feature_map="identity", normalize=False, decay=0.8, positions="rope", rope_style="half",
         norm_type="rmsnorm", mlp="gated", n_kv_heads=1, form="chunked", chunk_size=3),
    dict(feature_map="taylor2", d_model=9, normalize=True, decay=[0.95, 0.7, 0.85], positions="rope",
         rope_on="features", norm="post", form="parallel", trainable_bias=True),
    dict(feature_map="hedgehog", feature_size=5, normalize=True, decay=[0.9, 1.0, 0.75], positions="rope",
         rope_on="inputs", window=3, sinks=1),
    dict(feature_map="hedgehog", feature_size=0, normalize=True, positions="learned", window=8, sinks=0,
         n_kv_heads=3, use_bias=False, form="chunked", chunk_size=2),
    dict(feature_map="elu+1", normalize=True, decay=0.7, positions="rope", rope_on="features", window=0,
         sinks=4, norm="none", skip="residual", mlp_depth=3, activation="silu"),
    dict(feature_map="hedgehog", feature_size=3, normalize=True, positions="none", window=1, sinks=4,
         trainable_bias=False, tie_embeddings=False),
    dict(feature_map="elu+1", normalize=True, decay=[0.9, 0.8, 1.0], positions="rope", rope_on="inputs",
         form="chunked", chunk_size=5, n_kv_heads=1),
]


class Family:
    """One config with its model and jitted init/apply, built once; ``variables(seed)`` are random
    parameters (learned maps perturbed away from their init, so that their use is tested)."""

    def __init__(self, index: int):
        self.cfg = linicl.ModelConfig(**{**_BASE, **FAMILIES[index]})
        self.model, _ = init(self.cfg, 0)
        self.apply = jax.jit(self.model.apply)

    def variables(self, seed: int):
        _, variables = init(self.cfg, seed)
        return perturb_learned_maps(variables, seed)  # hedgehog maps and window gates; others unchanged


_FAMILIES: dict = {}  # this module's compiled families (dropped with the module)


def family(index: int) -> Family:
    if index not in _FAMILIES:
        _FAMILIES[index] = Family(index)
    return _FAMILIES[index]


_TIMES: list = []


@pytest.fixture(scope="module", autouse=True)
def _report_time():
    yield
    if _TIMES:
        print(f"\n{len(_TIMES)} family examples: median {1e3 * np.median(_TIMES):.1f} ms, "
              f"total {sum(_TIMES):.1f} s (compilation included)")


# Every family is its own test case (hypothesis drawing the index saw only some of them in the ci
# profile): the examples are shared among the families, at least one each.
EVERY_FAMILY = pytest.mark.parametrize("index", range(len(FAMILIES)))


def per_family(examples: int) -> settings:
    """``examples`` of an identity shared among the families (at least one each)."""
    return settings(max_examples=max(1, round(examples / len(FAMILIES))))


@EVERY_FAMILY
@per_family(N_EXAMPLES)
@given(n=st.sampled_from(PROMPT_LENS), shared=st.booleans(), seed=st.integers(0, 2**16))
def test_converted_equals_prompted(index, n, shared, seed):
    t0 = time.perf_counter()
    fam = family(index)
    variables = fam.variables(seed)
    prompt, query = prompt_and_query(seed + 1, 1 if shared else BATCH, n, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (BATCH, n)), query], axis=1)
    reference = fam.apply(variables, full)[:, n:]
    converted = iclca.convert(fam.model, variables, prompt)
    assert rel_err(fam.apply(converted, query), reference) <= EXACT_RTOL
    assert rel_err(fam.apply(variables, query), reference) >= BASELINE_MIN  # power: the prompt matters
    _TIMES.append(time.perf_counter() - t0)


@EVERY_FAMILY
@per_family(N_EXAMPLES)
@given(n1=st.sampled_from(PROMPT_LENS[:2]), n2=st.sampled_from(PROMPT_LENS[:2]), seed=st.integers(0, 2**16))
def test_converting_twice_equals_converting_the_concatenation(index, n1, n2, seed):
    t0 = time.perf_counter()
    fam = family(index)
    variables = fam.variables(seed)
    p1, query = prompt_and_query(seed + 1, 1, n1, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    p2 = tokens(seed + 3, 1, n2, fam.cfg.vocab_size)
    twice = iclca.convert(fam.model, iclca.convert(fam.model, variables, p1), p2)
    once = iclca.convert(fam.model, variables, jnp.concatenate([p1, p2], axis=1))
    assert rel_err(fam.apply(twice, query), fam.apply(once, query)) <= EXACT_RTOL
    only_p2 = iclca.convert(fam.model, variables, p2)
    assert rel_err(fam.apply(only_p2, query), fam.apply(once, query)) >= BASELINE_MIN
    _TIMES.append(time.perf_counter() - t0)


@EVERY_FAMILY
@per_family(N_EXAMPLES // 4)
@given(n=st.sampled_from(PROMPT_LENS), seed=st.integers(0, 2**16))
def test_generation_after_conversion_equals_generation_after_the_prompt(index, n, seed):
    t0 = time.perf_counter()
    fam = family(index)
    variables = fam.variables(seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (BATCH, n)), query], axis=1)
    converted = iclca.convert(fam.model, variables, prompt)
    np.testing.assert_array_equal(linicl.generate(fam.model, converted, query, 3),
                                  linicl.generate(fam.model, variables, full, 3))
    _TIMES.append(time.perf_counter() - t0)
