"""Benchmark of the exact ICLCA conversion and of the linear-attention kernel forms (float32, CPU).

1. Conversion: a 4-layer d_model=256 linear-attention model (preset ``bench-4x256``), prompts of 256 to
   16k tokens, a 16-token query: time to convert, the prompted forward over [prompt; query], the
   converted forward over the query alone, and one forward over the prompt alone.
2. Kernels: tokens/s of the parallel (quadratic), chunked and recurrent forms, and of the default
   ("auto") form, against sequence length, for one layer's attention (4 heads, d_head 64, elu+1).

Writes ``OUT/iclca_speed.json`` (every number) and ``OUT/iclca_speed.png``. Timings exclude compilation
(median of repeated calls after a warm-up).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

import linicl
from linicl import iclca, reporting
from linicl.kernels import feature_maps
from linicl.kernels.linear_attention import choose_form, linear_attention, zero_state
from linicl.timing import time_call

QUERY_LEN = 16


def bench_conversion(lengths, seed: int, repeats: int) -> list[dict]:
    cfg = linicl.preset("bench-4x256")
    model = linicl.Transformer(cfg)
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))
    forward = jax.jit(model.apply)
    absorb = iclca._absorb_fn(model)
    query = jax.random.randint(jax.random.PRNGKey(seed + 1), (1, QUERY_LEN), 0, cfg.vocab_size, jnp.int32)
    rows = []
    for n in tqdm(lengths, desc="conversion"):
        prompt = jax.random.randint(jax.random.PRNGKey(n), (1, n), 0, cfg.vocab_size, jnp.int32)
        full = jnp.concatenate([prompt, query], axis=1)
        converted = iclca.convert(model, variables, prompt)
        t_convert = time_call(absorb, variables, prompt, repeats=repeats)
        t_prompt_forward = time_call(forward, variables, prompt, repeats=repeats)
        t_prompted = time_call(forward, variables, full, repeats=repeats)
        t_converted = time_call(forward, converted, query, repeats=max(repeats, 20), min_seconds=0.2)
        rows.append(dict(prompt_len=n, convert_s=t_convert, prompt_forward_s=t_prompt_forward,
                         prompted_forward_s=t_prompted, converted_forward_s=t_converted,
                         query_speedup=t_prompted / t_converted,
                         convert_over_forward=t_convert / t_prompt_forward))
    return rows


def bench_kernels(lengths, max_quadratic: int, seed: int, repeats: int) -> list[dict]:
    H, d, chunk = 4, 64, 64
    rows = []
    for T in tqdm(lengths, desc="kernels"):
        key = jax.random.PRNGKey(seed + T)
        q, k, v = jax.random.normal(key, (3, 1, H, T, d), jnp.float32)
        fq, fk = feature_maps.elu_plus_one(q), feature_maps.elu_plus_one(k)
        state = zero_state(1, H, d, d, jnp.float32)
        row = dict(seq_len=T, auto_form=choose_form(T, chunk))
        for form in ("parallel", "chunked", "recurrent", "auto"):
            if form == "parallel" and T > max_quadratic:
                continue
            fn = jax.jit(lambda a, b, c, s, form=form: linear_attention(
                a, b, c, s, normalize=True, eps=1e-6, form=form, chunk_size=chunk)[0])
            row[f"{form}_tokens_per_s"] = T / time_call(fn, fq, fk, v, state, repeats=repeats)
        if "parallel_tokens_per_s" in row:
            row["auto_over_parallel"] = row["auto_tokens_per_s"] / row["parallel_tokens_per_s"]
        rows.append(row)
    return rows


def figure(plt, report: dict):
    """Conversion and forward times against the prompt length; kernel forms' tokens/s against T."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    conv = report["conversion"]
    n = [r["prompt_len"] for r in conv]
    a.loglog(n, [r["prompted_forward_s"] * 1e3 for r in conv], "o-", label="prompted forward (n + 16)")
    a.loglog(n, [r["convert_s"] * 1e3 for r in conv], "s-", label="convert (n)")
    a.loglog(n, [r["converted_forward_s"] * 1e3 for r in conv], "^-", label="converted forward (16)")
    a.set(xlabel="prompt length n", ylabel="ms", title="bench-4x256, float32")
    a.legend()
    ker = report["kernels"]
    for form in ("parallel", "chunked", "recurrent", "auto"):
        pts = [(r["seq_len"], r[f"{form}_tokens_per_s"]) for r in ker if f"{form}_tokens_per_s" in r]
        b.loglog(*zip(*pts), "o-", label=form)
    b.set(xlabel="sequence length T", ylabel="tokens / s", title="linear attention kernel forms")
    b.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks", quick="short sequences only (CI)",
                              seed="weights, prompts and queries", progress=False)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median)")
    args = parser.parse_args(argv)

    if args.quick:
        prompt_lengths, kernel_lengths, max_quadratic = [256, 512], [256, 1024], 1024
    else:
        prompt_lengths = [256, 512, 1024, 2048, 4096, 8192, 16384]
        kernel_lengths, max_quadratic = [256, 512, 1024, 2048, 4096, 8192, 16384], 8192
    report = dict(machine=reporting.machine_info(), query_len=QUERY_LEN, quick=args.quick,
                  conversion=bench_conversion(prompt_lengths, args.seed, args.repeats),
                  kernels=bench_kernels(kernel_lengths, max_quadratic, args.seed, args.repeats))
    reporting.write_json(os.path.join(args.out, "iclca_speed.json"), report)
    print(f"{'n':>6s} {'convert ms':>11s} {'prompt fwd ms':>13s} {'prompted ms':>12s} {'converted ms':>12s} "
          f"{'speed-up':>9s} {'convert/fwd':>11s}")
    for r in report["conversion"]:
        print(f"{r['prompt_len']:6d} {r['convert_s'] * 1e3:11.2f} {r['prompt_forward_s'] * 1e3:13.2f} "
              f"{r['prompted_forward_s'] * 1e3:12.2f} {r['converted_forward_s'] * 1e3:12.3f} "
              f"{r['query_speedup']:8.1f}x {r['convert_over_forward']:10.2f}x")
    print(f"\n{'T':>6s} {'auto form':>10s} " + " ".join(f"{f + ' tok/s':>16s}" for f in ("parallel", "chunked", "recurrent", "auto"))
          + f" {'auto/parallel':>13s}")
    for r in report["kernels"]:
        cells = " ".join(f"{r.get(f + '_tokens_per_s', float('nan')):16.3g}" for f in ("parallel", "chunked", "recurrent", "auto"))
        print(f"{r['seq_len']:6d} {r['auto_form']:>10s} {cells} {r.get('auto_over_parallel', float('nan')):12.1f}x")
    png = reporting.plot(os.path.join(args.out, "iclca_speed.png"), figure, report, dpi=120)
    print(f"\nwrote {args.out}/iclca_speed.json" + (" and iclca_speed.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
