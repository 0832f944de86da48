"""The ICR protocol's results pooled and compared (routing.md; arXiv 2509.22854, section 5).

A row (``evaluate_task``) holds per method its accuracy and, under ``detail``, its per-item
correctness with the items' positions in the task's zero-shot item list, so that every comparison is
paired: two methods are compared only on the items both scored (the few-shot baseline scores the first
ones only).

* ``pool_seeds``: one row per task from its rows per seed.
* ``aligned``: the methods' correctness on their shared items.
* ``compare``: per method, minus zero-shot (paired bootstrap), collapse, share of the few-shot gain.
* ``summarise``: group averages (ID, near, far, OOD, all), the comparisons, collapses and the targets.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from linicl import stats
from linicl.errors import LiniclError
from linicl.routing.arms import RANDOM_CONTROLS

ROW_FIELDS = ("n", "metric", "detail")  # the keys of a result row that are not methods
POOLED_FIELDS = ROW_FIELDS + ("seeds",)  # and of a pooled row


def merge_row(old: dict, new: dict) -> dict:
    """A row with the methods of ``new`` (``evaluate_task`` over the methods ``old`` lacks) added to
    those of ``old`` (an earlier row of the same task and seed, maybe empty)."""
    return dict(old, **{k: v for k, v in new.items() if k != "detail"},
                detail={**old.get("detail", {}), **new["detail"]})


def method_names(results: dict) -> list:
    """Every method of any task's row, in first-seen order (a method may be on some tasks only: the
    function vector is an in-domain baseline)."""
    names = [m for row in results.values() for m in row if m not in POOLED_FIELDS]
    return list(dict.fromkeys(names))


def pool_seeds(per_seed: dict) -> dict:
    """One row from a task's rows by seed (``{"0": row, "1": row}``): each method's correctness
    concatenated in seed order, ``items`` shifted to the concatenated item list, the pooled accuracy
    with its 95 % Wilson interval, ``constant`` if no seed's predictions varied, and ``seeds``."""
    if not per_seed:
        raise LiniclError("per_seed must hold one or more rows (seed -> row of evaluate_task), got none")
    seeds = sorted(per_seed, key=int)
    methods = [m for m in per_seed[seeds[0]] if m not in ROW_FIELDS]
    detail = {m: dict(correct=[], items=[], distinct=0) for m in methods}
    offset = 0
    for s in seeds:
        r = per_seed[s]
        for m in methods:
            d = r["detail"][m]
            detail[m]["correct"] += d["correct"]
            detail[m]["items"] += [offset + i for i in d["items"]]
            detail[m]["distinct"] = max(detail[m]["distinct"], d["distinct"])
        offset += r["n"]
    row = {}
    for m in methods:
        c = detail[m]["correct"]
        iv = stats.wilson(int(sum(c)), len(c))
        row[m] = sum(c) / len(c)
        detail[m].update(ci_low=iv.low, ci_high=iv.high, constant=detail[m]["distinct"] == 1)
    return dict(row, n=offset, metric=per_seed[seeds[0]]["metric"], detail=detail, seeds=[int(s) for s in seeds])


def aligned(row: dict, *methods: str) -> list:
    """Per method, its correctness ``f64[m]`` on the ``m`` items that every one of ``methods`` scored
    (in item order)."""
    missing = [m for m in methods if m not in row.get("detail", {})]
    if missing or not methods:
        raise LiniclError(f"methods: expected some of the row's methods {list(row.get('detail', {}))}, "
                          f"got {list(methods)}")
    shared = set.intersection(*(set(row["detail"][m].get("items", range(row["n"]))) for m in methods))
    out = []
    for m in methods:
        d = row["detail"][m]
        items = d.get("items", list(range(len(d["correct"]))))
        out.append(np.asarray([c for i, c in zip(items, d["correct"]) if i in shared], float))
    return out


def _iv(iv: Optional[stats.Interval]) -> Optional[dict]:
    return None if iv is None else dict(value=iv.value, low=iv.low, high=iv.high)


