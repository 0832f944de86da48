"""Synthetic in-context tasks as pure functions of a PRNG key (jit- and vmap-able).

The token generators return a ``TokenBatch`` of next-token training data: the model reads ``inputs``
and is trained to predict ``targets`` at every position; ``mask`` marks the positions that can be
predicted *from the context* (the in-context accuracy is the accuracy there).

* ``induction_batch``: the repeated random sequence of iclca.md section 8. A sequence of ``seq_len``
  tokens is ``h = seq_len / 2`` uniform random tokens followed by the same ``h`` tokens again;
  ``inputs = seq[:-1]``, ``targets = seq[1:]``. At input position t >= h the current token is
  ``seq[t - h]`` and the target is ``seq[t - h + 1]``, the token that followed its first occurrence:
  an induction head predicts it. Those positions are the mask (``h - 1`` of them). The first repeated
  token ``seq[h]`` (the target at t = h - 1) has no cue in the context and is not masked.
* ``recall_batch``: associative recall. ``n_pairs`` key-value pairs ``k_1 v_1 ... k_n v_n`` then a
  query key ``q = k_j``; the answer is ``v_j``. Keys are distinct tokens of ``[0, vocab_size // 2)``,
  values uniform tokens of ``[vocab_size // 2, vocab_size)``, so the answer is unique.
* ``mqar_batch``: multi-query associative recall (Zoology's MQAR, Arora et al. arXiv 2312.04927).
  ``n_pairs`` key-value pairs, then ``n_queries`` of their keys, each followed by its value (the
  model predicts the value at every query key). Keys and values as in ``recall_batch``.
* ``facts_batch``: keys from a fixed table of facts shared by every sequence, each followed by its
  value (``facts_table``; ``facts_prompt`` writes the whole table out as one prompt).
* ``token_task``: the generator of a task by name (``linicl.names.TOKEN_TASKS``) with its sizes bound.
* ``regression_batch``: in-context linear regression (Garg et al. arXiv 2208.01066), a continuous task:
  per sequence a weight vector w ~ N(0, I) and ``n_examples`` pairs (x_i, y_i = w . x_i + noise), as a
  ``RegressionBatch``; ``regression_embeds`` lays them out as the continuous tokens x_1, y_1, x_2,
  y_2, ... that a model reads as ``embeds`` (it predicts y_i at the x_i token).

Sizes are static Python ints: validate them eagerly (``LiniclError`` naming the argument), then trace.
Under ``jax.jit`` pass them as static arguments (``functools.partial`` or ``static_argnames``); under
``jax.vmap`` map over the key only::

    gen = jax.jit(functools.partial(induction_batch, batch=32, seq_len=64, vocab_size=64))
    b = gen(jax.random.PRNGKey(0))                           # inputs int32[32, 63]
    bs = jax.vmap(gen)(jax.random.split(key, 4))             # inputs int32[4, 32, 63]
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from linicl.errors import LiniclError
from linicl.names import TOKEN_TASKS

__all__ = ["TokenBatch", "RegressionBatch", "induction_batch", "recall_batch", "facts_batch", "facts_table",
           "facts_prompt", "token_task", "mqar_batch", "induction_mask",
           "regression_batch", "regression_embeds"]


class TokenBatch(NamedTuple):
    """Next-token data. ``inputs``, ``targets``: ``int32[batch, L]``; ``mask``: ``bool[batch, L]``, True
    where the target is predictable from the context (the in-context positions)."""

    inputs: jax.Array
    targets: jax.Array
    mask: jax.Array


class RegressionBatch(NamedTuple):
    """In-context linear regression tasks. ``xs``: ``f32[batch, n, d_x]``; ``ys``: ``f32[batch, n]``;
    ``w``: ``f32[batch, d_x]``, the weights each sequence's ``ys`` come from."""

    xs: jax.Array
    ys: jax.Array
    w: jax.Array


