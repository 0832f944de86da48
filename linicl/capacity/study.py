"""The recall-capacity study: one small model per mixer (``mixers.MIXERS``) trained on a task, saved
as a checkpoint, and evaluated prompted and with its prompt converted into weights.

A run is described by one dict of options (``options``): the model sizes shared by every mixer
(``vocab``, ``d_model``, ``n_layers``, ``n_heads``, ``d_ff``, ``short_conv``), the training budgets
(``lr``, ``chunk``; MQAR's ``circuit_steps``, ``circuit_batch``, ``vocab_steps``, ``steps``,
``train_pairs``, ``queries``; the regression's ``reg_dx``, ``reg_examples``, ``reg_steps``,
``reg_batch``), the evaluation's sizes (MQAR's ``pairs``, ``eval_queries``, ``eval_batch``; the
regression's ``reg_k``, ``reg_eval_batch``), ``mixers``, ``tasks``, ``seed`` and ``quick``. ``FULL``
holds the sizes of the default run, ``QUICK`` those of a smoke test.

Tasks (``TASKS``, each a ``Task``): ``"mqar"`` (``linicl.capacity.mqar``: its curriculum, token
inputs) and ``"regression"`` (``linicl.capacity.regression``: one stage, continuous inputs between a
read-in and a read-out). ``trained`` returns the model of one (mixer, task): loaded from
``OUT/checkpoints/<prefix><mixer>.ckpt`` when that was trained under the same ``settings`` (a
fingerprint of everything that shapes training, never of the evaluation's options), else trained
(``linicl.training.train_stages``, float32) and saved. ``run`` does so for every mixer of the options
and evaluates each in float64 (``mixers.eval_model``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

from linicl import checkpoint, reporting, training
from linicl.capacity import mqar, regression
from linicl.capacity.mixers import MIXERS, eval_model, init_params, mixer_config, state_label
from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.nn import Transformer
from linicl.timing import FAST_COMPILE, QUICK_COMPILE

__all__ = ["FULL", "QUICK", "TRAINING", "REG_TRAINING", "TRAINER", "options", "model_config", "regression_config",
           "mqar_init", "regression_init", "stages", "regression_stages", "Task", "TASKS", "train", "settings",
           "trained", "evaluate_mqar", "regression_tasks", "evaluate_regression", "run"]

# The options that shape a trained MQAR model (in its checkpoint's fingerprint).
TRAINING = ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "lr", "circuit_steps", "circuit_batch",
            "vocab_steps", "steps", "train_pairs", "queries", "chunk", "seed")
# The regression's: the same model sizes (its vocabulary is unused), its own data and steps.
REG_TRAINING = ("d_model", "n_layers", "n_heads", "d_ff", "lr", "reg_dx", "reg_examples", "reg_steps",
                "reg_batch", "chunk", "seed")
# Recorded in every checkpoint's settings since the first runs (the script that trained them): part of
# their fingerprint, so it stays as it is for those checkpoints to stay valid.
TRAINER = "experiments/recall_capacity.py"

# Sized for about 30 CPU-minutes (2 cores) for all seven mixers on MQAR, and about 12 more on the
# regression.
FULL = dict(vocab=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, lr=3e-3, circuit_steps=1200,
            circuit_batch=256, vocab_steps=300, steps=1000, train_pairs=[2, 4, 8, 16, 32], queries=128,
            chunk=50, pairs=[4, 8, 16, 32], eval_queries=4, eval_batch=256,
            reg_dx=8, reg_examples=32, reg_steps=1000, reg_batch=64, reg_k=[1, 2, 4, 8, 16, 32],
            reg_eval_batch=256, short_conv=0)
# Quick: one compiled training chunk serves both MQAR stages (the same sizes, vocabulary and length).
# The regression's held-out tasks are more than the full run's: cheap at these sizes, and enough to see
# the zero predictor's error near its expected 1.
QUICK = dict(vocab=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, lr=3e-3, circuit_steps=2,
             circuit_batch=8, vocab_steps=2, steps=2, train_pairs=[2], queries=8, chunk=2,
             pairs=[2, 4], eval_queries=2, eval_batch=8,
             reg_dx=2, reg_examples=4, reg_steps=2, reg_batch=8, reg_k=[1, 2, 4], reg_eval_batch=512, short_conv=0)


# ---------------------------------------------------------------------------------------- setup
def options(quick: bool = False, **changes) -> dict:
    """A run's options: ``FULL`` (or ``QUICK``) with every mixer and task, seed 0, and ``changes``
    applied (a None in ``changes`` keeps the default)."""
    opts = dict(QUICK if quick else FULL, mixers=list(MIXERS), tasks=list(TASKS), seed=0, quick=quick)
    unknown = sorted(set(changes) - set(opts))
    if unknown:
        raise LiniclError(f"options: unknown option(s) {', '.join(unknown)}; known: {', '.join(opts)}")
    opts.update({k: v for k, v in changes.items() if v is not None})
    return opts


def model_config(opts: dict, mixer: str) -> ModelConfig:
    """The MQAR model of ``mixer``: long enough for 2n + 2m - 1 tokens with m <= n pairs and queries of
    ``pairs`` and ``train_pairs``. With ``short_conv`` K > 0 every linear-family mixer gets a K-tap
    causal convolution of q, k, v with SiLU after it (as DeltaNet and Gated DeltaNet; softmax keeps
    none: the zoo's convolution is a finite-state option)."""
    sizes = {k: opts[k] for k in ("d_model", "n_layers", "n_heads", "d_ff")}
    cfg = mixer_config(mixer, vocab_size=opts["vocab"], max_len=4 * max(opts["pairs"] + opts["train_pairs"]),
                       **sizes)
    if opts.get("short_conv") and cfg.attention == "linear":
        cfg = cfg.replace(short_conv=opts["short_conv"], short_conv_activation="silu")
    return cfg


def regression_config(opts: dict, mixer: str) -> ModelConfig:
    """The regression model: MQAR's sizes, one (unused) token, ``max_len`` the training sequences' 2 *
    ``reg_examples`` (no mixer has learned positions: longer evaluation sequences are fine, and
    ``reg_k`` never retrains)."""
    return model_config(opts, mixer).replace(vocab_size=1, max_len=2 * opts["reg_examples"])


def mqar_init(opts: dict, mixer: str, key) -> dict:
    """Initial params of the MQAR model of ``mixer`` (``mixers.init_params``: gates at the decays)."""
    return init_params(model_config(opts, mixer), key)


def regression_init(opts: dict, mixer: str, key) -> dict:
    """Initial params ``{"model", "read_in", "read_out"}`` of the regression model of ``mixer``."""
    return regression.init(regression_config(opts, mixer), opts["reg_dx"], key)


def stages(opts: dict) -> list:
    """MQAR's training stages (``mqar.curriculum``)."""
    return mqar.curriculum(opts["vocab"], **{k: opts[k] for k in ("circuit_steps", "circuit_batch", "vocab_steps",
                                                                   "steps", "train_pairs", "queries")})


def regression_stages(opts: dict) -> list:
    """The regression's one training stage (``regression.stage``)."""
    return [regression.stage(opts["reg_examples"], opts["reg_dx"], opts["reg_batch"], opts["reg_steps"])]


# ---------------------------------------------------------------------------------------- evaluation
def evaluate_mqar(opts: dict, mixer: str, params) -> list:
    """One row per number of pairs of ``pairs`` (``mqar.evaluate`` on ``eval_batch`` held-out
    sequences of ``eval_queries`` queries), in float64."""
    model, params = eval_model(model_config(opts, mixer), params)
    apply = jax.jit(model.apply, compiler_options=FAST_COMPILE)
    # numpy for everything around the model: eager jnp calls would each compile
    held_out = lambda n: jax.tree.map(np.asarray, mqar.held_out(  # noqa: E731
        opts["seed"], opts["eval_batch"], n, opts["eval_queries"], opts["vocab"]))
    return [mqar.evaluate(model, apply, {"params": params}, held_out(n), n) for n in opts["pairs"]]


def regression_tasks(opts: dict):
    """The held-out regression tasks (``regression.held_out``: ``reg_eval_batch`` tasks of ``max(reg_k)
    + 1`` pairs): the same for every mixer and baseline."""
    return regression.held_out(opts["seed"], opts["reg_eval_batch"], max(opts["reg_k"]) + 1, opts["reg_dx"])


def evaluate_regression(opts: dict, mixer: str, params) -> list:
    """One row per k of ``reg_k`` (``regression.evaluate`` on ``regression_tasks``), in float64."""
    model, params = eval_model(regression_config(opts, mixer), params)
    apply = jax.jit(lambda *a: regression.regress(model, *a), compiler_options=FAST_COMPILE)
    return regression.evaluate(model, apply, params, regression_tasks(opts), opts["reg_k"])


# ---------------------------------------------------------------------------------------- tasks
class Task(NamedTuple):
    """What trains and evaluates one model per mixer on a task."""

    prefix: str         # of its checkpoints' file names
    config: Callable    # (opts, mixer) -> ModelConfig
    init: Callable      # (opts, mixer, key) -> initial params
    plan: Callable      # opts -> [Stage]
    loss: Callable      # (opts, model, stage) -> loss_fn(params, key) -> (loss, aux)
    record: Callable    # (stage, aux[steps, ...]) -> a chunk's history entry, the task's own part
    training: tuple     # the options that shape the trained model (in its fingerprint)
    evaluate: Callable  # (opts, mixer, params) -> one row per evaluated prompt size


TASKS = {
    "mqar": Task("", model_config, mqar_init, stages, lambda o, model, s: mqar.loss_fn(model, s, o["vocab"]),
                 mqar.record, TRAINING, evaluate_mqar),
    "regression": Task("regression_", regression_config, regression_init, regression_stages,
                       lambda o, model, s: regression.loss_fn(model, s), lambda stage, aux: {}, REG_TRAINING,
                       evaluate_regression),
}


def _task(task: str) -> Task:
    if task not in TASKS:
        raise LiniclError(f"task: unknown task {task!r}; known: {', '.join(TASKS)}")
    return TASKS[task]


# ---------------------------------------------------------------------------------------- training
def train(opts: dict, mixer: str, bar=None, task: str = "mqar") -> tuple:
    """Train the model of ``mixer`` on ``task`` through its stages from ``PRNGKey(seed)`` (init from
    ``fold_in(., 0)``, data from ``fold_in(., 1)``) with ``training.warmup_cosine_adam(lr)``;
    ``(params, history)`` (``training.train_stages``). ``bar``: a tqdm bar advanced by the steps."""
    t = _task(task)
    model = Transformer(t.config(opts, mixer))
    plan = t.plan(opts)
    root = jax.random.PRNGKey(opts["seed"])

    def on_chunk(stage, length, entry):
        if bar is not None:
            bar.update(length)
            bar.set_postfix_str(f"{mixer} {stage.name} loss {entry['loss']:.3f}")

    return training.train_stages(
        t.init(opts, mixer, jax.random.fold_in(root, 0)), plan, lambda stage: t.loss(opts, model, stage),
        training.warmup_cosine_adam(opts["lr"], sum(s.steps for s in plan)), jax.random.fold_in(root, 1),
        chunk=opts["chunk"], record=t.record, on_chunk=on_chunk,
        compiler_options=FAST_COMPILE if opts["quick"] else QUICK_COMPILE)


def settings(opts: dict, mixer: str, task: str = "mqar") -> dict:
    """What shapes a trained model, as its checkpoint stores it: the trainer, the mixer, its config, the
    task's training options (not the evaluation's) and stages, with their ``fingerprint``."""
    t = _task(task)
    kept = dict(trainer=TRAINER, mixer=mixer, model={k: v for k, v in t.config(opts, mixer).__dict__.items()},
                training={k: opts[k] for k in t.training}, stages=[s._asdict() for s in t.plan(opts)])
    if task != "mqar":  # MQAR's settings predate the tasks: unchanged, its checkpoints stay valid
        kept["task"] = task
    kept = json.loads(json.dumps(kept))  # as the checkpoint stores it: tuples become lists
    return dict(kept, fingerprint=reporting.fingerprint(kept))


def trained(opts: dict, mixer: str, out: str, bar=None, task: str = "mqar") -> tuple:
    """``(params, meta, reused)``: the model of ``mixer`` on ``task`` from its checkpoint
    ``out/checkpoints/<prefix><mixer>.ckpt`` when made under the same ``settings``, else newly
    trained (``train``) and saved there (a checkpoint of other settings is replaced). ``meta``:
    ``history`` and ``train_s``."""
    t = _task(task)
    path = os.path.join(out, "checkpoints", f"{t.prefix}{mixer}.ckpt")
    want = settings(opts, mixer, task)
    template = jax.eval_shape(lambda: t.init(opts, mixer, jax.random.PRNGKey(0)))
    if checkpoint.exists(path):
        if checkpoint.header(path).settings == want:
            tree, meta = checkpoint.load(path, {"params": template}, settings=want)
            if bar is not None:
                bar.update(sum(s.steps for s in t.plan(opts)))
            return jax.tree.map(jax.numpy.asarray, tree["params"]), meta, True
        print(f"{path} was trained under other settings; training {mixer} ({task}) again", file=sys.stderr)
    t0 = time.perf_counter()
    params, history = train(opts, mixer, bar, task)
    meta = dict(history=history, train_s=time.perf_counter() - t0)
    checkpoint.save(path, {"params": params}, settings=want, meta=meta)
    return params, meta, False


def run(opts: dict, out: str, progress: bool = True, task: str = "mqar") -> dict:
    """Train (or load, ``trained``) and evaluate every mixer of ``opts["mixers"]`` on ``task``;
    ``{mixer: dict(model, state, reused_checkpoint, train_s, eval_s, history, eval)}`` (``eval``: the
    task's evaluation rows; ``state``: ``mixers.state_label``)."""
    from tqdm.auto import tqdm

    t = _task(task)
    total = len(opts["mixers"]) * sum(s.steps for s in t.plan(opts))
    results = {}
    with tqdm(total=total, desc=f"train {task}", disable=not progress) as bar:
        for mixer in opts["mixers"]:
            params, meta, reused = trained(opts, mixer, out, bar, task)
            t0 = time.perf_counter()
            rows = t.evaluate(opts, mixer, params)
            cfg = t.config(opts, mixer)
            results[mixer] = dict(model=cfg.describe(), state=state_label(cfg), reused_checkpoint=reused,
                                  train_s=meta["train_s"], eval_s=time.perf_counter() - t0,
                                  history=meta["history"], eval=rows)
    return results
