"""Training the router (ICR's objective, routing.md section 2.5) with the LM frozen.

    L = CE + conf * relu(H_icr - H_zs) + spar * mean_l w_l |alpha_l|_1 / r + gate * mean_l |gamma_l|_1 / H

with alpha scaled by a cosine 1.0 -> 0.8 over training (the trained router keeps the last value for
inference, ``Router.alpha_scale``), AdamW and gradient clipping. CE is over the whole vocabulary as in
the paper (``target="vocab"``), or over each query's label words (``target="labels"``, an option of
ours: a small LM's full-vocabulary CE mostly teaches the answer format). The history logs every term and
the bias's size per routed layer (``bias_size``, to set beside the model's own logit spread). The residual
entering the first routed layer does not depend on the router, so ``prepare`` computes it once per
query and each step runs only the routed blocks. ``train_router(checkpoint=...)`` saves its state
through ``linicl.checkpoint`` and resumes bit-identically.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linicl import checkpoint as ckpt
from linicl.errors import DataError, LiniclError
from linicl.names import ICR_TARGETS
from linicl.parallel import data_size, device_mesh, place, replicate, shard_batch
from linicl.precision import in_compute_dtype
from linicl.routing.pids import PIDs
from linicl.routing.router import entry_residuals, make_router, routed_logits

_TRAINER = "linicl.routing.train_router"


@dataclass
class TrainingData:
    """Cached zero-shot queries: the residual entering the first routed layer ``h0: [N, T, d_model]``
    (right-padded), ``lengths``, the answer's first token ``y``, the zero-shot entropy ``H_zs`` and,
    for ``target="labels"``, each query's label-word tokens ``candidates: [N, C]`` (-1 pads; ``y`` one
    of them), and, for a router that reads an external embedding of each query (the paper's MiniLM),
    ``e: f32[N, d_in]`` (None: the router reads the mean-pooled ``h0``)."""

    h0: np.ndarray
    lengths: np.ndarray
    y: np.ndarray
    H_zs: np.ndarray
    candidates: Optional[np.ndarray] = None
    e: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.e is not None and (np.ndim(self.e) != 2 or len(self.e) != len(self.y)
                                   or not np.all(np.isfinite(self.e))):
            raise LiniclError(f"e: expected finite router inputs f32[N={len(self.y)}, d_in], one row per query, "
                              f"got shape {np.shape(self.e)}")


def prepare(model, variables, prompts, answer_ids, pids: PIDs, *, candidates=None, e=None,
            batch_size: int = 16, progress: bool = False) -> TrainingData:
    """Run the frozen model once over zero-shot prompts (``linicl.data.Prompt``): cache what training
    needs (one forward per query instead of one per step). ``candidates``: per prompt the token ids
    of its task's label words (a ragged list), needed by ``target="labels"``. ``e``: an external
    embedding per prompt ``f[N, d_in]`` for the router to read (``TrainingData.e``)."""
    from linicl.evaluate import run_logprobs  # linicl.evaluate is heavy and needs nothing from here
    lengths = np.asarray([len(getattr(p, "tokens", p)) for p in prompts], np.int32)
    h0 = entry_residuals(model, variables, prompts, pids.layers[0], batch_size=batch_size, progress=progress)
    logprobs = np.stack(run_logprobs(model, variables, prompts, batch_size=batch_size))
    H_zs = -np.sum(np.exp(logprobs) * logprobs, axis=-1)
    y = np.asarray(answer_ids, np.int32)
    return TrainingData(h0=h0, lengths=lengths, y=y, H_zs=H_zs.astype(np.float32),
                        candidates=None if candidates is None else _candidate_array(candidates, y, logprobs.shape[-1]),
                        e=None if e is None else np.asarray(e, np.float32))


def _candidate_array(candidates, y, vocab: int) -> np.ndarray:
    """Ragged label-token lists -> ``[N, C]`` int32 padded with -1, each row holding its answer."""
    if len(candidates) != len(y):
        raise LiniclError(f"candidates: expected one list of label tokens per prompt ({len(y)}), got {len(candidates)}")
    width = max(len(c) for c in candidates)
    out = np.full((len(y), width), -1, np.int32)
    for i, c in enumerate(candidates):
        c = [int(t) for t in c]
        if int(y[i]) not in c or len(set(c)) != len(c) or not all(0 <= t < vocab for t in c):
            raise LiniclError(f"candidates[{i}]: expected distinct label tokens in [0, {vocab}) holding the answer "
                              f"{int(y[i])}, got {c}")
        out[i, :len(c)] = c
    return out


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


def _label_ce(logits, y, candidates):
    """-log softmax over the candidate tokens (-1: none) at the answer's token."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    picked = jnp.take_along_axis(logits, jnp.maximum(candidates, 0), axis=1)
    picked = jnp.where(candidates >= 0, picked, -jnp.inf)
    gold = jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(picked, axis=1) - gold)


