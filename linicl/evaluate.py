"""Batched ICL evaluation by next-token scoring, with hooks for interventions.

Every prompt ends where the answer should start (``Q: hot\\nA:``); the model's next-token distribution
at the prompt's last token is scored against the label words:

* **classification** (``task.labels`` is a closed set of label words): the prediction is the label whose
  first token, ``label_prefix + word`` (e.g. " positive"), has the highest log-probability among the
  label tokens (label-restricted argmax, as in the ICR paper). ``check_label_words`` first makes sure
  every label word is a single, distinct token, so the restriction is exact.
* **open-ended** tasks (``labels=None``, e.g. antonym, country-capital): a prompt counts as correct when
  the *first token* of the gold answer (``label_prefix + answer``) is the argmax over the *whole
  vocabulary*. This is a **first-token accuracy**: it is an upper bound on exact-match accuracy of a
  greedy generation (the rest of a multi-token answer is not checked: " Paris" vs " Parisian" both pass
  when they share their first token), and it is the metric of the function-vector and task-vector papers.
  ``EvalResult.metric`` says which of the two was computed.

Batching and compilation (``linicl.batching``): prompts are sorted by length, cut into batches of a
fixed ``batch_size``, and right-padded to a **length bucket** (``bucket_length``); the last batch is
padded with copies of a real row. So one evaluation compiles the forward pass once per distinct bucket
(a handful, logarithmic in the prompt lengths), never per example. Right padding cannot leak into a
causal model's real tokens, and each row is read at ``lengths[b] - 1``. Batches are sharded across all
visible devices (``linicl.parallel``); on one device that is plain jit.

Hooks for methods built on this harness (task vectors, in-context routing):

* ``edits``: a list of ``(name, Edit)`` from ``linicl.interventions`` applied in every batch, after any
  edits ``variables`` already hold (their values are traced arguments: new values of the same
  structure do not recompile), or a function
  ``edits(tokens, lengths) -> [(name, Edit), ...]`` traced inside the jitted forward with the padded
  batch (e.g. ``add(name, v, positions=at_last(lengths, tokens.shape[1]))``). With ``extras`` it is
  called as ``edits(tokens, lengths, extras)``.
* ``forward(variables, tokens, lengths) -> logits[b, vocab]`` at each row's last real token replaces the
  default (``last_token_logits(model)``); ``variables`` already hold the edits. With ``extras`` a given
  ``forward`` is called as ``forward(variables, tokens, lengths, extras)`` (the default ignores them).
* ``extras``: a pytree of per-prompt arrays (axis 0 = prompt, e.g. a router's input embeddings), batched,
  padded and sharded alongside the tokens.

Pass a function defined once (not a fresh lambda per call): the compiled function is cached
(``linicl.compiled``) by the identity of ``forward`` and ``edits``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import batching, compiled
from linicl.data.datasets import Task
from linicl.data.prompts import Prompt, PromptBatch, Template, build_eval_set, check_label_words, template_for
from linicl.errors import LiniclError
from linicl.interventions import EditPlan, plan_edits
from linicl.nn.transformer import config_of, position_offset
from linicl.parallel import device_mesh


# ---------------------------------------------------------------------------------------- forward
def _logprob_fn(model, forward: Optional[Callable], edit_names: tuple, edits_fn: Optional[Callable],
                with_extras: bool):
    """jit(variables, edit values, tokens, lengths, extras) -> log-softmax at each row's last token."""
    cfg = config_of(model)
    default = batching.last_token_logits(model)

    def run(variables, edit_values, tokens, lengths, extras):
        more = (extras,) if with_extras else ()
        variables = EditPlan(edit_names, (), edits_fn).apply(variables, cfg, edit_values, tokens, lengths, *more)
        logits = default(variables, tokens, lengths) if forward is None else forward(variables, tokens, lengths, *more)
        if logits.shape != (tokens.shape[0], cfg.vocab_size):
            raise LiniclError(f"forward must return logits[{tokens.shape[0]}, {cfg.vocab_size}] at the last "
                              f"token, got {tuple(logits.shape)}")
        return jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    key = ("evaluate.logprobs", model, forward, edit_names, edits_fn, with_extras)
    return compiled.get(key, lambda: jax.jit(run))


def _check_finite(logprobs: np.ndarray) -> None:
    if not np.all(np.isfinite(logprobs)):
        bad = int(np.sum(~np.all(np.isfinite(logprobs), axis=-1)))
        raise LiniclError(f"the forward pass gave non-finite log-probabilities for {bad} row(s) (token ids "
                          f"outside the vocabulary, positions past max_len, or an edit that produces NaN/inf)")


