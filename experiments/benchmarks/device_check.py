"""One prepared device check: what a lent accelerator does with linicl's real LMs, in one command (<= 8 min
on one GPU at the default sizes), as JSON.

Per model (``--models``: SmolLM2-135M and Gemma 3 270M, those installed):

1. forward tokens/s of the pretrained LM at ``--batch`` x ``--seq`` and its MFU: the FLOPs of its
   matrix products (``linicl.timing.forward_flops``) per second over the rate of one large matmul
   measured in the same run on the same device (``matmul_rate``, float32);
2. stage-1 step time (attention transfer, ``linicl.linearize.train_maps``) at ``--stage1-batch`` x
   ``--stage1-seq``: the wall time of ``--stage1-steps`` + 1 steps minus that of 1, both after a warm-up
   run (each run traces its step again and finds it compiled: that cancels);
3. the converted-query speed-up of the linearized LM (``linicl.linearize.smollm2``/``gemma3``: shipped
   maps): the prompted forward over [prompt; query] against the converted forward over the 16-token
   query alone, at each of ``--prompts`` tokens (4k, 16k, 32k);
4. evaluation queries/s (``linicl.evaluate.evaluate``) on ``--eval-queries`` one-shot word-pair queries,
   after a warm-up call that compiles.

Timings exclude compilation (a warm-up call first) and are medians of ``--repeats`` calls.
``--quick`` runs SmolLM2 at CPU sizes (the CI test). Writes ``OUT/device_check.json`` after each model,
so that a run cut short still returns the models it finished.

**Weights that cannot travel.** A lent machine may receive only a few tens of MB (the packaged GGUF files
are 98 MB and 245 MB). ``--write-pack DIR`` writes, per model, what the timings depend on and nothing
else: ``config.json`` (``linicl.lm.save_pretrained``'s config, which ``config_from_hf`` reads back to the
same ``ModelConfig``) and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``), 1.5 MB for
SmolLM2 and 12 MB for Gemma 3. ``--pack DIR`` on the device builds each model from its config with
weights drawn at random (``model.init``) and the shipped linearized maps on top. Every timing here is
of dense float arithmetic whose cost does not depend on the values; the JSON says ``weights: random``.

    python experiments/benchmarks/device_check.py                       # on the accelerator
    python experiments/benchmarks/device_check.py --quick --models smollm2
    python experiments/benchmarks/device_check.py --write-pack .pack    # here, then carry .pack
    python experiments/benchmarks/device_check.py --pack .pack          # there
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linicl import reporting
from linicl.compiled import enable_persistent_cache
from linicl.reporting import positive_int

QUERY_LEN = 16
QUICK = dict(batch=1, seq=64, stage1_batch=2, stage1_seq=32, stage1_steps=2, prompts="128", eval_queries=8,
             repeats=2, matmul=512)


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/benchmarks", quick="SmolLM2 at CPU sizes (CI)", progress=False)
    p.add_argument("--models", default="smollm2,gemma3", help="comma-separated, of smollm2 and gemma3")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--seq", type=positive_int, default=1024)
    p.add_argument("--stage1-batch", type=positive_int, default=8)
    p.add_argument("--stage1-seq", type=positive_int, default=512)
    p.add_argument("--stage1-steps", type=positive_int, default=5)
    p.add_argument("--prompts", default="4096,16384,32768", help="prompt lengths of the converted-query speed-up")
    p.add_argument("--eval-queries", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--matmul", type=positive_int, default=4096, help="side of the peer matmul")
    p.add_argument("--write-pack", metavar="DIR", help="write each model's config and tokenizer to DIR and stop")
    p.add_argument("--pack", metavar="DIR", help="build the models from DIR (--write-pack) with random weights")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK, models="smollm2")
        args = p.parse_args(argv)
    try:
        args.prompt_lengths = [int(n) for n in args.prompts.split(",") if n]
    except ValueError:
        args.prompt_lengths = []
    if not args.prompt_lengths or min(args.prompt_lengths) < 1:
        p.error(f"--prompts: expected comma-separated positive ints, got {args.prompts!r}")
    bad = [m for m in args.models.split(",") if m not in ("smollm2", "gemma3")]
    if bad or not args.models:
        p.error(f"--models: expected some of smollm2, gemma3, got {args.models!r}")
    return args


def tokens(seed: int, batch: int, seq: int, vocab: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(1, vocab, (batch, seq)), jnp.int32)


def forward_rate(model, variables, args, peak: float) -> dict:
    from linicl.batching import last_token_logits
    from linicl.timing import forward_flops, time_call
    x = tokens(0, args.batch, args.seq, model.cfg.vocab_size)
    fn = jax.jit(model.apply)
    seconds = time_call(fn, variables, x, repeats=args.repeats)
    flops = forward_flops(model.cfg, args.batch, args.seq)
    last = jax.jit(last_token_logits(model))  # the harness's forward: only the last token is unembedded
    lengths = jnp.full((args.batch,), args.seq, jnp.int32)
    last_s = time_call(last, variables, x, lengths, repeats=args.repeats)
    return dict(batch=args.batch, seq=args.seq, seconds=seconds, tokens_per_s=args.batch * args.seq / seconds,
                flops=flops, mfu=flops / seconds / peak, last_token_tokens_per_s=args.batch * args.seq / last_s)


def stage1_step(name: str, model, variables, args) -> dict:
    from linicl import linearize as LZ
    student = type(model)(LZ.student_config(model.cfg))
    sv = LZ.student_variables(student, variables)
    seqs = np.asarray(tokens(1, 2 * args.stage1_batch, args.stage1_seq, model.cfg.vocab_size))
    common = dict(batch_size=args.stage1_batch, progress=False)

    def wall(steps):
        t0 = time.perf_counter()
        out, _ = LZ.train_maps(model, variables, student, sv, seqs, steps=steps, **common)
        jax.block_until_ready(out)
        return time.perf_counter() - t0
    warm = wall(1)  # compiles (a later run retraces and reuses the executable)
    one = wall(1)
    more = wall(1 + args.stage1_steps)
    return dict(batch=args.stage1_batch, seq=args.stage1_seq, steps=args.stage1_steps,
                step_s=(more - one) / args.stage1_steps, first_run_s=warm)


def converted_speedup(name: str, model, variables, args) -> list:
    """The shipped maps of ``name`` on ``model``'s weights (the real ones, or the pack's random ones)."""
    from linicl import iclca
    from linicl.linearize.maps import ARTIFACTS, load_maps
    from linicl.timing import time_call
    longest = max(args.prompt_lengths) + QUERY_LEN
    teacher = type(model)(model.cfg.replace(max_len=longest))
    student, sv, _ = load_maps(ARTIFACTS / f"{name}_maps.safetensors", teacher, variables)
    fn = jax.jit(student.apply)
    query = tokens(2, 1, QUERY_LEN, student.cfg.vocab_size)
    rows = []
    for n in args.prompt_lengths:
        prompt = tokens(3 + n, 1, n, student.cfg.vocab_size)
        converted = iclca.convert(student, sv, prompt)
        prompted = time_call(fn, sv, jnp.concatenate([prompt, query], axis=1), repeats=args.repeats)
        alone = time_call(fn, converted, query, repeats=max(args.repeats, 10))
        rows.append(dict(prompt_len=n, prompted_s=prompted, converted_s=alone, speedup=prompted / alone))
    return rows


def eval_rate(model, variables, tokenizer, args) -> dict:
    from linicl.data import Example, Task
    from linicl.evaluate import evaluate
    rng = np.random.default_rng(4)
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish"]
    n = 200 + args.eval_queries  # 200 to draw the demonstration from, then the queries
    pairs = [Example(a, b) for a, b in zip(rng.choice(words, n), rng.choice(words, n))]
    task = Task("pairs", tuple(pairs[:200]), tuple(pairs[200:]), None)
    run = dict(k=1, n_eval=args.eval_queries, progress=False, open_metric="first_content_token")
    evaluate(model, variables, tokenizer, task, **run)  # compiles every length bucket
    t0 = time.perf_counter()
    res = evaluate(model, variables, tokenizer, task, **run)
    seconds = time.perf_counter() - t0
    return dict(queries=res.n, seconds=seconds, queries_per_s=res.n / seconds)


def write_pack(directory: str, names: list) -> None:
    """Per model, ``DIR/<name>/``: ``config.json`` and the tokenizer (see the module's docstring)."""
    import linicl.lm
    from linicl.lm.export import hf_config
    for name in names:
        _, model, _, tokenizer = linicl.lm.load(name)
        folder = Path(directory) / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=1))
        (folder / "tokenizer.json").write_text(tokenizer.backend.to_str())
        special = dict(add_bos_token=tokenizer.adds_bos, bos_token=tokenizer.bos_token,
                       eos_token=tokenizer.eos_token)
        (folder / "tokenizer_config.json").write_text(json.dumps(special, indent=1))
        print(f"{name}: {folder} ({sum(f.stat().st_size for f in folder.iterdir()) / 1e6:.1f} MB)")


