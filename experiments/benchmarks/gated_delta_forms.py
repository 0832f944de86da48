"""Benchmark of the recurrent and chunked forms of the gated kernels (float32, CPU).

Three kernels, one layer's worth (batch 1, 4 heads, d_head 64, T = 8192 tokens):

* ``delta``: the gated delta rule (Gated DeltaNet: L2-normalised keys, beta = sigmoid, one log-gate
  per head and token), ``linicl.kernels.delta_rule``;
* ``gated-scalar``: gated linear attention with one log-gate per head and token (Mamba-2 style);
* ``gated-vector``: gated linear attention with one log-gate per key feature (GLA style);
  both unnormalised, ``linicl.kernels.gated_attention``.

For each: the recurrent form (a ``lax.scan`` over tokens) and the chunked form at several chunk
sizes, with the speed-up recurrent time / chunked time measured in the same run. Compilation
(``jit(...).lower().compile()``) is timed apart from running; run times are medians over
interleaved rounds (every variant once per round, so that a change in the machine's load hits all of
them alike), each round the median of repeated calls. Also the float32 agreement of each chunked
form with the recurrent one (max |chunked - recurrent| / max |recurrent|).

The issue's target: the chunked delta rule at least 3x faster than its recurrent form at T = 8192 on
2 CPU cores. Writes ``OUT/gated_delta_forms.json`` (every number).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from linicl import reporting
from linicl.kernels import delta_rule as dr
from linicl.kernels import gated_attention as ga
from linicl.timing import time_call

HEADS, D_HEAD, BATCH = 4, 64, 1
KERNELS = ("delta", "gated-scalar", "gated-vector")


def inputs(kernel: str, T: int, seed: int) -> tuple:
    """Random float32 arguments of one kernel: (q, k, v, beta or None, log-gates, initial state)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q, k, v = (jax.random.normal(keys[i], (BATCH, HEADS, T, D_HEAD), jnp.float32) for i in range(3))
    gate_shape = (BATCH, HEADS, T) if kernel != "gated-vector" else (BATCH, HEADS, T, D_HEAD)
    # Gates mostly near 1 (log sigmoid of N(3, 1): alpha around 0.95), as trained models have them.
    log_alpha = jax.nn.log_sigmoid(jax.random.normal(keys[4], gate_shape, jnp.float32) + 3.0)
    if kernel == "delta":
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        beta = jax.nn.sigmoid(jax.random.normal(keys[3], (BATCH, HEADS, T), jnp.float32))
        return q, k, v, beta, log_alpha, dr.zero_state(BATCH, HEADS, D_HEAD, D_HEAD, jnp.float32)
    return q, k, v, None, log_alpha, ga.zero_state(BATCH, HEADS, D_HEAD, D_HEAD, jnp.float32)


def kernel_fn(kernel: str, form: str, chunk: int):
    """The outputs of one kernel in one form, as a function of its arrays."""
    if kernel == "delta":
        return lambda q, k, v, beta, a, s: dr.delta_rule(q, k, v, s, beta=beta, log_alpha=a, form=form,
                                                         chunk_size=chunk)[0]
    return lambda q, k, v, beta, a, s: ga.gated_attention(q, k, v, s, log_alpha=a, normalize=False,
                                                          form=form, chunk_size=chunk)[0]


