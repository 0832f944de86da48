"""Multi-query associative recall (Zoology's MQAR; data: ``linicl.data.synthetic.mqar_batch``): a
training curriculum, its loss, and the evaluation of a model prompted against the same model holding
its prompt (the pairs) converted into weights.

The curriculum (``curriculum``), because the recall circuit (a token shift in the first layer, a
content match in the second) forms in a few hundred steps on a small vocabulary and not within a
thousand on the full one:

1. ``circuit``: 2 pairs and 1 query, keys and values from a ``CIRCUIT_VOCAB``-token sub-vocabulary;
2. ``vocab <V'>``: the sub-vocabulary doubled, stage by stage, until it is the whole vocabulary;
3. ``pairs``: the whole vocabulary, every step one batch per number of pairs n (``n_queries(n)``
   queries, ``queries / n_queries(n)`` sequences).

A sub-vocabulary's batch is moved into the model's vocabulary by ``widen``. Loss and accuracy count
the query keys only (``masked_metrics``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linicl import iclca, stats
from linicl.capacity.mixers import PAIRED, prompt_floats
from linicl.data.synthetic import TokenBatch, mqar_batch
from linicl.errors import LiniclError
from linicl.training import Stage

__all__ = ["CIRCUIT_VOCAB", "n_queries", "curriculum", "widen", "masked_metrics", "loss_fn", "record",
           "held_out", "accuracy", "evaluate", "compare"]

CIRCUIT_VOCAB = 16  # the first stage's sub-vocabulary: 8 keys, 8 values


def n_queries(n_pairs: int) -> int:
    """Queries per training sequence of ``n_pairs`` pairs: half of the pairs, at least 1 (more queries
    per sequence train faster; querying every pair would let the last answers be found by
    elimination)."""
    return max(1, n_pairs // 2)


def curriculum(vocab: int, *, circuit_steps: int, circuit_batch: int, vocab_steps: int, steps: int,
               train_pairs: Sequence[int], queries: int) -> list:
    """The stages (module docstring): ``circuit_steps`` steps of ``circuit_batch`` sequences of 2 pairs
    and 1 query on the first ``CIRCUIT_VOCAB`` tokens; ``vocab_steps`` steps per doubling of the
    sub-vocabulary up to ``vocab``; ``steps`` steps with a batch per number of pairs of
    ``train_pairs``. Stages of zero steps are left out."""
    if vocab < 4 or vocab % 2:
        raise LiniclError(f"vocab must be even and >= 4 (keys and values are its halves), got {vocab}")
    two = ((2, 1, circuit_batch),)
    subs = [min(CIRCUIT_VOCAB, vocab)]
    while subs[-1] < vocab:
        subs.append(min(2 * subs[-1], vocab))
    out = [Stage("circuit", circuit_steps, subs[0], two)]
    out += [Stage(f"vocab {sub}", vocab_steps, sub, two) for sub in subs[1:]]
    sizes = tuple((n, n_queries(n), max(1, queries // n_queries(n))) for n in train_pairs)
    out.append(Stage("pairs", steps, vocab, sizes))
    return [s for s in out if s.steps > 0]


def widen(batch: TokenBatch, sub_vocab: int, vocab: int) -> TokenBatch:
    """An MQAR batch drawn over ``sub_vocab`` tokens, moved into a vocabulary of ``vocab``: keys stay
    in ``[0, sub_vocab / 2)``, values (inputs and targets) go to ``[vocab / 2, vocab / 2 + sub_vocab /
    2)``. ``int32[batch, L]`` in and out; the mask is kept."""
    if sub_vocab > vocab:
        raise LiniclError(f"sub_vocab ({sub_vocab}) must be <= vocab ({vocab})")
    shift = vocab // 2 - sub_vocab // 2
    move = lambda x: jnp.where(x < sub_vocab // 2, x, x + shift)  # noqa: E731
    return TokenBatch(move(batch.inputs), move(batch.targets), batch.mask)


def masked_metrics(logits, batch: TokenBatch) -> tuple:
    """Mean cross-entropy and accuracy at the query keys: ``logits: f[batch, L, vocab]`` against
    ``batch.targets`` where ``batch.mask``; two scalars."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
    m = batch.mask.astype(jnp.float32)
    hit = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
    return (nll * m).sum() / m.sum(), (hit * m).sum() / m.sum()


