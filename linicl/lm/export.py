"""A zoo model of the Llama or Gemma 3 family written out as an HF ``transformers`` checkpoint: the
inverse of ``from_pretrained`` on such a directory.

    linicl.lm.save_pretrained("smollm2-hf", model, variables)   # config.json + model.safetensors
    # transformers.AutoModelForCausalLM.from_pretrained("smollm2-hf") runs the same weights

The tensor names, layouts and transforms are not written a second time: they are those of the loader's
own key map (``linicl.lm.checkpoints``), each transform inverted as the index permutation it is. Every
transform of an HF Llama or Gemma 3 map is a transpose or a reshape, so applying it to the array of
file positions ``arange(size).reshape(file_shape)`` says, for every parameter entry, which file entry
it came from; writing each parameter back to those positions undoes it exactly (bit for bit), and a
transform that is not a permutation is refused. ``config.json`` holds the fields ``config_from_hf``
reads, so that loading the directory again gives the same ``ModelConfig`` (tested), with
``architectures`` and ``model_type`` as transformers names them (``LlamaForCausalLM``, ``llama``;
``Gemma3ForCausalLM``, ``gemma3_text``). Weights are written in float32 (``torch_dtype`` float32).
Not written: a tokenizer (copy the source's tokenizer files beside it if you need one).
GPT-2 (fused ``c_attn``) and the linear-attention zoo have no HF counterpart here and are refused.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.lm.checkpoints import _HF_GEMMA3, _HF_LLAMA, _llama_map, _sizes, _spec_shape

LAYER_TYPES = {"local": "sliding_attention", "global": "full_attention"}  # zoo -> HF layer_types


def family(cfg: ModelConfig) -> str:
    """``"llama"`` or ``"gemma3_text"``: the HF architecture a zoo config is an instance of, or a
    LiniclError saying why it is neither (no HF counterpart to write)."""
    common = (cfg.attention == "softmax" and cfg.positions == "rope" and cfg.rope_style == "half"
              and cfg.mlp == "gated" and not cfg.use_bias and cfg.causal)
    if common and cfg.norm == "pre" and cfg.norm_type == "rmsnorm" and cfg.activation == "silu" \
            and not cfg.qk_norm and not cfg.scale_embeddings and cfg.layer_types is None \
            and cfg.head_dim * cfg.n_heads == cfg.d_model and cfg.query_pre_attn_scalar is None:
        return "llama"
    if common and cfg.norm == "sandwich" and cfg.norm_type == "gemma_rmsnorm" and cfg.activation == "gelu_tanh" \
            and cfg.qk_norm and cfg.scale_embeddings and not cfg.has_mlp_bias:
        return "gemma3_text"
    raise LiniclError(f"save_pretrained writes Llama- and Gemma 3-family models (softmax, rope 'half', gated MLP, "
                      f"RMSNorm); this one has no HF counterpart here: {cfg.describe()}")


def hf_config(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict of a Llama or Gemma 3 zoo config (the fields ``config_from_hf`` reads)."""
    kind = family(cfg)
    common = dict(model_type=kind, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  num_hidden_layers=cfg.n_layers, vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_len,
                  rms_norm_eps=cfg.ln_eps, tie_word_embeddings=cfg.tie_embeddings,
                  attention_bias=cfg.has_attn_bias, torch_dtype="float32")
    if kind == "llama":
        return dict(common, architectures=["LlamaForCausalLM"], hidden_act="silu", mlp_bias=cfg.has_mlp_bias,
                    head_dim=cfg.head_dim, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base})
    types = cfg.layer_types or ("global",) * cfg.n_layers
    local = cfg.rope_local_base if cfg.rope_local_base is not None else cfg.rope_base
    scalar = float(cfg.query_pre_attn_scalar or cfg.head_dim)
    scalar = int(scalar) if scalar.is_integer() else scalar  # transformers' Gemma3TextConfig types it int
    return dict(common, architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
                head_dim=cfg.head_dim, query_pre_attn_scalar=scalar,
                layer_types=[LAYER_TYPES[t] for t in types], sliding_window=max(1, cfg.sliding_window),
                final_logit_softcapping=None, attn_logit_softcapping=None,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_base},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}})


def _inverse(transform, file_shape, param: np.ndarray, name: str) -> np.ndarray:
    """The file tensor ``f[file_shape]`` whose ``transform`` is ``param``: ``transform`` applied to the
    file positions tells where each parameter entry came from."""
    where = np.asarray(transform(np.arange(math.prod(file_shape)).reshape(file_shape)))
    if where.shape != param.shape or np.unique(where).size != where.size or where.size != math.prod(file_shape):
        raise LiniclError(f"save_pretrained: the loader's transform of {name!r} is not a permutation of its "
                          f"entries; it cannot be inverted")
    out = np.empty(math.prod(file_shape), np.float32)
    out[where.ravel()] = np.asarray(param, np.float32).ravel()
    return out.reshape(file_shape)


def _leaf(params, path, name: str) -> np.ndarray:
    node = params
    for p in path:
        if not hasattr(node, "__getitem__") or p not in node:
            raise LiniclError(f"save_pretrained: variables['params'] has no {'/'.join(path)} (for {name!r}); "
                              f"are these the variables of this model?")
        node = node[p]
    return np.asarray(node)


def save_pretrained(directory, model, variables) -> Path:
    """Write ``model`` (a ``linicl.Transformer`` of the Llama or Gemma 3 family, e.g. from
    ``linicl.lm.smollm2()`` or ``gemma3()``) with ``variables`` into ``directory`` (created) as
    ``config.json`` + ``model.safetensors`` (float32) that HF ``transformers`` and
    ``linicl.lm.from_pretrained`` read. Returns the directory. Other families raise a LiniclError."""
    from safetensors.numpy import save_file

    from linicl.nn.transformer import config_of
    cfg = config_of(model)
    config = hf_config(cfg)
    params = variables.get("params") if isinstance(variables, dict) else None
    if params is None:
        raise LiniclError("save_pretrained: variables must be a dict with 'params' (the model's variables)")
    mapping = _llama_map(cfg, _HF_GEMMA3 if config["model_type"] == "gemma3_text" else _HF_LLAMA)
    sizes = _sizes(cfg)
    tensors = {name: _inverse(transform, _spec_shape(spec, sizes), _leaf(params, path, name), name)
               for name, (path, transform, spec) in mapping.items()}
    directory = Path(os.fspath(directory)).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


__all__ = ["family", "hf_config", "save_pretrained"]