def bench(T: int, chunks, seed: int, rounds: int, repeats: int) -> list[dict]:
    variants = [(kernel, "recurrent", 0) for kernel in KERNELS]
    variants += [(kernel, "chunked", c) for kernel in KERNELS for c in chunks]
    args, compiled, rows = {}, {}, {}
    for kernel, form, chunk in variants:
        if kernel not in args:
            args[kernel] = tuple(a for a in inputs(kernel, T, seed))
        t0 = time.perf_counter()
        compiled[kernel, form, chunk] = jax.jit(kernel_fn(kernel, form, chunk or 64)).lower(*args[kernel]).compile()
        compile_s = time.perf_counter() - t0
        rows[kernel, form, chunk] = dict(kernel=kernel, form=form, chunk_size=chunk or None, seq_len=T,
                                         compile_s=compile_s, run_s_rounds=[])
        print(f"compiled {kernel:>12s} {form:>9s} {chunk or '':>4} in {compile_s:5.2f} s", flush=True)
    for _ in range(rounds):  # interleaved: every variant once per round
        for key, fn in compiled.items():
            rows[key]["run_s_rounds"].append(time_call(fn, *args[key[0]], repeats=repeats))
    out = []
    for (kernel, form, chunk), row in rows.items():
        row["run_s"] = statistics.median(row["run_s_rounds"])
        row["tokens_per_s"] = T / row["run_s"]
        recurrent = rows[kernel, "recurrent", 0]
        row["speedup_over_recurrent"] = statistics.median(recurrent["run_s_rounds"]) / row["run_s"]
        if form == "chunked":
            o_c = np.asarray(compiled[kernel, form, chunk](*args[kernel]), np.float64)
            o_r = np.asarray(compiled[kernel, "recurrent", 0](*args[kernel]), np.float64)
            row["rel_diff_vs_recurrent_f32"] = float(np.max(np.abs(o_c - o_r)) / np.max(np.abs(o_r)))
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks", quick="T = 1024, one chunk size (CI)",
                              seed="the random inputs", progress=False)
    parser.add_argument("--seq-len", type=reporting.positive_int, default=8192, help="tokens T (default 8192)")
    parser.add_argument("--chunks", type=reporting.positive_int_list, default=[16, 32, 64, 128],
                        help="chunk sizes of the chunked form, comma-separated (default 16,32,64,128)")
    parser.add_argument("--rounds", type=reporting.positive_int, default=3,
                        help="interleaved rounds (median over rounds; default 3)")
    parser.add_argument("--repeats", type=reporting.positive_int, default=3,
                        help="timed calls per variant and round (median; default 3)")
    args = parser.parse_args(argv)

    T, chunks, rounds = args.seq_len, args.chunks, args.rounds
    if args.quick:
        T, chunks, rounds = 1024, [64], 1
    load_before = reporting.load_average()
    rows = bench(T, chunks, args.seed, rounds, args.repeats)
    report = dict(machine=reporting.machine_info(), quick=args.quick, seq_len=T, heads=HEADS,
                  d_head=D_HEAD, batch=BATCH, dtype="float32", chunks=chunks, rounds=rounds,
                  repeats=args.repeats, load_average_before=load_before,
                  load_average_after=reporting.load_average(), rows=rows)
    best = {}
    for kernel in KERNELS:
        chunked = [r for r in rows if r["kernel"] == kernel and r["form"] == "chunked"]
        fastest = max(chunked, key=lambda r: r["speedup_over_recurrent"])
        best[kernel] = dict(chunk_size=fastest["chunk_size"], speedup_over_recurrent=fastest["speedup_over_recurrent"])
    report["best_chunk"] = best
    report["target"] = dict(kernel="delta", speedup_over_recurrent=3.0, met=best["delta"]["speedup_over_recurrent"] >= 3.0)
    reporting.write_json(os.path.join(args.out, "gated_delta_forms.json"), report)

    print(f"\nT = {T}, batch {BATCH}, {HEADS} heads, d_head {D_HEAD}, float32; load average before / after: "
          f"{load_before} / {report['load_average_after']}")
    print(f"{'kernel':>12s} {'form':>9s} {'chunk':>5s} {'compile s':>9s} {'run ms':>8s} {'tok/s':>9s} "
          f"{'rec/chunked':>11s} {'f32 diff':>9s}")
    for r in rows:
        print(f"{r['kernel']:>12s} {r['form']:>9s} {r['chunk_size'] or '':>5} {r['compile_s']:9.2f} "
              f"{r['run_s'] * 1e3:8.1f} {r['tokens_per_s']:9.3g} {r['speedup_over_recurrent']:10.2f}x "
              f"{r.get('rel_diff_vs_recurrent_f32', float('nan')):9.1e}")
    for kernel, b in best.items():
        print(f"best chunk for {kernel}: {b['chunk_size']} ({b['speedup_over_recurrent']:.2f}x the recurrent form's speed)")
    met = report["target"]["met"]
    print(f"target (chunked delta rule >= 3x recurrent): {'met' if met else 'not met'}")
    print(f"\nwrote {args.out}/gated_delta_forms.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
