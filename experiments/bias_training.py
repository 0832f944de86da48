"""Trainable bias terms on the synthetic induction task (ICLCA, arXiv 2406.02847, Figure 1).

Arms (``--arms``), the same model except for ``ModelConfig.trainable_bias``:

* **baseline**: a linear-attention transformer (elu+1) with the bias fixed at zero (absent);
* **bias**: every layer and head has a trainable initial state (B, b) = (``S_bias``, ``z_bias``),
  zero-initialised; it enters the numerator and the normaliser of every position (iclca.md section 2).
  The zoo's ``z_bias`` is unconstrained, so phi(q).z can reach zero or go negative;
* **bias_nonneg**: the same, with ``z_bias`` clipped to >= 0 after every update (projected AdamW;
  iclca.md section 8 asks for b >= 0, e.g. softplus, so that denominators stay positive). It still
  starts at zero, so it starts from the baseline's function;
* **bias_B_only**: only ``S_bias`` (the paper's B) is trained; ``z_bias`` is held at zero after every
  update, so the normalisers are the baseline's and the bias acts on the numerator alone;
* **bias_warm**: as bias_nonneg, but (B, b) start from a converted demonstration instead of zero
  (``iclca.convert`` then ``iclca.to_trainable``, per seed on the shared initial weights): for ``facts``
  the whole table written out (``k f(k)`` for every fact), otherwise one sequence of the task (its inputs).

All arms start from the same shared parameters (the bias model is initialised and its shared
parameters are copied into the baseline), see the same batches in the same order (batch ``s`` of seed
``r`` is drawn from ``fold_in(data_key(r), s)``), and are trained with the same AdamW optimiser, one
jit-compiled ``lax.scan`` over ``--eval-every`` steps, vmapped over the seeds. Every ``--eval-every``
steps every arm is evaluated on a held-out batch per seed (the same one for every arm): loss,
in-context loss and accuracy (next-token accuracy at the positions predictable by induction, the second
half), and the attention denominators phi(q_t).z_t (bias included, the model's ``attn_eps`` excluded),
whose minimum says whether ``z_bias`` ever drives a normaliser to zero or below; the denominators are
also checked on every training batch.

Task (``linicl.data.synthetic``): ``induction`` (T/2 random tokens then the same again; default),
``recall`` (key-value pairs then a query key) or ``facts`` (``--n-pairs`` keys from a fixed table of
``--n-facts`` facts shared by every sequence, each followed by its value: what persists across
sequences, weights or a trained initial state, is what can answer).

Writes ``OUT/bias_training.json`` (the config, every curve per arm and seed, final metrics,
steps-to-threshold, wall times) and ``OUT/bias_training.png`` (mean over seeds, shaded min-max).
"""

from __future__ import annotations

import argparse
import functools
import math
import json
import os
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from tqdm.auto import tqdm

from linicl.compiled import enable_persistent_cache
from linicl import checkpoint, diagnostics, reporting
from linicl.reporting import nonnegative_float, nonnegative_int, positive_float, positive_int
from linicl.config import ModelConfig
from linicl.data.synthetic import facts_batch, facts_table, induction_batch, recall_batch
from linicl.errors import LiniclError
from linicl.iclca import convert, nonnegative_z_bias, to_trainable
from linicl.interventions import capture
from linicl.nn import Transformer

# arm -> how its z_bias (the paper's b) is treated: None (no bias terms), "free" (the zoo's
# unconstrained zero-initialised parameter) or "project" (the same parameter, clipped to b >= 0 after
# every update, so that phi(q).z > 0 for every input since phi = elu+1 > 0; it still starts at zero)
# or "zero" (held at zero: B alone is trained).
ARMS = {"baseline": None, "bias": "free", "bias_nonneg": "project", "bias_B_only": "zero", "bias_warm": "project"}
WARM = ("bias_warm",)  # arms whose bias starts from a converted demonstration (the others from zero)
Z_MODES = ("free", "project", "zero")  # a traced index into these: every bias arm shares one compilation
BIAS_PARAMS = ("S_bias", "z_bias")
THRESHOLDS = (0.5, 0.9)
DECAYED = ("kernel", "embed", "pos_embed")  # the parameters AdamW's weight decay acts on

