"""In-Context Routing (ICR, arXiv 2509.22854): principal ICL directions and a trained router.

Few-shot prompts change where attention goes. ICR reproduces that zero-shot with a low-rank,
input-conditioned bias on the attention logits of the last third of the layers (routing.md):

    Z_q = Q U_q,  Z_k = K U_k                      (Q, K: the layer's q/k projections, concatenated
    B   = Z_q diag(alpha(x)) Z_k^T                  over heads, before rope; U: the PIDs)
    scores[h] = q_h.k_h / sqrt(d) + gamma_h(x) B    -> causal mask -> softmax

* ``extract_pids``: PCA (rank r = 8, centred by default) of the last-token q and k of class-balanced
  few-shot prompts, per routed layer; ``PIDs.save`` / ``PIDs.load``.
* ``Router``: a Flax module mapping a frozen representation of the zero-shot query to alpha = tanh(.)
  per layer and direction and gamma = sigmoid(.) per layer and head. The default representation is the
  LM's own hidden state entering the first routed layer, mean-pooled over the query's tokens but the
  first (the attention sink; ``router_input``); the forward pass computes it anyway, so no sentence
  encoder is needed. The last layer of the alpha branch
  starts at zero, so an untrained router is exactly the base model.
* ``routing_edits``: the bias as ``linicl.interventions`` edits (an ``fn`` edit at each routed layer's
  ``hook_attn_scores``: added before the causal mask, so it never lets a query see a later key).
* ``prepare``/``train_router``: the paper's objective (cross-entropy + confidence + depth-weighted
  sparsity + gate terms, alpha scaled by a cosine 1.0 -> 0.8, AdamW, gradient clipping). The residual
  stream entering the first routed layer does not depend on the router, so it is computed once per
  query and training runs only the routed blocks (``Transformer(first_layer=...)``). ``checkpoint=``
  saves the training state as it goes and resumes from it.
* ``icr_forward``: the ``forward`` hook of ``linicl.evaluate`` that applies a trained router.
* ``task_vector``/``task_vector_edits``: the task-vector baseline (few-shot minus zero-shot mean
  last-token residual at one layer, added at the query's last token).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from linicl.config import ModelConfig
from linicl.errors import DataError, LiniclError
from linicl.interventions import apply_fn, capture, with_edits
from linicl.nn.transformer import config_of
from linicl.parallel import collect_activations

# ---------------------------------------------------------------------------------------- PIDs


def routed_layers(cfg: ModelConfig) -> tuple:
    """The last third of the layers, 0-based: floor(2L/3) .. L-1 (GPT-2 small: 8-11; SmolLM2: 20-29)."""
    return tuple(range((2 * cfg.n_layers) // 3, cfg.n_layers))


def pca(X: np.ndarray, r: int, center: bool = True):
    """Top-r principal directions of the rows of ``X: [N, d]``: ``(U [d, r] orthonormal, mean [d],
    explained variance ratio [r])``. Uncentred, the directions are those of the second moment."""
    X = np.asarray(X, np.float64)
    if X.ndim != 2 or X.shape[0] < 2 or not 1 <= r <= min(X.shape):
        raise LiniclError(f"pca needs X of shape [N >= 2, d] and 1 <= r <= min(N, d); got {X.shape}, r={r}")
    mean = X.mean(axis=0) if center else np.zeros(X.shape[1])
    _, s, vt = np.linalg.svd(X - mean, full_matrices=False)
    return vt[:r].T, mean, (s[:r] ** 2) / np.sum(s ** 2)


@dataclass(frozen=True)
class PIDs:
    """Principal ICL directions of the routed layers: ``U_q[i]: [heads * d_head, r]`` and
    ``U_k[i]: [kv_heads * d_head, r]`` for layer ``layers[i]``, with the means and explained variance
    of the PCA and free-form ``meta`` (tasks, prompt counts, model)."""

    layers: tuple
    U_q: np.ndarray
    U_k: np.ndarray
    mean_q: np.ndarray
    mean_k: np.ndarray
    explained_q: np.ndarray
    explained_k: np.ndarray
    centered: bool = True
    meta: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.U_q.shape[-1])

    def save(self, path) -> Path:
        """One ``.npz`` (arrays + a JSON string of the metadata)."""
        path = Path(path).with_suffix(".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        info = json.dumps({"layers": list(self.layers), "centered": self.centered, "meta": self.meta})
        np.savez(path, U_q=self.U_q, U_k=self.U_k, mean_q=self.mean_q, mean_k=self.mean_k,
                 explained_q=self.explained_q, explained_k=self.explained_k, info=np.asarray(info))
        return path

    @classmethod
    def load(cls, path) -> "PIDs":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
            info = json.loads(str(arrays.pop("info")))
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{path} is not a PIDs file written by PIDs.save: {e}") from None
        return cls(layers=tuple(info["layers"]), centered=info["centered"], meta=info["meta"], **arrays)


def extract_pids(model, variables, prompts, *, layers: Optional[Sequence[int]] = None, r: int = 8,
                 center: bool = True, batch_size: int = 16, meta: Optional[dict] = None,
                 progress: bool = False) -> PIDs:
    """PCA of the last-token q and k projections (before rope, concatenated over heads) of
    ``prompts`` (few-shot ``linicl.data.Prompt`` objects of the in-domain tasks) at each routed layer."""
    cfg = config_of(model)
    layers = routed_layers(cfg) if layers is None else tuple(layers)
    names = [f"blocks.{l}.attn.hook_{s}" for l in layers for s in ("q", "k")]
    acts = collect_activations(model, variables, prompts, names, batch_size=batch_size, progress=progress)
    parts = {s: [] for s in ("U_q", "U_k", "mean_q", "mean_k", "explained_q", "explained_k")}
    for l in layers:
        for s in ("q", "k"):
            X = acts[f"blocks.{l}.attn.hook_{s}"]
            U, mean, ev = pca(X.reshape(X.shape[0], -1), r, center)
            parts[f"U_{s}"].append(U)
            parts[f"mean_{s}"].append(mean)
            parts[f"explained_{s}"].append(ev)
    info = {"n_prompts": len(acts[names[0]]), "model": cfg.describe(), **(meta or {})}
    return PIDs(layers=layers, centered=center, meta=info, **{k: np.stack(v) for k, v in parts.items()})


# ---------------------------------------------------------------------------------------- router


class Router(nn.Module):
    """``e: f[batch, d_in]`` -> ``alpha: [batch, n_layers, rank]`` in (-1, 1) and ``gamma: [batch,
    n_layers, n_heads]`` in (0, 1), two independent two-layer MLPs after a LayerNorm of the input
    (LM hidden states have a few very large coordinates)."""

    n_layers: int
    rank: int
    n_heads: int
    hidden: int = 256

    @nn.compact
    def __call__(self, e: jax.Array):
        e = nn.LayerNorm(name="ln")(e)

        def mlp(name, out, last_init):
            h = nn.gelu(nn.Dense(self.hidden, name=f"{name}_1")(e))
            return nn.Dense(out, kernel_init=last_init, name=f"{name}_2")(h)
        alpha = jnp.tanh(mlp("alpha", self.n_layers * self.rank, nn.initializers.zeros))
        gamma = jax.nn.sigmoid(mlp("gamma", self.n_layers * self.n_heads, nn.initializers.lecun_normal()))
        B = e.shape[0]
        return alpha.reshape(B, self.n_layers, self.rank), gamma.reshape(B, self.n_layers, self.n_heads)


def make_router(model, pids: PIDs, *, hidden: int = 256, seed: int = 0):
    """``(router, params)`` for this model and these PIDs (input: the model's hidden width)."""
    cfg = config_of(model)
    router = Router(n_layers=len(pids.layers), rank=pids.rank, n_heads=cfg.n_heads, hidden=hidden)
    params = router.init(jax.random.PRNGKey(seed), jnp.zeros((1, cfg.d_model), jnp.float32))["params"]
    return router, params


def _bias(scores, value, ctx):
    """scores + gamma_h * (Q U_q) diag(alpha) (K U_k)^T, at every (query, key) pair (the mask follows)."""
    b, T = scores.shape[0], scores.shape[2]
    q = ctx["q_proj"].reshape(b, T, -1).astype(jnp.float32)
    k = ctx["k_proj"].reshape(b, T, -1).astype(jnp.float32)
    zq, zk = q @ value["U_q"], k @ value["U_k"]
    B = jnp.einsum("btr,br,bsr->bts", zq, value["alpha"], zk)
    return scores + (value["gamma"][:, :, None, None] * B[:, None]).astype(scores.dtype)


def routing_edits(pids: PIDs, alpha: jax.Array, gamma: jax.Array) -> list:
    """The routing bias as edits at each routed layer's ``hook_attn_scores``
    (``alpha: [batch, n_layers, rank]``, ``gamma: [batch, n_layers, heads]``)."""
    U_q, U_k = jnp.asarray(pids.U_q, jnp.float32), jnp.asarray(pids.U_k, jnp.float32)
    return [apply_fn(("attn_scores", l), _bias, {"U_q": U_q[i], "U_k": U_k[i], "alpha": alpha[:, i],
                                                 "gamma": gamma[:, i]})
            for i, l in enumerate(pids.layers)]


def router_input(h: jax.Array, lengths: jax.Array) -> jax.Array:
    """Mean of ``h: [batch, seq, d]`` over each row's real tokens after the first -> ``[batch, d]``
    (float32). The first token is left out (unless it is the only one): in pretrained LMs it is the
    attention sink, whose residual is ~100x larger than the others' (SmolLM2: ~2.5e4 against ~2e2 from
    layer 10 on) and the same for every prompt, so it would drown the query's content in the mean (the
    mean-pooled features of different SST-2/AG News/CB queries have cosine 0.98 with it, 0.91 without)."""
    pos = jnp.arange(h.shape[1])[None, :]
    start = (lengths > 1).astype(lengths.dtype)[:, None]
    real = ((pos < lengths[:, None]) & (pos >= start))[..., None]
    count = (lengths[:, None] - start).astype(jnp.float32)
    return (jnp.sum(jnp.where(real, h, 0).astype(jnp.float32), axis=1) / count).astype(jnp.float32)


def _unembed(cfg: ModelConfig, params, h):
    return h @ (params["embed"].T if cfg.tie_embeddings else params["unembed"]["kernel"])


def _last(h, lengths):
    return jnp.take_along_axis(h, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]


def routed_logits(model, variables, pids: PIDs, router: Router, router_params, h0, lengths,
                  alpha_scale: float = 1.0):
    """Next-token logits ``[batch, vocab]`` at each row's last token with the router's bias, from the
    residual ``h0: [batch, seq, d_model]`` entering the first routed layer. Also returns (alpha, gamma)."""
    cfg = config_of(model)
    alpha, gamma = router.apply({"params": router_params}, router_input(h0, lengths))
    edits = routing_edits(pids, alpha * alpha_scale, gamma)
    h = model.apply(with_edits(variables, edits, cfg), embeds=h0, first_layer=pids.layers[0], hidden=True)
    return _unembed(cfg, variables["params"], _last(h, lengths)), (alpha, gamma)


def icr_forward(model, pids: PIDs, router: Router):
    """The ``forward(variables, tokens, lengths)`` hook of ``linicl.evaluate`` for a trained router:
    ``variables["router"]`` holds its params (pass ``{**variables, "router": params}``)."""
    name = f"blocks.{pids.layers[0]}.hook_resid_pre"

    def forward(variables, tokens, lengths):
        router_params = variables["router"]
        base = {k: v for k, v in variables.items() if k != "router"}
        _, acts = capture(model, base, tokens, names=[name], hidden=True)  # later blocks are dropped
        return routed_logits(model, base, pids, router, router_params, acts[name], lengths)[0]
    return forward


# ---------------------------------------------------------------------------------------- training


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
    from linicl.evaluate import run_logprobs
    name = f"blocks.{pids.layers[0]}.hook_resid_pre"
    lengths = np.asarray([len(getattr(p, "tokens", p)) for p in prompts], np.int32)
    T = int(lengths.max())

    def whole(act, n, tokens, lengths):  # every position, cut or zero-padded to the longest prompt
        act = act[:, :T]
        return jnp.pad(act, ((0, 0), (0, T - act.shape[1]), (0, 0)))
    h0 = collect_activations(model, variables, prompts, [name], batch_size=batch_size, progress=progress,
                             reduce=whole)[name].astype(np.float32)
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


def train_router(model, variables, pids: PIDs, data: TrainingData, *, epochs: int = 2, batch_size: int = 8,
                 lr: float = 1e-3, weight_decay: float = 1e-2, clip: float = 1.0, hidden: int = 256,
                 weights: LossWeights = LossWeights(), seed: int = 0, progress: bool = True,
                 log_every: int = 10, checkpoint=None, checkpoint_every: int = 50):
    """Train only the router (the LM's variables are constants of the loss). Returns ``(router,
    params, history)`` with the loss terms logged every ``log_every`` steps.

    ``checkpoint``: a file path. Every ``checkpoint_every`` steps and at the end, the router params, the
    optimiser state, the step and the history are written there (atomically); if the file exists when
    training starts, training resumes from it and ends with the same params as an uninterrupted run
    (the batch order is a function of ``seed`` and the epoch)."""
    from tqdm.auto import tqdm
    router, params = make_router(model, pids, hidden=hidden, seed=seed)
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr, weight_decay=weight_decay))
    opt = tx.init(params)
    N = len(data.y)
    steps_per_epoch = max(1, N // batch_size)
    total = epochs * steps_per_epoch
    history: list = []
    start = 0
    if checkpoint is not None and Path(checkpoint).exists():
        start, params, opt, history = _load_training_state(checkpoint, params, opt, total)

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
                _save_training_state(checkpoint, t + 1, params, opt, history, total)
    bar.close()
    return router, params, history


def _save_training_state(path, step: int, params, opt, history, total: int) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"params": params, "opt": opt}
    head = json.dumps({"step": step, "total": total, "history": history}).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(len(head).to_bytes(4, "little") + head + serialization.to_bytes(state))
    tmp.replace(path)


