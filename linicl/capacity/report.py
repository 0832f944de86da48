"""The recall-capacity study's tables and figures, from its report (``experiments/recall_capacity.py``
writes it as JSON).

The report: ``config`` (the run's options, ``study.options``, with ``stages``), ``results`` (MQAR:
``{mixer: study.run's entry}``, each ``eval`` row as ``mqar.evaluate`` returns it), ``comparisons``
(``mqar.compare``) and ``regression`` (``config``, ``results`` with ``regression.evaluate``'s rows,
``baselines``: ``regression.baselines``, and its ``table``). Either task may be missing.

The figures take pyplot as their first argument (``linicl.reporting.plot`` passes it).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from linicl import reporting, stats

__all__ = ["mqar_table", "comparison_table", "mqar_tables", "regression_table", "regression_heading", "headline",
           "mqar_figure", "regression_figure", "FIGURES"]


def _fmt(iv: dict) -> str:
    return stats.Interval(iv["acc"], iv["low"], iv["high"]).fmt()


def _fmt_error(iv: dict) -> str:
    return stats.Interval(iv["mean"], iv["low"], iv["high"]).fmt(scale=1, digits=3)


def mqar_table(results: dict) -> str:
    """A markdown table, one row per mixer and number of pairs: prompt floats, prompted and converted
    accuracy with their 95 % Wilson intervals, and whether the predictions are the same."""
    rows = []
    for mixer, r in results.items():
        for e in r["eval"]:
            conv = (_fmt(e["converted"]), "yes" if e["identical"] else "NO") if "converted" in e \
                else ("not convertible (KV cache)", "")
            rows.append([mixer, e["pairs"], e["prompt_floats"], _fmt(e["prompted"]), *conv])
    return reporting.markdown_table(["mixer", "pairs", "prompt floats", "prompted acc % [95 % CI]",
                                     "converted acc % [95 % CI]", "same predictions"], rows)


def comparison_table(comps: list) -> str:
    """A markdown table of ``mqar.compare``'s rows: delta rule minus additive accuracy, in points."""
    rows = [[f"{c['delta']} - {c['additive']}", c["pairs"],
             stats.Interval(c["diff"], c["low"], c["high"]).fmt() + ("" if c["significant"] else " (n.s.)")]
            for c in comps]
    header = ["delta rule - additive", "pairs", "accuracy difference, points [95 % CI]"]
    return reporting.markdown_table(header, rows)


def mqar_tables(report: dict) -> str:
    """The MQAR table, then the delta-rule comparisons (when both mixers of a pair ran)."""
    comps = report["comparisons"]
    return mqar_table(report["results"]) + (("\n\n" + comparison_table(comps)) if comps else "")


def regression_table(reg: dict) -> str:
    """One row per mixer and k: prompt floats, prompted error (95 % bootstrap interval) and converted
    error; then the baselines, one row per k."""
    rows = []
    for mixer, r in reg["results"].items():
        for e in r["eval"]:
            conv = (f"{e['converted']:.3f}", f"yes ({e['max_rel_diff']:.0e})" if e["identical"] else "NO") \
                if "converted" in e else ("not convertible (KV cache)", "")
            rows.append([mixer, e["k"], e["prompt_floats"], _fmt_error(e["prompted"]), *conv])
    mixers = reporting.markdown_table(["mixer", "pairs k", "prompt floats", "prompted error [95 % CI]",
                                       "converted error", "same predictions (max rel. diff.)"], rows)
    base = [[k] + [_fmt_error(rows[i]["error"]) for rows in reg["baselines"].values()]
            for i, k in enumerate(reg["config"]["reg_k"])]
    header = ["pairs k"] + [f"{name} error" for name in reg["baselines"]]
    return mixers + "\n\n" + reporting.markdown_table(header, base)


def regression_heading(cfg: dict) -> str:
    """The regression table's one-line heading, from its ``config``."""
    return (f"In-context linear regression, d_x {cfg['reg_dx']}, d_model {cfg['d_model']}, {cfg['n_layers']} "
            f"layers, {cfg['n_heads']} heads, trained on {cfg['reg_examples']} pairs ({cfg['reg_steps']} steps "
            f"x {cfg['reg_batch']} tasks); error at the (k+1)-th x: (prediction - y)^2 / d_x (1: the zero "
            f"predictor), mean over {cfg['reg_eval_batch']} held-out tasks [95 % bootstrap CI]")


