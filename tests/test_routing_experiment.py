"""experiments/routing.py runs end to end in its quick mode on SmolLM2 and writes every number."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from test_pretrained import smollm2_only

SCRIPT = pathlib.Path(__file__).parent.parent / "experiments" / "routing.py"
PHASES = ("load_s", "pids_s", "caching_s", "training_s", "eval_s", "total_s")


def _script():
    spec = importlib.util.spec_from_file_location("routing_experiment", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help():
    assert "--quick" in subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                                       text=True).stdout


def test_summary_counts_collapses_and_checks_the_targets():
    ex = _script()
    results = {"a": {"zero-shot": 0.5, "few-shot": 0.7, "ICR": 0.6, "task-vector": 0.4, "n": 10, "metric": "m"},
               "b": {"zero-shot": 0.5, "few-shot": 0.4, "ICR": 0.52, "task-vector": 0.5, "n": 10, "metric": "m"},
               "c": {"zero-shot": 0.3, "few-shot": 0.5, "ICR": 0.2, "task-vector": 0.3, "n": 10, "metric": "m"}}
    s = ex.summarise(results, ["a", "b"], ["c"])
    assert s["ID"]["ICR"] == pytest.approx(0.56) and s["OOD"]["ICR"] == pytest.approx(0.2)
    assert s["collapses"] == {"few-shot": 1, "ICR": 1, "task-vector": 1}
    assert s["collapsed_tasks"]["ICR"] == ["c"]
    assert s["targets"]["ICR_ID_gain_points"] == pytest.approx(6.0) and s["targets"]["ID_gain_at_least_5_points"]
    assert not s["targets"]["no_collapses"]
    text = ex.table(results, s, ["a", "b"], ["c"])
    assert "| a | ID | 10 | 50.0 | 70.0 | 60.0 | 40.0 |" in text
    assert "| **ID average** | | | 50.0 | 55.0 | 56.0 | 45.0 |" in text
    assert "| **collapses** | | | - | 1 | 1 | 1 |" in text and "NOT met (1: c)" in text


def test_the_fingerprint_ignores_only_where_the_output_goes():
    ex = _script()
    a = ex.parse_args(["--quick"])
    assert ex.fingerprint(a) == ex.fingerprint(ex.parse_args(["--quick", "--out", "elsewhere", "--resume"]))
    assert ex.fingerprint(a) != ex.fingerprint(ex.parse_args(["--quick", "--seed", "1"]))


@smollm2_only
@pytest.mark.skipif(not os.environ.get("LINICL_DATA_DIR"), reason="needs LINICL_DATA_DIR (CI sets it)")
def test_quick_run_writes_json_and_plot(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "routing.json").read_text())
    assert set(record["results"]) == {"sst2", "cb"}
    for row in record["results"].values():
        for method in ("zero-shot", "few-shot", "ICR", "ICR-random-basis", "task-vector"):
            assert 0.0 <= row[method] <= 1.0
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
