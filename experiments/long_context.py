"""Long prompts: what a finite state remembers that a sliding window of the same size cannot.

Every method reads the same prompts of an exact token length (``linicl.data.long_context``):

1. **passkey**: a 5-digit key at a uniform depth of natural filler text (AG News test split), asked
   for at the end; right when the greedy answer's first number is the key (``key_answered``).
2. **key-value recall**: ``--pairs`` "The code for <word> is <4 digits>." lines spread through the
   filler, one asked for at the end (MQAR written in words); scored the same way.
3. **many-shot ICL**: k demonstrations (``--shots``, shared by every query) of word tasks, scored as
   ``linicl.evaluate`` does (exact match of the greedy answer).
4. **held-out next-token loss by position** on filler text of the longest length.

Methods (``--methods``), each with the floats its state holds for one prompt row:

* ``softmax``: the teacher, full KV cache (grows with the prompt);
* ``student``: the linearized teacher (shipped maps: hedgehog + window + sinks; ``--maps``);
* ``student+cache<C>``: the same maps with LoLA's sparse cache of C exact tokens (no training);
  ``student+attcache<C>``: the cache chosen by the attention each token got in the window
  (``--cache-rules attention``; ``ModelConfig.cache_rule``);
* ``window<W>``: sliding-window softmax with the student's sinks and no linear part, no training
  (``linearize.window_config``), at the student's window and at the window whose KV cache holds as
  many floats as the student's state (``equal``; with local layers, their windows counted per kv head,
  ``student_budget``);
* ``window<W>+attcache<C>`` (``--window-caches C``): a window plus a per-head cache of C tokens that
  left it, chosen by the attention they got while in it, W such that the whole state holds no more
  floats than the student's (no linear part, no training).
* ``window<W>+oracle`` (``--oracle``, passkey only): a diagnostic, not a method: the softmax teacher
  restricted to its sinks, its last W (the student's window) tokens and the key line, as if a cache
  had kept exactly that line in every head. What selection could at best give at that state size.

For every finite-state method the evaluated prompts are also converted (``iclca.convert`` of all but
the question), and the question read alone must give the prompted model's answers (checked on every
prompt; the float32 logit error is reported). Accuracies come with 95 % Wilson intervals and paired
bootstrap differences against the equal-state window.

    python experiments/long_context.py --quick                 # tiny fixture model, CI-sized
    python experiments/long_context.py                         # SmolLM2-135M, 0.5K-4K tokens
    python experiments/long_context.py --resume                # continue an interrupted run
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import linicl
from linicl import data, iclca, linearize, reporting, stats
from linicl import interventions as iv
from linicl.compiled import enable_persistent_cache
from linicl.data import long_context as lc
from linicl.evaluate import evaluate_prompts, greedy_answers
from linicl.memory import kv_cache_floats
from linicl.metrics import rel_err

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf", "llama-tiny.gguf")
# Settings a cell's key already names (probe, length, method), so that a run with more lengths, probes
# or methods resumes the cells an earlier one finished; everything else that changes a number stays in.
PROGRESS_IGNORES = ("out", "progress", "resume", "plots", "lengths", "probes", "methods", "caches", "windows",
                    "shots", "shot_tasks", "finished_only", "cache_rules", "window_caches", "oracle", "loss_len")
RULE_NAMES = {"recall": "cache", "attention": "attcache"}  # method-name part of each cache rule
EQUAL = "equal"  # --windows: the window whose KV cache matches the student's state


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/long_context", quick="tiny fixture model, one length, 2 prompts a cell",
                              seed="seeds the prompts (keys, depths, filler, demonstrations)", data_dir=True,
                              plots=True)
    p.add_argument("--model", default=None, help="teacher: smollm2, gemma3, an HF directory or .gguf (default smollm2)")
    p.add_argument("--maps", default=None, help="student maps (default: the shipped SmolLM2 maps)")
    p.add_argument("--lengths", nargs="+", type=reporting.positive_int, default=[512, 1024, 2048, 4096],
                   help="prompt lengths in tokens")
    p.add_argument("--n", type=reporting.positive_int, default=24, help="prompts per (probe, length) cell")
    p.add_argument("--probes", nargs="+", default=["passkey", "kv", "shots", "loss"],
                   choices=["passkey", "kv", "shots", "loss"])
    p.add_argument("--pairs", type=reporting.positive_int, default=8, help="key-value lines per prompt")
    p.add_argument("--shots", nargs="+", type=reporting.positive_int, default=[128], help="demonstrations k")
    p.add_argument("--shot-tasks", nargs="+", default=["country-capital", "present-past"])
    p.add_argument("--caches", nargs="+", type=reporting.nonnegative_int, default=[64],
                   help="sparse-cache sizes of the student+cache methods (0: none)")
    p.add_argument("--cache-rules", nargs="+", choices=list(RULE_NAMES), default=["recall"],
                   help="the rules of the student+cache methods (ModelConfig.cache_rule)")
    p.add_argument("--window-caches", nargs="+", type=reporting.positive_int, default=[],
                   help="window + attention-chosen cache baselines at the student's state size: cache sizes")
    p.add_argument("--oracle", action="store_true",
                   help="passkey: also the diagnostic window<W>+oracle (sinks, window and the key line exact)")
    p.add_argument("--windows", nargs="+", default=["student", EQUAL],
                   help="window-only baselines: 'student' (its window), 'equal' (its state size) or a number")
    p.add_argument("--methods", nargs="+", default=None,
                   help="evaluate only these methods (names as in the tables; default all)")
    p.add_argument("--loss-seqs", type=reporting.positive_int, default=4)
    p.add_argument("--loss-len", type=reporting.positive_int, default=None,
                   help="tokens per held-out loss sequence (default: the longest --lengths)")
    p.add_argument("--batch-size", type=reporting.positive_int, default=4)
    p.add_argument("--convert-check", type=reporting.nonnegative_int, default=None, metavar="N",
                   help="convert the first N prompts of each cell and check converted = prompted (default: every "
                        "prompt; 0: none)")
    p.add_argument("--resume", action="store_true", help="reuse the cells OUT/progress.json holds")
    p.add_argument("--finished-only", action="store_true",
                   help="with --resume: report the finished cells and compute none (a partial run's tables; "
                        "missing cells show as '-')")
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or FIXTURE
        args.lengths, args.n, args.pairs, args.shots, args.loss_seqs = [288], 2, 2, [2], 1
        args.shot_tasks, args.caches, args.cache_rules, args.window_caches = ["antonym"], [4], list(RULE_NAMES), [2]
        args.oracle = True
        args.convert_check = 1 if args.convert_check is None else args.convert_check
    return args


# ------------------------------------------------------------------------------------ the methods
def load_models(args):
    """``(teacher, tv, tokenizer, student, sv)``: the teacher and its linearized student."""
    max_len = max(args.lengths) + 64
    loaded = linicl.lm.load(args.model, max_len=max_len, require_tokenizer=True)
    teacher, tv = loaded.model, loaded.variables
    if args.maps or not args.quick:
        student, sv, _ = linearize.load_maps(args.maps or linearize.SMOLLM2_MAPS, teacher, tv)
    else:  # the fixture has no trained maps: identity maps, which is all the quick run checks
        student = linicl.Transformer(linearize.student_config(teacher.cfg, window=4, sinks=1))
        sv = linearize.student_variables(student, tv, seed=args.seed)
    return teacher, tv, loaded.tokenizer, student, sv


def student_budget(student) -> int:
    """The floats the student must keep of a prompt: its state as stored, except that its local layers'
    exact windows count once per kv head, as a window baseline's KV does (they are softmax windows,
    which grouped-query heads share; the zoo stores them per query head: benchmarks/decode_memory.py)."""
    cfg = student.cfg
    local = [l for l in range(cfg.n_layers) if l not in cfg.global_layers]
    shared = 2 * cfg.kv_heads * cfg.head_dim * max(cfg.sliding_window - 1, 0)
    return iclca.state_floats(cfg) - sum(iclca.state_floats(cfg.single_layer(l)) - shared for l in local)


def equal_window(student, teacher) -> int:
    """The largest window W whose KV cache (its W - 1 earlier tokens and the student's sinks, a key and
    a value per kv head and layer; a local layer's at most its own window) holds no more floats than
    the student must keep (``student_budget``); at least 1."""
    return _largest_window(student, teacher, cache=0) or 1


def equal_cached_window(student, teacher, cache: int) -> Optional[int]:
    """The largest window W whose window + attention-chosen cache of ``cache`` tokens (``window_floats``)
    holds no more floats than the student must keep; None if even W = 1 does not fit."""
    return _largest_window(student, teacher, cache)


def _largest_window(student, teacher, cache: int) -> Optional[int]:
    """Binary search for the largest W with ``window_floats`` of the window baseline (the student's
    sinks, ``cache``) <= ``student_budget``; None if W = 1 does not fit. Every token of the window
    costs at least one layer's key and value, so W - 1 <= budget / (2 kv_heads d_head) bounds it."""
    budget = student_budget(student)
    fits = lambda w: window_floats(linearize.window_config(  # noqa: E731
        teacher.cfg, window=w, sinks=student.cfg.sinks, cache=cache)) <= budget
    if not fits(1):
        return None
    lo, hi = 1, budget // (2 * teacher.cfg.kv_heads * teacher.cfg.head_dim) + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def window_floats(cfg) -> int:
    """What a window baseline (its config ``cfg``) must keep of a prompt: the KV of its sinks and last
    ``window - 1`` tokens, per kv head (its buffers are per query head, which a grouped-query window
    need not be); with a cache, per global layer and query head (each chooses its own tokens) each
    cached key, value and score, and the window's scores."""
    per_head = cfg.cache * (2 * cfg.head_dim + 1) + max(cfg.window - 1, 0) if cfg.cache else 0
    return kv_cache_floats(cfg, cfg.window - 1 + cfg.sinks) + len(cfg.global_layers) * cfg.n_heads * per_head


def methods(teacher, tv, student, sv, args) -> dict:
    """``{name: (model, variables, finite)}`` in table order."""
    out = {"softmax": (teacher, tv, False), "student": (student, sv, True)}
    for c in args.caches:
        for rule in args.cache_rules if c else ():
            out[f"student+{RULE_NAMES[rule]}{c}"] = (
                linicl.Transformer(student.cfg.replace(cache=c, cache_rule=rule)), sv, True)
    for w in args.windows:
        w = student.cfg.window if w == "student" else (equal_window(student, teacher)
                                                       if w == EQUAL else int(w))
        cfg = linearize.window_config(teacher.cfg, window=w, sinks=student.cfg.sinks)
        model = linicl.Transformer(cfg)
        out[f"window{w}"] = (model, linearize.student_variables(model, tv), True)
    for c in args.window_caches:
        w = equal_cached_window(student, teacher, c)
        if w is None:
            raise SystemExit(f"long_context: --window-caches {c}: a cache of {c} tokens alone holds more "
                             f"floats than the student's state")
        model = linicl.Transformer(linearize.window_config(teacher.cfg, window=w, sinks=student.cfg.sinks, cache=c))
        out[f"window{w}+attcache{c}"] = (model, linearize.student_variables(model, tv), True)
    if args.methods:
        unknown = sorted(set(args.methods) - set(out))
        if unknown:
            raise SystemExit(f"long_context: unknown --methods {unknown}; these exist: {list(out)}")
        out = {k: v for k, v in out.items() if k in args.methods}
    return out


# ------------------------------------------------------------------------------------ the probes
def prompts_for(probe: str, length: int, tok, filler, args) -> list:
    seed = [args.seed, length]
    if probe == "passkey":
        return lc.passkey_prompts(tok, filler, length, args.n, seed=int(np.random.SeedSequence(seed).generate_state(1)[0]))
    if probe == "kv":
        return lc.kv_recall_prompts(tok, filler, length, args.n, n_pairs=args.pairs,
                                    seed=int(np.random.SeedSequence(seed).generate_state(1)[0]))
    raise ValueError(probe)


def converted_check(model, variables, prompts, predictions, tok, max_new: int) -> dict:
    """Convert each prompt's context (all but the question) and read the question alone: its greedy
    answer must equal the prompted model's (``predictions``), and its logits the prompted model's at
    the question (the float32 relative error is reported)."""
    same, errs = 0, []
    for p, want in zip(prompts, predictions):
        ctx, query = jnp.asarray(p.tokens[:p.query_start])[None], p.tokens[p.query_start:]
        conv = iclca.convert(model, variables, ctx)
        ref = model.apply(variables, jnp.asarray(p.tokens)[None])[:, p.query_start:]
        errs.append(float(rel_err(model.apply(conv, jnp.asarray(query)[None]), ref)))
        got = greedy_answers(model, conv, tok, [query], max_new=max_new, common=dict(batch_size=1, progress=False))
        same += int(got[0] == want)
    return dict(answers_equal=same, of=len(prompts), max_rel_err=max(errs))


def scored_row(name, correct, predictions, prompts, t0: float) -> dict:
    """A cell's record of one method: per-prompt correctness and answers, accuracy with its Wilson
    interval, the time since ``t0`` and the prompts' length."""
    correct = np.asarray(correct)
    return dict(method=name, correct=correct.astype(int).tolist(), predictions=list(predictions),
                accuracy=float(correct.mean()), wilson=list(stats.wilson(int(correct.sum()), len(correct))),
                n=len(correct), eval_s=time.perf_counter() - t0, tokens=int(len(prompts[0])))


def cell(name, model, variables, finite, prompts, tok, args, max_new: int, keyed: bool) -> dict:
    """One method on one cell's prompts: accuracy (``keyed``: by ``long_context.key_answered``, else
    exact match as ``linicl.evaluate`` scores), its state's floats, and the converted = prompted check."""
    t0 = time.perf_counter()
    res = evaluate_prompts(model, variables, tok, prompts, label_prefix=" ", max_new_tokens=max_new,
                           batch_size=args.batch_size, progress=False)
    correct = res.correct
    if keyed:  # passkey / key-value: the answer's first number must be the key
        correct = np.asarray([lc.key_answered(a, p.label) for a, p in zip(res.predictions, prompts)])
    row = scored_row(name, correct, res.predictions, prompts, t0)
    if finite:
        row["state_floats"] = (window_floats(model.cfg) if model.cfg.feature_map == "none"
                               else iclca.state_floats(model.cfg))
        checked = len(prompts) if args.convert_check is None else min(args.convert_check, len(prompts))
        if checked:
            row["converted"] = converted_check(model, variables, prompts[:checked], res.predictions[:checked],
                                               tok, max_new)
    else:
        row["state_floats"] = kv_cache_floats(model.cfg, len(prompts[0]))
    return row


def key_line(prompt) -> tuple:
    """``(start, end)`` of a passkey prompt's key line: its last run of instruction tokens (with the
    key at depth 0 the run includes the opening instruction, a few more tokens kept)."""
    where = np.flatnonzero(np.asarray(prompt.roles) == data.INSTRUCTION)
    start = where[np.flatnonzero(np.diff(where) > 1)[-1] + 1] if (np.diff(where) > 1).any() else where[0]
    return int(start), int(where[-1]) + 1


def oracle_cell(name, teacher, tv, prompts, tok, args, window: int, sinks: int) -> dict:
    """The teacher with every layer's attention limited to the sinks, the last ``window`` tokens and
    the key line (an ``hook_attn_scores`` edit per prompt): an upper bound for a cache of that line."""
    def keep(x, span, ctx):
        q_pos, k_pos = ctx["q_pos"][:, None], ctx["k_pos"][None, :]
        ok = (k_pos < sinks) | (q_pos - k_pos < window) | ((k_pos >= span[0]) & (k_pos < span[1]))
        return jnp.where(ok, x, -jnp.inf)

    t0, correct, predictions, kept = time.perf_counter(), [], [], []
    for p in prompts:
        span = key_line(p)
        edits = [iv.apply_fn(f"blocks.{layer}.attn.hook_attn_scores", keep, jnp.asarray(span))
                 for layer in range(teacher.cfg.n_layers)]
        res = evaluate_prompts(teacher, iv.with_edits(tv, edits, teacher.cfg), tok, [p], label_prefix=" ",
                               max_new_tokens=8, batch_size=1, progress=False)
        predictions.append(res.predictions[0])
        correct.append(lc.key_answered(res.predictions[0], p.label))
        kept.append(span[1] - span[0])
    return dict(scored_row(name, correct, predictions, prompts, t0),
                state_floats=kv_cache_floats(teacher.cfg, window - 1 + sinks + max(kept)))


def shot_prompts(task_name: str, k: int, tok, args) -> list:
    task = data.load_task(task_name, args.data_dir)
    return data.build_eval_set(task, tok, k=k, seed=args.seed, n_eval=args.n, same_demos=True)


def loss_rows(tok, filler, args) -> np.ndarray:
    """``--loss-seqs`` windows of the filler stream, each ``--loss-len`` (default the longest length) long."""
    T = args.loss_len or max(args.lengths)
    starts = np.random.default_rng([args.seed, 7]).integers(0, len(filler) - T, args.loss_seqs)
    return np.stack([filler[s:s + T] for s in starts])


# ------------------------------------------------------------------------------------ tables
def tables(report: dict) -> str:
    methods = report["methods"]
    lines = [f"Long prompts ({os.path.basename(str(report['model']))}); accuracy % [95 % Wilson], n per cell "
             "(passkey and codes: the greedy answer's first number is the key; word tasks: exact match).", ""]
    cells = report["cells"]
    header = ["probe", "tokens"] + methods
    rows = []
    for key in sorted(cells, key=lambda k: (cells[k]["probe"], cells[k]["tokens"])):
        c = cells[key]
        rows.append([c["probe"], c["tokens"]] + [
            f"{100 * c['methods'][m]['accuracy']:.0f} [{100 * c['methods'][m]['wilson'][1]:.0f}, "
            f"{100 * c['methods'][m]['wilson'][2]:.0f}] n={c['methods'][m]['n']}" if m in c["methods"] else "-"
            for m in methods])
    lines.append(reporting.markdown_table(header, rows))
    sizes = report.get("state_floats", {})
    if sizes:
        lines += ["", "State floats per prompt row at the longest prompt evaluated (students: as stored; windows: the KV of "
                      "their sinks and window; softmax: its KV cache): "
                  + ", ".join(f"{m} {sizes[m]:,}" for m in methods if m in sizes)]
        if report.get("student_budget") not in (None, sizes.get("student")):
            lines += ["", f"The student must keep {report['student_budget']:,} of its floats: its local layers' exact "
                          f"windows are stored per query head but need one copy per kv head, as the windows' KV is "
                          f"counted; the equal-state window matches that."]
    conv = [(key, m, r["converted"]) for key, c in cells.items() for m, r in c["methods"].items() if "converted" in r]
    if conv:
        worst = max(x["max_rel_err"] for _, _, x in conv)
        equal = sum(x["answers_equal"] for _, _, x in conv), sum(x["of"] for _, _, x in conv)
        lines += ["", f"Converted = prompted: {equal[0]} of {equal[1]} answers equal; worst float32 relative "
                      f"logit error {worst:.1e} (target 1e-4)."]
    loss = report.get("loss")
    if loss:
        buckets = list(next(iter(loss.values()))["by_position"])
        lines += ["", "Held-out next-token loss (nats) by position:", "",
                  reporting.markdown_table(["method"] + buckets,
                                           [[m] + [f"{loss[m]['by_position'][b]:.3f}" for b in buckets] for m in loss])]
    return "\n".join(lines)


def figure(plt, report: dict):
    probes = sorted({c["probe"] for c in report["cells"].values()})
    fig, axes = plt.subplots(1, max(1, len(probes)), squeeze=False, figsize=(4 * max(1, len(probes)), 3.6))
    axes = axes[0]
    for ax, probe in zip(axes, probes):
        cs = sorted((c for c in report["cells"].values() if c["probe"] == probe), key=lambda c: c["tokens"])
        for m in report["methods"]:
            pts = [(c["tokens"], c["methods"][m]) for c in cs if m in c["methods"]]
            if pts:
                x = [t for t, _ in pts]
                ax.plot(x, [r["accuracy"] for _, r in pts], "o-", label=m)
                ax.fill_between(x, [r["wilson"][1] for _, r in pts], [r["wilson"][2] for _, r in pts], alpha=0.12)
        ax.set(xscale="log", xlabel="prompt tokens", ylabel="accuracy (95 % Wilson)", title=probe, ylim=(-0.02, 1.02))
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    enable_persistent_cache()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    teacher, tv, tok, student, sv = load_models(args)
    longest = max(args.lengths + [args.loss_len or 0])
    filler = lc.filler_stream(tok, seed=args.seed, min_tokens=longest + 1, data_dir=args.data_dir)
    ms = methods(teacher, tv, student, sv, args)
    prog = reporting.Progress(os.path.join(args.out, "progress.json"),
                              reporting.fingerprint(vars(args), ignore=PROGRESS_IGNORES), args.resume)
    todo = [(probe, L) for probe in ("passkey", "kv") if probe in args.probes for L in args.lengths]
    todo += [(f"{t} k={k}", None) for t in args.shot_tasks for k in args.shots if "shots" in args.probes]
    bar = tqdm(total=len(todo) * len(ms), disable=not args.progress, desc="cells")
    cells = {}
    for probe, L in todo:
        if L is not None:
            prompts, max_new, key = prompts_for(probe, L, tok, filler, args), 8, f"{probe} {L}"
        else:
            task, k = probe.split(" k=")
            prompts, max_new, key = shot_prompts(task, int(k), tok, args), None, probe
        cells[key] = dict(probe=probe.split(" ")[0] if L else probe, tokens=int(max(map(len, prompts))), methods={})
        for name, (model, variables, finite) in ms.items():
            done = prog.get(f"{key} | {name}")
            if done is None and args.finished_only:
                bar.update()
                continue
            if done is None:
                done = prog.put(f"{key} | {name}", cell(name, model, variables, finite, prompts, tok, args,
                                                         max_new or 8, keyed=L is not None))
            cells[key]["methods"][name] = done
            bar.update()
        if args.oracle and probe == "passkey":
            name = f"window{student.cfg.window}+oracle"
            done = prog.get(f"{key} | {name}")
            if done is None and not args.finished_only:
                done = prog.put(f"{key} | {name}", oracle_cell(name, teacher, tv, prompts, tok, args,
                                                               student.cfg.window, student.cfg.sinks))
            if done is not None:
                cells[key]["methods"][name] = done
    bar.close()
    listed = list(ms) + [m for c in cells.values() for m in c["methods"] if m not in ms]
    report = dict(settings=vars(args), model=args.model or "SmolLM2-135M-Instruct",
                  methods=list(dict.fromkeys(listed)), cells=cells,
                  machine=reporting.machine_info(), resumed=prog.resumed)
    # each method's state at the longest prompt it was evaluated on (later cells override earlier ones)
    report["state_floats"] = {m: r["state_floats"] for c in sorted(cells.values(), key=lambda c: c["tokens"])
                              for m, r in c["methods"].items()}
    report["student_budget"] = student_budget(student)
    report["vs_equal_window"] = versus(cells, ms)
    if "loss" in args.probes:
        rows = loss_rows(tok, filler, args)
        report["loss"] = {}
        for name, (model, variables, _) in ms.items():
            key = f"loss {rows.shape[1]} | {name}"  # the rows' length: a longer run is another cell
            got = prog.get(key)
            if got is None and args.finished_only:
                continue
            got = got or prog.put(key, linearize.next_token_loss(
                model, variables, rows, batch_size=1, buckets=(0, 64, 256, 512, 1024, 2048, 4096)))
            report["loss"][name] = {k: v for k, v in got.items() if k != "per_position"}
    report["wall_s"] = time.perf_counter() - t0
    reporting.publish(args.out, "long_context", report, tables(report), figure, args.plots)
    return 0


def versus(cells: dict, ms: dict) -> dict:
    """Each method minus the equal-state window (largest window baseline), paired over the same prompts."""
    windows = [m for m in ms if m.startswith("window") and m[len("window"):].isdigit()]
    if not windows:
        return {}
    ref = max(windows, key=lambda m: int(m[len("window"):]))
    out = {}
    for key, c in cells.items():
        if ref not in c["methods"]:
            continue
        base = c["methods"][ref]["correct"]
        out[key] = {m: list(stats.paired_bootstrap(r["correct"], base)) for m, r in c["methods"].items() if m != ref}
    return dict(reference=ref, differences=out)


if __name__ == "__main__":
    sys.exit(main())
