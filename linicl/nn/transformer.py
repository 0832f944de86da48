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
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from linicl._validate import check_fits, check_tokens, take_rows
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.names import DECODE, POSITION
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


class Transformer(nn.Module):
    """The zoo's model. Sites: ``hook_embed``, ``hook_pos_embed``, ``ln_final.hook_normalized`` (all
    ``[batch, seq, d_model]``) and those of every block (``linicl.nn.block``). ``remat``: recompute
    each block in the backward pass (module docstring); not part of the config, so not of a model's
    identity."""

    cfg: ModelConfig
    remat: bool = False

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
        block = nn.remat(Block) if self.remat else Block  # the same parameter paths either way
        for layer in range(first_layer, cfg.n_layers):  # a local layer runs its own (finite-state) config
            x = block(cfg.layer_config(layer), name=f"layers_{layer}")(x, positions)
        if cfg.has_final_norm:
            x = site(self, "ln_final.hook_normalized", make_norm(cfg, "ln_f")(x))
        if hidden:
            return x
        if cfg.tie_embeddings:
            return x @ embed.T
        return nn.Dense(cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=dt, name="unembed")(x)

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
