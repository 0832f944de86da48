"""linicl.checkpoint: the one checkpoint format (safetensors + JSON settings), exact round trips,
refusals that name the file, atomic writes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from linicl import checkpoint
from linicl.errors import DataError, LiniclError


def _tree():
    """A nested dict with float32, float64 and int32 leaves, a Python scalar and an empty dict."""
    rng = np.random.default_rng(0)
    return {"params": {"dense": {"kernel": rng.standard_normal((3, 4)).astype(np.float32),
                                 "bias": rng.standard_normal(4)},           # float64
                       "scale": np.float32(1.5)},
            "step": np.asarray(7, np.int32), "counts": np.arange(5, dtype=np.int32), "lr": 0.25,
            "empty": {}}


def _same(a, b) -> bool:
    """Equal structure, leaf types, dtypes, shapes and bits."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(np.asarray(x).dtype == np.asarray(y).dtype and np.shape(x) == np.shape(y)
                            and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_nested_dict_round_trips_exactly(tmp_path):
    tree = _tree()
    path = checkpoint.save(tmp_path / "a.safetensors", tree, settings={"total_steps": 6},
                           meta={"step": 3, "history": [{"loss": 0.1 + 0.2}, {"loss": float("nan")}]})
    template = jax.tree_util.tree_map(lambda x: 0.0 if type(x) is float else np.zeros_like(x), tree)
    loaded, meta = checkpoint.load(path, template, settings={"total_steps": 6})
    assert _same(loaded, tree)
    assert loaded["params"]["dense"]["kernel"].dtype == np.float32
    assert loaded["params"]["dense"]["bias"].dtype == np.float64 and loaded["step"].dtype == np.int32
    assert type(loaded["lr"]) is float and loaded["empty"] == {}
    assert meta["step"] == 3 and meta["history"][0]["loss"] == 0.1 + 0.2  # JSON keeps floats exactly
    assert np.isnan(meta["history"][1]["loss"])
    head = checkpoint.header(path)  # without reading the arrays
    assert head.settings == {"total_steps": 6} and head.meta["history"][0] == meta["history"][0]
    assert checkpoint.exists(path) and not checkpoint.exists(tmp_path / "b.safetensors")


