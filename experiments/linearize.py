"""Linearize SmolLM2 by attention transfer, then ask how much of its in-context learning survives in a
model whose prompt is a finite state (and so converts into weights exactly).

1. Stage 1 (``linicl.linearize.train_maps``): hedgehog maps plus an exact softmax window and sinks,
   trained so that every layer's attention output matches the softmax layer's on the teacher's own
   inputs, on few-shot text rendered from the tasks' training splits. Resumable (``OUT/stage1.safetensors``);
   the trained maps are written to ``OUT/maps.safetensors`` (``--maps PATH`` loads maps instead).
   Optional stage 2 (``--stage2-steps N``; ``linicl.linearize.train_lora``): a rank-``--lora-rank``
   correction of the attention projections trained on the teacher's next-token distribution (KL),
   resumable (``OUT/stage2.safetensors``), stored in ``OUT/maps.safetensors`` beside the maps.
2. Held-out next-token loss (text rendered from the test splits, never trained on) of the softmax
   model and the student, by position bucket; also the student read with other windows/sinks than it
   was trained with (the same maps: says how much the window carries).
3. ICL: zero- and k-shot accuracy (exact match on word tasks; on label tasks such as sst2 or cb,
   label-restricted argmax over the label words, as ``linicl.evaluate`` scores them) for the softmax
   model, the student, and the student after ``iclca.convert`` of the demonstrations (the query read
   alone: by construction the same predictions, checked), with Wilson intervals and the share of the
   softmax model's few-shot gain the student keeps (``linicl.stats``).
4. Converted-query time and state size against prompt length, against the prompted student.

    python experiments/linearize.py --quick                  # tiny fixture model, CI-sized
    python experiments/linearize.py                          # SmolLM2: 200 steps of 4 x 512 tokens
    python experiments/linearize.py --maps OUT/maps.safetensors --steps 0   # evaluate given maps

Writes ``OUT/linearize.json`` (every number), ``OUT/linearize.png``; prints the tables first.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from linicl.compiled import enable_persistent_cache
import linicl
from linicl import data, iclca, linearize, reporting, stats
from linicl.errors import LiniclError
from linicl.evaluate import evaluate_prompts
from linicl.memory import kv_cache_floats
from linicl.metrics import rel_err
from linicl.timing import time_call

TRAIN_TASKS = ("sst2", "trec", "agnews", "cb", "antonym", "synonym", "present-past", "singular-plural",
               "capitalize", "country-capital", "country-currency", "english-french", "english-spanish",
               "landmark-country", "person-occupation", "sentiment")
BOS_FLAG = {"auto": None, "on": True, "off": False}
# The unmodified softmax model with its demonstrations as learned-kernel terms, and the control: the same
# conversion with those terms dropped (only the sinks and the window's prompt tokens left).
APPROX, KEPT_ONLY = "softmax + learned-kernel prompt", "softmax + kept prompt tokens only"
STAGE1 = "student, stage 1 only"  # with --stage2-steps: the student before its LoRA correction
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
    max_len = max(args.eval_len, max(args.lengths) + 64, 2048)
    loaded = linicl.lm.load(args.model, max_len=max_len, require_tokenizer=True)
    return loaded.model, loaded.variables, loaded.tokenizer, str(loaded.source)


def check_tasks(tok, args) -> None:
    """Refuse, before any training, a label task whose label words the tokenizer cannot score (each
    must be one distinct token: label-restricted argmax reads one logit per label)."""
    for name in args.tasks:
        task = data.load_task(name, args.data_dir)
        if task.labels is not None:
            try:
                data.check_label_words(task.labels, tok, prefix=data.template_for(task).label_prefix)
            except LiniclError as e:
                raise LiniclError(f"--tasks {name}: a label task is scored by its label words {list(task.labels)}, "
                                  f"which this tokenizer cannot score: {e}") from None


def row_bos(tok, args):
    """The id every training and held-out row starts with: BOS when ``--bos`` (auto: the tokenizer's
    convention; Gemma yes, SmolLM2 no) says so, else None."""
    add = tok.adds_bos if BOS_FLAG[args.bos] is None else BOS_FLAG[args.bos]
    return tok.bos_id if add else None


def train_text(teacher, tv, tok, args):
    """Few-shot text from the training splits, plus ``--sampled-seqs`` rows sampled from the teacher."""
    seqs = linearize.training_sequences(tok, TRAIN_TASKS if not args.quick else ("antonym", "sst2"),
                                        n=args.train_seqs, length=args.seq_len, seed=args.seed,
                                        data_dir=args.data_dir, bos=row_bos(tok, args))
    if not args.sampled_seqs:
        return seqs
    rows = np.random.default_rng([args.seed, 17]).integers(0, len(seqs), args.sampled_seqs)
    sampled = linearize.sampled_sequences(teacher, tv, seqs[rows, :8], args.seq_len, seed=args.seed)
    return np.concatenate([seqs, sampled])


def stage1(teacher, tv, tok, args, seqs):
    student = linicl.Transformer(linearize.student_config(
        teacher.cfg, window=args.window, sinks=args.sinks, feature_size=args.feature_size, rope_on=args.rope_on))
    if args.maps:
        student, sv, meta = linearize.load_maps(args.maps, teacher, tv)
        return student, sv, dict(loaded=args.maps, meta=meta)
    sv = linearize.student_variables(student, tv, seed=args.seed)
    if args.from_checkpoint:
        sv, info = linearize.maps_from_checkpoint(args.from_checkpoint, student, sv)
        tokens = info["step"] * info["settings"]["batch_size"] * info["settings"]["sequences"][1]
        linearize.save_maps(os.path.join(args.out, "maps.safetensors"), student, sv,
                            meta=dict(tokens=tokens, steps=info["step"], teacher=args.model or "SmolLM2"))
        return student, sv, dict(history=info["history"], tokens_seen=tokens, steps_reached=info["step"],
                                 of_steps=info["settings"]["steps"], checkpoint=args.from_checkpoint)
    t0 = time.perf_counter()
    sv, hist = linearize.train_maps(teacher, tv, student, sv, seqs, steps=args.steps, batch_size=args.batch_size,
                                    lr=args.lr, seed=args.seed, progress=args.progress,
                                    checkpoint=os.path.join(args.out, "stage1.safetensors"))
    wall = time.perf_counter() - t0
    tokens = args.steps * args.batch_size * args.seq_len
    linearize.save_maps(os.path.join(args.out, "maps.safetensors"), student, sv,
                        meta=dict(tokens=tokens, steps=args.steps, seq_len=args.seq_len,
                                  teacher=args.model or "SmolLM2"))
    return student, sv, dict(history=hist._asdict(), wall_s=wall, tokens_seen=tokens,
                             train_sequences=list(seqs.shape))


def stage2(teacher, tv, student, sv, args, s1: dict, seqs):
    """LoRA distillation on the stage-1 student (the same training text); the maps file gets the
    correction beside the maps. Returns the corrected variables and the stage's record."""
    t0 = time.perf_counter()
    sv2, correction, hist = linearize.train_lora(
        teacher, tv, student, sv, seqs, rank=args.lora_rank, steps=args.stage2_steps,
        batch_size=args.stage2_batch_size, lr=args.stage2_lr, seed=args.seed, progress=args.progress,
        checkpoint=os.path.join(args.out, "stage2.safetensors"))
    tokens = args.stage2_steps * args.stage2_batch_size * args.seq_len
    meta = dict(tokens=s1.get("tokens_seen", (s1.get("meta") or {}).get("tokens")), stage2_tokens=tokens, stage2_steps=args.stage2_steps,
                lora_rank=args.lora_rank, seq_len=args.seq_len, teacher=args.model or "SmolLM2")
    linearize.save_maps(os.path.join(args.out, "maps.safetensors"), student, sv2, meta=meta, lora=correction)
    return sv2, dict(history=hist._asdict(), wall_s=time.perf_counter() - t0, tokens_seen=tokens,
                     rank=args.lora_rank, lr=args.stage2_lr)


