"""Parallelism over devices with ``jax.sharding``: the batch split over a ``"data"`` axis, and on a mesh that
also has a ``"model"`` axis the parameters sharded too (FSDP over ``"data"``, tensor parallel over ``"model"``).

Two kinds of mesh, and what each does with a model's variables:

* ``device_mesh()``: one axis ``"data"`` over every device. Parameters are **replicated** (each device
  holds a full copy) and only the batch is split: data parallelism. A forward pass never mixes rows, so
  nothing is communicated.
* ``make_mesh(model=m)``: axes ``("data", "model")`` of sizes ``(devices / m, m)``. Parameters are
  **sharded** by the rules of ``param_spec`` (``place``): tensor parallel over ``"model"`` (attention
  heads: the q/k/v kernels' head axis and ``o``'s; the MLP's hidden columns; the vocabulary of the
  embedding and unembedding; a converted prompt state's head axis), and FSDP over ``"data"`` (of what
  is left, the largest axis that divides). A model that does not fit one device then fits the mesh;
  ``make_mesh(model=1)`` is pure FSDP.

In both, ``jit`` partitions the computation (XLA's SPMD partitioner: no home-made collectives). Results
are the numbers of one device up to the order of floating-point sums, which XLA may pick differently
per layout (``tests/test_multidevice.py``, ``tests/library/test_sharding.py``).

* ``shard_batch(tree)``: axis 0 split over ``"data"`` (it must divide by the data axis's size;
  ``linicl.batching.pad_rows`` pads, ``linicl.batching.run_sharded`` does all of it).
* ``place(tree, mesh)``: a variables or parameter tree (or an optimiser state, ``place_like``) laid out
  as the mesh says: replicated on a data-only mesh, sharded by ``param_spec`` on one with ``"model"``.
  ``place(variables, mesh, model=m)`` first checks that the tree is ``m``'s (every path and shape of
  ``m.init``), so that another model's variables are refused by path here, not by Flax at apply.
* ``param_spec(path, shape, mesh)``: the ``PartitionSpec`` of one array, by the rules on its path
  (``TENSOR_RULES``): the one place where layouts are chosen.
* ``step_shardings(mesh, params, opt, n_logs=...)``: ``out_shardings`` of a jitted training step that
  keep the parameters and optimiser state where ``place`` put them (``linicl.linearize.train_maps``,
  ``train_lora`` and ``linicl.routing.train_router`` take a ``mesh``).

Every function refuses, by argument, what it cannot use (``LiniclError``): a mesh that is not a
``jax.sharding.Mesh`` with a ``"data"`` axis, no devices, repeated devices or ones that are not
``jax.Device``, a shape with a negative size, tree leaves that are not arrays or numbers, a training
state that ``place`` did not lay out on the mesh. These checks run on one device too.

On one device everything here is a no-op and functions run exactly as plain ``jit``. For CPU tests,
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before jax is imported) gives eight host
devices.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from linicl.errors import LiniclError
from linicl.names import DATA_AXIS, MODEL_AXIS, PARAMS, PROMPT_STATE

AXIS = DATA_AXIS  # the batch axis's name (kept for callers of the data-only mesh)

# Tensor parallelism: (pattern on the array's path "collection/scope/.../name", the axis split over
# "model"). Heads for attention (q/k/v kernels are [d_model, heads, d_head], o's [heads, d_head, d_model];
# the gates, feature maps and trainable bias are per head), hidden columns for the MLP, the vocabulary for
# the embeddings, the head axis of a converted prompt state ([batch, heads, ...]; a hybrid's stored keys and
# values, [batch, kv_heads, ...], split only where the model axis divides kv_heads). First match wins.
TENSOR_RULES = (
    (r"attn/(q|k|v|gate_proj|beta_proj)/kernel$", 1),
    (r"attn/(q|k|v|gate_proj|beta_proj)/bias$", 0),
    (r"attn/o/kernel$", 0),
    (r"attn/(gate|phi_\w+|S_bias|z_bias)$", 0),
    # the short convolution's state [batch, K - 1, heads, d_head] (before its taps' rule, which the
    # state's path also matches) and taps [K, heads, d_head]
    (rf"(^|/){PROMPT_STATE}/.*conv_[qkv]$", 2),
    (r"attn/conv_[qkv]$", 1),
    (r"mlp/(fc_in|fc_gate|fc_mid_\d+)/kernel$", 1),
    (r"mlp/(fc_in|fc_gate|fc_mid_\d+)/bias$", 0),
    (r"mlp/fc_out/kernel$", 0),
    (r"(^|/)params/embed$", 0),
    (r"unembed/kernel$", 1),
    (rf"(^|/){PROMPT_STATE}/", 1),
)
# Arrays smaller than this many elements stay whole on every device (norm scales, biases, offsets):
# splitting them saves nothing and costs a gather each.
MIN_SHARDED_SIZE = 1024


def _device_tuple(fn: str, devices) -> tuple:
    """``devices`` (None: all of ``jax.devices()``) as a tuple; refused when empty or when an entry is not
    a ``jax.Device`` (a name such as "cpu:0")."""
    if devices is None:
        return tuple(jax.devices())
    try:
        devices = tuple(devices)
    except TypeError:
        raise LiniclError(f"{fn}: devices must be a sequence of jax.Device, got {type(devices).__name__}") from None
    if not devices:
        raise LiniclError(f"{fn}: devices must hold at least one jax.Device, got none")
    for d in devices:
        if not isinstance(d, jax.Device):
            raise LiniclError(f"{fn}: devices must be jax.Device objects (jax.devices()), got {d!r}")
    return devices


def _check_distinct(fn: str, devices: tuple) -> None:
    """A device listed twice would hold two shards of every array: the mesh would split nothing."""
    if len(set(devices)) < len(devices):
        twice = sorted({str(d) for d in devices if devices.count(d) > 1})
        raise LiniclError(f"{fn}: devices must be distinct, got {twice} more than once")


def _check_mesh(fn: str, mesh, abstract: bool = False, optional: bool = False) -> Mesh:
    """``mesh`` if it is a ``Mesh`` (or, where only its shape is read, ``abstract``, an ``AbstractMesh``)
    with a ``"data"`` axis; else a LiniclError naming ``fn``. ``optional``: None means ``device_mesh()``."""
    if mesh is None and optional:
        return device_mesh()
    kinds = (Mesh, AbstractMesh) if abstract else (Mesh,)
    if not isinstance(mesh, kinds):
        raise LiniclError(f"{fn}: mesh must be a jax.sharding.Mesh (parallel.device_mesh() or make_mesh()), "
                          f"got {type(mesh).__name__}")
    if DATA_AXIS not in mesh.axis_names:  # the batch axis every layout here is stated in
        raise LiniclError(f"{fn}: mesh must have a {DATA_AXIS!r} axis (device_mesh() and make_mesh() make "
                          f"one), got axes {tuple(mesh.axis_names)}")
    return mesh


def _is_array_like(leaf) -> bool:
    """An array (jax, traced or NumPy) of numbers, bools or PRNG keys, or a Python or NumPy number: what
    ``jax.device_put`` can place."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return any(jnp.issubdtype(leaf.dtype, kind) for kind in (jnp.number, jnp.bool_, jax.dtypes.prng_key))
    return isinstance(leaf, (bool, int, float, complex))


