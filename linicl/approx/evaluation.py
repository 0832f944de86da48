"""How much of a demonstration prompt survives approximate conversion, on a task's test queries.

For each demo count k, ONE k-shot class-balanced prompt is built (``linicl.data.build_eval_set(...,
same_demos=True)``: every test query gets the same k demos) and stored by each method (a converter of
``linicl.approx.variants.converters``); the converted model then reads each test query alone, its
positions continuing at the prompt's length n. Beside them, ``"zero"`` (the plain model on the query
alone) and ``"prompt"`` (demos + query: the reference). Every method is scored on the same queries by
``linicl.fidelity.method_scores`` (accuracy, agreement with and KL to the prompted model, per-layer
error of the attention output ``hook_z`` at the query's tokens).

Scoring as ``linicl.evaluate`` does: label-restricted argmax over the label words' single tokens
(classification); for open-ended tasks the gold answer's first content token, its blank prefix (if the
tokenizer spells " 5" as [" ", "5"]) appended to every row the query is read in, the argmax over the
whole vocabulary at the new last position.

Compilation: every pass is padded to a length bucket and a fixed batch (``query_window``), so a method
compiles once per bucket; the query-only passes of the converted models share one width per (task, k).
"""

from __future__ import annotations

import sys
import time
from typing import Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np

from linicl import activations, batching, data, iclca
from linicl.errors import LiniclError
from linicl.evaluate import first_content_targets
from linicl.fidelity import method_scores, predict
from linicl.memory import prompt_floats
from linicl.names import PROMPT_APPROX, block_site

__all__ = ["BASE", "query_window", "TaskTargets", "task_targets", "evaluate_task", "correctness", "layer_error_summary"]

# The methods every (task, k) cell has besides the converters: the plain model on the query alone and
# the prompted model (the reference).
BASE = ("zero", "prompt")


def query_window(model, variables, rows: Sequence, start: int, width: int, *, batch_size: int = 8,
                 bucket="geometric") -> tuple:
    """``(lp f32[N, vocab], z f32[layers, N, width, heads * d_head])``: the log-probabilities at each
    token row's last token and every layer's attention output ``hook_z`` at positions ``start .. start
    + width - 1`` (``linicl.activations.logprobs_and_window``)."""
    names = [block_site(layer, "hook_z") for layer in range(model.cfg.n_layers)]
    return activations.logprobs_and_window(model, variables, rows, names, start, width, batch_size=batch_size,
                                           bucket=bucket)


class TaskTargets(NamedTuple):
    """What a task's test queries are read as and scored against."""

    prompts: list             # the zero-shot prompts (``data.build_eval_set(..., k=0)``)
    metric: str               # "label" or "first_content_token"
    label_ids: Optional[np.ndarray]  # int[labels], the label words' tokens; None for an open-ended task
    gold_ids: np.ndarray      # int[N], the token each query must predict
    blanks: list              # per query, the gold answer's blank prefix int[b_i] (usually empty)
    kl_ids: Optional[np.ndarray]  # the restricted KL's tokens: the label words, or the >= 2 distinct gold ids
    queries: list             # per query, its tokens followed by its blank prefix


def task_targets(task, tokenizer, *, n_eval: Optional[int], seed: int = 0,
                 add_bos: Optional[bool] = None) -> TaskTargets:
    """The ``TaskTargets`` of ``n_eval`` seeded test queries of ``task`` (``data.build_eval_set``'s
    ``n_eval``, ``seed``, ``add_bos``). Raises LiniclError when the label words are not single tokens
    of ``tokenizer`` (checked first)."""
    template = data.template_for(task)
    label_ids = (None if task.labels is None
                 else data.check_label_words(task.labels, tokenizer, prefix=template.label_prefix))
    zero_prompts = data.build_eval_set(task, tokenizer, k=0, seed=seed, n_eval=n_eval, add_bos=add_bos)
    if label_ids is None:
        rows, gold_ids = first_content_targets(tokenizer, zero_prompts, [p.label for p in zero_prompts],
                                               template.label_prefix)
        blanks = [r[len(p.tokens):] for r, p in zip(rows, zero_prompts)]  # the answers' blank prefixes
        cand = np.unique(gold_ids)
        kl_ids = cand if len(cand) >= 2 else None
    else:
        gold_ids = label_ids[np.asarray([task.labels.index(p.label) for p in zero_prompts])]
        blanks = [np.zeros(0, np.int32)] * len(zero_prompts)
        kl_ids = label_ids
    # every row a query is read in ends with its gold answer's blank prefix (usually none)
    queries = [np.concatenate([p.tokens[p.query_start:], b]) for p, b in zip(zero_prompts, blanks)]
    return TaskTargets(zero_prompts, "first_content_token" if label_ids is None else "label", label_ids, gold_ids,
                       blanks, kl_ids, queries)