def held_out(teacher, tv, student, sv, tok, args, stage1_sv=None) -> dict:
    """Next-token loss of held-out text; ``stage1_sv``: the student before stage 2 (a row of its own)."""
    seqs = linearize.training_sequences(tok, args.tasks, n=args.eval_seqs, length=args.eval_len,
                                        seed=args.seed + 1, split="test", data_dir=args.data_dir,
                                        bos=row_bos(tok, args))
    out = {"softmax": linearize.next_token_loss(teacher, tv, seqs, batch_size=2),
           "student": linearize.next_token_loss(student, sv, seqs, batch_size=2)}
    if stage1_sv is not None:
        out["student, stage 1 only"] = linearize.next_token_loss(student, stage1_sv, seqs, batch_size=2)
    for window, sinks in ((0, 0), (0, args.sinks), (args.window, 0), (4 * args.window, args.sinks)):
        if (window, sinks) == (args.window, args.sinks):
            continue
        other = linicl.Transformer(student.cfg.replace(window=window, sinks=sinks))
        out[f"student w{window} s{sinks} (same maps)"] = linearize.next_token_loss(other, sv, seqs, batch_size=2)
    for v in out.values():
        v.pop("per_position")
    return out


def icl(teacher, tv, student, sv, tok, args, prog: reporting.Progress, stage1_sv=None) -> dict:
    """Per task and k: softmax, student, student with the demonstrations converted (query alone), and
    the softmax model with the demonstrations as learned-kernel bias terms. Each finished (task, k) cell
    is saved in ``prog`` at once and reused by a resumed run."""
    # The headline cells first (zero-shot and the largest k of every task), so that an interrupted run
    # has the measure; the other k after. The returned dict is in task, k order either way.
    first = {0, max(args.k)}
    cells = ([(name, k) for name in args.tasks for k in args.k if k in first]
             + [(name, k) for name in args.tasks for k in args.k if k not in first])
    bar = tqdm(total=len(cells), desc="ICL cells", disable=not args.progress)
    for name, k in cells:
        key = f"{name} k={k}"
        bar.set_postfix_str(key)
        if prog.get(key) is None:
            t0 = time.perf_counter()
            prog.put(key, icl_cell(teacher, tv, student, sv, tok, data.load_task(name, args.data_dir), k, args,
                                   stage1_sv) | {"wall_s": time.perf_counter() - t0})
        bar.update(1)
    bar.close()
    return {f"{name} k={k}": prog.get(f"{name} k={k}") for name in args.tasks for k in args.k}


