"""How close a student is to its teacher as a language model: next-token loss by position."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import compiled


def _nll_fn(model):
    def nll(variables, tokens):
        logits = model.apply(variables, tokens)[:, :-1].astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]  # [b, T - 1]
    return compiled.get(("linearize.nll", model), lambda: jax.jit(nll))


def next_token_loss(model, variables, tokens, *, batch_size: int = 8,
                    buckets: Sequence[int] = (0, 16, 32, 64, 128, 256, 512, 1024, 2048)) -> dict:
    """Mean next-token NLL (nats) of ``tokens: int[n, T]`` overall and by position bucket: the loss of
    predicting token t + 1 from 0..t, grouped by t in [buckets[j], buckets[j + 1]). Returns
    ``{"mean": float, "by_position": {"lo-hi": float}, "per_position": [T - 1 floats], "n": n}``."""
    tokens = np.asarray(tokens, np.int32)
    fn = _nll_fn(model)
    parts = [np.asarray(fn(variables, jnp.asarray(tokens[i:i + batch_size])))
             for i in range(0, len(tokens), batch_size)]
    nll = np.concatenate(parts)  # [n, T - 1]
    per_position = nll.mean(axis=0)
    edges = [b for b in buckets if b < nll.shape[1]] + [nll.shape[1]]
    by = {f"{lo}-{hi - 1}": float(per_position[lo:hi].mean()) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo}
    return dict(mean=float(nll.mean()), by_position=by, per_position=per_position.tolist(), n=int(len(tokens)))
