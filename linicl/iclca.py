"""ICLCA: exact conversion of a prompt into linear-attention bias terms (arXiv 2406.02847).

In causal linear attention a prompt acts on later tokens only through each layer's and head's state
(S = sum phi(k) v^T, z = sum phi(k)). ``convert`` runs the model once over the prompt and stores every
layer's final state, re-based for rope, in the ``"prompt_state"`` collection of an ordinary variables
dict, plus the query's first position in ``"position"`` (``offset``; it moves when the model depends
on absolute positions: learned positions, rope on the inputs, a window or sinks)::

    converted = convert(model, variables, prompt)                       # prompt int32[batch or 1, n]
    model.apply(converted, query) == model.apply(variables, concat([prompt, query], 1))[:, n:]

The same holds for the gated and delta-rule recurrences (``ModelConfig.gate``, ``update``): each
token's gate alpha_t and write strength beta_t depend on that token alone, so the prompt still reaches
later tokens only through its final state: (S, z) for a gated additive state, S alone for the delta
rule, which has no z.

Converting a converted model again with a second prompt equals converting the concatenated prompt,
because the pass over the second prompt starts from the first prompt's state. Softmax models are
refused: for them the prompt is not a finite state, and only an approximate conversion exists:
``convert_approx`` (kernel-approximated bias terms, iclca.md section 7), which on a linear model is
``convert`` itself.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct, traverse_util
from jax.experimental import checkify

from linicl import compiled, selection
from linicl._validate import check_fits, check_tokens, is_concrete
from linicl.config import ModelConfig
from linicl.errors import LiniclError, NotExactError
from linicl.interventions import capture
from linicl.kernels import prompt_kernels
from linicl.kernels.positions import apply_rope
from linicl.kernels.softmax_attention import repeat_kv
from linicl.names import (APPROX_FORMS, APPROX_KERNELS, BIAS_PARAMS, DECODE, NO_KERNEL, POSITION, POSITIONLESS_SCORES,
                          PROMPT_APPROX, PROMPT_COLLECTIONS, PROMPT_STATE, SELECTION_SCORES, SHORT_CONV_STATE,
                          block_site, layer_scope, scope_layer)
from linicl.nn.transformer import config_of, position_offset
from linicl.selection import scored_queries

Variables = Mapping[str, Any]


def require_exact(model) -> ModelConfig:
    """The model's config, or NotExactError when the ICLCA identity does not hold for it."""
    cfg = config_of(model)
    if cfg.attention != "linear":
        raise NotExactError(
            f"iclca.convert is exact only for linear attention, but this model has "
            f"attention={cfg.attention!r}. A softmax prompt cannot be stored as a finite state; use the "
            f"approximate conversion (iclca.convert_approx, kernel-approximated bias terms) instead.")
    return cfg


def _check_variables(variables) -> None:
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise LiniclError("variables must be the dict returned by model.init (with a 'params' entry), "
                          f"got {type(variables).__name__}"
                          + (f" with keys {sorted(variables)}" if isinstance(variables, Mapping) else ""))
    # A decode collection is the running state of tokens already decoded: the model would continue
    # from it, so the stored state would hold those tokens too, silently (issue 52, item 1).
    if DECODE in variables:
        raise LiniclError(f"variables hold a {DECODE!r} collection (the cache left by "
                          f"model.apply(..., mutable=[{DECODE!r}])); a conversion starts from params and "
                          f"any converted prompt only: pass {{k: v for k, v in variables.items() if k != "
                          f"{DECODE!r}}}")


def _absorb_fn(model):
    """jit(variables, prompt) -> the prompt_state and position collections after the prompt. Logits
    are never returned, so XLA drops the final norm and the unembedding."""
    def absorb(variables, prompt=None, embeds=None):
        _, state = model.apply(variables, prompt, embeds=embeds, mutable=[PROMPT_STATE, POSITION])
        return state
    return compiled.get(("iclca.absorb", model), lambda: jax.jit(absorb))


def convert(model, variables: Variables, prompt=None, *, embeds=None) -> dict:
    """Store ``prompt`` in the model's attention states: the exact ICLCA conversion.

    Args:
      model: a ``linicl.Transformer`` with ``attention="linear"``.
      variables: its variables (``model.init``), possibly already converted: the new prompt then
        follows the earlier one.
      prompt: ``int32[batch, n]``. A batch-1 prompt serves queries of any batch size.
      embeds: instead of ``prompt``, a prompt of continuous tokens ``f[batch, n, d_model]`` (the first
        block's input, as ``Transformer(embeds=...)``; e.g. in-context regression). The converted
        model then serves queries given as tokens or as embeds.
    Returns:
      A new variables dict: ``variables`` with the ``"prompt_state"`` collection holding, per layer
      ``layers_l/attn``, ``S: [batch, heads, d_phi, d_head]`` and ``z: [batch, heads, d_phi]`` (with
      a window or sinks also the buffers of ``kernels.hybrid_attention.HybridState``, keys and values
      ``[batch, kv_heads, ., d_head]``; with
      ``update="delta"`` ``S`` alone; with ``short_conv`` = K also ``conv_q``, ``conv_k``, ``conv_v``
      ``[batch, K - 1, heads or kv_heads, d_head]``, the convolution's last inputs), and
      ``"position"`` holding the query's first position ``offset`` (``ModelConfig.keeps_offset``:
      the prompt's end; 0 otherwise).
    Raises:
      NotExactError: softmax model. LiniclError: bad prompt or variables, or a non-finite prompt state
        (checked when the state is concrete; the message names the layers and the cause).
      SequenceTooLongError: learned positions and offset + n > max_len (checked when the offset is
        known; under ``jax.jit``, where variables may be traced, the positions past max_len give NaN).
    """
    cfg = require_exact(model)
    _check_variables(variables)
    prompt, embeds = _check_prompt(cfg, prompt, embeds)
    n = (prompt if embeds is None else embeds).shape[1]
    if cfg.positions == "learned":
        check_fits("prompt", position_offset(variables), n, cfg.max_len, "learned positions")
    state = _absorb_fn(model)(dict(variables), prompt, embeds)
    _check_finite_state(state[PROMPT_STATE], variables, embeds)
    return {**variables, **state}