def icl_cell(teacher, tv, student, sv, tok, task, k: int, args, stage1_sv=None) -> dict:
    """One (task, k) cell of ``icl``: every method's summary, correct flags and predictions
    (``stage1_sv``: the student before stage 2, one more method). A label task (``task.labels``) is
    scored by label-restricted argmax over its label words, an open-ended one by exact match."""
    name = task.name
    template = data.template_for(task)
    prompts = data.build_eval_set(task, tok, k=k, seed=args.seed, n_eval=args.n_eval, template=template,
                                  same_demos=True, add_bos=BOS_FLAG[args.bos])
    common = dict(tokenizer=tok, prompts=prompts, task=name, k=k, progress=False, labels=task.labels,
                  label_prefix=template.label_prefix)
    res = {"softmax": evaluate_prompts(teacher, tv, **common),
           "student": evaluate_prompts(student, sv, **common)}
    if stage1_sv is not None:
        res[STAGE1] = evaluate_prompts(student, stage1_sv, **common)
    n = prompts[0].query_start
    if n:  # the shared demonstrations (and BOS) become the student's weights
        converted = iclca.convert(student, sv, jnp.asarray(prompts[0].tokens[:n])[None])
        alone = [dataclasses.replace(p, tokens=p.tokens[n:], roles=p.roles[n:], query_start=0)
                 for p in prompts]
        res["student converted"] = evaluate_prompts(student, converted, **dict(common, prompts=alone))
    if n and not args.skip_approx:
        # The unmodified softmax model with its demonstrations as learned-kernel bias terms; the
        # student's sinks and the prompt tokens in its window at the first query token stay exact.
        cfg = student.cfg
        approx = iclca.convert_approx(teacher, tv, jnp.asarray(prompts[0].tokens[:n])[None],
                                      kernel="learned", maps=sv, sinks=min(cfg.sinks, n),
                                      window=min(max(cfg.window - 1, 0), max(n - cfg.sinks, 0)))
        res[APPROX] = evaluate_prompts(teacher, approx, **dict(common, prompts=alone))
        res[KEPT_ONLY] = evaluate_prompts(teacher, iclca.drop_approx_terms(approx), **dict(common, prompts=alone))
    row = {m: r.summary() | {"correct": r.correct.astype(int).tolist(), "predictions": list(r.predictions)}
           for m, r in res.items()}
    if "student converted" in res:  # exact conversion: the same answers, by construction
        row["converted_same_answers"] = res["student converted"].predictions == res["student"].predictions
    row["prompt_tokens"] = int(n)  # demonstrations (and BOS): compare with the window
    return row


