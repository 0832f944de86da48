"""experiments/routing.py runs end to end in its quick mode on SmolLM2 and writes every number."""

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, smollm2_only
from linicl.stats import wilson

SCRIPT = REPO / "experiments" / "routing.py"
PHASES = ("load_s", "pids_s", "bases_s", "caching_s", "training_s", "function_vectors_s", "eval_s", "total_s")


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
    s = ex.summarise(results, {"ID": ["a", "b"], "near": [], "far": ["c"]})
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
    text = ex.table(results, s)
    assert "| a | ID | 40 | 50.0 [35.2, 64.8] | 90.0 [76.9, 96.0] | 70.0 [54.6, 81.9] | 47.5 [32.9, 62.5] |" in text
    assert "| **ID average** | | | 50.0 | 67.5 | 61.3 | 48.8 |" in text
    assert "| **collapses** | | | - | 0 | 1 | 0 |" in text and "ICR: collapses 1 (c)" in text
    assert "rec 0.50 [" in text and "COLLAPSED" in text and "Wilson" in text


def test_a_method_of_the_id_tasks_only_is_averaged_over_them():
    """The function vector is an ID baseline (as the paper): OOD rows lack it; averages, comparisons and
    the table use the tasks that have it and mark the others."""
    ex = _script()
    results = {"a": _row(40, **{"zero-shot": 20, "few-shot": 30, "function-vector": 26}),
               "b": _row(40, **{"zero-shot": 10, "few-shot": 30, "function-vector": 30}),
               "c": _row(40, **{"zero-shot": 30, "few-shot": 32})}
    assert ex.method_names(results) == ["zero-shot", "few-shot", "function-vector"]
    s = ex.summarise(results, {"ID": ["a", "b"], "near": [], "far": ["c"]})
    assert s["ID"]["function-vector"] == pytest.approx(0.7) and "function-vector" not in s["OOD"]
    assert s["all"]["function-vector"] == pytest.approx(0.7) and s["all"]["zero-shot"] == pytest.approx(0.5)
    assert "function-vector" not in s["compare"]["c"] and s["collapses"]["function-vector"] == 0
    text = ex.table(results, s)
    assert "| c | far | 40 | 75.0" in text and text.count(" - |") >= 2


def test_pids_against_the_random_basis_on_ood_pooled_and_paired():
    ex = _script()
    results = {"a": _row(40, **{"zero-shot": 20, "ICR-logit": 25, "ICR-logit-random": 20}),
               "b": _row(40, **{"zero-shot": 20, "ICR-logit": 20, "ICR-logit-random": 20}),
               "c": _row(40, **{"zero-shot": 20, "ICR-logit": 30, "ICR-logit-random": 20})}
    s = ex.summarise(results, {"ID": ["a"], "near": ["b"], "far": ["c"]})
    vs = s["targets"]["ICR-logit_vs_ICR-logit-random_OOD"]
    assert vs["value"] == pytest.approx(10 / 80) and vs["low"] > 0  # b: 0, c: +10 of 80 pooled
    assert "ICR-logit minus ICR-logit-random on the OOD tasks' pooled queries: 12.5" in ex.table(results, s)


def test_seeds_pool_and_few_shot_is_compared_on_its_own_items():
    """Rows of two seeds pool in seed order; a method scored on the first items only (the few-shot
    baseline) is compared with zero-shot on those items."""
    ex = _script()
    one = _row(4, **{"zero-shot": 2, "few-shot": 2, "ICR": 3})
    for row in (one,):
        d = row["detail"]["few-shot"]
        d["correct"], d["items"] = d["correct"][:2], [0, 1]
        for m in ("zero-shot", "ICR"):
            row["detail"][m]["items"] = list(range(4))
    two = _row(4, **{"zero-shot": 1, "few-shot": 4, "ICR": 1})
    for m in ("zero-shot", "few-shot", "ICR"):
        two["detail"][m]["items"] = list(range(4))
    pooled = ex.pool_seeds({"1": two, "0": one})
    assert pooled["n"] == 8 and pooled["seeds"] == [0, 1]
    assert pooled["detail"]["few-shot"]["items"] == [0, 1, 4, 5, 6, 7]
    assert pooled["few-shot"] == pytest.approx(6 / 6) and pooled["zero-shot"] == pytest.approx(3 / 8)
    few, zero = ex.aligned(pooled, "few-shot", "zero-shot")
    assert few.tolist() == [1, 1, 1, 1, 1, 1] and zero.tolist() == [1, 1, 1, 0, 0, 0]


