"""The committed sample of the data sets (tests/fixtures/data), which the tests read where the full data sets
are not: it is the script's output, its specs are the shipped ones but for its own files, every file is
what its spec says, and every task loads with all its classes on both sides."""

import collections
import json

import pytest
from helpers import DATA_FIXTURE, REPO, load_module
from test_data import full_dir  # noqa: F401  (a fixture)

from linicl.data import list_tasks, load_task, specs

SCRIPT = REPO / "tests" / "fixtures" / "make_data_fixture.py"


def _script():
    return load_module(SCRIPT, "make_data_fixture")


def _without_downloads(raw: dict) -> dict:
    """A spec's JSON with each file reduced to its path, and no test_size: what the sample may change."""
    path = lambda entry: entry if isinstance(entry, str) else entry["path"]  # noqa: E731
    out = {k: v for k, v in raw.items() if k != "test_size"}
    out["files"] = {role: path(entry) for role, entry in raw["files"].items()}
    out["label_files"] = {role: path(entry) for role, entry in raw.get("label_files", {}).items()}
    out["extra_files"] = [path(entry) for entry in raw.get("extra_files", [])]
    return out


def test_its_specs_are_the_shipped_ones_but_for_its_files():
    """Same formats, fields, labels, templates: only the files (no url; the sample's size and sha256)
    and the evaluation counts of tasks read from one file differ, so the tests on the sample read the
    tasks as shipped."""
    shipped = sorted(p.name for p in specs.SHIPPED_DIR.glob("*.json"))
    assert sorted(p.name for p in (DATA_FIXTURE / "tasks").glob("*.json")) == shipped
    for name in shipped:
        ours = json.loads((DATA_FIXTURE / "tasks" / name).read_text(encoding="utf-8"))
        theirs = json.loads((specs.SHIPPED_DIR / name).read_text(encoding="utf-8"))
        assert _without_downloads(ours) == _without_downloads(theirs), name
        assert ours.get("test_size") == theirs.get("test_size") or name[:-5] in _script().TEST_SIZES
        for entry in [*ours["files"].values(), *ours.get("label_files", {}).values(), *ours.get("extra_files", [])]:
            assert set(entry) == {"path", "sha256", "size"}, (name, entry)


def test_every_task_loads_from_it_with_every_class_and_checked_files():
    assert list_tasks(DATA_FIXTURE) == sorted(specs.all_specs(None))
    for name in list_tasks(DATA_FIXTURE):
        task = load_task(name, DATA_FIXTURE, verify=True)  # every size and SHA-256 as its spec says
        # Enough for the quick experiments (tests/fixtures/make_data_fixture.py: ROWS).
        assert len(task.train) >= 16 and len(task.test) >= 9, name
        if task.labels is not None:
            for part in (task.train, task.test):
                counts = collections.Counter(e.output for e in part)
                assert set(counts) == set(task.labels), name
                assert max(counts.values()) - min(counts.values()) <= 1, (name, counts)  # balanced
        else:
            assert len(task.test) >= 16, name  # test_evaluate's 16 present-past queries


def test_it_is_small():
    files = [p for p in DATA_FIXTURE.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 300_000  # 236 kB when written (138 kB before the ICR suite)


def test_it_is_the_script_output_of_the_full_data_sets(tmp_path, full_dir):  # noqa: F811
    """Rebuilt from the full data sets, byte for byte: nothing in it was edited by hand, and every row
    is a published row."""
    out = tmp_path / "data"
    files = _script().write(full_dir, out)
    committed = sorted(p.relative_to(DATA_FIXTURE) for p in DATA_FIXTURE.rglob("*") if p.is_file())
    assert [p.relative_to(out) for p in files] == committed
    for rel in committed:
        assert (out / rel).read_bytes() == (DATA_FIXTURE / rel).read_bytes(), rel


def test_the_script_samples_evenly_within_each_class():
    script = _script()
    assert script.spread(list(range(10)), 3) == [1, 5, 8] and script.spread([1, 2], 5) == [1, 2]
    labels = ["a"] * 6 + ["b"] * 2 + ["c"] * 4
    chosen = script.choose(labels, 7)
    assert collections.Counter(labels[i] for i in chosen) == {"a": 3, "b": 2, "c": 2}  # b runs out
    assert chosen == sorted(chosen) and script.choose([None] * 4, 9) == [0, 1, 2, 3]
