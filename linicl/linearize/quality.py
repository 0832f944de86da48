"""How close a student is to its teacher as a language model: next-token loss by position bucket, for
the teacher, the student and the student read with other windows and sinks than it was trained with
(the same maps: how much of its quality the exact window carries)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import compiled
from linicl.errors import LiniclError


def _nll_fn(model):
    def nll(variables, tokens):
        logits = model.apply(variables, tokens)[:, :-1]
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # bf16 -> f32; f64 stays
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


def window_variants(student, *, window: Optional[int] = None, sinks: Optional[int] = None) -> dict:
    """``{"student w{W} s{S} (same maps)": model}``: the student's model with the softmax window W and
    sinks S swapped, for (W, S) in (0, 0), (0, sinks), (window, 0), (4 window, sinks), leaving out the
    setting it was trained with (``window``, ``sinks``; default: the student's own). The maps and every
    weight are unchanged, so each runs on the student's variables."""
    cfg = student.cfg
    window = cfg.window if window is None else window
    sinks = cfg.sinks if sinks is None else sinks
    for name, value in (("window", window), ("sinks", sinks)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise LiniclError(f"{name} must be a nonnegative int, got {value!r}")
    out = {}
    for w, s in ((0, 0), (0, sinks), (window, 0), (4 * window, sinks)):
        if (w, s) != (window, sinks):
            out[f"student w{w} s{s} (same maps)"] = type(student)(cfg.replace(window=w, sinks=s))
    return out


def held_out_losses(models: Mapping[str, tuple], tokens, *, batch_size: int = 2) -> dict:
    """``next_token_loss`` of held-out ``tokens: int[n, T]`` for every ``name: (model, variables)`` of
    ``models``, in their order, without the per-position lists: ``{name: {"mean", "by_position",
    "n"}}``."""
    if not models:
        raise LiniclError("held_out_losses: models is empty (want {name: (model, variables)})")
    out = {}
    for name, pair in models.items():
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise LiniclError(f"models[{name!r}] must be a (model, variables) pair, got {type(pair).__name__}")
        loss = next_token_loss(*pair, tokens, batch_size=batch_size)
        loss.pop("per_position")
        out[name] = loss
    return out