# The project defaults of iclca.md section 8; d_ff, batch size and steps are sized for ~5 CPU-minutes
# per full run (3 arms x 3 seeds; the MLP is not needed for induction, so d_ff = d_model).
FULL = dict(vocab=64, seq_len=64, n_layers=2, n_heads=4, d_model=128, d_ff=128, positions="learned",
            decay=None, steps=1000, batch_size=16, eval_every=50, eval_batch=128, lr=1e-3,
            weight_decay=0.01, warmup=100, feature_map="elu+1")
QUICK = dict(vocab=16, seq_len=16, n_layers=2, n_heads=2, d_model=32, d_ff=64, positions="learned",
             decay=None, steps=20, batch_size=8, eval_every=5, eval_batch=32, lr=1e-3,
             weight_decay=0.01, warmup=5, feature_map="elu+1")


# ---------------------------------------------------------------------------------------- setup
def options(quick: bool = False, **changes) -> dict:
    """The run's options: ``FULL`` (or ``QUICK``) plus the task defaults, with ``changes`` applied."""
    opts = dict(QUICK if quick else FULL, task="induction", n_pairs=4 if quick else 16, n_facts=4 if quick else 32,
                distinct=False,
                seeds=[0, 1, 2], arms=list(ARMS), loss_on=None, quick=quick)
    opts.update(changes)
    if opts["loss_on"] is None:
        opts["loss_on"] = "all" if opts["task"] == "induction" else "context"
    return opts


def model_config(opts: dict, trainable_bias: bool) -> ModelConfig:
    """The experiment's ModelConfig; the two arms differ only in ``trainable_bias``."""
    length = dict(induction=opts["seq_len"] - 1, recall=2 * opts["n_pairs"] + 1,
                  facts=max(2 * opts["n_pairs"] - 1, 2 * opts.get("n_facts", 1)))[opts["task"]]  # facts: the table fits too
    return ModelConfig(vocab_size=opts["vocab"], d_model=opts["d_model"], n_layers=opts["n_layers"],
                       n_heads=opts["n_heads"], d_ff=opts["d_ff"], max_len=max(length, 1),
                       attention="linear", feature_map=opts.get("feature_map", "elu+1"), decay=opts["decay"],
                       positions=opts["positions"], trainable_bias=trainable_bias)


def make_sampler(opts: dict):
    """``key -> TokenBatch`` of ``opts["batch_size"]`` training sequences (jit-able)."""
    return functools.partial(sampler_for(opts), batch=opts["batch_size"])


def sampler_for(opts: dict):
    if opts["task"] == "induction":
        return functools.partial(induction_batch, seq_len=opts["seq_len"], vocab_size=opts["vocab"],
                                 distinct=opts["distinct"])
    if opts["task"] == "facts":
        return functools.partial(facts_batch, n_pairs=opts["n_pairs"], vocab_size=opts["vocab"],
                                 n_facts=opts["n_facts"])
    return functools.partial(recall_batch, n_pairs=opts["n_pairs"], vocab_size=opts["vocab"])


def demonstration(opts: dict, key) -> jax.Array:
    """``int32[1, P]``, the prompt a warm-started bias is converted from: for ``facts`` every fact
    ``k f(k)`` in key order; otherwise one sequence of the task (its inputs: what fits the positions)."""
    if opts["task"] == "facts":
        table = facts_table(opts["n_facts"], opts["vocab"])
        return jnp.stack([jnp.arange(opts["n_facts"], dtype=jnp.int32), table], axis=-1).reshape(1, -1)
    return sampler_for(opts)(key, batch=1).inputs


