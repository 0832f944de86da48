"""Batches of variable-length prompts: rows, length buckets, padding, sharded runs, last positions.

Every batched method of linicl (evaluation, activation collection, routing, the experiments) runs
prompts of many lengths through one jitted function. To compile that function a handful of times,
not once per length, prompts are

1. turned into **rows** (``as_rows``: 1-D ``int32[n_i]`` token arrays, from ``Prompt`` objects, token
   arrays or ``PromptBatch``-es);
2. sorted by length (longest first, so a batch that does not fit fails early) and cut into batches of
   a fixed size ``B`` (rounded up to the device count);
3. right-padded to a **length bucket** (``bucket_length``: 16, 24, 32, 48, 64, 96, ... by default), the
   last batch padded with copies of a real row (``pad_rows``);
4. run with the batch axis sharded over the devices (``run_sharded``) and read back per row.

Right padding cannot leak into a causal model's real tokens; each row is read at its own last real
position ``lengths[b] - 1`` (``last_positions``), and only those rows are unembedded (``unembed``,
``last_token_logits``): the LM head is a large share of a small LM's compute.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from linicl import compiled
from linicl.config import ModelConfig
from linicl.data.prompts import PromptBatch
from linicl.errors import LiniclError, SequenceTooLongError
from linicl.nn.transformer import unembed  # re-exported: batching.unembed
from linicl.parallel import data_size, device_mesh, place, shard_batch


# ------------------------------------------------------------------------------ rows and buckets
def as_rows(prompts) -> list:
    """Token arrays ``int32[n_i]`` from Prompts, token arrays, a PromptBatch or an iterable of them.

    A ``PromptBatch`` (``.tokens [b, T]``, ``.lengths [b]``) gives its rows without their padding."""
    if isinstance(prompts, PromptBatch):
        prompts = [prompts]
    rows = []
    for item in prompts:
        if isinstance(item, PromptBatch):
            rows += [np.asarray(item.tokens[b, :item.lengths[b]], np.int32) for b in range(len(item.lengths))]
        else:
            rows.append(np.asarray(getattr(item, "tokens", item), np.int32))
    if not rows:
        raise LiniclError("no prompts to run")
    if any(r.ndim != 1 or len(r) == 0 for r in rows):
        raise LiniclError("every prompt must be a non-empty 1-D token array")
    return rows


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // int(multiple)) * int(multiple)


def bucket_length(n: int, bucket="geometric", max_len: Optional[int] = None) -> int:
    """The padded length of a batch whose longest prompt has ``n`` tokens.

    ``bucket="geometric"`` (the default): the smallest of 16, 24, 32, 48, 64, 96, ... (16 * 2^i and
    24 * 2^i) that holds ``n``: at most 50 % padding and only two shapes per doubling of the length, so
    an evaluation over prompts of 10 to 1,000 tokens compiles about 12 times, not once per multiple.
    An int: ``n`` rounded up to a multiple of it. Never past ``max_len`` (learned positions end there)
    unless ``n`` itself is longer (the model then raises its own clear error)."""
    if isinstance(bucket, str):
        if bucket != "geometric":
            raise LiniclError(f"bucket must be 'geometric' or an int >= 1, got {bucket!r}")
        size = compiled.geometric_bucket(n)
    elif isinstance(bucket, bool) or not isinstance(bucket, (int, np.integer)) or bucket < 1:
        raise LiniclError(f"bucket must be 'geometric' or an int >= 1, got {bucket!r}")
    else:
        size = round_up(n, bucket)
    return max(n, size if max_len is None else min(size, max_len))


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


def pad_tokens(rows: Sequence[np.ndarray], length: int) -> np.ndarray:
    """``int32[len(rows), length]``: the rows right-padded with id 0 (which every vocabulary has)."""
    tokens = np.zeros((len(rows), length), np.int32)
    for j, r in enumerate(rows):
        tokens[j, :len(r)] = r
    return tokens


# ------------------------------------------------------------------------------ batches
class Batch(NamedTuple):
    """One padded batch: ``idx`` (int[b] real rows' indices into the row list; the last batch has
    fewer than B), ``tokens: int32[B, T]``, ``lengths: int32[B]``, ``extras`` (pytree, axis 0 = B)."""

    idx: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    extras: Any


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise LiniclError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return int(batch_size)


def batches(rows: list, batch_size: int, *, bucket="geometric", max_len: Optional[int] = None,
            multiple: int = 1, extras: Any = None, progress: bool = False, desc: str = "") -> Iterator[Batch]:
    """The rows as ``Batch``-es of a fixed size B (``batch_size`` rounded up to ``multiple``, e.g. the
    device count, or fewer when there are fewer rows), longest rows first, each padded to a bucket."""
    n = len(rows)
    B = round_up(min(check_batch_size(batch_size), n), multiple)
    lengths = np.asarray([len(r) for r in rows], np.int32)
    order = np.argsort(-lengths, kind="stable")  # longest first: a batch that does not fit fails early
    for i in tqdm(range(0, n, B), desc=desc, disable=not progress, leave=False):
        idx = order[i:i + B]
        T = bucket_length(int(lengths[idx].max()), bucket, max_len)
        ex = None if extras is None else jax.tree_util.tree_map(lambda x: pad_rows(np.asarray(x)[idx], B), extras)
        yield Batch(idx, pad_rows(pad_tokens([rows[j] for j in idx], T), B), pad_rows(lengths[idx], B), ex)


def check_extras(extras, n: int) -> None:
    """Every leaf of ``extras`` needs axis 0 of size n (one row per prompt)."""
    if extras is None:
        return
    for leaf in jax.tree_util.tree_leaves(extras):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != n:
            raise LiniclError(f"extras: every array needs axis 0 of size {n} (one row per prompt), got "
                              f"shape {np.shape(leaf)}")


def check_vocab(rows: list, vocab_size: int, what: str = "prompts") -> None:
    """Every token id of every row in [0, vocab_size), checked before tracing: under jit the model
    would embed an out-of-range id as a NaN row, and the NaN would surface far from its cause."""
    for i, r in enumerate(rows):
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= vocab_size:
            raise LiniclError(f"{what}[{i}] holds token ids in [{lo}, {hi}], outside the model's vocabulary "
                              f"[0, {vocab_size}) (a tokenizer for another model?)")


def check_room(rows: list, cfg: ModelConfig, offset: int = 0) -> None:
    """Refuse rows past a learned-positions model's last position before tracing: under jit the model
    would return NaN for them, which an argmax turns into a silently wrong prediction."""
    if cfg.positions != "learned":
        return
    room = cfg.max_len - offset
    longest = max(len(r) for r in rows)
    if longest > room:
        raise SequenceTooLongError(f"the longest prompt has {longest} tokens but this model's learned positions "
                                   f"hold {room} (max_len={cfg.max_len}); use fewer demonstrations or shorter "
                                   f"inputs")


# ------------------------------------------------------------------------------ sharded runs
def run_sharded(fn: Callable, replicated: Any, batched: Sequence[Any], mesh=None) -> Any:
    """``fn(replicated, *batched)`` with ``replicated`` (variables, edit values) placed by
    ``linicl.parallel.place`` (on every device, or sharded on a mesh with a ``"model"`` axis) and the
    rows of every array in ``batched`` (a sequence of pytrees whose leaves all have the same axis 0 of
    size n) split over the mesh's ``"data"`` axis. The batch is padded to a multiple of the data size,
    and every output (a pytree of arrays with axis 0 = batch) comes back as NumPy with the padding rows
    dropped. ``fn`` is typically ``jax.jit``-ed; on one device this is ``fn(replicated, *batched)``
    converted to NumPy."""
    mesh = device_mesh() if mesh is None else mesh
    sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(list(batched))}
    if len(sizes) != 1:
        raise LiniclError(f"run_sharded: the batched arrays have different batch sizes {sorted(sizes)}")
    n = sizes.pop()
    if mesh.size > 1:
        padded = round_up(n, data_size(mesh))
        batched = [shard_batch(jax.tree_util.tree_map(lambda x: pad_rows(x, padded), b), mesh) for b in batched]
        replicated = place(replicated, mesh)
    out = fn(replicated, *batched)
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[:n], out)


def map_rows(fn: Callable, replicated: Any, rows: list, *, cfg: ModelConfig, batch_size: int,
             bucket="geometric", extras: Any = None, mesh=None, progress: bool = False,
             desc: str = "") -> Iterator[tuple]:
    """Run ``fn(replicated, tokens, lengths, extras)`` over every batch of ``rows`` (sharded over the
    mesh); yields ``(row indices, outputs of the real rows)``: outputs are pytrees with axis 0 = row."""
    mesh = device_mesh() if mesh is None else mesh
    replicated = place(replicated, mesh)
    for b in batches(rows, batch_size, bucket=bucket, max_len=cfg.max_len, multiple=data_size(mesh),
                     extras=extras, progress=progress, desc=desc):
        out = run_sharded(fn, replicated, [b.tokens, b.lengths, b.extras], mesh)
        yield b.idx, jax.tree_util.tree_map(lambda x: x[:len(b.idx)], out)


def gather(parts, n: int) -> list:
    """The per-row outputs of ``map_rows`` back in row order: a list of n pytrees."""
    out: list = [None] * n
    for idx, res in parts:
        for j, i in enumerate(idx):
            out[i] = jax.tree_util.tree_map(lambda x: x[j], res)
    return out


# ------------------------------------------------------------------------------ last positions
def last_positions(x: jax.Array, lengths: jax.Array, axis: int = 1) -> jax.Array:
    """``x[b, lengths[b] - 1]`` along ``axis``: each row's last real position (the axis removed)."""
    moved = jnp.moveaxis(x, axis, 1)
    idx = (jnp.asarray(lengths) - 1).astype(jnp.int32).reshape((-1, 1) + (1,) * (moved.ndim - 2))
    return jnp.take_along_axis(moved, idx, axis=1)[:, 0]


def last_token_logits(model) -> Callable:
    """``forward(variables, tokens, lengths) -> logits[b, vocab]``: the final hidden state at each row's
    last real token, unembedded. Only b rows go through the unembedding (not b * T), which saves a
    large share of a small LM's compute (SmolLM2: 28M of its 135M parameters)."""
    cfg = model.cfg

    def forward(variables, tokens, lengths):
        h = model.apply(variables, tokens, hidden=True)
        return unembed(cfg, variables["params"], last_positions(h, lengths))
    return forward


__all__ = ["as_rows", "round_up", "bucket_length", "pad_rows", "pad_tokens", "Batch", "batches",
           "check_batch_size", "check_extras", "check_vocab", "check_room", "run_sharded", "map_rows", "gather",
           "last_positions", "unembed", "last_token_logits"]
