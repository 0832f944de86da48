"""The zoo's language model: ``Transformer(cfg)``, ``tokens int32[batch, seq] -> logits f[batch, seq, vocab]``.

Positions: the first token of a call sits at ``offset`` (``variables["position"]["offset"]``, 0 when
absent) plus, while decoding (``mutable=["decode"]``), the number of tokens already read, kept in
``decode/n_tokens`` (except in linear attention with rope on the features, whose state is re-based so
that its next token always sits at position 0). With ``mutable=["prompt_state", "position"]``
(``iclca.convert``) a call also advances ``offset`` when the model depends on absolute positions
(``ModelConfig.keeps_offset``: learned positions, rope on the inputs, a window or sinks); re-based
rope states need none.

``Transformer(cfg, remat=True)`` (or ``model.clone(remat=True)``) rematerialises each block in the
backward pass (``flax.linen.remat``): a gradient then keeps only the blocks' inputs, not every
activation inside them, and recomputes those, so training on long sequences needs less memory for one
more forward. The parameters, outputs and gradients are the same (tested to float64 precision).

``Transformer(cfg, scan=True)`` runs the blocks with ``jax.lax.scan`` instead of a Python loop, so the
traced program holds one block (or one period of blocks: Gemma 3's 5 local + 1 global) instead of
``n_layers`` copies, and compile time stops growing with depth. The variables keep their per-layer
paths (``params/layers_{l}/...``; loaders, ``iclca.convert``, hooks and checkpoints see no difference):
each call stacks the scanned layers' subtrees along a new leading axis. That copy is what the option
costs at run time (SmolLM2-135M forward on 2 CPU cores: 0.35 s against the loop's 0.09 s at 7 tokens,
1.1 s against 0.7 s at 128, for a compile 0.31x the loop's), so it pays where compile time dominates: a
training step on a device, many shapes, deep models. Outputs and gradients are the loop's to float64
precision (bitwise in the tests' unoptimised build and for SmolLM2 in float32; XLA may fuse a scanned
body differently from an unrolled chain and round differently, as any recompilation may: 1e-16
relative in float64, 5e-7 in float32 measured on a tiny model). A call falls back to the loop, with
identical results, while initialising and for the layers that no scan can cover exactly
(``_scan_plan``): runs of at least two periods of equal configs and equal variables (structure,
shapes, dtypes), edits included, are scanned, from ``first_layer`` on, and the layers between them
loop. Edits of the same kind at the same sites of every layer scan (their values stacked); an edit
in one layer loops that layer and scans the runs before and after it (``scan_segments``).

Mutable collections scan too (decoding's cache, captured sites, ``iclca.convert``'s prompt states):
each step returns its blocks' updated collections, stacked along the scan, and they are written
back under each layer's own path, as the loop writes them. (An edit that fails its own checks inside
a scanned block names the site without the ``layers_{l}`` part of its path.) Decoding stacks the
parameters and the cache again at every step: ``linicl.generate`` on SmolLM2 (20 tokens after 12,
2 CPU cores, no compilation cache) took 8.5 s scanned against 14.8-16.8 s looped on its first call,
and 2.0 s against 0.8-1.0 s on the next.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import is_filter_empty

from linicl._validate import check_fits, check_tokens, take_rows
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.names import DECODE, POSITION, layer_scope
from linicl.nn.attention import advancing
from linicl.nn.block import Block
from linicl.nn.norms import make_norm
from linicl.nn.hooks import site

_EMBED_INIT = nn.initializers.normal(stddev=0.02)


def config_of(model) -> ModelConfig:
    """The ModelConfig of a zoo model, or a clear error for anything else."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise LiniclError(f"model must be a linicl.Transformer (with a ModelConfig .cfg), "
                          f"got {type(model).__name__}")
    return cfg


def position_offset(variables: Mapping[str, Any]) -> jax.Array:
    """Position of the first token a call with these variables reads, ``int32[]`` (0 unless a prompt
    was stored in a model that keeps absolute positions, or approximately converted).

    An array, never a Python int: under ``jit`` the variables are traced and the offset is known only
    at run time (the eager checks that need its value, ``check_fits``, skip a traced one)."""
    return jnp.asarray(variables.get(POSITION, {}).get("offset", 0), jnp.int32)


def unembed(cfg: ModelConfig, params, h: jax.Array) -> jax.Array:
    """Logits ``f[..., vocab]`` of final hidden states ``h: f[..., d_model]`` (``Transformer(...,
    hidden=True)``, after the final norm): the tied embedding's transpose or the separate ``unembed``
    matrix, as the model does. Unembedding only the rows one needs (a prompt's last token) spares the
    rest of the ``[batch, seq, vocab]`` logits (Gemma 3: 262,144 entries a token)."""
    if cfg.tie_embeddings:
        return h @ params["embed"].T
    return h @ params["unembed"]["kernel"]


