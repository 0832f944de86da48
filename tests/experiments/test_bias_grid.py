"""experiments/bias_grid.py: the ICLCA Fig. 1 grid has >= 24 distinct settings, its verdict pairs arms
over seeds with censoring, and a quick run writes every setting and resumes without rerunning them."""

import importlib.util
import json
import shutil
import subprocess
import sys

from helpers import REPO

SCRIPT = REPO / "experiments" / "bias_grid.py"
_spec = importlib.util.spec_from_file_location("bias_grid", SCRIPT)
bg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bg)


def test_the_grid_covers_the_unknowns():
    grid = bg.settings(quick=False)
    assert len(grid) >= 24 and len({tuple(a) for a in grid.values()}) == len(grid)
    assert sum("--task facts" in " ".join(a) for a in grid.values()) == 4
    joined = [" ".join(a) for a in grid.values()]
    for needle in ("--feature-map hedgehog", "--feature-map elu+1", "--positions learned", "--decay",
                   "--vocab 256", "--vocab 16", "--lr 3e-3"):
        assert any(needle in j for j in joined), needle


def _summary(base_steps, arm_steps, never=1050):
    arm = lambda steps: dict(steps={"0.5": steps, "0.9": steps},  # noqa: E731
                             reached={"0.5": [s < never for s in steps], "0.9": [s < never for s in steps]},
                             final_ctx_acc=[0.9, 0.9, 0.9], finite=True, min_denominator=0.1)
    return dict(seeds=[0, 1, 2], arms=dict(baseline=arm(base_steps), bias_nonneg=arm(arm_steps)))


def test_verdict_pairs_seeds_and_counts_censored_runs():
    sooner = bg.verdict(_summary([600, 650, 700], [400, 420, 480]))["bias_nonneg"]["steps_0.9"]
    assert sooner["sooner"] and not sooner["later"] and sooner["diff"]["value"] < -200
    noisy = bg.verdict(_summary([600, 650, 700], [300, 700, 500]))["bias_nonneg"]["steps_0.9"]
    assert not noisy["sooner"] and not noisy["later"]  # mean -150, but the seeds disagree
    censored = bg.verdict(_summary([1050, 1050, 1050], [500, 600, 550]))["bias_nonneg"]["steps_0.9"]
    assert censored["sooner"] and censored["reached"] == 3 and censored["baseline_reached"] == 0


def test_verdict_names_every_significant_difference():
    same = bg.verdict(_summary([600, 650, 700], [600, 650, 700]))["bias_nonneg"]
    assert bg.verdict_words(same) == ["no difference"]
    summary = _summary([600, 650, 700], [400, 420, 480])
    summary["arms"]["bias_nonneg"]["steps"]["0.5"] = [300, 310, 320]
    summary["arms"]["baseline"]["steps"]["0.5"] = [200, 220, 230]
    summary["arms"]["bias_nonneg"]["final_ctx_acc"] = [0.95, 0.96, 0.94]
    words = bg.verdict_words(bg.verdict(summary)["bias_nonneg"])
    assert words == ["sooner to 90 %", "later to 50 %", "higher final acc"]
    counts = bg.overall(dict(s=dict(summary=summary, verdict=bg.verdict(summary))))["per_arm"]["bias_nonneg"]
    assert counts["sooner"] == counts["later_50"] == counts["higher"] == ["s"] and not counts["sooner_50"]


def test_quick_grid_writes_every_setting_and_resumes(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)]
    # one setting (as a process given an --only list): a partial report, never the grid's
    first = subprocess.run(cmd + ["--only", "quick-elu+1"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    partial = json.loads((tmp_path / "bias_grid_partial.json").read_text())
    assert list(partial["results"]) == ["quick-elu+1"] and not partial["complete"]
    assert not (tmp_path / "bias_grid.json").exists() and "1 of 2 settings" in first.stdout
    done_first = (tmp_path / "quick-elu+1" / "bias_training.json").stat().st_mtime_ns
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "quick-elu+1" / "bias_training.json").stat().st_mtime_ns == done_first  # resumed
    report = json.loads((tmp_path / "bias_grid.json").read_text())
    assert set(report["results"]) == set(bg.settings(quick=True)) and report["complete"]
    for r in report["results"].values():
        assert set(r["verdict"]) == set(bg.BIAS_ARMS)
    assert "Δ steps to 90 %" in report["table"] and (tmp_path / "bias_grid.png").stat().st_size > 0
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/bias_training.json")}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing rerun
    bad = subprocess.run([sys.executable, str(SCRIPT), "--seeds", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--seeds" in bad.stderr
    # finished settings of other seeds are refused before anything trains (one OUT, one kind of run)
    other = subprocess.run(cmd + ["--seeds", "0", "1"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "another --out" in other.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # --settings makes a smaller grid, whose report is complete when its settings are done
    sub = tmp_path / "sub"
    (sub / "quick-elu+1").mkdir(parents=True)
    shutil.copy(tmp_path / "quick-elu+1" / "summary.json", sub / "quick-elu+1")
    part = subprocess.run(cmd[:-1] + [str(sub), "--settings", "quick-elu+1"], capture_output=True, text=True,
                          timeout=300)
    assert part.returncode == 0, part.stderr[-2000:]
    small = json.loads((sub / "bias_grid.json").read_text())
    assert small["complete"] and small["grid"] == ["quick-elu+1"] and list(small["results"]) == ["quick-elu+1"]
    unknown = subprocess.run(cmd + ["--settings", "nope"], capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "--settings" in unknown.stderr


def test_the_longer_runs_are_settings_of_the_grid():
    spec = importlib.util.spec_from_file_location("registry", REPO / "experiments" / "registry.py")
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    full = registry.EXPERIMENTS["bias_grid_long"]["full"]
    keys = full[full.index("--settings") + 1:full.index("--steps")]
    assert keys == registry.BIAS_GRID_LONG and set(keys) <= set(bg.settings(quick=False))
