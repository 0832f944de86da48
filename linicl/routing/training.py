"""Training the router (ICR's objective, routing.md section 2.5) with the LM frozen.

    L = CE + conf * relu(H_icr - H_zs) + spar * mean_l w_l |alpha_l|_1 / r + gate * mean_l |gamma_l|_1 / H

with alpha scaled by a cosine 1.0 -> 0.8 over training, AdamW and gradient clipping. The residual
entering the first routed layer does not depend on the router, so ``prepare`` computes it once per
query and each step runs only the routed blocks. ``train_router(checkpoint=...)`` saves its state
through ``linicl.checkpoint`` and resumes bit-identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linicl import checkpoint as ckpt
from linicl.errors import DataError
from linicl.names import block_site
from linicl.activations import collect_activations
from linicl.routing.pids import PIDs
from linicl.routing.router import make_router, routed_logits

_TRAINER = "linicl.routing.train_router"


@dataclass
class TrainingData:
    """Cached zero-shot queries: the residual entering the first routed layer ``h0: [N, T, d_model]``
    (right-padded), ``lengths``, the answer's first token ``y`` and the zero-shot entropy ``H_zs``."""

    h0: np.ndarray
    lengths: np.ndarray
    y: np.ndarray
    H_zs: np.ndarray


def prepare(model, variables, prompts, answer_ids, pids: PIDs, *, batch_size: int = 16,
            progress: bool = False) -> TrainingData:
    """Run the frozen model once over zero-shot prompts (``linicl.data.Prompt``): cache what training
    needs (one forward per query instead of one per step)."""
    from linicl.evaluate import run_logprobs  # linicl.evaluate is heavy and needs nothing from here
    entry = block_site(pids.layers[0], "hook_resid_pre")
    lengths = np.asarray([len(getattr(p, "tokens", p)) for p in prompts], np.int32)
    T = int(lengths.max())

    def whole(act, n, tokens, lengths):  # every position, cut or zero-padded to the longest prompt
        act = act[:, :T]
        return jnp.pad(act, ((0, 0), (0, T - act.shape[1]), (0, 0)))
    h0 = collect_activations(model, variables, prompts, [entry], batch_size=batch_size, progress=progress,
                             reduce=whole)[entry].astype(np.float32)
    h0 = np.where(np.arange(T)[None, :, None] < lengths[:, None, None], h0, 0.0)
    logprobs = np.stack(run_logprobs(model, variables, prompts, batch_size=batch_size))
    H_zs = -np.sum(np.exp(logprobs) * logprobs, axis=-1)
    return TrainingData(h0=h0, lengths=lengths, y=np.asarray(answer_ids, np.int32), H_zs=H_zs.astype(np.float32))


@dataclass(frozen=True)
class LossWeights:
    """The paper's weights (routing.md, section 2.5) and the depth weights' range of the sparsity term."""

    conf: float = 0.01
    spar: float = 1e-3
    gate: float = 0.02
    depth_max: float = 3.0


def _entropy(logits):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(lp) * lp, axis=-1)


def icr_loss(router_params, model, variables, pids, router, batch, alpha_scale, weights: LossWeights):
    """L = CE + conf * relu(H_icr - H_zs) + spar * mean_l w_l |alpha_l|_1 / r + gate * mean_l |gamma_l|_1 / H."""
    h0, lengths, y, H_zs = batch
    logits, (alpha, gamma) = routed_logits(model, variables, pids, router, router_params, h0, lengths,
                                           alpha_scale)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(lp, y[:, None], axis=1))
    conf = jnp.mean(jax.nn.relu(_entropy(logits) - H_zs))
    depth = jnp.linspace(1.0, weights.depth_max, alpha.shape[1])
    spar = jnp.mean(jnp.sum(depth * jnp.abs(alpha).mean(-1), axis=1) / alpha.shape[1])
    gate = jnp.mean(jnp.abs(gamma).mean(-1).mean(-1))
    total = ce + weights.conf * conf + weights.spar * spar + weights.gate * gate
    return total, {"loss": total, "ce": ce, "conf": conf, "spar": spar, "gate": gate}


