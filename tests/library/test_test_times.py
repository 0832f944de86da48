"""tools/test_times.py: the table of a recorded test run (per file, slowest tests, compile share,
memory) from the JSON lines tests/conftest.py writes; a folder with no run is refused by name."""

import importlib.util
import json
import sys

import pytest

from helpers import REPO

_spec = importlib.util.spec_from_file_location("test_times_tool", REPO / "tools" / "test_times.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("test_times_tool", tool)
_spec.loader.exec_module(tool)


def _write(folder, worker, records):
    (folder / f"{worker}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_table_sums_each_file_and_lists_the_slowest(tmp_path, capsys):
    _write(tmp_path, "main", [{"event": "start", "t": 100.0}, {"event": "finish", "t": 220.0, "peak_rss_mib": 90}])
    _write(tmp_path, "gw0", [{"event": "start", "t": 101.0},
                             {"test": "tests/a.py::t1", "s": 30.0, "compile_s": 20.0, "programs": 5},
                             {"test": "tests/b.py::t2", "s": 10.0, "compile_s": 1.0, "programs": 1},
                             {"event": "finish", "t": 210.0, "peak_rss_mib": 512}])
    _write(tmp_path, "gw1", [{"test": "tests/a.py::t3", "s": 50.0, "compile_s": 10.0, "programs": 2},
                             {"event": "finish", "t": 200.0, "peak_rss_mib": 640}])
    run = tool.read(tmp_path)
    assert run["wall_s"] == 120.0 and run["workers"] == {"main": 90, "gw0": 512, "gw1": 640}
    assert tool.by_file(run["tests"]) == [["tests/a.py", 2, 80.0, 30.0, 7], ["tests/b.py", 1, 10.0, 1.0, 1]]
    assert tool.main([str(tmp_path), "--top", "2", "--json", str(tmp_path / "out.json")]) == 0
    text = capsys.readouterr().out
    assert "3 tests; wall 2.0 min" in text and "compiling 0.5 min (34 %), 8 XLA programs" in text
    assert text.index("| tests/a.py::t3 | 50.0") < text.index("| tests/a.py::t1 | 30.0")
    assert json.loads((tmp_path / "out.json").read_text())["files"][0][0] == "tests/a.py"


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no recorded run"):
        tool.read(tmp_path)


def test_a_subprocess_compiles_count_in_the_test_that_started_it(tmp_path, capsys):
    _write(tmp_path, "gw0", [{"event": "start", "t": 0.0},
                             {"test": "tests/x.py::t@g", "s": 60.0, "compile_s": 1.0, "programs": 2,
                              "names": {"jit(apply)": 1, "jit(add)": 1}, "name_s": {"jit(apply)": 0.5, "jit(add)": 0.1}},
                             {"test": "tests/y.py::u", "s": 5.0, "compile_s": 0.5, "programs": 1},
                             {"event": "finish", "t": 70.0, "peak_rss_mib": 100}])
    _write(tmp_path, "sub-41", [{"of": "tests/x.py::t@g", "command": "python a.py", "compile_s": 30.0,
                                 "programs": 40, "peak_rss_mib": 900, "names": {"jit(apply)": 39, "jit(step)": 1},
                                 "name_s": {"jit(apply)": 20.0, "jit(step)": 0.2}}])
    _write(tmp_path, "sub-42", [{"of": "tests/x.py::t@g", "command": "python b.py", "compile_s": 9.0,
                                 "programs": 10, "peak_rss_mib": 300}])
    run = tool.read(tmp_path)
    assert run["workers"] == {"gw0": 100}  # a subprocess is not a worker
    x = next(t for t in run["tests"] if t["test"] == "tests/x.py::t@g")
    assert (x["compile_s"], x["programs"], x["sub_compile_s"], x["sub_programs"]) == (40.0, 52, 39.0, 50)
    assert tool.by_file(run["tests"])[0] == ["tests/x.py", 1, 60.0, 40.0, 52]
    # programs per name, the subprocess's added (sub-42 was recorded without names: older runs)
    assert x["names"] == {"jit(apply)": 40, "jit(add)": 1, "jit(step)": 1}
    assert tool.by_name(run["tests"]) == [["jit(apply)", 40, 20.5, 1], ["jit(step)", 1, 0.2, 1],
                                          ["jit(add)", 1, 0.1, 1]]
    tool.main([str(tmp_path)])
    text = capsys.readouterr().out
    assert "2 subprocesses started by tests" in text and "compiling 0.7 min, 50 programs" in text
    assert "largest 900 MiB (python a.py)" in text and "| jit(apply) | 40 | 20.5 | 1 |" in text


def test_a_subprocess_records_its_programs_under_the_running_test(tmp_path):
    """The real mechanism: a Python started with the recording's environment (as tests/conftest.py
    sets it) writes its compiles, named by the test pytest says is running."""
    import os
    import subprocess
    env = dict(os.environ, LINICL_TEST_TIMES=str(tmp_path), PYTEST_CURRENT_TEST="tests/z.py::w (call)",
               PYTHONPATH=str(REPO / "tests" / "timing_site"))
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).block_until_ready()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    (record,) = [json.loads(line) for f in tmp_path.glob("sub-*.jsonl") for line in f.read_text().splitlines()]
    assert record["of"] == "tests/z.py::w" and record["programs"] >= 1 and record["compile_s"] > 0
    assert record["peak_rss_mib"] > 0 and record["names"].get("jit(<lambda>)") == 1
    assert record["name_s"]["jit(<lambda>)"] > 0
    # without a running test (a script started by hand) nothing is written
    subprocess.run([sys.executable, "-c", code], env={k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"},
                   check=True, timeout=300)
    assert len(list(tmp_path.glob("sub-*.jsonl"))) == 1