def _check_prompt(cfg: ModelConfig, prompt, embeds):
    """``(prompt, embeds)`` as arrays, exactly one of them given and well formed."""
    if (prompt is None) == (embeds is None):
        raise LiniclError("convert: pass exactly one of prompt (int32[batch, n]) or embeds "
                          f"(float[batch, n, {cfg.d_model}])")
    if prompt is not None:
        return jnp.asarray(check_tokens("prompt", prompt, cfg.vocab_size)), None
    shape, dtype = getattr(embeds, "shape", None), getattr(embeds, "dtype", None)
    if shape is None or len(shape) != 3 or shape[-1] != cfg.d_model or not jnp.issubdtype(dtype, jnp.floating):
        raise LiniclError(f"embeds must be float[batch, n, {cfg.d_model}], got "
                          f"{type(embeds).__name__ if shape is None else f'{dtype}{tuple(shape)}'}")
    if shape[0] < 1 or shape[1] < 1:
        raise LiniclError(f"embeds must have at least one row and one token, got shape {tuple(shape)}")
    return None, jnp.asarray(embeds)


def _nonfinite_leaves(tree) -> list[str]:
    """Paths of the concrete leaves of ``tree`` holding NaN or inf (traced leaves are skipped)."""
    leaves = [(jax.tree_util.keystr(path), x) for path, x in jax.tree_util.tree_leaves_with_path(tree)
              if is_concrete(x) and jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return []
    finite = np.asarray(jnp.stack([jnp.all(jnp.isfinite(x)) for _, x in leaves]))  # one device sync
    return [name for (name, _), ok in zip(leaves, finite) if not ok]


def _check_finite_state(prompt_state, variables, embeds=None) -> None:
    """Refuse to return a NaN/inf prompt state: every later query would be NaN, far from the cause.

    Under ``jax.jit`` (traced state) the check is skipped and a NaN state shows as NaN outputs."""
    bad = _nonfinite_leaves(prompt_state)
    if not bad:
        return
    bad_params = _nonfinite_leaves(variables.get("params", {}))
    if embeds is not None and _nonfinite_leaves(embeds):
        cause = "embeds hold NaN or inf"
    elif bad_params:
        cause = f"variables['params'] hold NaN or inf at {', '.join(bad_params[:4])}"
    else:
        # Seen with jaxlib 0.10 on CPU: a float64 YNNPACK reduce fusion returned an all-NaN tensor for
        # about 1 in 5 fresh compilations of a batch-256 prompt (README, known issues).
        cause = ("the parameters and prompt are finite, so the compiled program misbehaved; on CPU this is a "
                 "known XLA bug, avoided with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot "
                 "set before jax is imported (README, known issues)")
    raise LiniclError(f"convert: the prompt state is not finite at {', '.join(bad[:4])}"
                      f"{' ...' if len(bad) > 4 else ''}: {cause}")


def to_trainable(model, converted: Variables):
    """Move a converted prompt's state into trainable parameters.

    Returns ``(model', variables')``: the same model with ``trainable_bias=True`` and variables whose
    ``params`` hold the state as ``S_bias``/``z_bias`` (added to any bias already there), so that the
    stored prompt can be fine-tuned like any weight (e.g. as the initialisation of a PrefixMemory-style
    bias). ``model'.apply(variables', query) == model.apply(converted, query)``. The state must have
    batch 1; a learned-positions offset stays in the ``"position"`` collection (it is not a weight).
    """
    cfg = require_exact(model)
    if cfg.hybrid:
        raise LiniclError(
            f"to_trainable cannot move a window/sinks state into params (window={cfg.window}, "
            f"sinks={cfg.sinks}): the window's and the sinks' keys and values are exact softmax "
            f"entries with positions, not a bias of the linear state; keep the converted variables")
    if cfg.short_conv:
        raise LiniclError(f"to_trainable cannot move a short convolution's state into params "
                          f"(short_conv={cfg.short_conv}): its last K - 1 inputs of q, k, v feed the next "
                          f"tokens' convolutions and are not a bias of the linear state; keep the "
                          f"converted variables")
    if cfg.update == "delta":
        raise LiniclError("to_trainable cannot move a delta-rule state into params: the trainable bias "
                          "is additive linear attention's (S, z) (ModelConfig.trainable_bias is refused "
                          "with update='delta'); keep the converted variables")
    terms = bias_terms(converted)
    if terms[0][0].shape[0] != 1:
        raise LiniclError(f"to_trainable needs a state converted from a batch-1 prompt, got batch "
                          f"{terms[0][0].shape[0]}")
    params = dict(converted["params"])  # each touched layer below is copied, not mutated
    for layer, (S, z) in enumerate(terms):
        scope = layer_scope(layer)
        attn = dict(params[scope]["attn"])
        attn["S_bias"] = attn.get("S_bias", 0) + S[0]
        attn["z_bias"] = attn.get("z_bias", 0) + z[0]
        params[scope] = {**params[scope], "attn": attn}
    trainable = type(model)(cfg.replace(trainable_bias=True))
    rest = {k: v for k, v in converted.items() if k not in ("params", PROMPT_STATE)}
    return trainable, {**rest, "params": params}


def nonnegative_z_bias(params):
    """``params`` with every trainable ``z_bias`` clipped to >= 0: the projection step of projected
    gradient descent on the trainable bias terms (apply it after each optimiser update).

    A free ``z_bias`` can drive a normaliser phi(q).z to zero or below (the ICLCA Fig. 1 training
    collapses that way; experiments/bias_training.py). With non-negative feature maps (elu+1, relu,
    ...) ``z_bias >= 0`` keeps every bias contribution to the normaliser >= 0. Other leaves are
    returned unchanged (the same arrays)."""
    def clip(path, leaf):
        last = path[-1]
        return jnp.maximum(leaf, 0) if getattr(last, "key", None) == "z_bias" else leaf
    return jax.tree_util.tree_map_with_path(clip, params)


def zero_z_bias(params):
    """``params`` with every trainable ``z_bias`` set to zero: the projection that trains B alone (the
    normalisers stay the no-bias model's, the bias acts on the numerator only). Other leaves are
    returned unchanged (the same arrays)."""
    def zero(path, leaf):
        return jnp.zeros_like(leaf) if getattr(path[-1], "key", None) == "z_bias" else leaf
    return jax.tree_util.tree_map_with_path(zero, params)


def without_bias(params) -> dict:
    """``params`` (a nested dict) without the trainable bias terms (``names.BIAS_PARAMS``: ``S_bias``,
    ``z_bias``): the parameters of the same model with ``trainable_bias=False``, sharing every other
    leaf (the same arrays)."""
    if not isinstance(params, Mapping):
        raise LiniclError(f"without_bias: params must be a nested dict of parameters, got {type(params).__name__}")
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k[-1] not in BIAS_PARAMS})


