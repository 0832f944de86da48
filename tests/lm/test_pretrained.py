"""Pretrained checkpoints: parity with HF ``transformers`` (committed fixtures), strict loading, SmolLM2.

The fixtures in ``tests/fixtures/hf/`` were written by ``make_fixtures.py`` there (torch 2.13.0,
transformers 5.24.0): tiny random GPT-2 and Llama checkpoints, a GGUF copy of the Llama one (q/k rows
permuted as llama.cpp does), and the logits HF computes for a fixed batch, in float64 and float32.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl.errors import DataError, LiniclError
from linicl.lm import from_pretrained
from helpers import FIXTURES, rel_err, smollm2_only

FIXTURES = FIXTURES

# Tolerances, relative to the largest reference logit:
# * GPT-2 in float64: HF's float64 GPT-2 computes every step in float64, so the two implementations
#   differ only by summation order: 1e-12 (measured 2.5e-15).
# * Llama in float64: HF's Llama casts to float32 inside RMSNorm (``.to(torch.float32)``), the rotary
#   angles (``.float()``) and the attention softmax (``dtype=torch.float32``) even in a float64 model,
#   so its "float64" logits carry float32 rounding: 1e-5 (measured 6.7e-7). A wrong convention (rope
#   pairing, kv-head order, a transposed matrix) moves the logits by O(1) (rope pairing: 1.3).
# * float32 models against HF float32: two float32 implementations, each ~1e-6 off the exact value
#   through a couple of layers of width 64: 1e-5 (measured 1.1e-6 and 1.4e-6).
# * Gemma 3 in float64: as Llama, HF computes RMSNorm (``x.float()``), the rope angles and the softmax
#   in float32 inside its float64 model; its logits_f64 are 1.1e-6 from an exact float64 forward
#   (make_fixtures.py, measured by patching those three to float64): 1e-5. float32 as above.
TOL = {("gpt2-tiny", "float64"): 1e-12, ("llama-tiny", "float64"): 1e-5, ("gemma3-tiny", "float64"): 1e-5,
       ("gpt2-tiny", "float32"): 1e-5, ("llama-tiny", "float32"): 1e-5, ("gemma3-tiny", "float32"): 1e-5}
WRONG_MIN = 1e-2


def _reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def _logits(model, variables, tokens):
    return np.asarray(jax.jit(model.apply)(variables, jnp.asarray(tokens)), np.float64)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("source", ["gpt2-tiny", "llama-tiny", "llama-tiny.gguf", "gemma3-tiny"])
def test_logits_match_hf_transformers(source, dtype):
    name = source.removesuffix(".gguf")
    model, variables, _ = from_pretrained(FIXTURES / source, dtype=dtype)
    ref = _reference(name)
    logits = _logits(model, variables, ref["inputs"])
    assert logits.dtype == np.float64 and variables["params"]["embed"].dtype == jnp.dtype(dtype)
    target = ref["logits_f64"] if dtype == "float64" else ref["logits_f32"]
    assert rel_err(logits, target) <= TOL[name, dtype]


def test_gguf_and_hf_llama_load_identical_parameters():
    """GGUF q/k rows are un-permuted on load, so both files give the same parameters bit for bit."""
    _, hf, _ = from_pretrained(FIXTURES / "llama-tiny")
    _, gg, _ = from_pretrained(FIXTURES / "llama-tiny.gguf")
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), hf, gg)
    assert all(jax.tree_util.tree_leaves(same))


@pytest.mark.parametrize("change", [dict(rope_style="interleaved"), dict(n_kv_heads=4),
                                    dict(norm_type="layernorm")])
def test_parity_has_power_wrong_conventions_are_far_off(change):
    model, variables, _ = from_pretrained(FIXTURES / "llama-tiny", dtype="float64")
    ref = _reference("llama-tiny")
    wrong = linicl.Transformer(model.cfg.replace(**change))
    params = dict(variables["params"])
    if "n_kv_heads" in change:  # duplicate kv heads the wrong way: head h reads kv head h % 2
        for l in range(model.cfg.n_layers):
            layer = {**params[f"layers_{l}"], "attn": dict(params[f"layers_{l}"]["attn"])}
            for n in "kv":
                k = layer["attn"][n]["kernel"]
                layer["attn"][n] = {"kernel": jnp.concatenate([k, k], axis=1)}
            params[f"layers_{l}"] = layer
    if "norm_type" in change:  # LayerNorm (mean removed) with the same scales and a zero bias
        params = jax.tree_util.tree_map(lambda x: x, params)  # a copy we may edit
        nodes = [(params[k], ("ln1", "ln2")) for k in params if k.startswith("layers_")]
        for node, names in nodes + [(params, ("ln_f",))]:
            for ln in names:
                node[ln] = {"scale": node[ln]["scale"], "bias": jnp.zeros_like(node[ln]["scale"])}
    assert rel_err(_logits(wrong, {"params": params}, ref["inputs"]), ref["logits_f64"]) >= WRONG_MIN


@pytest.mark.parametrize("change", [dict(sliding_window=5), dict(layer_types=("local", "global", "global")),
                                    dict(rope_local_base=None), dict(query_pre_attn_scalar=None),
                                    dict(rope_style="interleaved"), dict(norm_type="rmsnorm")])
def test_gemma3_parity_has_power(change):
    """Gemma 3's conventions, each changed alone, move the logits far from HF's (the window, which
    layers are local, the local rope base, the attention scale, the rope pairing, 1 + w norms)."""
    model, variables, _ = from_pretrained(FIXTURES / "gemma3-tiny", dtype="float64")
    ref = _reference("gemma3-tiny")
    assert rel_err(_logits(model, variables, ref["inputs"]), ref["logits_f64"]) <= TOL["gemma3-tiny", "float64"]
    wrong = linicl.Transformer(model.cfg.replace(**change))
    params = dict(variables["params"])
    if "layer_types" in change:  # layer 1 global: it has no window gate
        params["layers_1"] = {**params["layers_1"], "attn": {
            k: v for k, v in params["layers_1"]["attn"].items() if k != "gate"}}
    assert rel_err(_logits(wrong, {"params": params}, ref["inputs"]), ref["logits_f64"]) >= WRONG_MIN


def test_gemma3_config():
    model, variables, tok = from_pretrained(FIXTURES / "gemma3-tiny")
    cfg = model.cfg
    assert (cfg.layer_types, cfg.sliding_window, cfg.rope_base, cfg.rope_local_base) == (
        ("local", "local", "global"), 4, 1e6, 1e4)
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.norm, cfg.norm_type, cfg.qk_norm, cfg.scale_embeddings) == (
        24, 20.0, "sandwich", "gemma_rmsnorm", True, True)
    assert tok is None and cfg.tie_embeddings
    np.testing.assert_array_equal(variables["params"]["layers_0"]["attn"]["gate"], 0.0)  # no file holds it


def test_loaded_configs():
    gpt2, _, tok = from_pretrained(FIXTURES / "gpt2-tiny")
    assert gpt2.cfg.positions == "learned" and gpt2.cfg.tie_embeddings and gpt2.cfg.max_len == 32
    assert tok is not None and tok.decode(tok.encode("hello")) == "hello"
    llama, _, tok = from_pretrained(FIXTURES / "llama-tiny")
    cfg = llama.cfg
    assert (cfg.kv_heads, cfg.mlp, cfg.norm_type, cfg.rope_style, cfg.tie_embeddings) == (2, "gated", "rmsnorm", "half", False)
    assert tok is None  # the directory has no tokenizer files
    gg, _, _ = from_pretrained(FIXTURES / "llama-tiny.gguf")
    assert gg.cfg == cfg  # including ln_eps: GGUF's float32 9.99999975e-06 is read back as 1e-05


def test_bfloat16_and_max_len():
    model, variables, _ = from_pretrained(FIXTURES / "llama-tiny", dtype="bfloat16", max_len=16)
    assert variables["params"]["embed"].dtype == jnp.bfloat16 and model.cfg.max_len == 16
    ref = _reference("llama-tiny")
    assert rel_err(_logits(model, variables, ref["inputs"]), ref["logits_f32"]) < 0.1
    with pytest.raises(LiniclError, match="learned positions"):
        from_pretrained(FIXTURES / "gpt2-tiny", max_len=64)


# ---------------------------------------------------------------------------------------- bad input
def _copy(tmp_path, name="gpt2-tiny"):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_missing_checkpoint_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match="never downloads"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="config.json"):
        from_pretrained(tmp_path / "empty")
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(DataError, match="no model.safetensors"):
        from_pretrained(d)


def test_corrupt_files_are_reported(tmp_path):
    d = _copy(tmp_path)
    (d / "model.safetensors").write_bytes(os.urandom(256))
    with pytest.raises(DataError, match="safetensors"):
        from_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(DataError, match="config.json"):
        from_pretrained(d)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(512))
    with pytest.raises(LiniclError, match="bad.gguf"):
        from_pretrained(bad)


def _rewrite(d, edit):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def test_strict_mapping_unknown_missing_misshaped(tmp_path):
    d = _copy(tmp_path)
    _rewrite(d, lambda t: t.update({"transformer.h.0.attn.extra": np.zeros(3, np.float32)}))
    with pytest.raises(DataError, match="unknown.*attn.extra"):
        from_pretrained(d)
    d = _copy(tmp_path / "b")
    _rewrite(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(DataError, match="missing.*c_fc.bias"):
        from_pretrained(d)
    d = _copy(tmp_path / "c")
    _rewrite(d, lambda t: t.update({"transformer.ln_f.weight": np.ones(63, np.float32)}))
    with pytest.raises(DataError, match="ln_f.weight.*shape"):
        from_pretrained(d)


def test_unsupported_architecture(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(LiniclError, match="model_type='bert'"):
        from_pretrained(d)


# ---------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    return linicl.lm.smollm2(max_len=64)


@smollm2_only
def test_smollm2_structure(smollm2):
    model, variables, tok = smollm2
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_ff) == (30, 576, 9, 3, 1536)
    assert cfg.tie_embeddings and cfg.rope_base == 100_000.0 and tok.vocab_size == 49152
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(variables))
    assert 134_000_000 < n_params < 135_000_000


@smollm2_only
@pytest.mark.parametrize("prompt, expected", [
    ("The capital of France is", " Paris"),
    ("hot -> cold\nbig -> small\nup ->", " down"),
    ("Review: a wonderful, moving film.\nSentiment: positive\nReview: dull and far too long.\n"
     "Sentiment: negative\nReview: a delight from start to finish.\nSentiment:", " positive"),
])
def test_smollm2_greedy_next_token(smollm2, prompt, expected):
    """Real behaviour of the real model (Q4_1 weights): facts, antonyms, few-shot sentiment."""
    model, variables, tok = smollm2
    ids = tok.encode(prompt)
    logits = jax.jit(model.apply)(variables, jnp.asarray([ids], jnp.int32))[0, -1]
    assert tok.decode([int(jnp.argmax(logits))]) == expected