def _layer_variables(variables: Mapping[str, Any], layer: int) -> dict:
    """Block ``layer``'s variables, ``{collection: subtree}``, for ``Block.apply`` (every collection
    that has the layer's scope)."""
    scope = layer_scope(layer)
    return {col: tree[scope] for col, tree in variables.items() if scope in tree}


def _signature(cfg: ModelConfig, variables: Mapping[str, Any], layer: int):
    """What must repeat for layers to share a scanned body: the layer's config and the structure,
    shapes and dtypes of its variables."""
    own = _layer_variables(variables, layer)
    return cfg.layer_config(layer), jax.tree.structure(own), tuple(
        (jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(own))


def _periodic_span(signatures: Sequence, start: int, p: int) -> int:
    """How many signatures from ``start`` on repeat with period ``p`` (``signatures[j] ==
    signatures[j + p]`` throughout), counting the first period itself."""
    j = start
    while j + p < len(signatures) and signatures[j] == signatures[j + p]:
        j += 1
    return j - start + p


def period_of(signatures: Sequence) -> Optional[int]:
    """The smallest ``p`` with ``signatures[i] == signatures[i + p]`` for every i, when the sequence
    holds at least two whole periods; else None (nothing to scan)."""
    n = len(signatures)
    return next((p for p in range(1, n // 2 + 1) if _periodic_span(signatures, 0, p) == n), None)


def scan_segments(signatures: Sequence) -> list:
    """The runs of layers to scan, ``[(start, period, n_periods)]`` in order, each at least two whole
    periods of equal signatures; the layers between them loop. Taken greedily from the first layer:
    at each layer the period whose run covers the most layers (the smaller period on a tie), else
    that layer loops. ``llgllgl`` -> ``[(0, 3, 2)]``; ``aabaa`` (an edit in the middle layer) ->
    ``[(0, 1, 2), (3, 1, 2)]``."""
    n, out, i = len(signatures), [], 0
    while i < n:
        best = None  # (layers covered, period)
        for p in range(1, (n - i) // 2 + 1):
            covered = _periodic_span(signatures, i, p) // p * p
            if covered >= 2 * p and (best is None or covered > best[0]):
                best = (covered, p)
        if best is None:
            i += 1
        else:
            out.append((i, best[1], best[0] // best[1]))
            i += best[0]
    return out


def _stack(trees: Sequence) -> Any:
    """Equal-structured pytrees stacked leaf by leaf along a new leading axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


class Transformer(nn.Module):
    """The zoo's model. Sites: ``hook_embed``, ``hook_pos_embed``, ``ln_final.hook_normalized`` (all
    ``[batch, seq, d_model]``) and those of every block (``linicl.nn.block``). ``remat``: recompute
    each block in the backward pass; ``scan``: run the blocks with ``jax.lax.scan`` (module docstring).
    Neither is part of the config, so neither is part of a model's identity."""

    cfg: ModelConfig
    remat: bool = False
    scan: bool = False

    @nn.compact
    def __call__(self, tokens: Optional[jax.Array] = None, *, embeds: Optional[jax.Array] = None,
                 hidden: bool = False, first_layer: int = 0) -> jax.Array:
        """``tokens: int32[batch, seq]`` -> logits ``f[batch, seq, vocab]``.

        Args:
          embeds: instead of tokens, the first block's input ``f[batch, seq, d_model]`` (continuous
            tokens, e.g. in-context regression; learned positions are still added).
          hidden: return the final hidden state ``f[batch, seq, d_model]`` (after the final norm, if
            any) instead of logits.
          first_layer: run only the blocks from this one on; ``embeds`` is then the residual stream
            entering it (``blocks.{first_layer}.hook_resid_pre``, positional embeddings included). A
            cached prefix: methods that edit only late layers (routing) need not recompute the rest.
        """
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        embed = self.param("embed", _EMBED_INIT, (cfg.vocab_size, cfg.d_model), dt)
        if not 0 <= first_layer < cfg.n_layers or (first_layer and embeds is None):
            raise LiniclError(f"first_layer must lie in [0, {cfg.n_layers}) and, when > 0, come with "
                              f"embeds (the residual entering that block); got {first_layer}")
        x = self._inputs(embed, tokens, embeds)
        positions = self._positions(x.shape[1])
        if cfg.positions == "learned" and first_layer == 0:
            pos_embed = self.param("pos_embed", _EMBED_INIT, (cfg.max_len, cfg.d_model), dt)
            x = x + site(self, "hook_pos_embed", take_rows(pos_embed, positions)[None])
        x = self._blocks(x, positions, first_layer)
        if cfg.has_final_norm:
            x = site(self, "ln_final.hook_normalized", make_norm(cfg, "ln_f")(x))
        if hidden:
            return x
        if cfg.tie_embeddings:
            return x @ embed.T
        return nn.Dense(cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=dt, name="unembed")(x)

    def _blocks(self, x: jax.Array, positions: jax.Array, first_layer: int) -> jax.Array:
        """Blocks ``first_layer`` .. ``n_layers - 1`` on ``x: f[batch, seq, d_model]``: runs of whole
        periods scanned when ``scan`` allows it (``_scan_plan``), the other layers one by one."""
        layer = first_layer
        for start, period, n_periods in self._scan_plan(first_layer):
            x = self._looped(x, positions, range(layer, start))
            layer = start + period * n_periods
            x = self._scanned(x, positions, range(start, layer), period)
        return self._looped(x, positions, range(layer, self.cfg.n_layers))

    def _looped(self, x: jax.Array, positions: jax.Array, layers: range) -> jax.Array:
        block = nn.remat(Block) if self.remat else Block  # the same parameter paths either way
        for layer in layers:  # a local layer runs its own (finite-state) config
            x = block(self.cfg.layer_config(layer), name=layer_scope(layer))(x, positions)
        return x

    def _scan_plan(self, first_layer: int) -> list:
        """The runs ``[(start, period, n_periods)]`` of blocks to scan (``scan_segments`` over the
        layers' ``_signature``: configs and variables, edits included), none when ``scan`` is off or
        while initialising (the loop creates the variables)."""
        if not isinstance(self.scan, bool):
            raise LiniclError(f"Transformer: scan must be a bool, got {self.scan!r}")
        if not self.scan or self.is_initializing():
            return []
        variables = self.variables
        layers = range(first_layer, self.cfg.n_layers)
        runs = scan_segments([_signature(self.cfg, variables, layer) for layer in layers])
        return [(first_layer + start, period, n) for start, period, n in runs]

    def _scanned(self, x: jax.Array, positions: jax.Array, layers: range, period: int) -> jax.Array:
        """The blocks of ``layers`` (whole periods) by ``jax.lax.scan``: step k applies blocks
        ``layers[k * period + j]``, j < period, each with its config and its own variables (stacked:
        leaf ``[n_periods, ...]`` per position j in the period). ``remat`` checkpoints the step. With
        mutable collections each block's updated ones come out of the step, stacked the same way, and
        are written back under the block's own path (``layers_{l}``), as the loop leaves them."""
        variables = self.variables
        mutable = self.scope.mutable
        writes = not is_filter_empty(mutable)
        cfgs = [self.cfg.layer_config(layer) for layer in layers[:period]]
        stacked = tuple(_stack([_layer_variables(variables, layer) for layer in layers[j::period]])
                        for j in range(period))

        def step(h, per_layer):
            updated = []
            for layer_cfg, own in zip(cfgs, per_layer):
                block = Block(layer_cfg, parent=None)
                if writes:
                    h, new = block.apply(own, h, positions, mutable=mutable)
                    updated.append(new)
                else:
                    h = block.apply(own, h, positions)
            return h, tuple(updated)

        if self.remat:
            step = jax.checkpoint(step, prevent_cse=False)  # scan already keeps steps apart
        x, updated = jax.lax.scan(step, x, stacked)
        for j, new in enumerate(updated):
            for k, layer in enumerate(layers[j::period]):
                for col, tree in new.items():
                    self.put_variable(col, layer_scope(layer), jax.tree.map(lambda a: a[k], tree))
        return x

    def _inputs(self, embed, tokens, embeds) -> jax.Array:
        cfg = self.cfg
        if (tokens is None) == (embeds is None):
            raise LiniclError("Transformer: pass exactly one of tokens (int32[batch, seq]) or "
                              "embeds (float[batch, seq, d_model])")
        if embeds is not None:
            if embeds.ndim != 3 or embeds.shape[-1] != cfg.d_model:
                raise LiniclError(f"embeds must be float[batch, seq, {cfg.d_model}], got "
                                  f"{embeds.dtype}{tuple(embeds.shape)}")
            return embeds.astype(cfg.jnp_dtype)
        check_tokens("tokens", tokens, cfg.vocab_size)
        x = take_rows(embed, tokens)
        if cfg.scale_embeddings:  # Gemma: sqrt(d_model), rounded to the model's dtype
            x = x * jnp.asarray(cfg.d_model ** 0.5, cfg.jnp_dtype)
        return site(self, "hook_embed", x)

    def _positions(self, T: int) -> jax.Array:
        """``int32[T]`` positions of this call's tokens; advances the position counters if mutable."""
        cfg = self.cfg
        offset = jnp.zeros((), jnp.int32)
        if self.has_variable(POSITION, "offset"):
            offset = jnp.asarray(self.get_variable(POSITION, "offset"), jnp.int32)
        start = offset
        if advancing(self, DECODE):
            read = self.variable(DECODE, "n_tokens", lambda: jnp.zeros((), jnp.int32))
            if cfg.attention == "softmax":
                check_fits("tokens", read.value, T, cfg.max_len, "the decode cache")
            if not cfg.rebases_state:  # a re-based state restarts at 0 instead
                start = offset + read.value
            read.value = read.value + T
        if cfg.positions == "learned":
            check_fits("tokens", start, T, cfg.max_len, "learned positions")
        if advancing(self, POSITION):
            self.put_variable(POSITION, "offset", offset + T if cfg.keeps_offset else offset)
        return start + jnp.arange(T, dtype=jnp.int32)
