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

Batching and compilation: prompts are sorted by length, cut into batches of a fixed ``batch_size``, and
right-padded to a **length bucket** (``bucket_length``: by default the smallest of 16, 24, 32, 48, 64,
96, ... that holds the batch's longest prompt; or a multiple of an int ``bucket``; capped at the model's
``max_len``); the last batch is padded with copies of a real row. So one evaluation compiles the forward
pass once per distinct bucket (a handful, logarithmic in the prompt lengths), never per example. Right
padding cannot leak into a causal model's real tokens, and each row is read at ``lengths[b] - 1``.
Batches are sharded across all visible devices (``linicl.parallel``); on one device that is plain jit.

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

Pass a function defined once (not a fresh lambda per call): the compiled function is cached by the
identity of ``forward`` and ``edits``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from linicl.data.datasets import Task
from linicl.data.prompts import Prompt, PromptBatch, Template, build_eval_set, check_label_words, template_for
from linicl.errors import LiniclError, SequenceTooLongError
from linicl.interventions import check_names, full_name, with_edits
from linicl.nn.hooks import INTERVENTIONS, Edit
from linicl.nn.transformer import config_of, position_offset
from linicl.parallel import device_mesh, pad_rows, replicate, round_up, run_sharded

# ---------------------------------------------------------------------------------------- forward


@functools.lru_cache(maxsize=None)
def last_token_logits(model) -> Callable:
    """The default ``forward(variables, tokens, lengths) -> logits[b, vocab]``: the final hidden state at
    each row's last real token, unembedded. Only b rows go through the unembedding (not b * T), which
    saves a large share of a small LM's compute (SmolLM2: 28M of its 135M parameters)."""
    cfg = config_of(model)

    def forward(variables, tokens, lengths):
        h = model.apply(variables, tokens, hidden=True)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        params = variables["params"]
        if cfg.tie_embeddings:
            return last @ params["embed"].T
        return last @ params["unembed"]["kernel"]
    return forward


def _split_edits(edits, cfg):
    """``(names, Edit values, edits function)`` from the ``edits`` argument (checked eagerly when static)."""
    if edits is None:
        return (), (), None
    if callable(edits):
        return (), (), edits
    pairs = list(edits)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], Edit)):
            raise LiniclError(f"edits must be (name, Edit) pairs from linicl.interventions (or a function "
                              f"returning them), got {pair!r:.80}")
    names = tuple(full_name(n) for n, _ in pairs)
    check_names(cfg, names, "edits")
    return names, tuple(e for _, e in pairs), None


def _merged(a: Any, b: Any) -> Any:
    """Two ``interventions`` trees joined; at a site present in both, ``a``'s edits apply first."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return tuple(a) + tuple(b)
    out = dict(a)
    for key, value in b.items():
        out[key] = _merged(out[key], value) if key in out else value
    return out


def apply_edits(variables, edits, cfg):
    """``variables`` with ``edits`` added after any edits they already hold (``with_edits`` would
    replace those), so an evaluation's edits compose with a pre-edited model."""
    edited = with_edits(variables, edits, cfg)
    if INTERVENTIONS not in variables:
        return edited
    return {**edited, INTERVENTIONS: _merged(variables[INTERVENTIONS], edited[INTERVENTIONS])}


@functools.lru_cache(maxsize=128)
def _logprob_fn(model, forward: Optional[Callable], edit_names: tuple, edits_fn: Optional[Callable],
                with_extras: bool):
    cfg = config_of(model)

    def run(variables, edit_values, tokens, lengths, extras):
        more = (extras,) if with_extras else ()
        edits = list(zip(edit_names, edit_values))
        if edits_fn is not None:
            edits += list(edits_fn(tokens, lengths, *more))
        if edits:
            variables = apply_edits(variables, edits, cfg)
        if forward is None:
            logits = last_token_logits(model)(variables, tokens, lengths)
        else:
            logits = forward(variables, tokens, lengths, *more)
        if logits.shape != (tokens.shape[0], cfg.vocab_size):
            raise LiniclError(f"forward must return logits[{tokens.shape[0]}, {cfg.vocab_size}] at the last "
                              f"token, got {tuple(logits.shape)}")
        return jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    return jax.jit(run)


# ---------------------------------------------------------------------------------------- batching
def _as_rows(prompts) -> list:
    """Token arrays int32[n_i] from Prompts, token arrays, a PromptBatch or an iterable of PromptBatch."""
    if isinstance(prompts, PromptBatch):
        prompts = [prompts]
    rows = []
    for item in prompts:
        if isinstance(item, PromptBatch):
            rows += [np.asarray(item.tokens[b, :item.lengths[b]], np.int32) for b in range(len(item.lengths))]
        else:
            rows.append(np.asarray(getattr(item, "tokens", item), np.int32))
    if not rows:
        raise LiniclError("no prompts to run")
    if any(r.ndim != 1 or len(r) == 0 for r in rows):
        raise LiniclError("every prompt must be a non-empty 1-D token array")
    return rows