def gains(rows: dict, args) -> dict:
    """Per task: the softmax few-shot gain at the largest k and the share the student keeps."""
    k = max(args.k)
    out = {}
    for name in args.tasks:
        zero, few = rows.get(f"{name} k=0"), rows.get(f"{name} k={k}")
        if zero is None or few is None:
            continue
        g = stats.gain(few["softmax"]["correct"], zero["softmax"]["correct"])
        rec = stats.recovered(few["student"]["correct"], few["softmax"]["correct"], zero["softmax"]["correct"])
        out[name] = dict(k=k, gain=g._asdict(), student_recovered=None if rec is None else rec._asdict())
        for m, field in ((APPROX, "learned_kernel_recovered"), (KEPT_ONLY, "kept_only_recovered"),
                         (STAGE1, "stage1_recovered")):
            if m in few:
                ap = stats.recovered(few[m]["correct"], few["softmax"]["correct"], zero["softmax"]["correct"])
                out[name][field] = None if ap is None else ap._asdict()
    return out


def pooled_gain(rows: dict, args) -> dict | None:
    """The issue's headline: the softmax gain at the largest k averaged over the tasks (their queries
    pooled, equal numbers per task) and the share of it each method keeps, with bootstrap intervals."""
    k = max(args.k)
    names = [t for t in args.tasks if f"{t} k=0" in rows and f"{t} k={k}" in rows]
    if not names or k == 0:
        return None
    flat = lambda cell, m: np.concatenate([rows[f"{t} k={cell}"][m]["correct"] for t in names])  # noqa: E731
    zero, few = flat(0, "softmax"), flat(k, "softmax")
    out = dict(k=k, tasks=names, n=int(zero.size), gain=stats.gain(few, zero)._asdict())
    for m in ("student", STAGE1, APPROX, KEPT_ONLY):
        if all(m in rows[f"{t} k={k}"] for t in names):
            rec = stats.recovered(flat(k, m), few, zero)
            out[m] = None if rec is None else rec._asdict()
    if all(APPROX in rows[f"{t} k={k}"] and KEPT_ONLY in rows[f"{t} k={k}"] for t in names):
        # What the learned kernel adds over the tokens it leaves exact: accuracy, same queries.
        out["kernel_adds"] = stats.paired_bootstrap(flat(k, APPROX), flat(k, KEPT_ONLY))._asdict()
    return out


def timing(student, sv, args) -> list:
    rows = []
    query = jnp.ones((1, 16), jnp.int32)
    fwd = jax.jit(student.apply)
    for n in args.lengths:
        prompt = jax.random.randint(jax.random.PRNGKey(n), (1, n), 0, student.cfg.vocab_size, jnp.int32)
        converted = iclca.convert(student, sv, prompt)
        full = jnp.concatenate([prompt, query], axis=1)
        # The conversion's float32 error on this pretrained student: max |converted - prompted| over
        # the query logits / max |prompted| (linicl.metrics.rel_err, as linicl verify reports).
        err = rel_err(fwd(converted, query), fwd(sv, full)[:, n:])
        rows.append(dict(prompt_len=n, prompted_s=time_call(fwd, sv, full, repeats=3),
                         converted_s=time_call(fwd, converted, query, repeats=3), logits_rel_err=err,
                         state_floats=int(sum(x.size for x in jax.tree_util.tree_leaves(converted["prompt_state"]))),
                         kv_cache_floats=kv_cache_floats(student.cfg, n)))
    return rows