def icr_loss(router_params, model, variables, pids, router, batch, alpha_scale, weights: LossWeights,
             target: str = "vocab"):
    """L = CE + conf * relu(H_icr - H_zs) + spar * mean_l w_l |alpha_l|_1 / r + gate * mean_l |gamma_l|_1 / H.
    ``batch``: (h0, lengths, y, H_zs), then candidates (for ``target="labels"``; else None) and the
    router's input embeddings ``e`` (None: the mean-pooled h0), each optional."""
    h0, lengths, y, H_zs = batch[:4]
    e = batch[5] if len(batch) > 5 else None
    logits, (alpha, gamma), size = routed_logits(model, variables, pids, router, router_params, h0, lengths,
                                                 alpha_scale, with_bias_size=True, e=e)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(lp, y[:, None], axis=1)) if target == "vocab" else \
        _label_ce(logits, y, batch[4])
    conf = jnp.mean(jax.nn.relu(_entropy(logits) - H_zs))
    depth = jnp.linspace(1.0, weights.depth_max, alpha.shape[1])
    spar = jnp.mean(jnp.sum(depth * jnp.abs(alpha).mean(-1), axis=1) / alpha.shape[1])
    gate = jnp.mean(jnp.abs(gamma).mean(-1).mean(-1))
    total = ce + weights.conf * conf + weights.spar * spar + weights.gate * gate
    return total, {"loss": total, "ce": ce, "conf": conf, "spar": spar, "gate": gate, "bias_size": size}


def _optimizer(lr: float, weight_decay: float, clip: float):
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr, weight_decay=weight_decay))


@functools.partial(jax.jit, static_argnames=("model", "router", "weights", "target", "hyper"))
def _step(params, opt, batch, scale, variables, bias, *, model, router, weights, target, hyper):
    """One optimiser step. The LM's variables and the bias (``RoutingBias``) are arguments, not
    constants: one compilation per model, router shape, loss and batch shape serves every arm."""
    (_, logs), grads = jax.value_and_grad(icr_loss, has_aux=True)(
        params, model, variables, bias, router, batch, scale, weights, target)
    updates, opt = _optimizer(*hyper).update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, logs


def alpha_schedule(progress: float, start: float = 1.0, end: float = 0.8) -> float:
    """The alpha scale, cosine-annealed from ``start`` to ``end`` as training ``progress`` goes 0 -> 1."""
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def _resume(path, params, opt, total: int, compute_dtype: Optional[str] = None):
    """``(step, params, opt, history)`` from a training checkpoint of a ``total``-step run."""
    stored = ckpt.header(path).settings
    if stored.get("trainer") == _TRAINER and stored.get("total_steps") != total:
        raise DataError(f"{path} is a checkpoint of a {stored.get('total_steps')}-step run, this run has "
                        f"{total} steps (other data, epochs or batch size); delete it to start afresh")
    state, meta = ckpt.load(path, {"params": params, "opt": opt},
                            settings=_checkpoint_settings(total, compute_dtype))
    return int(meta["step"]), state["params"], state["opt"], list(meta["history"])


def _checkpoint_settings(total: int, compute_dtype: Optional[str] = None) -> dict:
    extra = {} if compute_dtype is None else {"compute_dtype": compute_dtype}  # older checkpoints stay valid
    return {"trainer": _TRAINER, "total_steps": total, **extra}