def load_model(name: str, args, max_len: int):
    """``(model, variables, tokenizer, weights)``: the packaged checkpoint, or with ``--pack`` its
    architecture and tokenizer with random weights (``weights`` says which)."""
    import linicl.lm
    if not args.pack:
        _, model, variables, tokenizer = linicl.lm.load(name, max_len=max_len)
        return model, variables, tokenizer, "pretrained"
    from linicl.errors import DataError
    from linicl.lm.checkpoints import config_from_hf
    from linicl.lm.tokenizer import Tokenizer
    from linicl.nn.transformer import Transformer
    folder = Path(args.pack) / name
    if not (folder / "config.json").is_file():
        raise DataError(f"--pack: no {folder / 'config.json'} (write it with --write-pack)")
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()), source=str(folder / "config.json"))
    model = Transformer(cfg.replace(max_len=max_len))
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    return model, variables, Tokenizer.from_dir(folder), "random"


def check_model(name: str, args, peak: float, log) -> dict:
    t0 = time.perf_counter()
    model, variables, tokenizer, weights = load_model(name, args, max(args.seq, args.stage1_seq, 2048))
    out = dict(model=model.cfg.describe(), weights=weights, load_s=time.perf_counter() - t0)
    for key, fn in (("forward", lambda: forward_rate(model, variables, args, peak)),
                    ("stage1", lambda: stage1_step(name, model, variables, args)),
                    ("converted", lambda: converted_speedup(name, model, variables, args)),
                    ("evaluation", lambda: eval_rate(model, variables, tokenizer, args))):
        t0 = time.perf_counter()
        try:
            out[key] = fn()
        except Exception as e:  # one failed stage on a lent machine must not cost the others' numbers
            traceback.print_exc()
            out[key] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        out[f"{key}_wall_s"] = time.perf_counter() - t0
        log(f"{name} {key} ({out[f'{key}_wall_s']:.1f} s): {out[key]}")
    return out


