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
``regression_<mixer>.ckpt`` (``linicl.capacity.study.trained``) with a fingerprint of everything that
shapes its training; a later run with the same settings loads it instead of training (changing only the
evaluation options never retrains a regression model; MQAR's ``max_len`` follows ``--pairs``).

Writes ``OUT/recall_capacity.json`` (settings, every accuracy, count, interval, training curve and
timing; the regression under ``"regression"``), ``OUT/recall_capacity.png`` (accuracy against pairs,
converted as markers; training loss) and ``OUT/recall_capacity_regression.png`` (error against k,
baselines dashed; training loss); the tables are printed first, MQAR's then the regression's. The
options, training and evaluation are ``linicl.capacity.study``'s; the tables and figures
``linicl.capacity.report``'s.
"""

from __future__ import annotations

import os
import sys
import time

import jax

from linicl import reporting
from linicl.capacity import mqar, regression, report as capacity_report, study
from linicl.capacity.mixers import MIXERS, decays
from linicl.capacity.study import FULL, QUICK, TASKS, model_config, options, regression_stages, stages
from linicl.compiled import enable_persistent_cache
from linicl.errors import LiniclError
from linicl.reporting import nonnegative_int, positive_float, positive_int, positive_int_list


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


def regression_report(opts: dict, out: str, progress: bool) -> dict:
    """The regression part of the report: its settings, every mixer's results, the baselines, the
    table and the wall time."""
    t0 = time.perf_counter()
    results = study.run(opts, out, progress, task="regression")
    config = dict({k: opts[k] for k in study.REG_TRAINING + ("reg_k", "reg_eval_batch")},
                  stages=[s._asdict() for s in regression_stages(opts)])
    reg = dict(config=config, results=results,
               baselines=regression.baselines(study.regression_tasks(opts), opts["reg_k"]))
    return dict(reg, table=capacity_report.regression_table(reg), wall_s=time.perf_counter() - t0)


def print_models(results: dict) -> None:
    for mixer, r in results.items():
        how = "checkpoint reused" if r["reused_checkpoint"] else "trained"
        print(f"{mixer}: {r['model']}; {how} ({r['train_s']:.0f} s), evaluated in {r['eval_s']:.1f} s")


def print_summary(report: dict) -> None:
    cfg = report["config"]
    if "results" in report:
        print(f"\nMQAR, vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
              f"{cfg['n_heads']} heads; {cfg['eval_batch']} sequences x {cfg['eval_queries']} queries per point")
        print(capacity_report.mqar_tables(report))
        print_models(report["results"])
    if "regression" in report:
        print("\n" + capacity_report.regression_heading(report["regression"]["config"]))
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
        results = study.run(opts, args.out, progress=args.progress)
        report.update(results=results, comparisons=mqar.compare(results))
    if "regression" in opts["tasks"]:
        report["regression"] = regression_report(opts, args.out, args.progress)
    report.update(table=capacity_report.headline(report), wall_s=time.perf_counter() - t0)
    reporting.write_json(os.path.join(args.out, "recall_capacity.json"), report, indent=None)
    print_summary(report)
    pngs = [reporting.plot(os.path.join(args.out, name), draw, report) for part, name, draw in capacity_report.FIGURES
            if part in report]
    written = [p.name for p in pngs if p is not None]
    print(f"\nwrote {args.out}/recall_capacity.json" + (" and " + ", ".join(written) if written else "")
          + f" ({report['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
