"""What linicl.parallel refuses (issue 52, items 5 and 13), by argument and before any placing: meshes
with no, repeated or unnamed devices; shapes with a negative size; a mesh that is not one, or has no
"data" axis; tree leaves that are not arrays; another model's variables (``place(..., model=)``); a
training state that was not placed on the mesh (``step_shardings``). All but the last hold on one
device; the last needs several, so it runs in a 2-device subprocess (XLA_FLAGS is read at import)."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import parallel
from linicl.errors import LiniclError
from helpers import on_host_devices

ONE = jax.devices()[:1]


@pytest.fixture(scope="module")
def tiny():
    """A tiny model, its variables, and variables of a model of another width."""
    cfg = linicl.ModelConfig(vocab_size=16, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=16,
                             attention="softmax", dtype="float64")
    model = linicl.Transformer(cfg)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    other = linicl.Transformer(cfg.replace(d_ff=32)).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    return model, variables, other


@pytest.mark.parametrize("make", [parallel.device_mesh, lambda devices: parallel.make_mesh(1, devices)],
                         ids=["device_mesh", "make_mesh"])
@pytest.mark.parametrize("devices, match", [
    ([], "devices must hold at least one jax.Device, got none"),
    (ONE * 2, r"devices must be distinct, got \['.*'\] more than once"),
    (["cpu:0"], "devices must be jax.Device objects .*, got 'cpu:0'"),
    ("ab", "devices must be jax.Device objects .*, got 'a'"),
    (3, "devices must be a sequence of jax.Device, got int"),
])
def test_meshes_refuse_no_repeated_or_unnamed_devices(make, devices, match):
    with pytest.raises(LiniclError, match=match):
        make(devices)


def test_make_mesh_over_no_devices_is_refused_whatever_the_model_size():
    with pytest.raises(LiniclError, match="make_mesh: devices must hold at least one"):
        parallel.make_mesh(2, devices=[])


@pytest.mark.parametrize("path, shape, match", [
    ("params/embed", (-5, 4000), r"shape must be a sequence of ints >= 0, got \(-5, 4000\)"),
    ("params/embed", (5.0, 4000), r"shape must be a sequence of ints >= 0, got \(5.0, 4000\)"),
    ("params/embed", (True, 4000), "shape must be a sequence of ints >= 0"),
    ("params/embed", 4000, "shape must be a sequence of ints >= 0, got 4000"),
    (("params", "embed"), (8, 4000), "path must be a str"),
])
def test_param_spec_refuses_a_negative_size_and_other_shapes(path, shape, match):
    with pytest.raises(LiniclError, match="param_spec: " + match):
        parallel.param_spec(path, shape, parallel.make_mesh(1, ONE))


NO_DATA = jax.sharding.Mesh(np.asarray(ONE, dtype=object), ("x",))
ONLY_MODEL = jax.sharding.Mesh(np.asarray(ONE, dtype=object), ("model",))
CALLS = {
    "param_spec": lambda mesh: parallel.param_spec("params/embed", (64, 64), mesh),
    "data_size": parallel.data_size,
    "shards_params": parallel.shards_params,
    "shardings": lambda mesh: parallel.shardings({"a": np.zeros(4)}, mesh),
    "place": lambda mesh: parallel.place({"a": np.zeros(4)}, mesh),
    "place_like": lambda mesh: parallel.place_like({"mu": np.zeros(4)}, {"a": np.zeros(4)}, mesh),
    "replicate": lambda mesh: parallel.replicate({"a": np.zeros(4)}, mesh),
    "shard_batch": lambda mesh: parallel.shard_batch(np.zeros((2, 3)), mesh),
    "step_shardings": lambda mesh: parallel.step_shardings(mesh, {"a": np.zeros(4)}),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_mesh_without_a_data_axis_or_not_a_mesh_is_refused(name):
    for mesh in (NO_DATA, ONLY_MODEL):
        with pytest.raises(LiniclError, match=f"{name}: mesh must have a 'data' axis"):
            CALLS[name](mesh)
    with pytest.raises(LiniclError, match=f"{name}: mesh must be a jax.sharding.Mesh .*, got str"):
        CALLS[name]("mesh")


@pytest.mark.parametrize("leaf, kind", [("text", "str"), (np.array(["a", "b"]), "ndarray of dtype <U1"),
                                        (jax.ShapeDtypeStruct((2,), jnp.float32), "ShapeDtypeStruct"),
                                        (object(), "object")])
def test_leaves_that_are_not_arrays_are_refused_by_path(leaf, kind):
    tree = {"params": {"w": np.zeros(3), "bad": leaf}}
    mesh = parallel.device_mesh(ONE)
    for name, call, what in (("place", lambda: parallel.place(tree, mesh), "tree"),
                             ("replicate", lambda: parallel.replicate(tree, mesh), "tree"),
                             ("shard_batch", lambda: parallel.shard_batch(tree, mesh), "batch"),
                             ("place_like", lambda: parallel.place_like(tree, {"w": np.zeros(3)}, mesh), "state")):
        with pytest.raises(LiniclError, match=f"{name}: {what} leaf 'params/bad' must be an array or a number, "
                                              f"got {kind}"):
            call()


def test_placing_another_models_variables_names_the_first_differing_path(tiny):
    model, variables, other = tiny
    mesh = parallel.make_mesh(1, ONE)
    # without the check they pass here and Flax refuses them only at apply
    with pytest.raises(Exception, match="ScopeParamShapeError|shape"):
        model.apply(parallel.place(other, mesh), jnp.zeros((1, 2), jnp.int32))
    wrong = r"'params/layers_0/mlp/fc_in/bias' has shape \(32,\), the model's has \(16,\)"
    with pytest.raises(LiniclError, match="place: " + wrong):
        parallel.place(other, mesh, model=model)
    with pytest.raises(LiniclError, match="place: " + wrong):
        parallel.place(other["params"], mesh, "params", model=model)
    params = dict(variables["params"])
    del params["ln_f"]
    with pytest.raises(LiniclError, match=r"place: the variables lack 'params/ln_f/bias' \(shape \(8,\)\)"):
        parallel.place({"params": params}, mesh, model=model)
    with pytest.raises(LiniclError, match="place: 'params/extra' is not a variable of the model"):
        parallel.place({"params": {**variables["params"], "extra": np.zeros(2)}}, mesh, model=model)
    with pytest.raises(LiniclError, match="place: model must be a linicl.Transformer, got ModelConfig"):
        parallel.place(variables, mesh, model=model.cfg)
    with pytest.raises(LiniclError, match="place: model= checks a model's variables .* got prefix='x'"):
        parallel.place(variables, mesh, "x", model=model)


def test_placing_the_models_own_variables_passes_the_check(tiny):
    model, variables, _ = tiny
    mesh = parallel.make_mesh(1, ONE)
    assert parallel.place(variables, mesh, model=model) is variables  # one device: unchanged
    assert parallel.place(variables["params"], mesh, "params", model=model) is variables["params"]
    # another collection (a converted prompt state) is not the model's to check
    with_state = {**variables, "prompt_state": {"layers_0": {"attn": {"S": np.zeros((1, 2, 4, 4))}}}}
    assert parallel.place(with_state, mesh, model=model) is with_state


@pytest.mark.parametrize("n_logs", [-1, True, 1.0])
def test_step_shardings_refuses_a_bad_log_count(n_logs):
    with pytest.raises(LiniclError, match="step_shardings: n_logs must be an int >= 0"):
        parallel.step_shardings(parallel.make_mesh(1, ONE), {"a": np.zeros(4)}, n_logs=n_logs)


SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    from linicl import parallel
    from linicl.errors import LiniclError

    mesh = parallel.make_mesh(1)  # 2 x 1: parameters are sharded, so the state's layout is kept
    params = {"w": np.zeros((64, 32))}
    out = {}
    for name, state in (("numpy", params), ("one device", jax.device_put(params, jax.devices()[0])),
                        ("other mesh", parallel.place(params, parallel.make_mesh(2)))):
        try:
            parallel.step_shardings(mesh, parallel.place(params, mesh), state, n_logs=1)
            out[name] = "accepted"
        except LiniclError as e:
            out[name] = str(e)
    kept = parallel.step_shardings(mesh, parallel.place(params, mesh), n_logs=1)
    out["placed"] = [list(kept[0]["w"].spec), list(kept[1].spec)]
    print("RESULT " + json.dumps(out))
""")