def test_a_constant_predictor_is_marked():
    ex = _script()
    results = {"a": _row(10, **{"zero-shot": 5, "few-shot": 10, "ICR": 10, "task-vector": 0})}
    text = ex.table(results, ex.summarise(results, {"ID": ["a"], "near": [], "far": []}))
    assert "100.0 [72.2, 100.0] (const)" in text and "0.0 [0.0, 27.8] (const)" in text
    assert "50.0 [23.7, 76.3] |" in text  # zero-shot, 5 of 10 right: not constant


def test_flags_tasks_arms_seeds_and_bos():
    ex = _script()
    a = ex.parse_args(["--id-tasks", "sst2,trec", "--near-tasks", "mr", "--far-tasks", "cb_abc",
                       "--eval-tasks", "cb_abc,sst2", "--bos", "on"])
    assert ex.eval_task_names(a) == ["sst2", "cb_abc"] and ex.BOS_FLAG[a.bos] is True
    assert ex.eval_task_names(ex.parse_args(["--quick"])) == ["sst2", "mr", "cb_abc"]
    assert ex.BOS_FLAG[ex.parse_args([]).bos] is None  # auto: the tokenizer's convention
    paper = ex.parse_args(["--protocol", "paper"])
    assert (paper.pid_prompts, paper.train, paper.epochs, paper.n_eval, ex.seeds_of(paper)) == (1000, 5000, 2, 500,
                                                                                                 [0, 1, 2])
    assert (paper.batch, paper.lr, paper.pid_shots) == (4, 1e-4, 5)
    # which tasks are evaluated changes no task's numbers; BOS does
    q = ex.parse_args(["--quick"])
    assert ex.fingerprint(q) == ex.fingerprint(ex.parse_args(["--quick", "--eval-tasks", "cb_abc"]))
    assert ex.fingerprint(q) != ex.fingerprint(ex.parse_args(["--quick", "--bos", "on"]))
    for bad in (["--quick", "--eval-tasks", "trec"], ["--arms", "ICR,nope"], ["--seeds", "a"],
                ["--id-tasks", "sst2", "--pid-prompts", "4"]):
        run = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True, text=True)
        assert run.returncode == 2 and bad[-2] in run.stderr, bad
    assert "a PCA of rank r needs more than r prompts" in run.stderr


def test_the_fingerprint_ignores_only_where_the_output_goes():
    ex = _script()
    a = ex.parse_args(["--quick"])
    assert ex.fingerprint(a) == ex.fingerprint(ex.parse_args(["--quick", "--out", "elsewhere", "--resume"]))
    assert ex.fingerprint(a) != ex.fingerprint(ex.parse_args(["--quick", "--seed", "1"]))
    # --quick and --protocol set defaults: a flag given explicitly wins
    assert a.n_eval == 8 and ex.parse_args(["--quick", "--n-eval", "16"]).n_eval == 16
    assert ex.parse_args(["--protocol", "paper", "--seeds", "4"]).seeds == "4"
    assert ex.parse_args(["--protocol", "paper", "--quick"]).n_eval == 8
    # the function vectors' own settings are checked apart (a change redoes only them)
    assert ex.fingerprint(a) == ex.fingerprint(ex.parse_args(["--quick", "--fv-heads", "3", "--fv-screen", "9"]))


