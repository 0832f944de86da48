"""Innocenti & Achour (arXiv 2512.11255) on in-context linear regression: Fig. 1, A.3, A.1, A.2.

A 5-block causal softmax transformer (3 heads, d_model = d_x + 1 = 3, GELU MLP 3->12->12->3, no
attention biases, MLP biases, no positions, no final norm; ``--ln pre`` for the pre-LN Fig. A.3) is
trained with Adam (5e-2, 100 steps, 128 fresh tasks of N = 51 tokens per step) on the last
coordinate of the last token. At every step t (t = 0 is the initialisation) a fresh test batch gives:

* the test loss of the model and of the paper's implicit model (the last block patched with the
  last-token update, run on its contextualised query alone);
* per block: the Frobenius (= spectral: rank 1) norm of the last-token ΔW, mean over tasks.

At ``--msd-steps`` (1, 50, 100): per block the mean squared difference (Eq. 35) between the block
with context and the patched block on its query alone, over every task, position and coordinate;
the largest absolute difference; rank(Σ_i ΔW_i); the smallest ‖f‖; and the test loss of the whole
network with every block patched (what ``linicl.implicit.convert`` builds), run on the raw query alone. At ``--align-steps`` (0, 50, 90):
the token alignment maps DA(ΔW_i, ΔW_j) of every block for 3 tasks (Fig. A.1) and the last-token
cross-block maps (Fig. A.2). Metrics are computed on the fly (``linicl.implicit.train_with_probes``):
no array of every update over training.

Writes ``OUT/implicit_regression_<ln>_<dtype>.json`` (every number, the wall time and peak memory)
and PNG plots. Differences from the reference code: Flax's default initialisation (lecun-normal
kernels, zero biases) instead of Equinox's; no ``+1e-8`` in the denominator (a vanishing ‖f‖ raises).
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

from linicl.compiled import enable_persistent_cache
from linicl import reporting  # noqa: E402
from linicl.reporting import nonnegative_int_list, positive_float, positive_int  # noqa: E402
from linicl.timing import FAST_COMPILE, QUICK_COMPILE, peak_rss_mb  # noqa: E402


def parse(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/implicit", quick="a few steps on a small batch (CI)",
                              seed="initialisation and tasks", plots=True)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--ln", choices=("none", "pre"), default="none", help="block norms (pre: Fig. A.3)")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--batch", type=positive_int, default=128, help="tasks per step (train and test)")
    p.add_argument("--n-tokens", type=positive_int, default=51, help="N: context pairs + the query")
    p.add_argument("--d-x", type=positive_int, default=2)
    p.add_argument("--layers", type=positive_int, default=5)
    p.add_argument("--heads", type=positive_int, default=3)
    p.add_argument("--lr", type=positive_float, default=None,
                   help="Adam learning rate (default 5e-2; 1e-1 for <= 2 layers)")
    p.add_argument("--msd-steps", type=nonnegative_int_list, default="1,50,100",
                   help="steps with the per-block MSD (those past --steps are skipped)")
    p.add_argument("--align-steps", type=nonnegative_int_list, default="0,50,90",
                   help="steps with the alignment maps (those past --steps are skipped)")
    p.add_argument("--align-tasks", type=positive_int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.n_tokens, args.msd_steps, args.align_steps = 4, 16, 11, [1, 4], [0, 2]
    if args.lr is None:
        args.lr = 1e-1 if args.layers <= 2 else 5e-2
    args.msd_steps = sorted({s for s in args.msd_steps if s <= args.steps})
    args.align_steps = sorted({s for s in args.align_steps if s <= args.steps})
    return args


def run(args) -> dict:
    """Train and probe the paper's model (``linicl.implicit.regression``); the report without timings."""
    import jax.numpy as jnp

    import linicl
    from linicl import implicit
    from linicl.data import regression

    cfg = implicit.fig1_config(d_x=args.d_x, n_layers=args.layers, n_heads=args.heads, n_tokens=args.n_tokens,
                               norm=args.ln, dtype=args.dtype)
    model = linicl.Transformer(cfg)
    variables = regression.numpy_init(model, jnp.zeros((1, args.n_tokens, cfg.d_model), cfg.jnp_dtype), args.seed)
    result = implicit.train_with_probes(
        model, variables, steps=args.steps, batch=args.batch, n_tokens=args.n_tokens, d_x=args.d_x, lr=args.lr,
        seed=args.seed, msd_steps=args.msd_steps, align_steps=args.align_steps, align_tasks=args.align_tasks,
        compiler_options=FAST_COMPILE if args.quick else QUICK_COMPILE,  # quick mode: compiling dominates
        progress=args.progress, desc=f"train ({args.ln}-LN, {args.dtype})")
    return dict(config=dict(vars(args), model=cfg.describe()), **result)


def fig1(plt, report: dict):
    """Fig. 1: the test loss of the model and of its implicit versions, and the per-block MSD."""
    import numpy as np

    c, steps = report["curves"], report["steps"]
    ln, dtype = report["config"]["ln"], report["config"]["dtype"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, c["model"], "-", lw=3, alpha=0.5, label="model (with context)")
    a.plot(steps, c["implicit_last_block"], "--", label="implicit: last block, last token")
    msd = report["msd_steps"]
    if msd:
        ts = sorted(msd, key=int)
        a.plot([int(t) for t in ts], [msd[t]["loss_implicit_network"] for t in ts], "k^", ms=8,
               label="implicit: whole network patched, on the query alone")
    a.set(xlabel="training step", ylabel="test loss", title=f"{ln}-LN, {dtype}")
    a.legend()
    L = len(next(iter(msd.values()))["msd"]) if msd else 0
    width = 0.8 / max(len(msd), 1)
    for j, (t, row) in enumerate(sorted(msd.items(), key=lambda kv: int(kv[0]))):
        vals = np.maximum(np.asarray(row["msd"]), 1e-300)
        b.bar(np.arange(L) + j * width, vals, width, label=f"step {t}")
    b.set(yscale="log", xlabel="block", ylabel="MSD (theory vs model)", title="per-block exactness (Eq. 35)")
    b.set_xticks(np.arange(L) + width * (len(msd) - 1) / 2, [str(i + 1) for i in range(L)])
    b.legend()
    fig.tight_layout()
    return fig