def _check_leaves(fn: str, tree, what: str = "tree") -> None:
    """Refuse, by path, the first leaf of ``tree`` that ``_is_array_like`` does not accept (a string, a
    ``jax.ShapeDtypeStruct``, an object): ``device_put`` would fail on it deep inside."""
    for keys, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not _is_array_like(leaf):
            raise LiniclError(f"{fn}: {what} leaf {_path(keys) or '(root)'!r} must be an array or a number, got "
                              f"{type(leaf).__name__}{'' if not hasattr(leaf, 'dtype') else f' of dtype {leaf.dtype}'}")


def device_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-dimensional mesh (axis ``"data"``) over ``devices`` (default: all of ``jax.devices()``):
    data parallelism, parameters replicated. Meshes over the same devices compare equal, so compiled
    functions are reused across calls. Refuses no devices, repeated ones and entries that are not
    ``jax.Device``."""
    devices = _device_tuple("device_mesh", devices)
    _check_distinct("device_mesh", devices)
    return Mesh(np.asarray(devices, dtype=object), (DATA_AXIS,))


def make_mesh(model: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A two-dimensional mesh ``("data", "model")`` of shape ``(len(devices) // model, model)``: the batch
    over ``"data"``, parameters sharded (FSDP over ``"data"``, tensor parallel over ``"model"``). Refuses
    a ``model`` that is not an int >= 1 dividing the device count, no devices, repeated ones and entries
    that are not ``jax.Device``."""
    devices = _device_tuple("make_mesh", devices)
    if isinstance(model, bool) or not isinstance(model, (int, np.integer)) or model < 1 or len(devices) % model:
        raise LiniclError(f"make_mesh: model must be an int >= 1 dividing the {len(devices)} devices, got {model!r}")
    _check_distinct("make_mesh", devices)
    grid = np.asarray(devices, dtype=object).reshape(len(devices) // model, model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def data_size(mesh: Mesh) -> int:
    """How many ways the batch is split: the size of the mesh's ``"data"`` axis."""
    return int(_check_mesh("data_size", mesh, abstract=True).shape[DATA_AXIS])


def shards_params(mesh: Mesh) -> bool:
    """Whether ``place`` shards parameters on this mesh (it has a ``"model"`` axis) or replicates them."""
    return MODEL_AXIS in _check_mesh("shards_params", mesh, abstract=True).axis_names


def _check_shape(fn: str, shape) -> tuple:
    """``shape`` as a tuple of Python ints, each an int >= 0 (never a bool or a float, which ``int()``
    would truncate)."""
    if isinstance(shape, (str, bytes)) or not (isinstance(shape, Sequence)
                                               or isinstance(shape, np.ndarray) and shape.ndim == 1):
        raise LiniclError(f"{fn}: shape must be a sequence of ints >= 0, got {shape!r}")
    for size in shape:
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 0:
            raise LiniclError(f"{fn}: shape must be a sequence of ints >= 0, got {tuple(shape)!r}")
    return tuple(int(size) for size in shape)


def param_spec(path: str, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The ``PartitionSpec`` of the array at ``path`` (``"params/layers_0/attn/q/kernel"``) of ``shape``.

    On a data-only mesh: ``P()`` (replicated). Otherwise the first ``TENSOR_RULES`` entry matching the
    path names the axis split over ``"model"``; then the largest other axis that divides by the
    ``"data"`` size is split over it (FSDP). An axis that does not divide stays whole (e.g. SmolLM2's 3
    key/value heads over 2 model devices); arrays under ``MIN_SHARDED_SIZE`` elements stay whole.
    Refuses a ``path`` that is not a str, a ``shape`` that is not a sequence of ints >= 0 (a negative
    size would pass as a small array, replicated) and a mesh without a ``"data"`` axis."""
    if not isinstance(path, str):
        raise LiniclError(f"param_spec: path must be a str such as 'params/embed', got {path!r}")
    shape = _check_shape("param_spec", shape)
    _check_mesh("param_spec", mesh, abstract=True)
    if not shards_params(mesh) or int(np.prod(shape, dtype=np.int64)) < MIN_SHARDED_SIZE:
        return PartitionSpec()
    spec = [None] * len(shape)
    m, d = int(mesh.shape[MODEL_AXIS]), data_size(mesh)
    for pattern, axis in TENSOR_RULES:
        if re.search(pattern, path):
            if axis < len(shape) and m > 1 and shape[axis] % m == 0:
                spec[axis] = MODEL_AXIS
            break
    if d > 1:
        free = [i for i in range(len(shape)) if spec[i] is None and shape[i] % d == 0]
        if free:
            spec[max(free, key=lambda i: (shape[i], -i))] = DATA_AXIS
    while spec and spec[-1] is None:  # one spelling per layout: P("data") == P("data", None) as layouts
        spec.pop()
    return PartitionSpec(*spec)


def _path(keys) -> str:
    parts = []
    for k in keys:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(name))
    return "/".join(parts)


def _check_prefix(fn: str, prefix) -> None:
    if not isinstance(prefix, str):
        raise LiniclError(f"{fn}: prefix must be a str such as {PARAMS!r} (prepended to the paths), got {prefix!r}")


def _shapes(tree) -> dict:
    """``{path: shape}`` of every leaf, in ``tree``'s order."""
    return {_path(keys): tuple(np.shape(leaf)) for keys, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _check_variables_of(fn: str, model, tree, prefix: str) -> None:
    """Refuse, naming the first path that differs, a ``tree`` that is not ``model``'s variables
    (``prefix=""``) or parameters (``prefix="params"``): each path and shape that ``model.init`` makes
    (read off ``jax.eval_shape``: nothing is computed), and nothing more in those collections. Other
    collections (a converted prompt state) are not the model's to check. Flax would otherwise refuse
    another model's variables only at apply, with a ``ScopeParamShapeError``."""
    # Duck-typed: this module sits below linicl.nn and may not import the Transformer.
    if not callable(getattr(model, "init", None)) or not hasattr(model, "cfg"):
        raise LiniclError(f"{fn}: model must be a linicl.Transformer, got {type(model).__name__}")
    if prefix not in ("", PARAMS):
        raise LiniclError(f"{fn}: model= checks a model's variables (prefix='') or its parameters "
                          f"(prefix={PARAMS!r}), got prefix={prefix!r}")
    made = jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 1), jnp.int32))
    if prefix:
        made, tree = {PARAMS: made[PARAMS]}, {PARAMS: tree}
    if not isinstance(tree, Mapping):
        raise LiniclError(f"{fn}: the variables of a model are a dict of collections ({PARAMS!r}, ...), got "
                          f"{type(tree).__name__}")
    want = _shapes(made)
    got = _shapes({c: tree[c] for c in made if c in tree})
    for path, shape in want.items():
        if path not in got:
            raise LiniclError(f"{fn}: the variables lack {path!r} (shape {shape}) of the model: are they "
                              f"another model's?")
        if got[path] != shape:
            raise LiniclError(f"{fn}: {path!r} has shape {got[path]}, the model's has {shape}: are the "
                              f"variables another model's?")
    extra = [path for path in got if path not in want]
    if extra:
        raise LiniclError(f"{fn}: {extra[0]!r} is not a variable of the model ({len(extra)} such): are the "
                          f"variables another model's?")


