"""Greedy and sampled generation with a decode state, for both attention kinds.

Every layer keeps its running state in the ``"decode"`` collection: linear attention its (S, z),
which starts from a converted prompt's ``"prompt_state"`` when there is one, softmax attention its
key-value cache. Two compiled functions: a prefill reads the prompt (compiled per length bucket
where right padding is exact, causal softmax attention, else per length), and one ``lax.scan`` makes
the new tokens (compiled once per batch size and number of new tokens, whatever the prompt length):
nothing retraces per position, nor per prompt length within a bucket.

A row whose logits are not finite never becomes a token id: it gets ``FAILED`` (-1). Under ``jit``
that is how an out-of-range token or a position past ``max_len`` shows (the model turns them into
NaN, ``linicl._validate``); an eager call raises instead.
"""

from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from linicl import compiled
from linicl._validate import check_fits, check_tokens, is_concrete
from linicl.errors import LiniclError
from linicl.names import DECODE, POSITION, PROMPT_APPROX
from linicl.nn.transformer import config_of, position_offset, unembed

FAILED = -1  # the token generated from logits that are not finite (NaN or inf)

_NOT_FINITE = ("generate: the model's logits are not finite (NaN or inf), so no token can be chosen; "
               f"those new tokens are {FAILED}. Under jit this is how an out-of-range token id (tokens "
               "must lie in [0, vocab_size)) or a position past max_len (learned positions, the decode "
               "cache) shows; otherwise check the variables for NaN")


def _pick(logits, key, temperature, greedy: bool):
    """``logits: f[batch, vocab]`` -> ``int32[batch]``; FAILED for a row that is not all finite
    (argmax and categorical would turn NaN into a valid id, usually 0)."""
    if greedy:
        tok = jnp.argmax(logits, axis=-1)
    else:
        tok = jax.random.categorical(key, logits / temperature, axis=-1)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(finite, tok, FAILED).astype(jnp.int32)


def _prefill_fn(model):
    """jit ``(variables, tokens, length) -> (decode state, logits f[batch, vocab] at the last prompt
    token)``. ``tokens: int32[batch, T]`` holds the prompt in its first ``length`` (``int32[]``)
    columns; the rest is right padding (``_padded_length``), which the returned state forgets. One
    compile per padded length T: prompts of other lengths in the same bucket reuse it."""
    def prefill(variables, tokens, length):
        # Only the last prompt token is unembedded: never the [batch, T, vocab] logits.
        h, state = model.apply(variables, tokens, hidden=True, mutable=[DECODE])
        last = jax.lax.dynamic_index_in_dim(h, length - 1, axis=1, keepdims=False)
        return _forget_padding(state, tokens.shape[1] - length), unembed(config_of(model), variables["params"], last)
    return compiled.get(("generate.prefill", model), lambda: jax.jit(prefill))


def _decode_fn(model, greedy: bool):
    """jit ``(variables, state, last, key, temperature, n_new) -> int32[batch, n_new]``: the first new
    token picked from the prompt's ``last`` logits, then one ``lax.scan`` step per further token,
    each feeding back the token before. Sampling splits ``key`` into one key per new token (the
    first for the first token); greedy decoding ignores it. The decode state has the same shapes for
    every prompt length (softmax: a ``max_len`` cache; linear: the (S, z) state), so this compiles
    once per batch size and ``n_new`` (static)."""
    def decode(variables, state, last, key, temperature, n_new):
        keys = jnp.zeros((n_new, 2), jnp.uint32) if greedy else jax.random.split(key, n_new)
        first = _pick(last, keys[0], temperature, greedy)

        # A FAILED token fed back is out of range, so the rest of its row fails too.
        def step(carry, key):
            state, tok = carry
            logits, state = model.apply({**variables, **state}, tok[:, None], mutable=[DECODE])
            nxt = _pick(logits[:, -1], key, temperature, greedy)
            return (state, nxt), nxt

        _, rest = jax.lax.scan(step, (state, first), keys[1:])
        out = jnp.concatenate([first[:, None], rest.T], axis=1)
        # A no-op unless the caller wraps the call in jax.experimental.checkify.checkify.
        checkify.debug_check(jnp.all(out != FAILED), _NOT_FINITE)
        return out
    return compiled.get(("generate.decode", model, greedy), lambda: jax.jit(decode, static_argnums=5))


def _forget_padding(state, n_pad):
    """The decode state after a padded prefill, as if only the real tokens had been read: the
    counters of tokens read (``n_tokens``, a softmax cache's fill ``index``) go back by ``n_pad``.
    The padding's keys stay in the cache, at positions later than the query's, so the causal mask
    hides each of them until the decode overwrites its slot with a real token at that position."""
    def rewind(path, leaf):
        return leaf - n_pad if getattr(path[-1], "key", None) in ("n_tokens", "index") else leaf
    return jax.tree_util.tree_map_with_path(rewind, state)


def _padded_length(cfg, variables, n: int) -> int:
    """The prefill length of an ``n``-token prompt: its bucket (``compiled.geometric_bucket``) where
    right padding is exact, else ``n``.

    Exact: causal softmax attention, whose decode cache keeps every key with its position (the padding
    is hidden by the causal mask and overwritten), with nothing in ``variables`` that depends on the
    sequence length (edits, captured activations). Not with learned positions after a stored prompt
    (the offset could push the padding past ``max_len``, whose NaN would reach the real tokens through
    the attention weights' zeros), nor with linear attention, whose state would sum the padding, nor
    with local layers, whose window would keep the padding instead of the last real tokens."""
    if cfg.attention != "softmax" or not cfg.causal or cfg.has_local_layers:
        return n
    if not set(variables) <= {"params", PROMPT_APPROX, POSITION}:
        return n
    if cfg.positions == "learned" and POSITION in variables:
        return n
    return max(n, min(compiled.geometric_bucket(n), cfg.max_len))