def alpha_schedule(progress: float, start: float = 1.0, end: float = 0.8) -> float:
    """The alpha scale, cosine-annealed from ``start`` to ``end`` as training ``progress`` goes 0 -> 1."""
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def _resume(path, params, opt, total: int):
    """``(step, params, opt, history)`` from a training checkpoint of a ``total``-step run."""
    stored = ckpt.header(path).settings
    if stored.get("trainer") == _TRAINER and stored.get("total_steps") != total:
        raise DataError(f"{path} is a checkpoint of a {stored.get('total_steps')}-step run, this run has "
                        f"{total} steps (other data, epochs or batch size); delete it to start afresh")
    state, meta = ckpt.load(path, {"params": params, "opt": opt}, settings=_checkpoint_settings(total))
    return int(meta["step"]), state["params"], state["opt"], list(meta["history"])


def _checkpoint_settings(total: int) -> dict:
    return {"trainer": _TRAINER, "total_steps": total}


def train_router(model, variables, pids: PIDs, data: TrainingData, *, epochs: int = 2, batch_size: int = 8,
                 lr: float = 1e-3, weight_decay: float = 1e-2, clip: float = 1.0, hidden: int = 256,
                 weights: LossWeights = LossWeights(), seed: int = 0, progress: bool = True,
                 log_every: int = 10, checkpoint=None, checkpoint_every: int = 50):
    """Train only the router (the LM's variables are constants of the loss). Returns ``(router,
    params, history)`` with the loss terms logged every ``log_every`` steps.

    ``checkpoint``: a file path. Every ``checkpoint_every`` steps and at the end, the router params, the
    optimiser state, the step and the history are written there (``linicl.checkpoint``, atomically);
    if the file exists when training starts, training resumes from it and ends with the same params
    as an uninterrupted run (the batch order is a function of ``seed`` and the epoch). A checkpoint
    of a run with another number of steps is refused."""
    from tqdm.auto import tqdm
    router, params = make_router(model, pids, hidden=hidden, seed=seed)
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr, weight_decay=weight_decay))
    opt = tx.init(params)
    N = len(data.y)
    steps_per_epoch = max(1, N // batch_size)
    total = epochs * steps_per_epoch
    history: list = []
    start = 0
    if checkpoint is not None and ckpt.exists(checkpoint):
        start, params, opt, history = _resume(checkpoint, params, opt, total)

    @jax.jit
    def step(params, opt, batch, scale):
        (_, logs), grads = jax.value_and_grad(icr_loss, has_aux=True)(
            params, model, variables, pids, router, batch, scale, weights)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, logs

    rng = np.random.default_rng(seed)
    bar = tqdm(total=total, initial=start, desc="router", disable=not progress)
    for epoch in range(epochs):
        order = rng.permutation(N)  # drawn for every epoch, also skipped ones: resuming keeps the order
        for s in range(steps_per_epoch):
            t = epoch * steps_per_epoch + s
            if t < start:
                continue
            idx = order[s * batch_size:(s + 1) * batch_size]
            batch = (jnp.asarray(data.h0[idx]), jnp.asarray(data.lengths[idx]), jnp.asarray(data.y[idx]),
                     jnp.asarray(data.H_zs[idx]))
            params, opt, logs = step(params, opt, batch, jnp.float32(alpha_schedule(t / max(1, total - 1))))
            if t % log_every == 0 or t == total - 1:
                history.append({"step": t, **{k: float(v) for k, v in logs.items()}})
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
            bar.update(1)
            if checkpoint is not None and ((t + 1) % checkpoint_every == 0 or t == total - 1):
                ckpt.save(checkpoint, {"params": params, "opt": opt}, settings=_checkpoint_settings(total),
                          meta={"step": t + 1, "history": history})
    bar.close()
    return router, params, history
