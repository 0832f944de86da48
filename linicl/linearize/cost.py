"""What a prompt turned into weights saves a linearized student: the time of a query read alone after
``iclca.convert`` against the same query read after its prompt, and the floats the state holds
against a softmax model's KV cache for the same prompt, at several prompt lengths."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from linicl import iclca
from linicl.errors import LiniclError
from linicl.memory import kv_cache_floats, prompt_floats
from linicl.metrics import rel_err
from linicl.names import PROMPT_STATE
from linicl.timing import time_call


def conversion_cost(model, variables, lengths: Sequence[int], *, query_len: int = 16, repeats: int = 3) -> list:
    """One row per prompt length n: a random prompt ``int32[1, n]`` (key n) and a query of ``query_len``
    ones, read prompted (``prompted_s``, prompt + query in one call) and converted (``converted_s``, the
    query alone on ``iclca.convert``'s variables), median seconds of ``repeats`` jitted calls
    (``timing.time_call``, compile excluded); ``logits_rel_err``: max |converted - prompted| over the
    query logits / max |prompted| (the conversion's rounding error, ``metrics.rel_err``);
    ``state_floats``: the floats of the converted prompt state (``memory.prompt_floats``: its int32
    positions are not floats; the same for every n, ``iclca.state_floats``);
    ``kv_cache_floats``: a softmax model's cache for n tokens (``memory.kv_cache_floats``). Timings
    are for reports, never assertions."""
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise LiniclError(f"lengths must be positive ints (prompt lengths), got {list(lengths)!r}")
    if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1:
        raise LiniclError(f"query_len must be a positive int, got {query_len!r}")
    rows = []
    query = jnp.ones((1, query_len), jnp.int32)
    fwd = jax.jit(model.apply)
    for n in lengths:
        prompt = jax.random.randint(jax.random.PRNGKey(n), (1, n), 0, model.cfg.vocab_size, jnp.int32)
        converted = iclca.convert(model, variables, prompt)
        full = jnp.concatenate([prompt, query], axis=1)
        err = rel_err(fwd(converted, query), fwd(variables, full)[:, n:])
        rows.append(dict(prompt_len=n, prompted_s=time_call(fwd, variables, full, repeats=repeats),
                         converted_s=time_call(fwd, converted, query, repeats=repeats), logits_rel_err=err,
                         state_floats=prompt_floats({PROMPT_STATE: converted[PROMPT_STATE]}),
                         kv_cache_floats=kv_cache_floats(model.cfg, n)))
    return rows


__all__ = ["conversion_cost"]
