"""Training trainable bias terms against the same model without them (ICLCA, arXiv 2406.02847, Figure 1).

A linear-attention transformer with ``ModelConfig.trainable_bias`` holds per layer and head an
initial state (B, b) = (``S_bias``, ``z_bias``) that enters the numerator and the normaliser of every
position (iclca.md section 2). The arms (``ARMS``) are the same model except for that state:

* ``baseline``: no bias terms;
* ``bias``: (B, b) zero-initialised and trained, b unconstrained (phi(q).z can reach zero or below);
* ``bias_nonneg``: the same with b clipped to >= 0 after every update (projected AdamW; iclca.md
  section 8 asks for b >= 0 so that denominators stay positive);
* ``bias_B_only``: B alone trained, b held at zero (the baseline's normalisers);
* ``bias_warm``: as ``bias_nonneg``, started from a converted demonstration (``iclca.convert`` then
  ``iclca.to_trainable``) instead of zero.

Every arm starts from the same shared parameters (``shared_init``), sees the same batches in the same
order (batch ``s`` of seed ``r`` is drawn from ``fold_in(data_key(r), s)``) and is trained by the same
optimiser (``linicl.training.warmup_constant_adamw``) in compiled chunks of ``eval_every`` steps
(one ``lax.scan`` under ``jit``, vmapped over the seeds; ``make_fns``). After every chunk every arm is
evaluated on the same held-out batch per seed: loss, in-context loss and accuracy (``token_metrics``)
and the smallest attention denominators (``linicl.diagnostics.normaliser_summary``). ``run`` does all
of that (checkpointed, resumable) and ``summarise`` reduces the curves to final metrics over seeds,
steps to in-context accuracy thresholds and denominator checks.

A run's options are one dict (``options``): the model sizes and training settings of ``FULL`` (or
``QUICK``) plus the task (``linicl.data.synthetic.token_task``: ``induction``, ``recall`` or ``facts``),
its sizes, the seeds and the arms. ``experiments/bias_training.py`` is the command line around it.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from tqdm.auto import tqdm

from linicl import checkpoint, diagnostics, stats
from linicl.config import ModelConfig
from linicl.data.synthetic import TokenBatch, facts_prompt, token_task
from linicl.errors import LiniclError
from linicl.iclca import convert, nonnegative_z_bias, to_trainable, without_bias, zero_z_bias
from linicl.interventions import capture
from linicl.names import BIAS_PARAMS, PARAMS
from linicl.nn import Transformer
from linicl.training import steps_to_threshold, warmup_constant_adamw

__all__ = ["ARMS", "WARM", "Z_MODES", "THRESHOLDS", "FULL", "QUICK", "options", "model_config", "sampler",
           "demonstration", "warm_bias", "shared_init", "make_optimizer", "token_metrics", "ArmFns", "make_fns",
           "run", "summarise"]

# arm -> how its z_bias (the paper's b) is treated: None (no bias terms), "free" (the zoo's
# unconstrained zero-initialised parameter), "project" (the same parameter, clipped to b >= 0 after
# every update, so that phi(q).z > 0 for every input since phi = elu+1 > 0; it still starts at zero)
# or "zero" (held at zero: B alone is trained).
ARMS = {"baseline": None, "bias": "free", "bias_nonneg": "project", "bias_B_only": "zero", "bias_warm": "project"}
WARM = ("bias_warm",)  # arms whose bias starts from a converted demonstration (the others from zero)
Z_MODES = ("free", "project", "zero")  # a traced index into these: every bias arm shares one compilation
THRESHOLDS = (0.5, 0.9)  # the in-context accuracies whose first step summarise reports

# The project defaults of iclca.md section 8; d_ff, batch size and steps are sized for ~5 CPU-minutes
# per full run (3 arms x 3 seeds; the MLP is not needed for induction, so d_ff = d_model).
FULL = dict(vocab=64, seq_len=64, n_layers=2, n_heads=4, d_model=128, d_ff=128, positions="learned",
            decay=None, steps=1000, batch_size=16, eval_every=50, eval_batch=128, lr=1e-3,
            weight_decay=0.01, warmup=100, feature_map="elu+1")
QUICK = dict(vocab=16, seq_len=16, n_layers=2, n_heads=2, d_model=32, d_ff=64, positions="learned",
             decay=None, steps=20, batch_size=8, eval_every=5, eval_batch=32, lr=1e-3,
             weight_decay=0.01, warmup=5, feature_map="elu+1")
# What a checkpoint's settings name as their trainer (kept as it was, so that earlier runs resume).
_TRAINER = "experiments/bias_training.py"


# ---------------------------------------------------------------------------------------- setup
def options(quick: bool = False, **changes) -> dict:
    """A run's options: ``FULL`` (or ``QUICK``) plus the task's defaults (``task="induction"``,
    ``n_pairs``, ``n_facts``, ``distinct=False``), ``seeds=[0, 1, 2]``, every arm, and ``loss_on``
    (``"all"`` for induction, else ``"context"``: which positions the training loss covers), with
    ``changes`` applied."""
    unknown = sorted(set(changes) - set(FULL) - {"task", "n_pairs", "n_facts", "distinct", "seeds", "arms", "loss_on"})
    if unknown:
        raise LiniclError(f"options: unknown options {unknown}; these exist: {sorted(options(quick))}")
    opts = dict(QUICK if quick else FULL, task="induction", n_pairs=4 if quick else 16, n_facts=4 if quick else 32,
                distinct=False, seeds=[0, 1, 2], arms=list(ARMS), loss_on=None, quick=quick)
    opts.update(changes)
    if opts["loss_on"] is None:
        opts["loss_on"] = "all" if opts["task"] == "induction" else "context"
    return opts


def model_config(opts: dict, trainable_bias: bool) -> ModelConfig:
    """The arms' ``ModelConfig`` (they differ only in ``trainable_bias``): a normalised linear
    attention of ``opts``' sizes, long enough for the task's inputs (for ``facts`` also for the whole
    table, the warm arm's demonstration)."""
    length = dict(induction=opts["seq_len"] - 1, recall=2 * opts["n_pairs"] + 1,
                  facts=max(2 * opts["n_pairs"] - 1, 2 * opts.get("n_facts", 1)))[opts["task"]]
    return ModelConfig(vocab_size=opts["vocab"], d_model=opts["d_model"], n_layers=opts["n_layers"],
                       n_heads=opts["n_heads"], d_ff=opts["d_ff"], max_len=max(length, 1),
                       attention="linear", feature_map=opts.get("feature_map", "elu+1"), decay=opts["decay"],
                       positions=opts["positions"], trainable_bias=trainable_bias)


def sampler(opts: dict, batch: Optional[int] = None) -> Callable:
    """The task's generator (``linicl.data.synthetic.token_task``): ``(key, batch) -> TokenBatch``, or
    with ``batch`` bound ``key -> TokenBatch`` (jit- and vmap-able)."""
    gen = token_task(opts["task"], vocab_size=opts["vocab"], seq_len=opts["seq_len"], n_pairs=opts["n_pairs"],
                     n_facts=opts["n_facts"], distinct=opts["distinct"])
    return gen if batch is None else functools.partial(gen, batch=batch)


def demonstration(opts: dict, key) -> jax.Array:
    """``int32[1, P]``, the prompt a warm-started bias is converted from: for ``facts`` every fact
    ``k f(k)`` in key order (``facts_prompt``); otherwise one sequence of the task (its inputs: what
    fits the positions)."""
    if opts["task"] == "facts":
        return facts_prompt(opts["n_facts"], opts["vocab"])
    return sampler(opts)(key, batch=1).inputs


def warm_bias(opts: dict, bias_params, keys) -> dict:
    """``bias_params`` (leading seed axis) with every ``S_bias``/``z_bias`` replaced by the state of a
    converted demonstration (``demonstration``, one per seed from ``keys``), read on that seed's own
    initial weights. A learned-positions offset is dropped: training sequences start at position 0."""
    model = Transformer(model_config(opts, True))
    out = []
    for r in range(len(keys)):
        params = jax.tree.map(lambda a: a[r], bias_params)
        converted = convert(model, {PARAMS: params}, demonstration(opts, keys[r]))
        _, warmed = to_trainable(model, converted)
        out.append(warmed[PARAMS])
    return jax.tree.map(lambda *a: jnp.stack(a), *out)


def shared_init(opts: dict, keys) -> tuple[dict, dict]:
    """``(bias_params, baseline_params)`` for a stack of PRNG keys ``[n_seeds, ...]``: the bias model's
    init (one jitted, vmapped call), and the same arrays without the bias (``iclca.without_bias``);
    every leaf has a leading seed axis. Raises if the baseline's own parameter structure differs from
    the stripped tree."""
    bias_model, base_model = Transformer(model_config(opts, True)), Transformer(model_config(opts, False))
    dummy = jnp.zeros((1, 2), jnp.int32)
    bias_params = jax.jit(jax.vmap(lambda k: bias_model.init(k, dummy)[PARAMS]))(keys)
    base_params = without_bias(bias_params)
    expected = jax.eval_shape(jax.vmap(lambda k: base_model.init(k, dummy)[PARAMS]), keys)
    if jax.tree.structure(expected) != jax.tree.structure(base_params) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(base_params))):
        raise RuntimeError("the baseline's parameters are not the bias model's minus S_bias/z_bias")
    return bias_params, base_params


