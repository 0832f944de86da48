"""The ICR protocol's results (linicl.routing.summary, linicl.routing.report): rows pooled over seeds,
paired comparisons on shared items, collapses only when significant, the targets, and the tables."""

import numpy as np
import pytest

from linicl import routing
from linicl.errors import LiniclError
from linicl.stats import wilson


def _row(n: int, **hits) -> dict:
    """A result row of ``n`` queries, method -> queries right (the first ones, or ``(hits, start)``)."""
    row, detail = {}, {}
    for method, h in hits.items():
        start = 0
        if isinstance(h, tuple):
            h, start = h
        correct = [int(start <= i < start + h) for i in range(n)]
        distinct = len(set(correct))  # stands in for the predictions: all right or all wrong is constant
        iv = wilson(h, n)
        detail[method] = dict(ci_low=iv.low, ci_high=iv.high, distinct=distinct, constant=distinct == 1,
                              correct=correct)
        row[method] = h / n
    return dict(row, n=n, metric="m", detail=detail)


def test_summary_counts_only_significant_collapses_and_checks_the_targets():
    results = {"a": _row(40, **{"zero-shot": 20, "few-shot": 36, "ICR": 28, "task-vector": 19}),
               "b": _row(40, **{"zero-shot": 20, "few-shot": 18, "ICR": 21, "task-vector": 20}),
               "c": _row(40, **{"zero-shot": 30, "few-shot": 32, "ICR": 5, "task-vector": 30})}
    s = routing.summarise(results, {"ID": ["a", "b"], "near": [], "far": ["c"]})
    assert s["ID"]["ICR"] == pytest.approx(0.6125) and s["OOD"]["ICR"] == pytest.approx(0.125)
    assert s["far"]["ICR"] == pytest.approx(0.125) and "near" not in s
    # 19 vs 20 (a) and 18 vs 20 (b) are below zero-shot, but not significantly: no collapse
    assert s["collapses"] == {"few-shot": 0, "ICR": 1, "task-vector": 0}
    assert s["collapsed_tasks"]["ICR"] == ["c"]
    t = s["targets"]["ICR"]
    assert t["ID_gain_points"] == pytest.approx(11.25) and t["ID_gain_at_least_5_points"] and not t["no_collapses"]
    pooled = t["ID_gain_pooled"]
    assert pooled["value"] == pytest.approx(9 / 80) and pooled["low"] <= pooled["value"] <= pooled["high"]
    # recovered only where the few-shot gain is significant (a: 36 vs 20; not b, not c)
    rec = s["compare"]["a"]["ICR"]["recovered"]
    assert rec["value"] == pytest.approx(0.5) and rec["low"] < 0.5 < rec["high"]
    assert s["compare"]["b"]["ICR"]["recovered"] is None and s["compare"]["c"]["ICR"]["recovered"] is None
    text = routing.results_table(results, s)
    assert "| a | ID | 40 | 50.0 [35.2, 64.8] | 90.0 [76.9, 96.0] | 70.0 [54.6, 81.9] | 47.5 [32.9, 62.5] |" in text
    assert "| **ID average** | | | 50.0 | 67.5 | 61.3 | 48.8 |" in text
    assert "| **collapses** | | | - | 0 | 1 | 0 |" in text and "ICR: collapses 1 (c)" in text
    assert "rec 0.50 [" in text and "COLLAPSED" in text and "Wilson" in text


def test_a_method_of_the_id_tasks_only_is_averaged_over_them():
    """The function vector is an ID baseline (as the paper): OOD rows lack it; averages, comparisons and
    the table use the tasks that have it and mark the others."""
    results = {"a": _row(40, **{"zero-shot": 20, "few-shot": 30, "function-vector": 26}),
               "b": _row(40, **{"zero-shot": 10, "few-shot": 30, "function-vector": 30}),
               "c": _row(40, **{"zero-shot": 30, "few-shot": 32})}
    assert routing.method_names(results) == ["zero-shot", "few-shot", "function-vector"]
    s = routing.summarise(results, {"ID": ["a", "b"], "near": [], "far": ["c"]})
    assert s["ID"]["function-vector"] == pytest.approx(0.7) and "function-vector" not in s["OOD"]
    assert s["all"]["function-vector"] == pytest.approx(0.7) and s["all"]["zero-shot"] == pytest.approx(0.5)
    assert "function-vector" not in s["compare"]["c"] and s["collapses"]["function-vector"] == 0
    text = routing.results_table(results, s)
    assert "| c | far | 40 | 75.0" in text and text.count(" - |") >= 2


def test_pids_against_the_random_basis_on_ood_pooled_and_paired():
    results = {"a": _row(40, **{"zero-shot": 20, "ICR-logit": 25, "ICR-logit-random": 20}),
               "b": _row(40, **{"zero-shot": 20, "ICR-logit": 20, "ICR-logit-random": 20}),
               "c": _row(40, **{"zero-shot": 20, "ICR-logit": 30, "ICR-logit-random": 20})}
    s = routing.summarise(results, {"ID": ["a"], "near": ["b"], "far": ["c"]})
    vs = s["targets"]["ICR-logit_vs_ICR-logit-random_OOD"]
    assert vs["value"] == pytest.approx(10 / 80) and vs["low"] > 0  # b: 0, c: +10 of 80 pooled
    text = routing.results_table(results, s)
    assert "ICR-logit minus ICR-logit-random on the OOD tasks' pooled queries: 12.5" in text