def shardings(tree: Any, mesh: Mesh, prefix: str = "") -> Any:
    """``tree`` with every array replaced by its ``NamedSharding`` on ``mesh`` (``param_spec`` of its
    path): for ``jax.jit(..., in_shardings=..., out_shardings=...)`` or ``jax.device_put``. ``prefix``
    is prepended to the paths (``"params"`` for a bare parameter tree)."""
    _check_mesh("shardings", mesh)
    _check_prefix("shardings", prefix)

    def one(keys, leaf):
        path = "/".join(p for p in (prefix, _path(keys)) if p)
        return NamedSharding(mesh, param_spec(path, np.shape(leaf), mesh))
    return jax.tree_util.tree_map_with_path(one, tree)


def place(tree: Any, mesh: Optional[Mesh] = None, prefix: str = "", *, model: Any = None) -> Any:
    """``tree`` (a model's variables ``{"params": ..., ...}``, or a bare parameter tree with
    ``prefix="params"``) on the mesh's devices: replicated on a data-only mesh, sharded by
    ``param_spec`` on one with a ``"model"`` axis. On one device this returns ``tree``.

    ``model`` (a ``linicl.Transformer``): check first that ``tree`` holds that model's variables (or,
    with ``prefix="params"``, its parameters), every path with its shape, and refuse by path the first
    that differs (another model's variables would otherwise fail only at apply, inside Flax). Leaves
    that are not arrays or numbers are refused, on one device too."""
    mesh = _check_mesh("place", mesh, optional=True)
    _check_prefix("place", prefix)
    _check_leaves("place", tree)
    if model is not None:
        _check_variables_of("place", model, tree, prefix)
    if mesh.size == 1:
        return tree
    if not shards_params(mesh):
        return replicate(tree, mesh)
    return jax.device_put(tree, shardings(tree, mesh, prefix))