def _with_blanks(prompts, blanks) -> list:
    """Each prompt's tokens followed by its gold answer's blank prefix."""
    return [np.concatenate([p.tokens, b]) for p, b in zip(prompts, blanks)]


def _stored(conv) -> int:
    """Floats the converted prompt stores: every float of its prompt collections except the seeded
    random projections (re-drawn from the seed); a selection's kept entries without their padding
    (``iclca.stored_floats``: each KV head's own entries)."""
    layers = conv[PROMPT_APPROX].values()
    if any(a["attn"]["approx"].sink_pos is not None and a["attn"]["approx"].sink_pos.ndim == 3 for a in layers):
        return sum(iclca.stored_floats(conv).values())
    return prompt_floats(conv, projections=False)


def _cell(model, variables, tokenizer, task, methods: Mapping, t: TaskTargets, zero: tuple, k: int, *,
          n_eval, seed, add_bos, fit_queries, width, window: dict, bar, skipped: list) -> Optional[dict]:
    """One (task, k) cell: every method scored against the prompted model; None when the k-shot
    prompts cannot be built or read (recorded in ``skipped``)."""
    name, qlens = task.name, np.asarray([len(q) for q in t.queries], np.int32)
    cell: dict = {"methods": {}, "timing": {}}
    try:
        prompts = data.build_eval_set(task, tokenizer, k=k, seed=seed, n_eval=n_eval, same_demos=True,
                                      add_bos=add_bos)
        n, ctx, q_k = data.shared_context(prompts)
        q_k = [np.concatenate([q, b]) for q, b in zip(q_k, t.blanks)]
        if any(not np.array_equal(a, b) for a, b in zip(q_k, t.queries)):
            raise LiniclError("the query tokens differ between the zero-shot and the k-shot prompts")
        if model.cfg.positions == "learned" and n + width > model.cfg.max_len:
            raise LiniclError(f"prompt ({n}) + query width ({width}) exceed the learned positions "
                              f"(max_len={model.cfg.max_len})")
        t0 = time.perf_counter()
        lp_p, z_p = query_window(model, variables, _with_blanks(prompts, t.blanks), n, width, **window)
        cell["timing"]["prompt_eval_s"] = time.perf_counter() - t0
    except LiniclError as e:
        skipped.append(dict(task=name, k=k, method="all", reason=str(e)))
        return None
    ref = dict(lp=lp_p, z=z_p, pred=predict(lp_p, t.label_ids))
    cfg = model.cfg
    # every layer's full cache (a local layer's too): the prompt as the prompted model holds it
    cell.update(prompt_len=int(n), demos=[dict(input=d.input, output=d.output) for d in prompts[0].demos],
                kv_cache_floats=int(2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * n))
    score = lambda lp, z, r: method_scores(lp, z, r, t.gold_ids, t.label_ids, t.kl_ids, qlens)  # noqa: E731
    cell["methods"]["prompt"] = score(lp_p, z_p, None)
    cell["methods"]["zero"] = score(*zero, ref)
    fit = None
    if any(fits for _, fits in methods.values()):
        fit = data.fit_queries(task, tokenizer, data.template_for(task), set(prompts[0].demos), fit_queries,
                               int(np.median(qlens)), seed)
        cell["fit_inputs_shape"] = None if fit is None else list(fit.shape)
    for i, (method, (convert, _)) in enumerate(methods.items()):
        if bar is not None:
            bar.set_postfix_str(f"{name} k={k}: {method} ({i + 1}/{len(methods)})")
        try:
            t0 = time.perf_counter()
            conv = convert(ctx, fit)
            jax.block_until_ready(conv[PROMPT_APPROX])
            t1 = time.perf_counter()
            lp, z = query_window(model, conv, t.queries, 0, width, **window)
            t2 = time.perf_counter()
        except LiniclError as e:
            skipped.append(dict(task=name, k=k, method=method, reason=str(e)))
            continue
        m = score(lp, z, ref)
        m.update(convert_s=t1 - t0, eval_s=t2 - t1, state_floats=_stored(conv))
        cell["methods"][method] = m
        del conv, z
    return cell


