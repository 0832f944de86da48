"""The approximate-conversion experiment's tables and figures, from its report
(``experiments/approx_conversion.py`` writes it as JSON).

The report: ``variants`` (the converters' names, ``variants.variant_specs``), ``tasks`` ({task:
``evaluation.evaluate_task``'s entry}), ``recovery`` (``linicl.recovery.recovery`` of
``evaluation.correctness``), ``layer_error_summary`` (``evaluation.layer_error_summary``),
``synthetic`` (``linicl.fidelity.copy_test``'s result, or None), ``model`` (with its ``source``) and
``settings`` (with ``n_eval`` and ``k``).

The figures take pyplot as their first argument (``linicl.reporting.plot`` passes it).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from linicl import reporting, stats
from linicl.approx.evaluation import BASE

__all__ = ["CONSTANT_MARK", "fmt_acc", "fmt_iv", "fmt_recovered", "best_line", "tables", "per_task_figure",
           "layer_error_figure", "synthetic_figure"]

CONSTANT_MARK = "(const)"  # after the accuracy of a method that predicts the same token for every query


def _fmt(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _cells(report: dict):
    """Every (task, k, task entry, cell) of the report, in order."""
    return [(t, k, e, cell) for t, e in report["tasks"].items() for k, cell in e["k"].items()]


def fmt_acc(r: dict) -> str:
    """``"62.5 [45.1, 77.3]"`` (percent, Wilson), marked for a constant predictor."""
    text = stats.Interval(r["accuracy"], r["ci_low"], r["ci_high"]).fmt()
    return f"{text} {CONSTANT_MARK}" if r.get("constant") else text


def fmt_iv(d, scale: float = 100.0, digits: int = 1, empty: str = "-") -> str:
    """An interval dict ``{"value", "low", "high"}`` as ``"v [low, high]"`` times ``scale``; ``empty``
    for None (undefined)."""
    return empty if d is None else stats.Interval(d["value"], d["low"], d["high"]).fmt(scale, digits)


def fmt_recovered(p: dict, v: str) -> str:
    """The recovered share of the gain with its interval; 'n.s.' where the gain is not significant,
    'collapsed' appended where the variant is significantly below zero-shot."""
    if v not in p["variant_acc"]:
        return "-"
    text = "n.s." if not p["significant"] else fmt_iv(p["fraction"][v], 1.0, 2)
    return text + (" collapsed" if p["collapsed"].get(v) else "")


def best_line(rec: dict) -> str:
    """The best variant and its count of tasks, or that there is none (every variant at 0) or a tie."""
    best, tied = rec["best_variant"], rec.get("tied_variants", [])
    if best is not None:
        return f"best variant {best}: {len(rec['passing'][best])} of {rec['tasks']} tasks"
    if not tied:
        return "no variants"
    passing = len(rec["passing"][tied[0]])
    if passing == 0:
        return f"no best variant: every variant recovers half the gain on 0 of {rec['tasks']} tasks"
    return f"no single best variant: {', '.join(tied)} tie at {passing} of {rec['tasks']} tasks"


def tables(report: dict) -> str:
    """The printed summary: accuracy per (task, k) and method, each method minus the prompted model,
    the KLs, the hook_z error by layer, the share of the few-shot gain recovered with the target's
    verdict, and the synthetic copy test (when it ran)."""
    methods, rest, variants = list(BASE) + report["variants"], ["zero"] + report["variants"], report["variants"]
    table = reporting.markdown_table
    acc = table(["task", "k", "n"] + methods, [
        [t, k, e["n"]] + [fmt_acc(c["methods"][m]) if m in c["methods"] else "-" for m in methods]
        for t, k, e, c in _cells(report)])
    rec = report["recovery"]
    diff = table(["task", "k"] + rest, [
        [c["task"], c["k"]] + [fmt_iv(c["vs_prompt"].get(v)) for v in rest]
        for c in rec["per_task_k"].values()])
    kl = table(["task", "k"] + rest, [
        [t, k] + [f"{_fmt(c['methods'][m]['kl_full_mean'], '.3g')} / {_fmt(c['methods'][m]['kl_label_mean'], '.3g')}"
                  if m in c["methods"] else "-" for m in rest]
        for t, k, e, c in _cells(report)])
    err = table(["method", "first layer", "middle", "last layer", "mean over layers"], [
        [m] + [_fmt(x, ".3f") for x in (curve[0], curve[len(curve) // 2], curve[-1], float(np.mean(curve)))]
        for m, curve in report["layer_error_summary"].items()])
    gain = table(["task", "zero", "prompt", "gain"] + variants, [
        [t, _fmt(100 * p["zero"], ".1f"), _fmt(100 * p["prompt"], ".1f"),
         fmt_iv(p["gain"]) + ("" if p["significant"] else " (n.s.)")] + [fmt_recovered(p, v) for v in variants]
        for t, p in list(rec["per_task_pooled"].items()) + [("all tasks pooled", rec.get("across_tasks"))] if p])
    lines = ["Accuracy in % with 95 % Wilson intervals (label-restricted for classification, first content "
             f"token for word tasks; {CONSTANT_MARK}: the same prediction for every query):", "", acc,
             "", "Method minus prompted model, accuracy points on the same queries (paired bootstrap 95 %):", "",
             diff,
             "", "Mean KL(prompted || method), full vocabulary / label words, at the query's last token:", "", kl,
             "", "hook_z relative error vs the prompted model (mean over queries, tasks and k), by layer:", "", err,
             "", "Share of the few-shot gain recovered, with its 95 % bootstrap interval (every (query, k) of a "
                 "task one pair; 'n.s.': the few-shot gain is not significant, so no share is defined; "
                 "'collapsed': significantly below zero-shot):", "", gain,
             f"\nTarget (best variant recovers >= half the gain on >= half the tasks): "
             f"{'MET' if rec['target_met'] else 'NOT MET'} ({best_line(rec)}, "
             f"{rec['tasks_with_gain']} with a significant gain, {rec['needed']} needed)"]
    syn = report.get("synthetic")
    if syn and syn["methods"]:
        s = syn["settings"]
        lines += ["", f"Synthetic copy test: {s['pairs']} random prompts of {s['prompt_len']} tokens, input = "
                      f"their first {s['input_len']}:", "",
                  table(["method", "logit rel. err (median)", "KL (mean)", "argmax agrees", "copy acc", "copy NLL"], [
                      [m, _fmt(r["logit_rel_err_median"], ".3f"), _fmt(r["kl_mean"], ".3g"), _fmt(r["argmax_agree"]),
                       _fmt(r["copy_acc"]), _fmt(r["copy_nll"], ".2f")] for m, r in syn["methods"].items()])]
    return "\n".join(lines)


def _colors(report: dict) -> dict:
    """One colour per method, the same in every figure."""
    return {m: f"C{i}" for i, m in enumerate(list(BASE) + report["variants"])}


def per_task_figure(plt, report: dict, what: str, ylabel: str):
    """``what`` (a method metric) against k, one panel per task, one line per method."""
    names = [t for t, e in report["tasks"].items() if e["k"]]
    colors = _colors(report)
    ncols = min(3, max(1, len(names)))
    nrows = max(1, -(-len(names) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.9 * nrows), squeeze=False)
    for ax, t in zip(axes.flat, names):
        cells = report["tasks"][t]["k"]
        ks = list(cells)
        for m in colors:
            ys = [cells[k]["methods"].get(m, {}).get(what, np.nan) for k in ks]
            if what == "kl_full_mean" and m == "prompt":
                continue
            ax.plot(range(len(ks)), [np.nan if y is None else y for y in ys], "o-" if m not in BASE else "s--",
                    color=colors[m], label=m, lw=2.2 if m in BASE else 1.2, ms=4)
        ax.set_xticks(range(len(ks)), ks)
        ax.set_title(f"{t} ({report['tasks'][t]['metric']})", fontsize=9)
        ax.set_xlabel("k (demonstrations)", fontsize=8)
        if what == "accuracy":
            ax.set_ylim(-0.03, 1.03)
        else:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=7)
    fig.suptitle(f"{Path(report['model']['source']).name}: {ylabel} per task and k, n={report['settings']['n_eval']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def layer_error_figure(plt, report: dict):
    """The hook_z relative error by layer: over every task and k, then at each k."""
    colors = _colors(report)
    ks = report["settings"]["k"]
    fig, axes = plt.subplots(1, len(ks) + 1, figsize=(3.8 * (len(ks) + 1), 3.2), squeeze=False)
    for ax, k in zip(axes[0], [None] + list(ks)):
        curves: dict = {}
        for e in report["tasks"].values():
            cell = e["k"].get(str(k)) if k is not None else None
            cells = [cell] if cell else (list(e["k"].values()) if k is None else [])
            for c in cells:
                for m, r in c["methods"].items():
                    if "layer_rel_err" in r:
                        curves.setdefault(m, []).append(r["layer_rel_err"])
        for m, cs in curves.items():
            ax.plot(np.mean(np.asarray(cs), 0), "s--" if m in BASE else "o-", color=colors[m], label=m, ms=3)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title("all tasks and k" if k is None else f"k = {k}", fontsize=9)
        ax.set_ylabel("rel. error of hook_z vs prompted", fontsize=8)
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    return fig


def synthetic_figure(plt, report: dict):
    """The synthetic copy test: logit error, argmax agreement and copy accuracy per method."""
    colors = _colors(report)
    syn = report.get("synthetic") or {}
    ms = syn.get("methods") or {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    labels = list(ms)
    for ax, (key, title) in zip(axes, (("logit_rel_err_median", "logit rel. error (median)"),
                                       ("argmax_agree", "argmax agrees with prompted"),
                                       ("copy_acc", "copy accuracy"))):
        ax.bar(range(len(labels)), [ms[m][key] for m in labels], color=[colors.get(m, "0.5") for m in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    if syn:
        fig.suptitle(f"synthetic copy test: {syn['settings']['pairs']} random prompts of "
                     f"{syn['settings']['prompt_len']} tokens", fontsize=10)
    fig.tight_layout()
    return fig