def _load_training_state(path, params, opt, total: int):
    path = Path(path)
    try:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:4], "little")
        head = json.loads(raw[4:4 + n])
        state = serialization.from_bytes({"params": params, "opt": opt}, raw[4 + n:])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a training checkpoint written by train_router: {e}") from None
    if head["total"] != total:
        raise DataError(f"{path} is a checkpoint of a {head['total']}-step run, this run has {total} steps "
                        "(other data, epochs or batch size); delete it to start afresh")
    return int(head["step"]), state["params"], state["opt"], list(head["history"])


def save_router(path, router: Router, params) -> Path:
    """The router's sizes (JSON) and params (flax msgpack) in one file."""
    path = Path(path).with_suffix(".msgpack")
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"n_layers": router.n_layers, "rank": router.rank, "n_heads": router.n_heads,
                       "hidden": router.hidden}).encode()
    path.write_bytes(len(head).to_bytes(4, "little") + head + serialization.to_bytes(params))
    return path


def load_router(path):
    """``(router, params)`` written by ``save_router``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:4], "little")
        sizes = json.loads(raw[4:4 + n])
        router = Router(**sizes)
        params = serialization.msgpack_restore(raw[4 + n:])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a router file written by save_router: {e}") from None
    return router, jax.tree_util.tree_map(jnp.asarray, params)


def task_vector(model, variables, few_shot, zero_shot, layer: int, *, batch_size: int = 16) -> np.ndarray:
    """The task-vector baseline: mean last-token residual after ``layer`` over few-shot prompts minus
    the same mean over zero-shot prompts (added at the query's last token at inference,
    ``task_vector_edits``)."""
    name = f"blocks.{layer}.hook_resid_post"
    fs = collect_activations(model, variables, few_shot, [name], batch_size=batch_size)[name]
    zs = collect_activations(model, variables, zero_shot, [name], batch_size=batch_size)[name]
    return fs.mean(axis=0) - zs.mean(axis=0)


def task_vector_edits(vector: Any, layer: int):
    """An ``edits`` function for ``linicl.evaluate``: add a task vector to the residual after ``layer``
    at each prompt's last token.

    * ``vector: [d_model]``: ``edits(tokens, lengths)``, the vector is a constant of the compiled forward.
    * ``vector=None``: ``edits(tokens, lengths, vectors)`` reading one vector per prompt from the
      harness's ``extras`` (``[n_prompts, d_model]``). The function is the same object for every call
      with this ``layer``, so evaluating many tasks (many vectors) compiles the forward once."""
    if vector is None:
        return _task_vector_extras_edits(int(layer))
    v = jnp.asarray(vector, jnp.float32)

    def edits(tokens, lengths):
        return _add_at_last(layer, v, tokens, lengths)
    return edits


def _add_at_last(layer, v, tokens, lengths):
    from linicl.interventions import add, at_last
    v = v if v.ndim == 1 else v[:, None, :]  # one vector for all rows, or one per row
    return [add(f"blocks.{layer}.hook_resid_post", v.astype(jnp.float32),
                positions=at_last(lengths, tokens.shape[1]))]


@functools.lru_cache(maxsize=None)
def _task_vector_extras_edits(layer: int):
    def edits(tokens, lengths, vectors):
        return _add_at_last(layer, jnp.asarray(vectors), tokens, lengths)
    return edits