def train_router(model, variables, pids: PIDs, data: TrainingData, *, epochs: int = 2, batch_size: int = 8,
                 lr: float = 1e-3, weight_decay: float = 1e-2, clip: float = 1.0, hidden: int = 256,
                 weights: LossWeights = LossWeights(), target: str = "vocab", seed: int = 0,
                 progress: bool = True, log_every: int = 10, checkpoint=None, checkpoint_every: int = 50,
                 mesh=None, compute_dtype: Optional[str] = None):
    """Train only the router (the LM's variables are constants of the loss). Returns ``(router,
    params, history)``: the router reads alpha at the schedule's last scale (``Router.alpha_scale``);
    the history holds the loss terms and the bias size per routed layer every ``log_every`` steps.

    ``target``: ``"vocab"`` (the paper's CE) or ``"labels"`` (CE over ``data.candidates``). With
    ``data.e`` the router reads those embeddings (its input width is theirs); evaluate it with
    ``icr_forward(..., embedded=True)`` and the same kind of embeddings as ``extras``.

    ``checkpoint``: a file path. Every ``checkpoint_every`` steps and at the end, the router params, the
    optimiser state, the step and the history are written there (``linicl.checkpoint``, atomically);
    if the file exists when training starts, training resumes from it and ends with the same params
    as an uninterrupted run (the batch order is a function of ``seed`` and the epoch). A checkpoint
    of a run with another number of steps is refused.

    ``mesh`` (``linicl.parallel``): the LM's variables are placed on it (replicated, or sharded on a mesh
    with a ``"model"`` axis) and each batch is split over its ``"data"`` axis (``batch_size`` must divide
    by the data size); the router's few parameters stay whole on every device.

    ``compute_dtype`` (e.g. ``"bfloat16"``, ``linicl.precision``): the routed layers run in it (the LM's
    variables and the cached residuals cast once), the router's parameters and AdamW's state stay in
    float32 and the loss is computed in float32. Its checkpoints are not those of a run without it."""
    from tqdm.auto import tqdm
    model, cast = in_compute_dtype(model, compute_dtype)  # refuses a bad dtype before any work
    if target not in ICR_TARGETS:
        raise LiniclError(f"target must be one of {ICR_TARGETS}, got {target!r}")
    if target == "labels" and data.candidates is None:
        raise LiniclError("target='labels' needs TrainingData.candidates (prepare(..., candidates=...))")
    d_in = None if data.e is None else data.e.shape[1]
    router, params = make_router(model, pids, hidden=hidden, seed=seed, d_in=d_in)
    hyper = (float(lr), float(weight_decay), float(clip))
    opt = _optimizer(*hyper).init(params)
    N = len(data.y)
    steps_per_epoch = max(1, N // batch_size)
    total = epochs * steps_per_epoch
    history: list = []
    start = 0
    if checkpoint is not None and ckpt.exists(checkpoint):
        start, params, opt, history = _resume(checkpoint, params, opt, total, compute_dtype)

    mesh = device_mesh() if mesh is None else mesh
    if batch_size % data_size(mesh):
        raise LiniclError(f"batch_size ({batch_size}) must divide by the mesh's {data_size(mesh)} data shards")
    variables, (params, opt) = place(cast(variables), mesh), replicate((params, opt), mesh)
    bias = replicate(pids.routing_bias(), mesh)
    static = dict(model=model, router=router, weights=weights, target=target, hyper=hyper)
    rng = np.random.default_rng(seed)
    bar = tqdm(total=total, initial=start, desc="router", disable=not progress)
    for epoch in range(epochs):
        order = rng.permutation(N)  # drawn for every epoch, also skipped ones: resuming keeps the order
        for s in range(steps_per_epoch):
            t = epoch * steps_per_epoch + s
            if t < start:
                continue
            idx = order[s * batch_size:(s + 1) * batch_size]
            # Cut the batch to its longest query, rounded up to a power of two >= 32 (few shapes to
            # compile): the causal routed blocks give the same logits at the real tokens.
            width = min(data.h0.shape[1], max(32, 1 << (int(data.lengths[idx].max()) - 1).bit_length()))
            batch = (cast(jnp.asarray(data.h0[idx, :width])), jnp.asarray(data.lengths[idx]), jnp.asarray(data.y[idx]),
                     jnp.asarray(data.H_zs[idx]))
            batch += (jnp.asarray(data.candidates[idx]) if target == "labels" else None,
                      None if data.e is None else jnp.asarray(data.e[idx]))
            batch = shard_batch(batch, mesh)
            params, opt, logs = _step(params, opt, batch, jnp.float32(alpha_schedule(t / max(1, total - 1))),
                                      variables, bias, **static)
            if t % log_every == 0 or t == total - 1:
                history.append({"step": t, "alpha_scale": alpha_schedule(t / max(1, total - 1)),
                                **{k: (np.asarray(v).tolist() if np.ndim(v) else float(v)) for k, v in logs.items()}})
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
            bar.update(1)
            if checkpoint is not None and ((t + 1) % checkpoint_every == 0 or t == total - 1):
                ckpt.save(checkpoint, {"params": params, "opt": opt},
                          settings=_checkpoint_settings(total, compute_dtype),
                          meta={"step": t + 1, "history": history})
    bar.close()
    return router.clone(alpha_scale=alpha_schedule(1.0)), params, history
