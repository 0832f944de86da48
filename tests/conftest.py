"""Test session settings: float64 everywhere, hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default; few derandomised examples, the suite stays within a
few minutes on 2 cores), ``thorough`` (many random examples), ``dev`` (one or two examples).
"""

import os
import sys

# XLA's classic CPU emitters compile the suite's small programs faster than the fusion emitters: a
# tiny model's init and forward about 1.3x, test_iclca.py 255 -> 196 s (2 cores, no compilation cache);
# only rounding differs, and both sides of every identity come from programs built the same way.
# linicl.verify chooses the same for its checks. Set before jax starts its backend, and inherited by
# the scripts tests run in subprocesses; a flag the caller gave already wins.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""),
                                                    "--xla_cpu_use_fusion_emitters=false") if f)

import jax

# Tests are grouped in folders mirroring the package; they all import the shared ``helpers`` module.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Before any array is created: the exactness claims are checked in float64.
jax.config.update("jax_enable_x64", True)
# Every hypothesis example compiles new shapes; XLA's optimisation passes dominate that time on a CPU
# and change nothing we test (the identities hold for any evaluation order).
jax.config.update("jax_disable_most_optimizations", True)
# The same for the scripts tests run in subprocesses (the experiments' quick modes), which read it from
# the environment: their compiles dominate their time (icl_baselines --quick: 57 -> 47 CPU-seconds).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Compiled executables are kept on disk between sessions (linicl.compiled.enable_persistent_cache;
# LINICL_COMPILATION_CACHE=off turns it off, or names another folder).
from linicl import compiled as _compiled  # noqa: E402

_compiled.enable_persistent_cache()
# (Strict dtype promotion is not enabled: flax.linen.LayerNorm itself promotes float64 with float32.
# That a float32 model stays float32 is tested directly instead.)

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=10, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=2, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=200, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_functions():
    """Drop linicl's compiled functions and jax's caches after each test module: a long (thorough)
    session otherwise keeps every compiled executable of every example alive."""
    yield
    import linicl.compiled
    linicl.compiled.clear()
    jax.clear_caches()


@pytest.fixture
def data_env(monkeypatch):
    """``LINICL_DATA_DIR`` pointed at ``helpers.data_dir()`` (the full data sets, else the committed
    fixture) for one test and the scripts it starts; returns that folder."""
    from helpers import data_dir
    root = data_dir()
    monkeypatch.setenv("LINICL_DATA_DIR", str(root))
    return root


# --------------------------------------------------------------------------- where the time goes
# With LINICL_TEST_TIMES=<folder> (``make test`` sets it), every test process appends one JSON line per
# test to <folder>/<worker>.jsonl: its wall time (setup, call and teardown) and the XLA programs it built
# with their compile seconds and names (``linicl.timing.CompileMeter``; programs built in a subprocess a test starts
# are counted by that subprocess: tests/timing_site), then the process's peak resident memory.
# ``python tools/test_times.py`` reads them.
_TIMES_DIR = os.environ.get("LINICL_TEST_TIMES")
if _TIMES_DIR:
    # The subprocesses a test starts record their own compiles (tests/timing_site/sitecustomize.py),
    # wherever they run: they get the folder as an absolute path and that module on their path.
    _TIMES_DIR = os.environ["LINICL_TEST_TIMES"] = os.path.abspath(_TIMES_DIR)
    _SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timing_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)


def _times_file():
    return os.path.join(_TIMES_DIR, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl")


def _append(record: dict) -> None:
    import json
    with open(_times_file(), "a") as f:
        f.write(json.dumps(record) + "\n")


if _TIMES_DIR:
    import time as _time

    from linicl.timing import CompileMeter

    _METER = CompileMeter()

    def pytest_sessionstart(session):
        os.makedirs(_TIMES_DIR, exist_ok=True)
        _append({"event": "start", "t": _time.time()})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        # for a subprocess whose environment was built before this test ran (tests/timing_site)
        with open(os.path.join(_TIMES_DIR, f"running-{os.getpid()}"), "w") as f:
            f.write(item.nodeid)
        _METER.start()
        t0 = _time.perf_counter()
        yield
        c = _METER.read()
        _append({"test": item.nodeid, "s": _time.perf_counter() - t0, "compile_s": c["compile_s"],
                 "programs": c["programs"], "names": _METER.programs_by_name(),
                 "name_s": _METER.backend_s_by_name()})

    def pytest_sessionfinish(session):
        import resource
        _append({"event": "finish", "t": _time.time(),
                 "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