def _size(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise LiniclError(f"{name} must be a Python int (a static size), got {type(value).__name__} "
                          f"{value!r}; under jit pass it as a static argument")
    if value < minimum:
        raise LiniclError(f"{name} must be at least {minimum}, got {value}")
    return value


def induction_mask(seq_len: int) -> jax.Array:
    """``bool[seq_len - 1]``: the input positions t >= seq_len / 2 of an induction sequence, whose
    target is predictable by induction (see the module docstring)."""
    _size("seq_len", seq_len, 4)
    if seq_len % 2:
        raise LiniclError(f"seq_len must be even (two copies of seq_len / 2 tokens), got {seq_len}")
    return jnp.arange(seq_len - 1) >= seq_len // 2


def induction_batch(key: jax.Array, batch: int, seq_len: int, vocab_size: int,
                    distinct: bool = False) -> TokenBatch:
    """The repeated-random-sequence induction task.

    Args:
      key: a PRNG key (``jax.random.PRNGKey`` or ``jax.random.key``).
      batch: number of sequences, >= 1.
      seq_len: length T of each full sequence, even and >= 4: T/2 random tokens, then the same again.
      vocab_size: tokens are drawn from ``[0, vocab_size)``, >= 2.
      distinct: draw the T/2 tokens of a sequence without replacement (needs T/2 <= vocab_size), so
        that every in-context target is unambiguous; by default they are i.i.d. uniform, and a token
        that occurs twice in the first half has two candidate successors.
    Returns:
      ``TokenBatch`` with ``inputs = seq[:, :-1]``, ``targets = seq[:, 1:]`` (``int32[batch, T - 1]``)
      and ``mask`` (``bool[batch, T - 1]``): True at input positions t >= T/2.
    Raises:
      LiniclError: a size that is not a Python int, too small, odd ``seq_len``, or ``distinct`` with
        ``seq_len / 2 > vocab_size``.
    """
    _size("batch", batch, 1)
    induction_mask(seq_len)
    _size("vocab_size", vocab_size, 2)
    if distinct and seq_len // 2 > vocab_size:
        raise LiniclError(f"distinct=True draws seq_len / 2 = {seq_len // 2} different tokens, more "
                          f"than vocab_size = {vocab_size}")
    return _induction(key, batch, seq_len, vocab_size, bool(distinct))


# The generators proper, jitted with static sizes: an eager call compiles once per size instead of
# once per operation; inside an outer jit they are inlined.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _induction(key, batch: int, seq_len: int, vocab_size: int, distinct: bool) -> TokenBatch:
    half = seq_len // 2
    if distinct:
        first = _first_of_permutation(key, batch, vocab_size, half)
    else:
        first = jax.random.randint(key, (batch, half), 0, vocab_size, dtype=jnp.int32)
    seq = jnp.concatenate([first, first], axis=1)
    mask = jnp.arange(seq_len - 1) >= half
    return TokenBatch(seq[:, :-1], seq[:, 1:], jnp.broadcast_to(mask, (batch, seq_len - 1)))


def recall_batch(key: jax.Array, batch: int, n_pairs: int, vocab_size: int) -> TokenBatch:
    """Associative recall: ``k_1 v_1 ... k_n v_n q`` with ``q = k_j`` for a uniform j; predict ``v_j``.

    Args:
      key: a PRNG key.
      batch: number of sequences, >= 1.
      n_pairs: key-value pairs per sequence, >= 1 and <= vocab_size // 2 (keys are distinct).
      vocab_size: keys come from ``[0, vocab_size // 2)``, values from ``[vocab_size // 2,
        vocab_size)``; >= 4.
    Returns:
      ``TokenBatch`` of length ``L = 2 * n_pairs + 1``: ``inputs`` the whole sequence
      (``int32[batch, L]``); ``targets[:, t] = inputs[:, t + 1]`` for t < L - 1 and the answer
      ``v_j`` at the last (query) position; ``mask`` True at the query position only. The answer is
      ``targets[:, -1]``; which pair was queried is ``argmax(inputs[:, 0:-1:2] == inputs[:, -1:])``.
    Raises:
      LiniclError: a size that is not a Python int or too small, or ``n_pairs > vocab_size // 2``.
    """
    _check_pairs(batch, n_pairs, vocab_size)
    return _recall(key, batch, n_pairs, vocab_size)


def _check_pairs(batch, n_pairs, vocab_size) -> None:
    """The sizes shared by the recall tasks: distinct keys from [0, vocab_size // 2)."""
    _size("batch", batch, 1)
    _size("n_pairs", n_pairs, 1)
    _size("vocab_size", vocab_size, 4)
    if n_pairs > vocab_size // 2:
        raise LiniclError(f"n_pairs = {n_pairs} distinct keys do not fit in the key vocabulary "
                          f"[0, vocab_size // 2 = {vocab_size // 2})")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _recall(key, batch: int, n_pairs: int, vocab_size: int) -> TokenBatch:
    n_keys = vocab_size // 2
    k_key, k_val, k_query = jax.random.split(key, 3)
    keys = _first_of_permutation(k_key, batch, n_keys, n_pairs)
    values = jax.random.randint(k_val, (batch, n_pairs), n_keys, vocab_size, dtype=jnp.int32)
    j = jax.random.randint(k_query, (batch,), 0, n_pairs)
    query = jnp.take_along_axis(keys, j[:, None], axis=1)
    answer = jnp.take_along_axis(values, j[:, None], axis=1)
    pairs = jnp.stack([keys, values], axis=-1).reshape(batch, 2 * n_pairs)
    inputs = jnp.concatenate([pairs, query], axis=1)
    targets = jnp.concatenate([pairs[:, 1:], query, answer], axis=1)
    L = 2 * n_pairs + 1
    mask = jnp.broadcast_to(jnp.arange(L) == L - 1, (batch, L))
    return TokenBatch(inputs, targets, mask)


def facts_table(n_facts: int, vocab_size: int, table_seed: int = 0) -> jax.Array:
    """The fixed facts of ``facts_batch``: ``int32[n_facts]``, the value of key k = 0 .. n_facts - 1,
    drawn from ``[vocab_size // 2, vocab_size)`` by ``table_seed`` alone (the same for every batch)."""
    _size("vocab_size", vocab_size, 4)
    _size("n_facts", n_facts, 1)
    if n_facts > vocab_size // 2:
        raise LiniclError(f"n_facts = {n_facts} keys do not fit in the key vocabulary [0, vocab_size // 2 = "
                          f"{vocab_size // 2})")
    return jax.random.randint(jax.random.PRNGKey(table_seed), (n_facts,), vocab_size // 2, vocab_size,
                              dtype=jnp.int32)


def facts_batch(key: jax.Array, batch: int, n_pairs: int, vocab_size: int, n_facts: int,
                table_seed: int = 0) -> TokenBatch:
    """Shared facts: ``k_1 f(k_1) k_2 f(k_2) ... k_n f(k_n)`` with the keys drawn uniformly, with
    replacement, from a fixed table of ``n_facts`` facts ``f`` (``facts_table``: the same in every
    sequence and batch). A value is predictable from the sequence itself only when its key occurred
    earlier in it; otherwise only what persists across sequences can supply it (the weights, or a
    trained initial state such as ICLCA's bias terms): the task where a persistent state has something
    to store.

    Args:
      key: a PRNG key (draws the keys only).
      batch: number of sequences, >= 1.
      n_pairs: key-value pairs per sequence, >= 1.
      vocab_size: keys from ``[0, n_facts)``, values from ``[vocab_size // 2, vocab_size)``; >= 4.
      n_facts: the table's size, >= 1 and <= vocab_size // 2.
      table_seed: the table's seed.
    Returns:
      ``TokenBatch`` of length ``2 * n_pairs - 1``: ``inputs = seq[:, :-1]``, ``targets = seq[:, 1:]``,
      ``mask`` True at the keys (input positions 0, 2, 4, ...), whose target is their fact.
    Raises:
      LiniclError: a size that is not a Python int, too small, or ``n_facts > vocab_size // 2``.
    """
    _size("batch", batch, 1)
    _size("n_pairs", n_pairs, 1)
    table = facts_table(n_facts, vocab_size, table_seed)
    keys = jax.random.randint(key, (batch, n_pairs), 0, n_facts, dtype=jnp.int32)
    seq = jnp.stack([keys, table[keys]], axis=-1).reshape(batch, 2 * n_pairs)
    L = 2 * n_pairs - 1
    mask = jnp.broadcast_to(jnp.arange(L) % 2 == 0, (batch, L))
    return TokenBatch(seq[:, :-1], seq[:, 1:], mask)


def facts_prompt(n_facts: int, vocab_size: int, table_seed: int = 0) -> jax.Array:
    """``int32[1, 2 * n_facts]``: every fact of ``facts_table`` written out in key order, ``0 f(0) 1 f(1)
    ... (n_facts - 1) f(n_facts - 1)``, the one prompt that holds the whole table (what a converted
    prompt, ``iclca.convert``, can store in place of training)."""
    table = facts_table(n_facts, vocab_size, table_seed)
    return jnp.stack([jnp.arange(n_facts, dtype=jnp.int32), table], axis=-1).reshape(1, -1)


def token_task(task: str, *, vocab_size: int, seq_len: int = 4, n_pairs: int = 1, n_facts: int = 1,
               distinct: bool = False) -> Callable:
    """The generator of a next-token task by name, with its sizes bound: ``(key, batch) -> TokenBatch``.

    The sizes a task does not read are ignored; they are checked when the generator is called
    (``LiniclError``).

    Args:
      task: one of ``linicl.names.TOKEN_TASKS``: ``"induction"`` (``induction_batch``, reads
        ``seq_len`` and ``distinct``), ``"recall"`` (``recall_batch``, reads ``n_pairs``) or ``"facts"``
        (``facts_batch``, reads ``n_pairs`` and ``n_facts``).
      vocab_size: the vocabulary size.
      seq_len: ``induction_batch``'s sequence length.
      n_pairs: the pairs per sequence (recall, facts).
      n_facts: the size of the shared facts table (facts).
      distinct: ``induction_batch``'s ``distinct``.
    Returns:
      ``functools.partial`` of the generator: call it as ``gen(key, batch=B)``; jit- and vmap-able
      over the key with ``batch`` bound (``functools.partial(gen, batch=B)``).
    Raises:
      LiniclError: an unknown ``task``.
    """
    if task == "induction":
        return functools.partial(induction_batch, seq_len=seq_len, vocab_size=vocab_size, distinct=distinct)
    if task == "facts":
        return functools.partial(facts_batch, n_pairs=n_pairs, vocab_size=vocab_size, n_facts=n_facts)
    if task == "recall":
        return functools.partial(recall_batch, n_pairs=n_pairs, vocab_size=vocab_size)
    raise LiniclError(f"task must be one of {TOKEN_TASKS}, got {task!r}")


def mqar_batch(key: jax.Array, batch: int, n_pairs: int, n_queries: int, vocab_size: int,
               seq_len=None) -> TokenBatch:
    """Multi-query associative recall (MQAR; Zoology, Arora et al. arXiv 2312.04927).

    The full sequence is ``k_1 v_1 ... k_n v_n`` (the prompt: ``2 * n_pairs`` tokens, distinct keys)
    followed by a query region in which ``n_queries`` different keys of the pairs, in random order,
    each appear once followed by their value: ``q_1 a_1 q_2 a_2 ...``; the model must predict
    ``a_j`` when it reads ``q_j``. ``inputs = seq[:-1]``, ``targets = seq[1:]``, ``mask`` True at the
    query keys.

    Layout (where this departs from Zoology): the value follows its query in the input, so the data
    is plain next-token data and every query is answered from the pairs, never from an earlier query
    (queries are distinct keys). With ``seq_len=None`` the queries come right after the pairs, ``L =
    2 * n_pairs + 2 * n_queries - 1``. With ``seq_len`` the region is padded to that input length:
    it is cut into two-token slots, the queries take ``n_queries`` uniformly random slots (in slot
    order) and every other token is a filler drawn from the *value* half of the vocabulary. Zoology
    instead spaces the queries by power-law gaps and fills with any token; a filler key would write a
    conflicting pair into a recurrent state, which our filler never does. With ``seq_len = 2 *
    n_pairs + 2 * n_queries - 1`` both layouts give the same batch for the same key.

    Args:
      key: a PRNG key.
      batch: number of sequences, >= 1.
      n_pairs: key-value pairs, >= 1 and <= vocab_size // 2 (keys are distinct).
      n_queries: queried keys per sequence, >= 1 and <= n_pairs (each pair is queried at most once).
      vocab_size: keys come from ``[0, vocab_size // 2)``, values (and fillers) from ``[vocab_size //
        2, vocab_size)``; >= 4.
      seq_len: None (compact), or the input length L >= 2 * n_pairs + 2 * n_queries - 1.
    Returns:
      ``TokenBatch`` with ``inputs``, ``targets``: ``int32[batch, L]`` and ``mask``: ``bool[batch,
      L]``, exactly ``n_queries`` True per row, all at positions >= 2 * n_pairs. The prompt is
      ``inputs[:, :2 * n_pairs]``; what follows it is ``inputs[:, 2 * n_pairs:]``.
    Raises:
      LiniclError: a size that is not a Python int or too small, ``n_pairs > vocab_size // 2``,
        ``n_queries > n_pairs``, or a ``seq_len`` too short for the pairs and the queries.
    """
    _check_pairs(batch, n_pairs, vocab_size)
    _size("n_queries", n_queries, 1)
    if n_queries > n_pairs:
        raise LiniclError(f"n_queries = {n_queries} must be <= n_pairs = {n_pairs}: each pair is "
                          f"queried at most once")
    shortest = 2 * n_pairs + 2 * n_queries - 1
    seq_len = shortest if seq_len is None else _size("seq_len", seq_len, shortest)
    return _mqar(key, batch, n_pairs, n_queries, vocab_size, seq_len)


def _first_of_permutation(key, batch: int, n: int, k: int) -> jax.Array:
    """``int32[batch, k]``: the first k entries of a uniformly random permutation of range(n) per row
    (k distinct indices, in random order)."""
    return jnp.argsort(jax.random.uniform(key, (batch, n)), axis=-1)[:, :k].astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _mqar(key, batch: int, n_pairs: int, n_queries: int, vocab_size: int, seq_len: int) -> TokenBatch:
    n_keys = vocab_size // 2
    k_key, k_val, k_query, k_slot, k_fill = jax.random.split(key, 5)
    keys = _first_of_permutation(k_key, batch, n_keys, n_pairs)
    values = jax.random.randint(k_val, (batch, n_pairs), n_keys, vocab_size, dtype=jnp.int32)
    which = _first_of_permutation(k_query, batch, n_pairs, n_queries)      # the queried pairs
    queries = jnp.take_along_axis(keys, which, axis=1)
    answers = jnp.take_along_axis(values, which, axis=1)
    region = seq_len + 1 - 2 * n_pairs                    # tokens after the pairs, incl. the last target
    # Sorted slots: with as many slots as queries they are 0, 1, ..., the compact layout.
    slots = jnp.sort(_first_of_permutation(k_slot, batch, region // 2, n_queries), axis=-1)
    rows = jnp.arange(batch)[:, None]
    tail = jax.random.randint(k_fill, (batch, region), n_keys, vocab_size, dtype=jnp.int32)
    tail = tail.at[rows, 2 * slots].set(queries).at[rows, 2 * slots + 1].set(answers)
    is_query = jnp.zeros((batch, region), bool).at[rows, 2 * slots].set(True)
    pairs = jnp.stack([keys, values], axis=-1).reshape(batch, 2 * n_pairs)
    seq = jnp.concatenate([pairs, tail], axis=1)         # [batch, seq_len + 1]
    mask = jnp.concatenate([jnp.zeros((batch, 2 * n_pairs), bool), is_query], axis=1)[:, :-1]
    return TokenBatch(seq[:, :-1], seq[:, 1:], mask)


def regression_batch(key: jax.Array, batch: int, n_examples: int, d_x: int, noise=0.0) -> RegressionBatch:
    """In-context linear regression (Garg et al. arXiv 2208.01066): one linear function per sequence.

    x_i ~ N(0, I_{d_x}) and w ~ N(0, I_{d_x}) independently per sequence, y_i = w . x_i + noise * e_i
    with e_i ~ N(0, 1). With ``noise=0`` every y_i is exactly w . x_i (a function of the pairs before
    it once i > d_x: least squares recovers w), and E[y^2] = d_x.

    Args:
      key: a PRNG key.
      batch: number of sequences (tasks), >= 1.
      n_examples: (x, y) pairs per sequence, >= 1.
      d_x: input dimension, >= 1.
      noise: the standard deviation of the label noise, >= 0 (a float; under jit it may be traced).
    Returns:
      ``RegressionBatch(xs: f32[batch, n_examples, d_x], ys: f32[batch, n_examples], w: f32[batch,
      d_x])``.
    Raises:
      LiniclError: a size that is not a Python int or too small, or a negative or non-finite ``noise``
        (checked when it is a Python number).
    """
    _size("batch", batch, 1)
    _size("n_examples", n_examples, 1)
    _size("d_x", d_x, 1)
    if isinstance(noise, (int, float)) and not 0 <= noise < float("inf"):
        raise LiniclError(f"noise must be a finite standard deviation >= 0, got {noise}")
    return _regression(key, batch, n_examples, d_x, noise)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _regression(key, batch: int, n_examples: int, d_x: int, noise) -> RegressionBatch:
    k_x, k_w, k_e = jax.random.split(key, 3)
    f32 = jnp.float32  # explicit: with jax_enable_x64 the default float would be float64
    xs = jax.random.normal(k_x, (batch, n_examples, d_x), f32)
    w = jax.random.normal(k_w, (batch, d_x), f32)
    ys = jnp.einsum("bnd,bd->bn", xs, w) + jnp.asarray(noise, f32) * jax.random.normal(k_e, (batch, n_examples), f32)
    return RegressionBatch(xs, ys, w)


def regression_embeds(xs, ys) -> jax.Array:
    """The continuous tokens of in-context regression: x_1, y_1, x_2, y_2, ... (Garg et al.).

    An x-token is ``[x_i, 0]`` and a y-token ``[0, ..., 0, y_i]`` (d_x + 1 features: the last one says
    "label"). A causal model predicts y_i at the x_i token, position ``2 * (i - 1)``, from the i - 1
    pairs before it and x_i; its predictions are its outputs at positions ``0, 2, 4, ...``. The first
    ``2 * k`` tokens are a prompt of k pairs.

    Args:
      xs: ``f[batch, n, d_x]``.
      ys: ``f[batch, n]``.
    Returns:
      ``f[batch, 2 * n, d_x + 1]`` in the dtype of ``xs`` and ``ys`` together (NumPy or JAX input).
    Raises:
      LiniclError: ``xs`` not 3-dimensional, or ``ys`` not ``[batch, n]`` of the same batch and n.
    """
    if getattr(xs, "ndim", None) != 3:
        raise LiniclError(f"xs must be f[batch, n, d_x], got shape {getattr(xs, 'shape', type(xs).__name__)}")
    if getattr(ys, "shape", None) != xs.shape[:2]:
        raise LiniclError(f"ys must be f[batch, n] = {tuple(xs.shape[:2])} (one label per x), got shape "
                          f"{getattr(ys, 'shape', type(ys).__name__)}")
    return _embeds(xs, ys)


@jax.jit
def _embeds(xs, ys) -> jax.Array:
    dt = jnp.result_type(xs, ys)
    x_tok = jnp.concatenate([xs, jnp.zeros(ys.shape + (1,), dt)], axis=-1)
    y_tok = jnp.concatenate([jnp.zeros(xs.shape, dt), ys[..., None]], axis=-1)
    batch, n, d = x_tok.shape
    return jnp.stack([x_tok, y_tok], axis=2).reshape(batch, 2 * n, d).astype(dt)
