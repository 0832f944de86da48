"""experiments/bias_grid.py: the ICLCA Fig. 1 grid has >= 24 distinct settings, its verdict pairs arms
over seeds with censoring, and a quick run writes every setting and resumes without rerunning them."""

import importlib.util
import itertools
import json
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

from linicl import reporting

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


def _fake_bias_training(calls):
    """``reporting.run_logged`` standing in for bias_training.py: records the command and writes the
    bias_training.json its --steps and --seeds ask for (numbers that differ by seed and arm)."""
    def run_logged(cmd, folder):
        calls.append(list(cmd))
        steps, at = int(cmd[cmd.index("--steps") + 1]), cmd.index("--seeds") + 1
        seeds = [int(x) for x in itertools.takewhile(lambda x: not x.startswith("--"), cmd[at:])]
        arms = {arm: dict(steps_to_ctx_acc={t: dict(per_seed=[steps // 2 + 5 * j * (a + 1) for j in range(len(seeds))])
                                            for t in bg.THRESHOLDS},
                          eval=dict(ctx_acc={str(x): [0.5, 0.9 - 0.01 * j * a] for j, x in enumerate(seeds)}),
                          finite=True, denominators=dict(min_train=0.1), eval_steps=[0, steps])
                for a, arm in enumerate(("baseline",) + bg.BIAS_ARMS)}
        config = dict(steps=steps, eval_every=5, seeds=seeds, model="fake", lr=1e-3)
        reporting.write_json(folder / "bias_training.json", dict(config=config, arms=arms))
    return run_logged


@pytest.fixture
def fake_training(monkeypatch):
    calls = []
    monkeypatch.setattr(reporting, "run_logged", _fake_bias_training(calls))
    return calls


def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        bg.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_quick_mode_trains_the_steps_asked_and_reports_them(tmp_path, fake_training, capsys):
    """Issue 52 item 2: --quick --steps 50 trained 20 steps and reported steps=50."""
    quick = ["--quick", "--no-progress", "--out", str(tmp_path)]
    assert bg.main(quick + ["--steps", "50"]) == 0
    assert fake_training and all(c[c.index("--steps") + 1] == "50" for c in fake_training)
    report = json.loads((tmp_path / "bias_grid.json").read_text())
    assert report["steps"] == 50 and all(r["summary"]["steps"] == 50 for r in report["results"].values())
    # The same OUT without --steps (quick's 20): another length, refused before anything trains.
    assert "finished with steps 50" in _refused(capsys, quick) and len(fake_training) == 2
    assert "multiple of 5" in _refused(capsys, quick + ["--steps", "52"])
    assert "multiple of 50" in _refused(capsys, ["--steps", "1020", "--out", str(tmp_path / "full")])
    assert bg.train_steps(True, None, None) == 20 and bg.train_steps(False, None, None) == 1000


def test_a_seed_list_in_another_order_is_the_same_run(tmp_path, fake_training):
    """Issue 52 item 16: a finished setting of seeds 0 1 2 is read again by --seeds 2 0 1 (nothing rerun)."""
    quick = ["--quick", "--no-progress", "--out", str(tmp_path)]
    assert bg.main(quick + ["--seeds", "2", "0", "1"]) == 0
    assert all(c[c.index("--seeds") + 1:c.index("--seeds") + 4] == ["0", "1", "2"] for c in fake_training)
    assert bg.main(quick + ["--seeds", "1", "2", "0"]) == 0 and len(fake_training) == 2
    assert json.loads((tmp_path / "bias_grid.json").read_text())["seeds"] == [0, 1, 2]


@pytest.mark.parametrize("damage, says", [
    (lambda text: text[:len(text) // 2], "cannot be read as a bias_grid setting's summary"),  # cut short
    (lambda text: "[1, 2]", "got an array"),
    (lambda text: text.replace('"baseline"', '"base"'), "without arms.baseline"),
    (lambda text: text.replace('"min_denominator"', '"min_den"'), "without arms.baseline.min_denominator"),
    (lambda text: text.replace('"0.9"', '"0.95"'), "without arms.baseline.steps.0.9"),
    (lambda text: text.replace('"steps"', '"n_steps"', 1), "without steps")])
def test_a_broken_summary_is_refused_by_name_before_anything_trains(tmp_path, fake_training, capsys, damage, says):
    """Issue 52 item 16: a corrupt or incomplete OUT/<setting>/summary.json was a JSON or KeyError traceback
    naming no file; now the file, what it lacks and the fix (delete it to rerun that setting)."""
    quick = ["--quick", "--no-progress", "--out", str(tmp_path)]
    assert bg.main(quick + ["--only", "quick-elu+1"]) == 0
    path = tmp_path / "quick-elu+1" / "summary.json"
    path.write_text(damage(path.read_text()))
    err = _refused(capsys, quick)
    assert f"{path}: " in err and says in err and "delete it to rerun that setting" in err, err
    assert len(fake_training) == 1  # the other setting was not started


def test_the_longer_runs_are_settings_of_the_grid():
    spec = importlib.util.spec_from_file_location("registry", REPO / "experiments" / "registry.py")
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    full = registry.EXPERIMENTS["bias_grid_long"]["full"]
    keys = full[full.index("--settings") + 1:full.index("--steps")]
    assert keys == registry.BIAS_GRID_LONG and set(keys) <= set(bg.settings(quick=False))