def test_seeds_pool_and_few_shot_is_compared_on_its_own_items():
    """Rows of two seeds pool in seed order; a method scored on the first items only (the few-shot
    baseline) is compared with zero-shot on those items."""
    one = _row(4, **{"zero-shot": 2, "few-shot": 2, "ICR": 3})
    for row in (one,):
        d = row["detail"]["few-shot"]
        d["correct"], d["items"] = d["correct"][:2], [0, 1]
        for m in ("zero-shot", "ICR"):
            row["detail"][m]["items"] = list(range(4))
    two = _row(4, **{"zero-shot": 1, "few-shot": 4, "ICR": 1})
    for m in ("zero-shot", "few-shot", "ICR"):
        two["detail"][m]["items"] = list(range(4))
    pooled = routing.pool_seeds({"1": two, "0": one})
    assert pooled["n"] == 8 and pooled["seeds"] == [0, 1]
    assert pooled["detail"]["few-shot"]["items"] == [0, 1, 4, 5, 6, 7]
    assert pooled["few-shot"] == pytest.approx(6 / 6) and pooled["zero-shot"] == pytest.approx(3 / 8)
    few, zero = routing.aligned(pooled, "few-shot", "zero-shot")
    assert few.tolist() == [1, 1, 1, 1, 1, 1] and zero.tolist() == [1, 1, 1, 0, 0, 0]


def test_a_constant_predictor_is_marked():
    results = {"a": _row(10, **{"zero-shot": 5, "few-shot": 10, "ICR": 10, "task-vector": 0})}
    text = routing.results_table(results, routing.summarise(results, {"ID": ["a"], "near": [], "far": []}))
    assert "100.0 [72.2, 100.0] (const)" in text and "0.0 [0.0, 27.8] (const)" in text
    assert "50.0 [23.7, 76.3] |" in text  # zero-shot, 5 of 10 right: not constant


def test_merge_row_adds_the_new_methods_to_an_earlier_row():
    old = _row(4, **{"zero-shot": 2, "ICR": 1})
    new = _row(4, **{"few-shot": 3})
    merged = routing.merge_row(old, new)
    assert routing.method_names({"t": merged}) == ["zero-shot", "ICR", "few-shot"]
    assert merged["few-shot"] == 0.75 and merged["detail"]["ICR"] == old["detail"]["ICR"]
    assert routing.merge_row({}, new) == new and "few-shot" not in old  # old is left as it was


def test_pooled_difference_pools_the_items_of_the_tasks_before_comparing():
    results = {"a": _row(10, **{"x": 10, "y": 0}), "b": _row(30, **{"x": 0, "y": 0})}
    d = routing.pooled_difference(results, ["a", "b"], "x", "y")
    assert d.value == pytest.approx(10 / 40)  # not the mean of the per-task differences (0.5)
    assert d.low <= d.value <= d.high
    results["c"] = _row(10, **{"x": 0})  # a task without y is left out
    assert routing.pooled_difference(results, ["a", "b", "c"], "x", "y") == d
    with pytest.raises(LiniclError, match="both"):
        routing.pooled_difference(results, ["c"], "x", "y")


def test_aligned_and_pool_seeds_refuse_what_is_not_there():
    row = _row(4, **{"zero-shot": 2})
    with pytest.raises(LiniclError, match="methods"):
        routing.aligned(row, "zero-shot", "ICR")
    with pytest.raises(LiniclError, match="per_seed"):
        routing.pool_seeds({})
    assert isinstance(LiniclError("x"), ValueError)


def test_formatters_and_bias_lines():
    row = _row(10, **{"zero-shot": 5})
    assert routing.fmt_accuracy(row, "zero-shot") == "50.0 [23.7, 76.3]" and routing.fmt_accuracy(row, "ICR") == "-"
    c = {"vs_zero": {"value": 0.125, "low": 0.031, "high": 0.219}, "collapsed": False,
         "recovered": {"value": 0.8, "low": 0.31, "high": 1.2}}
    assert routing.fmt_comparison(c) == "12.5 [3.1, 21.9]; rec 0.80 [0.31, 1.20]"
    assert routing.fmt_comparison(dict(c, recovered=None, collapsed=True)).endswith(" COLLAPSED")
    text = routing.bias_lines({"ICR": [{"loss": 1.0}, {"loss": 0.5, "bias_size": [0.1, 0.25]}], "none": []},
                              [1.0, 2.5])
    assert text.splitlines() == ["- model's own logit std over keys, per routed layer: 1.00, 2.50",
                                 "- ICR: bias std at the end of training: 0.10, 0.25"]
    assert routing.bias_lines({}, None) == ""


def test_results_figure_draws_one_bar_per_task_and_method():
    plt = pytest.importorskip("matplotlib.pyplot")
    results = {"a": _row(10, **{"zero-shot": 5, "ICR": 6}), "b": _row(10, **{"zero-shot": 4})}
    fig = routing.results_figure(plt, results, routing.summarise(results, {"ID": ["a", "b"]}))
    assert len(fig.axes[0].patches) == 4 and np.isnan(fig.axes[0].patches[3].get_height())
    plt.close(fig)