def loss_fn(model, stage: Stage, vocab: int) -> Callable:
    """``loss_fn(params, key) -> (loss, acc f32[len(stage.sizes)])``: the mean cross-entropy over one
    fresh batch per size of ``stage`` (drawn from ``fold_in(key, i)``, widened into ``vocab``) and
    each batch's accuracy."""

    def fn(params, key):
        losses, accs = [], []
        for i, (n, m, b) in enumerate(stage.sizes):
            drawn = mqar_batch(jax.random.fold_in(key, i), b, n, m, stage.sub_vocab)
            batch = widen(drawn, stage.sub_vocab, vocab)
            loss, acc = masked_metrics(model.apply({"params": params}, batch.inputs), batch)
            losses.append(loss)
            accs.append(acc)
        return jnp.mean(jnp.stack(losses)), jnp.stack(accs)

    return fn


def record(stage: Stage, acc) -> dict:
    """A training chunk's history entry, MQAR's part: ``acc: f[steps, sizes]`` -> the mean accuracy
    per training number of pairs, ``{"acc": {"<n>": a}}``."""
    acc = np.asarray(acc).mean(0)
    return dict(acc={str(n): float(a) for (n, _, _), a in zip(stage.sizes, acc)})


def held_out(seed: int, batch: int, n_pairs: int, queries: int, vocab: int) -> TokenBatch:
    """Held-out sequences of ``n_pairs`` pairs and ``queries`` queries right after them, from
    ``fold_in(fold_in(PRNGKey(seed), 2), n_pairs)``: apart from training data drawn from
    ``fold_in(PRNGKey(seed), 1)`` and the same for every model."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), 2), n_pairs)
    return mqar_batch(key, batch, n_pairs, queries, vocab)


def accuracy(hit) -> dict:
    """``{"acc", "low", "high"}``: the fraction of True in ``hit`` with its 95 % Wilson interval."""
    iv = stats.wilson(int(np.sum(hit)), int(np.size(hit)))
    return dict(acc=iv.value, low=iv.low, high=iv.high)


def evaluate(model, apply: Callable, variables: dict, batch: TokenBatch, n_pairs: int) -> dict:
    """One evaluation row for a batch of ``n_pairs`` pairs then queries (NumPy ``int32[batch, L]``).

    The prompted model reads every token; a finite-state model is also converted on the pairs (the
    first ``2 * n_pairs`` tokens, ``iclca.convert``) and then reads only the queries. ``apply`` is
    ``model.apply`` (jitted by the caller, once per model). Returns ``dict(pairs, queries, correct,
    prompt_floats, prompted, hits)`` (``prompted``: ``accuracy``; ``hits``: 0/1 per query, for paired
    comparisons) and, when converted, ``converted``, ``correct_converted``, ``identical`` (same argmax
    at every query) and ``max_rel_logit_diff``.

    Raises:
      AssertionError: the converted model's predictions differ from the prompted model's.
    """
    cut = 2 * n_pairs                                           # the prompt: the pairs
    logits = np.asarray(apply(variables, batch.inputs))[:, cut:]
    mask, targets = batch.mask[:, cut:], batch.targets[:, cut:]
    pred = logits.argmax(-1)
    hit = (pred == targets)[mask]
    row = dict(pairs=n_pairs, queries=int(hit.size), correct=int(hit.sum()),
               prompt_floats=prompt_floats(model.cfg, 2 * n_pairs), prompted=accuracy(hit),
               hits=hit.astype(int).tolist())
    if model.cfg.attention != "linear":
        return row
    converted = iclca.convert(model, variables, batch.inputs[:, :cut])
    logits_c = np.asarray(apply(converted, batch.inputs[:, cut:]))
    pred_c = logits_c.argmax(-1)
    hit_c = (pred_c == targets)[mask]
    scale = float(np.abs(logits).max())
    row.update(converted=accuracy(hit_c), correct_converted=int(hit_c.sum()),
               identical=bool(np.array_equal(pred_c[mask], pred[mask])),
               max_rel_logit_diff=float(np.abs(logits_c - logits).max()) / max(scale, 1e-300))
    if not row["identical"]:
        raise AssertionError(f"{model.cfg.describe()}, {n_pairs} pairs: the converted model's predictions "
                             f"differ from the prompted model's (max relative logit difference "
                             f"{row['max_rel_logit_diff']:.3g})")
    return row


def compare(results: dict, paired: dict = PAIRED) -> list:
    """Delta-rule minus additive accuracy on the same queries, with a paired bootstrap interval (in
    points), for every pair of ``paired`` whose both mixers are in ``results`` (``{mixer: {"eval":
    [evaluate's rows]}}``); one ``dict(delta, additive, pairs, diff, low, high, significant)`` per row."""
    out = []
    for delta, additive in paired.items():
        if delta not in results or additive not in results:
            continue
        for a, b in zip(results[delta]["eval"], results[additive]["eval"]):
            iv = stats.paired_bootstrap(a["hits"], b["hits"])
            out.append(dict(delta=delta, additive=additive, pairs=a["pairs"], diff=iv.value, low=iv.low,
                            high=iv.high, significant=iv.excludes_zero()))
    return out
