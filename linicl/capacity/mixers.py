"""Seven token mixers at one size, whose finite states hold the same number of floats per prompt.

Every mixer gets the same sizes (``mixer_config``: no positions except softmax's rope). The
finite-state ones store ``iclca.state_floats`` floats per prompt: L * H * (d_phi * d_head + d_phi)
with d_phi = d_head (the delta rule keeps no z: L * H * d_phi * d_head, d_head floats fewer per head):

* ``softmax``: softmax attention with rope; its prompt is a KV cache of 2 * L * H * d_head floats per
  prompt token, not a finite state: not convertible;
* ``linear``: linear attention, phi = elu+1, normalised (Katharopoulos et al.);
* ``decayed``: the same with a fixed per-head decay gamma_h = 1 - 2^-s_h, s_h evenly over [0.4,
  6.6] (0.24, 0.82, 0.96, 0.99 for 4 heads: RetNet-style, one head almost a token shift; ``decays``);
* ``gated``, ``gated_vector``: data-dependent decays, one per head and token (``gate="scalar"``,
  Mamba-2 style) or per head, token and key feature (``gate="vector"``, GLA);
* ``delta``: the delta rule (DeltaNet; phi = identity, L2-normalised q and k, ``normalize=False``);
* ``gated_delta``: the delta rule with a scalar gate (Gated DeltaNet).

The gated models' gate biases start at the decayed model's gammas (alpha_h = gamma_h at x W = 0;
``with_gate_bias``): a gate is then the fixed decay plus what the tokens make of it. The zoo's own
initial gates remember 8 to 512 tokens (``linicl.nn.attention.gate_bias_init``); these models have no
short convolution and must make the token shift that binds a key to its value from a short memory,
which the zoo's gates reach only after long training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linicl import iclca
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.memory import kv_cache_floats
from linicl.nn import Transformer

__all__ = ["MIXERS", "PAIRED", "decays", "mixer_config", "with_gate_bias", "init_params", "state_label",
           "prompt_floats", "eval_model"]

# mixer -> its ModelConfig fields ("spread": the decays of ``decays(n_heads)``)
MIXERS = {
    "softmax": dict(attention="softmax", positions="rope"),
    "linear": dict(feature_map="elu+1"),
    "decayed": dict(feature_map="elu+1", decay="spread"),
    "gated": dict(feature_map="elu+1", gate="scalar"),
    "gated_vector": dict(feature_map="elu+1", gate="vector"),
    "delta": dict(feature_map="identity", normalize=False, update="delta"),
    "gated_delta": dict(feature_map="identity", normalize=False, update="delta", gate="scalar"),
}
# delta-rule mixer -> the additive mixer it differs from only by the update rule
PAIRED = {"delta": "linear", "gated_delta": "gated"}


def decays(n_heads: int) -> tuple:
    """gamma_h = 1 - 2^-s_h with s_h evenly over [0.4, 6.6], one per head: from an almost-shift head
    (0.24) to a memory of ~100 tokens (0.99); one head gets s = 3 (0.875)."""
    if not isinstance(n_heads, int) or n_heads < 1:
        raise LiniclError(f"n_heads must be an int >= 1, got {n_heads!r}")
    s = np.linspace(0.4, 6.6, n_heads) if n_heads > 1 else np.array([3.0])
    return tuple(float(g) for g in 1.0 - np.exp2(-s))


def mixer_config(mixer: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                 max_len: int) -> ModelConfig:
    """The ``ModelConfig`` of ``mixer`` (a key of ``MIXERS``) at the given sizes. Linear-family models
    run the chunked form with chunks of 16 (the fastest on a CPU at short lengths; every form computes
    the same). A size the zoo refuses raises its ``ConfigError`` naming the field."""
    if mixer not in MIXERS:
        raise LiniclError(f"mixer: unknown mixer {mixer!r}; known: {', '.join(MIXERS)}")
    fields = dict(MIXERS[mixer])
    if fields.get("decay") == "spread":
        fields["decay"] = decays(n_heads)
    if fields.get("attention", "linear") == "linear":
        fields.update(form="chunked", chunk_size=16)
    return ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff,
                       max_len=max_len, **fields)


def with_gate_bias(params: dict, cfg: ModelConfig) -> dict:
    """``params`` with every layer's gate bias at logit(gamma_h) of ``decays(cfg.n_heads)``, so that
    alpha_h = gamma_h at x W = 0 (bias ``[heads]`` for a scalar gate, ``[heads, d_phi]`` for a vector
    one); changed in place and returned. A model without gates is returned as it is."""
    if cfg.gate == "none":
        return params
    gamma = np.asarray(decays(cfg.n_heads))
    logit = np.log(gamma) - np.log1p(-gamma)                          # sigmoid(logit) = gamma
    for layer in range(cfg.n_layers):
        gate = params[f"layers_{layer}"]["attn"]["gate_proj"]
        shape = gate["bias"].shape
        bias = np.broadcast_to(logit.reshape((-1,) + (1,) * (len(shape) - 1)), shape)
        gate["bias"] = jnp.asarray(bias.astype(cfg.jnp_dtype))       # numpy: no eager compilation
    return params


def init_params(cfg: ModelConfig, key, *, embeds: bool = False) -> dict:
    """Initial params of ``Transformer(cfg)``, gates by ``with_gate_bias``. ``embeds=True``: the model
    that reads ``embeds: f[batch, seq, d_model]`` and returns its final hidden state (``hidden=True``)
    instead of token ids and logits."""
    model = Transformer(cfg)
    if embeds:
        init = jax.jit(lambda k: model.init(k, embeds=jnp.zeros((1, 2, cfg.d_model), jnp.float32), hidden=True))
    else:
        init = jax.jit(lambda k: model.init(k, jnp.zeros((1, 2), jnp.int32)))
    return with_gate_bias(init(key)["params"], cfg)


def state_label(cfg: ModelConfig) -> str:
    """``"state <floats>"`` for a finite-state (linear-family) model, ``"KV cache"`` for softmax."""
    return f"state {iclca.state_floats(cfg)}" if cfg.attention == "linear" else "KV cache"


def prompt_floats(cfg: ModelConfig, n_tokens: int) -> int:
    """Floats a prompt of ``n_tokens`` tokens leaves per row: the finite state (any length), or a
    softmax model's KV cache."""
    if cfg.attention == "linear":
        return iclca.state_floats(cfg)
    return kv_cache_floats(cfg, n_tokens)


def eval_model(cfg: ModelConfig, params) -> tuple:
    """``(model, params)`` for a float64 evaluation: ``cfg`` in float64 and the trained weights cast,
    so that prompted and converted outputs agree to ~1e-12 and no rounding flips an argmax."""
    cfg = cfg.replace(dtype="float64")
    if cfg.attention == "linear":
        # Every form computes the same model. The recurrent one here because with the parallel form
        # (also the chunked form's short tail) XLA CPU's YNNPACK reduce fusions returned an all-NaN
        # state in float64 at batch 256 for about 1 compilation in 5 (README, known issues).
        cfg = cfg.replace(form="recurrent")
    return Transformer(cfg), jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