def strip(variables: Variables) -> dict:
    """The variables without any stored prompt (the no-prompt model)."""
    return {k: v for k, v in variables.items() if k not in PROMPT_COLLECTIONS}


def bias_terms(variables: Variables) -> list[tuple[jax.Array, jax.Array]]:
    """The stored (S, z) of every layer, in layer order: ``[(S[b, H, d_phi, d_v], z[b, H, d_phi]), ...]``."""
    if PROMPT_STATE not in variables:
        raise LiniclError(f"variables hold no converted prompt (no '{PROMPT_STATE}' collection); call convert")
    layers = variables[PROMPT_STATE]
    scopes = sorted((k for k in layers if scope_layer(k) is not None), key=scope_layer)
    extra = sorted({name for s in scopes for name in layers[s]["attn"]} - {"S", "z"})
    if extra:
        raise LiniclError(
            f"bias_terms returns (S, z) only, but this prompt state also holds {extra} (window/sinks buffers "
            f"or a short convolution's state, {', '.join(SHORT_CONV_STATE)}); read variables['{PROMPT_STATE}'] "
            f"directly")
    if any("z" not in layers[s]["attn"] for s in scopes):
        raise LiniclError(
            "bias_terms returns (S, z), but this prompt state holds S only (a delta-rule model, "
            f"ModelConfig.update='delta', has no z); read variables['{PROMPT_STATE}'] directly")
    return [(layers[s]["attn"]["S"], layers[s]["attn"]["z"]) for s in scopes]


def state_floats(cfg: ModelConfig) -> int:
    """Floats stored per prompt (batch 1), independent of the prompt length, summed over the layers
    (a local layer, ``ModelConfig.layer_config``, is a window-only hybrid): the sizes of the arrays
    ``convert`` stores. Per layer, with H query heads, G = kv_heads key/value heads and W' = window - 1:
    H * (d_phi * d_v + d_phi) (gated or not; the delta rule keeps no z: H * d_phi * d_v), plus, with a
    window or sinks, per buffered and per cached token two feature vectors per query head
    (H * (W' + cache) * 2 d_phi) and its key and value per key/value head (G * (W' + cache) * (d + d_v)),
    per sink its key and value per key/value head (G * sinks * (d + d_v)), and with
    ``cache_rule="attention"`` a score per buffered and cached token and key/value head. With a short
    convolution of K taps, (K - 1) * (heads + 2 kv_heads) * d_head (its last inputs of q, k, v). The
    buffers' int32 positions are not counted."""
    return sum(_layer_state_floats(cfg.layer_config(layer)) for layer in range(cfg.n_layers))


def _layer_state_floats(cfg: ModelConfig) -> int:
    F, d, H, G = cfg.feature_dim, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    floats = H * (F * d + (0 if cfg.update == "delta" else F))
    if cfg.hybrid:
        tokens = max(cfg.window - 1, 0) + cfg.cache  # buffered and cached: features, key and value
        floats += H * tokens * 2 * F + G * (tokens + cfg.sinks) * (d + d)
        if cfg.cache and cfg.cache_rule == "attention":
            floats += G * tokens
    conv = max(cfg.short_conv - 1, 0) * (cfg.n_heads + 2 * cfg.kv_heads) * d
    return floats + conv


# ------------------------------------------------------------------------------ approximate (softmax)
@struct.dataclass
class PromptApprox:
    """A softmax layer's kernel-approximated prompt (``variables["prompt_approx"][layer]["attn"]["approx"]``).

    Attributes:
      B: ``f[batch or 1, heads, F, d_head]``, b: ``f[batch or 1, heads, F]``: the prompt's bias terms;
        None with ``kernel="none"`` (the prompt tokens not kept exact are dropped).
      W: positive-random-feature projections ``f[heads, m, d_head]`` (kernel ``"prf"``), else None.
      sink_k, sink_v: ``f[batch or 1, kv_heads, s, d_head]`` prompt keys (rotated) and values kept
        exact, with their positions ``sink_pos``: ``int32[s]`` when every head keeps the same tokens
        (sinks and window), or ``int32[1, kv_heads, s]`` for a selection (``keep``): each KV head's
        own tokens, padded to the longest head with -1 (a slot no query sees); None when no token is
        kept.
      phi_W: ``f[heads, d_head, m]``, phi_b: ``f[heads, m]``: the query map phi_q of the
        ``"learned"`` kernel (F = 2m), else None.
      g: ``f[heads]``, the weight g_h of the exact keys in the hybrid form (kernel ``"learned"``);
        None for the shared and mix forms.
      kernel: ``"taylor2"``, ``"prf"``, ``"elu+1"`` or ``"learned"`` (static).
      lam: None for the shared normaliser (or the hybrid form), else the fixed input weight of the
        lambda-mix (static).
    """

    B: jax.Array
    b: jax.Array
    W: Optional[jax.Array] = None
    sink_k: Optional[jax.Array] = None
    sink_v: Optional[jax.Array] = None
    sink_pos: Optional[jax.Array] = None
    phi_W: Optional[jax.Array] = None
    phi_b: Optional[jax.Array] = None
    g: Optional[jax.Array] = None
    kernel: str = struct.field(pytree_node=False, default="taylor2")
    lam: Optional[float] = struct.field(pytree_node=False, default=None)


