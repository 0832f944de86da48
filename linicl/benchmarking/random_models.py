"""Random-weight models at the shapes the speed benchmarks measure: GPT-2 configurations, a GPT-2
HF checkpoint drawn without PyTorch, and a tiny softmax LM for quick compile-time runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# HF GPT2Config fields: GPT-2 small (124M) and a tiny one for quick runs.
GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
GPT2_TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
_GPT2_FIELDS = tuple(GPT2_SMALL)


def write_random_gpt2(directory, config: dict, seed: int = 0) -> dict:
    """An HF GPT-2 checkpoint (``model.safetensors`` + ``config.json``) in ``directory``, drawn with
    NumPy as GPT-2 initialises: N(0, 0.02) embeddings and weights (Conv1D layout ``[n_in, n_out]``),
    zero biases, unit norm scales, tied unembedding. ``config`` holds the ``GPT2_SMALL`` fields.
    ``linicl.lm.from_pretrained(directory)`` loads it; for when no PyTorch can make one.
    Returns ``{"n_params", "source"}``."""
    from safetensors.numpy import save_file
    missing = [k for k in _GPT2_FIELDS if not isinstance(config.get(k), int) or config[k] < 1]
    if missing:
        raise ValueError(f"write_random_gpt2: config needs positive ints {list(_GPT2_FIELDS)}, bad or missing "
                         f"{missing} in {config!r}")
    rng = np.random.default_rng(seed)
    D, V, P, L = config["n_embd"], config["vocab_size"], config["n_positions"], config["n_layer"]

    def normal(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    t = {"transformer.wte.weight": normal(V, D), "transformer.wpe.weight": normal(P, D),
         "transformer.ln_f.weight": np.ones(D, np.float32), "transformer.ln_f.bias": np.zeros(D, np.float32)}
    for layer in range(L):
        h = f"transformer.h.{layer}."
        for ln in ("ln_1", "ln_2"):
            t[h + ln + ".weight"], t[h + ln + ".bias"] = np.ones(D, np.float32), np.zeros(D, np.float32)
        for name, (n_in, n_out) in {"attn.c_attn": (D, 3 * D), "attn.c_proj": (D, D),
                                    "mlp.c_fc": (D, 4 * D), "mlp.c_proj": (4 * D, D)}.items():
            t[h + name + ".weight"], t[h + name + ".bias"] = normal(n_in, n_out), np.zeros(n_out, np.float32)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = dict(model_type="gpt2", activation_function="gelu_new", layer_norm_epsilon=1e-5,
              tie_word_embeddings=True, **config)
    (directory / "config.json").write_text(json.dumps(hf, indent=1))
    return dict(n_params=int(sum(a.size for a in t.values())), source="numpy (no PyTorch)")


def tiny_softmax_lm(seed: int = 0) -> tuple:
    """``(model, variables)``: a random 2-layer softmax LM with rope (vocab 128, d_model 32, 4 heads,
    ``max_len`` 256) that compiles in about a second: SmolLM2's stand-in in quick benchmarks."""
    import jax
    import jax.numpy as jnp

    from linicl.config import ModelConfig
    from linicl.nn import Transformer
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=256,
                      attention="softmax", positions="rope")
    model = Transformer(cfg)
    return model, jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))
