"""Recall capacity with and without short convolutions, over seeds: a grid of
``experiments/recall_capacity.py --tasks mqar`` runs and the comparisons the papers make.

DeltaNet, Gated DeltaNet and Zoology report that the delta rule recalls more than additive linear
attention on MQAR; their models have a short causal convolution before q, k and v. Our one run without
it found the opposite ordering at 16-32 pairs. This grid runs every mixer at ``--short-conv`` 0 and K
(default 4; SiLU after it) for each seed of ``--seeds`` (default 0, 1, 2), each as its own
``recall_capacity.py`` process into ``OUT/conv<K>-seed<s>/`` (which checkpoints every trained model:
a stopped grid resumes, and a finished run, its ``recall_capacity.json``, is not run again), and reports:

* accuracy against the prompt's state size per mixer, with and without the convolution (the plot);
* delta - linear and gated_delta - gated at each number of pairs, with and without the convolution:
  the paired bootstrap interval over every held-out query of every seed (the two mixers answer the
  same queries), and the mean of the per-seed differences with a Student-t interval over seeds;
* the convolution's own effect per mixer (K - 0, paired over the same queries).

Training follows recall_capacity's defaults (``--steps`` and the other budgets pass through with
``--steps``); those leave the models short of converged (RESULTS.md says so): longer runs span sessions.
Writes ``OUT/mqar_grid.json`` and ``OUT/mqar_grid.png``.

    python experiments/mqar_grid.py               # 6 runs of about 30 CPU-minutes each (resumable)
    python experiments/mqar_grid.py --quick       # 2 mixers, 2 seeds, tiny (CI)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from linicl import reporting, stats
from linicl.reporting import nonnegative_int, positive_int

SCRIPT = Path(__file__).resolve().parent / "recall_capacity.py"
PAIRS = (("delta", "linear"), ("gated_delta", "gated"))  # (delta rule, its additive twin)


def run_one(folder: Path, seed: int, conv: int, args) -> dict:
    """One recall_capacity run (resumed from its checkpoints), unless its JSON exists; its JSON."""
    if not (folder / "recall_capacity.json").exists():
        cmd = [sys.executable, str(SCRIPT), "--tasks", "mqar", "--seed", str(seed), "--short-conv", str(conv),
               "--no-progress", "--out", str(folder)] + (["--quick"] if args.quick else [])
        cmd += ["--mixers", *args.mixers] if args.mixers else []
        cmd += ["--steps", str(args.steps)] if args.steps else []
        reporting.run_logged(cmd, folder)
    return json.loads((folder / "recall_capacity.json").read_text())


def hits(runs: dict, conv: int, mixer: str, pairs: int) -> list:
    """Per seed, the held-out queries' correctness of ``mixer`` at ``pairs`` (prompted)."""
    out = []
    for (c, _), r in sorted(runs.items()):
        if c == conv and mixer in r["results"]:
            row = next(e for e in r["results"][mixer]["eval"] if e["pairs"] == pairs)
            out.append(np.asarray(row["hits"], bool))
    return out


def compare(runs: dict, conv: int, a: str, b: str, pairs: int, conv_b=None) -> dict:
    """``a`` minus ``b`` (at convolution ``conv``, and ``conv_b`` for ``b`` if given) on the same queries:
    the pooled paired bootstrap over queries of every seed, and the Student-t interval over seeds."""
    ha, hb = hits(runs, conv, a, pairs), hits(runs, conv if conv_b is None else conv_b, b, pairs)
    pooled = stats.paired_bootstrap(np.concatenate(ha), np.concatenate(hb))
    per_seed = [float(x.mean() - y.mean()) for x, y in zip(ha, hb)]
    seeds = stats.paired_t(per_seed, [0.0] * len(per_seed)) if len(per_seed) >= 2 else None
    return dict(pooled=pooled._asdict(), per_seed=per_seed, over_seeds=None if seeds is None else seeds._asdict(),
                significant=pooled.excludes_zero() and (seeds is None or seeds.excludes_zero()))