def make_optimizer(opts: dict) -> optax.GradientTransformation:
    """``warmup_constant_adamw`` with ``opts``' ``lr``, ``warmup`` and ``weight_decay`` (on the
    matrices only: decay would pull B, b back to the baseline's zero)."""
    return warmup_constant_adamw(opts["lr"], opts["warmup"], opts["weight_decay"])


# ---------------------------------------------------------------------------------------- training
def token_metrics(logits, batch: TokenBatch, loss_on: str):
    """``(loss, metrics)`` of ``logits`` (``f[batch, L, vocab]``) on ``batch``: the training loss
    (mean next-token cross-entropy over every position, ``loss_on="all"``, or over the in-context
    positions ``batch.mask``, ``"context"``) and the metrics ``loss``, ``all_loss``, ``ctx_loss``,
    ``ctx_acc`` (greedy accuracy where ``batch.mask``) and ``acc`` (everywhere), each ``f32[]``."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
    correct = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
    m = batch.mask.astype(jnp.float32)
    n_ctx = jnp.maximum(m.sum(), 1.0)
    ctx_loss = (nll * m).sum() / n_ctx
    loss = nll.mean() if loss_on == "all" else ctx_loss
    return loss, dict(loss=loss, all_loss=nll.mean(), ctx_loss=ctx_loss, ctx_acc=(correct * m).sum() / n_ctx,
                      acc=correct.mean())


class ArmFns(NamedTuple):
    """The compiled functions of the arms with or without bias terms (``make_fns``)."""

    model: Transformer
    opt: optax.GradientTransformation
    loss_fn: Callable       # (params, batch) -> (loss, metrics), one seed
    train_chunk: Callable   # jitted, vmapped over seeds: (params, opt_state, data_keys, start, z_mode)
    evaluate: Callable      # jitted, vmapped over seeds: (params, batch) -> metrics


def make_fns(opts: dict, trainable_bias: bool) -> ArmFns:
    """The functions of the arms with (``bias*``) or without (``baseline``) bias terms.

    ``train_chunk(params, opt_state, data_keys, start, z_mode) -> (params, opt_state, per-step
    metrics)`` runs ``eval_every`` steps (params and optimiser state donated); step ``s`` of seed ``r``
    trains on ``fold_in(data_keys[r], s)``; ``z_mode`` (an int32 index into ``Z_MODES``, traced, so that
    every bias arm shares one compilation) says what happens to every ``z_bias`` after each update:
    nothing, clipped to >= 0, or set to 0. ``evaluate(params, batch) -> metrics``. Both report the
    attention denominators (``diagnostics.normaliser_summary``) besides ``token_metrics``."""
    cfg = model_config(opts, trainable_bias)
    model = Transformer(cfg)
    opt = make_optimizer(opts)
    sample = sampler(opts, opts["batch_size"])
    loss_on = opts["loss_on"]
    sites = diagnostics.normaliser_sites(cfg)

    def forward(params, batch):
        logits, acts = capture(model, {PARAMS: params}, batch.inputs, names=sites)
        loss, metrics = token_metrics(logits, batch, loss_on)
        metrics.update(diagnostics.normaliser_summary(cfg, params, acts))
        return loss, metrics

    def one_step(carry, step, z_mode):
        params, opt_state, data_key = carry
        batch = sample(jax.random.fold_in(data_key, step))
        grads, metrics = jax.grad(forward, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(grads)
        params = optax.apply_updates(params, updates)
        if trainable_bias:  # the arm's projection of z_bias, selected by the traced z_mode
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


def _save(path, chunk: int, state: dict, curves: dict, opts: dict) -> None:
    """The training state after ``chunk`` chunks (every arm's params and optimiser state, the curves)."""
    tree = {arm: {"params": p, "opt": o} for arm, (p, o) in state.items()}
    listed = jax.tree.map(lambda a: np.asarray(a).tolist(), curves)
    checkpoint.save(path, tree, settings=_settings(opts), meta={"chunk": chunk, "curves": listed})


def _settings(opts: dict) -> dict:
    return json.loads(json.dumps({"trainer": _TRAINER, **opts}, default=str))


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


def _compile_arms(opts: dict, arms: list, starts: dict, data_keys, eval_batch) -> tuple:
    """Per arm ``(train_chunk(params, opt_state, data_keys, start), evaluate)`` with its ``z_mode``
    bound, its ``[params, opt_state]`` (own buffers: each arm's step donates them) and its compile
    seconds. The arms with bias share one compilation, the baseline has its own."""
    state, fns, compiled, seconds = {}, {}, {}, {}
    for arm in arms:
        with_bias = ARMS[arm] is not None
        params = jax.tree.map(jnp.copy, starts[arm])
        t0 = time.perf_counter()
        if with_bias not in compiled:
            f = make_fns(opts, with_bias)
            opt_state = jax.vmap(f.opt.init)(params)
            compiled[with_bias] = (
                f.opt,
                f.train_chunk.lower(params, opt_state, data_keys, jnp.zeros((), jnp.int32),
                                    jnp.zeros((), jnp.int32)).compile(),
                f.evaluate.lower(params, eval_batch).compile())
        opt, train_chunk, evaluate = compiled[with_bias]
        seconds[arm] = time.perf_counter() - t0
        state[arm] = [params, jax.vmap(opt.init)(params)]
        z_mode = jnp.asarray(Z_MODES.index(ARMS[arm]) if with_bias else 0, jnp.int32)
        fns[arm] = (lambda p, o, k, s, _f=train_chunk, _z=z_mode: _f(p, o, k, s, _z), evaluate)
    return state, fns, seconds


def run(opts: dict, progress: bool = True, checkpoint_path=None) -> dict:
    """Train every arm of ``opts["arms"]`` on every seed of ``opts["seeds"]``; returns ``summarise``'s
    report, ``dict(arms={arm: ...})``.

    ``opts["steps"]`` must be a multiple of ``opts["eval_every"]``. ``checkpoint_path``: after every
    chunk the state is saved there (``linicl.checkpoint``); a run with the same settings resumes from
    it and ends with the same numbers as an uninterrupted one (the data of a chunk is a function of the
    seeds and the chunk's first step)."""
    if opts["steps"] < 1 or opts["eval_every"] < 1 or opts["steps"] % opts["eval_every"]:
        raise LiniclError(f"run: steps ({opts['steps']}) must be a positive multiple of eval_every "
                         f"({opts['eval_every']})")
    seeds, arms = list(opts["seeds"]), list(opts["arms"])
    n_chunks = opts["steps"] // opts["eval_every"]
    seed_keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    bias_params, base_params = shared_init(opts, fold(seed_keys, 0))
    warm_params = warm_bias(opts, bias_params, fold(seed_keys, 3)) if any(a in WARM for a in arms) else None
    data_keys = fold(seed_keys, 1)
    eval_batch = jax.jit(jax.vmap(sampler(opts, opts["eval_batch"])))(fold(seed_keys, 2))
    starts = {arm: warm_params if arm in WARM else bias_params if ARMS[arm] is not None else base_params
              for arm in arms}
    state, fns, compile_s = _compile_arms(opts, arms, starts, data_keys, eval_batch)
    timing = {arm: dict(compile_s=compile_s[arm], train_s=0.0, eval_s=0.0) for arm in arms}
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


# ---------------------------------------------------------------------------------------- summary
def _round(xs) -> list:
    """A curve as a list of floats with 7 significant digits (float32 precision)."""
    return [float(f"{x:.7g}") for x in np.asarray(xs, np.float64)]


def _thresholds(steps: list, ctx_acc: np.ndarray) -> dict:
    """Per threshold of ``THRESHOLDS``: the first evaluated step each seed's in-context accuracy
    (``ctx_acc``, ``[seeds, evals]``) exceeds it, and that of the mean curve."""
    out = {}
    for thr in THRESHOLDS:
        per_seed = [steps_to_threshold(steps, row, thr) for row in ctx_acc]
        reached = [s for s in per_seed if s is not None]
        out[str(thr)] = dict(per_seed=per_seed, of_mean_curve=steps_to_threshold(steps, ctx_acc.mean(axis=0), thr),
                             mean_over_seeds_that_reached=(float(np.mean(reached)) if reached else None),
                             n_reached=len(reached))
    return out


def _denominator_checks(seeds: list, train: dict, ev: dict, params) -> dict:
    """The smallest denominators seen in training and evaluation, the first step (per seed) whose
    smallest denominator was <= 0, and for an arm with bias (``params`` not None) its final b and B."""
    den = dict(
        min_train=float(train["den_min"].min()), min_eval=float(ev["den_min"].min()),
        min_first_position=float(min(train["den_first_min"].min(), ev["den_first_min"].min())),
        min_bias_term=float(min(train["bias_term_min"].min(), ev["bias_term_min"].min())),
        min_z_bias_entry=float(train["z_bias_min"].min()),
        first_nonpositive_step={str(s): next((int(i) + 1 for i, v in enumerate(train["den_min"][r])
                                              if v <= 0), None) for r, s in enumerate(seeds)})
    den["stayed_positive"] = den["min_train"] > 0 and den["min_eval"] > 0
    if params is not None:
        flat = traverse_util.flatten_dict(params)
        entries = {name: np.concatenate([np.asarray(v).ravel() for k, v in flat.items() if k[-1] == name])
                   for name in BIAS_PARAMS}
        zb, sb = entries["z_bias"], entries["S_bias"]
        den.update(final_negative_z_bias_fraction=float((zb < 0).mean()), final_z_bias_abs_max=float(np.abs(zb).max()),
                   final_S_bias_abs_max=float(np.abs(sb).max()))
    return den


def summarise(opts: dict, curves: dict, timing: dict, final_params: dict) -> dict:
    """Per arm: every curve per seed (7 significant digits), final metrics (``stats.spread`` over
    seeds), steps to the in-context accuracy ``THRESHOLDS``, denominator checks and timings.

    Args:
      opts: the run's options.
      curves: per arm ``dict(train={metric: [f[seeds, eval_every] per chunk]}, eval={metric:
        [f[seeds] per evaluation]}, eval_steps=[step per evaluation])``.
      timing: per arm its seconds (``compile_s``, ``train_s``, ``eval_s``).
      final_params: per arm its final params (leading seed axis).
    """
    seeds = list(opts["seeds"])
    out = {}
    for arm, c in curves.items():
        train = {k: np.concatenate(v, axis=1) for k, v in c["train"].items()}  # [seeds, steps]
        ev = {k: np.stack(v, axis=1) for k, v in c["eval"].items()}           # [seeds, evals]
        steps = c["eval_steps"]
        final = {k: stats.spread(ev[k][:, -1]) for k in ("loss", "ctx_loss", "ctx_acc", "acc")}
        final["train_loss_last_eval_window"] = stats.spread(train["loss"][:, -opts["eval_every"]:].mean(axis=1))
        final["best_ctx_acc"] = stats.spread(ev["ctx_acc"].max(axis=1))
        den = _denominator_checks(seeds, train, ev, final_params[arm] if ARMS[arm] is not None else None)
        out[arm] = dict(
            z_bias=ARMS[arm], eval_steps=steps,
            eval={k: {str(s): _round(v[r]) for r, s in enumerate(seeds)} for k, v in ev.items()},
            train={k: {str(s): _round(v[r]) for r, s in enumerate(seeds)} for k, v in train.items()},
            final=final, steps_to_ctx_acc=_thresholds(steps, ev["ctx_acc"]), denominators=den, timing=timing[arm],
            finite=bool(all(np.isfinite(v).all() for v in list(train.values()) + list(ev.values()))))
    return dict(arms=out)
