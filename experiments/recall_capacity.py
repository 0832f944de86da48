"""Recall capacity of the zoo's mixers on multi-query associative recall (Zoology's MQAR) and on
in-context linear regression, and the same predictions read from the prompt converted into weights.

``--tasks`` (default both): ``mqar`` and ``regression``, one small model per mixer of ``--mixers``
(``--d-model`` 64, 2 layers, 4 heads, MLP 128): the seven of ``linicl.capacity.mixers``, whose finite
states hold the same number of floats per prompt; softmax's prompt is a KV cache, not convertible.

MQAR (``linicl.capacity.mqar``): the curriculum ``circuit`` (``--circuit-steps``, 2 pairs and 1 query
on 16 tokens, batch ``--circuit-batch``), ``vocab <V'>`` (``--vocab-steps`` per doubling of the
sub-vocabulary) and ``pairs`` (``--steps``, one batch per size of ``--train-pairs``, ``--queries`` /
queries sequences); float32, ``linicl.training.warmup_cosine_adam`` (``--lr``). Evaluation in float64
(the trained weights cast): for each number of pairs of ``--pairs``, ``--eval-batch`` held-out
sequences with ``--eval-queries`` queries, the accuracy with its 95 % Wilson interval (queries of one
sequence share a prompt: somewhat optimistic); every finite-state model is also converted on the pairs
and must predict the same (asserted). Delta rule against additive (delta - linear, gated_delta -
gated): a paired bootstrap interval on the same queries. The default budget (about 30 minutes on 2
busy CPU cores) leaves every model far from trained at 8 pairs and more (RESULTS.md): the numbers
compare mixers under one small, equal budget, not their capacity at convergence.

Regression (Garg et al. arXiv 2208.01066; ``linicl.capacity.regression``): the same mixers and sizes
between a read-in and a read-out, ``--reg-steps`` steps of ``--reg-batch`` fresh tasks of
``--reg-examples`` pairs (d_x ``--reg-dx``), no curriculum; about 12 minutes for all seven. Evaluated
on ``--reg-eval-batch`` held-out tasks: for each k of ``--reg-k`` the error (prediction - y)^2 / d_x at
the (k+1)-th x (1: the zero predictor) with a 95 % bootstrap interval, prompted and converted
(relative difference <= 1e-10, asserted), beside least squares, averaging and zero on the same tasks.

Each trained model is checkpointed in ``OUT/checkpoints/<mixer>.ckpt`` (MQAR) or
``regression_<mixer>.ckpt`` (``linicl.checkpoint``) with a fingerprint of everything that shapes its
training; a later run with the same settings loads it instead of training (changing only the
evaluation options never retrains a regression model; MQAR's ``max_len`` follows ``--pairs``).

Writes ``OUT/recall_capacity.json`` (settings, every accuracy, count, interval, training curve and
timing; the regression under ``"regression"``), ``OUT/recall_capacity.png`` (accuracy against pairs,
converted as markers; training loss) and ``OUT/recall_capacity_regression.png`` (error against k,
baselines dashed; training loss); the tables are printed first, MQAR's then the regression's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

from linicl import checkpoint, reporting, stats, training
from linicl.capacity import mqar, regression
from linicl.capacity.mixers import MIXERS, decays, eval_model, init_params as _init, mixer_config, state_label
from linicl.capacity.mqar import widen  # noqa: F401  (the script's test reaches it here)
from linicl.capacity.regression import BASELINES  # noqa: F401
from linicl.compiled import enable_persistent_cache
from linicl.errors import LiniclError
from linicl.nn import Transformer
from linicl.reporting import nonnegative_int, positive_float, positive_int, positive_int_list
from linicl.timing import FAST_COMPILE, QUICK_COMPILE

TRAINING = ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "lr", "circuit_steps", "circuit_batch",
            "vocab_steps", "steps", "train_pairs", "queries", "chunk", "seed")
# The regression's: the same model sizes (its vocabulary is unused), its own data and steps.
REG_TRAINING = ("d_model", "n_layers", "n_heads", "d_ff", "lr", "reg_dx", "reg_examples", "reg_steps",
                "reg_batch", "chunk", "seed")

# Sized for about 30 CPU-minutes (2 cores) for all seven mixers on MQAR, and about 12 more on the
# regression (module docstring).
FULL = dict(vocab=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, lr=3e-3, circuit_steps=1200,
            circuit_batch=256, vocab_steps=300, steps=1000, train_pairs=[2, 4, 8, 16, 32], queries=128,
            chunk=50, pairs=[4, 8, 16, 32], eval_queries=4, eval_batch=256,
            reg_dx=8, reg_examples=32, reg_steps=1000, reg_batch=64, reg_k=[1, 2, 4, 8, 16, 32],
            reg_eval_batch=256, short_conv=0)
# Quick: one compiled training chunk serves both stages (the same sizes, vocabulary and length). The
# regression's held-out tasks are more than the full run's: cheap at these sizes, and enough to see
# the zero predictor's error near its expected 1 (the test checks it).
QUICK = dict(vocab=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, lr=3e-3, circuit_steps=2,
             circuit_batch=8, vocab_steps=2, steps=2, train_pairs=[2], queries=8, chunk=2,
             pairs=[2, 4], eval_queries=2, eval_batch=8,
             reg_dx=2, reg_examples=4, reg_steps=2, reg_batch=8, reg_k=[1, 2, 4], reg_eval_batch=512, short_conv=0)


# ---------------------------------------------------------------------------------------- setup
def options(quick: bool = False, **changes) -> dict:
    """The run's options: ``FULL`` (or ``QUICK``) with ``changes`` applied."""
    opts = dict(QUICK if quick else FULL, mixers=list(MIXERS), tasks=list(TASKS), seed=0, quick=quick)
    opts.update({k: v for k, v in changes.items() if v is not None})
    return opts


