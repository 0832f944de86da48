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
* ``param_spec(path, shape, mesh)``: the ``PartitionSpec`` of one array, by the rules on its path
  (``TENSOR_RULES``): the one place where layouts are chosen.
* ``step_shardings(mesh, params, opt, n_logs=...)``: ``out_shardings`` of a jitted training step that
  keep the parameters and optimiser state where ``place`` put them (``linicl.linearize.train_maps``,
  ``train_lora`` and ``linicl.routing.train_router`` take a ``mesh``).

On one device everything here is a no-op and functions run exactly as plain ``jit``. For CPU tests,
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before jax is imported) gives eight host
devices.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linicl.errors import LiniclError
from linicl.names import DATA_AXIS, MODEL_AXIS, PROMPT_STATE

AXIS = DATA_AXIS  # the batch axis's name (kept for callers of the data-only mesh)

# Tensor parallelism: (pattern on the array's path "collection/scope/.../name", the axis split over
# "model"). Heads for attention (q/k/v kernels are [d_model, heads, d_head], o's [heads, d_head, d_model];
# the gates, feature maps and trainable bias are per head), hidden columns for the MLP, the vocabulary for
# the embeddings, the head axis of a converted prompt state ([batch, heads, ...]). First match wins.
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


def device_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-dimensional mesh (axis ``"data"``) over ``devices`` (default: all of ``jax.devices()``):
    data parallelism, parameters replicated. Meshes over the same devices compare equal, so compiled
    functions are reused across calls."""
    devices = tuple(jax.devices() if devices is None else devices)
    if not devices:
        raise LiniclError("device_mesh: no devices")
    return Mesh(np.asarray(devices, dtype=object), (DATA_AXIS,))


def make_mesh(model: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A two-dimensional mesh ``("data", "model")`` of shape ``(len(devices) // model, model)``: the batch
    over ``"data"``, parameters sharded (FSDP over ``"data"``, tensor parallel over ``"model"``)."""
    devices = tuple(jax.devices() if devices is None else devices)
    if isinstance(model, bool) or not isinstance(model, (int, np.integer)) or model < 1 or len(devices) % model:
        raise LiniclError(f"make_mesh: model must be an int >= 1 dividing the {len(devices)} devices, got {model!r}")
    grid = np.asarray(devices, dtype=object).reshape(len(devices) // model, model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def data_size(mesh: Mesh) -> int:
    """How many ways the batch is split: the size of the mesh's ``"data"`` axis."""
    return int(mesh.shape[DATA_AXIS])


def shards_params(mesh: Mesh) -> bool:
    """Whether ``place`` shards parameters on this mesh (it has a ``"model"`` axis) or replicates them."""
    return MODEL_AXIS in mesh.axis_names


def param_spec(path: str, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The ``PartitionSpec`` of the array at ``path`` (``"params/layers_0/attn/q/kernel"``) of ``shape``.

    On a data-only mesh: ``P()`` (replicated). Otherwise the first ``TENSOR_RULES`` entry matching the
    path names the axis split over ``"model"``; then the largest other axis that divides by the
    ``"data"`` size is split over it (FSDP). An axis that does not divide stays whole (e.g. SmolLM2's 3
    key/value heads over 2 model devices); arrays under ``MIN_SHARDED_SIZE`` elements stay whole."""
    shape = tuple(int(s) for s in shape)
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


def shardings(tree: Any, mesh: Mesh, prefix: str = "") -> Any:
    """``tree`` with every array replaced by its ``NamedSharding`` on ``mesh`` (``param_spec`` of its
    path): for ``jax.jit(..., in_shardings=..., out_shardings=...)`` or ``jax.device_put``. ``prefix``
    is prepended to the paths (``"params"`` for a bare parameter tree)."""
    def one(keys, leaf):
        path = "/".join(p for p in (prefix, _path(keys)) if p)
        return NamedSharding(mesh, param_spec(path, np.shape(leaf), mesh))
    return jax.tree_util.tree_map_with_path(one, tree)


def place(tree: Any, mesh: Optional[Mesh] = None, prefix: str = "") -> Any:
    """``tree`` (a model's variables ``{"params": ..., ...}``, or a bare parameter tree with
    ``prefix="params"``) on the mesh's devices: replicated on a data-only mesh, sharded by
    ``param_spec`` on one with a ``"model"`` axis. On one device this returns ``tree``."""
    mesh = device_mesh() if mesh is None else mesh
    if mesh.size == 1:
        return tree
    if not shards_params(mesh):
        return replicate(tree, mesh)
    return jax.device_put(tree, shardings(tree, mesh, prefix))


def place_like(state: Any, params: Any, mesh: Optional[Mesh] = None, prefix: str = "params") -> Any:
    """An optimiser state (``optax``) laid out like the parameters it mirrors: each leaf whose path ends
    with a parameter's path and has its shape takes that parameter's layout (Adam's ``mu`` and ``nu``);
    the rest (step counts) is replicated."""
    mesh = device_mesh() if mesh is None else mesh
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
    mesh = device_mesh() if mesh is None else mesh
    if mesh.size == 1:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(tree: Any, mesh: Optional[Mesh] = None) -> Any:
    """``tree`` with the axis 0 of every array split over the mesh's ``"data"`` axis (each data shard
    holds ``batch / data_size`` rows; on a mesh with ``"model"`` they are replicated over it). The batch
    must divide by the data size (``pad_rows``); on one device this returns ``tree``."""
    mesh = device_mesh() if mesh is None else mesh
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
    parameters in another layout than it was given them (then every step would reshard them)."""
    if mesh.size == 1 or not shards_params(mesh):
        return None
    whole = NamedSharding(mesh, PartitionSpec())
    kept = tuple(jax.tree_util.tree_map(lambda x: x.sharding, t) for t in state)
    return kept + (whole,) * n_logs


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
