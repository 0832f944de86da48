"""Test session settings: float64 everywhere, hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default; few derandomised examples, the suite stays within a
few minutes on 2 cores), ``thorough`` (many random examples), ``dev`` (one or two examples).
"""

import os
import sys

import jax

# Tests are grouped in folders mirroring the package; they all import the shared ``helpers`` module.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Before any array is created: the exactness claims are checked in float64.
jax.config.update("jax_enable_x64", True)
# Every hypothesis example compiles new shapes; XLA's optimisation passes dominate that time on a CPU
# and change nothing we test (the identities hold for any evaluation order).
jax.config.update("jax_disable_most_optimizations", True)
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