def _prompt_kv_fn(model):
    """jit(variables, prompt) -> ``(kv, local)``: ``kv[l] = (k, v)``, the prompt's keys and values of
    each global layer l as the decode cache holds them (``[batch, kv_heads, n, d_head]``, keys rotated
    to positions 0..n-1: exact, by causality), and ``local``, the ``prompt_state`` collection the
    prompt leaves in the local layers (their exact windows; empty without local layers)."""
    def run(variables, prompt):
        _, state = model.apply(variables, prompt, mutable=[DECODE, PROMPT_STATE])
        n = prompt.shape[1]
        kv = {}
        for l in config_of(model).global_layers:
            a = state[DECODE][layer_scope(l)]["attn"]
            kv[l] = (a["cached_k"][:, :, :n], a["cached_v"][:, :, :n])
        return kv, state.get(PROMPT_STATE, {})
    return compiled.get(("iclca.prompt_kv", model), lambda: jax.jit(run))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_approx_args(cfg, kernel, form, lam, sinks, window, n, fit_inputs, n_features, ridge) -> None:
    if kernel not in APPROX_KERNELS:
        raise LiniclError(f"kernel must be one of {APPROX_KERNELS}, got {kernel!r}")
    # n_features = 0 would store an empty (B, b): the prompt silently dropped.
    if not _is_int(n_features) or n_features < 1:
        raise LiniclError(f"n_features must be a positive int (the number of random features of the "
                          f"'prf' kernel), got {n_features!r}")
    # A negative ridge can make the regularised normal equations indefinite (a wrong fit, not an error).
    if not (_is_int(ridge) or isinstance(ridge, (float, np.floating))) or not (math.isfinite(ridge) and ridge >= 0):
        raise LiniclError(f"ridge must be a finite number >= 0 (the fit's regularisation, relative to "
                          f"the mean diagonal), got {ridge!r}")
    if form not in APPROX_FORMS:
        raise LiniclError(f"form must be one of {APPROX_FORMS}, got {form!r}")
    # The learned maps were trained next to g_h e^{s - c_t}; the fixed kernels approximate e^s.
    if (kernel == "learned") != (form == "hybrid"):
        raise LiniclError(f"form='hybrid' goes with kernel='learned' and only with it, got "
                          f"kernel={kernel!r}, form={form!r}")
    if kernel == "learned" and fit_inputs is not None:
        raise LiniclError("fit_inputs fits (B, b) for the shared or mix form; kernel='learned' keeps "
                          "the student's sums")
    if form == "mix" and not 0.0 <= lam <= 1.0:
        raise LiniclError(f"lam must lie in [0, 1] (the input's weight in the mix), got {lam}")
    if not _is_int(sinks) or not 0 <= sinks <= n:
        raise LiniclError(f"sinks must be an int in [0, {n}] (first prompt tokens kept exact), got {sinks!r}")
    if not _is_int(window) or not 0 <= window <= n - sinks:
        raise LiniclError(f"window must be an int in [0, {n - sinks}] (last prompt tokens kept exact; the "
                          f"prompt has {n} tokens and sinks={sinks}), got {window!r}")
    if kernel == NO_KERNEL and (form == "mix" or fit_inputs is not None):
        raise LiniclError("kernel='none' stores no kernel terms: form='mix' (their own normaliser) and "
                          "fit_inputs (a fit of them) do not apply")
    if form == "mix" and sinks + window == n:
        raise LiniclError("form='mix' needs at least one linearised prompt token (sinks + window < prompt length)")
    if not cfg.causal:
        raise LiniclError("convert_approx needs a causal model")


_MAPS = ("phi_q_W", "phi_q_b", "phi_k_W", "phi_k_b")  # a linearized student's maps per layer


def _map_error(what: str) -> LiniclError:
    return LiniclError(f"maps {what}; pass the variables (or params) of this model's linearized student "
                       f"(linicl.linearize.student_variables, train_maps or load_maps)")


def _learned_maps(cfg: ModelConfig, maps) -> dict:
    """Per global layer l (``cfg.global_layers``) ``{phi_q_W, phi_q_b, phi_k_W, phi_k_b: the maps, g:
    f[heads]}``, checked against ``cfg``. g_h = sigmoid(gate) of the student's layer; a student without
    an exact part (window 0, sinks 0) has no gate, and then g_h = 1: the teacher's own e^{s - c_t}.
    A local layer needs no maps (its window is kept exact)."""
    if not isinstance(maps, Mapping):
        raise _map_error(f"must be a dict, got {type(maps).__name__}")
    params = maps.get("params", maps)
    extra = sorted(s for s in params if scope_layer(s) is not None and scope_layer(s) >= cfg.n_layers)
    if extra:
        raise _map_error(f"hold {extra} but the model has {cfg.n_layers} layers")
    H, d, dt = cfg.n_heads, cfg.head_dim, cfg.jnp_dtype
    out = {}
    for l in cfg.global_layers:
        scope = layer_scope(l)
        attn = params.get(scope, {}).get("attn", {})
        missing = [name for name in _MAPS if name not in attn]
        if missing:
            raise _map_error(f"lack {scope}/attn/{{{', '.join(missing)}}}")
        m = attn["phi_q_W"].shape[-1]
        want = {"phi_q_W": (H, d, m), "phi_k_W": (H, d, m), "phi_q_b": (H, m), "phi_k_b": (H, m)}
        if "gate" in attn:
            want["gate"] = (H,)
        for name, shape in want.items():
            if tuple(attn[name].shape) != shape:
                raise _map_error(f"have {scope}/attn/{name} of shape {tuple(attn[name].shape)}; this model "
                                 f"(n_heads={H}, head_dim={d}) needs {shape}")
        layer = {name: jnp.asarray(attn[name], dt) for name in _MAPS}
        layer["g"] = jax.nn.sigmoid(jnp.asarray(attn["gate"], dt)) if "gate" in attn else jnp.ones((H,), dt)
        out[l] = layer
    return out


def _check_maps_use(cfg: ModelConfig, kernel: str, maps) -> None:
    if kernel != "learned":
        raise LiniclError(f"maps are the 'learned' kernel's; got them with kernel={kernel!r}")
    if maps is None:
        raise LiniclError("kernel='learned' needs maps= (the linearized student's variables or params)")
    if cfg.attention != "softmax":
        raise LiniclError(f"kernel='learned' puts a student's maps into its softmax teacher, but this model "
                          f"has attention={cfg.attention!r} (a linear model converts exactly: iclca.convert)")


def _kept_defaults(sinks, window, keep) -> tuple:
    """``(sinks, window)``: as given, else 0 and 0, or 4 sinks and a 16-token window with ``keep``
    (StreamingLLM's sinks; the tokens every later query reads first)."""
    return (sinks if sinks is not None else (0 if keep is None else 4),
            window if window is not None else (0 if keep is None else 16))


