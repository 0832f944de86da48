"""Synthetic in-context tasks (linicl.data.synthetic): shapes, the task structure, determinism under
the key, jit and vmap, and clear errors for bad sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linicl.data.synthetic import TokenBatch, induction_batch, induction_mask, recall_batch
from linicl.errors import LiniclError

KEY = jax.random.PRNGKey(0)


def full_sequence(b: TokenBatch) -> np.ndarray:
    """The length-T sequence behind an induction batch: inputs plus the last target."""
    return np.concatenate([np.asarray(b.inputs), np.asarray(b.targets)[:, -1:]], axis=1)


# One size per generator is shared by most tests below (every new size is a new compilation).
IND = dict(batch=3, seq_len=12, vocab_size=7)
REC = dict(batch=5, n_pairs=3, vocab_size=10)


@pytest.mark.parametrize("batch,seq_len,vocab", [(1, 4, 2), (3, 12, 7), (4, 64, 64)])
def test_induction_shapes_and_structure(batch, seq_len, vocab):
    b = induction_batch(KEY, batch, seq_len, vocab)
    assert isinstance(b, TokenBatch)
    for a in (b.inputs, b.targets):
        assert a.shape == (batch, seq_len - 1) and a.dtype == jnp.int32
    assert b.mask.shape == (batch, seq_len - 1) and b.mask.dtype == jnp.bool_
    seq = full_sequence(b)
    h = seq_len // 2
    assert seq.min() >= 0 and seq.max() < vocab
    np.testing.assert_array_equal(seq[:, :h], seq[:, h:])          # the second half repeats the first
    np.testing.assert_array_equal(np.asarray(b.targets), seq[:, 1:])  # next token at every position
    np.testing.assert_array_equal(np.asarray(b.inputs), seq[:, :-1])
    mask = np.asarray(b.mask)
    assert (mask == (np.arange(seq_len - 1) >= h)).all() and mask.sum(1).tolist() == [h - 1] * batch
    # At a masked position t the target is the token that followed the current token's first
    # occurrence at t - h: an induction head's answer.
    t = np.arange(h, seq_len - 1)
    np.testing.assert_array_equal(seq[:, t - h], seq[:, t])
    np.testing.assert_array_equal(np.asarray(b.targets)[:, t], seq[:, t - h + 1])
    np.testing.assert_array_equal(np.asarray(induction_mask(seq_len)), mask[0])


def test_induction_distinct_and_uniform():
    b = induction_batch(KEY, 200, 16, 8, distinct=True)
    seq = full_sequence(b)
    assert all(len(set(row[:8])) == 8 for row in seq)  # a permutation of the whole vocabulary
    counts = np.bincount(np.asarray(induction_batch(KEY, 400, 64, 16).inputs).ravel(), minlength=16)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()
    # i.i.d. tokens repeat inside a half; distinct ones never do
    plain = full_sequence(induction_batch(KEY, 50, 16, 8))
    assert any(len(set(row[:8])) < 8 for row in plain)


def test_determinism_under_key():
    a, b = induction_batch(KEY, **IND), induction_batch(KEY, **IND)
    c = induction_batch(jax.random.PRNGKey(1), **IND)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert not np.array_equal(a.inputs, c.inputs)
    r1, r2 = recall_batch(KEY, **REC), recall_batch(KEY, **REC)
    for x, y in zip(r1, r2):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(r1.inputs, recall_batch(jax.random.PRNGKey(1), **REC).inputs)
    # new-style typed keys work as well
    typed = induction_batch(jax.random.key(3), **IND)
    assert typed.inputs.shape == (3, 11)


@pytest.mark.parametrize("batch,n_pairs,vocab", [(1, 1, 4), (5, 3, 10), (8, 16, 64)])
def test_recall_answer_is_the_value_of_the_query_key(batch, n_pairs, vocab):
    b = recall_batch(KEY, batch, n_pairs, vocab)
    L = 2 * n_pairs + 1
    inputs, targets, mask = (np.asarray(a) for a in b)
    assert inputs.shape == targets.shape == mask.shape == (batch, L)
    assert inputs.dtype == targets.dtype == np.int32 and mask.dtype == np.bool_
    keys, values, query = inputs[:, 0:-1:2], inputs[:, 1:-1:2], inputs[:, -1]
    assert keys.max() < vocab // 2 and values.min() >= vocab // 2 and values.max() < vocab
    for r in range(batch):
        assert len(set(keys[r])) == n_pairs                       # distinct keys: a unique answer
        (j,) = np.flatnonzero(keys[r] == query[r])                # the query is exactly one key
        assert targets[r, -1] == values[r, j]
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])  # next token elsewhere
    assert (mask == (np.arange(L) == L - 1)).all()


def test_recall_query_is_uniform_over_pairs():
    b = recall_batch(KEY, 2000, 4, 16)
    inputs = np.asarray(b.inputs)
    j = np.argmax(inputs[:, 0:-1:2] == inputs[:, -1:], axis=1)
    counts = np.bincount(j, minlength=4)
    assert counts.min() > 400  # 500 expected per pair


def test_jit_and_vmap():
    gen = functools.partial(induction_batch, **IND)
    keys = jax.random.split(KEY, 3)
    eager = [gen(k) for k in keys]
    np.testing.assert_array_equal(jax.jit(gen)(keys[1]).inputs, eager[1].inputs)
    stacked = jax.jit(jax.vmap(gen))(keys)
    assert stacked.inputs.shape == (3, 3, 11) and stacked.mask.shape == (3, 3, 11)
    for i in range(3):
        np.testing.assert_array_equal(stacked.targets[i], eager[i].targets)
    rec = functools.partial(recall_batch, **REC)
    np.testing.assert_array_equal(jax.vmap(rec)(keys).inputs[2], rec(keys[2]).inputs)
    # sizes as static arguments of a jitted generator
    gen_static = jax.jit(induction_batch, static_argnames=("batch", "seq_len", "vocab_size", "distinct"))
    assert gen_static(KEY, **IND, distinct=True).inputs.shape == (3, 11)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch=2, seq_len=7, vocab_size=4), "even"),
    (dict(batch=2, seq_len=2, vocab_size=4), "seq_len must be at least 4"),
    (dict(batch=0, seq_len=8, vocab_size=4), "batch must be at least 1"),
    (dict(batch=2, seq_len=8, vocab_size=1), "vocab_size must be at least 2"),
    (dict(batch=2.0, seq_len=8, vocab_size=4), "batch must be a Python int"),
    (dict(batch=2, seq_len=True, vocab_size=4), "seq_len must be a Python int"),
    (dict(batch=2, seq_len=jnp.int32(8), vocab_size=4), "static"),
    (dict(batch=2, seq_len=20, vocab_size=4, distinct=True), "distinct"),
])
def test_induction_errors(kwargs, match):
    with pytest.raises(LiniclError, match=match):
        induction_batch(KEY, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch=2, n_pairs=0, vocab_size=8), "n_pairs must be at least 1"),
    (dict(batch=2, n_pairs=5, vocab_size=8), "key vocabulary"),
    (dict(batch=2, n_pairs=1, vocab_size=3), "vocab_size must be at least 4"),
    (dict(batch=-1, n_pairs=1, vocab_size=8), "batch must be at least 1"),
])
def test_recall_errors(kwargs, match):
    with pytest.raises(LiniclError, match=match):
        recall_batch(KEY, **kwargs)


def test_errors_are_value_errors_under_jit():
    with pytest.raises(ValueError, match="even"):
        jax.jit(functools.partial(induction_batch, batch=1, seq_len=9, vocab_size=4))(KEY)


def test_facts_are_one_table_shared_by_every_sequence():
    from linicl.data.synthetic import facts_batch, facts_table
    table = np.asarray(facts_table(8, 32, table_seed=5))
    assert table.shape == (8,) and table.min() >= 16 and table.max() < 32
    b = facts_batch(jax.random.PRNGKey(0), 6, 10, 32, 8, table_seed=5)
    inputs, targets, mask = (np.asarray(x) for x in b)
    assert inputs.shape == targets.shape == mask.shape == (6, 19)
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])  # next-token data
    keys, values = inputs[:, 0::2], targets[:, 0::2]
    assert keys.max() < 8 and mask[:, 0::2].all() and not mask[:, 1::2].any()
    np.testing.assert_array_equal(values, table[keys])  # every answer is the table's
    other = np.asarray(facts_batch(jax.random.PRNGKey(1), 6, 10, 32, 8, table_seed=5).targets)[:, 0::2]
    assert not np.array_equal(other, values)  # another key draws other keys from the same table
    assert not np.array_equal(np.asarray(facts_table(8, 32, table_seed=6)), table)  # power: the seed matters
    with pytest.raises(LiniclError, match="n_facts"):
        facts_table(17, 32)
    with pytest.raises(LiniclError, match="n_pairs"):
        facts_batch(jax.random.PRNGKey(0), 2, 0, 32, 8)


def test_token_task_binds_the_sizes_of_the_named_generator():
    from linicl.data.synthetic import facts_batch, token_task
    for task, direct in (("induction", lambda k: induction_batch(k, 2, **{"seq_len": 8, "vocab_size": 7})),
                         ("recall", lambda k: recall_batch(k, 2, n_pairs=3, vocab_size=8)),
                         ("facts", lambda k: facts_batch(k, 2, n_pairs=3, vocab_size=8, n_facts=4))):
        gen = token_task(task, vocab_size=7 if task == "induction" else 8, seq_len=8, n_pairs=3, n_facts=4)
        for got, want in zip(gen(KEY, batch=2), direct(KEY)):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(LiniclError, match="task must be one of"):
        token_task("mqar", vocab_size=8)


def test_facts_prompt_writes_the_table_out_in_key_order():
    from linicl.data.synthetic import facts_prompt, facts_table
    prompt = np.asarray(facts_prompt(5, 12))
    assert prompt.shape == (1, 10) and prompt.dtype == np.int32
    np.testing.assert_array_equal(prompt[0, 0::2], np.arange(5))
    np.testing.assert_array_equal(prompt[0, 1::2], facts_table(5, 12))
    with pytest.raises(LiniclError, match="n_facts"):
        facts_prompt(7, 12)
