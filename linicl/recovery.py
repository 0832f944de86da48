"""The few-shot gain a method recovers: for paired per-query correctness of the zero-shot model, the
prompted (few-shot) model and some variants (methods standing in for the prompt, e.g. a converted
prompt), the gain acc_prompt - acc_zero, each variant's recovered fraction (acc_variant - acc_zero) /
(acc_prompt - acc_zero) with its bootstrap interval (``linicl.stats.recovered``), per (task, k) and
per task pooled over k, and a target: the best variant recovers >= half of the gain on >= half of the
tasks.

Correctness is given as ``{task: {k: {method: f[queries]}}}`` (0/1 per query; ``"zero"`` and
``"prompt"`` always present; the queries of one (task, k) paired across methods).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from linicl import stats
from linicl.errors import LiniclError

__all__ = ["interval_dict", "compare", "pooled", "best_variant", "recovery", "DEFINITION"]

DEFINITION = ("fraction = (acc_variant - acc_zero) / (acc_prompt - acc_zero) with a 95 % bootstrap "
              "interval (linicl.stats.recovered), defined only where the few-shot gain acc_prompt - "
              "acc_zero is significant (paired bootstrap interval above 0). Primary (pooled): every "
              "(query, k) of a task one pair. Target: one variant (the best) has fraction >= 0.5 on at "
              "least ceil(#tasks / 2) of all evaluated tasks (a task without a significant gain counts "
              "as not recovered). best_variant: the one passing on the most tasks (then the highest "
              "mean fraction); None with tied_variants when none passes on any task or the leaders "
              "tie. collapsed: significantly below zero-shot. per_k: the same at each k.")


def interval_dict(iv: Optional[stats.Interval]) -> Optional[dict]:
    """An Interval as JSON, ``{"value", "low", "high"}`` (None stays None: the quantity is undefined)."""
    return None if iv is None else dict(value=iv.value, low=iv.low, high=iv.high)


def compare(correct: Mapping[str, np.ndarray], variants: Sequence[str]) -> dict:
    """Per-query correctness ``{method: f[queries]}`` of one set of paired queries -> the few-shot gain
    with its paired interval, each variant's recovered share (None unless the gain is significantly
    positive, or when the variant is missing), its difference to the prompted model and whether it
    (or the prompted model) collapsed (significantly below zero-shot)."""
    for need in ("zero", "prompt"):
        if need not in correct:
            raise LiniclError(f"correct: needs a {need!r} entry, got {sorted(correct)}")
    zero, few = correct["zero"], correct["prompt"]
    g = stats.gain(few, zero)
    present = [v for v in variants if v in correct]
    return dict(zero=float(zero.mean()), prompt=float(few.mean()), gain=interval_dict(g),
                significant=g.excludes_zero(), variant_acc={v: float(correct[v].mean()) for v in present},
                fraction={v: interval_dict(stats.recovered(correct[v], few, zero)) if v in correct else None
                          for v in variants},
                vs_prompt={v: interval_dict(stats.paired_bootstrap(correct[v], few)) for v in ["zero"] + present},
                collapsed={v: stats.collapsed(correct[v], zero) for v in ["prompt"] + present})


def pooled(cells: Sequence[Mapping[str, np.ndarray]]) -> dict:
    """The (query, k) pairs of every cell (one per k) concatenated, for the methods every cell has."""
    common = set.intersection(*(set(c) for c in cells))
    return {m: np.concatenate([np.asarray(c[m]) for c in cells]) for m in common}


def best_variant(passes: Mapping[str, list], mean_fraction: Callable[[str], float]) -> tuple:
    """``(best, tied)`` from ``passes`` ({variant: tasks where it recovers >= half of the gain}): the
    variant passing on the most tasks, a tie broken by ``mean_fraction(variant)``; ``best`` is None when
    no variant passes on any task (``tied``: every variant, all at 0) or when the leaders tie on both
    (``tied``: the leaders). Naming one of equals "best" would report an order that is not there."""
    if not passes:
        return None, []
    key = {v: (len(p), mean_fraction(v)) for v, p in passes.items()}
    top = max(key.values())
    leaders = [v for v in passes if key[v] == top]
    if top[0] == 0:
        return None, list(passes)
    return (leaders[0], []) if len(leaders) == 1 else (None, leaders)


def _ok(f) -> bool:
    return f is not None and f["value"] >= 0.5


def _per_k(per_cell: dict, variants: Sequence[str]) -> dict:
    """The target at each k alone."""
    per_k = {}
    for k in sorted({c["k"] for c in per_cell.values()}):
        cells = {c["task"]: c for c in per_cell.values() if c["k"] == k}
        g = [t for t, c in cells.items() if c["significant"] and c["gain"]["value"] > 0]
        passing = {v: sorted(t for t in g if _ok(cells[t]["fraction"][v])) for v in variants}
        per_k[str(k)] = dict(tasks=len(cells), tasks_with_gain=len(g), passing=passing,
                             target_met=bool(variants) and bool(g) and max(len(x) for x in passing.values())
                             >= math.ceil(len(cells) / 2))
    return per_k


def recovery(correct: Mapping[str, Mapping], variants: Sequence[str]) -> dict:
    """The few-shot gain recovered (module docstring), from ``correct``: ``{task: {k: {method:
    f[queries]}}}``. Returns ``per_task_k`` (``compare`` per ``"<task>/k=<k>"``, with ``task`` and
    ``k``), ``per_task_pooled`` (``compare`` of ``pooled`` per task with any k), ``passing`` ({variant:
    tasks with a significant gain where it recovers >= half}), ``best_variant``/``tied_variants``
    (``best_variant``), ``best_mean_fraction``, ``needed`` (ceil(tasks / 2)), ``target_met``, ``per_k``
    (the same at each k), ``across_tasks`` (``compare`` of every task's (query, k) pairs pooled: the
    gain over all tasks and the share of it each variant keeps; None without tasks) and the
    ``definition`` (``DEFINITION``)."""
    per_cell, pool = {}, {}
    for name, by_k in correct.items():
        for k, cell in by_k.items():
            per_cell[f"{name}/k={k}"] = dict(task=name, k=int(k), **compare(cell, variants))
        if by_k:
            pool[name] = compare(pooled(list(by_k.values())), variants)
    with_gain = [t for t, p in pool.items() if p["significant"] and p["gain"]["value"] > 0]
    passes = {v: [t for t in with_gain if _ok(pool[t]["fraction"][v])] for v in variants}

    def mean_fraction(v) -> float:
        fs = [pool[t]["fraction"][v]["value"] for t in with_gain if pool[t]["fraction"][v] is not None]
        return float(np.mean(fs)) if fs else -math.inf

    best, tied = best_variant(passes, mean_fraction)
    tasks = [pooled(list(by_k.values())) for by_k in correct.values() if by_k]
    across = compare(pooled(tasks), variants) if tasks else None
    need = math.ceil(len(pool) / 2)
    return dict(
        definition=DEFINITION, per_task_k=per_cell, per_task_pooled=pool, tasks=len(pool),
        tasks_with_gain=len(with_gain), passing=passes, best_variant=best, tied_variants=tied,
        best_mean_fraction=None if best is None or not math.isfinite(mean_fraction(best)) else mean_fraction(best),
        needed=need, target_met=bool(with_gain) and max(map(len, passes.values()), default=0) >= need,
        per_k=_per_k(per_cell, variants), across_tasks=across)