def summary(m: dict, key: str) -> str:
    """One stage of one model in words (or its error)."""
    r = m[key]
    if isinstance(r, dict) and "error" in r:
        return f"{key} failed ({r['error'][:80]})"
    if key == "forward":
        return f"forward {r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f} % of the matmul peer"
    if key == "stage1":
        return f"stage-1 step {r['step_s']:.3f} s"
    if key == "converted":
        return "converted query x" + ", x".join(f"{x['speedup']:.1f} at {x['prompt_len']}" for x in r)
    return f"evaluation {r['queries_per_s']:.1f} queries/s"


def table(report: dict) -> str:
    """The headline as a markdown table: one row per model that ran."""
    peer = report["matmul_peer_flops"] / 1e12
    rows = ["| model | weights | forward tok/s | MFU (of the f32 matmul peer) | stage-1 step s | converted query "
            "speed-up | evaluation queries/s |", "|---|---|---|---|---|---|---|"]
    for name, m in report["models"].items():
        if "forward" not in m:
            rows.append(f"| {name} | {m.get('skipped', 'not run')} | | | | | |")
            continue
        cells = []
        for key in ("forward", "stage1", "converted", "evaluation"):
            r = m[key]
            if isinstance(r, dict) and "error" in r:
                cells.append("failed" if key != "forward" else "failed | failed")
            elif key == "forward":
                cells.append(f"{r['tokens_per_s']:,.0f} ({r['batch']}x{r['seq']}) | {100 * r['mfu']:.0f} %")
            elif key == "stage1":
                cells.append(f"{r['step_s']:.3f} ({r['batch']}x{r['seq']})")
            elif key == "converted":
                cells.append(", ".join(f"x{x['speedup']:.0f} at {x['prompt_len'] // 1024}k" for x in r))
            else:
                cells.append(f"{r['queries_per_s']:,.0f}")
        rows.append(f"| {name} | {m['weights']} | " + " | ".join(cells) + " |")
    return (f"{report['device']} ({report['platform']}); matmul peer {peer:.1f} TFLOP/s (float32 "
            f"{report['args']['matmul']}^3, JAX's default precision)\n\n" + "\n".join(rows))


def write_report(report: dict, out: str, t_start: float) -> None:
    report["table"] = table(report)
    report["wall_s"] = time.perf_counter() - t_start
    report["machine"] = reporting.machine_info()
    os.makedirs(out, exist_ok=True)
    reporting.write_json(os.path.join(out, "device_check.json"), report)


def main(argv=None) -> int:
    enable_persistent_cache()
    args = parse_args(argv)
    if args.write_pack:
        write_pack(args.write_pack, args.models.split(","))
        return 0
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    from linicl.timing import matmul_rate
    t_start = time.perf_counter()
    peak = matmul_rate(args.matmul, repeats=args.repeats)
    report = dict(device=str(jax.devices()[0]), platform=jax.default_backend(), device_count=jax.device_count(),
                  matmul_peer_flops=peak, args={k: v for k, v in vars(args).items()}, models={})
    log(f"{report['device']}: matmul peer {peak / 1e9:.1f} GFLOP/s")
    for name in args.models.split(","):
        try:
            report["models"][name] = check_model(name, args, peak, log)
        except Exception as e:  # a model that is not installed is reported, not fatal: the rest still runs
            if type(e).__name__ not in ("DataError", "ModuleNotFoundError"):
                raise
            report["models"][name] = dict(skipped=f"{type(e).__name__}: {e}")
            log(f"{name}: skipped ({e})")
        write_report(report, args.out, t_start)
    for name, m in report["models"].items():
        if "forward" in m:
            print(f"{name}: " + "; ".join(summary(m, key) for key in ("forward", "stage1", "converted", "evaluation")))
    failed = [f"{n}.{k}" for n, m in report["models"].items() for k, v in m.items()
              if isinstance(v, dict) and "error" in v]
    print(f"wall {report['wall_s']:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