def model_config(opts: dict, mixer: str):
    """The MQAR model of ``mixer``: long enough for 2n + 2m - 1 tokens with m <= n; with ``--short-conv
    K`` every linear-family mixer gets a K-tap causal convolution of q, k, v with SiLU after it (as
    DeltaNet and Gated DeltaNet; softmax keeps none: the zoo's convolution is a finite-state option)."""
    sizes = {k: opts[k] for k in ("d_model", "n_layers", "n_heads", "d_ff")}
    cfg = mixer_config(mixer, vocab_size=opts["vocab"], max_len=4 * max(opts["pairs"] + opts["train_pairs"]),
                       **sizes)
    if opts.get("short_conv") and cfg.attention == "linear":
        cfg = cfg.replace(short_conv=opts["short_conv"], short_conv_activation="silu")
    return cfg


def regression_config(opts: dict, mixer: str):
    """The regression model: MQAR's sizes, one (unused) token, ``max_len`` the training sequences' (no
    mixer has learned positions: longer evaluation sequences are fine, and ``--reg-k`` never retrains)."""
    return model_config(opts, mixer).replace(vocab_size=1, max_len=2 * opts["reg_examples"])


def init_params(opts: dict, mixer: str, key) -> dict:
    return _init(model_config(opts, mixer), key)


def regression_init(opts: dict, mixer: str, key) -> dict:
    return regression.init(regression_config(opts, mixer), opts["reg_dx"], key)


def stages(opts: dict) -> list:
    return mqar.curriculum(opts["vocab"], **{k: opts[k] for k in ("circuit_steps", "circuit_batch", "vocab_steps",
                                                                   "steps", "train_pairs", "queries")})


def regression_stages(opts: dict) -> list:
    return [regression.stage(opts["reg_examples"], opts["reg_dx"], opts["reg_batch"], opts["reg_steps"])]


def check_options(opts: dict) -> None:
    """Raise LiniclError naming the option when a size cannot work (before any training)."""
    V, half = opts["vocab"], opts["vocab"] // 2
    if V < 4 or V % 2:
        raise LiniclError(f"--vocab must be even and >= 4 (keys and values are its halves), got {V}")
    for name in ("pairs", "train_pairs"):
        if max(opts[name]) > half:
            raise LiniclError(f"--{name.replace('_', '-')} {max(opts[name])} distinct keys do not fit in "
                              f"the {half} keys of --vocab {V}")
    if opts["eval_queries"] > min(opts["pairs"]):
        raise LiniclError(f"--eval-queries {opts['eval_queries']} must be <= the smallest --pairs "
                          f"({min(opts['pairs'])}): each pair is queried at most once")
    for name, known in (("mixers", MIXERS), ("tasks", TASKS)):
        for x in opts[name]:
            if x not in known:
                raise LiniclError(f"--{name}: unknown {name[:-1]} {x!r}; known: {', '.join(known)}")
    for mixer in opts["mixers"]:
        model_config(opts, mixer)  # a ConfigError names the field


