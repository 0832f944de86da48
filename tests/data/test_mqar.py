"""Multi-query associative recall (linicl.data.synthetic.mqar_batch): every answer is the value of its
query key, the mask marks exactly the query keys, keys and queries are distinct, the padded layout
(seq_len) keeps the same structure, jit/vmap, and errors that name the argument."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linicl.data.synthetic import TokenBatch, mqar_batch
from linicl.errors import LiniclError

KEY = jax.random.PRNGKey(0)


def check_structure(b: TokenBatch, n_pairs: int, n_queries: int, vocab: int, seq_len: int) -> None:
    """Every property of an MQAR batch, row by row (see mqar_batch's docstring)."""
    inputs, targets, mask = (np.asarray(a) for a in b)
    batch = inputs.shape[0]
    assert inputs.shape == targets.shape == mask.shape == (batch, seq_len)
    assert inputs.dtype == targets.dtype == np.int32 and mask.dtype == np.bool_
    # one sequence: inputs are its first L tokens, targets its last L
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    half = vocab // 2
    keys, values = inputs[:, 0:2 * n_pairs:2], inputs[:, 1:2 * n_pairs:2]
    assert keys.max() < half and values.min() >= half and max(inputs.max(), targets.max()) < vocab
    for r in range(batch):
        assert len(set(keys[r])) == n_pairs                        # distinct keys: unique answers
        where = np.flatnonzero(mask[r])
        assert len(where) == n_queries and where.min() >= 2 * n_pairs
        queried = inputs[r, where]
        assert len(set(queried)) == n_queries                      # each pair queried at most once
        for t, q in zip(where, queried):
            (j,) = np.flatnonzero(keys[r] == q)                    # the query is one of the keys
            assert targets[r, t] == values[r, j]                   # and its answer is that key's value
        # After the pairs, the only key tokens are the queries (fillers are values).
        tail = inputs[r, 2 * n_pairs:]
        assert set(np.flatnonzero(tail < half) + 2 * n_pairs) == set(where)


@pytest.mark.parametrize("batch,n_pairs,n_queries,vocab", [(1, 1, 1, 4), (4, 3, 2, 10), (6, 8, 8, 32)])
def test_compact_layout(batch, n_pairs, n_queries, vocab):
    b = mqar_batch(KEY, batch, n_pairs, n_queries, vocab)
    L = 2 * n_pairs + 2 * n_queries - 1
    check_structure(b, n_pairs, n_queries, vocab, L)
    # the queries come right after the pairs, each followed by its answer
    expected = np.zeros(L, bool)
    expected[2 * n_pairs::2] = True
    np.testing.assert_array_equal(np.asarray(b.mask), np.broadcast_to(expected, (batch, L)))


def test_padded_layout_and_its_compact_special_case():
    b = mqar_batch(KEY, 8, 4, 3, 16, seq_len=30)
    check_structure(b, 4, 3, 16, 30)
    assert len({tuple(np.flatnonzero(m)) for m in np.asarray(b.mask)}) > 1  # random query slots
    # the shortest seq_len is the compact layout, sample for sample
    for x, y in zip(mqar_batch(KEY, 5, 4, 3, 16), mqar_batch(KEY, 5, 4, 3, 16, seq_len=13)):
        np.testing.assert_array_equal(x, y)


def test_queries_cover_the_pairs_uniformly():
    b = mqar_batch(KEY, 2000, 4, 1, 16)
    inputs = np.asarray(b.inputs)
    j = np.argmax(inputs[:, 0:8:2] == inputs[:, 8:9], axis=1)
    assert np.bincount(j, minlength=4).min() > 400   # 500 expected per pair
    # every pair once when all are queried
    full = np.asarray(mqar_batch(KEY, 50, 5, 5, 20).inputs)
    assert all(sorted(row[10::2]) == sorted(row[0:10:2]) for row in full)


def test_determinism_jit_and_vmap():
    gen = functools.partial(mqar_batch, batch=3, n_pairs=4, n_queries=2, vocab_size=16)
    keys = jax.random.split(KEY, 3)
    eager = [gen(k) for k in keys]
    np.testing.assert_array_equal(gen(keys[0]).inputs, eager[0].inputs)
    assert not np.array_equal(eager[0].inputs, eager[1].inputs)
    np.testing.assert_array_equal(jax.jit(gen)(keys[1]).targets, eager[1].targets)
    stacked = jax.jit(jax.vmap(gen))(keys)
    assert stacked.inputs.shape == (3, 3, 11)
    for i in range(3):
        np.testing.assert_array_equal(stacked.mask[i], eager[i].mask)
    static = jax.jit(mqar_batch, static_argnames=("batch", "n_pairs", "n_queries", "vocab_size", "seq_len"))
    assert static(KEY, batch=2, n_pairs=2, n_queries=1, vocab_size=8, seq_len=9).inputs.shape == (2, 9)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch=0, n_pairs=2, n_queries=1, vocab_size=8), "batch must be at least 1"),
    (dict(batch=2, n_pairs=0, n_queries=1, vocab_size=8), "n_pairs must be at least 1"),
    (dict(batch=2, n_pairs=2, n_queries=0, vocab_size=8), "n_queries must be at least 1"),
    (dict(batch=2, n_pairs=2, n_queries=3, vocab_size=8), "n_queries = 3 must be <= n_pairs"),
    (dict(batch=2, n_pairs=5, n_queries=1, vocab_size=8), "n_pairs = 5 .*key vocabulary"),
    (dict(batch=2, n_pairs=1, n_queries=1, vocab_size=3), "vocab_size must be at least 4"),
    (dict(batch=2, n_pairs=2, n_queries=2, vocab_size=8, seq_len=6), "seq_len must be at least 7"),
    (dict(batch=2.0, n_pairs=2, n_queries=1, vocab_size=8), "batch must be a Python int"),
    (dict(batch=2, n_pairs=2, n_queries=True, vocab_size=8), "n_queries must be a Python int"),
    (dict(batch=2, n_pairs=2, n_queries=1, vocab_size=8, seq_len=jnp.int32(9)), "seq_len .*static"),
])
def test_errors_name_the_argument(kwargs, match):
    with pytest.raises(LiniclError, match=match):
        mqar_batch(KEY, **kwargs)