def bucket_length(n: int, bucket: int | str = "geometric", max_len: Optional[int] = None) -> int:
    """The padded length of a batch whose longest prompt has ``n`` tokens.

    ``bucket="geometric"`` (the default): the smallest of 16, 24, 32, 48, 64, 96, ... (16 * 2^i and
    24 * 2^i) that holds ``n``: at most 50 % padding and only two shapes per doubling of the length, so
    an evaluation over prompts of 10 to 1,000 tokens compiles about 12 times, not once per multiple.
    An int: ``n`` rounded up to a multiple of it. Never past ``max_len`` (learned positions end there)
    unless ``n`` itself is longer (the model then raises its own clear error)."""
    if isinstance(bucket, str):
        if bucket != "geometric":
            raise LiniclError(f"bucket must be 'geometric' or an int >= 1, got {bucket!r}")
        size = 16
        while size < n:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    elif isinstance(bucket, bool) or not isinstance(bucket, (int, np.integer)) or bucket < 1:
        raise LiniclError(f"bucket must be 'geometric' or an int >= 1, got {bucket!r}")
    else:
        size = round_up(n, bucket)
    return max(n, size if max_len is None else min(size, max_len))


def _batches(rows: list, cfg, batch_size: int, bucket, mesh, progress: bool, desc: str,
             extras: Any = None) -> Iterator:
    """``(row indices, tokens int32[B, T], lengths int32[B], extras)`` per batch; B is fixed (batch_size
    rounded up to the device count, or fewer when there are fewer prompts), T a length bucket."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise LiniclError(f"batch_size must be an int >= 1, got {batch_size!r}")
    n = len(rows)
    B = round_up(min(int(batch_size), n), mesh.size)
    lengths = np.asarray([len(r) for r in rows], np.int32)
    order = np.argsort(-lengths, kind="stable")  # longest first: a batch that does not fit fails early
    chunks = [order[i:i + B] for i in range(0, n, B)]
    for idx in tqdm(chunks, desc=desc, disable=not progress, leave=False):
        T = bucket_length(int(lengths[idx].max()), bucket, cfg.max_len)
        tokens = np.zeros((len(idx), T), np.int32)  # id 0 exists in every vocabulary
        for j, i in enumerate(idx):
            tokens[j, :lengths[i]] = rows[i]
        ex = None if extras is None else jax.tree_util.tree_map(lambda x: pad_rows(np.asarray(x)[idx], B), extras)
        yield idx, pad_rows(tokens, B), pad_rows(lengths[idx], B), ex


def _check_lengths(rows: list, cfg, variables) -> None:
    """Refuse prompts past a learned-positions model's last position before tracing: under jit the model
    would return NaN for them, which an argmax turns into a silently wrong prediction."""
    if cfg.positions != "learned":
        return
    room = cfg.max_len - position_offset(variables)
    longest = max(len(r) for r in rows)
    if longest > room:
        raise SequenceTooLongError(f"the longest prompt has {longest} tokens but this model's learned positions "
                                   f"hold {room} (max_len={cfg.max_len}); use fewer demonstrations or shorter "
                                   f"inputs")


def _check_finite(logprobs: np.ndarray) -> None:
    if not np.all(np.isfinite(logprobs)):
        bad = int(np.sum(~np.all(np.isfinite(logprobs), axis=-1)))
        raise LiniclError(f"the forward pass gave non-finite log-probabilities for {bad} row(s) (token ids "
                          f"outside the vocabulary, positions past max_len, or an edit that produces NaN/inf)")


def _check_extras(extras, n: int):
    if extras is None:
        return
    for leaf in jax.tree_util.tree_leaves(extras):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != n:
            raise LiniclError(f"extras: every array needs axis 0 of size {n} (one row per prompt), got "
                              f"shape {np.shape(leaf)}")


def run_logprobs(model, variables, prompts, *, forward: Optional[Callable] = None, edits=None, extras=None,
                 batch_size: int = 16, bucket: int | str = "geometric", mesh=None,
                 progress: bool = False, desc: str = "eval", stats: Optional[dict] = None,
                 select: Optional[Callable[[np.ndarray], Any]] = None) -> list:
    """Next-token log-probabilities at each prompt's last token, ``[vocab]`` per prompt in input order
    (or ``select(logprobs[B, vocab])`` per batch, split per row, to keep only what is needed). The
    machinery behind ``label_logprobs`` and ``evaluate``; ``stats`` (a dict) receives
    ``seconds``, ``n_tokens`` (real) and ``n_padded_tokens`` (computed)."""
    cfg = config_of(model)
    mesh = device_mesh() if mesh is None else mesh
    rows = _as_rows(prompts)
    _check_lengths(rows, cfg, variables)
    _check_extras(extras, len(rows))
    edit_names, edit_values, edits_fn = _split_edits(edits, cfg)
    fn = _logprob_fn(model, forward, edit_names, edits_fn, extras is not None)
    replicated = (replicate(variables, mesh), replicate(edit_values, mesh))
    out: list = [None] * len(rows)
    n_padded, start = 0, time.perf_counter()
    for idx, tokens, lengths, ex in _batches(rows, cfg, batch_size, bucket, mesh, progress, desc, extras):
        res = run_sharded(lambda rep, t, le, e: fn(rep[0], rep[1], t, le, e), replicated,
                          [tokens, lengths, ex], mesh)
        n_padded += tokens.size
        _check_finite(res)
        res = res if select is None else select(res)
        for j, i in enumerate(idx):
            out[i] = jax.tree_util.tree_map(lambda x: x[j], res)
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


__all__ = ["EvalResult", "evaluate", "evaluate_prompts", "label_logprobs", "run_logprobs",
           "last_token_logits", "bucket_length", "apply_edits"]
