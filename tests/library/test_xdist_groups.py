"""The suite's distribution: ``make test`` runs ``pytest -n auto --dist loadgroup`` and relies on
``xdist_group`` to run a group on one worker (test_sharding's 8-device subprocess made once, the Gemma 3
tests sharing one load). pytest 9.2 with pytest-xdist 3.8 silently ignored the groups (xdist renames a
grouped test's node id, which pytest 9.2 no longer reads back): the groups' expensive setups then ran on
every worker. This runs a grouped module of four tests on two workers and checks they share one."""

import subprocess
import sys

GROUPED = '''
import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    pass
'''


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", str(tmp_path),
                          str(tmp_path / "test_grouped.py")], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # "[gw0] PASSED test_grouped.py::test_grouped[0]@together", one line per test
    workers = [line.split()[0] for line in run.stdout.splitlines() if " PASSED " in line and line.startswith("[gw")]
    assert len(workers) == 4 and len(set(workers)) == 1, run.stdout[-2000:]
