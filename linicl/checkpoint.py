"""The one checkpoint format of linicl's training loops: a safetensors file of a pytree plus JSON.

Every loop that trains something (the ICR router today) saves and resumes through this module, so
there is one writer and one reader of training state::

    checkpoint.save(path, {"params": params, "opt": opt_state}, settings={"total_steps": 600},
                    meta={"step": 50, "history": history})
    tree, meta = checkpoint.load(path, {"params": params0, "opt": opt0}, settings={"total_steps": 600})

The file (``safetensors``: a JSON header, then the raw bytes of each array):

* tensors: every array of ``flax.serialization.to_state_dict(tree)``, named by its path joined with
  ``/`` (``opt/1/0/mu/alpha_1/kernel``), with its exact dtype and shape (float32 stays float32, an
  int32 step counter stays int32);
* metadata (strings): ``format`` (``"linicl.checkpoint"``), ``version``, and the JSON of
  ``settings`` and ``meta``.

``settings`` is what must agree for a file to continue a run (total steps, sizes): ``load`` refuses a
file whose settings differ from the ones it is given. ``meta`` is what the run reports (the step
reached, a loss history); it is returned as stored. Both must be JSON-serialisable.

``load`` refuses a file holding NaN or infinity in any array: it was written by a run that had diverged,
and resuming from it would only continue with NaN parameters.

``checksum(tree)`` is a content hash of the arrays of a tree (names, dtypes, shapes and bytes): what a
training loop records in ``settings`` to tell its data and frozen weights from others of the same shape.

``load`` restores into a ``template`` of the same structure (``flax.serialization.from_state_dict``:
an optax state comes back as the same NamedTuples). The template's leaves may be arrays, Python
scalars or ``jax.ShapeDtypeStruct`` (``jax.eval_shape``: nothing is computed); every stored array
must have its template leaf's shape and dtype. Restored arrays are NumPy arrays (a ``jnp.asarray``
would narrow float64 when x64 is off), Python-scalar leaves come back as Python scalars.

Writing is atomic: a temporary file in the same directory, flushed to disk, then ``os.replace``; a
run killed while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import numpy as np
import safetensors
import safetensors.numpy
from flax import serialization

from linicl.errors import DataError, LiniclError

FORMAT = "linicl.checkpoint"
VERSION = 1
_SEP = "/"
_SCALARS = (bool, int, float, complex)


class Header(NamedTuple):
    """What a checkpoint says about itself, without its arrays."""

    settings: dict
    meta: dict


# ------------------------------------------------------------------------------------- the tree
def _flatten(state, path: Tuple[str, ...] = ()) -> dict:
    """``{path: leaf}`` of a state dict (nested dicts); empty dicts and None hold no array and are
    restored from the template instead."""
    if isinstance(state, Mapping):
        out = {}
        for key, value in state.items():
            out.update(_flatten(value, path + (str(key),)))
        return out
    return {} if state is None else {path: state}


def _name(path: Tuple[str, ...]) -> str:
    if any(_SEP in part for part in path):
        raise LiniclError(f"checkpoint tree keys must not contain {_SEP!r}; got the path {list(path)}")
    return _SEP.join(path)


def _arrays(tree) -> dict:
    """The named NumPy arrays of ``tree`` (what the file stores)."""
    arrays = {}
    for path, leaf in _flatten(serialization.to_state_dict(tree)).items():
        a = np.asarray(leaf, order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
        if a.dtype.kind in "OSU":  # objects, strings: not a numeric array
            raise LiniclError(f"checkpoint tree leaf {_name(path)!r} is not an array "
                              f"({type(leaf).__name__})")
        arrays[_name(path)] = a
    return arrays


def _spec(leaf) -> Tuple[tuple, np.dtype]:
    """Shape and dtype of a template leaf (an array, a ShapeDtypeStruct or a Python scalar)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    a = np.asarray(leaf)
    return a.shape, a.dtype


