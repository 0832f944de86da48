"""experiments/routing.py runs end to end in its quick mode on SmolLM2 and writes every number."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from helpers import REPO, smollm2_only
from linicl.stats import wilson

SCRIPT = REPO / "experiments" / "routing.py"
PHASES = ("load_s", "pids_s", "caching_s", "training_s", "eval_s", "total_s")


def _script():
    spec = importlib.util.spec_from_file_location("routing_experiment", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help():
    assert "--quick" in subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                                       text=True).stdout


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
    ex = _script()
    results = {"a": _row(40, **{"zero-shot": 20, "few-shot": 36, "ICR": 28, "task-vector": 19}),
               "b": _row(40, **{"zero-shot": 20, "few-shot": 18, "ICR": 21, "task-vector": 20}),
               "c": _row(40, **{"zero-shot": 30, "few-shot": 32, "ICR": 5, "task-vector": 30})}
    s = ex.summarise(results, ["a", "b"], ["c"])
    assert s["ID"]["ICR"] == pytest.approx(0.6125) and s["OOD"]["ICR"] == pytest.approx(0.125)
    # 19 vs 20 (a) and 18 vs 20 (b) are below zero-shot, but not significantly: no collapse
    assert s["collapses"] == {"few-shot": 0, "ICR": 1, "task-vector": 0}
    assert s["collapsed_tasks"]["ICR"] == ["c"]
    assert s["targets"]["ICR_ID_gain_points"] == pytest.approx(11.25) and s["targets"]["ID_gain_at_least_5_points"]
    assert not s["targets"]["no_collapses"]
    pooled = s["targets"]["ICR_ID_gain_pooled"]
    assert pooled["value"] == pytest.approx(9 / 80) and pooled["low"] <= pooled["value"] <= pooled["high"]
    # recovered only where the few-shot gain is significant (a: 36 vs 20; not b, not c)
    rec = s["compare"]["a"]["ICR"]["recovered"]
    assert rec["value"] == pytest.approx(0.5) and rec["low"] < 0.5 < rec["high"]
    assert s["compare"]["b"]["ICR"]["recovered"] is None and s["compare"]["c"]["ICR"]["recovered"] is None
    text = ex.table(results, s, ["a", "b"], ["c"])
    assert "| a | ID | 40 | 50.0 [35.2, 64.8] | 90.0 [76.9, 96.0] | 70.0 [54.6, 81.9] | 47.5 [32.9, 62.5] |" in text
    assert "| **ID average** | | | 50.0 | 67.5 | 61.3 | 48.8 |" in text
    assert "| **collapses** | | | - | 0 | 1 | 0 |" in text and "NOT met (1: c)" in text
    assert "rec 0.50 [" in text and "COLLAPSED" in text and "Wilson" in text


def test_a_constant_predictor_is_marked():
    ex = _script()
    results = {"a": _row(10, **{"zero-shot": 5, "few-shot": 10, "ICR": 10, "task-vector": 0})}
    text = ex.table(results, ex.summarise(results, ["a"], []), ["a"], [])
    assert "100.0 [72.2, 100.0] (const)" in text and "0.0 [0.0, 27.8] (const)" in text
    assert "50.0 [23.7, 76.3] |" in text  # zero-shot, 5 of 10 right: not constant


def test_eval_tasks_and_bos_flags():
    ex = _script()
    a = ex.parse_args(["--id-tasks", "sst2,trec", "--ood-tasks", "cb", "--eval-tasks", "cb,sst2", "--bos", "on"])
    assert ex.eval_task_names(a) == ["sst2", "cb"] and ex.BOS_FLAG[a.bos] is True
    assert ex.eval_task_names(ex.parse_args(["--quick"])) == ["sst2", "cb"]
    assert ex.BOS_FLAG[ex.parse_args([]).bos] is None  # auto: the tokenizer's convention
    # which tasks are evaluated changes no task's numbers; BOS does
    q = ex.parse_args(["--quick"])
    assert ex.fingerprint(q) == ex.fingerprint(ex.parse_args(["--quick", "--eval-tasks", "cb"]))
    assert ex.fingerprint(q) != ex.fingerprint(ex.parse_args(["--quick", "--bos", "on"]))
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--eval-tasks", "trec"], capture_output=True,
                         text=True)
    assert run.returncode == 2 and "--eval-tasks" in run.stderr and "trec" in run.stderr


def test_the_fingerprint_ignores_only_where_the_output_goes():
    ex = _script()
    a = ex.parse_args(["--quick"])
    assert ex.fingerprint(a) == ex.fingerprint(ex.parse_args(["--quick", "--out", "elsewhere", "--resume"]))
    assert ex.fingerprint(a) != ex.fingerprint(ex.parse_args(["--quick", "--seed", "1"]))


@smollm2_only
@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_quick_run_writes_json_and_plot(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "routing.json").read_text())
    assert set(record["results"]) == {"sst2", "cb"} and record["add_bos"] is False  # SmolLM2 says no
    for row in record["results"].values():
        for method in ("zero-shot", "few-shot", "ICR", "ICR-random-basis", "task-vector"):
            d = row["detail"][method]
            assert 0.0 <= d["ci_low"] <= row[method] <= d["ci_high"] <= 1.0 and len(d["correct"]) == row["n"]
    assert all(math.isfinite(h["loss"]) for h in record["history"])
    assert all(record["timings"][k] > 0 for k in PHASES) and not record["resumed"]
    assert record["timings"]["total_s"] >= record["timings"]["eval_s"] + record["timings"]["training_s"]
    assert "**collapses**" in run.stdout and "**collapses**" in (tmp_path / "routing.md").read_text()
    assert (tmp_path / "routing.png").stat().st_size > 0 and (tmp_path / "pids.npz").exists()
    for name in ("router.safetensors", "router_random_basis.safetensors", "ckpt/router.safetensors", "progress.json"):
        assert (tmp_path / name).exists(), name
    # A resumed run reuses everything (PIDs, routers, finished tasks) and reports the same numbers.
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((tmp_path / "routing.json").read_text())
    assert resumed["resumed"] and resumed["results"] == record["results"]
    assert resumed["timings"]["pids_s"] == record["timings"]["pids_s"]
    # --eval-tasks on a resume: the router is reused and only the task asked for is reported
    only = subprocess.run(cmd + ["--resume", "--eval-tasks", "cb"], capture_output=True, text=True, timeout=1800)
    assert only.returncode == 0, only.stderr[-3000:]
    one = json.loads((tmp_path / "routing.json").read_text())
    assert set(one["results"]) == {"cb"} and one["results"]["cb"] == record["results"]["cb"]