def test_an_optax_state_round_trips_bit_identically(tmp_path):
    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)), jnp.float32),
              "b": jnp.zeros(3, jnp.float32)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2))
    opt = tx.init(params)
    for _ in range(3):  # non-trivial moments and a step count
        grads = jax.tree_util.tree_map(lambda p: jnp.sin(p) + 1.0, params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    state = {"params": params, "opt": opt}
    path = checkpoint.save(tmp_path / "opt.safetensors", state, settings={})
    # A template of shapes only: nothing is computed to load.
    template = jax.eval_shape(lambda: {"params": params, "opt": tx.init(params)})
    loaded, meta = checkpoint.load(path, template, settings={})
    assert meta == {} and _same(loaded, state)
    assert type(loaded["opt"]) is type(opt) and type(loaded["opt"][1][0]) is type(opt[1][0])
    assert loaded["opt"][1][0].count.dtype == np.int32 and int(loaded["opt"][1][0].count) == 3
    # The restored state continues training exactly as the original.
    a = tx.update(params, opt, params)[0]
    b = tx.update(loaded["params"], loaded["opt"], loaded["params"])[0]
    assert _same(a, b)


def test_other_settings_are_refused_naming_the_file_and_keys(tmp_path):
    path = checkpoint.save(tmp_path / "run.safetensors", _tree(), settings={"total_steps": 6, "kind": "x"})
    template = _tree()
    with pytest.raises(DataError, match=r"run\.safetensors.*total_steps: stored 6, given 3.*delete it"):
        checkpoint.load(path, template, settings={"total_steps": 3, "kind": "x"})
    with pytest.raises(DataError, match=r"run\.safetensors.*extra: stored \(absent\), given 1"):
        checkpoint.load(path, template, settings={"total_steps": 6, "kind": "x", "extra": 1})
    # Settings compare as JSON: a tuple equals the list it is stored as.
    checkpoint.save(path, _tree(), settings={"sizes": (1, 2)})
    checkpoint.load(path, template, settings={"sizes": [1, 2]})


def test_another_tree_is_refused(tmp_path):
    path = checkpoint.save(tmp_path / "t.safetensors", _tree(), settings={})
    other = _tree()
    other["params"]["dense"]["kernel"] = np.zeros((3, 5), np.float32)
    with pytest.raises(DataError, match=r"t\.safetensors holds 'params/dense/kernel' as float32\[3, 4\]"):
        checkpoint.load(path, other, settings={})
    other = _tree()
    other["params"]["dense"]["kernel"] = np.zeros((3, 4), np.float64)
    with pytest.raises(DataError, match="expected float64"):
        checkpoint.load(path, other, settings={})
    other = _tree()
    del other["counts"]
    with pytest.raises(DataError, match=r"t\.safetensors does not hold the expected tree.*'counts'"):
        checkpoint.load(path, other, settings={})


def test_non_checkpoints_are_refused_naming_the_file(tmp_path):
    with pytest.raises(DataError, match="nowhere.safetensors"):
        checkpoint.load(tmp_path / "nowhere.safetensors", _tree(), settings={})
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint at all")
    with pytest.raises(DataError, match=r"junk\.safetensors is not a linicl checkpoint"):
        checkpoint.load(tmp_path / "junk.safetensors", _tree(), settings={})
    import safetensors.numpy
    safetensors.numpy.save_file({"x": np.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(DataError, match=r"foreign\.safetensors is not a linicl checkpoint"):
        checkpoint.header(tmp_path / "foreign.safetensors")


def test_bad_arguments_name_what_is_wrong(tmp_path):
    with pytest.raises(LiniclError, match="settings must be JSON-serialisable"):
        checkpoint.save(tmp_path / "x.safetensors", _tree(), settings={"f": object()})
    with pytest.raises(LiniclError, match="not an array"):
        checkpoint.save(tmp_path / "x.safetensors", {"a": "text"}, settings={})
    assert os.listdir(tmp_path) == []


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "deep" / "ckpt.safetensors"
    checkpoint.save(path, _tree(), settings={"v": 1})
    checkpoint.save(path, _tree(), settings={"v": 2})  # replaces the file
    assert os.listdir(path.parent) == ["ckpt.safetensors"]  # no temporary file left behind
    assert checkpoint.header(path).settings == {"v": 2}

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, _tree(), settings={"v": 3})
    monkeypatch.undo()
    # The failed write removed its temporary file and left the previous checkpoint whole.
    assert os.listdir(path.parent) == ["ckpt.safetensors"]
    assert checkpoint.header(path).settings == {"v": 2}
    assert _same(checkpoint.load(path, _tree(), settings={"v": 2})[0], _tree())


def test_checksum_sees_every_value_dtype_shape_and_name():
    """One content hash for the training loops' fingerprints: equal for the same arrays (whatever the
    container), different for reordered rows, two entries moved by +-1 (the same sum), another dtype,
    shape or name."""
    rows = np.random.default_rng(2).integers(1, 90, (6, 5)).astype(np.int32)
    moved = rows.copy()
    moved[0, 0] += 1
    moved[3, 2] -= 1
    base = checkpoint.checksum(rows)
    assert base == checkpoint.checksum(rows.copy()) == checkpoint.checksum(jnp.asarray(rows))
    others = [rows[::-1], moved, rows.astype(np.int64), rows.reshape(5, 6), rows.T]
    assert all(checkpoint.checksum(x) != base for x in others)
    assert len({base, *map(checkpoint.checksum, others)}) == 1 + len(others)
    tree = _tree()
    assert checkpoint.checksum(tree) == checkpoint.checksum(_tree())
    renamed = _tree()
    renamed["params"]["dense"]["other"] = renamed["params"]["dense"].pop("bias")
    assert checkpoint.checksum(renamed) != checkpoint.checksum(tree)
    changed = _tree()
    changed["params"]["dense"]["kernel"][1, 2] = np.nextafter(changed["params"]["dense"]["kernel"][1, 2],
                                                              np.float32(np.inf))  # one ulp
    assert checkpoint.checksum(changed) != checkpoint.checksum(tree)


def test_a_setting_saved_as_nan_equals_itself(tmp_path):
    settings = {"lr": float("nan"), "grid": [1.0, float("nan")], "nested": {"x": float("nan")}}
    path = checkpoint.save(tmp_path / "nan.safetensors", _tree(), settings=settings)
    loaded, _ = checkpoint.load(path, _tree(), settings=settings)
    assert _same(loaded, _tree())
    with pytest.raises(DataError, match=r"lr: stored nan, given 0\.1"):  # NaN is still unequal to numbers
        checkpoint.load(path, _tree(), settings=dict(settings, lr=0.1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_checkpoint_holding_nan_or_inf_is_refused_by_name(tmp_path, bad):
    tree = _tree()
    tree["params"]["dense"]["bias"][2] = bad
    path = checkpoint.save(tmp_path / "diverged.safetensors", tree, settings={})
    with pytest.raises(DataError, match=r"diverged\.safetensors holds NaN or infinity in 1 array\(s\) "
                                        r"\('params/dense/bias'\)"):
        checkpoint.load(path, _tree(), settings={})
    assert checkpoint.header(path).settings == {}  # the header alone is still readable