def warm_bias(opts: dict, bias_params, keys) -> dict:
    """``bias_params`` (leading seed axis) with every ``S_bias``/``z_bias`` replaced by the state of a
    converted demonstration (``demonstration``, one per seed from ``keys``), read on that seed's own
    initial weights. A learned-positions offset is dropped: training sequences start at position 0."""
    model = Transformer(model_config(opts, True))
    out = []
    for r in range(len(keys)):
        params = jax.tree.map(lambda a: a[r], bias_params)
        converted = convert(model, {"params": params}, demonstration(opts, keys[r]))
        _, warmed = to_trainable(model, converted)
        out.append(warmed["params"])
    return jax.tree.map(lambda *a: jnp.stack(a), *out)


def strip_bias(params) -> dict:
    """The params without ``S_bias``/``z_bias``: the baseline's params, sharing every other leaf."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k[-1] not in BIAS_PARAMS})


def shared_init(opts: dict, keys) -> tuple[dict, dict]:
    """``(bias_params, baseline_params)`` for a stack of PRNG keys ``[n_seeds, ...]``: the bias model's
    init (one jitted, vmapped call), and the same arrays without the bias; every leaf has a leading
    seed axis. Raises if the baseline's own parameter structure differs from the stripped tree."""
    bias_model, base_model = Transformer(model_config(opts, True)), Transformer(model_config(opts, False))
    dummy = jnp.zeros((1, 2), jnp.int32)
    bias_params = jax.jit(jax.vmap(lambda k: bias_model.init(k, dummy)["params"]))(keys)
    base_params = strip_bias(bias_params)
    expected = jax.eval_shape(jax.vmap(lambda k: base_model.init(k, dummy)["params"]), keys)
    if jax.tree.structure(expected) != jax.tree.structure(base_params) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(base_params))):
        raise RuntimeError("the baseline's parameters are not the bias model's minus S_bias/z_bias")
    return bias_params, base_params


def zero_z_bias(params):
    """``params`` with every ``z_bias`` set to zero (the B-only arm's projection); other leaves as they are."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.zeros_like(leaf) if getattr(path[-1], "key", None) == "z_bias" else leaf, params)


def decay_mask(params):
    """Weight decay on matrices (dense kernels, embeddings) only: not on LayerNorm, projection biases,
    or the trainable bias terms (weight decay would pull B, b back to the baseline's zero)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: k[-1] in DECAYED for k in flat})


def make_optimizer(opts: dict) -> optax.GradientTransformation:
    schedule = optax.warmup_constant_schedule(0.0, opts["lr"], max(opts["warmup"], 1))
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=opts["weight_decay"], mask=decay_mask))