# ---------------------------------------------------------------------------------------- training
def train(opts: dict, mixer: str, bar=None, task: str = "mqar") -> tuple:
    """Train one mixer on ``task`` through its stages; ``(params, history)`` (``training.train_stages``)."""
    t = TASKS[task]
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
    """What shapes a trained model: the mixer, its config and the task's training options (not the
    evaluation's), with their fingerprint."""
    t = TASKS[task]
    kept = dict(trainer="experiments/recall_capacity.py", mixer=mixer,
                model={k: v for k, v in t.config(opts, mixer).__dict__.items()},
                training={k: opts[k] for k in t.training}, stages=[s._asdict() for s in t.plan(opts)])
    if task != "mqar":  # MQAR's settings predate the tasks: unchanged, its checkpoints stay valid
        kept["task"] = task
    kept = json.loads(json.dumps(kept))  # as the checkpoint stores it: tuples become lists
    return dict(kept, fingerprint=reporting.fingerprint(kept))


def trained(opts: dict, mixer: str, out: str, bar=None, task: str = "mqar") -> tuple:
    """``(params, meta, reused)``: the checkpoint of the same settings (``OUT/checkpoints/<mixer>.ckpt``,
    ``regression_<mixer>.ckpt``), or a newly trained model (saved). A checkpoint made under other
    settings is trained again and replaced."""
    t = TASKS[task]
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


# ---------------------------------------------------------------------------------------- evaluation
def evaluate(opts: dict, mixer: str, params) -> list:
    """One row per number of pairs of ``--pairs`` (``mqar.evaluate``), float64."""
    model, params = eval_model(model_config(opts, mixer), params)
    apply = jax.jit(model.apply, compiler_options=FAST_COMPILE)
    # numpy for everything around the model: eager jnp calls would each compile
    held_out = lambda n: jax.tree.map(np.asarray, mqar.held_out(  # noqa: E731
        opts["seed"], opts["eval_batch"], n, opts["eval_queries"], opts["vocab"]))
    return [mqar.evaluate(model, apply, {"params": params}, held_out(n), n) for n in opts["pairs"]]


def regression_tasks(opts: dict):
    """The held-out tasks, ``max(--reg-k) + 1`` pairs each: the same for every mixer and baseline."""
    return regression.held_out(opts["seed"], opts["reg_eval_batch"], max(opts["reg_k"]) + 1, opts["reg_dx"])


def evaluate_regression(opts: dict, mixer: str, params) -> list:
    """One row per k of ``--reg-k`` (``regression.evaluate``), float64."""
    model, params = eval_model(regression_config(opts, mixer), params)
    apply = jax.jit(lambda *a: regression.regress(model, *a), compiler_options=FAST_COMPILE)
    return regression.evaluate(model, apply, params, regression_tasks(opts), opts["reg_k"])


# ---------------------------------------------------------------------------------------- tasks
class Task(NamedTuple):
    """What trains and evaluates one model per mixer on a task of ``--tasks``."""

    prefix: str         # of its checkpoints' file names
    config: Callable    # (opts, mixer) -> ModelConfig
    init: Callable      # (opts, mixer, key) -> initial params
    plan: Callable      # opts -> [Stage]
    loss: Callable      # (opts, model, stage) -> loss_fn(params, key) -> (loss, aux)
    record: Callable    # (stage, aux[steps, ...]) -> a chunk's history entry, the task's own part
    training: tuple     # the options that shape the trained model (in its fingerprint)
    evaluate: Callable  # (opts, mixer, params) -> one row per evaluated prompt size


TASKS = {
    "mqar": Task("", model_config, init_params, stages, lambda o, model, s: mqar.loss_fn(model, s, o["vocab"]),
                 mqar.record, TRAINING, evaluate),
    "regression": Task("regression_", regression_config, regression_init, regression_stages,
                       lambda o, model, s: regression.loss_fn(model, s), lambda stage, aux: {}, REG_TRAINING,
                       evaluate_regression),
}