def _restore(path: Path, template, arrays: dict):
    """``template`` with every leaf replaced by the stored array of the same name."""
    state = serialization.to_state_dict(template)
    leaves = {_name(p): leaf for p, leaf in _flatten(state).items()}
    missing, extra = sorted(set(leaves) - set(arrays)), sorted(set(arrays) - set(leaves))
    if missing or extra:
        raise DataError(f"{path} does not hold the expected tree (another model or optimiser?): "
                        f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                        f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    for name, leaf in leaves.items():
        want, got = _spec(leaf), (arrays[name].shape, arrays[name].dtype)
        if want != got:
            raise DataError(f"{path} holds {name!r} as {got[1]}{list(got[0])}, expected "
                            f"{want[1]}{list(want[0])} (another model or settings?)")

    def fill(node, prefix):
        if isinstance(node, Mapping):
            return {k: fill(v, prefix + (str(k),)) for k, v in node.items()}
        if node is None:
            return None
        stored = arrays[_name(prefix)]
        return stored.item() if type(node) in _SCALARS else stored  # not np.float64 (a float)
    return serialization.from_state_dict(template, fill(state, ()))


def checksum(tree) -> str:
    """A content hash of ``tree`` (a pytree of arrays: params, token ids; or one array): the SHA-256 hex
    digest of every array's name in the tree, dtype, shape and bytes, in name order. Two trees hash
    alike only if they hold the same arrays bit for bit (float32 and float64 copies of the same
    values differ; so do the same bytes in another shape)."""
    digest = hashlib.sha256()
    for name, a in sorted(_arrays(tree).items()):
        # The header is self-delimiting JSON and the bytes that follow have the length its dtype and
        # shape give, so no two different trees feed the hash the same stream.
        digest.update(json.dumps([name, a.dtype.name, list(a.shape)]).encode())
        digest.update(a.reshape(-1).view(np.uint8))  # the raw bytes, without a copy (a is C-ordered)
    return digest.hexdigest()


def _non_finite(arrays: dict) -> list:
    """The names of the stored arrays holding NaN or infinity (integers and booleans cannot)."""
    return sorted(name for name, a in arrays.items()
                  if a.dtype.kind not in "biu" and not np.all(np.isfinite(a)))


# ------------------------------------------------------------------------------------- the file
def _json(value, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise LiniclError(f"checkpoint {what} must be JSON-serialisable: {e}") from None


def save(path, tree, *, settings: Mapping[str, Any], meta: Optional[Mapping[str, Any]] = None) -> Path:
    """Write ``tree`` (a pytree of arrays: params, optimiser state, ...) with its ``settings`` and
    ``meta`` to ``path`` atomically (parent directories are created). Returns the path."""
    path = Path(path)
    if not isinstance(settings, Mapping):
        raise LiniclError(f"settings must be a dict, got {type(settings).__name__}")
    metadata = {"format": FORMAT, "version": str(VERSION),
                "settings": _json(dict(settings), "settings"), "meta": _json(dict(meta or {}), "meta")}
    try:
        data = safetensors.numpy.save(_arrays(tree), metadata=metadata)
    except safetensors.SafetensorError as e:  # e.g. a dtype safetensors does not store
        raise LiniclError(f"cannot write the checkpoint {path}: {e}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory: os.replace is then a rename within one file system, which is atomic. Written
    # from Python rather than by safetensors.numpy.save_file, which makes owner-only files.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before it replaces the previous checkpoint
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _open(path: Path, with_arrays: bool) -> Tuple[dict, dict]:
    """``(metadata, arrays)`` of a linicl checkpoint (arrays empty unless asked for)."""
    if not path.is_file():
        raise DataError(f"no checkpoint at {path} (no such file)")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            arrays = {k: f.get_tensor(k) for k in f.keys()} if with_arrays else {}
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise DataError(f"{path} is not a linicl checkpoint (not a safetensors file: {e})") from None
    if metadata.get("format") != FORMAT:
        raise DataError(f"{path} is not a linicl checkpoint (a safetensors file without linicl's "
                        f"metadata; linicl.checkpoint.save writes them)")
    if not metadata.get("version", "").isdigit() or int(metadata["version"]) > VERSION:
        raise DataError(f"{path} has checkpoint format version {metadata.get('version')!r}; this linicl "
                        f"reads versions <= {VERSION} (a newer linicl wrote it)")
    return metadata, arrays


def _header(path: Path, metadata: dict) -> Header:
    try:
        return Header(json.loads(metadata["settings"]), json.loads(metadata["meta"]))
    except (KeyError, ValueError) as e:
        raise DataError(f"{path} has a damaged checkpoint header: {e!r}") from None


def header(path) -> Header:
    """The settings and meta stored in a checkpoint (its arrays are not read)."""
    path = Path(path)
    return _header(path, _open(path, with_arrays=False)[0])


def _same_setting(a, b) -> bool:
    """``a == b`` for JSON values, except that a NaN equals NaN (a setting saved as NaN is the same
    setting when given again; ``nan != nan`` would refuse every resume)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_setting(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    return a == b


def _differences(stored: dict, given: dict) -> list:
    absent = object()
    out = []
    for key in sorted(set(stored) | set(given)):
        a, b = stored.get(key, absent), given.get(key, absent)
        if a is absent or b is absent or not _same_setting(a, b):
            show = lambda v: "(absent)" if v is absent else repr(v)  # noqa: E731
            out.append(f"{key}: stored {show(a)}, given {show(b)}")
    return out


def load(path, template, *, settings: Mapping[str, Any]) -> Tuple[Any, dict]:
    """``(tree, meta)`` from a checkpoint written by ``save``, with ``tree`` in the structure of
    ``template``. Raises DataError naming the file when it is missing, not a linicl checkpoint, was
    written with other ``settings`` (naming the keys that differ), holds another tree, or holds NaN or
    infinity (naming the arrays)."""
    path = Path(path)
    metadata, arrays = _open(path, with_arrays=True)
    head = _header(path, metadata)
    given = json.loads(_json(dict(settings), "settings"))  # compare as stored: tuples become lists
    diff = _differences(head.settings, given)
    if diff:
        raise DataError(f"{path} was written with other settings ({'; '.join(diff)}); delete it to "
                        f"start afresh")
    tree = _restore(path, template, arrays)
    bad = _non_finite(arrays)
    if bad:
        raise DataError(f"{path} holds NaN or infinity in {len(bad)} array(s) ({', '.join(map(repr, bad[:5]))}"
                        f"{', ...' if len(bad) > 5 else ''}): a run that had diverged wrote it, and whatever "
                        f"resumed or loaded from it would be NaN; delete it and train again")
    return tree, head.meta


def exists(path) -> bool:
    """Whether a file is at ``path`` (a run resumes from it; ``load`` checks that it is a checkpoint)."""
    return Path(path).is_file()


__all__ = ["FORMAT", "VERSION", "Header", "save", "load", "header", "exists", "checksum"]
