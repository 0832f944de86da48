"""The router and the routing bias it drives (ICR, arXiv 2509.22854; routing.md).

    Z_q = Q U_q,  Z_k = K U_k                      (Q, K: the layer's q/k projections, concatenated
    B   = Z_q diag(alpha(x)) Z_k^T                  over heads, before rope; U: the PIDs)
    scores[h] = q_h.k_h / sqrt(d) + gamma_h(x) B    -> causal mask -> softmax

``Router`` maps a frozen representation of the zero-shot query to alpha = tanh(.) per layer and direction and
gamma = sigmoid(.) per layer and head. That representation is
either the LM's own residual entering the first routed layer, mean-pooled (``router_input``; no second
model), or an embedding given with each query (``e``: the paper's frozen all-MiniLM-L6-v2 sentence
embedding, ``linicl.lm.minilm``), computed once per query outside the LM. ``routing_edits`` adds the bias through
``linicl.interventions`` at each routed layer's ``hook_attn_scores``, before the causal mask, so a
query never sees a later key. ``save_router``/``load_router`` go through ``linicl.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linicl import checkpoint
from linicl.batching import last_positions, unembed
from linicl.errors import DataError, LiniclError
from linicl.interventions import apply_fn, capture, with_edits
from linicl.names import block_site
from linicl.nn.transformer import config_of
from linicl.routing.pids import PIDs, RoutingBias

SUFFIX = ".safetensors"
_KIND = "linicl.routing.Router"
_SIZES = ("n_layers", "rank", "n_heads", "hidden")


class Router(nn.Module):
    """``e: f[batch, d_in]`` -> ``alpha: [batch, n_layers, rank]`` in (-1, 1) and ``gamma: [batch,
    n_layers, n_heads]`` in (0, 1), two independent two-layer MLPs after a LayerNorm of the input
    (LM hidden states have a few very large coordinates). The last layer of the alpha branch starts at
    zero, so an untrained router is exactly the base model.

    ``alpha_scale`` multiplies alpha on the way out: 1 while training (where ``alpha_schedule`` scales
    it instead), and the schedule's last value in a trained router (``train_router``), so inference
    reads alpha at the scale training ended with (the paper anneals 1.0 -> 0.8)."""

    n_layers: int
    rank: int
    n_heads: int
    hidden: int = 256
    alpha_scale: float = 1.0

    @nn.compact
    def __call__(self, e: jax.Array):
        e = nn.LayerNorm(name="ln")(e)

        def mlp(name, out, last_init):
            h = nn.gelu(nn.Dense(self.hidden, name=f"{name}_1")(e))
            return nn.Dense(out, kernel_init=last_init, name=f"{name}_2")(h)
        alpha = jnp.tanh(mlp("alpha", self.n_layers * self.rank, nn.initializers.zeros)) * self.alpha_scale
        gamma = jax.nn.sigmoid(mlp("gamma", self.n_layers * self.n_heads, nn.initializers.lecun_normal()))
        B = e.shape[0]
        return alpha.reshape(B, self.n_layers, self.rank), gamma.reshape(B, self.n_layers, self.n_heads)


def _init(router: Router, d_in: int, seed: int = 0):
    return router.init(jax.random.PRNGKey(seed), jnp.zeros((1, d_in), jnp.float32))["params"]


def make_router(model, pids: PIDs, *, hidden: int = 256, seed: int = 0, d_in: Optional[int] = None):
    """``(router, params)`` for this model and these PIDs. ``d_in``: the width of the router's input, the
    model's hidden width by default (``router_input``); an external embedding's width otherwise."""
    cfg = config_of(model)
    router = Router(n_layers=len(pids.layers), rank=pids.rank, n_heads=cfg.n_heads, hidden=hidden)
    d_in = cfg.d_model if d_in is None else int(d_in)
    if d_in < 1:
        raise LiniclError(f"d_in must be a positive width, got {d_in}")
    return router, _init(router, d_in, seed)


def input_width(router_params) -> int:
    """The input width a router's params expect (``make_router``'s ``d_in``)."""
    return int(router_params["ln"]["scale"].shape[-1])


def _checked_input(e, router_params, h0):
    """``e`` as the router's input ``f32[batch, d_in]``, refused (by name) when its shape is not one row of
    ``input_width`` per query."""
    e = jnp.asarray(e)
    want = (h0.shape[0], input_width(router_params))
    if e.shape != want:
        raise LiniclError(f"e (the router's input embeddings): expected shape {want}, one row per query of the "
                          f"width the router was made with, got {tuple(e.shape)}")
    return e.astype(jnp.float32)


def _bias(scores, value, ctx):
    """scores + gamma_h * s * z_q diag(alpha) z_k^T at every (query, key) pair (the mask follows), with
    z_q = ((Q - c_q) U_q) * w_q and z_k alike (``PIDs.bias_params``; the paper's bias: c = 0, w = s = 1)."""
    b, T = scores.shape[0], scores.shape[2]
    dt = jnp.promote_types(scores.dtype, jnp.float32)  # at least float32, also under bfloat16
    value = {n: jnp.asarray(v).astype(dt) for n, v in value.items()}
    q = ctx["q_proj"].reshape(b, T, -1).astype(dt)
    k = ctx["k_proj"].reshape(b, T, -1).astype(dt)
    zq = ((q - value["c_q"]) @ value["U_q"]) * value["w_q"]
    zk = ((k - value["c_k"]) @ value["U_k"]) * value["w_k"]
    B = value["s"] * jnp.einsum("btr,br,bsr->bts", zq, value["alpha"], zk)
    return scores + (value["gamma"][:, :, None, None] * B[:, None]).astype(scores.dtype)


def _as_bias(pids) -> RoutingBias:
    return pids if isinstance(pids, RoutingBias) else pids.routing_bias()


def routing_edits(pids, alpha: jax.Array, gamma: jax.Array) -> list:
    """The routing bias as edits at each routed layer's ``hook_attn_scores``
    (``alpha: [batch, n_layers, rank]``, ``gamma: [batch, n_layers, heads]``; the bias's size as
    ``pids.bias`` says). ``pids``: a ``PIDs`` or its ``RoutingBias`` (the same below)."""
    bias = _as_bias(pids)
    return [apply_fn(block_site(l, "hook_attn_scores"), _bias,
                     {**{k: jnp.asarray(v) for k, v in bias.params[i].items()},
                      "alpha": alpha[:, i], "gamma": gamma[:, i]})
            for i, l in enumerate(bias.layers)]


def router_input(h: jax.Array, lengths: jax.Array) -> jax.Array:
    """Mean of ``h: [batch, seq, d]`` over each row's real tokens after the first -> ``[batch, d]``
    (float32). The first token is left out (unless it is the only one): in pretrained LMs it is the
    attention sink, whose residual is ~100x larger than the others' (SmolLM2: ~2.5e4 against ~2e2 from
    layer 10 on) and the same for every prompt, so it would drown the query's content in the mean (the
    mean-pooled features of different SST-2/AG News/CB queries have cosine 0.98 with it, 0.91 without)."""
    pos = jnp.arange(h.shape[1])[None, :]
    start = (lengths > 1).astype(lengths.dtype)[:, None]
    real = ((pos < lengths[:, None]) & (pos >= start))[..., None]
    count = (lengths[:, None] - start).astype(jnp.float32)
    return (jnp.sum(jnp.where(real, h, 0).astype(jnp.float32), axis=1) / count).astype(jnp.float32)


def routed_logits(model, variables, pids, router: Router, router_params, h0, lengths,
                  alpha_scale: float = 1.0, with_bias_size: bool = False, e=None):
    """Next-token logits ``[batch, vocab]`` at each row's last token with the router's bias, from the
    residual ``h0: [batch, seq, d_model]`` entering the first routed layer. Also returns (alpha, gamma)
    (alpha before ``alpha_scale``, which multiplies it in the bias),
    and with ``with_bias_size`` the bias's size per routed layer (``bias_size``) as a third item.
    Only the routed blocks run (``first_layer``): h0 does not depend on the router. The router reads
    ``e: f[batch, d_in]`` when given (an external embedding of each query), else ``router_input(h0)``."""
    cfg = config_of(model)
    pids = _as_bias(pids)
    inputs = router_input(h0, lengths) if e is None else _checked_input(e, router_params, h0)
    alpha, gamma = router.apply({"params": router_params}, inputs)
    edited = with_edits(variables, routing_edits(pids, alpha * alpha_scale, gamma), cfg)
    if not with_bias_size:
        h = model.apply(edited, embeds=h0, first_layer=pids.layers[0], hidden=True)
        return unembed(cfg, variables["params"], last_positions(h, lengths)), (alpha, gamma)
    names = [block_site(l, f"hook_{s}") for l in pids.layers for s in ("q", "k")]
    h, acts = capture(model, edited, embeds=h0, names=names, first_layer=pids.layers[0], hidden=True)
    size = bias_size(pids, [acts[block_site(l, "hook_q")] for l in pids.layers],
                     [acts[block_site(l, "hook_k")] for l in pids.layers], alpha * alpha_scale, gamma, lengths)
    return unembed(cfg, variables["params"], last_positions(h, lengths)), (alpha, gamma), size


def bias_size(pids, q, k, alpha, gamma, lengths) -> jax.Array:
    """``[n_layers]``: per routed layer, the std over keys of the bias at each row's last query
    (mean gate over heads times the std of ``s z_q diag(alpha) z_k^T``), averaged over the batch.
    ``q[i], k[i]``: the layer's ``hook_q``/``hook_k`` ``[batch, seq, heads, d_head]``. The quantity to
    set beside the model's own logit spread (``PIDs`` docstring); no gradient flows through it."""
    out = []
    pids = _as_bias(pids)
    T = q[0].shape[1]
    keys = jnp.arange(T)[None, :] < lengths[:, None]  # [b, T]
    for i in range(len(pids.layers)):
        dt = jnp.promote_types(q[i].dtype, jnp.float32)
        p = {n: jnp.asarray(v).astype(dt) for n, v in pids.params[i].items()}
        qi = last_positions(q[i], lengths).reshape(q[i].shape[0], -1).astype(dt)
        ki = k[i].reshape(k[i].shape[0], T, -1).astype(dt)
        zq = ((qi - p["c_q"]) @ p["U_q"]) * p["w_q"]
        zk = ((ki - p["c_k"]) @ p["U_k"]) * p["w_k"]
        row = p["s"] * jnp.einsum("br,br,bsr->bs", zq, alpha[:, i], zk)  # [b, T]
        n = jnp.sum(keys, -1)
        mean = jnp.sum(jnp.where(keys, row, 0), -1) / n
        std = jnp.sqrt(jnp.sum(jnp.where(keys, (row - mean[:, None]) ** 2, 0), -1) / n)
        out.append(jnp.mean(std * jnp.mean(gamma[:, i], -1)))
    return jax.lax.stop_gradient(jnp.stack(out))


ROUTING_KEYS = ("router", "routing_bias")  # what icr_forward reads of the variables besides the LM's


def icr_forward(model, pids: PIDs, router: Router, *, embedded: bool = False, cached: bool = False):
    """The ``forward(variables, tokens, lengths)`` hook of ``linicl.evaluate`` for a trained router:
    ``variables["router"]`` holds its params (pass ``{**variables, "router": params}``). With
    ``embedded`` or ``cached`` the evaluation passes ``extras``, a dict with one row per prompt of

    * ``"e": f[n_prompts, d_in]`` (``embedded``): an external embedding of each query for the router to
      read (the kind it was trained on, e.g. ``linicl.lm.minilm``'s of each query's text) instead of the
      LM's own residual (``router_input``);
    * ``"h0": f[n_prompts, T, d_model]`` (``cached``): the residual entering the first routed layer,
      right-padded (``entry_residuals``), so that only the routed blocks run: several routers evaluated
      on the same prompts share one pass through the layers below.

    With
    ``variables["routing_bias"]`` (``PIDs.routing_bias()`` of a basis with ``pids``'s layers and
    shapes) the bias is that basis's, an argument rather than a constant: one forward function, and so
    one compilation, serves every router of the same shape on every such basis."""
    entry = block_site(pids.layers[0], "hook_resid_pre")

    wanted = [k for k, on in (("e", embedded), ("h0", cached)) if on]

    def forward(variables, tokens, lengths, extras=None):
        if wanted and not (isinstance(extras, dict) and all(k in extras for k in wanted)):
            raise LiniclError(f"this forward reads extras={{{', '.join(repr(k) + ': ...' for k in wanted)}}} (one row "
                              f"per prompt; icr_forward's docstring), got {type(extras).__name__}")
        router_params = variables["router"]
        bias = variables.get("routing_bias", pids)
        base = {k: v for k, v in variables.items() if k not in ROUTING_KEYS}
        if cached:
            h0 = _to_width(extras["h0"], tokens.shape[1])
        else:
            h0 = capture(model, base, tokens, names=[entry], hidden=True)[1][entry]  # later blocks are dropped
        e = extras["e"] if embedded else None
        return routed_logits(model, base, bias, router, router_params, h0, lengths, e=e)[0]
    return forward


def _to_width(h0, width: int):
    """Right-padded ``h0: [b, T, d]`` cut or zero-padded to ``width`` positions (the batch's; the routed
    causal blocks read no position past a row's length)."""
    if h0.shape[1] >= width:
        return h0[:, :width]
    return jnp.pad(h0, ((0, 0), (0, width - h0.shape[1]), (0, 0)))


def entry_residuals(model, variables, prompts, layer: int, *, batch_size: int = 16,
                    progress: bool = False) -> np.ndarray:
    """``f32[n_prompts, T, d_model]``: the residual entering block ``layer`` at every position of each
    prompt, right-padded with zeros to the longest (T), in input order: the cache that ``prepare``
    stores for training and ``icr_forward(cached=True)`` reads in evaluation."""
    from linicl.activations import collect_activations
    entry = block_site(layer, "hook_resid_pre")
    lengths = np.asarray([len(getattr(p, "tokens", p)) for p in prompts], np.int32)
    T = int(lengths.max())

    def whole(act, n, tokens, lengths):  # every position, cut or zero-padded to the longest prompt
        return jnp.pad(act[:, :T], ((0, 0), (0, T - min(T, act.shape[1])), (0, 0)))
    h0 = collect_activations(model, variables, prompts, [entry], batch_size=batch_size, progress=progress,
                             reduce=whole)[entry].astype(np.float32)
    return np.where(np.arange(T)[None, :, None] < lengths[:, None, None], h0, 0.0)


# ---------------------------------------------------------------------------------------- files
def _settings(router: Router, d_in: int) -> dict:
    return {"kind": _KIND, **{k: int(getattr(router, k)) for k in _SIZES}, "d_in": int(d_in),
            "alpha_scale": float(router.alpha_scale)}


def save_router(path, router: Router, params) -> Path:
    """The router's sizes (checkpoint settings) and params in one ``linicl.checkpoint`` file
    (suffix ``.safetensors``). Returns the path written."""
    d_in = params["ln"]["scale"].shape[-1]
    return checkpoint.save(Path(path).with_suffix(SUFFIX), params, settings=_settings(router, d_in))


def load_router(path):
    """``(router, params)`` written by ``save_router``: the router is rebuilt from the stored sizes."""
    settings = checkpoint.header(path).settings
    try:
        if settings.get("kind") != _KIND:
            raise ValueError(f"its settings are {settings}")
        router = Router(**{k: int(settings[k]) for k in _SIZES},
                        alpha_scale=float(settings.get("alpha_scale", 1.0)))
        d_in = int(settings["d_in"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path} is not a router file written by save_router: {e}") from None
    # The template's shapes come from the stored sizes; eval_shape runs no initialiser.
    template = jax.eval_shape(lambda: _init(router, d_in))
    params, _ = checkpoint.load(path, template, settings=settings)
    return router, jax.tree_util.tree_map(jnp.asarray, params)
