"""Greedy and sampled generation with a decode state, for both attention kinds.

Every layer keeps its running state in the ``"decode"`` collection: linear attention its (S, z),
which starts from a converted prompt's ``"prompt_state"`` when there is one, softmax attention its
key-value cache. One ``lax.scan`` over the new tokens: nothing retraces per position.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from linicl import compiled
from linicl._validate import check_fits, check_tokens
from linicl.errors import LiniclError
from linicl.names import DECODE
from linicl.nn.transformer import config_of, position_offset


def _generate_fn(model, greedy: bool):
    # One compiled function per (model, greedy); a new prompt length or n_new retraces it (shapes).
    return compiled.get(("generate", model, greedy), lambda: jax.jit(_decoder(model, greedy)))


def _decoder(model, greedy: bool):
    """``run(variables, tokens, keys, temperature) -> int32[batch, n_new]`` (n_new = len(keys))."""

    def pick(logits, key, temperature):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

    def run(variables, tokens, keys, temperature):
        logits, state = model.apply(variables, tokens, mutable=[DECODE])
        first = pick(logits[:, -1], keys[0], temperature)

        def step(carry, key):
            state, tok = carry
            logits, state = model.apply({**variables, **state}, tok[:, None], mutable=[DECODE])
            nxt = pick(logits[:, -1], key, temperature)
            return (state, nxt), nxt

        _, rest = jax.lax.scan(step, (state, first), keys[1:])
        return jnp.concatenate([first[:, None], rest.T], axis=1)

    return run


def generate(model, variables, tokens, n_new: int, *, key: Optional[jax.Array] = None,
             temperature: float = 1.0) -> jax.Array:
    """Continue ``tokens: int32[batch, seq]`` by ``n_new`` tokens; greedy when ``key`` is None.

    Sampling uses ``key`` split into one key per new token, so two models with the same logits (e.g. a
    prompted and a converted model) sample the same tokens. Returns ``int32[batch, n_new]``.
    """
    cfg = config_of(model)
    tokens = jnp.asarray(check_tokens("tokens", tokens, cfg.vocab_size))
    if not isinstance(n_new, int) or n_new < 1:
        raise LiniclError(f"n_new must be a positive int, got {n_new!r}")
    if not temperature > 0:
        raise LiniclError(f"temperature must be > 0, got {temperature!r}")
    total = tokens.shape[1] + n_new - 1  # the last new token is never fed back
    if cfg.positions == "learned":
        check_fits("tokens", position_offset(variables), total, cfg.max_len, "generation with learned positions")
    if cfg.attention == "softmax":
        check_fits("tokens", 0, total, cfg.max_len, "generation with the decode cache")
    variables = {k: v for k, v in variables.items() if k != DECODE}  # a fresh decode every call
    greedy = key is None
    keys = jnp.zeros((n_new, 2), jnp.uint32) if greedy else jax.random.split(key, n_new)
    return _generate_fn(model, greedy)(variables, tokens, keys, jnp.asarray(temperature))
