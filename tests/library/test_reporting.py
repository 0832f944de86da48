"""linicl.reporting: the shared flags, machine record, JSON, Markdown tables and optional plots of the
experiment scripts."""

import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from linicl import reporting
from linicl.errors import DataError, LiniclError
from helpers import REPO


@pytest.fixture
def no_matplotlib(monkeypatch):
    """An interpreter without matplotlib: importing it raises ImportError (a None entry in
    sys.modules does exactly that), and the skip line has not been printed yet."""
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(reporting, "_said_skipped", False)


def _line_figure(plt, ys):
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot(ys)
    return fig


def test_common_args_defaults_and_flags():
    parser = reporting.argument_parser("doc")
    reporting.add_common_args(parser, out="results/x", quick="CI", seed="data", data_dir=True, plots=True)
    args = parser.parse_args([])
    assert vars(args) == dict(out="results/x", quick=False, seed=0, progress=True, data_dir=None, plots=True)
    args = parser.parse_args(["--out", "o", "--quick", "--seed", "3", "--no-progress", "--data-dir", "d",
                              "--no-plots"])
    assert vars(args) == dict(out="o", quick=True, seed=3, progress=False, data_dir="d", plots=False)


def test_common_args_leave_out_what_a_script_lacks():
    parser = reporting.argument_parser(None)
    reporting.add_common_args(parser, out="o", quick="CI", progress=False)
    assert vars(parser.parse_args([])) == dict(out="o", quick=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "1"])


def test_help_shows_the_docstring_as_written(capsys):
    parser = reporting.argument_parser("Title.\n\n    python script.py --quick   # indented")
    reporting.add_common_args(parser, out="o", quick="a tiny run")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "    python script.py --quick   # indented" in out and "a tiny run" in out


def test_machine_info_has_the_keys_the_reports_read():
    info = reporting.machine_info()
    assert {"platform", "processor", "python", "jax", "devices", "cpu_count", "xla_flags"} <= set(info)
    assert info["cpu_count"] == os.cpu_count() and info["devices"].startswith("[")  # str(jax.devices())
    json.dumps(info)
    assert all(isinstance(x, float) for x in reporting.load_average())


def test_write_json_converts_arrays_and_creates_the_folder(tmp_path):
    obj = dict(a=np.float32(0.5), b=np.arange(3), c=jnp.ones((2,)), d=(1, np.int64(2)), e=[np.bool_(True)],
               f=float("nan"), g=tmp_path)
    path = reporting.write_json(tmp_path / "deep" / "er" / "r.json", obj)
    back = json.loads(path.read_text())
    assert back["a"] == 0.5 and back["b"] == [0, 1, 2] and back["c"] == [1.0, 1.0] and back["d"] == [1, 2]
    assert back["e"] == [True] and np.isnan(back["f"]) and back["g"] == str(tmp_path)
    assert os.listdir(tmp_path / "deep" / "er") == ["r.json"]  # no temporary file left behind
    reporting.write_json(path, [1], indent=None)
    assert path.read_text() == "[1]"


def test_write_json_names_what_it_cannot_write(tmp_path):
    with pytest.raises(TypeError, match="object"):
        reporting.write_json(tmp_path / "r.json", dict(x=object()))


def test_markdown_table():
    text = reporting.markdown_table(["task", "n", "acc"], [["a", 10, "0.50"], ["**mean**", "", "0.5"]])
    assert text.splitlines() == ["| task | n | acc |", "|---|---|---|", "| a | 10 | 0.50 |", "| **mean** | | 0.5 |"]
    assert reporting.markdown_table(["x"], []) == "| x |\n|---|"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = reporting.plot(tmp_path / "sub" / "p.png", _line_figure, [1, 3, 2], dpi=50)
    assert path == tmp_path / "sub" / "p.png" and path.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_prints_one_line_and_returns_none(tmp_path, capsys, no_matplotlib):
    for name in ("a.png", "b.png"):  # a script with several plots says it once
        assert reporting.plot(tmp_path / name, _line_figure, [1, 2]) is None
    captured = capsys.readouterr()
    assert captured.out == reporting.PLOTS_SKIPPED + "\n" and captured.err == ""
    assert reporting.PLOTS_SKIPPED == ("plots skipped: matplotlib is not installed "
                                       "(pip install 'linicl[plots]')")
    assert not list(tmp_path.iterdir())


