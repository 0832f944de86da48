"""linicl.lm.save_pretrained: the inverse of from_pretrained for the Llama and Gemma 3 families. Exporting
a model loaded from the HF directories that transformers wrote gives back transformers' own tensors (names,
shapes and values, bit for bit) and a config that loads to the same model; the GGUF fixtures hold the same
weights, so exporting a model loaded from GGUF gives them too. Other families are refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import linicl
from linicl.errors import LiniclError
from helpers import FIXTURES, rel_err

CONFIG_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types", "sliding_window",
               "query_pre_attn_scalar", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "vocab_size")


def _logits(model, variables, name):
    ids = jnp.asarray(np.load(FIXTURES / name / "reference.npz")["inputs"])
    return np.asarray(jax.jit(model.apply)(variables, ids))


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_an_exported_model_is_the_checkpoint_transformers_wrote(name, tmp_path):
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / name, dtype="float64")
    out = linicl.lm.save_pretrained(tmp_path / name, model, variables)
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(FIXTURES / name / "model.safetensors"))
    if model.cfg.tie_embeddings:
        theirs.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == np.float32 and np.array_equal(ours[key], theirs[key]), key
    config = json.loads((out / "config.json").read_text())
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    for key in CONFIG_KEYS:
        if key in hf:
            assert config[key] == hf[key] or (key == "head_dim" and "head_dim" not in hf), key
    again, v2, _ = linicl.lm.from_pretrained(out, dtype="float64")
    assert again.cfg == model.cfg
    a = _logits(model, variables, name)
    assert np.array_equal(_logits(again, v2, name), a)
    assert rel_err(a, np.load(FIXTURES / name / "reference.npz")["logits_f32"]) < 1e-5
    # Power: the same file with one tensor's rows reversed is another model.
    q = "model.layers.0.self_attn.q_proj.weight"
    save_file(dict(ours, **{q: np.ascontiguousarray(ours[q][::-1])}), str(out / "model.safetensors"))
    wrong, v3, _ = linicl.lm.from_pretrained(out, dtype="float64")
    assert rel_err(_logits(wrong, v3, name), a) > 1e-3


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_a_model_loaded_from_gguf_exports_to_the_same_tensors(name, tmp_path):
    """llama.cpp's layout (permuted q/k rows, GGUF names, Gemma's stored 1 + w) is undone on the way in,
    so the export is transformers' checkpoint again (Gemma's norms to one float32 rounding of 1 + w)."""
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / f"{name}.gguf")
    ours = load_file(str(linicl.lm.save_pretrained(tmp_path / name, model, variables) / "model.safetensors"))
    theirs = load_file(str(FIXTURES / name / "model.safetensors"))
    theirs.pop("lm_head.weight", None) if model.cfg.tie_embeddings else None
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        ulp = 2.0 ** -23 if name.startswith("gemma3") and key.endswith("norm.weight") else 0.0
        assert np.max(np.abs(ours[key] - theirs[key])) <= ulp, key


def test_families_without_an_hf_counterpart_are_refused(tmp_path):
    for cfg in (linicl.preset("tiny-gpt2"), linicl.preset("tiny-linear")):
        model = linicl.Transformer(cfg)
        variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
        with pytest.raises(LiniclError, match="no HF counterpart"):
            linicl.lm.save_pretrained(tmp_path / "x", model, variables)
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / "llama-tiny.gguf")
    with pytest.raises(LiniclError, match="variables"):
        linicl.lm.save_pretrained(tmp_path / "y", model, {"params": {}})