def accuracy(runs: dict, conv: int, mixer: str, pairs: int) -> dict:
    """Pooled accuracy over seeds with its Wilson interval, and the prompt's state size."""
    h = np.concatenate(hits(runs, conv, mixer, pairs))
    run = next(r for (c, _), r in runs.items() if c == conv and mixer in r["results"])
    floats = next(e for e in run["results"][mixer]["eval"] if e["pairs"] == pairs)["prompt_floats"]
    return dict(stats.wilson(int(h.sum()), h.size)._asdict(), queries=int(h.size), prompt_floats=floats)


def summarise(runs: dict, convs: list) -> dict:
    first = next(iter(runs.values()))
    mixers, pair_counts = list(first["results"]), [e["pairs"] for e in next(iter(first["results"].values()))["eval"]]
    acc = {f"conv{c}": {m: {str(n): accuracy(runs, c, m, n) for n in pair_counts} for m in mixers} for c in convs}
    rule = {f"conv{c}": {f"{a} - {b}": {str(n): compare(runs, c, a, b, n) for n in pair_counts}
                         for a, b in PAIRS if a in mixers and b in mixers} for c in convs}
    conv_effect = {m: {str(n): compare(runs, convs[1], m, m, n, conv_b=convs[0]) for n in pair_counts}
                   for m in mixers if m != "softmax"} if len(convs) == 2 else {}
    return dict(mixers=mixers, pairs=pair_counts, accuracy=acc, delta_vs_additive=rule, conv_effect=conv_effect)


def table(summary: dict) -> str:
    fmt = lambda d: stats.Interval(d["value"], d["low"], d["high"]).fmt()  # noqa: E731
    rows = []
    for conv, comps in summary["delta_vs_additive"].items():
        for name, by_pairs in comps.items():
            for n, c in by_pairs.items():
                seeds = "" if c["over_seeds"] is None else fmt(c["over_seeds"])
                rows.append([conv, name, n, fmt(c["pooled"]), seeds, "yes" if c["significant"] else "no"])
    return reporting.markdown_table(["convolution", "comparison", "pairs", "pooled Δ acc % [95 % CI]",
                                     "mean of seeds Δ % [t 95 % CI]", "significant (both)"], rows)


def figure(plt, report: dict):
    s = report["summary"]
    fig, axes = plt.subplots(1, len(s["pairs"]), figsize=(4 * len(s["pairs"]), 3.6), squeeze=False)
    for ax, n in zip(axes[0], s["pairs"]):
        for conv, marker in zip(s["accuracy"], "os"):
            for m in s["mixers"]:
                a = s["accuracy"][conv][m][str(n)]
                ax.errorbar(a["prompt_floats"], a["value"], yerr=[[a["value"] - a["low"]], [a["high"] - a["value"]]],
                            fmt=marker, label=f"{m} ({conv})", alpha=0.8)
        ax.set(xscale="log", xlabel="prompt floats (state or KV cache)", ylabel="accuracy", title=f"{n} pairs")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/mqar_grid", quick="2 mixers, 2 seeds, tiny models (CI)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (0 1 with --quick)")
    p.add_argument("--conv", type=nonnegative_int, default=None, help="the taps K compared with 0 (default 4, 3 quick)")
    p.add_argument("--steps", type=positive_int, default=None, help="recall_capacity's --steps (its default)")
    p.add_argument("--mixers", nargs="+", default=None, help="default all (linear and delta with --quick)")
    args = p.parse_args(argv)
    args.seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
    args.mixers = args.mixers or (["linear", "delta"] if args.quick else None)
    K = args.conv if args.conv is not None else (3 if args.quick else 4)
    if K == 1 or K == 0 or len(set(args.seeds)) != len(args.seeds):
        p.error("--conv must be >= 2 (0 is always run) and --seeds must be different")
    convs = [0, K]
    out = Path(args.out)
    runs = {}
    todo = [(c, s) for c in convs for s in args.seeds]
    for c, s in tqdm(todo, desc="runs", disable=not args.progress):
        runs[(c, s)] = run_one(out / f"conv{c}-seed{s}", s, c, args)
    summary = summarise(runs, convs)
    report = dict(seeds=args.seeds, convs=convs, quick=args.quick, summary=summary, table=table(summary),
                  machine=reporting.machine_info())
    reporting.write_json(out / "mqar_grid.json", report)
    reporting.plot(out / "mqar_grid.png", figure, report)
    print(report["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