def run_logprobs(model, variables, prompts, *, forward: Optional[Callable] = None, edits=None, extras=None,
                 batch_size: int = 16, bucket: int | str = "geometric", mesh=None,
                 progress: bool = False, desc: str = "eval", stats: Optional[dict] = None,
                 select: Optional[Callable[[np.ndarray], Any]] = None) -> list:
    """Next-token log-probabilities at each prompt's last token, ``[vocab]`` per prompt in input order
    (or ``select(logprobs[B, vocab])`` per batch, split per row, to keep only what is needed). The
    machinery behind ``label_logprobs`` and ``evaluate``; ``stats`` (a dict) receives
    ``seconds``, ``n_tokens`` (real) and ``n_padded_tokens`` (computed)."""
    cfg = config_of(model)
    rows = batching.as_rows(prompts)
    batching.check_room(rows, cfg, position_offset(variables))
    batching.check_extras(extras, len(rows))
    plan = plan_edits(edits, cfg)
    fn = _logprob_fn(model, forward, plan.names, plan.fn, extras is not None)
    mesh = device_mesh() if mesh is None else mesh
    n_padded, start = 0, time.perf_counter()

    def run(rep, tokens, lengths, ex):
        nonlocal n_padded
        n_padded += tokens.size
        return fn(rep[0], rep[1], tokens, lengths, ex)

    def checked(parts):
        for idx, res in parts:
            _check_finite(res)
            yield idx, (res if select is None else select(res))
    parts = batching.map_rows(run, (variables, plan.values), rows, cfg=cfg, batch_size=batch_size,
                              bucket=bucket, extras=extras, mesh=mesh, progress=progress, desc=desc)
    out = batching.gather(checked(parts), len(rows))
    if stats is not None:
        stats.update(seconds=time.perf_counter() - start, n_tokens=int(sum(len(r) for r in rows)),
                     n_padded_tokens=int(n_padded))
    return out


def label_logprobs(model, variables, batch: PromptBatch, *, forward: Optional[Callable] = None, edits=None,
                   extras=None, batch_size: Optional[int] = None, bucket: int | str = "geometric",
                   mesh=None) -> np.ndarray:
    """``[b, vocab]`` log-softmax of the next-token logits at each row's last real token
    (``batch.lengths - 1``), float32 (float64 for a float64 model). One jitted forward per
    ``batch_size`` rows (default: the whole batch), the length padded to a bucket (``bucket_length``):
    the result does not depend on the padding. ``forward``, ``edits``, ``extras``: module docstring."""
    if not isinstance(batch, PromptBatch):
        raise LiniclError(f"label_logprobs expects a PromptBatch (linicl.data.batch_prompts), got "
                          f"{type(batch).__name__}")
    n = len(batch.lengths)
    out = run_logprobs(model, variables, batch, forward=forward, edits=edits, extras=extras,
                       batch_size=n if batch_size is None else batch_size, bucket=bucket, mesh=mesh)
    return np.stack(out)


# ---------------------------------------------------------------------------------------- evaluation
@dataclass(frozen=True, eq=False)
class EvalResult:
    """One evaluation. ``metric`` is ``"label"`` (label-restricted argmax over ``label_words``) or
    ``"first_token"`` (the gold answer's first token is the argmax over the whole vocabulary).

    Per prompt (input order): ``predictions`` (predicted label word, or the decoded predicted token),
    ``labels`` (gold label word / answer), ``correct``, ``pred_ids`` / ``gold_ids`` (token ids),
    ``gold_logprob`` (log-probability of the gold (first) token over the whole vocabulary) and, for
    classification, ``label_scores[n, n_labels]`` (log-probabilities of the label tokens)."""
    task: str
    k: Optional[int]
    seed: Optional[int]
    metric: str
    accuracy: float
    n: int
    predictions: tuple
    labels: tuple
    correct: np.ndarray
    pred_ids: np.ndarray
    gold_ids: np.ndarray
    gold_logprob: np.ndarray
    label_words: Optional[tuple] = None
    label_ids: Optional[np.ndarray] = None
    label_scores: Optional[np.ndarray] = field(default=None, repr=False)
    seconds: float = 0.0
    n_tokens: int = 0
    n_padded_tokens: int = 0

    @property
    def chance(self) -> Optional[float]:
        """1 / number of labels (classification), else None."""
        return None if self.label_words is None else 1.0 / len(self.label_words)

    @property
    def majority(self) -> Optional[float]:
        """Share of the most frequent gold label (what always answering it would score)."""
        if self.label_words is None:
            return None
        return max(self.labels.count(w) for w in self.label_words) / self.n

    @property
    def tokens_per_s(self) -> float:
        """Real prompt tokens per second of forward passes (compilation included)."""
        return self.n_tokens / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> dict:
        """The scalars, JSON-ready."""
        return dict(task=self.task, k=self.k, seed=self.seed, metric=self.metric, accuracy=self.accuracy,
                    n=self.n, chance=self.chance, majority=self.majority,
                    mean_gold_logprob=float(np.mean(self.gold_logprob)), seconds=self.seconds,
                    n_tokens=self.n_tokens, n_padded_tokens=self.n_padded_tokens,
                    tokens_per_s=self.tokens_per_s)

    def to_dict(self) -> dict:
        """Every number, JSON-ready (per-example lists included)."""
        return dict(self.summary(), predictions=list(self.predictions), labels=list(self.labels),
                    correct=self.correct.tolist(), pred_ids=self.pred_ids.tolist(),
                    gold_ids=self.gold_ids.tolist(), gold_logprob=self.gold_logprob.tolist(),
                    label_words=None if self.label_words is None else list(self.label_words),
                    label_ids=None if self.label_ids is None else self.label_ids.tolist())