def place_like(state: Any, params: Any, mesh: Optional[Mesh] = None, prefix: str = "params") -> Any:
    """An optimiser state (``optax``) laid out like the parameters it mirrors: each leaf whose path ends
    with a parameter's path and has its shape takes that parameter's layout (Adam's ``mu`` and ``nu``);
    the rest (step counts) is replicated."""
    mesh = _check_mesh("place_like", mesh, optional=True)
    _check_prefix("place_like", prefix)
    _check_leaves("place_like", state, "state")
    _check_leaves("place_like", params, "params")
    if mesh.size == 1:
        return state
    if not shards_params(mesh):
        return replicate(state, mesh)
    own = {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = _path(keys)
        own[path] = (np.shape(leaf), param_spec("/".join(p for p in (prefix, path) if p), np.shape(leaf), mesh))

    def one(keys, leaf):
        path = _path(keys)
        for p, (shape, spec) in own.items():
            if (path == p or path.endswith("/" + p)) and np.shape(leaf) == shape:
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, PartitionSpec())
    return jax.device_put(state, jax.tree_util.tree_map_with_path(one, state))


def replicate(tree: Any, mesh: Optional[Mesh] = None) -> Any:
    """``tree`` with every array placed whole on every device of the mesh (edit values, small trees).
    Arrays that are already so placed are not copied again; on one device this returns ``tree``."""
    mesh = _check_mesh("replicate", mesh, optional=True)
    _check_leaves("replicate", tree)
    if mesh.size == 1:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(tree: Any, mesh: Optional[Mesh] = None) -> Any:
    """``tree`` with the axis 0 of every array split over the mesh's ``"data"`` axis (each data shard
    holds ``batch / data_size`` rows; on a mesh with ``"model"`` they are replicated over it). The batch
    must divide by the data size (``pad_rows``); on one device this returns ``tree``."""
    mesh = _check_mesh("shard_batch", mesh, optional=True)
    _check_leaves("shard_batch", tree, "batch")
    if mesh.size == 1:
        return tree
    d = data_size(mesh)
    for leaf in jax.tree_util.tree_leaves(tree):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] % d:
            raise LiniclError(f"shard_batch: a batch of shape {np.shape(leaf)} does not split evenly over "
                              f"the {d} data shards; pad it with linicl.batching.pad_rows")
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(DATA_AXIS)))