def test_a_script_without_matplotlib_writes_its_json_and_says_so(tmp_path):
    """experiments/implicit_dherin.py --quick in an interpreter without matplotlib: exit 0, the JSON, the
    table, and the one line instead of the plot."""
    script = REPO / "experiments" / "implicit_dherin.py"
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = [{str(script)!r}, '--quick', '--no-progress', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines.count(reporting.PLOTS_SKIPPED) == 1 and "held-out loss" in run.stdout
    assert lines.index(reporting.PLOTS_SKIPPED) > max(i for i, s in enumerate(lines) if s.startswith("n="))
    assert json.loads((tmp_path / "implicit_dherin_float32.json").read_text())["finetuning"]
    assert not list(tmp_path.glob("*.png"))


def test_fingerprint_ignores_what_changes_no_number():
    a = reporting.fingerprint(dict(seed=0, out="x", tasks=["a"]), ignore=("out",))
    assert a == reporting.fingerprint(dict(seed=0, out="y", tasks=["a"]), ignore=("out",))
    assert a != reporting.fingerprint(dict(seed=1, out="x", tasks=["a"]), ignore=("out",))


def test_progress_resumes_only_under_the_same_settings(tmp_path, capsys):
    path = tmp_path / "progress.json"
    prog = reporting.Progress(path, "fp1")
    assert not prog.resumed and prog.get("cell") is None
    assert prog.put("cell", {"acc": np.float64(0.5)}) == {"acc": 0.5}
    with prog.phase("train"):
        pass
    again = reporting.Progress(path, "fp1")           # an interrupted run, restarted
    assert again.resumed and again.get("cell") == {"acc": 0.5} and again.done("train")
    fresh = reporting.Progress(path, "fp1", resume=False)
    assert not fresh.resumed and fresh.get("cell") is None
    other = reporting.Progress(path, "fp2")            # other settings: never mixed in
    assert not other.resumed and other.get("cell") is None
    assert "other settings" in capsys.readouterr().err


def test_progress_can_refuse_a_file_of_other_settings(tmp_path):
    path = tmp_path / "progress.json"
    reporting.Progress(path, "fp1").put("cell", 1)
    with pytest.raises(LiniclError, match="other settings"):
        reporting.Progress(path, "fp2", refuse_other=True)
    assert reporting.Progress(path, "fp1", refuse_other=True).get("cell") == 1  # the file was left as it was
    assert reporting.Progress(path, "fp2", resume=False, refuse_other=True).get("cell") is None


@pytest.mark.parametrize("text, says", [("{\"fingerprint\": \"fp1\", \"res", "cannot be read"),  # cut short
                                         ("[1, 2]", "got an array"),
                                         ('{"fingerprint": "fp1", "results": [1]}', "'results' should be an object"),
                                         ('{"fingerprint": "fp2", "timings": 3}', "'timings' should be an object")])
def test_progress_refuses_a_file_that_holds_no_progress_by_name(tmp_path, text, says):
    """A corrupt or list-valued progress.json: a DataError naming the file and the fix, never a JSON or
    AttributeError traceback, and never read as empty progress (whatever the settings)."""
    path = tmp_path / "progress.json"
    path.write_text(text)
    for refuse in (False, True):
        with pytest.raises(DataError, match=rf"{re.escape(str(path))}: .*{says}.*delete it"):
            reporting.Progress(path, "fp1", refuse_other=refuse)
    assert path.read_text() == text  # left as it was, for whoever wants to look at it
    assert reporting.Progress(path, "fp1", resume=False).get("cell") is None  # not resuming: not read


def test_read_json_names_the_file_what_it_should_hold_and_the_fix(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"a": 1}')
    assert reporting.read_json(path, what="a summary", fix="delete it") == {"a": 1}
    with pytest.raises(DataError, match=r"s.json: should hold a summary \(an array\), got an object; delete it"):
        reporting.read_json(path, what="a summary", fix="delete it", kind=list)
    with pytest.raises(DataError, match=r"missing.json: cannot be read as a summary .*; rerun"):
        reporting.read_json(tmp_path / "missing.json", what="a summary", fix="rerun")


def test_run_logged_keeps_the_output_and_names_the_log_of_a_failure(tmp_path):
    run_logged = reporting.run_logged
    run_logged([sys.executable, "-c", "print('hello')"], tmp_path / "ok")
    assert (tmp_path / "ok" / "stdout.txt").read_text().strip() == "hello"
    with pytest.raises(RuntimeError, match=r"bad: .* exited 3; see .*bad/stdout.txt"):
        run_logged([sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"], tmp_path / "bad")
    assert "oops" in (tmp_path / "bad" / "stdout.txt").read_text()
