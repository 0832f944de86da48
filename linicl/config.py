"""Model configuration: one frozen dataclass for every model in the zoo, and named tiny presets.

The config is hashable (it is a static argument of jitted functions) and validated on construction, so
that a bad option fails here with a message naming the field rather than deep inside a forward pass.
Every field has a type and a range: sizes are ints (NumPy integers are accepted and converted; bools
and floats are not), switches are bools (``numpy.bool_`` accepted; 0, 1 or strings are not), rates and
epsilons finite numbers, options one of the names in ``linicl.names``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from linicl._validate import is_concrete
from linicl.errors import ConfigError
from linicl.kernels.feature_maps import feature_dim
from linicl.names import (ACTIVATIONS, ALL_FEATURE_MAPS, ATTENTION_KINDS, CACHE_FORMS, CACHE_RULES,  # noqa: F401
                          DTYPES, FEATURE_MAPS, FORMS, GATES, MLPS, NO_LINEAR_PART, NONNEGATIVE_MAPS,
                          NORM_TYPES, NORMS, POSITIONS, ROPE_ON, ROPE_STYLES, SHORT_CONV_ACTIVATIONS, SKIPS,
                          UPDATES, LAYER_TYPES)


# Field kinds. Every field of ModelConfig is in exactly one of these (n_kv_heads, d_head,
# query_pre_attn_scalar, layer_types, rope_local_base, decay and short_conv are checked on their own);
# tests/library/test_config_validation.py checks that none is left out.
_POSITIVE_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len", "chunk_size",
                  "mlp_depth")
_NONNEGATIVE_INTS = ("feature_size", "window", "sinks", "cache", "sliding_window")
_BOOLS = ("normalize", "causal", "use_bias", "tie_embeddings", "trainable_bias", "qk_norm", "scale_embeddings")
_OPTIONAL_BOOLS = ("final_norm", "attn_bias", "mlp_bias")  # None means "derived from other fields"
_POSITIVE_FLOATS = ("rope_base", "ln_eps")
# 0 is allowed: no epsilon (the denominator of a non-negative map is positive without one).
_NONNEGATIVE_FLOATS = ("attn_eps",)
_CHOICES = {"attention": ATTENTION_KINDS, "feature_map": ALL_FEATURE_MAPS, "rope_on": ROPE_ON,
            "positions": POSITIONS, "norm": NORMS, "norm_type": NORM_TYPES, "skip": SKIPS, "mlp": MLPS,
            "rope_style": ROPE_STYLES, "activation": ACTIVATIONS, "form": FORMS, "dtype": DTYPES,
            "gate": GATES, "update": UPDATES, "cache_rule": CACHE_RULES,
            "short_conv_activation": SHORT_CONV_ACTIVATIONS}


def _scalar(value):
    """A NumPy (or concrete JAX) scalar or 0-d array as the Python value it holds; else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and is_concrete(value):
        return np.asarray(value).item()
    return value


