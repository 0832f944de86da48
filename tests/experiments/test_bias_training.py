"""experiments/bias_training.py (ICLCA Figure 1), the command line of linicl.bias_training (whose own
tests are tests/iclca/test_bias_training.py): --help, argument errors before any training, and the quick
mode writes finite numbers and a plot."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from linicl.bias_training import WARM
from helpers import REPO

ROOT = REPO
SCRIPT = ROOT / "experiments" / "bias_training.py"

_spec = importlib.util.spec_from_file_location("bias_training", SCRIPT)
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)


def test_help_and_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        bt.main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
    for argv, match in ((["--steps", "7", "--eval-every", "5"], "multiple"),
                        (["--seeds", "1", "1"], "different"),
                        (["--seq-len", "9"], "even")):
        with pytest.raises(SystemExit) as e:
            bt.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_quick_run_writes_finite_json_and_plot(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "bias_training.json").read_text())
    cfg = report["config"]
    assert cfg["quick"] and cfg["seeds"] == [0, 1, 2]
    assert set(report["arms"]) == {"baseline", "bias", "bias_nonneg", "bias_B_only", "bias_warm"}
    for arm, r in report["arms"].items():
        assert r["finite"], arm
        assert r["eval_steps"] == list(range(0, cfg["steps"] + 1, cfg["eval_every"]))
        for seed in ("0", "1", "2"):
            assert len(r["train"]["loss"][seed]) == cfg["steps"]
            assert len(r["eval"]["ctx_acc"][seed]) == len(r["eval_steps"])
            assert all(np.isfinite(r["train"]["loss"][seed]))
        assert set(r["steps_to_ctx_acc"]) == {"0.5", "0.9"}
        assert np.isfinite(r["final"]["ctx_acc"]["mean"]) and 0 <= r["final"]["ctx_acc"]["mean"] <= 1
        assert r["denominators"]["min_train"] > 0 and r["timing"]["train_s"] > 0
    # the same init and held-out batch, and a zero bias: at step 0 every arm but the warm one has the same loss
    first = {arm: r["eval"]["loss"]["0"][0] for arm, r in report["arms"].items()}
    cold = [v for arm, v in first.items() if arm not in WARM]
    assert cold == pytest.approx([cold[0]] * len(cold), rel=1e-5)
    assert first["bias_warm"] != pytest.approx(cold[0], rel=1e-5)
    assert report["arms"]["bias_nonneg"]["denominators"]["min_z_bias_entry"] >= 0
    assert (tmp_path / "bias_training.png").stat().st_size > 0
    assert report["wall_s"] > 0
