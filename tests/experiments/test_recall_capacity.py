"""experiments/recall_capacity.py: the quick mode runs both tasks and writes its JSON and plots, every
finite-state mixer's converted accuracy (MQAR) and error (regression) are its prompted ones (same
predictions), the regression baselines are what they must be (least squares exact past d_x pairs, the
zero predictor at 1), a second run reuses the checkpoints of both tasks, and bad options are usage
errors naming the option. The pieces (curriculum, configs, fingerprints, training and reuse, tables)
are tested in tests/capacity/test_study.py."""

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from linicl.capacity import mixers, regression, study
from linicl.errors import LiniclError
from helpers import REPO, json_numbers, run_script

SCRIPT = REPO / "experiments" / "recall_capacity.py"

_spec = importlib.util.spec_from_file_location("recall_capacity", SCRIPT)
rc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rc)


def run(*args) -> str:
    return run_script(SCRIPT, *args)


def test_help():
    out = run("--help")
    for flag in ("--quick", "--seed", "--steps", "--mixers", "--pairs", "--out", "--tasks", "--reg-steps", "--reg-dx",
                 "--reg-examples", "--reg-batch", "--reg-k", "--reg-eval-batch"):
        assert flag in out


def test_quick_run_converted_equals_prompted_and_resume_reuses_checkpoints(tmp_path):
    printed = run("--quick", "--no-progress", "--out", str(tmp_path))
    report = json.loads((tmp_path / "recall_capacity.json").read_text())
    assert (tmp_path / "recall_capacity.png").stat().st_size > 0
    assert printed.index("| mixer |") < printed.index("wrote ")          # the table comes first
    assert all(math.isfinite(x) for x in json_numbers(report))
    results = report["results"]
    assert list(results) == list(mixers.MIXERS)
    pairs = report["config"]["pairs"]
    for mixer, r in results.items():
        assert not r["reused_checkpoint"]
        assert [e["pairs"] for e in r["eval"]] == pairs
        for e in r["eval"]:
            assert e["queries"] == report["config"]["eval_batch"] * report["config"]["eval_queries"]
            assert e["prompted"]["low"] <= e["prompted"]["acc"] <= e["prompted"]["high"]
            if mixer == "softmax":                                       # a KV cache grows with the prompt
                assert "converted" not in e and e["prompt_floats"] == 2 * 2 * 2 * 8 * (2 * e["pairs"])
                continue
            assert e["identical"] and e["correct_converted"] == e["correct"]
            assert e["converted"] == e["prompted"]
            assert e["max_rel_logit_diff"] <= 1e-10                     # float64 evaluation
        assert (tmp_path / "checkpoints" / f"{mixer}.ckpt").is_file()
    assert {c["delta"] for c in report["comparisons"]} == {"delta", "gated_delta"}
    assert "same predictions" in report["table"]
    check_regression(report["regression"], tmp_path)
    assert (tmp_path / "recall_capacity_regression.png").stat().st_size > 0
    assert printed.index("| mixer |") < printed.index("In-context linear regression") < printed.index("wrote ")
    assert "In-context linear regression" in report["table"]                # RESULTS.md's headline has both

    # A second run (a subset of the mixers) loads the checkpoints of both tasks and reproduces the numbers.
    files = [f"{prefix}{m}.ckpt" for prefix in ("", "regression_") for m in ("linear", "gated_delta")]
    stamps = {f: (tmp_path / "checkpoints" / f).stat().st_mtime_ns for f in files}
    run("--quick", "--no-progress", "--out", str(tmp_path), "--mixers", "linear", "gated_delta")
    report2 = json.loads((tmp_path / "recall_capacity.json").read_text())
    again, reg_again = report2["results"], report2["regression"]["results"]
    assert list(again) == list(reg_again) == ["linear", "gated_delta"]
    assert {f: (tmp_path / "checkpoints" / f).stat().st_mtime_ns for f in files} == stamps
    for mixer, r in again.items():
        assert r["reused_checkpoint"] and reg_again[mixer]["reused_checkpoint"]
        assert [e["correct"] for e in r["eval"]] == [e["correct"] for e in results[mixer]["eval"]]
        assert reg_again[mixer]["eval"] == report["regression"]["results"][mixer]["eval"]

    # The regression alone: no MQAR part, no MQAR plot written.
    (tmp_path / "recall_capacity.png").unlink()
    printed = run("--quick", "--no-progress", "--out", str(tmp_path), "--mixers", "delta", "--tasks", "regression")
    alone = json.loads((tmp_path / "recall_capacity.json").read_text())
    assert "results" not in alone and list(alone["regression"]["results"]) == ["delta"]
    assert alone["regression"]["results"]["delta"]["reused_checkpoint"] and "MQAR" not in printed
    assert not (tmp_path / "recall_capacity.png").exists()


def check_regression(reg: dict, out) -> None:
    """The regression part of a quick run: every mixer and k, converted = prompted for every finite-state
    mixer, the baselines on the same tasks."""
    ks, d_x = reg["config"]["reg_k"], reg["config"]["reg_dx"]
    assert list(reg["results"]) == list(mixers.MIXERS)
    for mixer, r in reg["results"].items():
        assert not r["reused_checkpoint"] and r["history"]
        assert [e["k"] for e in r["eval"]] == ks
        for e in r["eval"]:
            assert e["prompted"]["low"] <= e["prompted"]["mean"] <= e["prompted"]["high"]
            if mixer == "softmax":                                       # a KV cache grows with the prompt
                assert "converted" not in e and e["prompt_floats"] == 2 * 2 * 2 * 8 * (2 * e["k"])
                continue
            assert e["identical"] and e["max_rel_diff"] <= 1e-10        # float64 evaluation
            assert e["converted"] == pytest.approx(e["prompted"]["mean"], rel=1e-9)
        assert (out / "checkpoints" / f"regression_{mixer}.ckpt").is_file()
    base = reg["baselines"]
    assert list(base) == list(regression.BASELINES) and any(k >= d_x + 1 for k in ks)
    tasks = study.regression_tasks(study.options(quick=True))
    for i, k in enumerate(ks):
        assert [rows[i]["k"] for rows in base.values()] == [k] * 3
        if k >= d_x + 1:                                                 # noise-free: w is determined
            assert base["least squares"][i]["error"]["mean"] <= 1e-6
        zero = base["zero"][i]["error"]["mean"]
        assert zero == pytest.approx(np.mean(tasks.ys[:, k] ** 2) / d_x, rel=1e-12)
        # E[y^2] / d_x = 1; the per-task error y^2 / d_x has sd sqrt(5) at d_x = 2: 4 standard errors
        assert abs(zero - 1) <= 4 * np.sqrt(5 / len(tasks.ys))


@pytest.mark.parametrize("changes,match", [
    (dict(pairs=[4, 40]), "--pairs 40 distinct keys"),
    (dict(train_pairs=[64]), "--train-pairs 64"),
    (dict(eval_queries=8, pairs=[4, 8]), "--eval-queries 8"),
    (dict(vocab=15), "--vocab must be even"),
    (dict(mixers=["mamba"]), "unknown mixer 'mamba'"),
    (dict(tasks=["mqar", "ridge"]), "--tasks: unknown task 'ridge'"),
    (dict(d_model=30), "divisible by n_heads"),
    (dict(quick=True, short_conv=1), "short_conv"),
])
def test_bad_options_name_the_option(changes, match):
    with pytest.raises(LiniclError, match=match):
        rc.check_options(study.options(**changes))


def test_bad_option_is_a_usage_error():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--pairs", "4,40"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 2 and "--pairs 40" in proc.stderr