def tables(report: dict) -> str:
    lines = ["Held-out next-token loss (nats; text from the test splits), by position:", ""]
    ho = report["held_out"]
    buckets = list(ho["softmax"]["by_position"])
    rows = [[m, f"{v['mean']:.3f}", f"{v['mean'] - ho['softmax']['mean']:+.3f}"] + [f"{v['by_position'][b]:.3f}" for b in buckets]
            for m, v in ho.items()]
    lines += [reporting.markdown_table(["model", "mean", "gap"] + buckets, rows), ""]
    s2 = report.get("stage2")
    if s2:
        kl = s2["history"]["kl"]
        lines += [f"Stage 2 (LoRA rank {s2['rank']} on q, k, v, o; {s2['tokens_seen']} tokens): KL to the teacher "
                  f"{kl[0]:.3f} -> {kl[-1]:.3f} nats per token (training batches).", ""]
    lines += ["ICL accuracy, % [95 % Wilson] (exact match on word tasks, label-restricted on label tasks; "
              "(const) = one answer for every query):", ""]
    present = lambda m: any(m in c for c in report["icl"].values())  # noqa: E731
    methods = [m for m in ("softmax", "student", STAGE1, "student converted", APPROX, KEPT_ONLY) if present(m)]
    rows = []
    for cell, res in report["icl"].items():
        rows.append([cell + ("" if res.get("converted_same_answers", True) else " (CONVERTED DIFFERS)")] + [(f"{100 * res[m]['accuracy']:.1f} [{100 * res[m]['ci_low']:.1f}, {100 * res[m]['ci_high']:.1f}]"
                               + (" (const)" if res[m]["constant"] else "")) if m in res else "-" for m in methods])
    lines += [reporting.markdown_table(["task, k"] + methods, rows), ""]
    lines += ["Share of the softmax model's few-shot gain the student keeps (only where the gain is significantly positive):", ""]
    def share(r):
        return "n.s. gain" if r is None else f"{r['value']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
    # (method, its field in report["gains"]): the methods this run evaluated
    kept = [(m, f) for m, f in (("student", "student_recovered"), (STAGE1, "stage1_recovered"),
                                (APPROX, "learned_kernel_recovered"), (KEPT_ONLY, "kept_only_recovered")) if present(m)]
    rows = [[t, g["k"], f"{100 * g['gain']['value']:.1f} [{100 * g['gain']['low']:.1f}, {100 * g['gain']['high']:.1f}]"]
            + [share(g.get(f)) for _, f in kept] for t, g in report["gains"].items()]
    pooled = report.get("pooled_gain")
    if pooled:
        g = pooled["gain"]
        rows.append([f"all {len(pooled['tasks'])} tasks, pooled (n={pooled['n']})", pooled["k"],
                     f"{100 * g['value']:.1f} [{100 * g['low']:.1f}, {100 * g['high']:.1f}]"]
                    + [share(pooled.get(m)) for m, _ in kept])
    lines += [reporting.markdown_table(["task", "k", "softmax gain, points"] + [f"{m} keeps" for m, _ in kept],
                                       rows), ""]
    if pooled and "kernel_adds" in pooled:
        d = pooled["kernel_adds"]
        lines += [f"The learned kernel's terms add {100 * d['value']:+.1f} [{100 * d['low']:+.1f}, "
                  f"{100 * d['high']:+.1f}] points of pooled k={pooled['k']} accuracy over the kept tokens alone "
                  f"(paired bootstrap, same queries).", ""]
    sig = [g for g in report["gains"].values() if g["student_recovered"] is not None]  # a significant gain
    for m, field in kept:
        half = sum(1 for g in sig if (g.get(field) or {}).get("value", 0) >= 0.5)
        lines += [f"{m}: at least half of the gain on {half} of the {len(sig)} tasks with a significant gain "
                  f"(of {len(report['gains'])} tasks)."]
    lines += [""]
    shortest = min((c["prompt_tokens"] for c in report["icl"].values() if c.get("prompt_tokens")), default=None)
    if shortest is not None:
        lines += [f"Shortest converted prompt: {shortest} tokens (student window "
                  f"{report['settings']['window']}, sinks {report['settings']['sinks']}).", ""]
    rows = [[r["prompt_len"], f"{r['prompted_s'] * 1e3:.1f}", f"{r['converted_s'] * 1e3:.1f}",
             f"{r['prompted_s'] / r['converted_s']:.1f}x", r["state_floats"], r["kv_cache_floats"],
             f"{r['logits_rel_err']:.1e}" if "logits_rel_err" in r else "-"] for r in report["timing"]]
    lines += [reporting.markdown_table(["prompt", "prompted ms", "converted ms", "speed-up", "state floats",
                                        "softmax KV floats", "converted vs prompted logits, rel. err"], rows)]
    return "\n".join(lines)