def test_step_shardings_refuses_a_state_not_placed_on_the_mesh(tmp_path):
    script = tmp_path / "steps2.py"
    script.write_text(SCRIPT)
    out = on_host_devices(script, 2, timeout=300)
    assert out["numpy"].startswith("step_shardings: state 1 leaf 'w' is a ndarray, not on this mesh; place it")
    assert out["one device"].startswith("step_shardings: state 1 leaf 'w' is laid out by SingleDeviceSharding")
    assert out["other mesh"].startswith("step_shardings: state 1 leaf 'w' is laid out by NamedSharding")
    assert out["placed"] == [["data"], []]  # a placed state keeps its layout; the log comes back whole


BATCH_SCRIPT = """
import json
import numpy as np
import jax
from linicl import parallel
mesh = parallel.make_mesh(2)  # 4 devices: data 2 x model 2
x = parallel.shard_batch(np.arange(8.0).reshape(4, 2), mesh)
rows = sorted({(s.index[0].start, s.index[0].stop) for s in x.addressable_shards})
print("RESULT " + json.dumps(dict(spec=[list(a) if isinstance(a, tuple) else a for a in x.sharding.spec],
                                  rows=rows, devices=len(x.addressable_shards))))
"""


def test_shard_batch_splits_the_batch_over_the_data_axis_only(tmp_path):
    """On a data x model mesh the batch is split over "data" and replicated over "model" (a batch split
    over every axis gives the same numbers, so only its layout tells; mutant batch-over-model-axis)."""
    script = tmp_path / "batch4.py"
    script.write_text(BATCH_SCRIPT)
    out = on_host_devices(script, 4, timeout=300)
    assert out["spec"] == ["data"] and out["devices"] == 4
    assert out["rows"] == [[0, 2], [2, 4]]  # two data shards of two rows, each held by both model devices
