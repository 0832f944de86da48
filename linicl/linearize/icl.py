"""How much of its teacher's in-context learning a linearized student keeps, per task and number of
demonstrations k, and how much of it survives the prompt being turned into weights.

One (task, k) cell scores the same prompts (``n_eval`` test queries sharing one set of k
demonstrations, ``data.build_eval_set(same_demos=True)``) with every method of ``METHODS``:

* ``SOFTMAX``: the teacher; ``STUDENT``: the student; ``STAGE1``: the student before its stage-2
  correction (when given);
* ``CONVERTED``: the student with the shared demonstrations (and BOS) converted into its state
  (``iclca.convert``) and the query read alone: the same predictions as ``STUDENT`` by construction,
  which the cell checks (``converted_same_answers``);
* ``APPROX``: the unmodified teacher with the demonstrations as learned-kernel terms
  (``iclca.convert_approx(kernel="learned")``, the student's maps as the kernel; its sinks and the
  prompt tokens in its window at the first query token stay exact), and ``KEPT_ONLY``, its control:
  the same conversion with the kernel terms dropped.

A label task (``task.labels``: sst2, cb, ...) is scored by label-restricted argmax over its label words,
an open-ended one by exact match of the greedy answer (``linicl.evaluate``). The share of the
teacher's few-shot gain a method keeps is ``stats.recovered`` (Wilson intervals per cell, bootstrap
intervals for gains and shares); a method that gave one answer for every query is set apart (``gains``'
``constant``), left out of ``kept_half`` and of the pooled share (``pooled_gain``), and marked in
``gains_table``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from linicl import iclca, reporting, stats
from linicl.data import build_eval_set, check_label_words, load_task, template_for
from linicl.errors import LiniclError
from linicl.evaluate import evaluate_prompts

SOFTMAX, STUDENT, STAGE1, CONVERTED = "softmax", "student", "student, stage 1 only", "student converted"
APPROX, KEPT_ONLY = "softmax + learned-kernel prompt", "softmax + kept prompt tokens only"
METHODS = (SOFTMAX, STUDENT, STAGE1, CONVERTED, APPROX, KEPT_ONLY)  # a cell's methods, in table order
# The methods whose share of the teacher's few-shot gain ``gains`` reports, and the field holding it.
RECOVERED = {STUDENT: "student_recovered", STAGE1: "stage1_recovered", APPROX: "learned_kernel_recovered",
             KEPT_ONLY: "kept_only_recovered"}


def check_scorable(tokenizer, tasks: Sequence[str], data_dir=None) -> None:
    """Refuse (``LiniclError`` naming the task and its words) a label task whose label words the
    tokenizer cannot score: label-restricted argmax reads one logit per label, so each word must be
    one distinct token. Open-ended tasks always pass. Cheap: run it before any training."""
    for name in tasks:
        task = load_task(name, data_dir)
        if task.labels is not None:
            try:
                check_label_words(task.labels, tokenizer, prefix=template_for(task).label_prefix)
            except LiniclError as e:
                raise LiniclError(f"{name}: a label task is scored by its label words {list(task.labels)}, "
                                  f"which this tokenizer cannot score: {e}") from None


def _alone(prompts, n: int) -> list:
    """The prompts with their first ``n`` tokens (the shared demonstrations) cut off."""
    return [dataclasses.replace(p, tokens=p.tokens[n:], roles=p.roles[n:], query_start=0) for p in prompts]


def icl_cell(teacher, teacher_variables, student, student_variables, tokenizer, task, k: int, *, seed: int = 0,
             n_eval: Optional[int] = None, add_bos: Optional[bool] = None, approx: bool = True,
             stage1_variables=None) -> dict:
    """One (task, k) cell: ``{method: EvalResult.summary() + {"correct": [0/1 per query], "predictions"}}``
    for every method that applies (no conversion at k = 0 without BOS: nothing to convert;
    ``approx=False`` leaves ``APPROX`` and ``KEPT_ONLY`` out), plus ``converted_same_answers`` (bool,
    when converted) and ``prompt_tokens`` (the converted prefix's length, to compare with the window).
    ``add_bos``: as ``data.build_eval_set`` (None: the tokenizer's convention)."""
    template = template_for(task)
    prompts = build_eval_set(task, tokenizer, k=k, seed=seed, n_eval=n_eval, template=template,
                             same_demos=True, add_bos=add_bos)
    common = dict(tokenizer=tokenizer, prompts=prompts, task=task.name, k=k, progress=False, labels=task.labels,
                  label_prefix=template.label_prefix)
    res = {SOFTMAX: evaluate_prompts(teacher, teacher_variables, **common),
           STUDENT: evaluate_prompts(student, student_variables, **common)}
    if stage1_variables is not None:
        res[STAGE1] = evaluate_prompts(student, stage1_variables, **common)
    n = prompts[0].query_start
    if n:  # the shared demonstrations (and BOS) become weights; the queries are then read alone
        demos, alone = jnp.asarray(prompts[0].tokens[:n])[None], dict(common, prompts=_alone(prompts, n))
        res[CONVERTED] = evaluate_prompts(student, iclca.convert(student, student_variables, demos), **alone)
        if approx:
            cfg = student.cfg
            kernel = iclca.convert_approx(teacher, teacher_variables, demos, kernel="learned",
                                          maps=student_variables, sinks=min(cfg.sinks, n),
                                          window=min(max(cfg.window - 1, 0), max(n - cfg.sinks, 0)))
            res[APPROX] = evaluate_prompts(teacher, kernel, **alone)
            res[KEPT_ONLY] = evaluate_prompts(teacher, iclca.drop_approx_terms(kernel), **alone)
    row = {m: r.summary() | {"correct": r.correct.astype(int).tolist(), "predictions": list(r.predictions)}
           for m, r in res.items()}
    if CONVERTED in res:  # exact conversion: the same answers, by construction
        row["converted_same_answers"] = res[CONVERTED].predictions == res[STUDENT].predictions
    row["prompt_tokens"] = int(n)
    return row


class _Memory(dict):
    """A store that keeps the cells in memory (``icl_table`` without ``store``)."""

    def put(self, key, row):
        self[key] = row
        return row


def _cell_order(tasks: Sequence[str], ks: Sequence[int]) -> list:
    """The headline cells first (k = 0 and the largest k of every task), so that an interrupted run
    has the gain of every task; the other k after."""
    first = {0, max(ks)}
    return ([(t, k) for t in tasks for k in ks if k in first] + [(t, k) for t in tasks for k in ks if k not in first])


def icl_table(teacher, teacher_variables, student, student_variables, tokenizer, tasks: Sequence[str],
              ks: Sequence[int], *, store=None, data_dir=None, progress: bool = False, **cell) -> dict:
    """``{"{task} k={k}": icl_cell(...) + {"wall_s"}}`` for every task and k, in task, k order. ``cell``:
    ``icl_cell``'s keywords. ``store``: where finished cells are kept and found again (``get(key)``,
    ``put(key, row)`` returning the row as stored, e.g. ``linicl.reporting.Progress``, so that an
    interrupted run resumes); default: memory."""
    if not tasks or not ks:
        raise LiniclError(f"icl_table needs at least one task and one k, got tasks={list(tasks)}, ks={list(ks)}")
    store = _Memory() if store is None else store
    cells = _cell_order(tasks, ks)
    bar = tqdm(total=len(cells), desc="ICL cells", disable=not progress)
    for name, k in cells:
        key = f"{name} k={k}"
        bar.set_postfix_str(key)
        if store.get(key) is None:
            t0 = time.perf_counter()
            row = icl_cell(teacher, teacher_variables, student, student_variables, tokenizer,
                           load_task(name, data_dir), k, **cell)
            store.put(key, row | {"wall_s": time.perf_counter() - t0})
        bar.update(1)
    bar.close()
    return {f"{name} k={k}": store.get(f"{name} k={k}") for name in tasks for k in ks}


def _constant(cell: Mapping, method: str) -> bool:
    """Whether ``method`` gave one answer for every query of ``cell`` (``EvalResult.constant``)."""
    return bool(cell.get(method, {}).get("constant", False))


def gains(rows: Mapping[str, dict], tasks: Sequence[str], k: int) -> dict:
    """Per task with both cells in ``rows`` (``icl_table``): the teacher's few-shot gain at ``k`` over
    k = 0 (``stats.gain``) and the share of it each method kept (``stats.recovered``; None where the
    gain is not significantly positive), as ``{task: {"k", "gain", "student_recovered", ..., "constant"}}``
    (the fields of ``RECOVERED``). ``constant``: the methods of ``RECOVERED`` that gave one answer for
    every query at ``k``: their share only says how often that answer is gold (" 5" on a numeric
    task can "keep" 1.2 of a gain), so ``kept_half``, ``pooled_gain`` and ``gains_table`` set them apart."""
    out = {}
    for name in tasks:
        zero, few = rows.get(f"{name} k=0"), rows.get(f"{name} k={k}")
        if zero is None or few is None:
            continue
        z, f = zero[SOFTMAX]["correct"], few[SOFTMAX]["correct"]
        rec = stats.recovered(few[STUDENT]["correct"], f, z)
        out[name] = dict(k=k, gain=stats.gain(f, z)._asdict(), student_recovered=None if rec is None else rec._asdict())
        for m in (APPROX, KEPT_ONLY, STAGE1):
            if m in few:
                rec = stats.recovered(few[m]["correct"], f, z)
                out[name][RECOVERED[m]] = None if rec is None else rec._asdict()
        out[name]["constant"] = [m for m in RECOVERED if m in few and _constant(few, m)]
    return out


def pooled_gain(rows: Mapping[str, dict], tasks: Sequence[str], k: int) -> Optional[dict]:
    """The teacher's gain at ``k`` over every task's queries pooled (equal numbers per task: the mean over
    tasks) and the share of it each method kept, with bootstrap intervals; ``kernel_adds``: what the
    learned kernel's terms add over the tokens they leave exact (``APPROX`` - ``KEPT_ONLY`` accuracy,
    paired bootstrap on the same queries). None without a task holding both cells, or at k = 0.

    A method's share leaves out the tasks where it answered one word to every query at ``k`` (a
    constant predictor keeps no in-context learning, whatever its accuracy): ``constant`` names them
    per method, and ``with_constant`` holds that method's share over every task, so both are reported."""
    names = [t for t in tasks if f"{t} k=0" in rows and f"{t} k={k}" in rows]
    if not names or k == 0:
        return None

    def flat(cell, m, among=names):
        return np.concatenate([rows[f"{t} k={cell}"][m]["correct"] for t in among])

    def share(m, among):
        rec = stats.recovered(flat(k, m, among), flat(k, SOFTMAX, among), flat(0, SOFTMAX, among)) if among else None
        return None if rec is None else rec._asdict()
    zero, few = flat(0, SOFTMAX), flat(k, SOFTMAX)
    out = dict(k=k, tasks=names, n=int(zero.size), gain=stats.gain(few, zero)._asdict(), constant={}, with_constant={})
    for m in (STUDENT, STAGE1, APPROX, KEPT_ONLY):
        if all(m in rows[f"{t} k={k}"] for t in names):
            constant = [t for t in names if _constant(rows[f"{t} k={k}"], m)]
            out[m] = share(m, [t for t in names if t not in constant])
            if constant:
                out["constant"][m], out["with_constant"][m] = constant, share(m, names)
    if all(APPROX in rows[f"{t} k={k}"] and KEPT_ONLY in rows[f"{t} k={k}"] for t in names):
        out["kernel_adds"] = stats.paired_bootstrap(flat(k, APPROX), flat(k, KEPT_ONLY))._asdict()
    return out


def kept_half(gains_: Mapping[str, dict], method: str) -> dict:
    """Of the tasks in ``gains_`` (``gains``) with a significantly positive gain, those where ``method``
    (a key of ``RECOVERED``) kept at least half of it: ``{"half": [...], "of": [...], "constant": [...]}``.
    ``of``: the significant tasks where it gave more than one answer; ``constant``: those where it gave
    one answer for every query, left out of both counts (its share there is no kept learning)."""
    field = RECOVERED[method]
    sig = [t for t, g in gains_.items() if g.get(field) is not None]
    constant = [t for t in sig if method in gains_[t].get("constant", ())]
    of = [t for t in sig if t not in constant]
    return dict(half=[t for t in of if gains_[t][field]["value"] >= 0.5], of=of, constant=constant)


def shortest_prompt(rows: Mapping[str, dict]) -> Optional[dict]:
    """The shortest converted prompt holding demonstrations (k >= 1; a k = 0 prompt converts BOS at
    most) over the cells of ``rows`` (``icl_table``): ``{"tokens", "cell"}``, None when there is none."""
    demos = [(c["prompt_tokens"], key) for key, c in rows.items()
             if c.get("prompt_tokens") and c.get(SOFTMAX, {}).get("k", 0) >= 1]
    if not demos:
        return None
    tokens, key = min(demos)
    return dict(tokens=tokens, cell=key)


def _interval(d: dict, scale: float = 1.0, places: int = 2) -> str:
    return f"{scale * d['value']:.{places}f} [{scale * d['low']:.{places}f}, {scale * d['high']:.{places}f}]"


def gains_table(gains_: Mapping[str, dict], pooled: Optional[dict], methods: Sequence[str]) -> str:
    """The Markdown table of the teacher's gain per task (``gains``) and the share each of ``methods``
    (keys of ``RECOVERED``) kept, with the pooled row (``pooled_gain``) last. "n.s. gain" where the gain
    is not significantly positive; "(const)" after a share from one answer for every query. The pooled
    share leaves those tasks out ("without const: ...") and gives the share over every task after it."""
    def share(g: Optional[dict]) -> str:
        return "n.s. gain" if g is None else _interval(g)

    rows = [[t, g["k"], _interval(g["gain"], 100, 1)]
            + [share(g.get(RECOVERED[m])) + (" (const)" if m in g.get("constant", ()) else "") for m in methods]
            for t, g in gains_.items()]
    if pooled:
        cells = []
        for m in methods:
            left_out = pooled.get("constant", {}).get(m)
            cells.append(share(pooled.get(m)) + (f" (without const {', '.join(left_out)}; all tasks: "
                                                 f"{share(pooled['with_constant'][m])})" if left_out else ""))
        rows.append([f"all {len(pooled['tasks'])} tasks, pooled (n={pooled['n']})", pooled["k"],
                     _interval(pooled["gain"], 100, 1)] + cells)
    return reporting.markdown_table(["task", "k", "softmax gain, points"] + [f"{m} keeps" for m in methods], rows)


__all__ = ["SOFTMAX", "STUDENT", "STAGE1", "CONVERTED", "APPROX", "KEPT_ONLY", "METHODS", "RECOVERED",
           "check_scorable", "icl_cell", "icl_table", "gains", "pooled_gain", "kept_half", "shortest_prompt",
           "gains_table"]