def _kernel_floats(cfg: ModelConfig, kernel: str, learned, Ws) -> int:
    """Floats of the kernel terms (B, b) over the global layers: heads * (F * d_head + F)."""
    if kernel == NO_KERNEL:
        return 0
    x = jax.ShapeDtypeStruct((1, cfg.n_heads, 1, cfg.head_dim), cfg.jnp_dtype)
    total = 0
    for l in cfg.global_layers:
        maps = (learned[l]["phi_k_W"], learned[l]["phi_k_b"]) if learned is not None else (Ws[l],)
        F = jax.eval_shape(lambda x: prompt_kernels.features(kernel, x, *maps), x).shape[-1]
        total += cfg.n_heads * (F * cfg.head_dim + F)
    return total


def _select(model, variables, prompt, keep, score, allocation, sinks, window, instruction, chunk, seed,
            kernel, fit_inputs, form, learned, Ws, scores, size):
    """``(kept bool[layers, kv_heads, n], index int32[layers, kv_heads, m], valid bool[...])``: the
    selection of ``convert_approx(keep=...)``."""
    cfg = config_of(model)
    if prompt.shape[0] != 1:
        raise LiniclError(f"keep selects per prompt: pass a batch-1 prompt, got batch {prompt.shape[0]}")
    if not is_concrete(prompt):
        raise LiniclError("keep selects with data-dependent sizes: call convert_approx eagerly, not under jit")
    if fit_inputs is not None:
        raise LiniclError("keep and fit_inputs do not combine: the fit targets a fixed set of linearised tokens")
    if form == "mix" and kernel == NO_KERNEL:
        raise LiniclError("form='mix' reads the kernel terms under their own normaliser; kernel='none' has none")
    if score not in SELECTION_SCORES:
        raise LiniclError(f"score must be one of {SELECTION_SCORES}, got {score!r}")
    allocation = selection.default_allocation(score) if allocation is None else allocation
    if allocation in ("global", "heads") and score in POSITIONLESS_SCORES:
        raise LiniclError(f"allocation={allocation!r} ranks scores across heads, but score={score!r} says nothing "
                          f"about which head needs more; use allocation='uniform'")
    if not _is_int(chunk) or chunk < 1:
        raise LiniclError(f"chunk must be a positive int (tokens the selection reads at once), got {chunk!r}")
    n = prompt.shape[1]
    tokens = selection.token_budget(cfg, n, keep, extra_floats=_kernel_floats(cfg, kernel, learned, Ws))
    want = (len(cfg.global_layers), cfg.kv_heads, n)
    if scores is None:
        scores = selection.score_prompt(model, variables, np.asarray(prompt), score, chunk=chunk, sinks=sinks,
                                        instruction=instruction, seed=seed)
    elif np.shape(scores) != want or not np.all(np.isfinite(scores)):
        raise LiniclError(f"scores must be finite f[{want[0]}, {want[1]}, {want[2]}] (global layers, KV heads, "
                          f"prompt tokens: selection.score_prompt of this prompt), got shape {np.shape(scores)}")
    kept = selection.allocate(scores, tokens, sinks=sinks, window=window, allocation=allocation)
    return (kept,) + selection.kept_entries(kept, size)


def _kept_entries(k, v, index, valid, i: int) -> tuple:
    """``(sink_k, sink_v, sink_pos)`` of global layer ``i``'s selection: each KV head's kept keys and
    values ``f[1, kv_heads, m, d]`` and positions ``int32[1, kv_heads, m]`` (-1: padding)."""
    idx = jnp.asarray(index[i])[None, :, :, None]
    pos = jnp.asarray(np.where(valid[i], index[i], -1), jnp.int32)[None]
    return jnp.take_along_axis(k, idx, axis=2), jnp.take_along_axis(v, idx, axis=2), pos


def _dropped_terms(cfg: ModelConfig, kernel: str, k, v, kept, key_map) -> tuple:
    """The kernel terms (B, b) of the prompt tokens a head does not keep (None, None for "none")."""
    if kernel == NO_KERNEL:
        return None, None
    weights = jnp.asarray(repeat_kv(jnp.asarray(~kept, k.dtype)[None, :, :, None], cfg.n_heads)[..., 0])
    return prompt_kernels.prompt_state(kernel, repeat_kv(k, cfg.n_heads), repeat_kv(v, cfg.n_heads), *key_map,
                                       weights=weights)


