"""Counts the XLA programs of every Python subprocess a test starts while ``make test`` records the
suite's time (``LINICL_TEST_TIMES``).

tests/conftest.py puts this folder on ``PYTHONPATH`` only then, so Python imports this module at the
start of each subprocess (an experiment's quick run, a notebook's kernel). When a test started it, the
module listens for JAX's compile events (``linicl.timing.CompileMeter``) and at exit writes one JSON
line to ``$LINICL_TEST_TIMES/sub-<pid>.jsonl``: the test (``_running_test``), the command, compile
seconds, programs built (and per name) and peak resident memory. ``tools/test_times.py`` adds them to that test's
own. A Python without linicl (the torch reference worker) is left alone.
"""

import os


def _running_test(folder: str):
    """The test that started this process: pytest's ``PYTEST_CURRENT_TEST``, else (a test that built
    its subprocess's environment before it ran) the one its parent process says it runs
    (``running-<pid>``, written by tests/conftest.py); None for a process no test started."""
    test = os.environ.get("PYTEST_CURRENT_TEST")
    if test:
        return test
    try:
        with open(os.path.join(folder, f"running-{os.getppid()}")) as f:
            return f.read().strip() or None
    except OSError:
        return None


_DIR = os.environ.get("LINICL_TEST_TIMES")
_TEST = _running_test(_DIR) if _DIR else None


def _start(folder: str, test: str) -> None:
    import atexit
    import json
    import resource
    import sys

    try:
        from linicl.timing import CompileMeter
    except ImportError:
        return
    meter = CompileMeter()

    def write() -> None:
        c = meter.read()
        record = {"of": test.rsplit(" (", 1)[0], "command": " ".join(sys.argv[:2]),
                  "compile_s": c["compile_s"], "programs": c["programs"], "names": meter.programs_by_name(),
                  "name_s": meter.backend_s_by_name(),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        try:
            with open(os.path.join(folder, f"sub-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass  # the record is a measurement; a folder gone (the run cleaned up) costs nothing else

    atexit.register(write)


if _DIR and _TEST:
    _start(_DIR, _TEST)
