"""Batched ICL evaluation by next-token scoring, with hooks for interventions.

Every prompt ends where the answer should start (``Q: hot\\nA:``); the model's next-token distribution
at the prompt's last token is scored against the label words:

* **classification** (``task.labels`` is a closed set of label words): the prediction is the label whose
  first token, ``label_prefix + word`` (e.g. " positive"), has the highest log-probability among the
  label tokens (label-restricted argmax, as in the ICR paper). ``check_label_words`` first makes sure
  every label word is a single, distinct token, so the restriction is exact.
* **open-ended** tasks (``labels=None``, e.g. antonym, country-capital) are scored on the answer itself,
  never on a token every answer may share (SmolLM2 spells " 5" as [" ", "5"]: a first-token metric
  would give any model that emits a space 100 %):

  - ``"exact_match"`` (default): greedy decoding until the line break that ends an answer (or EOS, or
    ``max_new_tokens``), then the normalised answer (``normalise_answer``: case, white space and
    surrounding punctuation ignored) must equal the gold one;
  - ``"first_content_token"`` (one forward pass, cheaper): the gold answer's blank prefix, if any, is
    fed, and its first *content* token must be the argmax over the whole vocabulary (an upper bound
    on exact match: " Paris" and " Parisian" share it).

Every ``EvalResult`` carries n, a 95 % Wilson interval, the number of distinct predictions and their
entropy, and flags a constant predictor (``EvalResult.constant``); classification adds the majority
rate and the balanced accuracy. ``linicl.stats`` compares methods on the same queries.

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

import string
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
from linicl.generation import generate
from linicl.interventions import EditPlan, plan_edits
from linicl.names import OPEN_METRICS
from linicl.stats import Interval, wilson
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
    machinery behind ``label_logprobs`` and ``evaluate``; ``stats`` (a dict) has ``seconds``,
    ``n_tokens`` (real) and ``n_padded_tokens`` (computed) added to it."""
    cfg = config_of(model)
    rows = batching.as_rows(prompts)
    batching.check_vocab(rows, cfg.vocab_size)
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
        for key, value in (("seconds", time.perf_counter() - start), ("n_tokens", sum(len(r) for r in rows)),
                           ("n_padded_tokens", n_padded)):
            stats[key] = stats.get(key, 0) + value
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
    """One evaluation. ``metric`` (``linicl.names.EVAL_METRICS``): ``"label"`` (label-restricted argmax
    over ``label_words``), ``"exact_match"`` (the greedy answer, normalised, equals the gold answer)
    or ``"first_content_token"`` (the gold answer's first non-blank token is the argmax after its
    blank prefix).

    Per prompt (input order): ``predictions`` (predicted label word, generated answer, or decoded
    predicted token), ``labels`` (gold label word / answer), ``correct``, ``pred_ids`` / ``gold_ids``
    (the scored token: the label's, or the first content token's; -1 for exact match, which scores
    text), ``gold_logprob`` (log-probability of that gold token over the whole vocabulary; NaN for
    exact match) and, for classification, ``label_scores[n, n_labels]``.

    Beside the accuracy: its 95 % Wilson ``interval``, how many ``distinct`` predictions the model made
    and their ``entropy`` (bits; 0 for a ``constant`` predictor), and for classification the
    ``majority`` class rate and the ``balanced_accuracy`` (mean recall over the gold classes), which a
    constant predictor cannot lift above 1 / classes."""
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
    def interval(self) -> Interval:
        """The accuracy with its 95 % Wilson interval."""
        return wilson(int(np.sum(self.correct)), self.n)

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
    def balanced_accuracy(self) -> Optional[float]:
        """Mean over the gold classes present of the share of that class predicted right."""
        if self.label_words is None:
            return None
        gold = np.asarray(self.labels, dtype=object)
        return float(np.mean([np.mean(self.correct[gold == w]) for w in sorted(set(self.labels))]))

    @property
    def distinct(self) -> int:
        """How many different predictions the model made."""
        return len(set(self.predictions))

    @property
    def entropy(self) -> float:
        """Entropy (bits) of the empirical distribution of the predictions."""
        _, counts = np.unique(np.asarray(self.predictions, dtype=object).astype(str), return_counts=True)
        p = counts / counts.sum()
        return float(-np.sum(p * np.log2(p)) + 0.0)

    @property
    def constant(self) -> bool:
        """The same prediction for every query (n > 1): the accuracy then only measures how often
        that one answer is gold, whatever the prompt says."""
        return self.n > 1 and self.distinct == 1

    @property
    def tokens_per_s(self) -> float:
        """Real prompt tokens per second of forward passes (compilation included)."""
        return self.n_tokens / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> dict:
        """The scalars, JSON-ready."""
        iv = self.interval
        return dict(task=self.task, k=self.k, seed=self.seed, metric=self.metric, accuracy=self.accuracy,
                    ci_low=iv.low, ci_high=iv.high, n=self.n, chance=self.chance, majority=self.majority,
                    balanced_accuracy=self.balanced_accuracy, distinct=self.distinct, entropy=self.entropy,
                    constant=self.constant, mean_gold_logprob=float(np.mean(self.gold_logprob)),
                    seconds=self.seconds, n_tokens=self.n_tokens, n_padded_tokens=self.n_padded_tokens,
                    tokens_per_s=self.tokens_per_s)

    def to_dict(self) -> dict:
        """Every number, JSON-ready (per-example lists included; NaN as None)."""
        lp = [None if not np.isfinite(x) else float(x) for x in self.gold_logprob]
        out = dict(self.summary(), predictions=list(self.predictions), labels=list(self.labels),
                   correct=self.correct.tolist(), pred_ids=self.pred_ids.tolist(),
                   gold_ids=self.gold_ids.tolist(), gold_logprob=lp,
                   label_words=None if self.label_words is None else list(self.label_words),
                   label_ids=None if self.label_ids is None else self.label_ids.tolist())
        if not np.isfinite(out["mean_gold_logprob"]):
            out["mean_gold_logprob"] = None
        return out

    def describe(self) -> str:
        """One line: ``"sst2 k=4: 62.5 [45.1, 77.3] % (label, n=32; CONSTANT predictor)"``."""
        flag = "; CONSTANT predictor" if self.constant else f"; {self.distinct} distinct predictions"
        extra = "" if self.label_words is None else f", balanced {100 * self.balanced_accuracy:.1f} %"
        return (f"{self.task} k={self.k}: {self.interval.fmt()} % ({self.metric}, n={self.n}{extra}{flag})")