def convert_approx(model, variables: Variables, prompt, kernel: str = "taylor2", *,
                   form: Optional[str] = None, lam: float = 0.5, sinks: Optional[int] = None,
                   window: Optional[int] = None, n_features: int = 256,
                   seed: int = 0, fit_inputs=None, ridge: float = 1e-6,
                   maps: Optional[Variables] = None, keep=None, score: str = "reconstruction",
                   allocation: Optional[str] = None, instruction=None, chunk: int = 512,
                   scores=None, size: Optional[int] = None) -> dict:
    """Store ``prompt`` as kernel-approximated bias terms in a softmax model (iclca.md, section 7).

    The prompt's keys and values are the exact ones of the prompted model (its decode cache); only
    e^{q.k/sqrt d} between a later query and a prompt key is replaced by phi(q).phi(k), so each layer
    and head keeps B = sum phi(k_i) v_i^T and b = sum phi(k_i). The query then sits at positions
    n, n+1, ... (the offset is stored, for learned positions and rope alike). A model with local
    (sliding-window) layers (``ModelConfig.layer_types``, Gemma 3) approximates only its global layers;
    each local layer is a finite state and stores its exact window (the prompt's last
    ``sliding_window - 1`` keys and values), as ``iclca.convert`` stores it.

    Args:
      model: a ``linicl.Transformer``.
      variables: its variables (with no prompt stored yet).
      prompt: ``int32[batch or 1, n]``.
      kernel: ``"taylor2"`` (default), ``"prf"`` (``n_features`` positive random features drawn from
        ``seed``), ``"elu+1"``, or ``"learned"`` (a linearized student's trained maps, ``maps``).
      form: ``"shared"`` (prompt and input terms share one softmax normaliser) or ``"mix"``
        (``lam`` * softmax over the input + (1 - lam) * the prompt's kernel attention); the default
        None means ``"shared"``, or ``"hybrid"`` for ``kernel="learned"`` (its only form): LoLCATs'
        hybrid with the prompt as the linear part. A query at absolute position t, head h, reads
        ``[sum_E g_h e^{s_i - c_t} v_i + phi_q(q_t)^T B] / [sum_E g_h e^{s_i - c_t} + phi_q(q_t).b]``,
        E being the visible exact keys (the query's own tokens, the sinks and the window), c_t =
        max_E s_i and g_h = sigmoid(gate) of the student's layer (1 when the student has no gate:
        window 0, sinks 0). With the student's ``sinks`` and ``window - 1`` (its window at the first
        query token holds that token and the prompt's last window - 1), the first query token reads
        the student's layer on the teacher's q, k, v; later query tokens keep that prompt tail exact
        where the student's window would have moved past it.
      maps: for ``kernel="learned"`` only: the linearized student's variables or params, with
        ``layers_l/attn/{phi_q_W, phi_q_b, phi_k_W, phi_k_b: [heads, d_head, m] / [heads, m]}`` for
        every global layer (and ``gate: [heads]`` when the student has an exact part). The maps act on
        rotated q, k (``rope_on="inputs"``, the student's default).
      sinks: the first ``sinks`` prompt tokens stay exact key/value entries of the softmax (attention
        sinks); only the rest is linearised. Default 0, or 4 with ``keep``.
      window: the last ``window`` prompt tokens stay exact too (sinks + window <= n). With
        ``sinks + window = n`` the conversion is exact. Default 0, or 16 with ``keep``.
      keep: selection (``linicl.selection``): besides the sinks and the window, each global layer's
        **KV heads** keep exact prompt keys and values chosen by ``score`` from the whole prompt (never
        from a later query), at their positions. A float in (0, 1]: the share of the prompt's full KV
        floats (global layers, ``2 * head_dim`` a token and KV head) that everything stored may hold,
        kernel terms included; an int: tokens per KV head. ``iclca.stored_floats`` counts the result.
        Needs a batch-1 prompt; eager only (the kept sets have data-dependent sizes).
      score: what ranks the keys (``names.SELECTION_SCORES``): ``"reconstruction"`` (KVzip, arXiv
        2505.23416), ``"expected"`` (Expected Attention, arXiv 2510.00636), ``"h2o"``, ``"snapkv"``
        (a question-free observation window: the prompt's last 64 tokens), ``"recent"`` (StreamingLLM:
        sinks + the most recent tokens), ``"random"`` (drawn from ``seed``).
      allocation: ``"global"`` (top scores over all layers and heads: heads get unequal shares; the
        default for the attention scores), ``"heads"`` (whole heads, highest mean score first) or
        ``"uniform"`` (the same number per head; the default and only choice for "recent" and
        "random").
      instruction: "reconstruction" only: token ids said before each re-read of the prompt (e.g. the
        ids of "\n\nRepeat the previous context exactly."); default none.
      chunk: tokens the selection passes read at once (bounds their memory; the scores do not depend
        on it).
      scores: ``f[len(cfg.global_layers), kv_heads, n]``, scores already computed for this prompt
        (``selection.score_prompt``: one pass serves several budgets); ``score`` then only names them.
      size: with ``keep``: pad each KV head's kept entries to this many slots' bucket
        (``selection.kept_entries``; e.g. the prompt's length, so that conversions of one prompt length
        share one compiled query); default the longest head's count.
      fit_inputs: optional ``int32[m, t]`` sample inputs. Then (B, b) are not sums over the prompt but
        the least-squares fit, per layer and head, of the prompt's exact numerator and partition at
        the queries the prompted model forms on these inputs (rows weighted by 1 / the query's total
        softmax mass, so the fit targets the attention mixture), with ridge ``ridge`` (>= 0) * mean
        diagonal. Needs a batch-1 prompt. A singular fit (possible with ``ridge=0``) raises
        LiniclError; under ``jit`` it gives non-finite bias terms (NaN logits) and a ``checkify`` error.
      n_features: a positive int (used by ``"prf"``).
    Returns:
      Variables with the ``"prompt_approx"`` collection holding, per global layer, a ``PromptApprox``
      (and ``"prompt_state"`` the local layers' exact windows, when the model has local layers), and
      ``"position"`` the query's position ``offset = n``. On a linear-attention model: ``convert(model, variables, prompt)``,
      which is exact (the kernel arguments do not apply; ``kernel="learned"`` is refused there).
      Works under ``jax.jit`` (variables and prompt may be traced; the offset is an array).
    """
    cfg = config_of(model)
    if kernel == "learned" or maps is not None:
        _check_maps_use(cfg, kernel, maps)
    if cfg.attention == "linear":
        return convert(model, variables, prompt)
    _check_variables(variables)
    if any(c in variables for c in PROMPT_COLLECTIONS):
        raise LiniclError("variables already hold a converted prompt; convert the whole prompt at once "
                          "(iclca.strip(variables) gives the plain model)")
    prompt = jnp.asarray(check_tokens("prompt", prompt, cfg.vocab_size))
    n = prompt.shape[1]
    form = ("hybrid" if kernel == "learned" else "shared") if form is None else form
    sinks, window = _kept_defaults(sinks, window, keep)
    _check_approx_args(cfg, kernel, form, lam, sinks, window, n, fit_inputs, n_features, ridge)
    learned = _learned_maps(cfg, maps) if kernel == "learned" else None
    check_fits("prompt", 0, n + 1, cfg.max_len, "the model's positions (prompt plus one query token)")
    key = jax.random.PRNGKey(seed)
    Ws = {l: prompt_kernels.prf_projection(jax.random.fold_in(key, l), cfg.n_heads, n_features, cfg.head_dim,
                                           cfg.jnp_dtype) if kernel == "prf" else None for l in cfg.global_layers}
    kept = None
    if size is not None and keep is None:
        raise LiniclError("size pads a selection's kept entries: pass it with keep")
    if keep is not None:
        kept = _select(model, variables, prompt, keep, score, allocation, sinks, window, instruction, chunk, seed,
                       kernel, fit_inputs, form, learned, Ws, scores, size)
    kv, local = _prompt_kv_fn(model)(dict(variables), prompt)
    layers = {}
    lin = slice(sinks, n - window)  # without keep: the linearised prompt tokens; the rest stay exact
    exact = np.r_[0:sinks, n - window:n].astype(np.int32)
    fit = _fit_targets(model, variables, prompt, fit_inputs, kernel, lin, n_features, seed) \
        if fit_inputs is not None else None
    for i, (l, (k, v)) in enumerate(kv.items()):
        W = Ws[l]
        key_map = (learned[l]["phi_k_W"], learned[l]["phi_k_b"]) if learned is not None else (W,)
        if kept is not None:
            entries = _kept_entries(k, v, *kept[1:], i)
            B, b = _dropped_terms(cfg, kernel, k, v, kept[0][i], key_map)
        else:
            entries = (k[:, :, exact], v[:, :, exact], jnp.asarray(exact)) if exact.size else (None,) * 3
            # GQA: keys and values are repeated to the query heads first (the student's key map is per
            # query head); the cache's keys are rotated to their absolute positions 0..n-1.
            k_lin, v_lin = repeat_kv(k[:, :, lin], cfg.n_heads), repeat_kv(v[:, :, lin], cfg.n_heads)
            if kernel == NO_KERNEL:
                B = b = None
            elif fit is None:
                B, b = prompt_kernels.prompt_state(kernel, k_lin, v_lin, *key_map)
            else:
                B, b = _solve(*fit[l], ridge, k.dtype, l)
        query_map = ({} if learned is None else
                     dict(phi_W=learned[l]["phi_q_W"], phi_b=learned[l]["phi_q_b"], g=learned[l]["g"]))
        layers[layer_scope(l)] = {"attn": {"approx": PromptApprox(
            B=B, b=b, W=W, sink_k=entries[0], sink_v=entries[1], sink_pos=entries[2], kernel=kernel,
            lam=float(lam) if form == "mix" else None, **query_map)}}
    exact_windows = {PROMPT_STATE: local} if local else {}
    return {**variables, PROMPT_APPROX: layers, **exact_windows,
            POSITION: {"offset": jnp.asarray(n, jnp.int32)}}


