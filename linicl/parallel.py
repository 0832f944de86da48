"""Data parallelism over every visible device with ``jax.sharding``: shard the batch, replicate the rest.

The model's parameters are replicated on each device and the batch axis (axis 0) of the inputs is split
across a one-dimensional ``Mesh`` whose axis is called ``"data"``. A jitted function called on such inputs
runs as one SPMD program: XLA partitions it along the batch, each device computes its rows, and nothing
is communicated (a forward pass never mixes rows). Results are the same numbers as on one device, up to
the order of floating-point sums inside each row's matmuls, which XLA may pick differently for a
different per-device batch (see ``tests/test_multidevice.py``).

* ``device_mesh()``: the mesh over ``jax.devices()`` (cached).
* ``replicate(tree)`` / ``shard_batch(tree)``: ``jax.device_put`` with ``NamedSharding(mesh, P())`` /
  ``NamedSharding(mesh, P("data"))``. The batch must divide by the device count: ``pad_rows`` pads it.
* ``run_sharded(fn, replicated, batched)``: pad, shard, call, drop the padding rows.
* ``collect_activations(model, variables, prompts, names)``: last-token (or mean) activations at named
  sites over many prompts, batched, bucketed and sharded like ``linicl.evaluate``.

On one device everything here is a no-op: nothing is moved or padded (except to the fixed batch and
length buckets, which keep compilation to a few shapes), and the functions run exactly as plain ``jit``.
For CPU tests, ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before jax is imported)
gives four host devices.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linicl.errors import LiniclError

AXIS = "data"


@functools.lru_cache(maxsize=8)
def _mesh(devices: tuple) -> Mesh:
    return Mesh(np.asarray(devices, dtype=object), (AXIS,))


def device_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-dimensional mesh (axis ``"data"``) over ``devices`` (default: all of ``jax.devices()``)."""
    devices = tuple(jax.devices() if devices is None else devices)
    if not devices:
        raise LiniclError("device_mesh: no devices")
    return _mesh(devices)


def n_shards(mesh: Optional[Mesh] = None) -> int:
    """How many ways the batch is split (the number of devices in the mesh)."""
    return (device_mesh() if mesh is None else mesh).size


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // int(multiple)) * int(multiple)


def pad_rows(x, n: int) -> np.ndarray:
    """``x`` with its axis 0 grown to ``n`` rows by repeating its first row (padding rows are valid
    inputs, e.g. real token ids and a length >= 1, so they never produce NaN; drop their outputs)."""
    x = np.asarray(x)
    if x.shape[0] > n:
        raise LiniclError(f"pad_rows: {x.shape[0]} rows do not fit in {n}")
    if x.shape[0] == n:
        return x
    if x.shape[0] == 0:
        raise LiniclError("pad_rows: cannot pad an empty batch (no row to repeat)")
    return np.concatenate([x, np.repeat(x[:1], n - x.shape[0], axis=0)], axis=0)


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
                              f"{mesh.size} devices; pad it with pad_rows(x, round_up(n, {mesh.size}))")
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(AXIS)))


def run_sharded(fn: Callable, replicated: Any, batched: Sequence[Any], mesh: Optional[Mesh] = None) -> Any:
    """``fn(replicated, *batched)`` with ``replicated`` on every device and the rows of every array in
    ``batched`` (a sequence of pytrees whose leaves all have the same axis 0 of size n) split across the
    devices. The batch is padded to a multiple of the device count, and every output (a pytree of
    arrays with axis 0 = batch) comes back as NumPy with the padding rows dropped. ``fn`` is typically
    ``jax.jit``-ed; on one device this is ``fn(replicated, *batched)`` converted to NumPy."""
    mesh = device_mesh() if mesh is None else mesh
    sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(list(batched))}
    if len(sizes) != 1:
        raise LiniclError(f"run_sharded: the batched arrays have different batch sizes {sorted(sizes)}")
    n = sizes.pop()
    if mesh.size > 1:
        padded = round_up(n, mesh.size)
        batched = [shard_batch(jax.tree_util.tree_map(lambda x: pad_rows(x, padded), b), mesh) for b in batched]
        replicated = replicate(replicated, mesh)
    out = fn(replicated, *batched)
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[:n], out)


# ---------------------------------------------------------------------------------------- activations
Reduce = Union[str, Callable]


def _position_axis(name: str) -> int:
    """Where the query positions are: axis 2 at score/pattern sites, axis 1 everywhere else."""
    return 2 if name.endswith(("hook_attn_scores", "hook_pattern")) else 1