# ---------------------------------------------------------------------------------------- open answers
def normalise_answer(text: str) -> str:
    """The form answers are compared in: lower case, whitespace collapsed, surrounding whitespace
    and punctuation stripped (``" Paris."`` -> ``"paris"``)."""
    return " ".join(text.split()).lower().strip(string.punctuation + " ")


def first_content_index(tokenizer, ids: Sequence[int]) -> int:
    """Index of the first token of ``ids`` that decodes to something other than white space. A
    tokenizer may spell " 5" as [" ", "5"]: the first token of every such answer is the same blank,
    so only the first *content* token tells answers apart."""
    for j, i in enumerate(ids):
        if tokenizer.decode([int(i)]).strip():
            return j
    raise LiniclError(f"the answer {tokenizer.decode([int(i) for i in ids])!r} has no content token")


def _answer_ids(tokenizer, text: str) -> list:
    from linicl.data.prompts import _encode  # an answer continues the prompt: no BOS of its own
    ids = _encode(tokenizer, text)
    if not ids:
        raise LiniclError(f"the answer {text!r} encodes to no tokens")
    return ids


def _end_of_answer(text: str) -> int:
    """Where a generated answer ends: at its first line break (every template ends an answer there)."""
    cut = text.find("\n")
    return len(text) if cut < 0 else cut


def _answer_done(tokenizer, ids: list, eos) -> bool:
    """Whether a greedy answer has ended: at EOS or once its text holds a line break."""
    return ids[-1] == eos or "\n" in tokenizer.decode(ids)