def step_shardings(mesh: Mesh, *state: Any, n_logs: int = 0):
    """``out_shardings`` for a jitted training step returning ``(*state, *logs)``: each state tree (params,
    optimiser state) keeps the layout it was placed with, the ``n_logs`` log values come back whole.
    ``None`` (let XLA choose) where parameters are not sharded. Without it XLA may return updated
    parameters in another layout than it was given them (then every step would reshard them).

    Where it is not ``None``, every state leaf must be a ``jax.Array`` laid out on ``mesh`` (``place``,
    ``place_like``): a NumPy array or one on another mesh has no layout here to keep."""
    _check_mesh("step_shardings", mesh)
    if isinstance(n_logs, (bool, np.bool_)) or not isinstance(n_logs, (int, np.integer)) or n_logs < 0:
        raise LiniclError(f"step_shardings: n_logs must be an int >= 0 (the step's log values), got {n_logs!r}")
    if mesh.size == 1 or not shards_params(mesh):
        return None
    for i, tree in enumerate(state):
        for keys, x in jax.tree_util.tree_leaves_with_path(tree):
            sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
            if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
                where = f"a {type(x).__name__}" if sharding is None else f"laid out by {sharding}"
                raise LiniclError(f"step_shardings: state {i} leaf {_path(keys) or '(root)'!r} is {where}, not "
                                  f"on this mesh; place it first (parallel.place, place_like)")
    whole = NamedSharding(mesh, PartitionSpec())
    kept = tuple(jax.tree_util.tree_map(lambda x: x.sharding, t) for t in state)
    return kept + (whole,) * int(n_logs)


def device_bytes(tree: Any) -> dict:
    """Bytes of ``tree``'s arrays held by each device: ``{device id: bytes}`` (a sharded array counts
    its shard on each device, a replicated one its whole size on every device)."""
    out: dict = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


__all__ = ["AXIS", "TENSOR_RULES", "MIN_SHARDED_SIZE", "device_mesh", "make_mesh", "data_size", "shards_params",
           "param_spec", "shardings", "place", "place_like", "replicate", "shard_batch", "step_shardings",
           "device_bytes"]
