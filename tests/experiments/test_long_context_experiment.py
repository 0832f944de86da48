"""experiments/long_context.py: --help, and the quick run on the tiny fixture model and the committed
data sample: every probe and method, converted = prompted, complete JSON, a plot, and --resume reuses
the cells. The library parts (the equal-state window, the scoring) are tested in
tests/linearize/test_long_prompts.py."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest

import linicl

from helpers import REPO, json_numbers

SCRIPT = REPO / "experiments" / "long_context.py"


def test_help():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--quick", "--lengths", "--caches", "--cache-rules", "--window-caches", "--windows",
                 "--convert-check", "--resume", "--seed", "--filler", "--select-question"):
        assert flag in out


def sizes_softmax(report, cell) -> int:
    """The softmax teacher's full KV floats of the cell's context (all but the question)."""
    return cell["methods"]["softmax"]["state_floats"]


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample
def test_quick_run_writes_every_cell_and_resumes(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "long_context.json").read_text())
    methods = report["methods"]
    assert methods[:2] == ["softmax", "student"] and {"student+cache4", "student+attcache4"} <= set(methods)
    plain = [m for m in methods if m.startswith("window") and "+" not in m]
    cached = [m for m in methods if m.startswith("window") and m.endswith("+attcache2")]
    assert len(plain) == 2 and len(cached) == 1
    oracle = [m for m in methods if m.endswith("+oracle")]
    assert len(oracle) == 1  # the diagnostic, on the passkey cell only
    assert {c["probe"] for c in report["cells"].values()} == {"passkey", "kv", "antonym k=2"}
    chosen = [m for m in methods if "@" in m]  # the selections (--quick: three scores at one budget)
    dropped = ["reconstruction@0.5", "reconstruction:heads@0.5", "expected@0.5", "expected:heads@0.5",
               "recent@0.5", "snapkv+question@0.5", "snapkv+question:heads@0.5"]  # the query-aware reference last
    # each again with the tokens a head does not keep in the student's kernel terms (--select-kernels learned)
    assert chosen == [m for d in dropped for m in (d, d + "+learned")]
    for cell in report["cells"].values():
        keyed = cell["probe"] in ("passkey", "kv")
        assert set(cell["methods"]) == (set(methods) - (set() if cell["probe"] == "passkey" else set(oracle))
                                        - (set() if keyed else set(chosen)))
        for name in chosen if keyed else ():
            row = cell["selection"][name]
            assert 0 < row["state_floats"] <= 0.5 * sizes_softmax(report, cell) and row["score_per_prefill"] >= 0
            assert ("line_kept" in row) == (cell["probe"] == "passkey")
        for name, row in cell["methods"].items():
            assert row["n"] == len(row["correct"]) == 2
            if name not in ("softmax", *oracle, *chosen):
                assert row["converted"]["answers_equal"] == row["converted"]["of"] == 1
                assert row["converted"]["max_rel_err"] <= 1e-4
    sizes = report["state_floats"]
    student, windows = sizes["student"], [sizes[m] for m in plain]
    assert max(windows) <= student < max(windows) + sizes["softmax"] / 288  # the equal window: within a token
    assert sizes[cached[0]] <= student  # the window + cache fits the student's state too
    assert set(report["loss"]) == set(methods) - set(oracle) - set(chosen)
    after = report["loss_selection"]  # the text after a selected 288-token prefix (--quick: 16 tokens)
    assert (after["prefix"], after["tail"]) == (288, 16)
    assert set(after["methods"]) == {"full", "no prefix", "reconstruction@0.5", "expected@0.5", "recent@0.5"}
    assert "vs_full" not in after["methods"]["full"] and "vs_recent" in after["methods"]["expected@0.5"]
    assert all(0 < r["state_floats"] <= 0.5 * after["methods"]["full"]["state_floats"] for m, r in
               after["methods"].items() if "@" in m)
    assert "after a 288-token prefix" in report["table"]
    assert "Selection at conversion" in report["table"] and "| passkey | 288 | recent (uniform) |" in report["table"]
    assert all(math.isfinite(x) for x in json_numbers(report))
    assert (tmp_path / "long_context.png").exists()
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((tmp_path / "long_context.json").read_text())
    assert resumed["resumed"] and resumed["cells"] == report["cells"] and resumed["wall_s"] < report["wall_s"]


def test_a_budget_too_small_for_the_kept_sinks_and_window_is_refused_before_any_cell():
    # 1 % of a 1,024-token prompt is about 10 tokens per KV head, fewer than 4 sinks + a 16-token window:
    # refused up front (a run once scored every prompt of its first cell before the allocation refused it).
    spec = importlib.util.spec_from_file_location("long_context_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = linicl.preset("tiny-softmax-rope", n_kv_heads=2)
    args = script.parse_args(["--lengths", "1024", "--select-scores", "recent", "--select-keeps", "0.05", "0.01"])
    with pytest.raises(linicl.LiniclError, match=r"--select-keeps 0.01 holds fewer than 20 tokens per KV head"):
        script.check_budgets(cfg, args)
    script.check_budgets(cfg, script.parse_args(["--lengths", "1024", "--select-scores", "recent",
                                                 "--select-keeps", "0.05"]))