def keep_only(converted: Variables, kept, *, size: Optional[int] = None) -> dict:
    """A whole prompt kept exact, cut down to a selection: ``converted`` from ``convert_approx(model,
    variables, prompt, "none", sinks=n, window=0)`` (every prompt token exact in every head), ``kept:
    bool[len(cfg.global_layers), kv_heads, n]`` (``selection.allocate``). Returns what
    ``convert_approx(..., kernel="none", keep=...)`` stores for that kept set, without running the
    model again: one conversion of a prompt serves every score and budget. ``size``: pad every head's
    entries to this many slots' bucket (``selection.kept_entries``; e.g. the prompt's length, so that
    every cut of one prompt length shares one compiled query); default the longest head's."""
    layers = converted.get(PROMPT_APPROX) if isinstance(converted, Mapping) else None
    if not layers:
        raise LiniclError("keep_only needs convert_approx's variables of the whole prompt kept exact")
    scopes = sorted(layers, key=scope_layer)
    first = layers[scopes[0]]["attn"]["approx"]
    n = 0 if first.sink_pos is None else first.sink_pos.shape[-1]
    whole = all(a.B is None and a.sink_pos is not None and a.sink_pos.ndim == 1 and a.sink_k.shape[0] == 1
                and np.array_equal(np.asarray(a.sink_pos), np.arange(n))
                for a in (layers[s]["attn"]["approx"] for s in scopes))
    if not whole:
        raise LiniclError("keep_only needs a batch-1 prompt converted whole and exact: convert_approx(model, "
                          "variables, prompt, 'none', sinks=n, window=0) with n the prompt's length")
    kept = np.asarray(kept)
    want = (len(scopes), first.sink_k.shape[1], n)
    if kept.shape != want or kept.dtype != bool:
        raise LiniclError(f"kept must be bool[{want[0]}, {want[1]}, {want[2]}] (global layers, KV heads, prompt "
                          f"tokens), got {kept.dtype}{list(kept.shape)}")
    index, valid = selection.kept_entries(kept, size)
    out = {}
    for i, scope in enumerate(scopes):
        a = layers[scope]["attn"]["approx"]
        k, v, pos = _kept_entries(a.sink_k, a.sink_v, index, valid, i)
        out[scope] = {"attn": {"approx": a.replace(sink_k=k, sink_v=v, sink_pos=pos)}}
    return {**converted, PROMPT_APPROX: out}


def stored_floats(converted: Variables) -> dict:
    """Floats a ``convert_approx`` prompt stores, per prompt row: ``{"kept": exact keys and values of
    the global layers (a selection's padding not counted: each KV head's own entries), "kernel": the
    kernel terms B and b, "local": the local layers' exact windows (``prompt_state``, as stored)}``.
    Positions (int32) are not counted."""
    layers = converted.get(PROMPT_APPROX) if isinstance(converted, Mapping) else None
    if not layers:
        raise LiniclError("converted holds no approximated prompt (the variables of iclca.convert_approx)")
    kept = kernel = 0
    for layer in layers.values():
        a = layer["attn"]["approx"]
        if a.sink_k is not None:
            rows, d = a.sink_k.shape[0], a.sink_k.shape[-1] + a.sink_v.shape[-1]
            slots = (int(np.sum(np.asarray(a.sink_pos) >= 0)) if a.sink_pos.ndim == 3
                     else a.sink_pos.shape[0] * a.sink_k.shape[1])
            kept += slots * d * (rows if a.sink_pos.ndim == 1 else 1) // rows
        if a.B is not None:
            kernel += (a.B.size + a.b.size) // a.B.shape[0]
    local = sum(x.size // x.shape[0] for x in jax.tree_util.tree_leaves(converted.get(PROMPT_STATE, {}))
                if jnp.issubdtype(x.dtype, jnp.inexact))
    return {"kept": kept, "kernel": kernel, "local": local}


