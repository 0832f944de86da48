"""Model configuration: one frozen dataclass for every model in the zoo, and named tiny presets.

The config is hashable (it is a static argument of jitted functions) and validated on construction, so
that a bad option fails here with a message naming the field rather than deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax.numpy as jnp

from linicl.errors import ConfigError
from linicl.kernels.feature_maps import feature_dim
from linicl.names import (ACTIVATIONS, ALL_FEATURE_MAPS, ATTENTION_KINDS, DTYPES, FEATURE_MAPS,  # noqa: F401
                          FORMS, MLPS, NONNEGATIVE_MAPS, NORM_TYPES, NORMS, POSITIONS, ROPE_ON,
                          ROPE_STYLES, SKIPS)


def _choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"ModelConfig.{field} must be one of {choices}, got {value!r}")


def _positive_int(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"ModelConfig.{field} must be a positive int, got {value!r}")


def _nonnegative_int(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"ModelConfig.{field} must be an int >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a model of the zoo.

    Attributes:
      vocab_size, d_model, n_layers, n_heads, d_ff, max_len: sizes. ``max_len`` bounds the positions a
        model with learned positions can embed, and the length of a softmax decode cache.
      attention: ``"linear"`` (exactly convertible) or ``"softmax"``.
      feature_map: linear attention's phi: ``"elu+1"``, ``"relu"``, ``"identity"``, ``"taylor2"``
        (phi(q).phi(k) = 1 + s + s^2/2 with s = q.k/sqrt(d_head)) or the learned ``"hedgehog"``
        (phi(x) = [softmax(xW + b), softmax(-(xW + b))], separate maps for queries and keys per
        layer and head, initialised to W = identity, b = 0: ``linicl.kernels.feature_maps``).
      feature_size: hedgehog's m (d_phi = 2m); 0 means m = d_head. Hedgehog only.
      normalize: divide by phi(q).z (Katharopoulos); ``False`` is the unnormalised linear attention of
        the theory papers.
      decay: ``None``, one gamma for every head, or one per head (RetNet-style), each in (0, 1].
      positions: ``"none"``, ``"learned"`` absolute embeddings, or ``"rope"``. In linear attention the
        rotation acts on the features phi(q), phi(k) of the numerator only; the normaliser uses the
        unrotated features, so it stays positive and the model depends on t - i only.
      rope_on: where rope acts in linear attention: ``"features"`` (above; relative, a converted
        state is re-based and the query restarts at position 0) or ``"inputs"`` (q, k are rotated
        before phi, as LoLCATs does for rope-trained teachers; phi(R_t q).phi(R_i k) depends on
        absolute positions, the normaliser uses the same features, and a converted model continues
        at the prompt's length: the offset is kept in the ``position`` collection).
      window: linear attention with an exact softmax window (the LoLCATs hybrid): the current token
        and the ``window - 1`` before it are weighted g_h exp(q.k/sqrt(d) - c_t), older keys
        phi(q).phi(k), under one shared normaliser; g_h = sigmoid(``gate``), a per-head parameter
        initialised to 0 (g_h = 1/2), c_t the row maximum of the exact logits. With decay both
        parts are weighted gamma^(t - i). 0: no window (plain linear attention).
      sinks: tokens at absolute positions < ``sinks`` stay exact for every later query. With a
        window or sinks the exact logits use the rotated q, k (rope, for either ``rope_on``), the
        state is never re-based and the query keeps absolute positions (the offset is kept).
      norm: ``"pre"`` (with a final norm), ``"post"`` or ``"none"`` (no norm in the blocks).
      norm_type: ``"layernorm"`` (GPT-2: scale and bias) or ``"rmsnorm"`` (Llama: scale only).
      skip: how a block without norms adds its parts (``norm="none"`` only; the implicit-update
        block forms of Dherin et al. and Innocenti & Achour): ``"residual"`` h = x + A(x), out = h +
        MLP(h); ``"dherin"`` out = x + A(x) + MLP(A(x)); ``"none"`` (Dherin's plain block) out =
        MLP(A(x)).
      final_norm: a norm after the last block; ``None`` means "only for pre-norm models".
      mlp: ``"plain"`` (``fc_out(act(fc_in(x)))``, with ``mlp_depth - 2`` hidden ``fc_mid_j`` layers)
        or ``"gated"`` (SwiGLU when ``activation="silu"``: ``fc_out(act(fc_gate(x)) * fc_in(x))``).
      n_kv_heads: key/value heads (grouped-query attention, Llama family); ``None`` = ``n_heads``.
      rope_style: pairing of the rotated coordinates: ``"interleaved"`` (GPT-J, llama.cpp's GGUF
        layout) or ``"half"`` (GPT-NeoX, HF Llama).
      attn_bias, mlp_bias: biases of the attention and MLP projections; ``None`` = ``use_bias``.
      causal: causal attention. ``False`` (softmax only) serves the non-causal implicit-update
        theory; nothing that needs a state or a cache accepts it.
      attn_eps: the epsilon inside a normalised linear attention's denominator. It is part of the
        model, identical in the prompted and the converted model.
      form: linear-attention kernel form; ``"auto"`` picks parallel for short and chunked for long
        sequences.
      trainable_bias: add zero-initialised trainable initial states (B, b) per layer and head to the
        params (ICLCA Fig. 1).
      dtype: parameter and computation dtype.
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 64
    max_len: int = 256
    attention: str = "linear"
    feature_map: str = "elu+1"
    feature_size: int = 0
    normalize: bool = True
    decay: Union[None, float, Sequence[float]] = None
    positions: str = "none"
    norm: str = "pre"
    norm_type: str = "layernorm"
    skip: str = "residual"
    final_norm: Optional[bool] = None
    mlp: str = "plain"
    mlp_depth: int = 2
    n_kv_heads: Optional[int] = None
    rope_style: str = "interleaved"
    rope_on: str = "features"
    window: int = 0
    sinks: int = 0
    activation: str = "gelu_tanh"
    use_bias: bool = True
    attn_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    causal: bool = True
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    ln_eps: float = 1e-5
    attn_eps: float = 1e-6
    form: str = "auto"
    chunk_size: int = 64
    trainable_bias: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len", "chunk_size",
                  "mlp_depth"):
            _positive_int(f, getattr(self, f))
        for f, choices in (("attention", ATTENTION_KINDS), ("feature_map", ALL_FEATURE_MAPS),
                           ("rope_on", ROPE_ON),
                           ("positions", POSITIONS), ("norm", NORMS), ("norm_type", NORM_TYPES),
                           ("skip", SKIPS), ("mlp", MLPS), ("rope_style", ROPE_STYLES),
                           ("activation", ACTIVATIONS), ("form", FORMS), ("dtype", DTYPES)):
            _choice(f, getattr(self, f), choices)
        if self.d_model % self.n_heads:
            raise ConfigError(f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                              f"n_heads ({self.n_heads})")
        self._check_structure()
        self._check_decay()
        self._check_finite_state()
        if self.attention == "linear" and self.normalize and self.feature_map not in NONNEGATIVE_MAPS:
            raise ConfigError(
                f"ModelConfig.normalize=True needs a non-negative feature map {NONNEGATIVE_MAPS}; "
                f"{self.feature_map!r} can make phi(q).z zero or negative. Use normalize=False.")
        if self.attention == "softmax" and (self.decay is not None or self.trainable_bias):
            raise ConfigError("ModelConfig.decay and trainable_bias apply to attention='linear' only")
        if self.positions == "rope" and self.head_dim < 2 and self.attention == "softmax":
            raise ConfigError("ModelConfig.positions='rope' needs a head dimension of at least 2")

    def _check_structure(self) -> None:
        if self.n_kv_heads is not None:
            _positive_int("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ConfigError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
                                  f"n_kv_heads ({self.n_kv_heads})")
        if self.skip != "residual" and self.norm != "none":
            raise ConfigError(f"ModelConfig.skip={self.skip!r} is a block form without norms; "
                              f"it needs norm='none' (got norm={self.norm!r})")
        if self.mlp_depth < 2 or (self.mlp == "gated" and self.mlp_depth != 2):
            raise ConfigError(f"ModelConfig.mlp_depth counts the MLP's dense layers: >= 2 for a plain "
                              f"MLP, exactly 2 for a gated one; got {self.mlp_depth} ({self.mlp})")
        if not self.causal and self.attention != "softmax":
            raise ConfigError("ModelConfig.causal=False needs attention='softmax' (linear attention "
                              "is defined here by its causal state)")

    def _check_finite_state(self) -> None:
        """The options of the linearised models: hedgehog, rope on the inputs, window and sinks."""
        for f in ("feature_size", "window", "sinks"):
            _nonnegative_int(f, getattr(self, f))
        if self.feature_size and self.feature_map != "hedgehog":
            raise ConfigError(f"ModelConfig.feature_size sets hedgehog's m; it needs "
                              f"feature_map='hedgehog' (got {self.feature_map!r})")
        if self.attention != "linear":
            for f, default in (("feature_map", "hedgehog"), ("rope_on", "inputs")):
                if getattr(self, f) == default:
                    raise ConfigError(f"ModelConfig.{f}={default!r} applies to attention='linear' only")
            for f in ("window", "sinks"):
                if getattr(self, f):
                    raise ConfigError(f"ModelConfig.{f} adds an exact softmax part to linear attention; "
                                      f"it needs attention='linear' (got {self.attention!r})")
        if self.rope_on == "inputs" and self.positions != "rope":
            raise ConfigError(f"ModelConfig.rope_on='inputs' needs positions='rope' "
                              f"(got {self.positions!r})")
        for f in ("window", "sinks"):
            if getattr(self, f) and not self.normalize:
                raise ConfigError(f"ModelConfig.{f} needs normalize=True: the exact and the linear "
                                  f"parts share one normaliser")

    def _check_decay(self) -> None:
        if self.decay is None:
            return
        if isinstance(self.decay, (int, float)) and not isinstance(self.decay, bool):
            values = (float(self.decay),)
        else:
            values = tuple(float(g) for g in self.decay)
            if len(values) != self.n_heads:
                raise ConfigError(f"ModelConfig.decay has {len(values)} values; expected one float "
                                  f"or one per head (n_heads={self.n_heads})")
            object.__setattr__(self, "decay", values)  # lists -> tuple, so the config stays hashable
        if not all(0.0 < g <= 1.0 for g in values):
            raise ConfigError(f"ModelConfig.decay values must lie in (0, 1], got {self.decay}")

    # ---------------------------------------------------------------- derived quantities
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def has_attn_bias(self) -> bool:
        return self.use_bias if self.attn_bias is None else self.attn_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.use_bias if self.mlp_bias is None else self.mlp_bias

    @property
    def has_final_norm(self) -> bool:
        return self.norm == "pre" if self.final_norm is None else self.final_norm

    @property
    def feature_dim(self) -> int:
        """d_phi, the width of phi(k) and so of the state S: [d_phi, d_head]."""
        return feature_dim(self.feature_map, self.head_dim, self.feature_size)

    @property
    def hedgehog_size(self) -> int:
        """Hedgehog's m (the width of each softmax half)."""
        return self.feature_size or self.head_dim

    @property
    def hybrid(self) -> bool:
        """Linear attention with an exact softmax window or sinks (the LoLCATs hybrid)."""
        return self.attention == "linear" and (self.window > 0 or self.sinks > 0)

    @property
    def keeps_offset(self) -> bool:
        """Whether a stored prompt keeps absolute positions: the query continues at the prompt's
        length (``position/offset``), because the model depends on absolute positions."""
        return self.positions == "learned" or self.hybrid or (
            self.attention == "linear" and self.positions == "rope" and self.rope_on == "inputs")

    @property
    def rebases_state(self) -> bool:
        """Linear attention with rope on the features and nothing absolute: a stored state is
        re-based by R(-n) and the next token sits at position 0."""
        return self.attention == "linear" and self.positions == "rope" and not self.keeps_offset

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def decay_per_head(self) -> Optional[tuple]:
        """gamma for each head, or None when the model has no decay."""
        if self.decay is None:
            return None
        if isinstance(self.decay, tuple):
            return self.decay
        return (float(self.decay),) * self.n_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A one-line summary of the options that matter for exactness."""
        parts = [self.attention, f"L{self.n_layers}", f"H{self.n_heads}", f"d{self.d_model}"]
        if self.attention == "linear":
            parts += [self.feature_map + (f"{self.hedgehog_size}" if self.feature_map == "hedgehog" else ""),
                      "norm" if self.normalize else "unnorm"]
            if self.window or self.sinks:
                parts.append(f"window={self.window}/sinks={self.sinks}")
            if self.decay is not None:
                parts.append("decay=" + (f"{self.decay}" if not isinstance(self.decay, tuple)
                                         else "per-head"))
        if self.kv_heads != self.n_heads:
            parts.append(f"kv{self.kv_heads}")
        parts += [f"pos={self.positions}" + (f"/{self.rope_style}" if self.positions == "rope" else "")
                  + ("/inputs" if self.rope_on == "inputs" else "")]
        parts.append(f"{self.norm}-{'RMS' if self.norm_type == 'rmsnorm' else 'LN'}"
                     if self.norm != "none" else f"no-norm/{self.skip}")
        if self.mlp == "gated":
            parts.append("gated-MLP")
        if self.trainable_bias:
            parts.append("trainable-bias")
        return " ".join(parts)


PRESETS = {
    # Tiny models for tests and examples: fast enough to compile in a second on a CPU.
    "tiny-linear": ModelConfig(),
    "tiny-linear-rope-decay": ModelConfig(positions="rope", decay=(0.9, 0.95, 0.99, 1.0)),
    "tiny-linear-learned": ModelConfig(positions="learned", norm="post"),
    "tiny-linear-unnormalized": ModelConfig(feature_map="identity", normalize=False),
    "tiny-softmax": ModelConfig(attention="softmax", positions="learned"),
    "tiny-softmax-rope": ModelConfig(attention="softmax", positions="rope"),
    # The two pretrained families at toy size: GPT-2 (learned positions, LayerNorm with biases,
    # tanh-GELU, tied embeddings) and Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases).
    "tiny-gpt2": ModelConfig(attention="softmax", positions="learned", activation="gelu_tanh"),
    "tiny-llama": ModelConfig(attention="softmax", positions="rope", rope_style="half",
                              norm_type="rmsnorm", mlp="gated", activation="silu", n_kv_heads=2,
                              use_bias=False, tie_embeddings=False),
    # The benchmark model of the foundation issue.
    "bench-4x256": ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, d_ff=1024,
                               max_len=32_768, positions="rope", decay=0.999),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with some fields replaced: ``preset("tiny-linear", dtype="float64")``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
