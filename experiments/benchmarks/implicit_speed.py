"""Benchmark of the implicit-update operators (float32, CPU) and of the Fig. 1 experiment end to end.

1. Operators: for a batch of tasks, every block's update at every position in one jitted call
   (``linicl.implicit.updates``), against one forward pass of the same batch: the factored updates
   with the query reference (u = W(g - f), v = f/‖f‖², Δb'), the same plus the dense
   [layers, tasks, positions, h, d] matrices, and the own-token reference. Models: the Fig. 1 model
   of Innocenti & Achour (5 blocks, d_model 3, 128 tasks of 51 tokens) without and with pre-LN, and
   a larger pre-LN model for throughput. Time: median of repeated calls after a warm-up (compile
   excluded; interleaved rounds, the minimum and the median). Memory: XLA's buffer sizes of the
   compiled call (arguments, outputs, temporaries).
2. End to end: ``experiments/implicit_regression.py --no-plots`` (100 training steps with every
   metric; ``--quick`` here runs its quick mode) in a subprocess: wall time, and the CPU time and
   peak resident memory (VmHWM) the script reports for itself.

Writes ``OUT/implicit_speed.json`` and ``OUT/implicit_speed.png``. The reference code's figures
(issue: 2.1x / 2.6x a forward pass, 18 s and 1.5 GB end to end on 2 cores) are stored beside ours.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

import linicl
from linicl import implicit, reporting
from linicl.data import regression

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
REFERENCE = dict(updates_over_forward_no_ln=2.1, updates_over_forward_pre_ln=2.6, fig1_end_to_end_s=18.0,
                 fig1_peak_gb=1.5, fig1_all_updates_array_gb=0.94)


def fig1_config(norm: str, **changes) -> linicl.ModelConfig:
    base = dict(vocab_size=1, d_model=3, n_layers=5, n_heads=3, d_ff=12, mlp_depth=3, max_len=64,
                attention="softmax", positions="none", norm=norm, final_norm=False, activation="gelu_tanh",
                attn_bias=False, mlp_bias=True)
    base.update(changes)
    return linicl.ModelConfig(**base)


MODELS = {
    "fig1-no-ln": (fig1_config("none"), 128, 51),
    "fig1-pre-ln": (fig1_config("pre"), 128, 51),
    "pre-ln-d64": (linicl.ModelConfig(vocab_size=1, d_model=64, n_layers=4, n_heads=4, d_ff=256, max_len=256,
                                      attention="softmax", positions="rope", norm="pre", final_norm=False), 16, 128),
}


def memory_mb(compiled) -> float:
    """Arguments + outputs + temporaries of a compiled call, in MiB (XLA's buffer assignment)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return float("nan")
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return total / 2**20


def bench_operators(names, seed: int, repeats: int) -> list[dict]:
    rows = []
    for name in tqdm(names, desc="operators"):
        cfg, batch, T = MODELS[name]
        model = linicl.Transformer(cfg)
        x = jax.random.normal(jax.random.PRNGKey(seed), (batch, T, cfg.d_model), jnp.float32)
        variables = regression.numpy_init(model, x[:1], seed)
        calls = {
            "forward": lambda v, x: model.apply(v, embeds=x, hidden=True),
            "updates_query": lambda v, x: implicit.updates(model, v, embeds=x).update,
            "updates_query_dense": lambda v, x: implicit.dense(implicit.updates(model, v, embeds=x).update),
            "updates_own": lambda v, x: implicit.updates(model, v, embeds=x, reference="own").update,
        }
        row = dict(model=name, config=cfg.describe(), batch=batch, seq_len=T)
        compiled = {call: jax.jit(fn).lower(variables, x).compile() for call, fn in calls.items()}
        samples = {call: [] for call in calls}
        for call, fn in compiled.items():  # warm-up
            jax.block_until_ready(fn(variables, x))
        # Interleaved rounds, so that a busy spell of a shared machine hits every call alike; the
        # minimum over rounds estimates the cost on an idle machine, the median is kept beside it.
        for _ in range(repeats):
            for call, fn in compiled.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(variables, x))
                samples[call].append(time.perf_counter() - t0)
        for call in calls:
            row[f"{call}_s"] = min(samples[call])
            row[f"{call}_median_s"] = statistics.median(samples[call])
            row[f"{call}_tokens_per_s"] = batch * T / row[f"{call}_s"]
            row[f"{call}_mb"] = memory_mb(compiled[call])
        for call in ("updates_query", "updates_query_dense", "updates_own"):
            row[f"{call}_over_forward"] = row[f"{call}_s"] / row["forward_s"]
        rows.append(row)
    return rows


