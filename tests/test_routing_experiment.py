"""experiments/routing.py runs end to end in its quick mode on SmolLM2 and writes every number."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from test_pretrained import smollm2_only

SCRIPT = pathlib.Path(__file__).parent.parent / "experiments" / "routing.py"


def test_help():
    assert "--quick" in subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                                       text=True).stdout


@smollm2_only
@pytest.mark.skipif(not os.environ.get("LINICL_DATA_DIR"), reason="needs LINICL_DATA_DIR (CI sets it)")
def test_quick_run_writes_json_and_plot(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "routing.json").read_text())
    assert set(record["results"]) == {"sst2", "cb"}
    for row in record["results"].values():
        for method in ("zero-shot", "few-shot", "ICR", "ICR-random-basis", "task-vector"):
            assert 0.0 <= row[method] <= 1.0
    assert all(math.isfinite(h["loss"]) for h in record["history"])
    assert (tmp_path / "routing.png").stat().st_size > 0 and (tmp_path / "pids.npz").exists()
    assert (tmp_path / "router.msgpack").exists()