def _first_token(tokenizer, text: str) -> int:
    ids = list(tokenizer.encode(text))
    if not ids:
        raise LiniclError(f"the answer {text!r} encodes to no tokens")
    return int(ids[0])


def evaluate_prompts(model, variables, tokenizer, prompts: Sequence[Prompt], *,
                     labels: Optional[Sequence[str]] = None, label_prefix: str = " ", task: str = "",
                     k: Optional[int] = None, seed: Optional[int] = None, batch_size: int = 16,
                     bucket: int | str = "geometric", edits=None, forward: Optional[Callable] = None,
                     extras=None, mesh=None, progress: bool = True) -> EvalResult:
    """Score ready-made prompts (each with its gold ``Prompt.label``): label-restricted accuracy over
    ``labels`` when given, else first-token accuracy over the whole vocabulary (module docstring)."""
    prompts = list(prompts)
    if not prompts:
        raise LiniclError("evaluate: no prompts")
    gold_words = tuple(p.label for p in prompts)
    stats: dict = {}
    common = dict(forward=forward, edits=edits, extras=extras, batch_size=batch_size, bucket=bucket,
                  mesh=mesh, progress=progress, desc=task or "eval", stats=stats)
    if labels is not None:
        labels = tuple(labels)
        label_ids = check_label_words(labels, tokenizer, prefix=label_prefix)
        unknown = sorted(set(gold_words) - set(labels))
        if unknown:
            raise LiniclError(f"evaluate: gold labels {unknown} are not among the label words {list(labels)}")
        gold_idx = np.asarray([labels.index(w) for w in gold_words], np.int32)
        gold_ids = label_ids[gold_idx]
        rows = run_logprobs(model, variables, prompts, select=lambda lp: lp[:, label_ids], **common)
        scores = np.stack(rows)
        pick = np.argmax(scores, axis=-1)
        pred_ids = label_ids[pick]
        predictions = tuple(labels[i] for i in pick)
        gold_lp = scores[np.arange(len(prompts)), gold_idx]
        metric = "label"
    else:
        gold_ids = np.asarray([_first_token(tokenizer, label_prefix + w) for w in gold_words], np.int32)
        rows = run_logprobs(model, variables, prompts, select=lambda lp: lp, **common)
        lp = np.stack(rows)
        pred_ids = np.argmax(lp, axis=-1).astype(np.int32)
        predictions = tuple(tokenizer.decode([int(i)]) for i in pred_ids)
        gold_lp = lp[np.arange(len(prompts)), gold_ids]
        scores, label_ids, metric = None, None, "first_token"
    correct = pred_ids == gold_ids
    return EvalResult(task=task, k=k, seed=seed, metric=metric, accuracy=float(np.mean(correct)),
                      n=len(prompts), predictions=predictions, labels=gold_words, correct=correct,
                      pred_ids=np.asarray(pred_ids, np.int32), gold_ids=np.asarray(gold_ids, np.int32),
                      gold_logprob=np.asarray(gold_lp), label_words=labels, label_ids=label_ids,
                      label_scores=scores, seconds=stats["seconds"], n_tokens=stats["n_tokens"],
                      n_padded_tokens=stats["n_padded_tokens"])


def evaluate(model, variables, tokenizer, task: Task, *, k: int, seed: int = 0, n_eval: Optional[int] = None,
             batch_size: int = 16, template: Optional[Template] = None, edits=None,
             forward: Optional[Callable] = None, extras=None, bucket: int | str = "geometric",
             add_bos: Optional[bool] = None, same_demos: bool = False, mesh=None,
             progress: bool = True) -> EvalResult:
    """k-shot accuracy of a model on a task (k=0: zero-shot), deterministic in ``seed``.

    The prompts are ``build_eval_set(task, tokenizer, k=k, seed=seed, n_eval=n_eval, template=...)``:
    ``n_eval`` seeded test queries (all when None), each with its own ``k`` class-balanced
    demonstrations from ``task.train``. Classification tasks are scored by label-restricted argmax over
    ``task.labels`` (each must be one token with ``template.label_prefix``; a clear error otherwise),
    open-ended tasks by first-token accuracy (module docstring). ``edits``, ``forward``, ``extras``
    (one row per evaluated prompt, in the order of ``build_eval_set``): module docstring.
    """
    template = template_for(task) if template is None else template
    if task.labels is not None:  # fail before building the prompts
        check_label_words(task.labels, tokenizer, prefix=template.label_prefix)
    prompts = build_eval_set(task, tokenizer, k=k, seed=seed, n_eval=n_eval, template=template,
                             same_demos=same_demos, add_bos=add_bos)
    return evaluate_prompts(model, variables, tokenizer, prompts, labels=task.labels,
                            label_prefix=template.label_prefix, task=task.name, k=k, seed=seed,
                            batch_size=batch_size, bucket=bucket, edits=edits, forward=forward,
                            extras=extras, mesh=mesh, progress=progress)


__all__ = ["EvalResult", "evaluate", "evaluate_prompts", "label_logprobs", "run_logprobs"]