def _reduce(act: jax.Array, name: str, lengths: jax.Array, how: Reduce, tokens: jax.Array) -> jax.Array:
    if callable(how):
        return how(act, name, tokens, lengths)
    axis = _position_axis(name)
    T = act.shape[axis]
    moved = jnp.moveaxis(act, axis, 1)  # [b, T, ...]
    if how == "last":
        idx = (lengths - 1).reshape((-1, 1) + (1,) * (moved.ndim - 2))
        return jnp.take_along_axis(moved, idx, axis=1)[:, 0]
    real = (jnp.arange(T)[None, :] < lengths[:, None]).reshape(moved.shape[:2] + (1,) * (moved.ndim - 2))
    return jnp.sum(jnp.where(real, moved, 0), axis=1) / lengths.reshape((-1,) + (1,) * (moved.ndim - 2))


@functools.lru_cache(maxsize=64)
def _collect_fn(model, names: tuple, how: Reduce, edit_names: tuple, edits_fn: Optional[Callable],
                with_extras: bool):
    from linicl.evaluate import apply_edits
    from linicl.interventions import capture
    from linicl.nn.transformer import config_of
    cfg = config_of(model)

    def run(variables, edit_values, tokens, lengths, extras):
        edits = list(zip(edit_names, edit_values))
        if edits_fn is not None:
            edits += list(edits_fn(tokens, lengths, *((extras,) if with_extras else ())))
        if edits:
            variables = apply_edits(variables, edits, cfg)
        _, acts = capture(model, variables, tokens, names=list(names), hidden=True)
        return {n: _reduce(acts[n], n, lengths, how, tokens) for n in names}
    return jax.jit(run)


def collect_activations(model, variables: Mapping, prompts, names: Sequence[str], *, reduce: Reduce = "last",
                        batch_size: int = 16, bucket: Union[int, str] = "geometric", edits=None,
                        extras=None, mesh: Optional[Mesh] = None, progress: bool = False) -> dict:
    """Activations at the named sites, reduced over positions, for many prompts: ``{name: np.ndarray[N,
    ...]}`` in the order of the prompts. Batched, length-bucketed and sharded like ``linicl.evaluate``
    (one compile per length bucket).

    Args:
      prompts: a sequence of ``linicl.data.Prompt`` (or 1-D token arrays), a ``PromptBatch``, or an
        iterable of ``PromptBatch`` (their rows are concatenated).
      names: site names (``linicl.interventions.site_names``; ``("q", 20)`` shorthands work).
      reduce: ``"last"``: each prompt's last real token (the next-token position): ``[N, d_model]`` at
        residual sites, ``[N, heads, d_head]`` at ``hook_q``/``hook_k``, ``[N, heads, k_seq]`` at
        ``hook_pattern``/``hook_attn_scores``, whose key axis is cut (or zero-padded) to the longest
        prompt; ``"mean"``: the mean over each prompt's real tokens; or a function
        ``fn(act, name, tokens, lengths) -> [b, ...]`` (traced, on the padded batch).
      batch_size, bucket, edits, extras, mesh: as in ``linicl.evaluate`` (edits apply before the
        activations are read, so an edited site reports its edited value).
    """
    from linicl.evaluate import _as_rows, _batches, _check_extras, _check_lengths, _split_edits
    from linicl.interventions import check_names, full_name
    from linicl.nn.transformer import config_of

    cfg = config_of(model)
    names = tuple(full_name(n) for n in names)
    if not names:
        raise LiniclError("collect_activations: no site names")
    check_names(cfg, names)
    if not (callable(reduce) or reduce in ("last", "mean")):
        raise LiniclError(f"collect_activations: reduce must be 'last', 'mean' or a function, got {reduce!r}")
    mesh = device_mesh() if mesh is None else mesh
    rows = _as_rows(prompts)
    _check_lengths(rows, cfg, variables)
    _check_extras(extras, len(rows))
    edit_names, edit_values, edits_fn = _split_edits(edits, cfg)
    fn = _collect_fn(model, names, reduce, edit_names, edits_fn, extras is not None)
    replicated = (replicate(variables, mesh), replicate(edit_values, mesh))
    parts: dict = {n: [None] * len(rows) for n in names}
    for idx, tokens, lengths, ex in _batches(rows, cfg, batch_size, bucket, mesh, progress, "activations",
                                             extras):
        out = run_sharded(lambda rep, t, le, e: fn(rep[0], rep[1], t, le, e), replicated,
                          [tokens, lengths, ex], mesh)
        for n in names:
            for j, i in enumerate(idx):
                parts[n][i] = out[n][j]
    longest = max(len(r) for r in rows)
    result = {}
    for n in names:
        arrays = parts[n]
        if _position_axis(n) == 2 and not callable(reduce):
            arrays = [_fit_last_axis(a, longest) for a in arrays]
        result[n] = np.stack(arrays)
    return result


def _fit_last_axis(a: np.ndarray, size: int) -> np.ndarray:
    if a.shape[-1] >= size:
        return a[..., :size]
    return np.concatenate([a, np.zeros(a.shape[:-1] + (size - a.shape[-1],), a.dtype)], axis=-1)


__all__ = ["AXIS", "device_mesh", "n_shards", "round_up", "pad_rows", "replicate", "shard_batch",
           "run_sharded", "collect_activations"]