# ---------------------------------------------------------------------------------------- metrics
def token_metrics(logits, batch, loss_on: str):
    """Training loss (over every position, or the in-context ones for ``loss_on="context"``), and the
    in-context loss and accuracy (positions where ``batch.mask``)."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
    correct = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
    m = batch.mask.astype(jnp.float32)
    n_ctx = jnp.maximum(m.sum(), 1.0)
    ctx_loss = (nll * m).sum() / n_ctx
    loss = nll.mean() if loss_on == "all" else ctx_loss
    return loss, dict(loss=loss, all_loss=nll.mean(), ctx_loss=ctx_loss, ctx_acc=(correct * m).sum() / n_ctx,
                      acc=correct.mean())


def denominators(cfg: ModelConfig, params, acts) -> dict:
    """Summary of the normalisers phi(q_t).z_t (``linicl.diagnostics``, bias included, the model's
    ``attn_eps`` excluded) over all layers: the minimum denominator, the minimum at the first position
    (where z holds a single key, plus the bias), the minimum of the bias part, and the most negative
    entry of any ``z_bias`` (0 without bias). ``z_bias >= 0`` everywhere guarantees a positive
    denominator for every input, since phi = elu+1 > 0."""
    acts = jax.lax.stop_gradient(acts)
    out = dict(den_min=jnp.inf, den_first_min=jnp.inf, bias_term_min=jnp.zeros(()), z_bias_min=jnp.zeros(()))
    for layer, n in enumerate(diagnostics.normalisers_from(cfg, {"params": params}, acts)):
        out["den_min"] = jnp.minimum(out["den_min"], n.value.min())
        out["den_first_min"] = jnp.minimum(out["den_first_min"], n.value[:, :, 0].min())
        out["bias_term_min"] = jnp.minimum(out["bias_term_min"], n.bias.min())
        if cfg.trainable_bias:
            out["z_bias_min"] = jnp.minimum(out["z_bias_min"], params[f"layers_{layer}"]["attn"]["z_bias"].min())
    return jax.lax.stop_gradient(out)


class ArmFns(NamedTuple):
    model: Transformer
    opt: optax.GradientTransformation
    loss_fn: Callable       # (params, batch) -> (loss, metrics), one seed
    train_chunk: Callable   # jitted, vmapped over seeds: (params, opt_state, data_keys, start, nonneg)
    evaluate: Callable      # jitted, vmapped over seeds: (params, batch) -> metrics


def make_fns(opts: dict, trainable_bias: bool) -> ArmFns:
    """The functions of the arms with (``bias``, ``bias_nonneg``) or without (``baseline``) bias terms.

    ``train_chunk(params, opt_state, data_keys, start, z_mode) -> (params, opt_state, per-step
    metrics)`` runs ``eval_every`` steps; step ``s`` of seed ``r`` trains on ``fold_in(data_keys[r],
    s)``; ``z_mode`` (a traced index into ``Z_MODES``, so that every bias arm shares one compilation)
    says what happens to every ``z_bias`` after each update: nothing, clipped to >= 0, or set to 0. ``evaluate(params, batch) -> metrics``. Both
    report the attention denominators."""
    cfg = model_config(opts, trainable_bias)
    model = Transformer(cfg)
    opt = make_optimizer(opts)
    sample = make_sampler(opts)
    loss_on = opts["loss_on"]
    sites = diagnostics.normaliser_sites(cfg)

    def forward(params, batch):
        logits, acts = capture(model, {"params": params}, batch.inputs, names=sites)
        loss, metrics = token_metrics(logits, batch, loss_on)
        metrics.update(denominators(cfg, params, acts))
        return loss, metrics

    def one_step(carry, step, z_mode):
        params, opt_state, data_key = carry
        batch = sample(jax.random.fold_in(data_key, step))
        grads, metrics = jax.grad(forward, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(grads)
        params = optax.apply_updates(params, updates)
        if trainable_bias:
            params = jax.tree.map(lambda free, clipped, zeroed: jnp.select(
                [z_mode == Z_MODES.index("project"), z_mode == Z_MODES.index("zero")], [clipped, zeroed], free),
                params, nonnegative_z_bias(params), zero_z_bias(params))
        return (params, opt_state, data_key), metrics

    def chunk(params, opt_state, data_key, start, z_mode):
        steps = start + jnp.arange(opts["eval_every"])
        (params, opt_state, _), metrics = jax.lax.scan(functools.partial(one_step, z_mode=z_mode),
                                                       (params, opt_state, data_key), steps)
        return params, opt_state, metrics

    train_chunk = jax.jit(jax.vmap(chunk, in_axes=(0, 0, 0, None, None)), donate_argnums=(0, 1))
    evaluate = jax.jit(jax.vmap(lambda p, b: forward(p, b)[1]))
    return ArmFns(model, opt, forward, train_chunk, evaluate)


# ---------------------------------------------------------------------------------------- the run
def steps_to(steps, values, threshold):
    """The first step whose value exceeds ``threshold``, or None."""
    for s, v in zip(steps, values):
        if v > threshold:
            return int(s)
    return None


def _stats(xs):
    xs = np.asarray(xs, np.float64)
    return dict(mean=float(xs.mean()), std=float(xs.std(ddof=1)) if xs.size > 1 else 0.0,
                min=float(xs.min()), max=float(xs.max()))


def _round(xs) -> list:
    """A curve as a list of floats with 7 significant digits (float32 precision)."""
    return [float(f"{x:.7g}") for x in np.asarray(xs, np.float64)]


def _save(path, chunk: int, state: dict, curves: dict, opts: dict) -> None:
    """The training state after ``chunk`` chunks (every arm's params and optimiser state, the curves)."""
    tree = {arm: {"params": p, "opt": o} for arm, (p, o) in state.items()}
    listed = jax.tree.map(lambda a: np.asarray(a).tolist(), curves)
    checkpoint.save(path, tree, settings=_settings(opts), meta={"chunk": chunk, "curves": listed})


def _settings(opts: dict) -> dict:
    return json.loads(json.dumps({"trainer": "experiments/bias_training.py", **opts}, default=str))


def _resume(path, state: dict, curves: dict, opts: dict) -> int:
    """Restore a checkpoint of the same settings into ``state`` and ``curves``; the chunks done."""
    template = {arm: {"params": p, "opt": o} for arm, (p, o) in state.items()}
    tree, meta = checkpoint.load(path, template, settings=_settings(opts))
    for arm in state:
        state[arm] = jax.tree.map(jnp.asarray, [tree[arm]["params"], tree[arm]["opt"]])
        for part in ("train", "eval"):
            curves[arm][part] = {k: [np.asarray(v, np.float64) for v in vs] for k, vs in meta["curves"][arm][part].items()}
        curves[arm]["eval_steps"] = list(meta["curves"][arm]["eval_steps"])
    return int(meta["chunk"])


def run(opts: dict, progress: bool = True, checkpoint_path=None) -> dict:
    """Train every arm of ``opts["arms"]`` on every seed; returns ``summarise``'s report.

    ``checkpoint_path``: after every chunk the state is saved there (``linicl.checkpoint``); a run
    with the same settings resumes from it and ends with the same numbers as an uninterrupted one
    (the data of a chunk is a function of the seeds and the chunk's first step)."""
    seeds, arms = list(opts["seeds"]), list(opts["arms"])
    n_chunks = opts["steps"] // opts["eval_every"]
    seed_keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    bias_params, base_params = shared_init(opts, fold(seed_keys, 0))
    warm_params = warm_bias(opts, bias_params, fold(seed_keys, 3)) if any(a in WARM for a in arms) else None
    data_keys = fold(seed_keys, 1)
    eval_sample = functools.partial(sampler_for(opts), batch=opts["eval_batch"])
    eval_batch = jax.jit(jax.vmap(eval_sample))(fold(seed_keys, 2))

    state, fns, compiled, timing = {}, {}, {}, {}
    for arm in arms:
        with_bias = ARMS[arm] is not None
        # Own buffers for every arm: each arm's step donates them.
        start_from = warm_params if arm in WARM else bias_params if with_bias else base_params
        params = jax.tree.map(jnp.copy, start_from)
        t0 = time.perf_counter()
        if with_bias not in compiled:  # the two bias arms share one compilation
            f = make_fns(opts, with_bias)
            opt_state = jax.vmap(f.opt.init)(params)
            compiled[with_bias] = (
                f.opt,
                f.train_chunk.lower(params, opt_state, data_keys, jnp.zeros((), jnp.int32),
                                    jnp.zeros((), jnp.int32)).compile(),
                f.evaluate.lower(params, eval_batch).compile())
        opt, train_chunk, evaluate = compiled[with_bias]
        timing[arm] = dict(compile_s=time.perf_counter() - t0, train_s=0.0, eval_s=0.0)
        state[arm] = [params, jax.vmap(opt.init)(params)]
        z_mode = jnp.asarray(Z_MODES.index(ARMS[arm]) if with_bias else 0, jnp.int32)
        fns[arm] = (lambda p, o, k, s, _f=train_chunk, _z=z_mode: _f(p, o, k, s, _z), evaluate)

    curves = {arm: dict(train={}, eval={}, eval_steps=[]) for arm in arms}

    def log_eval(arm, step):
        t0 = time.perf_counter()
        metrics = jax.device_get(fns[arm][1](state[arm][0], eval_batch))
        timing[arm]["eval_s"] += time.perf_counter() - t0
        curves[arm]["eval_steps"].append(step)
        for name, v in metrics.items():
            curves[arm]["eval"].setdefault(name, []).append(np.asarray(v, np.float64))

    done = 0
    if checkpoint_path is not None and checkpoint.exists(checkpoint_path):
        done = _resume(checkpoint_path, state, curves, opts)
    else:
        for arm in arms:
            log_eval(arm, 0)
    bar = tqdm(range(n_chunks), desc="training", disable=not progress, initial=done)
    for c in range(done, n_chunks):
        start = jnp.asarray(c * opts["eval_every"], jnp.int32)
        for arm in arms:  # interleaved, so that every arm sees the same machine load
            t0 = time.perf_counter()
            params, opt_state, metrics = fns[arm][0](*state[arm], data_keys, start)
            metrics = jax.device_get(metrics)
            timing[arm]["train_s"] += time.perf_counter() - t0
            state[arm] = [params, opt_state]
            for name, v in metrics.items():
                curves[arm]["train"].setdefault(name, []).append(np.asarray(v, np.float64))
            log_eval(arm, (c + 1) * opts["eval_every"])
        bar.set_postfix({f"{a}": f"{np.mean(curves[a]['eval']['ctx_acc'][-1]):.3f}" for a in arms})
        bar.update(1)
        if checkpoint_path is not None:
            _save(checkpoint_path, c + 1, state, curves, opts)
    bar.close()

    return summarise(opts, curves, timing, {arm: state[arm][0] for arm in arms})


def summarise(opts: dict, curves: dict, timing: dict, final_params: dict) -> dict:
    """Per arm: every curve per seed, final metrics (mean, std, min, max over seeds), steps to
    in-context accuracy thresholds, denominator checks and timings."""
    seeds = list(opts["seeds"])
    out = {}
    for arm, c in curves.items():
        train = {k: np.concatenate(v, axis=1) for k, v in c["train"].items()}  # [seeds, steps]
        ev = {k: np.stack(v, axis=1) for k, v in c["eval"].items()}           # [seeds, evals]
        steps = c["eval_steps"]
        final = {k: _stats(ev[k][:, -1]) for k in ("loss", "ctx_loss", "ctx_acc", "acc")}
        final["train_loss_last_eval_window"] = _stats(train["loss"][:, -opts["eval_every"]:].mean(axis=1))
        final["best_ctx_acc"] = _stats(ev["ctx_acc"].max(axis=1))
        thresholds = {}
        for thr in THRESHOLDS:
            per_seed = [steps_to(steps, ev["ctx_acc"][r], thr) for r in range(len(seeds))]
            reached = [s for s in per_seed if s is not None]
            thresholds[str(thr)] = dict(
                per_seed=per_seed, of_mean_curve=steps_to(steps, ev["ctx_acc"].mean(axis=0), thr),
                mean_over_seeds_that_reached=(float(np.mean(reached)) if reached else None),
                n_reached=len(reached))
        den = dict(
            min_train=float(train["den_min"].min()), min_eval=float(ev["den_min"].min()),
            min_first_position=float(min(train["den_first_min"].min(), ev["den_first_min"].min())),
            min_bias_term=float(min(train["bias_term_min"].min(), ev["bias_term_min"].min())),
            min_z_bias_entry=float(train["z_bias_min"].min()),
            first_nonpositive_step={str(s): next((int(i) + 1 for i, v in enumerate(train["den_min"][r])
                                                  if v <= 0), None) for r, s in enumerate(seeds)})
        den["stayed_positive"] = den["min_train"] > 0 and den["min_eval"] > 0
        if ARMS[arm] is not None:
            flat = traverse_util.flatten_dict(final_params[arm])
            zb = np.concatenate([np.asarray(v).ravel() for k, v in flat.items() if k[-1] == "z_bias"])
            sb = np.concatenate([np.asarray(v).ravel() for k, v in flat.items() if k[-1] == "S_bias"])
            den.update(final_negative_z_bias_fraction=float((zb < 0).mean()),
                       final_z_bias_abs_max=float(np.abs(zb).max()),
                       final_S_bias_abs_max=float(np.abs(sb).max()))
        out[arm] = dict(
            z_bias=ARMS[arm], eval_steps=steps,
            eval={k: {str(s): _round(v[r]) for r, s in enumerate(seeds)} for k, v in ev.items()},
            train={k: {str(s): _round(v[r]) for r, s in enumerate(seeds)} for k, v in train.items()},
            final=final, steps_to_ctx_acc=thresholds, denominators=den, timing=timing[arm],
            finite=bool(all(np.isfinite(v).all() for v in list(train.values()) + list(ev.values()))))
    return dict(arms=out)


# ---------------------------------------------------------------------------------------- output
def figure(plt, report: dict):
    """Training loss, held-out in-context accuracy and loss, and the smallest normaliser, per arm."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    colors = dict(baseline="tab:blue", bias="tab:red", bias_nonneg="tab:green", bias_B_only="tab:purple",
                  bias_warm="tab:orange")
    labels = dict(baseline="no bias", bias="trainable (B, b), b free", bias_nonneg="trainable (B, b), b >= 0",
                  bias_B_only="trainable B, b = 0", bias_warm="(B, b) from a converted demonstration, b >= 0")
    panels = [(axes[0, 0], "train", "loss", "training loss (running mean)"),
              (axes[0, 1], "eval", "ctx_acc", "held-out in-context accuracy"),
              (axes[1, 0], "eval", "ctx_loss", "held-out in-context loss"),
              (axes[1, 1], "train", "den_min", "min denominator phi(q).z per training batch")]
    window = report["config"]["eval_every"]
    for ax, part, name, title in panels:
        for arm, r in report["arms"].items():
            ys = np.array(list(r[part][name].values()))
            if part == "train" and name != "den_min":
                kernel = np.ones(window) / window
                ys = np.stack([np.convolve(y, kernel, mode="valid") for y in ys])
                xs = np.arange(ys.shape[1]) + window
            elif part == "train":
                xs = np.arange(1, ys.shape[1] + 1)
            else:
                xs = np.asarray(r["eval_steps"])
            ax.plot(xs, ys.mean(0), color=colors[arm], label=labels[arm])
            ax.fill_between(xs, ys.min(0), ys.max(0), color=colors[arm], alpha=0.2, lw=0)
        ax.set(xlabel="step", title=title)
        if name == "den_min":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.axhline(0, color="k", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0, 1].legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['task']}: {cfg['model']}, {len(cfg['seeds'])} seeds (line: mean, band: min-max)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _parse_decay(text: str):
    if text.lower() == "none":
        return None
    values = [float(x) for x in text.split(",")]
    return values[0] if len(values) == 1 else values


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/bias_training", quick="a tiny model for a few steps (CI, seconds)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (>= 1)")
    parser.add_argument("--task", choices=("induction", "recall", "facts"), default="induction")
    parser.add_argument("--n-facts", type=positive_int, default=None,
                        help="facts: the table's size (default 32, 4 with --quick)")
    parser.add_argument("--n-pairs", type=positive_int, default=None,
                        help="recall: key-value pairs per sequence (default 16, 4 with --quick)")
    parser.add_argument("--distinct", action="store_true",
                        help="induction: the T/2 tokens of a sequence are all different")
    parser.add_argument("--loss-on", choices=("all", "context"), default=None,
                        help="train on every next token, or the in-context ones only "
                             "(default: all for induction, context for recall)")
    for name, kind in (("vocab", positive_int), ("seq_len", positive_int), ("n_layers", positive_int),
                       ("n_heads", positive_int), ("d_model", positive_int), ("d_ff", positive_int),
                       ("steps", positive_int), ("batch_size", positive_int), ("eval_every", positive_int),
                       ("eval_batch", positive_int), ("lr", positive_float), ("weight_decay", nonnegative_float),
                       ("warmup", nonnegative_int)):
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"default {FULL[name]} ({QUICK[name]} with --quick)")
    parser.add_argument("--positions", choices=("none", "learned", "rope"), default=None,
                        help=f"default {FULL['positions']}")
    parser.add_argument("--feature-map", choices=("elu+1", "hedgehog"), default=None,
                        help=f"default {FULL['feature_map']}")
    parser.add_argument("--decay", type=_parse_decay, default=argparse.SUPPRESS,
                        help="'none', one gamma, or one per head comma-separated (default none)")
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS),
                        help="baseline: no bias terms; bias: the zoo's trainable (S_bias, z_bias), "
                             "z_bias unconstrained; bias_nonneg: the same with z_bias clipped to >= 0 "
                             "after every update; bias_B_only: z_bias held at 0; bias_warm: as bias_nonneg, started "
                             "from a converted demonstration (default: all five)")
    args = parser.parse_args(argv)

    changes = {name: getattr(args, name) for name in FULL
               if name != "decay" and getattr(args, name, None) is not None}
    if hasattr(args, "decay"):
        changes["decay"] = args.decay
    if args.n_pairs is not None:
        changes["n_pairs"] = args.n_pairs
    if args.n_facts is not None:
        changes["n_facts"] = args.n_facts
    opts = options(args.quick, task=args.task, distinct=args.distinct, seeds=args.seeds,
                   arms=[a for a in ARMS if a in args.arms], loss_on=args.loss_on, **changes)
    if opts["steps"] < 1 or opts["eval_every"] < 1 or opts["steps"] % opts["eval_every"]:
        parser.error(f"--steps ({opts['steps']}) must be a positive multiple of --eval-every "
                     f"({opts['eval_every']})")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error("--seeds must be different")
    try:  # a bad model option (ConfigError) or task size (LiniclError), before any training
        cfg = model_config(opts, True)
        sampler_for(opts)(jax.random.PRNGKey(0), batch=1)
    except LiniclError as e:
        parser.error(str(e))

    if args.quick:  # a smoke test: compile time dominates, and XLA's optimisations do not pay off
        jax.config.update("jax_disable_most_optimizations", True)
    t0 = time.perf_counter()
    result = run(opts, progress=args.progress, checkpoint_path=os.path.join(args.out, "bias_training.ckpt"))
    wall = time.perf_counter() - t0
    report = dict(config=dict(opts, model=cfg.describe(), model_config={
        k: v for k, v in cfg.__dict__.items()}, optimizer="clip_by_global_norm(1) + AdamW "
        f"(lr {opts['lr']}, linear warm-up {opts['warmup']} steps then constant, weight decay "
        f"{opts['weight_decay']} on matrices only)"),
        machine=reporting.machine_info(), wall_s=wall, **result)
    reporting.write_json(os.path.join(args.out, "bias_training.json"), report, indent=None)
    print_summary(report)
    png = reporting.plot(os.path.join(args.out, "bias_training.png"), figure, report, dpi=120)
    print(f"\nwrote {args.out}/bias_training.json" + (" and bias_training.png" if png else "") + f" ({wall:.1f} s)")
    return 0


def _fmt(s) -> str:
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def print_summary(report: dict) -> None:
    cfg = report["config"]
    print(f"\n{cfg['task']}, {cfg['model']}, {cfg['steps']} steps x batch {cfg['batch_size']}, "
          f"seeds {cfg['seeds']}")
    print(f"{'arm':>11s} {'eval loss':>17s} {'ctx loss':>17s} {'ctx acc':>17s} "
          + " ".join(f"{'steps>' + str(t):>12s}" for t in THRESHOLDS) + f" {'min den':>9s} {'train s':>8s}")
    for arm, r in report["arms"].items():
        f = r["final"]
        thr = " ".join(f"{str(r['steps_to_ctx_acc'][str(t)]['of_mean_curve']):>12s}" for t in THRESHOLDS)
        print(f"{arm:>11s} {_fmt(f['loss']):>17s} {_fmt(f['ctx_loss']):>17s} {_fmt(f['ctx_acc']):>17s} {thr} "
              f"{r['denominators']['min_train']:9.3g} {r['timing']['train_s']:8.1f}")
    if not all(math.isfinite(r["final"]["loss"]["mean"]) for r in report["arms"].values()):
        print("WARNING: a non-finite final loss")


if __name__ == "__main__":
    sys.exit(main())
