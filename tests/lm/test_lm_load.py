"""linicl.lm.load and linicl.lm.adds_bos on the committed tiny checkpoints (tests/fixtures/hf)."""

import json
import shutil

import jax
import numpy as np
import pytest

import linicl.lm
from linicl.errors import DataError, LiniclError
from helpers import FIXTURES

HF = FIXTURES
GPT2, LLAMA, GGUF = HF / "gpt2-tiny", HF / "llama-tiny", HF / "llama-tiny.gguf"


def _same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_load_returns_the_source_and_from_pretrained_s_model():
    for source in (GPT2, LLAMA, GGUF):
        loaded = linicl.lm.load(source)
        source_, model, variables, tokenizer = loaded  # unpacks as a tuple
        ref_model, ref_variables, ref_tokenizer = linicl.lm.from_pretrained(source)
        assert source_ == loaded.source == source and model.cfg == ref_model.cfg
        _same_params(variables, ref_variables)
        assert (tokenizer is None) == (ref_tokenizer is None) == (source == LLAMA)  # the HF llama has no tokenizer


def test_max_len_sets_the_context_of_rope_models_only():
    assert linicl.lm.load(LLAMA, max_len=100).model.cfg.max_len == 100
    assert linicl.lm.load(GGUF, max_len=4096).model.cfg.max_len == 4096  # rope: only a cache size
    gpt2 = linicl.lm.load(GPT2, max_len=2048).model.cfg  # learned positions cannot be extended
    assert gpt2.positions == "learned" and gpt2.max_len == 32 == linicl.lm.load(GPT2).model.cfg.max_len
    assert linicl.lm.load(LLAMA).model.cfg.max_len == linicl.lm.from_pretrained(LLAMA)[0].cfg.max_len


def test_default_source_is_smollm2(monkeypatch):
    monkeypatch.setenv("LINICL_SMOLLM2_GGUF", str(GGUF))  # the tiny Llama stands in for SmolLM2
    loaded = linicl.lm.load(None, max_len=64)
    assert loaded.source == GGUF and loaded.model.cfg.max_len == 64 and loaded.tokenizer is not None
    _same_params(loaded.variables, linicl.lm.smollm2(max_len=64)[1])
    assert linicl.lm.adds_bos(None) is False


def test_packaged_checkpoints_by_name(monkeypatch, tmp_path):
    """"smollm2" and "gemma3" name their packages' files (here stood in for by the tiny fixtures); a
    directory of that name is reached as a path."""
    monkeypatch.setenv("LINICL_SMOLLM2_GGUF", str(GGUF))
    monkeypatch.setenv("LINICL_GEMMA3_GGUF", str(FIXTURES / "gemma3-tiny.gguf"))
    assert linicl.lm.load("smollm2").source == GGUF
    gemma = linicl.lm.load("gemma3", max_len=64)
    assert gemma.source == FIXTURES / "gemma3-tiny.gguf" and gemma.model.cfg.layer_types == ("local", "local", "global")
    shutil.copytree(GPT2, tmp_path / "gemma3")
    monkeypatch.chdir(tmp_path)
    assert linicl.lm.load("./gemma3").model.cfg.positions == "learned"


def test_require_tokenizer_and_missing_checkpoints(tmp_path):
    with pytest.raises(DataError, match="no tokenizer"):
        linicl.lm.load(LLAMA, require_tokenizer=True)
    assert linicl.lm.load(GPT2, require_tokenizer=True).tokenizer is not None
    with pytest.raises(LiniclError, match="no checkpoint found"):
        linicl.lm.load(tmp_path / "missing")


def test_adds_bos_reads_what_the_checkpoint_says(tmp_path):
    # The fixtures do not say (no add_bos_token key): no BOS.
    assert [linicl.lm.adds_bos(s) for s in (GPT2, LLAMA, GGUF)] == [False, False, False]
    for value in (True, False):
        hf = tmp_path / f"hf-{value}"
        shutil.copytree(GPT2, hf)  # a tokenizer with a BOS id (GPT-2's <|endoftext|>)
        config = hf / "tokenizer_config.json"
        old = json.loads(config.read_text()) if config.is_file() else {}
        config.write_text(json.dumps({**old, "add_bos_token": value}))
        assert linicl.lm.adds_bos(hf) is value and linicl.lm.adds_bos(str(hf)) is value
        # A GGUF tokenizer follows tokenizer.ggml.add_bos_token (the tiny fixture's metadata plus the key).
        meta = {**linicl.lm.read_gguf(GGUF).metadata, "tokenizer.ggml.add_bos_token": value}
        assert linicl.lm.Tokenizer.from_gguf(meta).adds_bos is value
