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

The arms, the training loop and its summary are ``linicl.bias_training`` (``options``, ``run``); this
script is its command line. Writes ``OUT/bias_training.json`` (the config, every curve per arm and
seed, final metrics, steps-to-threshold, wall times) and ``OUT/bias_training.png`` (mean over seeds,
shaded min-max).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import numpy as np

from linicl import reporting
from linicl.bias_training import ARMS, FULL, QUICK, THRESHOLDS, model_config, options, run, sampler
from linicl.compiled import enable_persistent_cache
from linicl.errors import LiniclError
from linicl.reporting import nonnegative_float, nonnegative_int, positive_float, positive_int


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
        sampler(opts)(jax.random.PRNGKey(0), batch=1)
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