def headline(report: dict) -> str:
    """The tables of the tasks that ran: MQAR's (``mqar_tables``), then the regression's heading and
    table."""
    parts = [mqar_tables(report)] if "results" in report else []
    if "regression" in report:
        parts += [regression_heading(report["regression"]["config"]), report["regression"]["table"]]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------- figures
def _mixer_lines(ax, x, results: dict, colors: list, value: str, converted: Callable) -> None:
    """Per mixer its prompted ``value`` against ``x`` with the interval as error bars and, where every
    point has one, ``converted(row)`` as hollow markers; log2 x axis."""
    for c, (mixer, r) in zip(colors, results.items()):
        ivs = [e["prompted"] for e in r["eval"]]
        v = np.array([iv[value] for iv in ivs])
        low, high = (np.array([iv[end] for iv in ivs]) for end in ("low", "high"))
        err = [np.maximum(v - low, 0), np.maximum(high - v, 0)]  # a bootstrap interval may miss its mean
        ax.errorbar(x, v, yerr=err, color=c, marker=".", capsize=3, label=f"{mixer} ({r['state']})")
        if all("converted" in e for e in r["eval"]):
            ax.plot(x, [converted(e) for e in r["eval"]], "o", mfc="none", ms=11, color=c)
    ax.plot([], [], "o", mfc="none", color="k", ms=11, label="converted prompt (same)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(p) for p in x])
    ax.minorticks_off()


def _loss_curves(ax, results: dict, colors: list, ylabel: str, title: str, stage_steps=()) -> None:
    """Every mixer's training loss against the step, the stage boundaries dotted."""
    for c, (mixer, r) in zip(colors, results.items()):
        ax.plot([x["step"] for x in r["history"]], [x["loss"] for x in r["history"]], color=c, label=mixer)
    ax.set(yscale="log", xlabel="training step", ylabel=ylabel, title=title)
    for stage_end in np.cumsum(stage_steps)[:-1]:
        ax.axvline(stage_end, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=7)


def _colors(plt, n: int) -> list:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


def mqar_figure(plt, report: dict):
    """Accuracy against pairs (lines: prompted, markers: converted), and the training loss."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = _colors(plt, len(report["results"]))
    pairs = report["config"]["pairs"]
    _mixer_lines(a, pairs, report["results"], colors, "acc", lambda e: e["converted"]["acc"])
    a.set(xlabel="key-value pairs in the prompt", ylabel="recall accuracy (95 % Wilson)", ylim=(-0.02, 1.02),
          title="MQAR recall")
    a.legend(fontsize=7)
    _loss_curves(b, report["results"], colors, "training loss (query keys)", "curriculum",
                 [s["steps"] for s in report["config"]["stages"]])
    fig.tight_layout()
    return fig


def regression_figure(plt, report: dict):
    """Error against k (lines: prompted, hollow markers: converted, dashed: the baselines), and the
    training loss."""
    reg = report["regression"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = _colors(plt, len(reg["results"]))
    ks = reg["config"]["reg_k"]
    _mixer_lines(a, ks, reg["results"], colors, "mean", lambda e: e["converted"])
    for grey, (name, rows) in zip(("0.1", "0.4", "0.65"), reg["baselines"].items()):
        a.plot(ks, [e["error"]["mean"] for e in rows], ls="--", marker="x", color=grey, label=name)
    # least squares is exact (~1e-30) from k = d_x on: the axis stops below the models' errors
    lows = [e["prompted"]["low"] for r in reg["results"].values() for e in r["eval"]]
    a.set_yscale("log")
    a.set_ylim(bottom=max(1e-6, min([0.1] + [0.5 * x for x in lows if x > 0])))
    a.set(xlabel="(x, y) pairs in the prompt, k", ylabel="squared error / d_x at the next x (95 % bootstrap)",
          title=f"in-context linear regression, d_x = {reg['config']['reg_dx']}")
    a.legend(fontsize=7)
    _loss_curves(b, reg["results"], colors, "training loss (squared error / d_x)", "regression training")
    fig.tight_layout()
    return fig


# (the report's part it draws, its file name, the figure)
FIGURES = (("results", "recall_capacity.png", mqar_figure),
           ("regression", "recall_capacity_regression.png", regression_figure))