def bench_end_to_end(quick: bool, seed: int, out: str) -> list[dict]:
    rows = []
    script = ROOT / "experiments" / "implicit_regression.py"
    for ln in ("none", "pre"):
        cmd = [sys.executable, str(script), "--no-plots", "--no-progress", "--ln", ln, "--seed", str(seed),
               "--out", out] + (["--quick"] if quick else [])
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if run.returncode:
            raise RuntimeError(run.stderr[-2000:])
        report = json.loads((pathlib.Path(out) / f"implicit_regression_{ln}_float32.json").read_text())
        rows.append(dict(ln=ln, quick=quick, wall_s=wall, cpu_s=report["cpu_s"],
                         peak_rss_mb=report["peak_rss_mb"], seconds=report["seconds"],
                         msd_steps={t: r["msd"] for t, r in report["msd_steps"].items()}))
    return rows


def figure(plt, report: dict):
    """Each operator's time over one forward pass, per model."""
    import numpy as np

    ops = report["operators"]
    calls = ["updates_query", "updates_query_dense", "updates_own"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    w = 0.25
    for j, call in enumerate(calls):
        ax.bar(np.arange(len(ops)) + j * w, [r[f"{call}_over_forward"] for r in ops], w, label=call)
    ax.axhline(1.5, color="k", ls="--", lw=1, label="target 1.5x")
    ax.set_xticks(np.arange(len(ops)) + w, [r["model"] for r in ops])
    ax.set(ylabel="time / one forward pass", title="every block, every position, a batch of tasks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks", seed="weights and inputs", progress=False,
                              quick="the Fig. 1 model without LN only; quick end-to-end run (CI)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--no-end-to-end", action="store_true")
    args = parser.parse_args(argv)

    names = ["fig1-no-ln"] if args.quick else ["fig1-no-ln", "fig1-pre-ln", "pre-ln-d64"]
    report = dict(machine=dict(reporting.machine_info(), load_average=reporting.load_average()), quick=args.quick,
                  reference_code=REFERENCE, operators=bench_operators(names, args.seed, args.repeats))
    if not args.no_end_to_end:
        report["end_to_end"] = bench_end_to_end(args.quick, args.seed, os.path.join(args.out, "implicit_e2e"))
    report["machine"]["load_average_after"] = reporting.load_average()
    reporting.write_json(os.path.join(args.out, "implicit_speed.json"), report)

    print(f"{'model':>12s} {'forward ms':>10s} {'query':>7s} {'+dense':>7s} {'own':>7s} {'fwd tok/s':>10s} "
          f"{'query tok/s':>11s} {'fwd MB':>7s} {'query MB':>8s}")
    for r in report["operators"]:
        print(f"{r['model']:>12s} {r['forward_s'] * 1e3:10.2f} {r['updates_query_over_forward']:6.2f}x "
              f"{r['updates_query_dense_over_forward']:6.2f}x {r['updates_own_over_forward']:6.2f}x "
              f"{r['forward_tokens_per_s']:10.3g} {r['updates_query_tokens_per_s']:11.3g} "
              f"{r['forward_mb']:7.1f} {r['updates_query_mb']:8.1f}")
    for r in report.get("end_to_end", []):
        print(f"end to end ({r['ln']}-LN{', quick' if r['quick'] else ''}): {r['wall_s']:.1f} s wall, "
              f"{r['cpu_s']:.1f} s CPU, peak RSS {r['peak_rss_mb']:.0f} MB")
    print(f"load average before / after: {report['machine']['load_average']} / {report['machine']['load_average_after']}")
    png = reporting.plot(os.path.join(args.out, "implicit_speed.png"), figure, report)
    print(f"\nwrote {args.out}/implicit_speed.json" + (" and implicit_speed.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
