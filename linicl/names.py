"""Every name linicl uses, in one place: option enumerations, variable collections, layer scopes and
activation-site names. This module imports nothing from linicl, so every layer can read it.

**Enumerations** (the allowed values of ``ModelConfig`` fields and of method arguments).

**Variable collections** (the keys of a variables dict besides ``params``):

==================  ================================================================================
collection          what it holds
==================  ================================================================================
``prompt_state``    the exact state a prompt left in each linear-attention layer, per layer
                    ``layers_l/attn/S: [batch or 1, heads, d_phi, d_head]`` and ``z: [.., heads,
                    d_phi]`` (``iclca.convert``; re-based for rope on the features; a delta-rule
                    layer, ``update="delta"``, keeps ``S`` alone). A layer with a
                    softmax window or sinks also keeps the fields of
                    ``linicl.kernels.hybrid_attention.HybridState`` (``win_*``, ``sink_*``: the
                    window's and the sinks' keys, features, values and positions); with a cache
                    (``ModelConfig.cache``) those of ``linicl.kernels.sparse_cache.SparseState``
                    (``cache_*``; ``cache_pos`` per row and head). With a short convolution
                    (``ModelConfig.short_conv`` = K) also ``conv_q: [batch or 1, K - 1, heads,
                    d_head]``, ``conv_k``, ``conv_v`` (kv_heads): the last K - 1 inputs of the
                    convolution (``SHORT_CONV_STATE``). Read as every later call's initial state.
``prompt_approx``   a softmax layer's kernel-approximated prompt, per layer ``layers_l/attn/approx``
                    (a ``linicl.iclca.PromptApprox``; ``iclca.convert_approx``).
``position``        ``offset: int32[]``, the position of the first token a call reads (a prompt
                    converted in a model with learned positions, rope on the inputs, a window or
                    sinks; or approximately converted).
``decode``          the running state of a decode (``linicl.generate``): softmax layers' key/value
                    cache (``cached_k``, ``cached_v``, ``k_pos``, ``index``), linear layers' running
                    state (``S``, ``z``, any window/sink buffers and ``conv_*``; when present it replaces
                    ``prompt_state``: it started from it),
                    and ``n_tokens``, the tokens read so far.
``interventions``   edits at named sites (``linicl.interventions``).
``intermediates``   activations captured at named sites (when the collection is mutable).
==================  ================================================================================

**Layers and sites.** Block ``l`` is the variable scope ``layers_l`` (params, states, edits) and the
site-name prefix ``blocks.l`` (TransformerLens style): ``layer_scope``, ``site_path`` and
``site_name`` convert between the two, and nothing else spells either.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

# ------------------------------------------------------------------------------ enumerations
ATTENTION_KINDS = ("linear", "softmax")
FEATURE_MAPS = ("elu+1", "relu", "identity", "taylor2")  # fixed maps: phi(x) alone
# Maps with parameters per layer and head (``phi(x; W, b)``); ModelConfig accepts both kinds.
LEARNED_FEATURE_MAPS = ("hedgehog",)
# No linear part (one zero feature): with a window or sinks, sliding-window softmax with attention
# sinks and nothing else, the untrained baseline of a linearized model (linearize.window_config).
NO_LINEAR_PART = "none"
ALL_FEATURE_MAPS = FEATURE_MAPS + LEARNED_FEATURE_MAPS + (NO_LINEAR_PART,)
# The pretrained checkpoints that ship as packages, by the name experiments accept for --model
# (``linicl.lm.load("gemma3")``); the first is the default.
PRETRAINED = ("smollm2", "gemma3")
# Where rotary positions act in linear attention: on the features phi(q), phi(k) of the numerator
# (relative; the state is re-based), or on q, k before phi (absolute; the offset is kept).
ROPE_ON = ("features", "inputs")
POSITIONS = ("none", "learned", "rope")
# "sandwich": pre-norm blocks that also normalise the attention's and the MLP's outputs before adding
# them to the residual (Gemma 2 and 3).
NORMS = ("pre", "post", "none", "sandwich")
# "gemma_rmsnorm": RMSNorm that multiplies by (1 + w), w initialised to 0 (Gemma's convention).
NORM_TYPES = ("layernorm", "rmsnorm", "gemma_rmsnorm")
SKIPS = ("residual", "dherin", "none")
MLPS = ("plain", "gated")
ROPE_STYLES = ("interleaved", "half")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "tanh")
FORMS = ("auto", "parallel", "chunked", "recurrent")
# The forms of the sparse-cache layer (linicl.kernels.sparse_cache): its selection is sequential, so it
# has the recurrent form only ("auto" runs it).
CACHE_FORMS = ("auto", "recurrent")
# How the sparse cache scores its tokens (the lowest score leaves for the linear state): "recall"
# (LoLA: how badly the linear state recalls the token's value from its key) or "attention" (the
# attention the token received from the queries of the window it passed through).
CACHE_RULES = ("recall", "attention")
# Linear attention's data-dependent decay alpha_t = sigmoid(x_t W + b) in (0, 1] (linicl.kernels.
# gated_attention): none; one per head and token (Mamba-2, Gated DeltaNet); one per head, token and
# key feature (GLA).
GATES = ("none", "scalar", "vector")
# How linear attention writes to its state: "add" S += phi(k) v^T (with z += phi(k)); "delta" the
# delta rule S = (I - beta k k^T) S + beta k v^T (DeltaNet; linicl.kernels.delta_rule), no z.
UPDATES = ("add", "delta")
DTYPES = ("float32", "float64", "bfloat16")
# The activation after linear attention's short causal convolution of q, k, v (ModelConfig.short_conv;
# linicl.kernels.short_conv): none, or SiLU (Mamba, GLA, DeltaNet).
SHORT_CONV_ACTIVATIONS = ("none", "silu")
# A layer's attention (ModelConfig.layer_types): "global" (the config's own attention) or "local" (exact
# softmax over the last sliding_window tokens: a finite state; Gemma 2/3, Mistral).
LAYER_TYPES = ("global", "local")
# Feature maps whose inner products phi(q).phi(k) are never negative (a normalised linear attention
# then has a positive denominator, up to the model's own epsilon).
NONNEGATIVE_MAPS = ("elu+1", "relu", "taylor2", "hedgehog", NO_LINEAR_PART)
# iclca.convert_approx. "learned": a linearized student's trained query/key maps (linicl.linearize).
# NO_KERNEL ("none"): no kernel terms at all; the prompt tokens that are not kept exact are dropped.
NO_KERNEL = "none"
APPROX_KERNELS = ("taylor2", "prf", "elu+1", "learned", NO_KERNEL)
# How the prompt terms join the input's softmax: one shared normaliser (in units of e^s), a fixed
# lambda-mix, or the student's hybrid (g_h e^{s - c_t} for exact keys; the "learned" kernel's form).
APPROX_FORMS = ("shared", "mix", "hybrid")
# iclca.convert_approx(keep=...) / linicl.selection: how the exact prompt keys to keep are scored, before
# any query ("reconstruction": KVzip; "expected": Expected Attention; "h2o", "snapkv", "recent":
# StreamingLLM's sinks + window, "random"), and how the budget is shared by the heads (the same number
# each, the top scores over all heads and layers, or whole heads ranked by their mean score:
# DuoAttention's long-context heads, KVzip's head-level variant). Positionless scores say nothing about which head
# needs more: they are allocated uniformly.
SELECTION_SCORES = ("reconstruction", "expected", "h2o", "snapkv", "recent", "random")
POSITIONLESS_SCORES = ("recent", "random")
ALLOCATIONS = ("uniform", "global", "heads")
EDIT_OPS = ("add", "scale", "replace", "fn")  # linicl.nn.hooks.Edit
REFERENCES = ("query", "own")  # linicl.implicit: which token is run alone
OPEN_METRICS = ("exact_match", "first_content_token")  # linicl.evaluate: open-ended answers
EVAL_METRICS = ("label",) + OPEN_METRICS
# linicl.routing: the size of the routing bias ("paper": B = (Q U_q) diag(alpha) (K U_k)^T as written;
# "logit": projections centred and whitened, B scaled to the model's own logit spread) and the
# cross-entropy of the router's loss (over the whole vocabulary, as the paper, or over the label words).
BIAS_SCALES = ("paper", "logit")
ICR_TARGETS = ("vocab", "labels")
ICR_BASES = ("pids", "random")  # linicl.routing.fit_bases: the PIDs, or the paper's random-basis control
ICR_INPUTS = ("lm", "minilm")  # linicl.routing.Arm: what a router reads (the LM's residual, a MiniLM embedding)
# linicl.parallel: the mesh axes (the batch is split over DATA_AXIS; parameters over both when MODEL_AXIS is there)
DATA_AXIS = "data"
MODEL_AXIS = "model"
FV_EFFECTS = ("patching", "attribution")  # linicl.routing.function_vector: how head effects are measured
# linicl.data.synthetic.token_task: the next-token tasks a name selects (induction, associative recall,
# a fixed table of facts); MQAR and regression have generators of their own.
TOKEN_TASKS = ("induction", "recall", "facts")
# A trainable-bias model's parameters per attention layer (ModelConfig.trainable_bias): the initial
# state (B, b) of iclca.md, added to the numerator's S and to the normaliser's z.
BIAS_PARAMS = ("S_bias", "z_bias")
# linicl.data.long_context.probe_prompts: the long-prompt probes whose answer is a key (scored by
# long_context.key_answered): a passkey in filler text, key-value lines recalled after more text.
KEYED_PROBES = ("passkey", "kv")

# ------------------------------------------------------------------------------ collections
PARAMS = "params"
PROMPT_STATE = "prompt_state"
PROMPT_APPROX = "prompt_approx"
POSITION = "position"
DECODE = "decode"
INTERVENTIONS = "interventions"
INTERMEDIATES = "intermediates"
# The short convolution's state entries of a linear layer in ``prompt_state`` and ``decode``: the last
# K - 1 inputs (before the convolution) of q, k and v (ModelConfig.short_conv).
SHORT_CONV_STATE = ("conv_q", "conv_k", "conv_v")
# The collections a stored prompt lives in (``iclca.strip`` removes them).
PROMPT_COLLECTIONS = (PROMPT_STATE, PROMPT_APPROX, POSITION)

# ------------------------------------------------------------------------------ sites
ATTN_SITES = ("hook_q", "hook_k", "hook_v", "hook_z")
SCORE_SITES = ("hook_attn_scores", "hook_pattern")  # softmax attention only
BLOCK_SITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out",
               "hook_resid_post")
MLP_SITES = ("hook_pre", "hook_post")
# Short names (``cache["pattern", 3]``) -> the module inside the block ("" for the block itself).
SHORT_NAMES = {**{s[5:]: "attn" for s in ATTN_SITES + SCORE_SITES},
               **{s[5:]: "" for s in BLOCK_SITES}, **{f"mlp_{s[5:]}": "mlp" for s in MLP_SITES}}

_LAYER_SCOPE = "layers_"
_SITE_PREFIX = "blocks"
_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(?:(attn|mlp)\.)?(hook_\w+)$")


def layer_scope(layer: int) -> str:
    """The variable scope of block ``layer``: ``"layers_3"``."""
    return f"{_LAYER_SCOPE}{int(layer)}"


def scope_layer(scope: str) -> Optional[int]:
    """The inverse of ``layer_scope`` (None for a scope that is not a block)."""
    if scope.startswith(_LAYER_SCOPE) and scope[len(_LAYER_SCOPE):].isdigit():
        return int(scope[len(_LAYER_SCOPE):])
    return None


def block_site(layer: int, hook: str) -> str:
    """The full site name of a per-block hook: ``block_site(3, "hook_q") == "blocks.3.attn.hook_q"``."""
    if hook in ATTN_SITES or hook in SCORE_SITES:
        module = "attn."
    elif hook in MLP_SITES:
        module = "mlp."
    elif hook in BLOCK_SITES:
        module = ""
    else:
        raise ValueError(f"{hook!r} is not a per-block site; one of "
                         f"{ATTN_SITES + SCORE_SITES + BLOCK_SITES + MLP_SITES}")
    return f"{_SITE_PREFIX}.{int(layer)}.{module}{hook}"


def site_layer(name: str) -> Optional[int]:
    """The block of a full site name (None for the sites outside the blocks)."""
    m = _BLOCK_NAME.match(name)
    return None if m is None else int(m.group(1))


def site_path(name: str) -> Tuple[str, ...]:
    """``"blocks.3.attn.hook_q"`` -> ``("layers_3", "attn", "hook_q")``, the variable path."""
    m = _BLOCK_NAME.match(name)
    if m is None:
        return (name,)
    layer, module, hook = m.groups()
    return (layer_scope(int(layer)),) + ((module,) if module else ()) + (hook,)


def site_name(path: Sequence[str]) -> str:
    """The inverse of ``site_path``."""
    layer = scope_layer(path[0]) if path else None
    if layer is not None:
        return ".".join([_SITE_PREFIX, str(layer), *path[1:]])
    return ".".join(path)


def short_site(short: str, layer: int) -> str:
    """``short_site("pattern", 3) == "blocks.3.attn.hook_pattern"`` (the short names of
    ``SHORT_NAMES``); raises ValueError for an unknown short name."""
    if short not in SHORT_NAMES:
        raise ValueError(f"unknown short site name {short!r}; use one of {sorted(SHORT_NAMES)} or a "
                         f"full name")
    module = SHORT_NAMES[short]
    return block_site(layer, "hook_" + (short[4:] if module == "mlp" else short))