def align_tokens_figure(plt, align: dict, task: int):
    """Fig. A.1: DA(ΔW_i, ΔW_j) between the token positions of every block, at each step, for one task."""
    import numpy as np

    times = sorted(align, key=int)
    tok = {t: np.asarray(align[t]["tokens"]) for t in times}          # [L, tasks, N, N]
    L = tok[times[0]].shape[0]
    fig, axes = plt.subplots(len(times), L, figsize=(2.2 * L, 2.2 * len(times)), squeeze=False,
                             layout="constrained")
    for r, t in enumerate(times):
        for l in range(L):
            im = axes[r, l].imshow(tok[t][l, task], vmin=-1, vmax=1, cmap="RdBu_r")
            axes[r, l].set(xticks=[], yticks=[], title=f"block {l + 1}, t={t}")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6)
    fig.suptitle(f"DA(ΔW_i, ΔW_j) between token positions, task {task}")
    return fig


def align_blocks_figure(plt, align: dict, n_tasks: int):
    """Fig. A.2: DA of the last-token updates between blocks, at each step, for every task."""
    import numpy as np

    times = sorted(align, key=int)
    fig, axes = plt.subplots(len(times), n_tasks, figsize=(2.6 * n_tasks, 2.6 * len(times)), squeeze=False,
                             layout="constrained")
    for r, t in enumerate(times):
        blocks = np.asarray(align[t]["blocks"])
        for task in range(n_tasks):
            im = axes[r, task].imshow(blocks[task], vmin=-1, vmax=1, cmap="RdBu_r")
            ticks = range(blocks.shape[-1])
            axes[r, task].set(title=f"task {task}, t={t}", xticks=ticks, yticks=ticks,
                              xticklabels=[str(i + 1) for i in ticks], yticklabels=[str(i + 1) for i in ticks])
    fig.suptitle("DA of the last-token updates between blocks")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6)
    return fig


def norms_figure(plt, report: dict):
    """The last-token update norm of every block against the training step."""
    import numpy as np

    fro = np.asarray(report["curves"]["dW_fro_last_token"])                # [steps + 1, L]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for l in range(fro.shape[1]):
        ax.plot(report["steps"], fro[:, l], label=f"block {l + 1}")
    ax.set(yscale="log", xlabel="training step", ylabel="‖ΔW_N‖_F (= spectral, rank 1)",
           title="last-token update norm, mean over tasks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot(report: dict, prefix: str) -> list:
    """Every figure as ``prefix_*.png``; the paths written (none without matplotlib)."""
    import numpy as np

    paths = [reporting.plot(f"{prefix}_fig1.png", fig1, report)]
    align = report["alignment_steps"]
    if align:
        n_tasks = np.asarray(align[min(align, key=int)]["tokens"]).shape[1]
        paths += [reporting.plot(f"{prefix}_align_tokens_task{task}.png", align_tokens_figure, align, task, dpi=90)
                  for task in range(n_tasks)]
        paths.append(reporting.plot(f"{prefix}_align_blocks.png", align_blocks_figure, align, n_tasks, dpi=90))
    paths.append(reporting.plot(f"{prefix}_norms.png", norms_figure, report))
    return [p for p in paths if p is not None]


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    args = parse(argv)
    import jax
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    report = run(args)
    report["wall_s"] = time.perf_counter() - _START  # process start to here: imports, compiles, run
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report["cpu_s"] = usage.ru_utime + usage.ru_stime
    report["peak_rss_mb"] = peak_rss_mb()
    report["machine"] = reporting.machine_info()
    prefix = os.path.join(args.out, f"implicit_regression_{args.ln}_{args.dtype}")
    reporting.write_json(prefix + ".json", report, indent=None)
    c = report["curves"]
    print(f"{report['config']['model']}: {args.steps} steps in {report['wall_s']:.1f} s "
          f"({report['cpu_s']:.1f} s CPU; " + ", ".join(f"{k} {v:.1f} s" for k, v in report["seconds"].items())
          + f"), peak RSS {report['peak_rss_mb']:.0f} MB")
    print(f"test loss at the end: model {c['model'][-1]:.4f}, implicit (last block, last token) "
          f"{c['implicit_last_block'][-1]:.4f}")
    for t, row in sorted(report["msd_steps"].items()):
        print(f"step {t:4d}  MSD per block " + " ".join(f"{m:.2e}" for m in row["msd"])
              + f"  (max |diff| {max(row['max_abs_err']):.1e}, rank Σ_i ΔW_i <= {max(row['rank_sum_max'])}; "
              f"whole network: loss {row['loss_implicit_network']:.4f} vs {row['loss_model']:.4f}, "
              f"max |diff| {row['network_max_abs_err']:.1e})")
    paths = plot(report, prefix) if args.plots else []
    print("wrote " + prefix + ".json" + "".join(f", {os.path.basename(p)}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
