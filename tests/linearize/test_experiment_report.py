"""experiments/linearize.py's report (issue 52, items 16, 20 and 21): an ICL-only run skips the held-out loss
and the timing (and its tables and figure do without them), the shortest converted prompt is a
demonstration prompt, and a progress file that holds no progress is refused by name. The model parts
are stubbed: these check the script's wiring in seconds (the quick run end to end: test_linearize.py)."""

import importlib.util
import json
from types import SimpleNamespace

import pytest
from helpers import REPO

from linicl import reporting
from linicl.linearize import icl as ICL

SCRIPT = REPO / "experiments" / "linearize.py"
_spec = importlib.util.spec_from_file_location("linearize_experiment", SCRIPT)
exp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)


def _result(k: int, correct: list) -> dict:
    n = len(correct)
    return dict(task="antonym", k=k, accuracy=sum(correct) / n, ci_low=0.0, ci_high=1.0, n=n, constant=False,
                correct=correct)


def _cells() -> dict:
    """Two cells as icl_table returns them: k = 0 converts BOS alone (1 token), k = 1 a demonstration."""
    zero, one = [0, 0, 0, 0], [1, 1, 0, 1]
    return {"antonym k=0": {ICL.SOFTMAX: _result(0, zero), ICL.STUDENT: _result(0, zero), "prompt_tokens": 1},
            "antonym k=1": {ICL.SOFTMAX: _result(1, one), ICL.STUDENT: _result(1, one),
                            ICL.CONVERTED: _result(1, one), "converted_same_answers": True, "prompt_tokens": 9}}


@pytest.fixture
def stubbed(monkeypatch):
    """The script with its model parts stubbed: the held-out loss and the timing fail if they run."""
    def must_not_run(*args, **kw):
        raise AssertionError("a part the run was told to skip ran")
    student = SimpleNamespace(cfg=SimpleNamespace(describe=lambda: "stub student"))
    monkeypatch.setattr(exp, "enable_persistent_cache", lambda: None)
    monkeypatch.setattr(exp, "load_teacher", lambda args: (None, None, None, "stub teacher"))
    monkeypatch.setattr(exp.linearize, "check_scorable", lambda *args, **kw: None)
    monkeypatch.setattr(exp, "stage1", lambda *args: (student, None, dict(loaded="stub maps")))
    monkeypatch.setattr(exp.linearize, "icl_table", lambda *args, **kw: _cells())
    monkeypatch.setattr(exp, "held_out", must_not_run)
    monkeypatch.setattr(exp.linearize, "conversion_cost", must_not_run)
    return exp


def _argv(out, *more) -> list:
    return ["--maps", "stub.safetensors", "--tasks", "antonym", "--k", "0", "1", "--no-progress", "--no-plots",
            "--out", str(out), *more]


def test_an_icl_only_run_skips_the_held_out_loss_and_the_timing(tmp_path, stubbed, capsys):
    """Item 21: --skip-held-out and --skip-timing (16 x 512-token texts and prompts up to 4,096 tokens
    by default); item 20: the shortest converted prompt is the k = 1 cell's, not k = 0's BOS."""
    assert stubbed.main(_argv(tmp_path, "--skip-held-out", "--skip-timing")) == 0
    report = json.loads((tmp_path / "linearize.json").read_text())
    assert "held_out" not in report and "timing" not in report and report["gains"]["antonym"]["k"] == 1
    out = capsys.readouterr().out
    assert "Held-out" not in out and "prompted ms" not in out and "ICL accuracy" in out
    assert "Shortest converted demonstration prompt: 9 tokens (antonym k=1;" in out and "1 tokens" not in out
    # The skip flags change no number: a run made with or without them resumes the other's progress.
    fp = lambda *flags: reporting.fingerprint(vars(exp.parse_args(_argv(tmp_path, *flags))),  # noqa: E731
                                              ignore=exp.PROGRESS_IGNORES)
    assert fp("--skip-held-out", "--skip-timing") == fp()


def test_the_figure_does_without_the_held_out_loss_and_the_training_curve(tmp_path):
    pytest.importorskip("matplotlib")
    report = dict(stage1={}, icl=_cells())  # maps loaded (no history), held-out loss skipped
    assert reporting.plot(tmp_path / "linearize.png", exp.figure, report).stat().st_size > 0


def test_help_names_every_teacher_the_script_takes():
    """Item 21: --help said "Linearize SmolLM2" though --model gemma3 works."""
    assert "Linearize SmolLM2 by" not in exp.__doc__
    assert "Gemma 3 270M with ``gemma3``" in exp.__doc__.split("\n\n")[0]


@pytest.mark.parametrize("text", ['{"fingerprint": "x", "results": {"antonym k=0"', '[]'])
def test_a_progress_file_that_holds_no_progress_is_refused_by_name(tmp_path, stubbed, capsys, text):
    """Item 16: a corrupt or list-valued OUT/progress.json was a JSON traceback naming no file."""
    (tmp_path / "progress.json").write_text(text)
    assert stubbed.main(_argv(tmp_path, "--resume", "--skip-held-out", "--skip-timing")) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'progress.json'}: " in err and "delete it" in err, err
