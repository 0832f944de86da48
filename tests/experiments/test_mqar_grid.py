"""experiments/mqar_grid.py: recall_capacity runs with and without a short convolution over seeds, the
delta rule against its additive twin paired over the same queries, resumed without rerunning."""

import importlib.util
import json
import subprocess
import sys

import numpy as np

from helpers import REPO

SCRIPT = REPO / "experiments" / "mqar_grid.py"
_spec = importlib.util.spec_from_file_location("mqar_grid", SCRIPT)
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)


def _run(hits_by_mixer: dict, pairs: int = 4) -> dict:
    return {"results": {m: {"eval": [{"pairs": pairs, "hits": h, "prompt_floats": 10}]} for m, h in hits_by_mixer.items()}}


def test_comparisons_pair_the_same_queries_of_every_seed():
    rng = np.random.default_rng(0)
    runs = {}
    for seed in (0, 1, 2):
        linear = rng.random(200) < 0.3
        runs[(0, seed)] = _run({"linear": linear.tolist(), "delta": (linear | (rng.random(200) < 0.4)).tolist()})
    c = mg.compare(runs, 0, "delta", "linear", 4)
    assert c["pooled"]["low"] > 0 and c["significant"] and len(c["per_seed"]) == 3
    same = mg.compare(runs, 0, "linear", "linear", 4)
    assert same["pooled"] == {"value": 0.0, "low": 0.0, "high": 0.0} and not same["significant"]
    a = mg.accuracy(runs, 0, "linear", 4)
    assert a["queries"] == 600 and a["low"] < a["value"] < a["high"]


def test_quick_grid_runs_and_resumes(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "mqar_grid.json").read_text())
    s = report["summary"]
    assert report["convs"] == [0, 3] and s["mixers"] == ["linear", "delta"]
    assert set(s["delta_vs_additive"]) == {"conv0", "conv3"} and set(s["conv_effect"]) == {"linear", "delta"}
    assert (tmp_path / "mqar_grid.png").stat().st_size > 0
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/recall_capacity.json")}
    assert len(stamps) == 4
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing rerun
    bad = subprocess.run([sys.executable, str(SCRIPT), "--conv", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--conv" in bad.stderr
