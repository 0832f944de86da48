"""A small training loop for the zoo's models: staged training in compiled chunks of steps.

A run is a list of ``Stage``s (a curriculum, or one stage). Each stage gives a loss function
``loss_fn(params, key) -> (loss, aux)`` that draws its own fresh data from ``key``; ``train_stages``
runs its steps in chunks of ``chunk`` optimiser steps, each chunk one ``jax.lax.scan`` under one
``jax.jit`` (``scan_chunk``), so that a CPU pays Python's overhead once per chunk, not per step. Step
``s`` of stage ``i`` draws from ``fold_in(fold_in(key, i), s)``: a stage's data do not depend on the
chunk length, and a resumed or re-chunked run sees the same data.

``warmup_cosine_adam``: Adam with global-norm clipping at 1 and a linear warm-up then a cosine decay
to ``lr / 10`` over all steps. ``warmup_constant_adamw``: AdamW with global-norm clipping at 1, a linear
warm-up then a constant rate, and weight decay on the matrices only (``decay_mask``).
``steps_to_threshold``: the first evaluated step at which a curve exceeds a threshold.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from linicl.errors import LiniclError

__all__ = ["Stage", "warmup_cosine_adam", "warmup_constant_adamw", "decay_mask", "DECAYED", "scan_chunk",
           "train_stages", "steps_to_threshold"]

# The parameters weight decay acts on by default: the matrices (dense kernels, token and position
# embeddings), not LayerNorm scales, projection biases or trainable bias terms (decay would pull those
# towards zero, for the bias terms the no-bias model).
DECAYED = ("kernel", "embed", "pos_embed")


class Stage(NamedTuple):
    """One phase of training: ``steps`` optimiser steps on one kind of data. ``sub_vocab`` and
    ``sizes`` say what the data are and are the task's to read (MQAR: tokens from a ``sub_vocab``-token
    part of the vocabulary, one batch per ``(n_pairs, n_queries, batch)`` of ``sizes`` in every step;
    regression: ``sub_vocab`` 0 and ``sizes`` the one ``(n_examples, d_x, batch)``). Two stages with the
    same ``(sub_vocab, sizes)`` share one compiled chunk."""

    name: str
    steps: int
    sub_vocab: int
    sizes: tuple


def warmup_cosine_adam(lr: float, total_steps: int, clip: float = 1.0) -> optax.GradientTransformation:
    """Adam, gradients clipped to global norm ``clip``, the learning rate warmed up linearly from 0
    over ``min(100, total_steps / 10)`` steps (at least 1) then cosine-decayed to ``lr / 10`` at
    ``total_steps``."""
    if not lr > 0:
        raise LiniclError(f"lr must be > 0, got {lr!r}")
    if not isinstance(total_steps, int) or total_steps < 0:
        raise LiniclError(f"total_steps must be an int >= 0, got {total_steps!r}")
    warmup = max(1, min(100, total_steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adam(schedule))


def decay_mask(params, decayed=DECAYED) -> dict:
    """``params``' tree of bools: True at the leaves whose name is in ``decayed`` (the ``mask`` of
    ``optax.adamw``)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: k[-1] in decayed for k in flat})


def warmup_constant_adamw(lr: float, warmup: int, weight_decay: float, *, decayed=DECAYED,
                          clip: float = 1.0) -> optax.GradientTransformation:
    """AdamW, gradients clipped to global norm ``clip``, the learning rate warmed up linearly from 0 to
    ``lr`` over ``max(warmup, 1)`` steps and then constant; weight decay ``weight_decay`` on the
    parameters named in ``decayed`` only (``decay_mask``)."""
    if not lr > 0:
        raise LiniclError(f"lr must be > 0, got {lr!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise LiniclError(f"warmup must be an int >= 0, got {warmup!r}")
    if not weight_decay >= 0:
        raise LiniclError(f"weight_decay must be >= 0, got {weight_decay!r}")
    schedule = optax.warmup_constant_schedule(0.0, lr, max(warmup, 1))
    mask = functools.partial(decay_mask, decayed=tuple(decayed))
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay, mask=mask))


