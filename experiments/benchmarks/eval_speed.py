"""Greedy evaluation per query: decoding with the cache against re-running every prefix.

``linicl.evaluate.greedy_answers`` answers open-ended prompts (exact match). Its cached path reads each
prompt once and continues it with the decode cache (``linicl.generate``); the re-run path (hooks, or
``cache=False``) runs the whole prefix again for every new token. Both are timed on the same prompts,
in alternating rounds (re-run, then cached, ``--rounds`` times); each time is the median over rounds
of one call after a warm-up call (the warm-up, which compiles, is reported apart). The ratio is re-run
seconds per query over cached seconds per query, measured in the same run; the answers of both paths
are compared too.

Prompts: ``--n`` rows of random token ids (line break and EOS left out) of each ``--lengths`` (no data
needed), up to ``--new`` new tokens each; a row stops where the model picks a line break or EOS, the
same on both paths.

    python experiments/benchmarks/eval_speed.py --quick          # tiny fixture model
    python experiments/benchmarks/eval_speed.py                  # SmolLM2-135M at 256 and 1,024 tokens

Writes ``OUT/eval_speed.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

import linicl
from linicl import reporting
from linicl.compiled import enable_persistent_cache
from linicl.evaluate import greedy_answers

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "hf", "llama-tiny.gguf")


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/eval_speed", quick="tiny fixture model, short prompts, 1 round",
                              seed="seeds the random prompts", progress=False)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", nargs="+", type=reporting.positive_int, default=[256, 1024])
    p.add_argument("--n", type=reporting.positive_int, default=8, help="prompts per length")
    p.add_argument("--new", type=reporting.positive_int, default=8, help="new tokens per answer")
    p.add_argument("--batch-size", type=reporting.positive_int, default=4)
    p.add_argument("--rounds", type=reporting.positive_int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.lengths, args.n, args.new, args.rounds = args.model or FIXTURE, [24, 48], 4, 3, 1
    return args


def timed(fn) -> tuple:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_length(model, variables, tok, length: int, args) -> dict:
    rng = np.random.default_rng([args.seed, length])
    newline = tok.encode("\n", add_bos=False)
    banned = set(int(i) for i in newline) | {getattr(tok, "eos_id", None) or -1}
    rows = []
    for _ in range(args.n):
        r = rng.integers(0, model.cfg.vocab_size, length).astype(np.int32)
        rows.append(np.where(np.isin(r, list(banned)), 1, r).astype(np.int32))
    common = dict(batch_size=args.batch_size, progress=False)

    def run(cache):
        return greedy_answers(model, variables, tok, rows, max_new=args.new, common=dict(common), cache=cache)
    warm = {name: timed(lambda c=c: run(c))[0] for name, c in (("rerun", False), ("cached", True))}
    times = {"rerun": [], "cached": []}
    answers = {}
    for _ in range(args.rounds):
        for name, c in (("rerun", False), ("cached", True)):
            t, answers[name] = timed(lambda c=c: run(c))
            times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(length=length, n=args.n, new=args.new, warmup_s=warm, seconds=times,
                per_query_s={k: v / args.n for k, v in med.items()}, ratio=med["rerun"] / med["cached"],
                answers_equal=sum(a == b for a, b in zip(answers["rerun"], answers["cached"])))


def main(argv=None) -> int:
    args = parse_args(argv)
    enable_persistent_cache()
    os.makedirs(args.out, exist_ok=True)
    loaded = linicl.lm.load(args.model, max_len=max(args.lengths) + args.new + 8, require_tokenizer=True)
    rows = [bench_length(loaded.model, loaded.variables, loaded.tokenizer, L, args) for L in args.lengths]
    report = dict(settings=vars(args), model=args.model or "SmolLM2-135M-Instruct", rows=rows,
                  machine=reporting.machine_info())
    table = reporting.markdown_table(
        ["prompt tokens", "re-run s/query", "cached s/query", "re-run / cached", "answers equal", "warm-up s (re-run, cached)"],
        [[r["length"], f"{r['per_query_s']['rerun']:.3f}", f"{r['per_query_s']['cached']:.3f}", f"{r['ratio']:.1f}x",
          f"{r['answers_equal']}/{r['n']}", f"{r['warmup_s']['rerun']:.1f}, {r['warmup_s']['cached']:.1f}"] for r in rows])
    report["table"] = table
    reporting.write_json(os.path.join(args.out, "eval_speed.json"), report)
    print(table)
    print(f"wrote {args.out}/eval_speed.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