def _is_number(value) -> bool:
    """An int or float, but not a bool (True is an int in Python, never a size or a rate here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(field: str, value, choices) -> str:
    value = _scalar(value)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"ModelConfig.{field} must be one of {choices}, got {value!r}")
    return str(value)  # a NumPy string -> str


def _int(field: str, value, lo: int) -> int:
    """``value`` as an int >= lo (NumPy integers accepted; bools and floats refused)."""
    v = _scalar(value)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        expected = "a positive int" if lo == 1 else f"an int >= {lo}"
        raise ConfigError(f"ModelConfig.{field} must be {expected}, got {value!r}")
    return int(v)


def _bool(field: str, value, optional: bool = False):
    """``value`` as a bool (NumPy bools accepted; 0, 1, strings refused), or None when optional."""
    v = _scalar(value)
    if v is None and optional:
        return None
    if not isinstance(v, bool):
        expected = "True, False or None" if optional else "True or False"
        raise ConfigError(f"ModelConfig.{field} must be {expected} (a bool), got {value!r}")
    return v


def _float(field: str, value, positive: bool) -> float:
    """``value`` as a finite float > 0 (or >= 0); ints and NumPy numbers accepted, bools refused."""
    v = _scalar(value)
    expected = "a finite float > 0" if positive else "a finite float >= 0"
    if not _is_number(v):
        raise ConfigError(f"ModelConfig.{field} must be {expected}, got {value!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(f"ModelConfig.{field} must be {expected}, got {value!r}")
    return v


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
        layer and head, initialised to W = identity, b = 0: ``linicl.kernels.feature_maps``), or
        ``"none"``: no linear part (one zero feature), so that a layer with a window or sinks is
        softmax over its sinks and window alone (StreamingLLM; needs a window or sinks, and
        rope_on="inputs" with rope): the untrained baseline of a linearized model.
      feature_size: hedgehog's m (d_phi = 2m); 0 means m = d_head. Hedgehog only.
      normalize: divide by phi(q).z (Katharopoulos); ``False`` is the unnormalised linear attention of
        the theory papers.
      decay: ``None``, one gamma for every head, or one per head (RetNet-style), each in (0, 1].
      gate: linear attention's data-dependent decay (``linicl.kernels.gated_attention``): ``"none"``;
        ``"scalar"``, one alpha_t per head and token (Mamba-2, Gated DeltaNet); ``"vector"``, one per
        head, token and key feature (GLA), decaying the rows of S and z elementwise. alpha_t =
        sigmoid(x_t W + b), computed in log space (log-sigmoid), so it stays in (0, 1]; the bias starts
        near 1 (``linicl.nn.attention``). Not with ``decay`` (one decay mechanism at a time), a window
        or sinks, or softmax attention; ``"vector"`` not with rope on the features (a per-feature
        decay does not commute with rotating feature pairs, so the state could not be re-based).
      update: how linear attention writes its state: ``"add"`` (S += phi(k) v^T, z += phi(k)) or
        ``"delta"``, the delta rule S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
        (DeltaNet; with ``gate="scalar"`` Gated DeltaNet; ``linicl.kernels.delta_rule``) with beta_t =
        sigmoid of a projection of x_t and phi(q), phi(k) L2-normalised per head. Its read-out is
        phi(q)^T S and it has no z, so it needs ``normalize=False``; it takes no ``decay`` (use
        ``gate="scalar"``), no ``"vector"`` gate, no window or sinks and no ``trainable_bias``.
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
      cache: LoLA's sparse cache beside a window or sinks (``linicl.kernels.sparse_cache``): up to
        ``cache`` tokens that have left the window stay exact, weighted like the window's; of the
        cached tokens and each token leaving the window, the one the linear state recalls best from
        its key (lowest |v - phi(k) S / (phi~(k).z + eps)|^2) enters (S, z) instead. No parameters,
        so the state stays finite and the conversion exact. Needs a window or sinks (hence
        attention="linear" and normalize=True) and form "auto" or "recurrent" (the selection is
        sequential: "auto" runs the recurrent form). 0: no cache (the hybrid).
      cache_rule: how the cache scores tokens (``CACHE_RULES``): ``"recall"`` (LoLA, above) or
        ``"attention"``: the attention weight a token received from the ``window`` queries it was
        exact for (stored with it, so the state grows by window - 1 + cache floats per head); the
        lowest leaves. ``"attention"`` needs window >= 1; either needs ``cache >= 1``.
      norm: ``"pre"`` (with a final norm), ``"post"``, ``"none"`` (no norm in the blocks) or
        ``"sandwich"`` (Gemma 2/3: pre-norm, and the attention's and the MLP's outputs normalised
        again before they are added, h = x + N1'(A(N1(x))), out = h + N2'(MLP(N2(h))); a final norm).
      norm_type: ``"layernorm"`` (GPT-2: scale and bias), ``"rmsnorm"`` (Llama: scale only) or
        ``"gemma_rmsnorm"`` (x / rms(x) * (1 + w), w initialised to 0).
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
      attn_eps: the epsilon inside a normalised linear attention's denominator (finite, >= 0); with
        ``update="delta"``, inside the L2 norm of the features, phi / sqrt(|phi|^2 + attn_eps). It is
        part of the model, identical in the prompted and the converted model.
      rope_base, ln_eps: finite floats > 0.
      form: linear-attention kernel form; ``"auto"`` picks parallel for short and chunked for long
        sequences.
      trainable_bias: add zero-initialised trainable initial states (B, b) per layer and head to the
        params (ICLCA Fig. 1).
      dtype: parameter and computation dtype.
      d_head: the width of each head; ``None`` = d_model / n_heads (which must then divide). Gemma
        sets it apart (heads * d_head != d_model; ``o`` maps back to d_model).
      qk_norm: normalise q and k per head (over d_head, with ``norm_type`` and ``ln_eps``; params
        ``q_norm``, ``k_norm``) after the projections (and their sites) and before rope (Gemma 3).
      scale_embeddings: multiply the token embeddings by sqrt(d_model) (in the model's dtype) before
        the first block (Gemma); the tied unembedding uses the unscaled matrix. ``embeds=`` inputs are
        the first block's input and are not scaled.
      query_pre_attn_scalar: s in the attention scale 1/sqrt(s) (Gemma); ``None`` = d_head. The
        queries are multiplied by sqrt(d_head / s) after rope, so every kernel (softmax, linear
        features, the exact window) sees the same scaled query.
      layer_types: ``None`` (every layer the config's attention) or one of ``LAYER_TYPES`` per layer:
        ``"global"`` (the config's attention) or ``"local"``: exact softmax over the current token and
        the ``sliding_window - 1`` before it (Gemma 2/3, Mistral), with rope base ``rope_local_base``.
        A local layer is a finite state, so it runs as the window-only hybrid (``layer_config``:
        attention "linear", feature_map "none", window = sliding_window, no sinks, attn_eps 0, rope on
        the inputs): its decode state and a converted prompt hold the last window - 1 keys and values
        with their positions, whatever the length. Its per-head window gate cancels (no linear part,
        no epsilon): exactly softmax. Linear global layers with local ones need rope on the inputs
        (the local windows keep absolute positions).
      sliding_window: the local layers' window (>= 1 with local layers, else 0).
      rope_local_base: the local layers' rope base; ``None`` = ``rope_base``.
      short_conv: K, the taps of a short depthwise causal convolution of q, k and v in every linear
        (global) layer, as in Mamba, GLA, DeltaNet and Gated DeltaNet (``linicl.kernels.short_conv``):
        each channel c of the projections becomes y_t[c] = act(sum_j w[j, c] x_{t-K+1+j}[c]), j = 0
        .. K - 1, without bias. It acts after the projections (and their sites ``hook_q``, ``hook_k``,
        ``hook_v``, before grouped-query heads are repeated) and before everything else: the q/k norms,
        the query scale, rope, the feature map and the delta rule's L2 norms (fla's order). Params
        ``conv_q: [K, heads, d_head]``, ``conv_k``, ``conv_v`` (kv_heads), initialised to the
        identity (tap K - 1 = 1, the others 0: a new model is the model without the convolution when
        the activation is "none"). Its state, the last K - 1 inputs of q, k, v (zeros before the
        first token), is stored by a conversion and carried by a decode beside the attention's
        state (``conv_q``, ``conv_k``, ``conv_v`` in ``prompt_state`` and ``decode``), so the
        conversion stays exact. 0: none; otherwise >= 2. Needs attention="linear" (local layers of
        ``layer_types`` have none).
      short_conv_activation: the activation after the convolution: ``"none"`` or ``"silu"``
        (``SHORT_CONV_ACTIVATIONS``); a non-default value needs ``short_conv >= 2``.
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
    # Last, so that positional arguments and every older config keep their meaning.
    gate: str = "none"
    update: str = "add"
    cache: int = 0
    cache_rule: str = "recall"
    d_head: Optional[int] = None
    qk_norm: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: Optional[float] = None
    layer_types: Optional[Sequence[str]] = None
    sliding_window: int = 0
    rope_local_base: Optional[float] = None
    short_conv: int = 0
    short_conv_activation: str = "none"

    def __post_init__(self):
        self._check_fields()
        if self.d_head is None and self.d_model % self.n_heads:
            raise ConfigError(f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                              f"n_heads ({self.n_heads}), or set d_head")
        self._check_structure()
        self._check_decay()
        self._check_recurrence()  # first: a delta-rule model with sinks hears "sinks=0", not "normalize=True"
        self._check_finite_state()
        if self.attention == "linear" and self.normalize and self.feature_map not in NONNEGATIVE_MAPS:
            raise ConfigError(
                f"ModelConfig.normalize=True needs a non-negative feature map {NONNEGATIVE_MAPS}; "
                f"{self.feature_map!r} can make phi(q).z zero or negative. Use normalize=False.")
        if self.attention == "softmax" and (self.decay is not None or self.trainable_bias):
            raise ConfigError("ModelConfig.decay and trainable_bias apply to attention='linear' only")
        self._check_rope()
        self._check_layer_types()
        self._check_short_conv()

    def _set(self, field: str, value) -> None:
        object.__setattr__(self, field, value)  # frozen: normalised values (np.int64 -> int, ...)

    def _check_fields(self) -> None:
        """Each field's type and range on its own (numbers and bools normalised to Python's)."""
        for f in _POSITIVE_INTS:
            self._set(f, _int(f, getattr(self, f), 1))
        for f in _NONNEGATIVE_INTS:
            self._set(f, _int(f, getattr(self, f), 0))
        if self.n_kv_heads is not None:
            self._set("n_kv_heads", _int("n_kv_heads", self.n_kv_heads, 1))
        if self.d_head is not None:
            self._set("d_head", _int("d_head", self.d_head, 1))
        if self.query_pre_attn_scalar is not None:
            self._set("query_pre_attn_scalar", _float("query_pre_attn_scalar", self.query_pre_attn_scalar, True))
        if self.rope_local_base is not None:
            self._set("rope_local_base", _float("rope_local_base", self.rope_local_base, True))
        K = _scalar(self.short_conv)
        if not isinstance(K, int) or isinstance(K, bool) or K < 0 or K == 1:
            raise ConfigError(f"ModelConfig.short_conv must be 0 (no convolution) or an int >= 2 (the "
                              f"kernel's taps), got {self.short_conv!r}")
        self._set("short_conv", int(K))
        for f in _BOOLS + _OPTIONAL_BOOLS:
            self._set(f, _bool(f, getattr(self, f), optional=f in _OPTIONAL_BOOLS))
        for f in _POSITIVE_FLOATS + _NONNEGATIVE_FLOATS:
            self._set(f, _float(f, getattr(self, f), positive=f in _POSITIVE_FLOATS))
        for f, choices in _CHOICES.items():
            self._set(f, _choice(f, getattr(self, f), choices))

    def _check_rope(self) -> None:
        """Rope rotates pairs of coordinates: a width below 2 would leave the model (or its exact
        softmax part) without any positional signal."""
        if self.positions != "rope":
            return
        widths = {}
        if self.attention == "softmax" or self.rope_on == "inputs" or self.hybrid:
            widths["head dimension (d_model / n_heads)"] = self.head_dim  # q, k are rotated
        if self.attention == "linear" and self.rope_on == "features":
            widths[f"feature dimension ({self.feature_map} of d_head={self.head_dim})"] = self.feature_dim
        for what, width in widths.items():
            if width < 2:
                raise ConfigError(f"ModelConfig.positions='rope' needs a {what} of at least 2, got "
                                  f"{width}: a rotation of pairs of coordinates would do nothing")

    def _check_structure(self) -> None:
        if self.n_kv_heads is not None:
            if self.n_heads % self.n_kv_heads:
                raise ConfigError(f"ModelConfig.n_kv_heads ({self.n_kv_heads}) must divide "
                                  f"n_heads ({self.n_heads}): each key/value head serves a group")
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
        self._check_no_linear_part()
        self._check_cache()  # first: a bad cache hears "cache", not what the window needs
        for f in ("window", "sinks"):
            if getattr(self, f) and not self.normalize:
                raise ConfigError(f"ModelConfig.{f} needs normalize=True: the exact and the linear "
                                  f"parts share one normaliser")

    def _check_no_linear_part(self) -> None:
        """feature_map='none' leaves only the exact part: it needs one (a window or sinks), and rope
        on q, k (there are no features to rotate)."""
        if self.feature_map != NO_LINEAR_PART:
            return
        if self.attention != "linear" or not (self.window or self.sinks):
            raise ConfigError(f"ModelConfig.feature_map='none' (no linear part) leaves only a window and "
                              f"sinks; it needs attention='linear' with window >= 1 or sinks >= 1 (got "
                              f"attention={self.attention!r}, window={self.window}, sinks={self.sinks})")
        if self.positions == "rope" and self.rope_on != "inputs":
            raise ConfigError("ModelConfig.feature_map='none' has no features to rotate: with "
                              "positions='rope' it needs rope_on='inputs'")

    def _check_layer_types(self) -> None:
        """Local layers: one type per layer, a window for them, and positions they can keep."""
        types = self.layer_types
        if types is not None:
            if isinstance(types, str) or not isinstance(types, Sequence) or len(types) != self.n_layers:
                raise ConfigError(f"ModelConfig.layer_types must be None or a sequence of n_layers "
                                  f"({self.n_layers}) names from {LAYER_TYPES}, got {types!r}")
            bad = [t for t in types if not isinstance(t, str) or t not in LAYER_TYPES]
            if bad:
                raise ConfigError(f"ModelConfig.layer_types entries must be one of {LAYER_TYPES}, got "
                                  f"{bad[0]!r} in {types!r}")
            self._set("layer_types", tuple(types))  # hashable
        local = self.has_local_layers
        if local and not self.sliding_window:
            raise ConfigError(f"ModelConfig.layer_types has local layers; they need sliding_window >= 1 "
                              f"(got sliding_window={self.sliding_window})")
        if not local and (self.sliding_window or self.rope_local_base is not None):
            raise ConfigError(f"ModelConfig.sliding_window={self.sliding_window} and rope_local_base="
                              f"{self.rope_local_base} set the local layers, but layer_types has none "
                              f"(got layer_types={self.layer_types!r})")
        if local and not self.causal:
            raise ConfigError("ModelConfig.layer_types: local (sliding-window) layers are causal; "
                              "they need causal=True")
        if local and self.attention == "linear" and self.positions == "rope" and self.rope_on != "inputs":
            raise ConfigError("ModelConfig.layer_types: local layers keep absolute positions, so linear "
                              "global layers with rope need rope_on='inputs' (got rope_on='features', "
                              "whose state is re-based to position 0)")

    def _check_short_conv(self) -> None:
        """The short convolution of q, k, v: linear attention only (its state joins the layer's)."""
        if not self.short_conv:
            if self.short_conv_activation != "none":
                raise ConfigError(f"ModelConfig.short_conv_activation={self.short_conv_activation!r} acts "
                                  f"after a short convolution, but short_conv=0; set short_conv >= 2")
            return
        if self.attention != "linear":
            raise ConfigError(f"ModelConfig.short_conv={self.short_conv} applies to attention='linear' "
                              f"only (its state is stored beside the linear state); got "
                              f"attention={self.attention!r}")

    def _check_cache(self) -> None:
        """The sparse cache extends the hybrid: it needs one, and the recurrent form."""
        if not self.cache:
            if self.cache_rule != "recall":  # a rule with nothing to rule: say so, do not ignore it
                raise ConfigError(f"ModelConfig.cache_rule={self.cache_rule!r} chooses what a sparse cache "
                                  f"keeps, but cache=0; set cache >= 1")
            return
        if self.cache_rule == "attention" and self.window < 1:
            raise ConfigError("ModelConfig.cache_rule='attention' scores a token by the attention it gets "
                              f"while in the window; it needs window >= 1, got window={self.window}")
        if not self.hybrid:
            raise ConfigError(f"ModelConfig.cache={self.cache} keeps exact tokens beside a hybrid layer's "
                              f"window or sinks; it needs attention='linear' with window >= 1 or sinks >= 1 "
                              f"(got attention={self.attention!r}, window={self.window}, sinks={self.sinks})")
        if not self.normalize:
            raise ConfigError(f"ModelConfig.cache={self.cache} needs normalize=True: the cached, the "
                              f"window's and the linear tokens share one normaliser")
        if self.form not in CACHE_FORMS:
            raise ConfigError(f"ModelConfig.cache={self.cache} needs form in {CACHE_FORMS} (its selection "
                              f"is sequential; 'auto' runs the recurrent form), got form={self.form!r}")

    def _check_recurrence(self) -> None:
        """The gated and delta-rule recurrences (``gate``, ``update``): refuse the combinations that
        have no meaning, or whose conversion would not be exact."""
        chosen = [f"{f}={getattr(self, f)!r}" for f, default in (("gate", "none"), ("update", "add"))
                  if getattr(self, f) != default]
        if not chosen:
            return
        what = " and ".join(chosen)
        if self.attention != "linear":
            raise ConfigError(f"ModelConfig.{what} applies to attention='linear' only (softmax "
                              f"attention has no state to gate or to write by the delta rule); got "
                              f"attention={self.attention!r}")
        for f in ("window", "sinks"):
            if getattr(self, f):
                raise ConfigError(f"ModelConfig.{f}={getattr(self, f)} cannot be combined with "
                                  f"ModelConfig.{what}: the hybrid softmax/linear layer has a fixed "
                                  f"decay and an additive state only; use {f}=0")
        if self.gate != "none" and self.decay is not None:
            raise ConfigError(f"ModelConfig.decay={self.decay!r} and ModelConfig.gate={self.gate!r} are "
                              f"two decay mechanisms; use one (a fixed decay is a constant scalar gate)")
        if self.update == "delta":
            if self.normalize:
                raise ConfigError("ModelConfig.update='delta' needs normalize=False: the delta rule has "
                                  "no normaliser z (its read-out phi(q)^T S is not divided); use "
                                  "normalize=False")
            if self.decay is not None:
                raise ConfigError(f"ModelConfig.decay={self.decay!r} with update='delta': the delta rule "
                                  f"decays through its gate; use gate='scalar' (Gated DeltaNet) instead")
            if self.gate == "vector":
                raise ConfigError("ModelConfig.gate='vector' with update='delta': the delta-rule kernel "
                                  "takes one gate per head and token; use gate='scalar'")
            if self.trainable_bias:
                raise ConfigError("ModelConfig.trainable_bias with update='delta': the trainable bias is "
                                  "additive linear attention's (S, z) pair (ICLCA Fig. 1) and the delta "
                                  "rule has no z; use trainable_bias=False")
        if self.gate == "vector" and self.positions == "rope" and self.rope_on == "features":
            raise ConfigError("ModelConfig.gate='vector' with positions='rope', rope_on='features': a "
                              "per-feature decay does not commute with rotating pairs of features, so "
                              "the model is not relative and a stored state cannot be re-based; use "
                              "rope_on='inputs' or gate='scalar'")

    def _check_decay(self) -> None:
        """None, one number or one per head (list, tuple or 1-d array), each in (0, 1]; stored as a
        float or a tuple of floats (hashable)."""
        if self.decay is None:
            return
        decay = _scalar(self.decay)
        if isinstance(decay, (np.ndarray, jax.Array)) and decay.ndim == 1 and is_concrete(decay):
            decay = np.asarray(decay).tolist()
        if _is_number(decay):
            values = (float(decay),)
            self._set("decay", values[0])
        elif isinstance(decay, (list, tuple)) and all(_is_number(_scalar(g)) for g in decay):
            values = tuple(float(_scalar(g)) for g in decay)
            if len(values) != self.n_heads:
                raise ConfigError(f"ModelConfig.decay has {len(values)} values ({self.decay!r}); "
                                  f"expected one float or one per head (n_heads={self.n_heads})")
            self._set("decay", values)  # lists -> tuple, so the config stays hashable
        else:
            raise ConfigError(f"ModelConfig.decay must be None, a float or a sequence of n_heads "
                              f"({self.n_heads}) floats, got {self.decay!r}")
        if not all(0.0 < g <= 1.0 for g in values):  # NaN fails this too
            raise ConfigError(f"ModelConfig.decay values must lie in (0, 1], got {self.decay}")

    # ---------------------------------------------------------------- derived quantities
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.d_head is None else self.d_head

    @property
    def query_scale(self) -> float:
        """sqrt(d_head / query_pre_attn_scalar): the factor on the queries (1.0 by default)."""
        s = self.query_pre_attn_scalar
        return 1.0 if s is None else math.sqrt(self.head_dim / s)

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
        return self.norm in ("pre", "sandwich") if self.final_norm is None else self.final_norm

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
    def has_local_layers(self) -> bool:
        return self.layer_types is not None and "local" in self.layer_types

    @property
    def global_layers(self) -> tuple:
        """The indices of the layers that run the config's own attention: every layer, or the global
        ones when ``layer_types`` has local (sliding-window) layers."""
        types = self.layer_types or ("global",) * self.n_layers
        return tuple(l for l, kind in enumerate(types) if kind == "global")

    def layer_config(self, layer: int) -> "ModelConfig":
        """The config layer ``layer`` runs with: this one for a global layer; for a local layer the
        exact sliding-window softmax as a finite-state hybrid (no linear part, no sinks, no epsilon,
        rope on the inputs at ``rope_local_base``), every option of the global attention reset."""
        if not self.has_local_layers or self.layer_types[layer] == "global":
            return self
        return self.replace(
            attention="linear", feature_map=NO_LINEAR_PART, feature_size=0, normalize=True, decay=None,
            gate="none", update="add", window=self.sliding_window, sinks=0, cache=0, cache_rule="recall",
            attn_eps=0.0, trainable_bias=False,
            rope_on="inputs" if self.positions == "rope" else "features",
            rope_base=self.rope_base if self.rope_local_base is None else self.rope_local_base,
            layer_types=None, sliding_window=0, rope_local_base=None, short_conv=0,
            short_conv_activation="none")

    def single_layer(self, layer: int) -> "ModelConfig":
        """A one-layer model of layer ``layer`` (its ``layer_config``, with one layer and no pattern)."""
        cfg = self.layer_config(layer)
        return cfg.replace(n_layers=1, layer_types=None, sliding_window=0, rope_local_base=None)

    @property
    def keeps_offset(self) -> bool:
        """Whether a stored prompt keeps absolute positions: the query continues at the prompt's
        length (``position/offset``), because the model depends on absolute positions (local layers
        do: their windows keep positions)."""
        return self.positions == "learned" or self.hybrid or self.has_local_layers or (
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
                parts.append(f"window={self.window}/sinks={self.sinks}"
                             + (f"/cache={self.cache}" if self.cache else "")
                             + (f"/{self.cache_rule}" if self.cache_rule != "recall" else ""))
            if self.decay is not None:
                parts.append("decay=" + (f"{self.decay}" if not isinstance(self.decay, tuple)
                                         else "per-head"))
            if self.gate != "none":
                parts.append(f"gate={self.gate}")
            if self.update != "add":
                parts.append(f"update={self.update}")
            if self.short_conv:
                parts.append(f"conv={self.short_conv}"
                             + (f"/{self.short_conv_activation}" if self.short_conv_activation != "none" else ""))
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
