"""Tokenizers for pretrained models: a thin wrapper over the HF ``tokenizers`` library (Rust).

Sources:

* ``Tokenizer.from_dir(path)``: an HF model directory, from ``tokenizer.json`` if present, otherwise
  GPT-2 style ``vocab.json`` + ``merges.txt`` (byte-level BPE). ``load_tokenizer_dir(path)`` does the
  same but returns ``None`` when the directory holds no tokenizer files.
* ``Tokenizer.from_gguf(file)``: rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata: byte-level
  BPE (``tokenizer.ggml.model == "gpt2"``), e.g. SmolLM2's, or Gemma's SentencePiece BPE
  (``"llama"`` in a ``gemma``/``gemma2``/``gemma3`` file), e.g. Gemma 3's 262,144 pieces.

Gemma's SentencePiece as a ``tokenizers`` BPE. The file stores pieces, scores and types but no merges.
SentencePiece's BPE merges the adjacent pair whose merged piece comes first in its vocabulary; the file
lists pieces in that order (Gemma's scores of normal pieces are minus their position), so the merges
are every split ``(left, right)`` of every piece into two pieces, ranked by the merged piece's
position (then by the longer left part, as HF ``transformers`` ranks them; an order that never
decides anything, see ``_sentencepiece_merges``). Text is
normalised by writing each space as ``▁`` (no prefix is added); characters without a piece become
their UTF-8 bytes (``<0x..>``, byte fallback). The runs of spaces the file stores as spaces are spelt
with ``▁`` so that they join the merges; the other user-defined pieces (runs of newlines and tabs,
``[multimodal]``, HTML tags) are matched whole, and control pieces (``<bos>``, ``<start_of_turn>``) are
special tokens, as in HF.

``encode`` follows the checkpoint's BOS convention unless told (``add_bos=True``/``False``), as HF's
``tokenizer.encode`` does: Gemma 3 says BOS, SmolLM2 and GPT-2 say none; EOS only with ``add_eos=True``.
A segment or an answer to append to a prompt takes ``add_bos=False``. Special tokens written
literally in the text (``"<|im_start|>"``) are matched whole, as in HF. ``decode`` keeps special tokens
unless ``skip_special_tokens=True``, so ``decode(encode(s)) == s`` for byte-level BPE.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from linicl._validate import _integer_dtype
from linicl.errors import LiniclError

__all__ = ["GGUF_PRE_TOKENIZERS", "Tokenizer", "load_tokenizer_dir"]

# GGUF token types (llama.cpp's llama_token_type; 0 is its UNDEFINED).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_TOKEN_TYPES = {"UNDEFINED": 0, "NORMAL": _NORMAL, "UNKNOWN": _UNKNOWN, "CONTROL": _CONTROL,
                "USER_DEFINED": _USER_DEFINED, "UNUSED": _UNUSED, "BYTE": _BYTE}

# tokenizer.ggml.pre values this module can reproduce, and how:
#   "gpt2" (and a missing key): GPT-2's ByteLevel pre-tokenizer (its regex, no prefix space);
#   "smollm": each digit split off first (HF: Digits(individual_digits=True)), then the same ByteLevel.
# Other values (llama-bpe, qwen2, deepseek, ...) use different split regexes and are refused rather
# than tokenised approximately. llama.cpp's own "default" is not GPT-2's regex (it also groups runs of
# punctuation), so it is refused too; ``from_gguf(..., pre="gpt2")`` overrides when that is intended.
GGUF_PRE_TOKENIZERS = ("gpt2", "smollm")

_ENDOFTEXT = "<|endoftext|>"


def _tk():
    try:
        import tokenizers
    except ImportError:
        raise LiniclError("linicl.lm.Tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    return tokenizers


class Tokenizer:
    """Text <-> token ids for one model.

    ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` (including added tokens),
    ``bos_id`` / ``eos_id`` (``None`` when unknown), ``token_to_id`` / ``id_to_token`` (``None`` when
    absent). ``backend`` is the underlying ``tokenizers.Tokenizer``; ``source`` says where it came from.

    ``adds_bos`` is the checkpoint's own BOS convention (GGUF ``tokenizer.ggml.add_bos_token``, HF
    ``tokenizer_config.json`` ``add_bos_token``; False when it does not say): the one BOS policy of
    linicl. ``encode(text)`` and prompts built with ``add_bos=None`` (``linicl.data.build_prompt``,
    ``evaluate``, every experiment's ``--bos auto``) follow it.
    """

    def __init__(self, backend: Any, *, bos_id: int | None = None, eos_id: int | None = None,
                 source: str = "<in memory>", adds_bos: bool = False):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.source = source
        self.adds_bos = bool(adds_bos) and bos_id is not None

    # -- constructors -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From an HF model directory: ``tokenizer.json``, else ``vocab.json`` + ``merges.txt``. BOS/EOS
        come from ``tokenizer_config.json``, then ``special_tokens_map.json``, then ``config.json``
        (``bos_token_id``/``eos_token_id``), then ``<|endoftext|>`` when the vocabulary has it (GPT-2's
        convention). Raises ``LiniclError`` naming the path when nothing loadable is there."""
        tok = load_tokenizer_dir(path)
        if tok is None:
            raise LiniclError(f"{path}: no tokenizer files (expected tokenizer.json, or vocab.json and "
                              f"merges.txt)")
        return tok

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """From a single ``tokenizer.json`` (special tokens read from the files beside it, if any)."""
        path = Path(path)
        if not path.is_file():
            raise LiniclError(f"tokenizer file not found: {path}")
        tk = _tk()
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a plain Exception for malformed JSON
            raise LiniclError(f"{path}: cannot load tokenizer: {e}") from None
        bos, eos = _special_ids(path.parent, backend)
        return cls(backend, bos_id=bos, eos_id=eos, source=str(path), adds_bos=_hf_adds_bos(path.parent))

    @classmethod
    def from_vocab_merges(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> Tokenizer:
        """GPT-2 style byte-level BPE from ``vocab.json`` (token -> id) and ``merges.txt`` (one
        ``"a b"`` merge per line, optional ``#version`` header)."""
        vocab_path, merges_path = Path(vocab_path), Path(merges_path)
        vocab = _read_json(vocab_path)
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise LiniclError(f"{vocab_path}: expected a JSON object mapping tokens to integer ids")
        try:
            lines = merges_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise LiniclError(f"merges file not found: {merges_path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise LiniclError(f"cannot read {merges_path}: {e}") from None
        merges = []
        for k, line in enumerate(lines, 1):
            if not line.strip() or (k == 1 and line.startswith("#version")):
                continue
            merges.append(_split_merge(line, f"{merges_path}:{k}"))
        backend = _byte_level_bpe(vocab, merges, digits=False, where=str(vocab_path))
        folder = vocab_path.parent
        specials = [t for t in _configured_special_tokens(folder) if t in vocab]
        if _ENDOFTEXT in vocab:
            specials.append(_ENDOFTEXT)
        _mark_special(backend, sorted(set(specials), key=vocab.get))
        bos, eos = _special_ids(folder, backend)
        return cls(backend, bos_id=bos, eos_id=eos, source=f"{vocab_path} + {merges_path.name}",
                   adds_bos=_hf_adds_bos(folder))

    @classmethod
    def from_gguf(cls, source: Any, *, pre: str | None = None) -> Tokenizer:
        """From GGUF tokenizer metadata. ``source``: a path, a ``GGUFFile`` (``linicl.lm.read_gguf``), its
        ``metadata`` mapping, or a ``gguf.GGUFReader``. Byte-level BPE (``tokenizer.ggml.model == "gpt2"``)
        with the pre-tokenizers in ``GGUF_PRE_TOKENIZERS`` (``pre`` overrides ``tokenizer.ggml.pre``), or
        Gemma's SentencePiece (``"llama"`` in a Gemma file; see the module docstring). CONTROL tokens
        become special tokens (matched whole, never split); USER_DEFINED ones are matched whole."""
        if isinstance(source, (str, os.PathLike)):
            from linicl.lm.gguf import read_gguf
            source = read_gguf(source)
        where = str(getattr(source, "path", "<GGUF metadata>"))
        if hasattr(source, "fields") and not isinstance(source, Mapping):  # a gguf.GGUFReader
            meta = {k: f.contents() for k, f in source.fields.items()}
        else:
            meta = getattr(source, "metadata", source)
        if not isinstance(meta, Mapping):
            raise LiniclError(f"from_gguf expects a path, a GGUFFile or a metadata mapping, got "
                              f"{type(source).__name__}")
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise LiniclError(f"{where}: no tokenizer in this GGUF file (no tokenizer.ggml.model)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise LiniclError(f"{where}: tokenizer.ggml.tokens is missing or empty")
        odd = next((k for k, t in enumerate(tokens) if not isinstance(t, str)), None)
        if odd is not None:
            raise LiniclError(f"{where}: tokenizer.ggml.tokens must be a list of strings, but entry {odd} is "
                              f"{tokens[odd]!r} ({type(tokens[odd]).__name__})")
        types = _token_types(meta.get("tokenizer.ggml.token_type"), len(tokens), where)
        if len(set(tokens)) != len(tokens):
            raise LiniclError(f"{where}: tokenizer.ggml.tokens has {len(tokens) - len(set(tokens))} duplicate "
                              f"entries; ids would not round-trip")
        arch = meta.get("general.architecture")
        if model == "gpt2":
            backend, kind = _gguf_byte_level(meta, tokens, types, pre, where)
        elif model == "llama" and arch in _GEMMA_ARCHS:
            backend, kind = _gemma_sentencepiece(tokens, types, where), "Gemma SentencePiece"
        elif model == "llama":
            raise LiniclError(f"{where}: SentencePiece tokenizers ('llama') are rebuilt for Gemma files only "
                              f"({', '.join(_GEMMA_ARCHS)}), not for architecture {arch!r}: other models "
                              f"normalise and merge differently")
        else:
            raise LiniclError(f"{where}: unsupported GGUF tokenizer model {model!r}; supported: byte-level "
                              f"BPE ('gpt2') and Gemma's SentencePiece ('llama')")

        return cls(backend, bos_id=_special_id(meta, "bos", len(tokens), where),
                   eos_id=_special_id(meta, "eos", len(tokens), where), source=f"{where} (GGUF, {kind})",
                   adds_bos=meta.get("tokenizer.ggml.add_bos_token") is True)

    # -- use ----------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``: ``int[n]`` as a list.

        ``add_bos``: prepend BOS. None (the default) follows the checkpoint, like HF's
        ``tokenizer.encode``: BOS when it says so (``adds_bos``: GGUF ``tokenizer.ggml.add_bos_token``,
        HF ``add_bos_token``; Gemma 3), none otherwise (SmolLM2, GPT-2 and any tokenizer that does not
        say). Pass False for text that continues a prompt (a segment, an answer): a BOS in the middle of
        a sequence changes what the model reads. ``add_eos``: append EOS. Refused: a non-str text,
        one with a lone surrogate (no UTF-8 form), a flag that is not a bool (None too for
        ``add_eos``), and True for a token this tokenizer does not have."""
        if not isinstance(text, str):
            raise LiniclError(f"encode expects a str, got {type(text).__name__}")
        if not (add_bos is None or isinstance(add_bos, bool)):
            raise LiniclError(f"encode: add_bos must be True, False or None (the checkpoint's convention), "
                              f"got {add_bos!r}")
        if not isinstance(add_eos, bool):
            raise LiniclError(f"encode: add_eos must be True or False, got {add_eos!r}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # the Rust side would raise a bare TypeError
            raise LiniclError(f"encode: text holds a lone surrogate {text[e.start]!r} at index {e.start}, which "
                              f"has no UTF-8 form (text decoded with errors='surrogateescape'? decode it "
                              f"with errors='replace')") from None
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if self.adds_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise LiniclError(f"add_bos=True but this tokenizer ({self.source}) has no BOS token")
            ids.insert(0, self.bos_id)
        if add_eos:
            if self.eos_id is None:
                raise LiniclError(f"add_eos=True but this tokenizer ({self.source}) has no EOS token")
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Iterable[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: ``int[n]``, a list (or other iterable) of ints or a 1-D integer NumPy/JAX
        array. Special tokens are kept by default. Refused, naming what came: a string, None, an array
        of another rank (decode rows one at a time), floats and bools (``int`` would truncate 2.7 to 2
        and read True as 1), ids outside [0, vocab_size)."""
        return self.backend.decode(_token_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.id_to_token(self.eos_id)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id})")


def load_tokenizer_dir(path: str | os.PathLike) -> Tokenizer | None:
    """``Tokenizer.from_dir(path)``, or ``None`` when the directory holds neither ``tokenizer.json`` nor
    ``vocab.json``/``merges.txt``. Raises ``LiniclError`` when ``path`` is not a directory, when only one
    of ``vocab.json``/``merges.txt`` is there, or when the files are corrupt."""
    path = Path(path)
    if not path.is_dir():
        raise LiniclError(f"tokenizer directory not found: {path}" if not path.exists()
                          else f"not a directory: {path}")
    tj = path / "tokenizer.json"
    if tj.is_file():
        return Tokenizer.from_file(tj)
    vocab, merges = path / "vocab.json", path / "merges.txt"
    if vocab.is_file() and merges.is_file():
        return Tokenizer.from_vocab_merges(vocab, merges)
    if vocab.is_file() or merges.is_file():
        missing = merges if vocab.is_file() else vocab
        raise LiniclError(f"{path}: found {'vocab.json' if vocab.is_file() else 'merges.txt'} but not "
                          f"{missing.name}; a GPT-2 style BPE tokenizer needs both")
    return None


# ----------------------------------------------------------------------------------------------------
# helpers


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise LiniclError(f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LiniclError(f"cannot read {path}: {e}") from None


def _token_ids(ids: Any, n: int) -> list[int]:
    """``decode``'s ids as Python ints in [0, n) (see ``Tokenizer.decode`` for what is refused)."""
    if ids is None or isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise LiniclError(f"decode: ids must be a list or 1-d array of token ids (ints), got "
                          f"{type(ids).__name__} {ids!r:.60}")
    if getattr(ids, "ndim", 1) != 1:
        raise LiniclError(f"decode: ids must be 1-d (one sequence; decode rows one at a time), got shape "
                          f"{tuple(ids.shape)}")
    items = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    odd = next((k for k, i in enumerate(items) if not _integer_dtype(i)), None)
    if odd is not None:
        raise LiniclError(f"decode: ids must be ints (token ids), got {items[odd]!r} "
                          f"({type(items[odd]).__name__}) at index {odd}")
    bad = [i for i in items if not 0 <= i < n]
    if bad:
        raise LiniclError(f"decode: ids {bad[:5]} are outside the vocabulary [0, {n})")
    return [int(i) for i in items]


def _token_types(types: Any, n: int, where: str) -> list[int]:
    """``tokenizer.ggml.token_type``: one llama.cpp token type (0-6) per token; all NORMAL when absent.
    An unknown value is refused: read as NORMAL it would silently split a control token into pieces."""
    if types is None:
        return [_NORMAL] * n
    if not isinstance(types, list):
        raise LiniclError(f"{where}: tokenizer.ggml.token_type must be a list of ints, got "
                          f"{type(types).__name__}")
    if len(types) != n:
        raise LiniclError(f"{where}: {len(types)} token types for {n} tokens")
    known = set(_TOKEN_TYPES.values())
    if all(type(t) is int for t in types) and set(types) <= known:  # the usual case, 10x faster
        return types
    bad = next((k for k, t in enumerate(types) if not (_integer_dtype(t) and int(t) in known)), None)
    if bad is not None:
        raise LiniclError(f"{where}: tokenizer.ggml.token_type[{bad}] = {types[bad]!r} is not a token type "
                          f"(llama.cpp's: {', '.join(f'{v} {k}' for k, v in _TOKEN_TYPES.items())})")
    return types


def _special_id(meta: Mapping, kind: str, n: int, where: str) -> int | None:
    """``tokenizer.ggml.<kind>_token_id`` (None when absent). One outside the vocabulary is refused:
    ignoring it would drop BOS (or EOS) without a word."""
    key = f"tokenizer.ggml.{kind}_token_id"
    v = meta.get(key)
    if v is None:
        return None
    if not _integer_dtype(v) or not 0 <= v < n:
        raise LiniclError(f"{where}: {key} = {v!r} is not a token id of this vocabulary (an int in [0, {n}))")
    return int(v)


def _split_merge(line: Any, where: str) -> tuple[str, str]:
    # As llama.cpp: the separator is the first space after position 0 (byte-level tokens never hold a
    # literal space, which is mapped to 'Ġ'). HF tokenizer.json may also give merges as pairs.
    if isinstance(line, (list, tuple)) and len(line) == 2:
        return str(line[0]), str(line[1])
    if isinstance(line, str):
        k = line.find(" ", 1)
        if k > 0 and k < len(line) - 1:
            return line[:k], line[k + 1:]
    raise LiniclError(f"{where}: malformed merge {line!r} (expected 'left right')")


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], *, digits: bool, where: str):
    tk = _tk()
    from tokenizers import decoders, models, pre_tokenizers, processors
    missing = [f"{a} {b}" for a, b in merges if a not in vocab or b not in vocab or a + b not in vocab]
    if missing:
        raise LiniclError(f"{where}: {len(missing)} merges use tokens that are not in the vocabulary, "
                          f"e.g. {missing[0]!r}")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    except Exception as e:
        raise LiniclError(f"{where}: cannot build a BPE model: {e}") from None
    backend = tk.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      byte_level]) if digits else byte_level)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _gguf_byte_level(meta: Mapping, tokens: list[str], types: list[int], pre: str | None, where: str):
    pre_name = pre if pre is not None else meta.get("tokenizer.ggml.pre", "gpt2")
    if pre_name not in GGUF_PRE_TOKENIZERS:
        raise LiniclError(f"{where}: unsupported GGUF pre-tokenizer {pre_name!r} (supported: "
                          f"{', '.join(GGUF_PRE_TOKENIZERS)}); pass pre=... to override")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise LiniclError(f"{where}: tokenizer.ggml.merges is missing (needed for BPE)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [_split_merge(m, f"{where}: tokenizer.ggml.merges[{k}]") for k, m in enumerate(merges)]
    backend = _byte_level_bpe(vocab, pairs, digits=(pre_name == "smollm"), where=where)
    _mark_special(backend, [t for t, ty in zip(tokens, types) if ty == _CONTROL])
    _mark_added(backend, [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return backend, f"pre={pre_name}"


_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, in the order SentencePiece's BPE applies them: by
    the merged piece's position in the vocabulary, then (as HF ``transformers`` lists them) the longer
    left part first.

    That last order never matters, in any vocabulary: two pairs that can merge into the same piece at
    the same moment are always split the same way, so they share a rank and the leftmost goes first,
    which is SentencePiece's rule for equal scores. Proof: while two symbols x, y cover a span of a word
    exactly, no merge has crossed the span's ends (symbols only grow), so the merges inside it so far
    were those of BPE run on the span's text alone, in the same order (each was the best pair inside
    the span when made, and positions inside keep their order). That run is deterministic and goes
    through exactly one state of two symbols. So every span holding the text of a piece as two
    symbols holds the same two. (tests/lm/test_tokenizer.py checks it on a vocabulary of every string
    of up to 4 letters over 3 in a shuffled order; no such tie arose in 60,000 strings of Gemma 3's.)"""
    known = set(pieces)
    return [(p[:cut], p[cut:]) for p in pieces for cut in range(len(p) - 1, 0, -1)
            if p[:cut] in known and p[cut:] in known]


def _gemma_sentencepiece(tokens: list[str], types: list[int], where: str):
    tk = _tk()
    from tokenizers import decoders, models, normalizers
    # Runs of spaces are stored as spaces; the normaliser spells spaces as the visible space.
    pieces = [_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    if len(set(pieces)) != len(pieces):
        raise LiniclError(f"{where}: a run of spaces is stored both with spaces and with {_SPACE!r}")
    if "<unk>" not in pieces:
        raise LiniclError(f"{where}: a Gemma vocabulary has '<unk>'; this one does not")
    try:
        bpe = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=_sentencepiece_merges(pieces),
                         unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    except Exception as e:
        raise LiniclError(f"{where}: cannot build a BPE model: {e}") from None
    backend = tk.Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _mark_special(backend, [t for t, ty in zip(pieces, types) if ty == _CONTROL])
    # the space runs are pieces of the BPE now (respelt), not whole-matched text
    _mark_added(backend, [t for t, p, ty in zip(tokens, pieces, types) if ty == _USER_DEFINED and t == p])
    return backend


def _mark_special(backend, tokens: list[str]) -> None:
    if tokens:
        tk = _tk()
        backend.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in tokens])


def _mark_added(backend, tokens: list[str]) -> None:
    if tokens:
        tk = _tk()
        backend.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t in tokens])


def _token_content(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _configured_special_tokens(folder: Path) -> list[str]:
    """Every special-token string named in tokenizer_config.json / special_tokens_map.json."""
    out = []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        p = folder / name
        if not p.is_file():
            continue
        cfg = _read_json(p)
        if not isinstance(cfg, dict):
            continue
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            t = _token_content(cfg.get(key))
            if t is not None:
                out.append(t)
        for spec in (cfg.get("added_tokens_decoder") or {}).values():
            if isinstance(spec, dict) and spec.get("special") and _token_content(spec) is not None:
                out.append(_token_content(spec))
    return out


def _hf_adds_bos(folder: Path) -> bool:
    """``add_bos_token`` of ``tokenizer_config.json`` (False when absent or unreadable)."""
    config = folder / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("add_bos_token") is True if config.is_file() else False
    except (OSError, ValueError, AttributeError):
        return False


def _special_ids(folder: Path, backend) -> tuple[int | None, int | None]:
    """(bos_id, eos_id) from the configuration files next to the tokenizer (see ``from_dir``)."""
    found: dict[str, int | None] = {"bos": None, "eos": None}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        p = folder / name
        if not p.is_file():
            continue
        cfg = _read_json(p)
        if not isinstance(cfg, dict):
            continue
        for kind in found:
            t = _token_content(cfg.get(f"{kind}_token"))
            if found[kind] is None and t is not None:
                found[kind] = backend.token_to_id(t)
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        cfg = _read_json(cfg_path)
        if isinstance(cfg, dict):
            n = backend.get_vocab_size(with_added_tokens=True)
            for kind in found:
                v = cfg.get(f"{kind}_token_id")
                if isinstance(v, list) and v:  # some configs list several EOS ids; the first is canonical
                    v = v[0]
                if found[kind] is None and isinstance(v, int) and 0 <= v < n:
                    found[kind] = v
    eot = backend.token_to_id(_ENDOFTEXT)
    for kind in found:
        if found[kind] is None and eot is not None:
            found[kind] = eot
    return found["bos"], found["eos"]
