"""Data parallelism over every visible device with ``jax.sharding``: shard the batch, replicate the rest.

The model's parameters are replicated on each device and the batch axis (axis 0) of the inputs is split
across a one-dimensional ``Mesh`` whose axis is called ``"data"``. A jitted function called on such inputs
runs as one SPMD program: XLA partitions it along the batch, each device computes its rows, and nothing
is communicated (a forward pass never mixes rows). Results are the same numbers as on one device, up to
the order of floating-point sums inside each row's matmuls, which XLA may pick differently for a
different per-device batch (see ``tests/test_multidevice.py``).

* ``device_mesh()``: the mesh over ``jax.devices()``.
* ``replicate(tree)`` / ``shard_batch(tree)``: ``jax.device_put`` with ``NamedSharding(mesh, P())`` /
  ``NamedSharding(mesh, P("data"))``. The batch must divide by the device count
  (``linicl.batching.pad_rows`` pads it; ``linicl.batching.run_sharded`` does all of it).

On one device everything here is a no-op and functions run exactly as plain ``jit``. For CPU tests,
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before jax is imported) gives four host
devices.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linicl.errors import LiniclError

AXIS = "data"


def device_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-dimensional mesh (axis ``"data"``) over ``devices`` (default: all of ``jax.devices()``).
    Meshes over the same devices compare equal, so compiled functions are reused across calls."""
    devices = tuple(jax.devices() if devices is None else devices)
    if not devices:
        raise LiniclError("device_mesh: no devices")
    return Mesh(np.asarray(devices, dtype=object), (AXIS,))


def replicate(tree: Any, mesh: Optional[Mesh] = None) -> Any:
    """``tree`` with every array placed whole on every device of the mesh (parameters, edit values).
    Arrays that are already so placed are not copied again; on one device this returns ``tree``."""
    mesh = device_mesh() if mesh is None else mesh
    if mesh.size == 1:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(tree: Any, mesh: Optional[Mesh] = None) -> Any:
    """``tree`` with the axis 0 of every array split across the mesh's devices (each holds
    ``batch / devices`` rows). The batch must divide by the device count (``pad_rows``); on one device
    this returns ``tree``."""
    mesh = device_mesh() if mesh is None else mesh
    if mesh.size == 1:
        return tree
    for leaf in jax.tree_util.tree_leaves(tree):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] % mesh.size:
            raise LiniclError(f"shard_batch: a batch of shape {np.shape(leaf)} does not split evenly over "
                              f"{mesh.size} devices; pad it with linicl.batching.pad_rows")
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(AXIS)))


__all__ = ["AXIS", "device_mesh", "replicate", "shard_batch"]
