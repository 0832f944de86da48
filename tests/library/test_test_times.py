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
