"""experiments/benchmarks/selection_vs_kvpress.py runs and reports what it should (no timing is asserted).

The quick mode runs in a subprocess on the tiny Llama GGUF fixture standing in for SmolLM2
(``LINICL_SMOLLM2_GGUF``), without a torch interpreter: every linicl score is timed against a prefill, the
kvpress side says it was skipped, and the JSON holds a table. The kvpress side itself is exercised when the
reference is written (tests/fixtures/hf/make_kvpress_reference.py) and compared in
tests/iclca/test_kvpress_parity.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from helpers import FIXTURES, REPO, json_numbers

SCRIPT = REPO / "experiments" / "benchmarks" / "selection_vs_kvpress.py"


def test_quick_run_times_every_score_and_skips_kvpress_without_torch(tmp_path):
    env = {**os.environ, "LINICL_SMOLLM2_GGUF": str(FIXTURES / "llama-tiny.gguf")}
    env.pop("LINICL_TORCH_PYTHON", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "selection_vs_kvpress.json").read_text())
    assert report["tokens"] == 256 and report["kvpress"].startswith("skipped")
    scores = report["linicl"]["scores"]
    assert set(scores) == {"reconstruction", "expected", "snapkv", "h2o", "recent"}
    assert all(r["median_s"] >= 0 and r["first_call_s"] >= 0 for r in scores.values())
    assert "kvpress not timed" in report["table"] and "| reconstruction |" in report["table"]
    assert all(math.isfinite(x) for x in json_numbers(report))


def test_help_names_the_torch_interpreter():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--torch-python" in out and "--quick" in out