# ---------------------------------------------------------------------------------------- report
def _fmt(iv: dict) -> str:
    return stats.Interval(iv["acc"], iv["low"], iv["high"]).fmt()


def _fmt_error(iv: dict) -> str:
    return stats.Interval(iv["mean"], iv["low"], iv["high"]).fmt(scale=1, digits=3)


def table(results: dict) -> str:
    """One row per mixer and number of pairs: prompt floats, prompted and converted accuracy."""
    rows = []
    for mixer, r in results.items():
        for e in r["eval"]:
            conv = (_fmt(e["converted"]), "yes" if e["identical"] else "NO") if "converted" in e \
                else ("not convertible (KV cache)", "")
            rows.append([mixer, e["pairs"], e["prompt_floats"], _fmt(e["prompted"]), *conv])
    return reporting.markdown_table(["mixer", "pairs", "prompt floats", "prompted acc % [95 % CI]",
                                     "converted acc % [95 % CI]", "same predictions"], rows)


def comparison_table(comps: list) -> str:
    rows = [[f"{c['delta']} - {c['additive']}", c["pairs"],
             stats.Interval(c["diff"], c["low"], c["high"]).fmt() + ("" if c["significant"] else " (n.s.)")]
            for c in comps]
    header = ["delta rule - additive", "pairs", "accuracy difference, points [95 % CI]"]
    return reporting.markdown_table(header, rows)


def mqar_tables(report: dict) -> str:
    """The MQAR table, then the delta-rule comparisons (when both of a pair ran)."""
    comps = report["comparisons"]
    return table(report["results"]) + (("\n\n" + comparison_table(comps)) if comps else "")


def regression_table(reg: dict) -> str:
    """One row per mixer and k: prompt floats, prompted and converted error; then the baselines, one
    row per k."""
    rows = []
    for mixer, r in reg["results"].items():
        for e in r["eval"]:
            conv = (f"{e['converted']:.3f}", f"yes ({e['max_rel_diff']:.0e})" if e["identical"] else "NO") \
                if "converted" in e else ("not convertible (KV cache)", "")
            rows.append([mixer, e["k"], e["prompt_floats"], _fmt_error(e["prompted"]), *conv])
    mixers = reporting.markdown_table(["mixer", "pairs k", "prompt floats", "prompted error [95 % CI]",
                                       "converted error", "same predictions (max rel. diff.)"], rows)
    base = [[k] + [_fmt_error(rows[i]["error"]) for rows in reg["baselines"].values()]
            for i, k in enumerate(reg["config"]["reg_k"])]
    header = ["pairs k"] + [f"{name} error" for name in reg["baselines"]]
    return mixers + "\n\n" + reporting.markdown_table(header, base)


def regression_heading(cfg: dict) -> str:
    return (f"In-context linear regression, d_x {cfg['reg_dx']}, d_model {cfg['d_model']}, {cfg['n_layers']} "
            f"layers, {cfg['n_heads']} heads, trained on {cfg['reg_examples']} pairs ({cfg['reg_steps']} steps "
            f"x {cfg['reg_batch']} tasks); error at the (k+1)-th x: (prediction - y)^2 / d_x (1: the zero "
            f"predictor), mean over {cfg['reg_eval_batch']} held-out tasks [95 % bootstrap CI]")


def headline(report: dict) -> str:
    """The tables of the tasks that ran (RESULTS.md's section)."""
    parts = [mqar_tables(report)] if "results" in report else []
    if "regression" in report:
        parts += [regression_heading(report["regression"]["config"]), report["regression"]["table"]]
    return "\n\n".join(parts)


