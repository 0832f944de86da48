"""The ICR protocol's results as text and a figure: Markdown tables of the pooled rows and of
``summarise``'s comparisons and targets, the routers' bias sizes, accuracy bars.

Accuracies are in percent with their 95 % Wilson interval (``"62.5 [45.1, 77.3]"``), differences in
points with their paired-bootstrap interval.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from linicl.reporting import markdown_table
from linicl.routing.summary import method_names
from linicl.stats import Interval

CONSTANT_MARK = "(const)"  # after the accuracy of a method that predicted the same label for every item


def fmt_accuracy(row: dict, method: str) -> str:
    """``"62.5 [45.1, 77.3]"`` (percent, Wilson), marked ``CONSTANT_MARK`` for a constant predictor;
    ``"-"`` when the row lacks the method."""
    if method not in row:
        return "-"
    d = row["detail"][method]
    text = Interval(row[method], d["ci_low"], d["ci_high"]).fmt()
    return f"{text} {CONSTANT_MARK}" if d["constant"] else text


def fmt_interval(v: dict, scale: float = 100.0, digits: int = 1) -> str:
    """An interval as ``summarise`` stores it (``{"value", "low", "high"}``), times ``scale``."""
    return Interval(v["value"], v["low"], v["high"]).fmt(scale, digits)


def fmt_comparison(c: dict) -> str:
    """One entry of ``compare``: ``"12.5 [3.1, 21.9]; rec 0.80 [0.31, 1.20]"`` (points; share of the
    few-shot gain recovered when there is one), with ``" COLLAPSED"`` after a collapse."""
    text = fmt_interval(c["vs_zero"])
    if c["recovered"] is not None:
        text += f"; rec {fmt_interval(c['recovered'], 1.0, 2)}"
    return text + (" COLLAPSED" if c["collapsed"] else "")


def _target_line(name: str, t: dict, collapsed_tasks: dict) -> str:
    if name.endswith("_OOD"):  # a PID arm minus its random-basis control
        a, b = name[:-4].split("_vs_")
        side = "PIDs >= random basis" if t["low"] >= 0 or t["value"] >= 0 else "PIDs BELOW the random basis"
        sig = ", significantly" if t["low"] > 0 or t["high"] < 0 else ", not significantly"
        return f"- {a} minus {b} on the OOD tasks' pooled queries: {fmt_interval(t)} points ({side}{sig})."
    gain = ""
    if "ID_gain_points" in t:
        gain = (f"; ID {t['ID_gain_points']:+.1f} points over zero-shot (pooled {fmt_interval(t['ID_gain_pooled'])}; "
                f">= 5: {'met' if t['ID_gain_at_least_5_points'] else 'NOT met'})")
    return f"- {name}: collapses {t['collapses']} ({', '.join(collapsed_tasks[name]) or 'none'}){gain}."


def results_table(results: dict, summary: dict) -> str:
    """Markdown: accuracy per task and method with the group averages and collapses; each method minus
    zero-shot per task; one line per target. ``results``: task -> pooled row (``pool_seeds``);
    ``summary``: ``summarise(results, ...)``."""
    methods = method_names(results)
    order = [(g, t) for g in ("ID", "near", "far") for t in summary["tasks"].get(g, [])]
    rows = [[t, g, results[t]["n"]] + [fmt_accuracy(results[t], m) for m in methods] for g, t in order]
    rows += [[f"**{g} average**", "", ""] + [f"{100 * summary[g][m]:.1f}" if m in summary[g] else "-"
                                              for m in methods]
             for g in ("ID", "near", "far", "OOD", "all") if g in summary]
    rows.append(["**collapses**", "", ""] + ["-" if m == "zero-shot" else summary["collapses"][m] for m in methods])
    others = [m for m in methods if m != "zero-shot"]
    diffs = [[t, g] + [fmt_comparison(summary["compare"][t][m]) if m in summary["compare"][t] else "-"
                       for m in others] for g, t in order]
    lines = [f"Accuracy in % with 95 % Wilson intervals, pooled over seeds ({CONSTANT_MARK}: the same prediction "
             "for every query; few-shot on its own first items):", "",
             markdown_table(["task", "group", "n"] + methods, rows), "",
             "Method minus zero-shot, points on the same queries (paired bootstrap 95 %); rec: share of the "
             "few-shot gain recovered (only where that gain is significantly positive); COLLAPSED: significantly below "
             "zero-shot:", "", markdown_table(["task", "group"] + others, diffs), ""]
    lines += [_target_line(name, t, summary["collapsed_tasks"]) for name, t in summary["targets"].items()]
    return "\n".join(lines)


def bias_lines(histories: dict, logit_std: Optional[Sequence[float]]) -> str:
    """Markdown list: the model's own logit std over keys per routed layer (``logit_std``, None to
    leave it out) and each router's bias std at the end of training (the last entry of its training
    ``history`` with a ``bias_size``)."""
    lines = []
    if logit_std is not None:
        lines.append(f"- model's own logit std over keys, per routed layer: {', '.join(f'{v:.2f}' for v in logit_std)}")
    for name, h in histories.items():
        if h and "bias_size" in h[-1]:
            sizes = ", ".join(f"{v:.2f}" for v in h[-1]["bias_size"])
            lines.append(f"- {name}: bias std at the end of training: {sizes}")
    return "\n".join(lines)


def results_figure(plt, results: dict, summary: dict):
    """Accuracy per task, one bar per method, the first group average in the title (for
    ``linicl.reporting.plot``)."""
    tasks = list(results)
    methods = method_names(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(tasks)), 4))
    w = 0.8 / len(methods)
    colors = plt.get_cmap("tab20")  # 20 distinct colours: the default cycle repeats after 10 methods
    for j, m in enumerate(methods):
        ax.bar(np.arange(len(tasks)) + j * w, [results[t].get(m, np.nan) for t in tasks], w, label=m,
               color=colors(j % 20))
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - w / 2, tasks, rotation=30, ha="right")
    ax.set_ylabel("accuracy")
    group = next(g for g in ("ID", "OOD", "all") if g in summary)
    ax.set_title(f"In-Context Routing: {group} avg " + ", ".join(f"{m} {v:.2f}" for m, v in summary[group].items()),
                 fontsize=6)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig
