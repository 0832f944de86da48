"""The checkpoint loaders refuse bad files with a DataError naming the file and the tensor or field.

Each test copies a committed fixture (tests/fixtures/hf) to tmp_path, corrupts one thing, and checks
that ``from_pretrained`` fails loudly instead of loading a wrong model (dropped columns, NaN weights,
a NaN-producing rope base) or failing with a bare ``ValueError``/``KeyError``/``AttributeError``.
"""

from __future__ import annotations

import json
import re
import shutil
import struct

import jax
import numpy as np
import pytest

from linicl.errors import DataError, LiniclError
from linicl.lm import config_from_gguf, config_from_hf, from_pretrained, load, read_gguf
from helpers import FIXTURES

GGUF = FIXTURES / "llama-tiny.gguf"


def _copy(tmp_path, name):
    dst = tmp_path / name
    if name.endswith(".gguf"):
        shutil.copy(FIXTURES / name, dst)
    else:
        shutil.copytree(FIXTURES / name, dst)
    return dst


def _rewrite(d, edit):
    """Apply ``edit`` to the dict of tensors of ``d/model.safetensors`` and save it back."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def _set_config(d, **changes):
    path = d / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _raises(where, *parts):
    """pytest.raises(DataError) whose message names ``where`` and then each of ``parts`` (in order)."""
    return pytest.raises(DataError, match=".*".join(re.escape(str(p)) for p in (where, *parts)))


# ------------------------------------------------------------------------------ tensor shapes
@pytest.mark.parametrize("suffix, wide", [("weight", (64, 195)), ("bias", (195,)), ("weight", (64, 190)),
                                          ("weight", (192, 64))])
def test_gpt2_c_attn_of_the_wrong_shape(tmp_path, suffix, wide):
    """Wider c_attn used to load with its extra columns dropped; narrower ones gave 'cannot reshape'."""
    d = _copy(tmp_path, "gpt2-tiny")
    name = f"transformer.h.1.attn.c_attn.{suffix}"
    _rewrite(d, lambda t: t.update({name: np.ones(wide, np.float32)}))
    expected = (64, 192) if suffix == "weight" else (192,)
    with _raises(d / "model.safetensors", name, wide, expected):
        from_pretrained(d)


@pytest.mark.parametrize("name, shape", [("model.layers.0.self_attn.q_proj.weight", (60, 64)),
                                         ("model.layers.1.self_attn.k_proj.weight", (48, 64)),
                                         ("model.layers.0.self_attn.o_proj.weight", (64, 48)),
                                         ("model.layers.1.mlp.down_proj.weight", (96, 64)),
                                         ("model.embed_tokens.weight", (98, 64))])
def test_llama_tensors_of_the_wrong_shape(tmp_path, name, shape):
    d = _copy(tmp_path, "llama-tiny")
    _rewrite(d, lambda t: t.update({name: np.ones(shape, np.float32)}))
    with _raises(d / "model.safetensors", name, shape):
        from_pretrained(d)


def test_num_key_value_heads_mismatch_names_k_proj(tmp_path):
    d = _copy(tmp_path, "llama-tiny")
    _set_config(d, num_key_value_heads=4)  # the file has 2 kv heads: k_proj is [2 * 16, 64]
    with _raises(d / "model.safetensors", "model.layers.0.self_attn.k_proj.weight", (32, 64), (64, 64),
                 "kv_heads=4"):
        from_pretrained(d)


def test_gguf_head_count_kv_mismatch_names_attn_k(tmp_path):
    p = _copy(tmp_path, "llama-tiny.gguf")
    _patch_gguf_value(p, "llama.attention.head_count_kv", "<I", 4)
    with _raises(p, "blk.0.attn_k.weight", (32, 64), (64, 64)):
        from_pretrained(p)


# ------------------------------------------------------------------------------ tensor values
def _patch_gguf_value(path, key, fmt, value):
    """Overwrite the scalar metadata value of ``key`` in place (same type, so the layout is kept)."""
    data = bytearray(path.read_bytes())
    at = data.find(key.encode()) + len(key) + 4  # key bytes, then the u32 value type, then the value
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))


def test_gguf_bytes_that_decode_to_nan_are_refused(tmp_path):
    p = _copy(tmp_path, "llama-tiny.gguf")
    info = read_gguf(p).tensor_info["blk.1.ffn_up.weight"]
    data = bytearray(p.read_bytes())
    data[info.offset + 40:info.offset + 48] = b"\xff" * 8  # two F32 NaNs
    p.write_bytes(bytes(data))
    with _raises(p, "blk.1.ffn_up.weight", "2 non-finite"):
        from_pretrained(p)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_safetensors_nan_or_inf_is_refused(tmp_path, bad):
    d = _copy(tmp_path, "gpt2-tiny")
    name = "transformer.h.0.mlp.c_fc.bias"

    def edit(t):
        t[name][7] = bad
    _rewrite(d, edit)
    with _raises(d / "model.safetensors", name, "1 non-finite"):
        from_pretrained(d)


def test_float64_values_that_overflow_float32_are_refused(tmp_path):
    d = _copy(tmp_path, "gpt2-tiny")
    name = "transformer.ln_f.bias"
    _rewrite(d, lambda t: t.update({name: np.full(64, 1e300)}))
    with _raises(d / "model.safetensors", name, "float32"):
        from_pretrained(d, dtype="float32")
    assert from_pretrained(d, dtype="float64")[1]["params"]["ln_f"]["bias"][0] == 1e300


def test_integer_tensors_are_refused(tmp_path):
    d = _copy(tmp_path, "gpt2-tiny")
    name = "transformer.ln_f.weight"
    _rewrite(d, lambda t: t.update({name: np.ones(64, np.int32)}))
    with _raises(d / "model.safetensors", name, "int32"):
        from_pretrained(d)


# ------------------------------------------------------------------------------ config.json
def test_config_json_that_is_not_an_object(tmp_path):
    d = _copy(tmp_path, "gpt2-tiny")
    (d / "config.json").write_text("[1, 2, 3]")
    with _raises(d / "config.json", "list"):
        from_pretrained(d)


@pytest.mark.parametrize("name, field", [("gpt2-tiny", "n_embd"), ("gpt2-tiny", "n_head"),
                                         ("gpt2-tiny", "vocab_size"), ("llama-tiny", "hidden_size"),
                                         ("llama-tiny", "intermediate_size")])
def test_config_json_missing_field(tmp_path, name, field):
    d = _copy(tmp_path, name)
    cfg = json.loads((d / "config.json").read_text())
    del cfg[field]
    (d / "config.json").write_text(json.dumps(cfg))
    with _raises(d / "config.json", field):
        from_pretrained(d)


@pytest.mark.parametrize("name, field, value", [
    ("llama-tiny", "rope_parameters", {"rope_theta": -1.0, "rope_type": "default"}),
    ("llama-tiny", "rope_parameters", {"rope_theta": float("nan"), "rope_type": "default"}),
    ("llama-tiny", "rope_parameters", [1, 2]),
    ("llama-tiny", "rms_norm_eps", 0.0), ("llama-tiny", "rms_norm_eps", -1e-5),
    ("llama-tiny", "rms_norm_eps", "1e-5"), ("llama-tiny", "num_hidden_layers", 0),
    ("llama-tiny", "num_key_value_heads", 3), ("llama-tiny", "num_attention_heads", 2.0),
    ("llama-tiny", "attention_bias", "false"), ("llama-tiny", "tie_word_embeddings", 1),
    ("llama-tiny", "max_position_embeddings", -5), ("llama-tiny", "head_dim", 8),
    ("gpt2-tiny", "layer_norm_epsilon", -1e-5), ("gpt2-tiny", "n_head", 5), ("gpt2-tiny", "n_head", True),
    ("gpt2-tiny", "n_inner", 0), ("gpt2-tiny", "n_positions", "32"),
    ("gpt2-tiny", "activation_function", ["x"]),
])
def test_config_json_bad_values(tmp_path, name, field, value):
    d = _copy(tmp_path, name)
    _set_config(d, **{field: value})
    with _raises(d / "config.json", field):
        from_pretrained(d)


def test_rope_theta_at_the_top_level_is_checked(tmp_path):
    d = _copy(tmp_path, "llama-tiny")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_parameters"]
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": -1}))
    with _raises(d / "config.json", "rope_theta", "-1"):
        from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": 500.0}))
    assert from_pretrained(d)[0].cfg.rope_base == 500.0


def test_config_from_hf_names_its_source():
    with pytest.raises(DataError, match="my/config.json.*n_layer"):
        config_from_hf({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "vocab_size": 5,
                        "n_positions": 4}, source="my/config.json")
    with pytest.raises(DataError, match="config.json.*dict"):
        config_from_hf(["gpt2"])


# ------------------------------------------------------------------------------ GGUF metadata
@pytest.mark.parametrize("key, fmt, value", [("llama.rope.freq_base", "<f", -1.0),
                                             ("llama.rope.freq_base", "<f", float("nan")),
                                             ("llama.attention.layer_norm_rms_epsilon", "<f", 0.0),
                                             ("llama.block_count", "<I", 0)])
def test_gguf_bad_metadata_values(tmp_path, key, fmt, value):
    p = _copy(tmp_path, "llama-tiny.gguf")
    _patch_gguf_value(p, key, fmt, value)
    with _raises(p, key):
        from_pretrained(p)


def test_gguf_missing_metadata_and_tensors():
    f = read_gguf(GGUF)
    del f.metadata["llama.embedding_length"]
    with _raises(GGUF, "llama.embedding_length"):
        config_from_gguf(f)
    f = read_gguf(GGUF)
    del f.tensor_info["token_embd.weight"]
    with _raises(GGUF, "token_embd.weight"):
        config_from_gguf(f)


# ------------------------------------------------------------------------------ sharded checkpoints
def _shard(d):
    """Split ``d/model.safetensors`` into two shards with an index; returns the index path."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(d / file))
        weight_map.update({k: file for k in keys})
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_sharded_checkpoint_loads_and_its_index_is_checked(tmp_path):
    d = _copy(tmp_path, "gpt2-tiny")
    index = _shard(d)
    ref = from_pretrained(FIXTURES / "gpt2-tiny")[1]
    for a, b in zip(jax.tree.leaves(from_pretrained(d)[1]), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(a, b)
    good = json.loads(index.read_text())
    index.write_text(json.dumps({"metadata": {}}))
    with _raises(index, "weight_map"):
        from_pretrained(d)
    index.write_text(json.dumps([1]))
    with _raises(index, "weight_map"):
        from_pretrained(d)
    elsewhere = {**good["weight_map"], "transformer.wte.weight": "nope.safetensors"}
    index.write_text(json.dumps({"weight_map": elsewhere}))
    with _raises(index, "nope.safetensors"):
        from_pretrained(d)
    moved = dict(good["weight_map"])  # a tensor listed in the wrong shard
    moved["transformer.wte.weight"] = next(f for f in sorted(set(moved.values()))
                                           if f != moved["transformer.wte.weight"])
    index.write_text(json.dumps({"weight_map": moved}))
    with _raises(index, "transformer.wte.weight"):
        from_pretrained(d)


def test_a_misshaped_tensor_in_a_shard_names_the_shard(tmp_path):
    d = _copy(tmp_path, "gpt2-tiny")
    weight_map = json.loads(_shard(d).read_text())["weight_map"]
    name = "transformer.h.0.attn.c_proj.weight"
    from safetensors.numpy import load_file, save_file
    shard = d / weight_map[name]
    tensors = load_file(str(shard))
    tensors[name] = np.ones((64, 65), np.float32)
    save_file(tensors, str(shard))
    with _raises(shard, name, (64, 65), (64, 64)):
        from_pretrained(d)


# ------------------------------------------------------------------------------ dtype and max_len
def test_float64_without_x64_is_refused():
    assert jax.config.read("jax_enable_x64")  # the test session runs in float64
    with jax.enable_x64(False):
        for call in (lambda: from_pretrained(FIXTURES / "gpt2-tiny", dtype="float64"),
                     lambda: load(GGUF, dtype="float64")):
            with pytest.raises(LiniclError, match="jax_enable_x64"):
                call()
        params = from_pretrained(FIXTURES / "gpt2-tiny", dtype="float32")[1]["params"]
        assert params["embed"].dtype == np.float32


def test_unknown_dtype_is_refused():
    with pytest.raises(LiniclError, match="dtype.*float16"):
        from_pretrained(FIXTURES / "llama-tiny", dtype="float16")


def test_learned_positions_keep_their_length():
    """A shorter max_len used to give a model whose pos_embed no longer fits (flax shape error)."""
    with pytest.raises(LiniclError, match="learned positions.*32"):
        from_pretrained(FIXTURES / "gpt2-tiny", max_len=16)
    assert from_pretrained(FIXTURES / "gpt2-tiny", max_len=32)[0].cfg.max_len == 32


def test_gguf_file_errors_are_data_errors(tmp_path):
    p = _copy(tmp_path, "llama-tiny.gguf")
    p.write_bytes(p.read_bytes()[:5000])  # the header's tensor layout now runs past the end
    with _raises(p, "corrupt"):
        from_pretrained(p)
    with pytest.raises(DataError, match="not found.*nowhere.gguf"):
        read_gguf(tmp_path / "nowhere.gguf")