def _mixer_lines(ax, x, results: dict, colors: list, value: str, converted: Callable) -> None:
    """Per mixer its prompted ``value`` against ``x`` with the interval as error bars and, where every
    point has one, ``converted(row)`` as hollow markers; log2 x axis."""
    for c, (mixer, r) in zip(colors, results.items()):
        ivs = [e["prompted"] for e in r["eval"]]
        v = np.array([iv[value] for iv in ivs])
        low, high = (np.array([iv[end] for iv in ivs]) for end in ("low", "high"))
        err = [np.maximum(v - low, 0), np.maximum(high - v, 0)]  # a bootstrap interval may miss its mean
        ax.errorbar(x, v, yerr=err, color=c, marker=".", capsize=3, label=f"{mixer} ({r['state']})")
        if all("converted" in e for e in r["eval"]):
            ax.plot(x, [converted(e) for e in r["eval"]], "o", mfc="none", ms=11, color=c)
    ax.plot([], [], "o", mfc="none", color="k", ms=11, label="converted prompt (same)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(p) for p in x])
    ax.minorticks_off()


def _loss_curves(ax, results: dict, colors: list, ylabel: str, title: str, stage_steps=()) -> None:
    """Every mixer's training loss against the step, the stage boundaries dotted."""
    for c, (mixer, r) in zip(colors, results.items()):
        ax.plot([x["step"] for x in r["history"]], [x["loss"] for x in r["history"]], color=c, label=mixer)
    ax.set(yscale="log", xlabel="training step", ylabel=ylabel, title=title)
    for stage_end in np.cumsum(stage_steps)[:-1]:
        ax.axvline(stage_end, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=7)


def _colors(plt, n: int) -> list:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


def figure(plt, report: dict):
    """Accuracy against pairs (lines: prompted, markers: converted), and the training loss."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = _colors(plt, len(report["results"]))
    pairs = report["config"]["pairs"]
    _mixer_lines(a, pairs, report["results"], colors, "acc", lambda e: e["converted"]["acc"])
    a.set(xlabel="key-value pairs in the prompt", ylabel="recall accuracy (95 % Wilson)", ylim=(-0.02, 1.02),
          title="MQAR recall")
    a.legend(fontsize=7)
    _loss_curves(b, report["results"], colors, "training loss (query keys)", "curriculum",
                 [s["steps"] for s in report["config"]["stages"]])
    fig.tight_layout()
    return fig


def regression_figure(plt, report: dict):
    """Error against k (lines: prompted, hollow markers: converted, dashed: the baselines), and the
    training loss."""
    reg = report["regression"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = _colors(plt, len(reg["results"]))
    ks = reg["config"]["reg_k"]
    _mixer_lines(a, ks, reg["results"], colors, "mean", lambda e: e["converted"])
    for grey, (name, rows) in zip(("0.1", "0.4", "0.65"), reg["baselines"].items()):
        a.plot(ks, [e["error"]["mean"] for e in rows], ls="--", marker="x", color=grey, label=name)
    # least squares is exact (~1e-30) from k = d_x on: the axis stops below the models' errors
    lows = [e["prompted"]["low"] for r in reg["results"].values() for e in r["eval"]]
    a.set_yscale("log")
    a.set_ylim(bottom=max(1e-6, min([0.1] + [0.5 * x for x in lows if x > 0])))
    a.set(xlabel="(x, y) pairs in the prompt, k", ylabel="squared error / d_x at the next x (95 % bootstrap)",
          title=f"in-context linear regression, d_x = {reg['config']['reg_dx']}")
    a.legend(fontsize=7)
    _loss_curves(b, reg["results"], colors, "training loss (squared error / d_x)", "regression training")
    fig.tight_layout()
    return fig


# (the report's part, the file, the figure)
FIGURES = (("results", "recall_capacity.png", figure),
           ("regression", "recall_capacity_regression.png", regression_figure))


def run(opts: dict, out: str, progress: bool = True, task: str = "mqar") -> dict:
    """Train (or load) and evaluate every mixer on ``task``; ``{mixer: its results}``."""
    from tqdm.auto import tqdm

    t = TASKS[task]
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


def regression_report(opts: dict, out: str, progress: bool) -> dict:
    """The regression part of the report: its settings, every mixer's results, the baselines, the
    table and the wall time."""
    t0 = time.perf_counter()
    results = run(opts, out, progress, task="regression")
    config = dict({k: opts[k] for k in REG_TRAINING + ("reg_k", "reg_eval_batch")},
                  stages=[s._asdict() for s in regression_stages(opts)])
    reg = dict(config=config, results=results, baselines=regression.baselines(regression_tasks(opts), opts["reg_k"]))
    return dict(reg, table=regression_table(reg), wall_s=time.perf_counter() - t0)


def print_models(results: dict) -> None:
    for mixer, r in results.items():
        how = "checkpoint reused" if r["reused_checkpoint"] else "trained"
        print(f"{mixer}: {r['model']}; {how} ({r['train_s']:.0f} s), evaluated in {r['eval_s']:.1f} s")


def print_summary(report: dict) -> None:
    cfg = report["config"]
    if "results" in report:
        print(f"\nMQAR, vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
              f"{cfg['n_heads']} heads; {cfg['eval_batch']} sequences x {cfg['eval_queries']} queries per point")
        print(mqar_tables(report))
        print_models(report["results"])
    if "regression" in report:
        print("\n" + regression_heading(report["regression"]["config"]))
        print(report["regression"]["table"])
        print_models(report["regression"]["results"])


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/recall_capacity", seed="initialisation, data, evaluation",
                              quick="tiny models, a few steps of each stage and task (CI, about a minute)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None,
                        help="default: both (mqar: recall; regression: in-context linear regression)")
    parser.add_argument("--mixers", nargs="+", choices=list(MIXERS), default=None, help="default: all")
    listed = lambda xs: ",".join(map(str, xs))  # noqa: E731
    parser.add_argument("--pairs", type=positive_int_list, default=None,
                        help=f"evaluated numbers of pairs, comma-separated (default {listed(FULL['pairs'])})")
    parser.add_argument("--train-pairs", type=positive_int_list, default=None,
                        help=f"pair counts of the pairs stage (default {listed(FULL['train_pairs'])})")
    for name, kind, what in (
            ("steps", positive_int, ""), ("circuit_steps", positive_int, ""), ("vocab_steps", positive_int, ""),
            ("vocab", positive_int, ""), ("d_model", positive_int, ""), ("n_layers", positive_int, ""),
            ("n_heads", positive_int, ""), ("d_ff", positive_int, ""), ("lr", positive_float, ""),
            ("circuit_batch", positive_int, ""), ("queries", positive_int, ""), ("chunk", positive_int, ""),
            ("eval_queries", positive_int, ""), ("eval_batch", positive_int, ""),
            ("reg_steps", positive_int, "regression training steps; "),
            ("reg_dx", positive_int, "regression input dimension d_x; "),
            ("reg_examples", positive_int, "(x, y) pairs per regression training sequence; "),
            ("reg_batch", positive_int, "regression tasks per training step; "),
            ("reg_k", positive_int_list, "evaluated numbers of regression pairs k, comma-separated; "),
            ("reg_eval_batch", positive_int, "held-out regression tasks; "),
            ("short_conv", nonnegative_int, "taps K of a short causal convolution of q, k, v (SiLU after it) in "
                                            "every linear-family mixer, 0: none; ")):
        shown = listed if isinstance(FULL[name], list) else str
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"{what}default {shown(FULL[name])} ({shown(QUICK[name])} with --quick)")
    args = parser.parse_args(argv)
    given = list(FULL) + ["mixers", "tasks"]
    changes = {k: getattr(args, k) for k in given if getattr(args, k, None) is not None}
    opts = options(args.quick, seed=args.seed, **changes)
    try:
        check_options(opts)
    except LiniclError as e:  # ConfigError too
        parser.error(str(e))
    if args.quick:  # a smoke test: compile time dominates, and XLA's optimisations do not pay off
        jax.config.update("jax_disable_most_optimizations", True)
    jax.config.update("jax_enable_x64", True)  # the evaluation's float64; training stays float32
    reporting.writable_dir(args.out)

    t0 = time.perf_counter()
    config = dict(opts, stages=[s._asdict() for s in stages(opts)], decays=list(decays(opts["n_heads"])))
    report = dict(config=config, machine=reporting.machine_info())
    if "mqar" in opts["tasks"]:
        results = run(opts, args.out, progress=args.progress)
        report.update(results=results, comparisons=mqar.compare(results))
    if "regression" in opts["tasks"]:
        report["regression"] = regression_report(opts, args.out, args.progress)
    report.update(table=headline(report), wall_s=time.perf_counter() - t0)
    reporting.write_json(os.path.join(args.out, "recall_capacity.json"), report, indent=None)
    print_summary(report)
    pngs = [reporting.plot(os.path.join(args.out, name), draw, report) for part, name, draw in FIGURES
            if part in report]
    written = [p.name for p in pngs if p is not None]
    print(f"\nwrote {args.out}/recall_capacity.json" + (" and " + ", ".join(written) if written else "")
          + f" ({report['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