def _icl_panel(ax, icl: dict):
    """Accuracy pooled over every task's queries (equal n per task: the mean over tasks) against k,
    with its 95 % Wilson interval."""
    for m, style in (("softmax", "o-"), ("student", "s--"), (STAGE1, "v--"), ("student converted", "^:"),
                     (APPROX, "x-."), (KEPT_ONLY, "d:")):
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
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    hist = report["stage1"].get("history")
    if hist:
        ax[0].semilogy(hist["step"], np.asarray(hist["loss"]) / len(hist["layers"][0]))
        ax[0].set(xlabel="step", ylabel="relative attention-output MSE per layer", title="stage 1")
    else:  # maps loaded, no training history: the ICL accuracies instead
        _icl_panel(ax[0], report["icl"])
    ho = report["held_out"]
    for m in ("softmax", "student"):
        ax[1].plot(list(ho[m]["by_position"]), list(ho[m]["by_position"].values()), "o-", label=m)
    ax[1].set(xlabel="position bucket", ylabel="next-token loss (nats)", title="held-out text")
    ax[1].legend()
    fig.tight_layout()
    return fig


# settings that change no number: a resumed run may differ in these
PROGRESS_IGNORES = ("out", "progress", "plots", "resume", "data_dir", "lengths")


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    args = parse_args(argv)
    args.tasks = args.tasks or data.list_tasks(args.data_dir, answers="open")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    teacher, tv, tok, source = load_teacher(args)
    try:
        check_tasks(tok, args)
    except LiniclError as e:
        print(f"linearize: {e}", file=sys.stderr)
        return 2
    trains_maps = not (args.maps or args.from_checkpoint)
    # built once for both stages (teacher samples are costly), and only when a stage trains
    seqs = train_text(teacher, tv, tok, args) if trains_maps or args.stage2_steps else None
    student, sv, s1 = stage1(teacher, tv, tok, args, seqs)
    s2, sv1 = None, None  # sv1: the student before stage 2, when there is one
    if args.stage2_steps:
        sv1 = sv
        sv, s2 = stage2(teacher, tv, student, sv, args, s1, seqs)
    if args.train_only:
        s1.update(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                  machine=reporting.machine_info(), stage2=s2)
        reporting.write_json(os.path.join(args.out, "stage1.json"), s1)
        print(f"stage 1: {args.steps} steps, {s1['tokens_seen']} tokens, {s1['wall_s']:.1f} s; "
              f"wrote {args.out}/maps.safetensors and stage1.json")
        return 0
    report = dict(settings=vars(args), model=dict(source=source, student=student.cfg.describe()), stage1=s1,
                  stage2=s2, machine=reporting.machine_info())
    prog = reporting.Progress(os.path.join(args.out, "progress.json"),
                              reporting.fingerprint(vars(args), ignore=PROGRESS_IGNORES), args.resume)
    report["resumed"] = prog.resumed
    report["held_out"] = prog.get("held_out") or prog.put("held_out", held_out(
        teacher, tv, student, sv, tok, args, stage1_sv=sv1))
    report["icl"] = icl(teacher, tv, student, sv, tok, args, prog, stage1_sv=sv1)
    report["gains"] = gains(report["icl"], args)
    report["pooled_gain"] = pooled_gain(report["icl"], args)
    report["timing"] = timing(student, sv, args)
    report["wall_s"] = time.perf_counter() - t0
    reporting.publish(args.out, "linearize", report, tables(report), figure, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