def _cache_sized(model, slots: int):
    """The model with its softmax decode cache cut from ``max_len`` slots to the bucket of the
    ``slots`` a generation fills, its padded prompt and new tokens (``compiled.geometric_bucket``: a
    handful of shapes to compile).
    Every decode step reads every slot of the cache, nearly all of them empty for a short answer
    after a short prompt. Only where ``max_len`` bounds nothing but the cache: positions that are not
    a learned table (whose size is ``max_len``)."""
    cfg = config_of(model)
    if cfg.attention != "softmax" or cfg.positions == "learned":
        return model
    size = min(cfg.max_len, compiled.geometric_bucket(slots))
    return model if size == cfg.max_len else model.clone(cfg=cfg.replace(max_len=size))


def _check_finite(out) -> None:
    """Raise for FAILED tokens in a concrete result, naming the rows and the first failing step."""
    arr = np.asarray(out)
    rows = np.flatnonzero((arr == FAILED).any(axis=1))
    if rows.size:
        step = int(np.argmax(arr[rows[0]] == FAILED))
        raise LiniclError(f"{_NOT_FINITE} (batch rows {rows[:8].tolist()}{'...' if rows.size > 8 else ''}; "
                          f"row {rows[0]} from new token {step} on)")


def _check_n_new(n_new) -> int:
    """``n_new`` as a Python int >= 1 (it is static under ``jit``); a bool is refused, not read as 1."""
    if isinstance(n_new, (bool, np.bool_)) or not isinstance(n_new, (int, np.integer)) or n_new < 1:
        raise LiniclError(f"generate: n_new must be a positive int, got {n_new!r}")
    return int(n_new)


def _check_temperature(temperature) -> float:
    """``temperature`` as a finite float > 0: inf would flatten the logits to a uniform draw, and a
    string or a traced value cannot be checked here (it scales the logits inside the compiled decode)."""
    value = temperature
    if not is_concrete(value):
        raise LiniclError("generate: temperature must be a concrete number, not a traced value (under jit, "
                          "close over a Python float instead of passing it as a jitted argument)")
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
        value = value.item()  # a concrete 0-d array: its number
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not (
            0 < value < float("inf")):
        raise LiniclError(f"generate: temperature must be > 0 and finite (a Python or NumPy real number), "
                          f"got {temperature!r}")
    return float(value)


def _check_key(key) -> None:
    """``key`` must be a JAX PRNG key: a typed key (``jax.random.key``, shape ``()``) or a raw
    ``uint32[2]`` (``jax.random.PRNGKey``). Only dtype and shape are read, so a traced key passes."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    raw = dtype == np.uint32 and tuple(shape or ()) == (2,)
    if not (typed or raw):
        what = f"{dtype}{list(shape)}" if dtype is not None and shape is not None else repr(key)
        raise LiniclError(f"generate: key must be a JAX PRNG key (jax.random.PRNGKey(0) or jax.random.key(0)), "
                          f"or None for greedy decoding, got {what}")


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

    Refused (eagerly, before any tracing): ``n_new`` that is not an int >= 1 (a bool too);
    ``temperature`` that is not a finite real > 0 (inf would sample uniformly; it must be a Python
    or NumPy number, or a concrete 0-d array, even under ``jit``); ``key`` that is not a PRNG key
    (typed, shape ``()``, or raw ``uint32[2]``; an int seed is refused: pass ``jax.random.PRNGKey(0)``).
    """
    cfg = config_of(model)
    tokens = jnp.asarray(check_tokens("tokens", tokens, cfg.vocab_size))
    n_new = _check_n_new(n_new)
    temperature = _check_temperature(temperature)
    if key is not None:
        _check_key(key)
    total = tokens.shape[1] + n_new - 1  # the last new token is never fed back
    if cfg.positions == "learned":
        check_fits("tokens", position_offset(variables), total, cfg.max_len, "generation with learned positions")
    if cfg.attention == "softmax":
        check_fits("tokens", 0, total, cfg.max_len, "generation with the decode cache")
    variables = {k: v for k, v in variables.items() if k != DECODE}  # a fresh decode every call
    greedy = key is None
    n = tokens.shape[1]
    padded = _padded_length(cfg, variables, n)
    if padded > n:  # id 0, which every vocabulary has; never read (_forget_padding)
        pad = ((0, 0), (0, padded - n))
        tokens = jnp.asarray(np.pad(np.asarray(tokens), pad)) if is_concrete(tokens) else jnp.pad(tokens, pad)
    # The cache holds the padded prompt and every new token but the last: sized from the padded length,
    # not the real one, so that every prompt of a prefill bucket shares one cache size (one prefill and
    # one decode to compile per bucket, not two where the real lengths straddle a cache bucket).
    model = _cache_sized(model, padded + n_new - 1)
    state, last = _prefill_fn(model)(variables, tokens, jnp.asarray(n, jnp.int32))
    key = np.zeros(2, np.uint32) if greedy else key  # greedy: a placeholder, never read
    out = _decode_fn(model, greedy)(variables, state, last, key, jnp.asarray(temperature), n_new)
    if is_concrete(out):
        _check_finite(out)
    return out
