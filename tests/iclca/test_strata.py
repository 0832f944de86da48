"""The exactness properties see every family that behaves differently where a stored prompt meets the
query (``helpers.OFFSET_FAMILIES``: no positions, learned positions, rope on the features, rope on the
inputs; plus exact windows and sinks for the finite-state configs). Before, each property drew its
config freely and the ``ci`` profile drew no config that keeps an offset for `converting twice =
converting the concatenation`, so a conversion that forgot the first prompt's offset passed.

Each property below is parametrised by stratum and asserts that its drawn config is of that stratum;
this module counts the strata each property is run on, so none can silently drop out."""

import functools

import pytest

import linicl
from helpers import HYBRID_FAMILIES, OFFSET_FAMILIES, REPO, load_module, offset_family

PROPERTIES = [
    ("iclca/test_iclca.py", "test_converted_equals_prompted", OFFSET_FAMILIES),
    ("iclca/test_iclca.py", "test_converting_twice_equals_converting_the_concatenation", OFFSET_FAMILIES),
    ("iclca/test_iclca.py", "test_generation_from_converted_equals_generation_from_prompted", OFFSET_FAMILIES),
    ("iclca/test_iclca.py", "test_continuous_prompt_converts_exactly", OFFSET_FAMILIES),
    ("nn/test_finite_state.py", "test_converted_equals_prompted", HYBRID_FAMILIES),
    ("nn/test_finite_state.py", "test_converting_twice_equals_converting_the_concatenation", HYBRID_FAMILIES),
    ("nn/test_finite_state.py", "test_generation_after_conversion_equals_generation_after_the_prompt", HYBRID_FAMILIES),
    # with a sparse cache (always a window or sinks): one stratum per kind of positions
    ("nn/test_sparse_cache_model.py", "test_converted_equals_prompted", OFFSET_FAMILIES),
    ("nn/test_sparse_cache_model.py", "test_converting_twice_equals_converting_the_concatenation", OFFSET_FAMILIES),
    ("nn/test_sparse_cache_model.py", "test_generation_after_conversion_equals_generation_after_the_prompt",
     OFFSET_FAMILIES),
]
FAMILY_PROPERTIES = ["test_converted_equals_prompted", "test_converting_twice_equals_converting_the_concatenation",
                     "test_generation_after_conversion_equals_generation_after_the_prompt"]


@functools.lru_cache(maxsize=None)
def _module(path: str):
    """A test module by its path under tests/ (the folders are not packages)."""
    return load_module(REPO / "tests" / path, f"strata_{path.replace('/', '_')[:-3]}")


def _parametrized(fn, argname: str) -> list:
    """The values ``fn`` is parametrised with for ``argname`` (its pytest marks)."""
    values = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == argname:
            values += list(mark.args[1])
    return values


@pytest.mark.parametrize("module, name, strata", PROPERTIES, ids=[f"{m}::{n}" for m, n, _ in PROPERTIES])
def test_each_exactness_property_runs_once_per_stratum(module, name, strata):
    fn = getattr(_module(module), name)
    assert sorted(_parametrized(fn, "family")) == sorted(strata)


@pytest.mark.parametrize("name", FAMILY_PROPERTIES)
def test_the_fixed_families_are_each_a_test_case_and_span_every_stratum(name):
    families = _module("iclca/test_families.py")
    fn = getattr(families, name)
    assert list(_parametrized(fn, "index")) == list(range(len(families.FAMILIES)))
    drawn = {offset_family(linicl.ModelConfig(**{**families._BASE, **f})) for f in families.FAMILIES}
    assert drawn == set(HYBRID_FAMILIES)


def test_the_strata_are_what_the_configs_say():
    """``offset_family`` agrees with the config's own ``keeps_offset`` (the behaviour it stands for)."""
    base = dict(vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_ff=8, attention="linear", dtype="float64")
    keeps = {"position-free": False, "learned": True, "rope-features": False, "rope-inputs": True}
    for family, options in OFFSET_FAMILIES.items():
        cfg = linicl.ModelConfig(**base, **options)
        assert offset_family(cfg) == family and cfg.keeps_offset == keeps[family]
    hybrid = linicl.ModelConfig(**base, feature_map="hedgehog", window=2, sinks=1)
    assert offset_family(hybrid) == "window-sinks" and hybrid.keeps_offset