def _rerun_greedy(model, variables, tokenizer, rows: list, max_new: int, common: dict) -> list:
    """Greedy ids per row by re-running every row's whole prefix at each new token (any hook applies)."""
    eos = getattr(tokenizer, "eos_id", None)
    out = [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(max_new):
        if all(done):
            break
        step = dict(common, progress=False)
        picks = run_logprobs(model, variables, [np.concatenate([r, np.asarray(o, np.int32)]) for r, o in zip(rows, out)],
                             select=lambda a: np.argmax(a, axis=-1), **step)
        for i, t in enumerate(picks):
            if not done[i]:
                out[i].append(int(t))
                done[i] = _answer_done(tokenizer, out[i], eos)
    return out


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def _decode_steps(model, variables, n: int, max_new: int) -> int:
    """``max_new`` rounded up to a multiple of 8 where the positions allow it: the decode loop then
    compiles for a few lengths across tasks (the extra tokens are dropped)."""
    steps = -(-max_new // 8) * 8
    room = config_of(model).max_len - int(position_offset(variables)) - n + 1
    return steps if steps <= room else max_new


def _cached_greedy(model, variables, tokenizer, rows: list, max_new: int, common: dict) -> list:
    """Greedy ids per row from ``linicl.generate`` (one prefill, then one cached step per token).

    The decode cache and the position counters are one per batch, so rows are grouped by their exact
    length; each group is cut into batches of ``batch_size`` rows, and a smaller batch is filled with
    copies of a real row up to the next power of two (at most ``log2(batch_size) + 1`` batch shapes to
    compile, and a group of one prompt, common with many demonstrations, costs one row, not
    ``batch_size``). Each row's ids are then cut where ``_rerun_greedy`` would have stopped (EOS or a
    line break)."""
    eos = getattr(tokenizer, "eos_id", None)
    size, stats = common.get("batch_size", 16), common.get("stats")
    groups: dict = {}
    for i, r in enumerate(rows):
        groups.setdefault(len(r), []).append(i)
    out, start, padded = [None] * len(rows), time.perf_counter(), 0
    for n, idx in groups.items():
        for lo in range(0, len(idx), size):
            part = idx[lo:lo + size]
            tokens = batching.pad_rows(np.stack([rows[i] for i in part]), min(size, _pow2(len(part))))
            ids = np.asarray(generate(model, variables, tokens, _decode_steps(model, variables, n, max_new)))
            padded += tokens.size
            for j, i in enumerate(part):
                out[i] = []
                for t in ids[j, :max_new]:
                    out[i].append(int(t))
                    if _answer_done(tokenizer, out[i], eos):
                        break
    if stats is not None:
        for key, value in (("seconds", time.perf_counter() - start), ("n_tokens", sum(len(r) for r in rows)),
                           ("n_padded_tokens", padded)):
            stats[key] = stats.get(key, 0) + value
    return out


def greedy_answers(model, variables, tokenizer, rows: list, *, max_new: int, common: dict,
                   cache: bool = True) -> list:
    """Greedy continuations of every row (``int32[n_i]`` tokens) until a line break, the tokenizer's
    EOS or ``max_new`` tokens: the decoded answers, cut at the line break.

    With ``cache`` (default) and no ``forward``, ``edits`` or ``extras`` hook in ``common``, each row is
    read once and continued with the decode cache (``linicl.generate``; rows grouped by length): one
    prefix pass per row instead of one per new token. Otherwise (``cache=False``, or a hook, whose
    meaning on a one-token decode step is not defined: an edit placed at the last token would edit
    every generated token for good) each step is one ``run_logprobs`` pass over every row with its
    answer so far appended, so any hook applies unchanged: edits placed at the last token act on each
    step's last token. The two paths pick the same tokens up to rounding of the logits (tested equal).

    Refused up front, the same for both paths: ``max_new`` that is not an int >= 1 (a bool too; the
    cached path would blame ``generate``'s ``n_new``, the re-run path return empty answers) and a
    ``common["batch_size"]`` that is not an int >= 1."""
    if isinstance(max_new, (bool, np.bool_)) or not isinstance(max_new, (int, np.integer)) or max_new < 1:
        raise LiniclError(f"greedy_answers: max_new must be a positive int (new tokens per answer), got {max_new!r}")
    max_new = int(max_new)
    common = dict(common, batch_size=batching.check_batch_size(common.get("batch_size", 16)))
    hooked = any(common.get(k) is not None for k in ("forward", "edits", "extras"))
    run = _cached_greedy if cache and not hooked else _rerun_greedy
    eos = getattr(tokenizer, "eos_id", None)
    texts = []
    for ids in run(model, variables, tokenizer, rows, max_new, common):
        ids = [i for i in ids if i != eos]
        text = tokenizer.decode(ids)
        texts.append(text[:_end_of_answer(text)])
    return texts


def _score_labels(model, variables, tokenizer, prompts, gold_words, labels, label_prefix, common):
    label_ids = check_label_words(labels, tokenizer, prefix=label_prefix)
    unknown = sorted(set(gold_words) - set(labels))
    if unknown:
        raise LiniclError(f"evaluate: gold labels {unknown} are not among the label words {list(labels)}")
    gold_idx = np.asarray([labels.index(w) for w in gold_words], np.int32)
    scores = np.stack(run_logprobs(model, variables, prompts, select=lambda lp: lp[:, label_ids], **common))
    pick = np.argmax(scores, axis=-1)
    return dict(metric="label", predictions=tuple(labels[i] for i in pick), pred_ids=label_ids[pick],
                gold_ids=label_ids[gold_idx], gold_logprob=scores[np.arange(len(prompts)), gold_idx],
                label_words=labels, label_ids=label_ids, label_scores=scores)


def first_content_targets(tokenizer, prompts, gold_words: Sequence[str], label_prefix: str = ""):
    """Next-token targets that tell answers apart: ``(rows, gold_ids)`` with ``rows[i]: int32[n_i]``
    the prompt's tokens followed by its gold answer's blank prefix (teacher-forced) and
    ``gold_ids: int32[N]`` the answer's first content token (``first_content_index``), which the
    model should predict after ``rows[i]``. Prompts are ``linicl.data.Prompt`` or token arrays. For
    scoring and for training on answers a tokenizer may start with a shared blank (" 5" -> [" ", "5"])."""
    if len(prompts) != len(gold_words):
        raise LiniclError(f"first_content_targets: {len(prompts)} prompts but {len(gold_words)} gold_words")
    golds = [_answer_ids(tokenizer, label_prefix + w) for w in gold_words]
    cut = [first_content_index(tokenizer, g) for g in golds]
    rows = [np.concatenate([np.asarray(getattr(p, "tokens", p), np.int32), np.asarray(g[:j], np.int32)])
            for p, g, j in zip(prompts, golds, cut)]
    return rows, np.asarray([g[j] for g, j in zip(golds, cut)], np.int32)


def _score_first_content(model, variables, tokenizer, prompts, gold_words, label_prefix, common):
    """Teacher-force each gold answer's blank prefix, then score its first content token."""
    rows, gold_ids = first_content_targets(tokenizer, prompts, gold_words, label_prefix)
    lp = np.stack(run_logprobs(model, variables, rows, select=lambda a: a, **common))
    pred_ids = np.argmax(lp, axis=-1).astype(np.int32)
    return dict(metric="first_content_token", predictions=tuple(tokenizer.decode([int(i)]) for i in pred_ids),
                pred_ids=pred_ids, gold_ids=gold_ids, gold_logprob=lp[np.arange(len(rows)), gold_ids])


def _score_exact_match(model, variables, tokenizer, prompts, gold_words, label_prefix, max_new, common):
    if max_new is None:  # room for the longest gold answer and its line break
        max_new = max(len(_answer_ids(tokenizer, label_prefix + w)) for w in gold_words) + 2
    texts = greedy_answers(model, variables, tokenizer, [np.asarray(p.tokens, np.int32) for p in prompts],
                           max_new=max_new, common=common)
    n = len(prompts)
    return dict(metric="exact_match", predictions=tuple(texts), pred_ids=np.full(n, -1, np.int32),
                gold_ids=np.full(n, -1, np.int32), gold_logprob=np.full(n, np.nan),
                correct=np.asarray([normalise_answer(t) == normalise_answer(w) for t, w in zip(texts, gold_words)]))


def evaluate_prompts(model, variables, tokenizer, prompts: Sequence[Prompt], *,
                     labels: Optional[Sequence[str]] = None, label_prefix: str = " ", task: str = "",
                     k: Optional[int] = None, seed: Optional[int] = None, batch_size: int = 16,
                     bucket: int | str = "geometric", edits=None, forward: Optional[Callable] = None,
                     extras=None, mesh=None, progress: bool = True, open_metric: str = "exact_match",
                     max_new_tokens: Optional[int] = None) -> EvalResult:
    """Score ready-made prompts (each with its gold ``Prompt.label``): label-restricted accuracy over
    ``labels`` when given; else ``open_metric``: ``"exact_match"`` of the greedy answer (up to
    ``max_new_tokens``, default: the longest gold answer's tokens + 2) or the cheaper
    ``"first_content_token"`` (module docstring)."""
    prompts = list(prompts)
    if not prompts:
        raise LiniclError("evaluate: no prompts")
    if labels is None and open_metric not in OPEN_METRICS:
        raise LiniclError(f"open_metric must be one of {OPEN_METRICS}, got {open_metric!r}")
    gold_words = tuple(p.label for p in prompts)
    counts: dict = {}
    common = dict(forward=forward, edits=edits, extras=extras, batch_size=batch_size, bucket=bucket,
                  mesh=mesh, progress=progress, desc=task or "eval", stats=counts)
    start = time.perf_counter()
    if labels is not None:
        scored = _score_labels(model, variables, tokenizer, prompts, gold_words, tuple(labels), label_prefix, common)
    elif open_metric == "first_content_token":
        scored = _score_first_content(model, variables, tokenizer, prompts, gold_words, label_prefix, common)
    else:
        scored = _score_exact_match(model, variables, tokenizer, prompts, gold_words, label_prefix,
                                    max_new_tokens, common)
    correct = scored.pop("correct", None)
    if correct is None:
        correct = scored["pred_ids"] == scored["gold_ids"]
    n_tokens = int(sum(len(p.tokens) for p in prompts))
    return EvalResult(task=task, k=k, seed=seed, accuracy=float(np.mean(correct)), n=len(prompts),
                      labels=gold_words, correct=np.asarray(correct, bool), seconds=time.perf_counter() - start,
                      n_tokens=n_tokens, n_padded_tokens=counts.get("n_padded_tokens", 0), **scored)


def evaluate(model, variables, tokenizer, task: Task, *, k: int, seed: int = 0, n_eval: Optional[int] = None,
             batch_size: int = 16, template: Optional[Template] = None, edits=None,
             forward: Optional[Callable] = None, extras=None, bucket: int | str = "geometric",
             add_bos: Optional[bool] = None, same_demos: bool = False, mesh=None,
             progress: bool = True, open_metric: str = "exact_match",
             max_new_tokens: Optional[int] = None) -> EvalResult:
    """k-shot accuracy of a model on a task (k=0: zero-shot), deterministic in ``seed``.

    The prompts are ``build_eval_set(task, tokenizer, k=k, seed=seed, n_eval=n_eval, template=...)``:
    ``n_eval`` seeded test queries (all when None), each with its own ``k`` class-balanced
    demonstrations from ``task.train``. Classification tasks are scored by label-restricted argmax over
    ``task.labels`` (each must be one token with ``template.label_prefix``; a clear error otherwise),
    open-ended tasks by ``open_metric`` (module docstring). ``edits``, ``forward``, ``extras`` (one row
    per evaluated prompt, in the order of ``build_eval_set``): module docstring.
    """
    template = template_for(task) if template is None else template
    if task.labels is not None:  # fail before building the prompts
        check_label_words(task.labels, tokenizer, prefix=template.label_prefix)
    prompts = build_eval_set(task, tokenizer, k=k, seed=seed, n_eval=n_eval, template=template,
                             same_demos=same_demos, add_bos=add_bos)
    return evaluate_prompts(model, variables, tokenizer, prompts, labels=task.labels,
                            label_prefix=template.label_prefix, task=task.name, k=k, seed=seed,
                            batch_size=batch_size, bucket=bucket, edits=edits, forward=forward,
                            extras=extras, mesh=mesh, progress=progress, open_metric=open_metric,
                            max_new_tokens=max_new_tokens)


__all__ = ["EvalResult", "evaluate", "evaluate_prompts", "label_logprobs", "run_logprobs", "greedy_answers",
           "normalise_answer", "first_content_index", "first_content_targets"]