@smollm2_only
@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_quick_run_writes_json_and_plot(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "routing.json").read_text())
    assert set(record["results"]) == {"sst2", "mr", "cb_abc"} and record["add_bos"] is False
    for row in record["results"].values():
        for method in ("zero-shot", "few-shot", "task-vector", "ICR", "ICR-logit", "ICR-logit-random", "ICR-minilm"):
            d = row["detail"][method]
            assert 0.0 <= d["ci_low"] <= row[method] <= d["ci_high"] <= 1.0 and len(d["correct"]) == len(d["items"])
        assert len(row["detail"]["few-shot"]["correct"]) == 4 and len(row["detail"]["ICR"]["correct"]) == row["n"]
    for arm in ("ICR", "ICR-logit", "ICR-logit-random", "ICR-minilm"):
        assert all(math.isfinite(h["loss"]) for h in record["history"][arm])
        assert len(record["history"][arm][-1]["bias_size"]) == len(record["routed_layers"])
    # the logit-scale arms are calibrated; the PIDs and the random basis each to the model's spread
    assert record["bias_scale"]["pids_paper"] is None and len(record["bias_scale"]["random_logit"]) == 10
    assert len(record["logit_std"]) == 10 and "Bias sizes" in record["table"]
    assert all(record["timings"][k] > 0 for k in PHASES) and not record["resumed"]
    # the function vector: an ID baseline, from the heads patching chose (--fv-heads 2 of --fv-screen 4)
    assert "function-vector" in record["results"]["sst2"] and "function-vector" not in record["results"]["mr"]
    with np.load(tmp_path / "fv" / "sst2.npz") as f:
        assert f["heads"].shape == (2, 2) and np.sum(~np.isnan(f["effects"])) == 4 and int(f["layer"]) == 10
    assert "**collapses**" in run.stdout and "**collapses**" in (tmp_path / "routing.md").read_text()
    assert (tmp_path / "routing.png").stat().st_size > 0 and (tmp_path / "pids.npz").exists()
    for name in ("router_ICR.safetensors", "router_ICR-logit-random.safetensors", "ckpt/router_ICR.safetensors",
                 "progress.json", "pid_acts/sst2.npz", "cache/sst2.npz", "pids_random_logit.npz",
                 "cache/sst2.minilm.npz", "router_ICR-minilm.safetensors"):
        assert (tmp_path / name).exists(), name
    # A resumed run reuses everything (PIDs, routers, finished tasks) and reports the same numbers.
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((tmp_path / "routing.json").read_text())
    assert resumed["resumed"] and resumed["results"] == record["results"]
    assert resumed["timings"]["pids_s"] == record["timings"]["pids_s"]
    # --eval-tasks on a resume: the routers are reused and only the task asked for is reported
    only = subprocess.run(cmd + ["--resume", "--eval-tasks", "cb_abc"], capture_output=True, text=True, timeout=1800)
    assert only.returncode == 0, only.stderr[-3000:]
    one = json.loads((tmp_path / "routing.json").read_text())
    assert set(one["results"]) == {"cb_abc"} and one["results"]["cb_abc"] == record["results"]["cb_abc"]
    # other function-vector settings keep the routers and every other number; only the vector is redone
    more = subprocess.run(cmd + ["--resume", "--fv-heads", "3"], capture_output=True, text=True, timeout=1800)
    assert more.returncode == 0, more.stderr[-3000:]
    redone = json.loads((tmp_path / "routing.json").read_text())
    assert redone["fingerprint"] == record["fingerprint"]
    for task, row in record["results"].items():
        for m in row["detail"]:
            if m != "function-vector":
                assert redone["results"][task]["detail"][m] == row["detail"][m], (task, m)
    with np.load(tmp_path / "fv" / "sst2.npz") as f:
        assert f["heads"].shape == (3, 2)