def evaluate_task(model, variables, tokenizer, task, methods: Mapping[str, tuple], *, ks: Sequence[int],
                  n_eval: Optional[int], seed: int = 0, add_bos: Optional[bool] = None, fit_queries: int = 16,
                  batch_size: int = 8, bucket="geometric", bar=None) -> tuple:
    """Score the zero-shot model, the prompted model and every converter of ``methods`` on ``n_eval``
    seeded test queries of ``task``, for each demo count of ``ks`` (module docstring).

    Args:
      model: a softmax ``linicl.Transformer``.
      variables: its variables (no prompt stored).
      tokenizer: the model's tokenizer.
      task: a ``linicl.data`` task.
      methods: ``{name: (convert, fit)}`` (``variants.converters``): ``convert(prompt int32[n],
        fit_inputs)`` returns the variables holding the prompt; ``fit``: it needs ``fit_inputs``, then
        up to ``fit_queries`` query rows of one length from the task's demo pool
        (``data.fit_queries``, never the test queries; None when there are none). A converter that
        raises LiniclError is skipped.
      ks: the demo counts.
      n_eval: ``data.build_eval_set``'s.
      seed: ``data.build_eval_set``'s; it also draws the demos and fit queries.
      add_bos: ``data.build_eval_set``'s.
      batch_size: ``query_window``'s.
      bucket: ``query_window``'s.
      bar: a tqdm bar (or None), advanced by one per k; while it is enabled a line per finished k is
        written.
    Returns:
      ``(entry, skipped)``: ``entry`` = ``dict(metric, labels, n, query_len, width, kl_label_set,
      gold_ids, k, zero_eval_s)`` with ``k = {"<k>": cell}``, a cell holding ``methods`` ({name:
      ``method_scores`` + ``convert_s``, ``eval_s``, ``state_floats`` for a converter}), ``timing``,
      ``prompt_len``, ``demos``, ``kv_cache_floats`` and, with a fitting method, ``fit_inputs_shape``;
      ``skipped``: ``dict(task, k, method, reason)`` per skipped (k, method) (``method="all"``: the
      whole k).
    Raises:
      LiniclError: the task cannot be scored with this tokenizer (``task_targets``).
    """
    from tqdm.auto import tqdm

    t = task_targets(task, tokenizer, n_eval=n_eval, seed=seed, add_bos=add_bos)
    qlens = np.asarray([len(q) for q in t.queries], np.int32)
    width = batching.bucket_length(int(qlens.max()), "geometric")
    entry = dict(metric=t.metric, labels=None if task.labels is None else list(task.labels), n=len(t.queries),
                 query_len=dict(min=int(qlens.min()), max=int(qlens.max()), mean=float(qlens.mean())),
                 width=width, kl_label_set=None if t.kl_ids is None else [int(i) for i in t.kl_ids],
                 gold_ids=t.gold_ids.tolist(), k={})
    skipped: list = []
    window = dict(batch_size=batch_size, bucket=bucket)
    t0 = time.perf_counter()
    zero = query_window(model, variables, _with_blanks(t.prompts, t.blanks), t.prompts[0].query_start, width,
                        **window)
    entry["zero_eval_s"] = time.perf_counter() - t0
    for k in ks:
        if bar is not None:
            bar.set_postfix_str(f"{task.name} k={k}")
        t_cell = time.perf_counter()
        cell = _cell(model, variables, tokenizer, task, methods, t, zero, k, n_eval=n_eval, seed=seed,
                     add_bos=add_bos, fit_queries=fit_queries, width=width, window=window, bar=bar, skipped=skipped)
        if cell is not None:
            entry["k"][str(k)] = cell
            if bar is not None and not bar.disable:
                tqdm.write(f"{task.name} k={k} n={cell['prompt_len']}: " + ", ".join(
                    f"{m} {r['accuracy']:.2f}" for m, r in cell["methods"].items())
                    + f" ({time.perf_counter() - t_cell:.0f} s)", file=sys.stderr)
            cell["timing"]["cell_s"] = time.perf_counter() - t_cell
        if bar is not None:
            bar.update(1)
    return entry, skipped


def correctness(tasks: Mapping[str, dict]) -> dict:
    """``{task: {k: {method: f[queries]}}}``, the per-query correctness (0/1) of every method in every
    (task, k) cell of ``evaluate_task``'s entries ``tasks``: what ``linicl.recovery.recovery`` reads."""
    return {name: {k: {m: np.asarray(r["correct"], float) for m, r in cell["methods"].items()}
                   for k, cell in e["k"].items()} for name, e in tasks.items()}


def layer_error_summary(tasks: Mapping[str, dict]) -> dict:
    """``{method: [layers]}``: each method's ``layer_rel_err`` averaged over every (task, k) cell of
    ``evaluate_task``'s entries ``tasks`` that has it (the prompted model has none)."""
    curves: dict = {}
    for e in tasks.values():
        for cell in e["k"].values():
            for m, r in cell["methods"].items():
                if "layer_rel_err" in r:
                    curves.setdefault(m, []).append(r["layer_rel_err"])
    return {m: np.mean(np.asarray(c), 0).tolist() for m, c in curves.items()}
