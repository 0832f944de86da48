"""Long prompts: what a finite state remembers that a sliding window of the same size cannot.

Every method reads the same prompts of an exact token length (``linicl.data.long_context``):

1. **passkey**: a 5-digit key at a uniform depth of natural filler text (AG News test split), asked
   for at the end; right when the greedy answer's first number is the key (``key_answered``).
   ``--filler classic`` uses the original test's five repeated sentences instead (``lc.classic_filler``),
   where the key line is the one novel thing in the prompt.
2. **key-value recall**: ``--pairs`` "The code for <word> is <4 digits>." lines spread through the
   filler, one asked for at the end (MQAR written in words); scored the same way.
3. **many-shot ICL**: k demonstrations (``--shots``, shared by every query) of word tasks, scored as
   ``linicl.evaluate`` does (exact match of the greedy answer).
4. **held-out next-token loss by position** on filler text of the longest length; with
   ``--select-scores`` also the loss of the ``--loss-tail`` tokens that follow a prefix of the longest
   length kept by each selection, against the whole prefix and the equal-float window
   (``approx.selected.prefix_loss``).

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
* ``<score>@<keep>`` (``--select-scores``, ``--select-keeps``): the softmax teacher's prompt converted
  with a selection of its exact keys and values (``iclca.convert_approx(keep=...)``, ``kernel="none"``):
  per global layer and KV head, the sinks, the last tokens and what a query-agnostic score chose from
  the whole context (``linicl.selection``; ``"recent"`` at the same budget is the sliding window of the
  same floats); the question is read alone after it. ``--select-keeps`` are shares of the context's
  full KV floats. Also reported per method: the share of the passkey line kept, and the selection's
  time against one prefill of the context.
* ``window<W>+oracle`` (``--oracle``, passkey only): a diagnostic, not a method: the softmax teacher
  restricted to its sinks, its last W (the student's window) tokens and the key line, as if a cache
  had kept exactly that line in every head. What selection could at best give at that state size.

For every finite-state method the evaluated prompts are also converted (``iclca.convert`` of all but
the question), and the question read alone must give the prompted model's answers (checked on every
prompt; the float32 logit error is reported). Accuracies come with 95 % Wilson intervals and paired
bootstrap differences against the equal-state window. The prompts are ``linicl.data.long_context``,
the methods and their state sizes ``linicl.linearize.baselines``, the scoring
``linicl.linearize.long_prompts``; this script runs the cells (resumable) and writes the tables.

    python experiments/long_context.py --quick                 # tiny fixture model, CI-sized
    python experiments/long_context.py                         # SmolLM2-135M, 0.5K-4K tokens
    python experiments/long_context.py --resume                # continue an interrupted run
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from tqdm.auto import tqdm

import linicl
from linicl import linearize, reporting, selection
from linicl.compiled import enable_persistent_cache
from linicl.data import long_context as lc
from linicl.linearize.baselines import EQUAL, RULE_NAMES, compared_methods, student_budget
from linicl.approx import selected
from linicl.linearize.long_prompts import oracle_window, score_method, versus_equal_window
from linicl.names import ALLOCATIONS, SELECTION_SCORES

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf", "llama-tiny.gguf")
# Settings a cell's key already names (probe, length, method), so that a run with more lengths, probes
# or methods resumes the cells an earlier one finished; everything else that changes a number stays in.
PROGRESS_IGNORES = ("out", "progress", "resume", "plots", "lengths", "probes", "methods", "caches", "windows",
                    "shots", "shot_tasks", "finished_only", "cache_rules", "window_caches", "oracle", "loss_len",
                    "loss_tail", "select_scores", "select_kernels", "select_keeps", "select_allocations",
                    "select_question")


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
    p.add_argument("--select-scores", nargs="+", default=[], choices=list(SELECTION_SCORES),
                   help="selection methods: scores of the teacher's prompt keys (default none)")
    p.add_argument("--select-keeps", nargs="+", type=float, default=[0.05, 0.1, 0.25],
                   help="selection budgets: shares of the context's full KV floats")
    p.add_argument("--select-allocations", nargs="+", default=[], choices=list(ALLOCATIONS),
                   help="also these allocations of the budget over heads (each score runs with its default: "
                        "'global' for attention scores, 'uniform' for recent and random)")
    p.add_argument("--select-question", action="store_true",
                   help=f"also '{selected.QUESTION}': SnapKV observing the real question, the query-aware reference "
                        "(not a conversion: it reads the query)")
    p.add_argument("--select-kernels", nargs="+", default=[], choices=["learned", "taylor2", "prf", "elu+1"],
                   help="also each selection with what a head does not keep stored as this kernel's terms, counted in "
                        "the budget ('learned': the student's maps, --maps); a budget that cannot hold them leaves it out")
    p.add_argument("--select-sinks", type=reporting.nonnegative_int, default=4, help="sinks every selection keeps")
    p.add_argument("--select-window", type=reporting.nonnegative_int, default=16,
                   help="last context tokens every selection keeps")
    p.add_argument("--methods", nargs="+", default=None,
                   help="evaluate only these methods (names as in the tables; default all)")
    p.add_argument("--filler", choices=["news", "classic"], default="news",
                   help="haystack of passkey and codes: 'news' (AG News text, every sentence novel) or 'classic' "
                        "(the original passkey test's five repeated sentences, the key line the one novel thing)")
    p.add_argument("--loss-seqs", type=reporting.positive_int, default=4)
    p.add_argument("--loss-len", type=reporting.positive_int, default=None,
                   help="tokens per held-out loss sequence (default: the longest --lengths)")
    p.add_argument("--loss-tail", type=reporting.positive_int, default=256,
                   help="with --select-scores: the held-out text after a prefix of the longest --lengths, whose "
                        "loss each selection of that prefix is scored by")
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
        args.select_scores = args.select_scores or ["reconstruction", "expected", "recent"]
        args.select_keeps, args.select_sinks, args.select_window = [0.5], 2, 4
        args.select_allocations = args.select_allocations or ["heads"]
        args.select_question, args.loss_tail = True, 16
        args.select_kernels = args.select_kernels or ["learned"]
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


def methods(teacher, tv, student, sv, args) -> dict:
    """``{name: (model, variables, finite)}`` in table order (``baselines.compared_methods``)."""
    try:
        return compared_methods(teacher, tv, student, sv, caches=args.caches, cache_rules=args.cache_rules,
                                windows=args.windows, window_caches=args.window_caches, only=args.methods)
    except ValueError as e:
        raise SystemExit(f"long_context: {e}")


def cell_prompts(probe: str, length, tok, filler, args) -> tuple:
    """A cell's ``(prompts, key)``: a keyed probe at ``length`` tokens (its seed drawn from ``--seed``
    and the length), or the many-shot cell ``"<task> k=<k>"`` (``length`` None)."""
    if length is None:
        task, k = probe.split(" k=")
        return lc.many_shot_prompts(tok, task, int(k), args.n, seed=args.seed, data_dir=args.data_dir), probe
    seed = int(np.random.SeedSequence([args.seed, length]).generate_state(1)[0])
    return lc.probe_prompts(probe, tok, filler, length, args.n, seed=seed, n_pairs=args.pairs), f"{probe} {length}"


def check_budgets(cfg, args) -> None:
    """Refuse a --select-keeps budget that cannot hold the sinks and window every selection keeps at
    one of --lengths, before any cell runs (a prompt's context is a little shorter than its length,
    so the check is at the length itself: the allocation refuses the borderline rest)."""
    if not args.select_scores:
        return
    heads, forced = len(cfg.global_layers) * cfg.kv_heads, args.select_sinks + args.select_window
    for length in args.lengths:
        for keep in args.select_keeps:
            if selection.token_budget(cfg, length, keep) < heads * forced:
                raise linicl.LiniclError(
                    f"--select-keeps {keep:g} holds fewer than {forced} tokens per KV head at {length} tokens, the "
                    f"--select-sinks + --select-window every selection keeps; raise it or lower those")


def select_scores(settings: dict) -> list:
    """The selection methods' scores as the tables name them: --select-scores, then the query-aware
    reference with --select-question."""
    return list(settings["select_scores"]) + ([selected.QUESTION] if settings.get("select_question") else [])


def budgets(args) -> str:
    """The budgets and kept ends of every selection, as a progress key names them."""
    return f"keep {','.join(f'{k:g}' for k in args.select_keeps)} sinks {args.select_sinks} window {args.select_window}"


def select_cell(key: str, prompts, teacher, tv, tok, prog, args, sv=None) -> dict:
    """The selection methods on one keyed cell: one record per prompt (resumable), then a row per
    ``<score>@<keep>``."""
    setting = f"select {','.join(select_scores(vars(args)))} {budgets(args)}" + \
              (f" allocations {','.join(args.select_allocations)}" if args.select_allocations else "") + \
              (f" kernels {','.join(args.select_kernels)}" if args.select_kernels else "")
    kernels = {k: dict(kernel=k, maps=sv) if k == "learned" else dict(kernel=k) for k in args.select_kernels}
    instruction = tok.encode(selection.REPEAT_INSTRUCTION, add_bos=False)
    records = []
    for i, p in enumerate(tqdm(prompts, disable=not args.progress, desc=f"{key} selection", leave=False)):
        name = f"{key} | {setting} | prompt {i}"
        done = prog.get(name)
        if done is None and args.finished_only:
            return {}  # an unfinished cell: reported as '-'
        if done is None:
            done = prog.put(name, selected.select_prompt(
                teacher, tv, p, tok, scores=args.select_scores, keeps=args.select_keeps, sinks=args.select_sinks,
                window=args.select_window, instruction=instruction, seed=args.seed,
                span=lc.key_line(p) if key.startswith("passkey") else None, allocations=args.select_allocations,
                question_aware=args.select_question, kernels=kernels))
        records.append(done)
    return selected.selected_rows(records, prompts, keyed=True)


def read_filler(tok, longest: int, args):
    """The --filler stream, more than ``longest`` tokens long."""
    if args.filler == "classic":
        return lc.classic_filler(tok, min_tokens=longest + 1)
    return lc.filler_stream(tok, seed=args.seed, min_tokens=longest + 1, data_dir=args.data_dir)


def select_loss(rows, teacher, tv, tok, prog, args) -> dict:
    """The selection methods on held-out text: each row's prefix (all but its last --loss-tail tokens)
    selected, the loss of what follows (one record per text, resumable); ``selected.loss_rows``."""
    prefix = rows.shape[1] - args.loss_tail
    setting = f"loss-select {prefix}+{args.loss_tail} | {','.join(args.select_scores)} {budgets(args)}"
    instruction = tok.encode(selection.REPEAT_INSTRUCTION, add_bos=False)
    records = []
    for i, row in enumerate(tqdm(rows, disable=not args.progress, desc="loss selection", leave=False)):
        done = prog.get(f"{setting} | text {i}")
        if done is None and args.finished_only:
            return {}
        records.append(done or prog.put(f"{setting} | text {i}", selected.prefix_loss(
            teacher, tv, row, prefix, scores=args.select_scores, keeps=args.select_keeps, sinks=args.select_sinks,
            window=args.select_window, instruction=instruction, seed=args.seed)))
    return dict(prefix=prefix, tail=args.loss_tail, methods=selected.loss_rows(records))


# ------------------------------------------------------------------------------------ tables
def tables(report: dict) -> str:
    methods = [m for m in report["methods"] if "@" not in m]  # the selections have a table of their own
    filler = report["settings"].get("filler", "news")
    lines = [f"Long prompts ({os.path.basename(str(report['model']))}, {filler} filler); accuracy % [95 % Wilson], n per cell "
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
    if any("selection" in c for c in cells.values()):
        settings = report["settings"]
        lines += ["", selected.selection_table(cells, select_scores(settings), settings["select_keeps"],
                                              settings.get("select_allocations", []),
                                              settings.get("select_kernels", []))]
    sizes = report.get("state_floats", {})
    if sizes:
        lines += ["", "State floats per prompt row at the longest prompt evaluated (students: as stored; windows: the KV of "
                      "their sinks and window; softmax: its KV cache): "
                  + ", ".join(f"{m} {sizes[m]:,}" for m in methods if m in sizes)]
        if "student" in sizes and report.get("student_budget") not in (None, sizes["student"]):
            lines += ["", f"The student must keep {report['student_budget']:,} of its floats: its local layers also "
                          f"store an empty linear part (a zero state and feature slots per query head), which a "
                          f"window need not keep; the equal-state window matches the rest."]
    conv = [(key, m, r["converted"]) for key, c in cells.items() for m, r in c["methods"].items() if "converted" in r]
    if conv:
        worst = max(x["max_rel_err"] for _, _, x in conv)
        equal = sum(x["answers_equal"] for _, _, x in conv), sum(x["of"] for _, _, x in conv)
        lines += ["", f"Converted = prompted: {equal[0]} of {equal[1]} answers equal; worst float32 relative "
                      f"logit error {worst:.1e} (target 1e-4)."]
    chosen = report.get("loss_selection")
    if chosen:
        lines += ["", selected.loss_table(chosen["methods"], chosen["prefix"], chosen["tail"])]
    loss = report.get("loss")
    if loss:
        buckets = list(next(iter(loss.values()))["by_position"])
        lines += ["", "Held-out next-token loss (nats) by position:", "",
                  reporting.markdown_table(["method"] + buckets,
                                           [[m] + [f"{loss[m]['by_position'][b]:.3f}" for b in buckets] for m in loss])]
    return "\n".join(lines)


def figure(plt, report: dict):
    probes = sorted({c["probe"] for c in report["cells"].values()})
    chosen = [c for c in report["cells"].values() if "selection" in c]
    cols = max(1, len(probes), len(chosen))
    fig, grid = plt.subplots(2 if chosen else 1, cols, squeeze=False, figsize=(4 * cols, 3.6 * (2 if chosen else 1)))
    axes = grid[0]
    if chosen:
        settings = report["settings"]
        selected.plot_budgets(grid[1], report["cells"], select_scores(settings), settings["select_keeps"],
                              settings.get("select_allocations", []), settings.get("select_kernels", []))
    for ax, probe in zip(axes, probes):
        cs = sorted((c for c in report["cells"].values() if c["probe"] == probe), key=lambda c: c["tokens"])
        for m in (m for m in report["methods"] if "@" not in m):
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
    check_budgets(teacher.cfg, args)
    longest = max(args.lengths + [args.loss_len or 0])
    filler = read_filler(tok, longest, args)
    ms = methods(teacher, tv, student, sv, args)
    # The news filler was the only one before --filler: runs made then resume under it.
    settings = {k: v for k, v in vars(args).items() if not (k == "filler" and v == "news")}
    prog = reporting.Progress(os.path.join(args.out, "progress.json"),
                              reporting.fingerprint(settings, ignore=PROGRESS_IGNORES), args.resume)
    todo = [(probe, L) for probe in ("passkey", "kv") if probe in args.probes for L in args.lengths]
    todo += [(f"{t} k={k}", None) for t in args.shot_tasks for k in args.shots if "shots" in args.probes]
    bar = tqdm(total=len(todo) * len(ms), disable=not args.progress, desc="cells")
    cells = {}
    for probe, L in todo:
        prompts, key = cell_prompts(probe, L, tok, filler, args)
        cells[key] = dict(probe=probe.split(" ")[0] if L else probe, tokens=int(max(map(len, prompts))), methods={})
        for name, (model, variables, finite) in ms.items():
            done = prog.get(f"{key} | {name}")
            if done is None and args.finished_only:
                bar.update()
                continue
            if done is None:
                done = prog.put(f"{key} | {name}", score_method(
                    name, model, variables, prompts, tok, finite=finite, keyed=L is not None, max_new=8,
                    batch_size=args.batch_size, convert_check=args.convert_check))
            cells[key]["methods"][name] = done
            bar.update()
        if args.select_scores and probe in ("passkey", "kv"):
            chosen = select_cell(key, prompts, teacher, tv, tok, prog, args, sv)
            if chosen:
                cells[key]["selection"] = chosen
                cells[key]["methods"].update(chosen)
        if args.oracle and probe == "passkey":
            name = f"window{student.cfg.window}+oracle"
            done = prog.get(f"{key} | {name}")
            if done is None and not args.finished_only:
                done = prog.put(f"{key} | {name}", oracle_window(name, teacher, tv, prompts, tok,
                                                                 window=student.cfg.window, sinks=student.cfg.sinks))
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
    report["vs_equal_window"] = versus_equal_window(cells, list(ms))
    if "loss" in args.probes:  # --loss-seqs windows of the filler, --loss-len (default the longest) long
        rows = lc.filler_windows(filler, args.loss_seqs, args.loss_len or max(args.lengths), seed=[args.seed, 7])
        report["loss"] = {}
        for name, (model, variables, _) in ms.items():
            key = f"loss {rows.shape[1]} | {name}"  # the rows' length: a longer run is another cell
            got = prog.get(key)
            if got is None and args.finished_only:
                continue
            got = got or prog.put(key, linearize.next_token_loss(
                model, variables, rows, batch_size=1, buckets=(0, 64, 256, 512, 1024, 2048, 4096)))
            report["loss"][name] = {k: v for k, v in got.items() if k != "per_position"}
        if args.select_scores:  # the text after a selected prefix of the longest length
            length = max(args.lengths) + args.loss_tail  # a stream of its own: the probes' prompts stay as they were
            texts = lc.filler_windows(read_filler(tok, length, args), args.loss_seqs, length, seed=[args.seed, 8])
            chosen = select_loss(texts, teacher, tv, tok, prog, args)
            if chosen:
                report["loss_selection"] = chosen
    report["wall_s"] = time.perf_counter() - t0
    reporting.publish(args.out, "long_context", report, tables(report), figure, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
