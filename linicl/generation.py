"""Greedy and sampled generation with a decode state, for both attention kinds.

Every layer keeps its running state in the ``"decode"`` collection: linear attention its (S, z),
which starts from a converted prompt's ``"prompt_state"`` when there is one, softmax attention its
key-value cache. One ``lax.scan`` over the new tokens: nothing retraces per position.

A row whose logits are not finite never becomes a token id: it gets ``FAILED`` (-1). Under ``jit``
that is how an out-of-range token or a position past ``max_len`` shows (the model turns them into
NaN, ``linicl._validate``); an eager call raises instead.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from linicl import compiled
from linicl._validate import check_fits, check_tokens, is_concrete
from linicl.errors import LiniclError
from linicl.names import DECODE
from linicl.nn.transformer import config_of, position_offset

FAILED = -1  # the token generated from logits that are not finite (NaN or inf)

_NOT_FINITE = ("generate: the model's logits are not finite (NaN or inf), so no token can be chosen; "
               f"those new tokens are {FAILED}. Under jit this is how an out-of-range token id (tokens "
               "must lie in [0, vocab_size)) or a position past max_len (learned positions, the decode "
               "cache) shows; otherwise check the variables for NaN")


def _generate_fn(model, greedy: bool):
    # One compiled function per (model, greedy); a new prompt length or n_new retraces it (shapes).
    return compiled.get(("generate", model, greedy), lambda: jax.jit(_decoder(model, greedy)))


def _decoder(model, greedy: bool):
    """``run(variables, tokens, keys, temperature) -> int32[batch, n_new]`` (n_new = len(keys))."""

    def pick(logits, key, temperature):
        """``logits: f[batch, vocab]`` -> ``int32[batch]``; FAILED for a row that is not all finite
        (argmax and categorical would turn NaN into a valid id, usually 0)."""
        if greedy:
            tok = jnp.argmax(logits, axis=-1)
        else:
            tok = jax.random.categorical(key, logits / temperature, axis=-1)
        finite = jnp.all(jnp.isfinite(logits), axis=-1)
        return jnp.where(finite, tok, FAILED).astype(jnp.int32)

    def run(variables, tokens, keys, temperature):
        logits, state = model.apply(variables, tokens, mutable=[DECODE])
        first = pick(logits[:, -1], keys[0], temperature)

        # A FAILED token fed back is out of range, so the rest of its row fails too.
        def step(carry, key):
            state, tok = carry
            logits, state = model.apply({**variables, **state}, tok[:, None], mutable=[DECODE])
            nxt = pick(logits[:, -1], key, temperature)
            return (state, nxt), nxt

        _, rest = jax.lax.scan(step, (state, first), keys[1:])
        out = jnp.concatenate([first[:, None], rest.T], axis=1)
        # A no-op unless the caller wraps the call in jax.experimental.checkify.checkify.
        checkify.debug_check(jnp.all(out != FAILED), _NOT_FINITE)
        return out

    return run


def _check_finite(out) -> None:
    """Raise for FAILED tokens in a concrete result, naming the rows and the first failing step."""
    arr = np.asarray(out)
    rows = np.flatnonzero((arr == FAILED).any(axis=1))
    if rows.size:
        step = int(np.argmax(arr[rows[0]] == FAILED))
        raise LiniclError(f"{_NOT_FINITE} (batch rows {rows[:8].tolist()}{'...' if rows.size > 8 else ''}; "
                          f"row {rows[0]} from new token {step} on)")


def generate(model, variables, tokens, n_new: int, *, key: Optional[jax.Array] = None,
             temperature: float = 1.0) -> jax.Array:
    """Continue ``tokens: int32[batch, seq]`` by ``n_new`` tokens; greedy when ``key`` is None.

    Sampling uses ``key`` split into one key per new token, so two models with the same logits (e.g. a
    prompted and a converted model) sample the same tokens. Returns ``int32[batch, n_new]``.

    Works under ``jax.jit`` (variables and tokens may be traced; the position offset of converted
    variables is an array). Token ids and positions are checked eagerly when their values are known:
    an out-of-range token or a position past ``max_len`` raises a LiniclError. Under ``jit`` they give
    NaN logits instead, and a row whose logits are not finite gets the token ``FAILED`` = -1 from
    there on (never a valid id); ``jax.experimental.checkify.checkify`` reports it as an error. An
    eager call whose logits are not finite (e.g. NaN variables) raises LiniclError.
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
    out = _generate_fn(model, greedy)(variables, tokens, keys, jnp.asarray(temperature))
    if is_concrete(out):
        _check_finite(out)
    return out