def steps_to_threshold(steps: Sequence[int], values: Sequence[float], threshold: float) -> Optional[int]:
    """The first of ``steps`` whose value (``values``, aligned with ``steps``) exceeds ``threshold``
    (strictly), or None if none does: e.g. the steps a run took to an in-context accuracy."""
    if len(steps) != len(values):
        raise LiniclError(f"steps and values must be aligned, got {len(steps)} steps and {len(values)} values")
    for s, v in zip(steps, values):
        if v > threshold:
            return int(s)
    return None


def scan_chunk(loss_fn: Callable, opt: optax.GradientTransformation, length: int,
               compiler_options: Optional[dict] = None) -> Callable:
    """A jitted ``(params, opt_state, key, start) -> (params, opt_state, loss f32[length], aux[length,
    ...])``: ``length`` optimiser steps on ``loss_fn(params, key) -> (loss, aux)``, step ``s`` (from
    ``start``, an int32 scalar) drawing its data from ``fold_in(key, s)``."""
    if not isinstance(length, int) or length < 1:
        raise LiniclError(f"length must be an int >= 1, got {length!r}")

    def step(carry, s):
        params, opt_state, key = carry
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, jax.random.fold_in(key, s))
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), (loss, aux)

    def chunk(params, opt_state, key, start):
        steps = start + jnp.arange(length)
        (params, opt_state, _), (loss, aux) = jax.lax.scan(step, (params, opt_state, key), steps)
        return params, opt_state, loss, aux

    return jax.jit(chunk, compiler_options=compiler_options)


def train_stages(params, plan: Sequence[Stage], loss_for: Callable, opt: optax.GradientTransformation, key, *,
                 chunk: int, record: Callable = lambda stage, aux: {}, on_chunk: Optional[Callable] = None,
                 compiler_options: Optional[dict] = None) -> tuple:
    """Train ``params`` through the stages of ``plan``; ``(params, history)``.

    Args:
      params: the initial parameters (any pytree ``loss_for``'s functions take).
      plan: the stages, in order.
      loss_for: ``stage -> loss_fn(params, key) -> (loss, aux)``, called once per distinct
        ``(sub_vocab, sizes, chunk length)``.
      opt: the optimiser; its state starts at ``opt.init(params)``.
      key: a PRNG key; stage ``i`` draws from ``fold_in(key, i)`` (module docstring).
      chunk: optimiser steps per compiled chunk (the last chunk of a stage may be shorter).
      record: ``(stage, aux[length, ...]) -> dict``, the task's own part of a history entry.
      on_chunk: called as ``on_chunk(stage, length, entry)`` after every chunk (a progress bar).
      compiler_options: for ``jax.jit`` of every chunk (``linicl.timing``'s presets).
    Returns:
      ``params`` trained, and ``history``: per chunk ``dict(stage, step, loss, **record(...), seconds)``:
      the stage's name, the steps done so far, the chunk's mean loss and the seconds since the start
      (compilation included).
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise LiniclError(f"chunk must be an int >= 1, got {chunk!r}")
    opt_state = opt.init(params)
    history, done, fns, t0 = [], 0, {}, time.perf_counter()
    for index, stage in enumerate(plan):
        stage_key = jax.random.fold_in(key, index)
        for start in range(0, stage.steps, chunk):
            length = min(chunk, stage.steps - start)
            shape = (stage.sub_vocab, stage.sizes, length)  # stages of the same data share a compilation
            if shape not in fns:
                fns[shape] = scan_chunk(loss_for(stage), opt, length, compiler_options)
            params, opt_state, loss, aux = fns[shape](params, opt_state, stage_key, jnp.int32(start))
            done += length
            history.append(dict(stage=stage.name, step=done, loss=float(np.mean(loss)), **record(stage, aux),
                                seconds=time.perf_counter() - t0))
            if on_chunk is not None:
                on_chunk(stage, length, history[-1])
    return params, history
