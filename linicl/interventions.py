"""Activation cache and interventions, with TransformerLens-style names.

Every value the zoo's forward pass passes through a site (``linicl.nn.hooks``) has a name such as
``blocks.3.attn.hook_pattern``, ``blocks.0.hook_resid_pre`` or ``hook_embed``; ``site_names(cfg)``
lists them for a model. There is one forward pass: caching and editing are variable collections of
the same ``model.apply``, so everything here is pure and works under ``jit``, ``grad`` and ``vmap``.

Reading::

    logits, cache = run_with_cache(model, variables, tokens, names=["blocks.0.attn.hook_pattern"])
    cache["pattern", 0]          # shorthand for "blocks.0.attn.hook_pattern"

Editing (an ``Edit`` per site; several at one site apply in order)::

    edits = [add("blocks.2.hook_resid_post", steer, positions=at_last(lengths, T)),
             logit_bias(5, bias, heads=[0, 3])]
    logits = run_with_edits(model, variables, tokens, edits)
    edited = with_edits(variables, edits, cfg)   # or: model.apply(edited, tokens), e.g. inside a loss

Shapes: residual sites ``[batch, seq, d_model]``; ``hook_q/k/v/z`` ``[batch, seq, heads, d_head]``
(``hook_k``/``hook_v`` have ``kv_heads``); ``hook_attn_scores`` (scaled logits, before the causal mask)
and ``hook_pattern`` ``[batch, heads, q_seq, k_seq]``; ``mlp.hook_pre``/``hook_post``
``[batch, seq, d_ff]``.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from linicl import compiled
from linicl._validate import is_concrete
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.names import (INTERMEDIATES, INTERVENTIONS, SCORE_SITES, layer_scope, short_site, site_layer, site_name,
                          site_path)
from linicl.nn.hooks import Edit
from linicl.nn.transformer import Transformer, config_of


def site_names(cfg: ModelConfig) -> Tuple[str, ...]:
    """Every site name of a model with this config, in forward order.

    Read off the model itself: an abstract trace (``jax.eval_shape``, no computation) of one forward
    pass that captures every site, so the list cannot drift from the ``site(...)`` calls of the
    modules. One block is traced per distinct layer config (``ModelConfig.single_layer``: local and
    global layers differ) and its sites are named for each layer. Traced once per config
    (``linicl.compiled``)."""
    if not isinstance(cfg, ModelConfig):
        raise LiniclError(f"site_names needs a ModelConfig, got {type(cfg).__name__}")
    return compiled.get(("interventions.site_names", cfg), lambda: _traced_site_names(cfg))


def _traced_site_names(cfg: ModelConfig) -> Tuple[str, ...]:
    layers = [cfg.single_layer(l) for l in range(cfg.n_layers)]
    traced = {one: _trace_one_layer(one) for one in set(layers)}  # local and global layers differ
    outside, _, first = traced[layers[0]]
    blocks = [site_name((layer_scope(l),) + p) for l, one in enumerate(layers) for p in traced[one][1]]
    return tuple(outside[:first] + blocks + outside[first:])


def _trace_one_layer(cfg: ModelConfig):
    """``(sites outside the block, paths inside it, index of the block's first site)`` of a one-layer
    model, read off an abstract trace."""
    model = Transformer(cfg)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    traced: list = []

    def trace(v, t):  # read the names inside the trace: the sown dicts keep the forward order there
        _, state = model.apply(v, t, mutable=[INTERMEDIATES])
        traced.extend(_flatten(state[INTERMEDIATES]))
        return 0

    jax.eval_shape(trace, variables, tokens)
    block = [n for n in traced if site_layer(n) == 0]
    first = traced.index(block[0])
    outside = traced[:first] + traced[first + len(block):]
    return outside, [site_path(n)[1:] for n in block], first


def full_name(name, layer: Optional[int] = None) -> str:
    """``("pattern", 3)`` or ``"pattern", 3`` -> ``"blocks.3.attn.hook_pattern"``; full names pass."""
    if isinstance(name, tuple):
        name, layer = name
    if layer is None:
        return name
    try:
        return short_site(name, layer)
    except ValueError as e:
        raise LiniclError(str(e)) from None


def check_names(cfg: ModelConfig, names: Iterable[str], what: str = "names") -> None:
    """Raise, naming each missing site with the closest valid names, when a site does not exist in this
    model (an edit at a missing site would otherwise do nothing, silently)."""
    valid = site_names(cfg)
    known = set(valid)
    bad = [n for n in names if n not in known]
    if not bad:
        return
    hint = ("; linear attention has no hook_attn_scores/hook_pattern"
            if any(n.endswith(SCORE_SITES) for n in bad) and cfg.attention == "linear" else "")
    close = {n: difflib.get_close_matches(n, valid, n=3, cutoff=0.6) for n in bad
             if not (hint and n.endswith(SCORE_SITES))}  # no near miss stands in for a missing kind
    suggest = "".join(f"; for {n!r} did you mean {' or '.join(map(repr, c))}?" for n, c in close.items() if c)
    raise LiniclError(f"{what}: no site {bad} in this model ({cfg.n_layers} layers{hint}){suggest}; "
                      f"valid names: {_name_summary(valid, cfg.n_layers)} "
                      f"(all of them: linicl.interventions.site_names(cfg))")


def _name_summary(valid: Sequence[str], n_layers: int) -> str:
    """The valid names in short, in forward order: block 0's sites stand for every block, with the
    layer written as a range (``blocks.{0..11}.attn.hook_q``)."""
    span = "{0.." + str(n_layers - 1) + "}"
    short = [n.replace("blocks.0.", f"blocks.{span}.", 1) if site_layer(n) == 0 else n
             for n in valid if site_layer(n) in (None, 0)]
    return ", ".join(short)


class ActivationCache(dict):
    """A plain ``{name: array}`` dict that also accepts ``cache["pattern", 3]``."""

    def __getitem__(self, key):
        return super().__getitem__(full_name(key) if isinstance(key, tuple) else key)

    def stack(self, short: str) -> jax.Array:
        """``cache.stack("resid_post")``: ``[layers, ...]`` of one site over all layers present."""
        layers = sorted(site_layer(n) for n in self
                        if site_layer(n) is not None and n == full_name(short, site_layer(n)))
        if not layers:
            raise LiniclError(f"the cache holds no {short!r} site")
        return jnp.stack([self[short, l] for l in layers])


def _flatten(tree: Mapping, prefix: Tuple[str, ...] = ()) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, tuple):  # a sown value: (x,)
            out[site_name(prefix + (key,))] = value[-1]
        else:
            out.update(_flatten(value, prefix + (key,)))
    return out


def sown(state: Mapping) -> dict:
    """``{site name: activation}`` of the values a ``model.apply(..., mutable=[..., "intermediates"])``
    sowed (its returned state, or that state's ``"intermediates"`` collection): the reading half of
    ``capture``, for a caller that also needs another mutable collection (e.g. a decode cache)."""
    return _flatten(state.get(INTERMEDIATES, state) if INTERMEDIATES in state else state)


def capture(model, variables, tokens=None, *, names: Optional[Sequence[str]] = None,
            embeds=None, **call_kwargs):
    """The pure version of ``run_with_cache``: ``(output, {name: activation})``. Jit it with ``names``
    fixed: activations that are not returned are never kept (XLA drops them)."""
    cfg = config_of(model)
    if names is not None:
        names = [full_name(n) for n in names]
        check_names(cfg, names)
    out, state = model.apply(variables, tokens, embeds=embeds, mutable=[INTERMEDIATES], **call_kwargs)
    acts = _flatten(state.get(INTERMEDIATES, {}))
    return out, (acts if names is None else {n: acts[n] for n in names})


def _jitted_capture(model, names, with_embeds: bool, call_items):
    def run(variables, x):
        kwargs = dict(call_items)
        if with_embeds:
            return capture(model, variables, names=names, embeds=x, **kwargs)
        return capture(model, variables, x, names=names, **kwargs)
    key = ("interventions.capture", model, names, with_embeds, call_items)
    return compiled.get(key, lambda: jax.jit(run))


def run_with_cache(model, variables, tokens=None, *, names: Optional[Sequence[str]] = None,
                   embeds=None, **call_kwargs):
    """``(output, ActivationCache)`` of one jitted forward pass (compiled once per model, names and
    shapes). ``names=None`` keeps every site; pass the ones you need for long sequences."""
    names = None if names is None else tuple(full_name(n) for n in names)
    fn = _jitted_capture(model, names, embeds is not None, tuple(sorted(call_kwargs.items())))
    out, acts = fn(variables, embeds if embeds is not None else tokens)
    return out, ActivationCache(acts)


# ---------------------------------------------------------------------------------------- edits
def _bool_mask(value, size: Optional[int], what: str):
    if value is None:
        return None
    arr = np.asarray(value) if not isinstance(value, jax.Array) else value
    if arr.dtype == np.bool_:
        return jnp.asarray(arr)
    if size is None:
        raise LiniclError(f"{what} as indices needs the size; pass a bool mask instead")
    idx = np.atleast_1d(np.asarray(arr))
    if not np.issubdtype(idx.dtype, np.integer) or np.any(idx >= size) or np.any(idx < -size):
        raise LiniclError(f"{what} must be integer indices in [-{size}, {size}) or a bool mask, got {value!r}")
    mask = np.zeros(size, bool)
    mask[idx] = True
    return jnp.asarray(mask)


def at_positions(seq_len: int, index) -> jax.Array:
    """``bool[seq_len]`` selecting ``index`` (an int or ints; negative counts from the end)."""
    return _bool_mask(np.asarray(index), seq_len, "index")


def at_last(lengths, seq_len: int) -> jax.Array:
    """``bool[batch, seq_len]`` selecting each row's last real token (right-padded batches).

    ``lengths: int[batch]``, each in [1, seq_len]: a length of 0 or past ``seq_len`` would select no
    position, and the edit would silently skip that row. Concrete lengths are checked now
    (``LiniclError``); traced ones (under ``jit``/``vmap``) by a ``jax.debug.callback`` when the
    computation runs, which then fails with a ``JaxRuntimeError`` quoting the same message."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise LiniclError(f"at_last: seq_len must be an int >= 1 (the padded length), got {seq_len!r}")
    seq_len = int(seq_len)
    concrete = is_concrete(lengths)
    if concrete:
        lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise LiniclError(f"at_last: lengths must be int[batch] (each row's number of real tokens), got "
                          f"{lengths.dtype}{tuple(lengths.shape)}")
    if concrete:
        _check_lengths(lengths, seq_len)
    else:  # the values exist only when the computation runs: check them there, loudly
        jax.debug.callback(_check_lengths, lengths, seq_len)
    lengths = jnp.asarray(lengths)
    return jnp.arange(seq_len)[None, :] == (lengths[:, None] - 1)


def _check_lengths(lengths: np.ndarray, seq_len: int) -> None:
    bad = np.flatnonzero((np.asarray(lengths) < 1) | (np.asarray(lengths) > seq_len))
    if bad.size:
        raise LiniclError(f"at_last: lengths must be in [1, seq_len={seq_len}] (each row's number of real "
                          f"tokens), got {np.asarray(lengths)[bad[:8]].tolist()} at rows {bad[:8].tolist()}: "
                          f"those rows have no last token to edit")


def edit(name, op: str, value: Any = None, *, positions=None, heads=None, n_heads: Optional[int] = None,
         fn: Optional[Callable] = None) -> Tuple[str, Edit]:
    """One ``(name, Edit)``. ``heads`` may be indices (give ``n_heads``) or a bool mask."""
    return full_name(name), Edit(value=value, positions=_bool_mask(positions, None, "positions"),
                                 heads=_bool_mask(heads, n_heads, "heads"), op=op, fn=fn)


def add(name, value, **where) -> Tuple[str, Edit]:
    """Add ``value`` (broadcast to the site) where selected: steering vectors, task vectors."""
    return edit(name, "add", value, **where)


def scale(name, factor, **where) -> Tuple[str, Edit]:
    return edit(name, "scale", factor, **where)


def replace(name, value, **where) -> Tuple[str, Edit]:
    """Replace the selected entries with ``value`` (activation patching / interchange)."""
    return edit(name, "replace", value, **where)


def zero(name, **where) -> Tuple[str, Edit]:
    return edit(name, "scale", jnp.zeros(()), **where)


def apply_fn(name, fn: Callable, params: Any = None, **where) -> Tuple[str, Edit]:
    """``fn(x, params, context)`` at a site; at ``hook_attn_scores`` the context holds the layer's
    (rotated) ``q``, ``k`` ``[batch, heads, seq, d_head]`` and their positions."""
    return edit(name, "fn", params, fn=fn, **where)


def logit_bias(layer: int, bias, **where) -> Tuple[str, Edit]:
    """An additive attention-logit bias at ``layer``, broadcast to ``[batch, heads, q_seq, k_seq]``;
    applied before the causal mask, so it can never let a query see a later key."""
    return add(("attn_scores", layer), bias, **where)


def with_edits(variables: Mapping, edits: Sequence[Tuple[str, Edit]], cfg: Optional[ModelConfig] = None):
    """``variables`` plus an ``interventions`` collection holding ``edits`` (replacing any there).

    ``cfg`` (the model's ``ModelConfig``, e.g. ``model.cfg``) is required: every name is checked
    against ``site_names(cfg)`` now, because an edit at a site the model lacks (a misspelt name, a
    layer past ``n_layers``, ``hook_pattern`` on linear attention) would be ignored by the forward
    pass, silently. ``run_with_edits`` passes it for you."""
    if cfg is None:
        raise LiniclError("with_edits needs cfg, the model's ModelConfig (e.g. with_edits(variables, edits, "
                          "model.cfg)): without it a misspelt or missing site would change nothing, silently")
    if not isinstance(cfg, ModelConfig):
        raise LiniclError(f"with_edits: cfg must be a ModelConfig (e.g. model.cfg), got {type(cfg).__name__}")
    edits = list(edits)
    for pair in edits:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise LiniclError(f"edits must be (name, Edit) pairs from linicl.interventions, got {pair!r:.80}")
    check_names(cfg, [n for n, _ in edits], "edits")
    tree: dict = {}
    for name, e in edits:
        if not isinstance(e, Edit):
            raise LiniclError(f"edits must be (name, Edit) pairs; got {type(e).__name__} for {name!r}")
        *scopes, leaf = site_path(name)
        node = tree
        for s in scopes:
            node = node.setdefault(s, {})
        node[leaf] = node.get(leaf, ()) + (e,)
    return {**variables, INTERVENTIONS: tree}


def _merged(a: Any, b: Any) -> Any:
    """Two ``interventions`` trees joined; at a site present in both, ``a``'s edits apply first."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return tuple(a) + tuple(b)
    out = dict(a)
    for key, value in b.items():
        out[key] = _merged(out[key], value) if key in out else value
    return out


def add_edits(variables: Mapping, edits: Sequence[Tuple[str, Edit]], cfg: Optional[ModelConfig] = None):
    """``variables`` with ``edits`` applied after any edits they already hold (``with_edits`` would
    replace those), so that a method's edits compose with a pre-edited model. ``cfg`` is required, as
    in ``with_edits``."""
    edited = with_edits(variables, edits, cfg)
    if INTERVENTIONS not in variables:
        return edited
    return {**edited, INTERVENTIONS: _merged(variables[INTERVENTIONS], edited[INTERVENTIONS])}


class EditPlan(NamedTuple):
    """The ``edits`` argument of a batched method, split for a jitted function: the site ``names``
    (static), their ``Edit`` values (traced: new values of the same structure do not recompile) and an
    optional function ``fn(tokens, lengths[, extras]) -> [(name, Edit), ...]`` traced per batch."""

    names: tuple
    values: tuple
    fn: Optional[Callable]

    def apply(self, variables, cfg: ModelConfig, values, tokens, lengths, *extras):
        """``variables`` with the plan's edits for this batch (``values`` as passed to the jitted
        function) added after the ones they hold."""
        edits = list(zip(self.names, values))
        if self.fn is not None:
            edits += list(self.fn(tokens, lengths, *extras))
        return add_edits(variables, edits, cfg) if edits else variables


def plan_edits(edits, cfg: ModelConfig) -> EditPlan:
    """An ``EditPlan`` from a list of ``(name, Edit)`` (checked now) or a function returning them."""
    if edits is None:
        return EditPlan((), (), None)
    if callable(edits):
        return EditPlan((), (), edits)
    pairs = list(edits)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], Edit)):
            raise LiniclError(f"edits must be (name, Edit) pairs from linicl.interventions (or a function "
                              f"returning them), got {pair!r:.80}")
    names = tuple(full_name(n) for n, _ in pairs)
    check_names(cfg, names, "edits")
    return EditPlan(names, tuple(e for _, e in pairs), None)


def run_with_edits(model, variables, tokens=None, edits: Sequence[Tuple[str, Edit]] = (), **call_kwargs):
    """``model.apply`` with ``edits`` (not jitted: wrap the caller in ``jax.jit``)."""
    edited = with_edits(variables, edits, config_of(model))
    if "embeds" in call_kwargs:
        return model.apply(edited, **call_kwargs)
    return model.apply(edited, tokens, **call_kwargs)