def drop_approx_terms(converted: Variables) -> dict:
    """``convert_approx``'s variables with every layer's kernel terms B, b set to 0: the query then
    reads only the prompt tokens kept exact (``sinks``, ``window``) at their positions. The control
    that says what the kernel adds: a kernel that keeps nothing scores like this."""
    layers = converted.get(PROMPT_APPROX) if isinstance(converted, Mapping) else None
    if not layers:
        raise LiniclError("converted holds no approximated prompt (the variables of iclca.convert_approx)")
    if any(layer["attn"]["approx"].B is None for layer in layers.values()):
        raise LiniclError("converted holds no kernel terms (kernel='none'): there is nothing to drop")
    if any(layer["attn"]["approx"].lam is not None for layer in layers.values()):
        raise LiniclError("form='mix' reads the kernel terms under their own normaliser (N / Z): with "
                          "B = b = 0 it is 0 / 0; drop them from a 'shared' or 'hybrid' conversion")
    dropped = {scope: {"attn": {"approx": layer["attn"]["approx"].replace(
        B=jnp.zeros_like(layer["attn"]["approx"].B), b=jnp.zeros_like(layer["attn"]["approx"].b))}}
        for scope, layer in layers.items()}
    return {**converted, PROMPT_APPROX: dropped}


def _fit_fn(model, kernel: str, lin: tuple, n: int):
    """jit(variables, tokens, Ws) -> per global layer l, ``{l: (A [H, R, F], Y [H, R, d+1])}``: the
    weighted regression rows phi(q_r) / M_r and targets [N_r, Z_r] / M_r, M_r being the query's total
    softmax mass."""
    cfg = config_of(model)
    layers = cfg.global_layers
    names = {l: [block_site(l, h) for h in ("hook_q", "hook_v", "hook_attn_scores")] for l in layers}

    def run(variables, tokens, Ws):
        _, acts = capture(model, variables, tokens, names=[a for l in layers for a in names[l]])
        T = tokens.shape[1]
        out = {}
        for l in layers:
            site_q, site_v, site_s = (acts[a] for a in names[l])
            q = scored_queries(cfg, variables["params"][layer_scope(l)]["attn"], site_q)
            q = jnp.swapaxes(q, 1, 2)  # [m, H, T, d]
            if cfg.positions == "rope":
                q = apply_rope(q, jnp.arange(T), cfg.rope_base, cfg.rope_style)
            v = repeat_kv(jnp.swapaxes(site_v, 1, 2), cfg.n_heads)[:, :, lin[0]:lin[1]]
            s = site_s[:, :, n:, :]  # rows of the input queries, all keys
            visible = jnp.arange(T)[None, :] <= (n + jnp.arange(T - n))[:, None]
            log_mass = jax.nn.logsumexp(jnp.where(visible, s, -jnp.inf), axis=-1)  # [m, H, t]
            w = jnp.exp(s[..., lin[0]:lin[1]] - log_mass[..., None])  # e^{s_i} / M, linearised part
            Y = jnp.concatenate([jnp.einsum("bhti,bhid->bhtd", w, v), w.sum(-1, keepdims=True)], -1)
            phi = prompt_kernels.features(kernel, q[:, :, n:], Ws[l]) * jnp.exp(-log_mass)[..., None]
            R = phi.shape[0] * phi.shape[2]
            out[l] = (jnp.swapaxes(phi, 0, 1).reshape(cfg.n_heads, R, -1),
                      jnp.swapaxes(Y, 0, 1).reshape(cfg.n_heads, R, -1))
        return out
    return compiled.get(("iclca.fit", model, kernel, lin, n), lambda: jax.jit(run))


def _fit_targets(model, variables, prompt, fit_inputs, kernel, lin: slice, n_features, seed):
    cfg = config_of(model)
    if prompt.shape[0] != 1:
        raise LiniclError("fit_inputs needs a batch-1 prompt")
    fit_inputs = jnp.asarray(check_tokens("fit_inputs", fit_inputs, cfg.vocab_size))
    n, m = prompt.shape[1], fit_inputs.shape[0]
    check_fits("fit_inputs", n, fit_inputs.shape[1], cfg.max_len, "the model's positions")
    key = jax.random.PRNGKey(seed)
    Ws = {l: prompt_kernels.prf_projection(jax.random.fold_in(key, l), cfg.n_heads, n_features, cfg.head_dim,
                                           cfg.jnp_dtype) if kernel == "prf" else None for l in cfg.global_layers}
    tokens = jnp.concatenate([jnp.broadcast_to(prompt, (m, n)), fit_inputs], axis=1)
    return _fit_fn(model, kernel, (lin.start, lin.stop), n)(dict(variables), tokens, Ws)


def _normal_equations(xp, A, Y, ridge: float):
    """``(G + ridge * mean(diag G) I, A^T Y)`` per head, G = A^T A, in NumPy or jax.numpy (``xp``)."""
    G = xp.einsum("hrf,hrg->hfg", A, A)
    reg = ridge * xp.einsum("hff->h", G) / G.shape[-1]
    return G + reg[:, None, None] * xp.eye(G.shape[-1]), xp.einsum("hrf,hrd->hfd", A, Y)


def _singular(layer: int, ridge: float) -> str:
    return (f"fit_inputs: the least-squares fit of layer {layer} is singular (ridge={ridge}; the sample "
            f"does not determine every feature's weight, e.g. fewer query rows than features, or "
            f"features that repeat); pass ridge > 0 (default 1e-6) or more fit_inputs")


def _solve(A, Y, ridge: float, dtype, layer: int):
    """Per head: argmin ||A X - Y||^2 + ridge * mean(diag(A^T A)) ||X||^2 -> B [1, H, F, d], b [1, H, F].

    Eagerly in float64 NumPy, raising LiniclError for a singular fit; under ``jit`` (traced A, Y) in
    the model's dtype, where a singular fit gives non-finite (B, b), hence NaN logits, and a
    ``checkify`` error."""
    if is_concrete(A) and is_concrete(Y):
        M, R = _normal_equations(np, np.asarray(A, np.float64), np.asarray(Y, np.float64), ridge)
        try:
            X = np.linalg.solve(M, R)
        except np.linalg.LinAlgError:
            raise LiniclError(_singular(layer, ridge)) from None
        if not np.all(np.isfinite(X)):
            raise LiniclError(_singular(layer, ridge))
    else:
        X = jnp.linalg.solve(*_normal_equations(jnp, A, Y, ridge))
        checkify.debug_check(jnp.all(jnp.isfinite(X)), _singular(layer, ridge))
    return jnp.asarray(X[None, :, :, :-1], dtype), jnp.asarray(X[None, :, :, -1], dtype)
