"""Linearize a pretrained softmax LM (``--model``: SmolLM2-135M by default, Gemma 3 270M with ``gemma3``, or a
checkpoint) by attention transfer, then ask how much of its in-context learning survives in a model whose
prompt is a finite state (and so converts into weights exactly).

1. Stage 1 (``linicl.linearize.train_maps``): hedgehog maps plus an exact softmax window and sinks,
   trained so that every layer's attention output matches the softmax layer's on the teacher's own
   inputs, on few-shot text rendered from the tasks' training splits. Resumable (``OUT/stage1.safetensors``);
   the trained maps are written to ``OUT/maps.safetensors`` (``--maps PATH`` loads maps instead).
   Optional stage 2 (``--stage2-steps N``; ``linicl.linearize.train_lora``): a rank-``--lora-rank``
   correction of the attention projections trained on the teacher's next-token distribution (KL),
   resumable (``OUT/stage2.safetensors``), stored in ``OUT/maps.safetensors`` beside the maps.
2. Held-out next-token loss (``linicl.linearize.quality``; text rendered from the test splits, never
   trained on) of the softmax model and the student, by position bucket; also the student read with
   other windows/sinks than it was trained with (the same maps: says how much the window carries).
3. ICL (``linicl.linearize.icl``): zero- and k-shot accuracy (exact match on word tasks; on label tasks such as sst2 or cb,
   label-restricted argmax over the label words, as ``linicl.evaluate`` scores them) for the softmax
   model, the student, and the student after ``iclca.convert`` of the demonstrations (the query read
   alone: by construction the same predictions, checked), with Wilson intervals and the share of the
   softmax model's few-shot gain each method keeps (``linicl.stats``; a method that gives one answer for
   every query is marked "(const)" and left out of the pooled share and the counts).
4. Converted-query time and state size against prompt length, against the prompted student
   (``linicl.linearize.conversion_cost``).

``--skip-held-out`` and ``--skip-timing`` leave out parts 2 and 4 (16 x 512-token texts and prompts up to
4,096 tokens by default) when only the ICL table is wanted.

    python experiments/linearize.py --quick                  # tiny fixture model, CI-sized
    python experiments/linearize.py                          # SmolLM2: 200 steps of 4 x 512 tokens
    python experiments/linearize.py --maps OUT/maps.safetensors --steps 0   # evaluate given maps
    python experiments/linearize.py --model gemma3 --maps linicl/linearize/artifacts/gemma3_maps.safetensors \\
        --skip-held-out --skip-timing                        # the ICL table alone

Writes ``OUT/linearize.json`` (every number), ``OUT/linearize.png``; prints the tables first.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from linicl.compiled import enable_persistent_cache
import linicl
from linicl import data, linearize, reporting, stats
from linicl.errors import LiniclError
from linicl.linearize.icl import METHODS, RECOVERED, STAGE1, gains_table, kept_half, shortest_prompt

TRAIN_TASKS = ("sst2", "trec", "agnews", "cb", "antonym", "synonym", "present-past", "singular-plural",
               "capitalize", "country-capital", "country-currency", "english-french", "english-spanish",
               "landmark-country", "person-occupation", "sentiment")
BOS_FLAG = {"auto": None, "on": True, "off": False}
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf", "llama-tiny.gguf")


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/linearize", quick="a tiny fixture model, a few steps (CI)",
                              seed="seeds the training text, batches and evaluation queries", data_dir=True,
                              plots=True)
    p.add_argument("--model", default=None, help="teacher: smollm2, gemma3 or a checkpoint (default smollm2; --quick: a tiny fixture)")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--feature-size", type=int, default=0, help="hedgehog m (0: d_head)")
    p.add_argument("--rope-on", choices=("inputs", "features"), default="inputs")
    p.add_argument("--train-seqs", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--sampled-seqs", type=int, default=0,
                   help="add this many sequences sampled from the teacher (each continuing the first 8 tokens "
                        "of a training sequence) to the training text")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--stage2-steps", type=int, default=0,
                   help="stage 2: steps of LoRA distillation against the teacher's logits (0: none)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--stage2-lr", type=float, default=1e-3)
    p.add_argument("--stage2-batch-size", type=int, default=2)
    p.add_argument("--maps", default=None, help="load trained maps instead of training")
    p.add_argument("--train-only", action="store_true",
                   help="stage 1 only: write OUT/maps.safetensors and OUT/stage1.json (wall time, tokens), "
                        "no evaluation")
    p.add_argument("--from-checkpoint", default=None,
                   help="evaluate the maps of a stage-1 checkpoint as far as it got (an unfinished run)")
    p.add_argument("--eval-seqs", type=int, default=16)
    p.add_argument("--eval-len", type=int, default=512)
    p.add_argument("--tasks", nargs="+", default=None,
                   help="tasks for the ICL table (default: every open-ended task in the data directory); a label "
                        "task (sst2, cb, ...) is scored by its label words, each of which must be one token")
    p.add_argument("--k", nargs="+", type=int, default=[0, 1, 4, 8])
    p.add_argument("--n-eval", type=int, default=24)
    p.add_argument("--bos", choices=list(BOS_FLAG), default="auto")
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096],
                   help="prompt lengths of the timing table")
    p.add_argument("--skip-held-out", action="store_true",
                   help="leave out part 2, the held-out next-token losses (--eval-seqs x --eval-len tokens per model)")
    p.add_argument("--skip-timing", action="store_true",
                   help="leave out part 4, the converted-query timing (prompts of --lengths tokens)")
    p.add_argument("--skip-approx", action="store_true",
                   help="leave the softmax model's learned-kernel conversion (and its control) out of the ICL table")
    p.add_argument("--resume", action="store_true",
                   help="reuse the held-out losses and ICL cells an earlier run with the same settings left in "
                        "OUT/progress.json (written after every cell)")
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or FIXTURE
        args.train_seqs, args.seq_len, args.steps, args.batch_size = 16, 32, 4, 4
        args.eval_seqs, args.eval_len, args.tasks, args.k, args.n_eval = 4, 64, args.tasks or ["antonym"], [0, 1], 4
        args.window, args.sinks, args.lengths = 4, 1, [32, 128]
    if args.train_only and (args.maps or args.from_checkpoint):
        p.error("--train-only trains the maps; it cannot be combined with --maps or --from-checkpoint")
    if args.quick and args.stage2_steps:
        args.stage2_steps, args.lora_rank = min(args.stage2_steps, 3), min(args.lora_rank, 2)
    for name in ("steps", "stage2_steps", "sampled_seqs", "train_seqs", "seq_len", "batch_size", "stage2_batch_size", "lora_rank",
                 "eval_seqs", "eval_len", "n_eval"):
        if getattr(args, name) < (0 if name in ("steps", "stage2_steps", "sampled_seqs") else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def load_teacher(args):
    # room for the held-out text and the timed prompts, when the run measures them
    max_len = max([2048] + ([] if args.skip_held_out else [args.eval_len])
                  + ([] if args.skip_timing else [max(args.lengths) + 64]))
    loaded = linicl.lm.load(args.model, max_len=max_len, require_tokenizer=True)
    return loaded.model, loaded.variables, loaded.tokenizer, str(loaded.source)


def stage1(teacher, tv, args, seqs):
    """The student and its maps: loaded (--maps), from a stage-1 checkpoint, or trained."""
    student = linicl.Transformer(linearize.student_config(
        teacher.cfg, window=args.window, sinks=args.sinks, feature_size=args.feature_size, rope_on=args.rope_on))
    if args.maps:
        student, sv, meta = linearize.load_maps(args.maps, teacher, tv)
        return student, sv, dict(loaded=args.maps, meta=meta)
    sv = linearize.student_variables(student, tv, seed=args.seed)
    maps, name = os.path.join(args.out, "maps.safetensors"), args.model or "SmolLM2"
    if args.from_checkpoint:
        return (student, *linearize.checkpoint_stage(args.from_checkpoint, student, sv, maps_path=maps, teacher_name=name))
    return (student, *linearize.transfer_stage(
        teacher, tv, student, sv, seqs, maps_path=maps, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        seed=args.seed, progress=args.progress, checkpoint=os.path.join(args.out, "stage1.safetensors"),
        teacher_name=name))


def held_out(teacher, tv, student, sv, tok, args, stage1_sv=None) -> dict:
    """Next-token loss of held-out text (test splits): softmax, student, the student before stage 2
    (``stage1_sv``) and the student with other windows/sinks (the same maps)."""
    seqs = linearize.training_sequences(tok, args.tasks, n=args.eval_seqs, length=args.eval_len, seed=args.seed + 1,
                                        split="test", data_dir=args.data_dir, bos=linearize.bos_for(tok, BOS_FLAG[args.bos]))
    models = {"softmax": (teacher, tv), "student": (student, sv)}
    if stage1_sv is not None:
        models[STAGE1] = (student, stage1_sv)
    models |= {name: (m, sv) for name, m in linearize.window_variants(student, window=args.window, sinks=args.sinks).items()}
    return linearize.held_out_losses(models, seqs)


def tables(report: dict) -> str:
    """Every table of the report, as printed: held-out loss and timing only where the run measured them
    (``--skip-held-out``, ``--skip-timing``)."""
    parts = [_held_out_lines(report), _stage2_lines(report), _icl_lines(report), _gains_lines(report),
             _timing_lines(report)]
    return "\n".join(line for part in parts for line in part).rstrip("\n")


def _held_out_lines(report: dict) -> list:
    ho = report.get("held_out")
    if not ho:
        return []
    buckets = list(ho["softmax"]["by_position"])
    rows = [[m, f"{v['mean']:.3f}", f"{v['mean'] - ho['softmax']['mean']:+.3f}"] + [f"{v['by_position'][b]:.3f}" for b in buckets]
            for m, v in ho.items()]
    return ["Held-out next-token loss (nats; text from the test splits), by position:", "",
            reporting.markdown_table(["model", "mean", "gap"] + buckets, rows), ""]


def _stage2_lines(report: dict) -> list:
    s2 = report.get("stage2")
    if not s2:
        return []
    kl = s2["history"]["kl"]
    return [f"Stage 2 (LoRA rank {s2['rank']} on q, k, v, o; {s2['tokens_seen']} tokens): KL to the teacher "
            f"{kl[0]:.3f} -> {kl[-1]:.3f} nats per token (training batches).", ""]


def _present(report: dict) -> list:
    """The methods of ``METHODS`` this run evaluated, in table order."""
    return [m for m in METHODS if any(m in c for c in report["icl"].values())]


def _icl_lines(report: dict) -> list:
    methods = _present(report)
    rows = []
    for cell, res in report["icl"].items():
        rows.append([cell + ("" if res.get("converted_same_answers", True) else " (CONVERTED DIFFERS)")] + [(f"{100 * res[m]['accuracy']:.1f} [{100 * res[m]['ci_low']:.1f}, {100 * res[m]['ci_high']:.1f}]"
                               + (" (const)" if res[m]["constant"] else "")) if m in res else "-" for m in methods])
    return ["ICL accuracy, % [95 % Wilson] (exact match on word tasks, label-restricted on label tasks; "
            "(const) = one answer for every query):", "", reporting.markdown_table(["task, k"] + methods, rows), ""]


def _gains_lines(report: dict) -> list:
    kept = [m for m in RECOVERED if m in _present(report)]
    pooled = report.get("pooled_gain")
    lines = ["Share of the softmax model's few-shot gain each method keeps (only where the gain is significantly "
             "positive; (const) = one answer for every query, left out of the pooled share and the counts):", "",
             gains_table(report["gains"], pooled, kept), ""]
    if pooled and "kernel_adds" in pooled:
        d = pooled["kernel_adds"]
        lines += [f"The learned kernel's terms add {100 * d['value']:+.1f} [{100 * d['low']:+.1f}, "
                  f"{100 * d['high']:+.1f}] points of pooled k={pooled['k']} accuracy over the kept tokens alone "
                  f"(paired bootstrap, same queries).", ""]
    for m in kept:
        c = kept_half(report["gains"], m)
        const = f"; left out, one answer for every query: {', '.join(c['constant'])}" if c["constant"] else ""
        lines += [f"{m}: at least half of the gain on {len(c['half'])} of the {len(c['of'])} tasks with a significant "
                  f"gain (of {len(report['gains'])} tasks{const})."]
    shortest = shortest_prompt(report["icl"])
    if shortest is not None:
        lines += ["", f"Shortest converted demonstration prompt: {shortest['tokens']} tokens ({shortest['cell']}; "
                      f"student window {report['settings']['window']}, sinks {report['settings']['sinks']})."]
    return lines + [""]


def _timing_lines(report: dict) -> list:
    if not report.get("timing"):
        return []
    rows = [[r["prompt_len"], f"{r['prompted_s'] * 1e3:.1f}", f"{r['converted_s'] * 1e3:.1f}",
             f"{r['prompted_s'] / r['converted_s']:.1f}x", r["state_floats"], r["kv_cache_floats"],
             f"{r['logits_rel_err']:.1e}" if "logits_rel_err" in r else "-"] for r in report["timing"]]
    return [reporting.markdown_table(["prompt", "prompted ms", "converted ms", "speed-up", "state floats",
                                      "softmax KV floats", "converted vs prompted logits, rel. err"], rows)]


def _icl_panel(ax, icl: dict):
    """Accuracy pooled over every task's queries (equal n per task: the mean over tasks) against k,
    with its 95 % Wilson interval."""
    for m, style in zip(METHODS, ("o-", "s--", "v--", "^:", "x-.", "d:")):
        counts = {}  # k -> [correct, n]
        for cell in icl.values():
            r = cell.get(m)  # "student converted" has no k = 0 cell: nothing to convert
            if r:
                c = counts.setdefault(r["k"], [0, 0])
                c[0], c[1] = c[0] + int(sum(r["correct"])), c[1] + r["n"]
        if not counts:
            continue
        ks = sorted(counts)
        iv = [stats.wilson(*counts[k]) for k in ks]
        ax.plot(ks, [counts[k][0] / counts[k][1] for k in ks], style, label=m)
        ax.fill_between(ks, [i.low for i in iv], [i.high for i in iv], alpha=0.15)
    tasks = {c["softmax"]["task"] for c in icl.values() if c.get("softmax")}
    ax.set(xlabel="demonstrations k", ylabel="accuracy, pooled (95 % Wilson)", title=f"ICL, {len(tasks)} tasks")
    ax.legend()


def figure(plt, report):
    """Stage 1's training curve (when it trained) and the held-out loss by position (when measured); the
    ICL accuracies against k in a panel either leaves free."""
    hist = report["stage1"].get("history")
    panels = ([lambda ax: _history_panel(ax, hist)] if hist else []) + (
        [lambda ax: _held_out_panel(ax, report["held_out"])] if report.get("held_out") else [])
    if len(panels) < 2:
        panels.append(lambda ax: _icl_panel(ax, report["icl"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(ax)
    fig.tight_layout()
    return fig


def _history_panel(ax, hist: dict):
    ax.semilogy(hist["step"], np.asarray(hist["loss"]) / len(hist["layers"][0]))
    ax.set(xlabel="step", ylabel="relative attention-output MSE per layer", title="stage 1")


def _held_out_panel(ax, ho: dict):
    for m in ("softmax", "student"):
        ax.plot(list(ho[m]["by_position"]), list(ho[m]["by_position"].values()), "o-", label=m)
    ax.set(xlabel="position bucket", ylabel="next-token loss (nats)", title="held-out text")
    ax.legend()


# settings that change no number: a resumed run may differ in these
# (the skip flags too: the parts they skip keep their own entries, and a later run without them adds those)
PROGRESS_IGNORES = ("out", "progress", "plots", "resume", "data_dir", "lengths", "skip_held_out", "skip_timing")


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    args = parse_args(argv)
    args.tasks = args.tasks or data.list_tasks(args.data_dir, answers="open")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    teacher, tv, tok, source = load_teacher(args)
    try:  # a label task whose label words this tokenizer cannot score: refused before any training
        linearize.check_scorable(tok, args.tasks, args.data_dir)
    except LiniclError as e:
        print(f"linearize: --tasks {e}", file=sys.stderr)
        return 2
    trains_maps = not (args.maps or args.from_checkpoint)
    # built once for both stages (teacher samples are costly), and only when a stage trains
    seqs = linearize.training_text(
        teacher, tv, tok, TRAIN_TASKS if not args.quick else ("antonym", "sst2"), n=args.train_seqs,
        length=args.seq_len, seed=args.seed, data_dir=args.data_dir, bos=linearize.bos_for(tok, BOS_FLAG[args.bos]),
        sampled=args.sampled_seqs) if trains_maps or args.stage2_steps else None
    student, sv, s1 = stage1(teacher, tv, args, seqs)
    s2, sv1 = None, None  # sv1: the student before stage 2, when there is one
    if args.stage2_steps:
        sv1 = sv
        sv, s2 = linearize.distill_stage(
            teacher, tv, student, sv, seqs, maps_path=os.path.join(args.out, "maps.safetensors"), rank=args.lora_rank,
            steps=args.stage2_steps, batch_size=args.stage2_batch_size, lr=args.stage2_lr, seed=args.seed,
            progress=args.progress, checkpoint=os.path.join(args.out, "stage2.safetensors"),
            stage1_tokens=s1.get("tokens_seen", (s1.get("meta") or {}).get("tokens")), teacher_name=args.model or "SmolLM2")
    if args.train_only:
        s1.update(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                  machine=reporting.machine_info(), stage2=s2)
        reporting.write_json(os.path.join(args.out, "stage1.json"), s1)
        print(f"stage 1: {args.steps} steps, {s1['tokens_seen']} tokens, {s1['wall_s']:.1f} s; "
              f"wrote {args.out}/maps.safetensors and stage1.json")
        return 0
    report = dict(settings=vars(args), model=dict(source=source, student=student.cfg.describe()), stage1=s1,
                  stage2=s2, machine=reporting.machine_info())
    try:  # a progress file that holds no progress: named, with the fix, not a JSON traceback
        prog = reporting.Progress(os.path.join(args.out, "progress.json"),
                                  reporting.fingerprint(vars(args), ignore=PROGRESS_IGNORES), args.resume)
    except LiniclError as e:
        print(f"linearize: --resume: {e}", file=sys.stderr)
        return 2
    report["resumed"] = prog.resumed
    if not args.skip_held_out:
        report["held_out"] = prog.get("held_out") or prog.put("held_out", held_out(
            teacher, tv, student, sv, tok, args, stage1_sv=sv1))
    report["icl"] = linearize.icl_table(teacher, tv, student, sv, tok, args.tasks, args.k, store=prog,
                                        data_dir=args.data_dir, progress=args.progress, seed=args.seed, n_eval=args.n_eval,
                                        add_bos=BOS_FLAG[args.bos], approx=not args.skip_approx, stage1_variables=sv1)
    report["gains"] = linearize.gains(report["icl"], args.tasks, max(args.k))
    report["pooled_gain"] = linearize.pooled_gain(report["icl"], args.tasks, max(args.k))
    if not args.skip_timing:
        report["timing"] = linearize.conversion_cost(student, sv, args.lengths)
    report["wall_s"] = time.perf_counter() - t0
    reporting.publish(args.out, "linearize", report, tables(report), figure, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
