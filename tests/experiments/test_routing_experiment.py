"""experiments/routing.py runs end to end in its quick mode on SmolLM2 and writes every number."""

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, smollm2_only

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
    # the hash a saved run's progress.json carries: --resume of a run made before must find it unchanged
    assert ex.fingerprint(a) == "6adfae350b63"


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
    assert not (tmp_path / "ckpt" / "router_ICR.safetensors").exists()  # superseded by the saved router
    for name in ("router_ICR.safetensors", "router_ICR-logit-random.safetensors",
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