def compare(row: dict, methods: list) -> dict:
    """Per method of ``methods`` in the row but zero-shot, on the items it shares with zero-shot:
    ``vs_zero``, the difference in accuracy (paired bootstrap 95 %), ``collapsed`` (significantly
    below zero-shot) and ``recovered``, the share of the few-shot gain it recovers on the few-shot
    items (None unless that gain is significantly positive)."""
    out = {}
    for m in methods:
        if m == "zero-shot" or m not in row:
            continue
        c, zero = aligned(row, m, "zero-shot")
        rec = None
        if m != "few-shot" and "few-shot" in row["detail"]:
            cf, few, zf = aligned(row, m, "few-shot", "zero-shot")
            rec = _iv(stats.recovered(cf, few, zf))
        out[m] = dict(vs_zero=_iv(stats.paired_bootstrap(c, zero)), collapsed=stats.collapsed(c, zero), recovered=rec)
    return out


def pooled_difference(results: dict, tasks: list, a: str, b: str) -> stats.Interval:
    """Method ``a`` minus method ``b`` in accuracy on the pooled shared items of those of ``tasks``
    that have both (paired bootstrap 95 %): one comparison over a group, not an average of per-task ones."""
    both = [t for t in tasks if a in results[t] and b in results[t]]
    if not both:
        raise LiniclError(f"pooled_difference: no task of {list(tasks)} has both {a!r} and {b!r}")
    pairs = [aligned(results[t], a, b) for t in both]
    return stats.paired_bootstrap(np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs]))


def summarise(results: dict, task_groups: dict) -> dict:
    """``results``: task -> pooled row; ``task_groups``: ``{"ID": [...], "near": [...], "far":
    [...]}`` (tasks without a row are left out). Returns ``tasks`` (the groups present, with ``OOD`` =
    near + far and ``all``), per group the mean over its tasks of each method's accuracy (over the tasks
    that have it), ``compare`` per task, ``collapsed_tasks`` and ``collapses`` per method, and
    ``targets``: per ICR arm its collapses and pooled in-domain gain (>= 5 points is the paper's
    claim), and each PID arm minus its random-basis control (``RANDOM_CONTROLS``) on the pooled OOD items."""
    methods = method_names(results)
    out = {}
    present = {g: [t for t in names if t in results] for g, names in task_groups.items()}
    present["OOD"] = present.get("near", []) + present.get("far", [])
    present["all"] = present.get("ID", []) + present["OOD"]
    out["tasks"] = present
    for group, names in present.items():
        if names:
            out[group] = {m: float(np.mean([results[t][m] for t in names if m in results[t]])) for m in methods
                          if any(m in results[t] for t in names)}
    out["compare"] = {t: compare(row, methods) for t, row in results.items()}
    out["collapsed_tasks"] = {m: [t for t in results if m in out["compare"][t] and out["compare"][t][m]["collapsed"]]
                              for m in methods if m != "zero-shot"}
    out["collapses"] = {m: len(ts) for m, ts in out["collapsed_tasks"].items()}
    targets = {}
    for m in [m for m in methods if m.startswith("ICR")]:
        targets[m] = {"collapses": out["collapses"][m], "no_collapses": out["collapses"][m] == 0}
        if present.get("ID"):
            pooled = pooled_difference(results, present["ID"], m, "zero-shot")
            gain = 100 * (out["ID"][m] - out["ID"]["zero-shot"])
            targets[m].update(ID_gain_points=gain, ID_gain_pooled=_iv(pooled),
                              ID_gain_at_least_5_points=bool(gain >= 5.0), ID_gain_significant=bool(pooled.low > 0))
    for pid_arm, rand_arm in RANDOM_CONTROLS.items():
        if pid_arm in methods and rand_arm in methods and present["OOD"]:
            targets[f"{pid_arm}_vs_{rand_arm}_OOD"] = _iv(pooled_difference(results, present["OOD"], pid_arm,
                                                                             rand_arm))
    out["targets"] = targets
    return out
