"""The implicit-update experiments and their benchmark run in quick mode and write finite numbers."""

import json
import math

from helpers import REPO, json_numbers, run_script as run

ROOT = REPO
SCRIPTS = ROOT / "experiments"


def test_innocenti_achour_quick(tmp_path):
    assert "--ln" in run(SCRIPTS / "implicit_regression.py", "--help")
    run(SCRIPTS / "implicit_regression.py", "--quick", "--no-progress", "--out", str(tmp_path))
    report = json.loads((tmp_path / "implicit_regression_none_float32.json").read_text())
    values = json_numbers(report)
    assert len(values) > 1000 and all(math.isfinite(x) for x in values)
    for row in report["msd_steps"].values():
        assert max(row["msd"]) <= 1e-10                       # float32 rounding, not a modelling error
        assert max(row["rank_sum_max"]) == 1
        assert abs(row["loss_implicit_network"] - row["loss_model"]) <= 1e-4 * row["loss_model"]
    curves = report["curves"]
    assert len(curves["model"]) == report["config"]["steps"] + 1
    assert max(abs(a - b) for a, b in zip(curves["model"], curves["implicit_last_block"])) <= 1e-4
    assert (tmp_path / "implicit_regression_none_float32_fig1.png").stat().st_size > 0
    assert (tmp_path / "implicit_regression_none_float32_align_blocks.png").stat().st_size > 0


def test_dherin_quick(tmp_path):
    assert "--ft-steps" in run(SCRIPTS / "implicit_dherin.py", "--help")
    run(SCRIPTS / "implicit_dherin.py", "--quick", "--no-progress", "--out", str(tmp_path))
    report = json.loads((tmp_path / "implicit_dherin_float32.json").read_text())
    assert all(math.isfinite(x) for x in json_numbers(report))
    n = report["config"]["n_context"]
    assert len(report["loss_with_context"]) == n + 1 and len(report["step_norm_median"]) == n
    assert report["max_abs_pred_diff"] <= 1e-4 * max(1.0, report["pred_scale"])
    assert {r["n"] for r in report["finetuning"]} == set(report["config"]["ft_lengths"])
    for r in report["finetuning"]:  # ΔW(C_n) on the query alone is the in-context prediction (same tasks)
        assert abs(r["loss_implicit"] - r["loss_in_context"]) <= 1e-4 * max(1.0, r["loss_in_context"])
    assert (tmp_path / "implicit_dherin_float32.png").stat().st_size > 0


def test_benchmark_quick(tmp_path):
    run(SCRIPTS / "benchmarks" / "implicit_speed.py", "--quick", "--no-end-to-end", "--repeats", "1",
        "--out", str(tmp_path))
    report = json.loads((tmp_path / "implicit_speed.json").read_text())
    assert [r["model"] for r in report["operators"]] == ["fig1-no-ln"]
    assert all(math.isfinite(x) and x > 0 for r in report["operators"] for x in json_numbers(r))
    assert (tmp_path / "implicit_speed.png").stat().st_size > 0
