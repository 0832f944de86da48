"""How much of a prompt survives as kernel-approximated bias terms in a softmax LM (issue 4, item 2).

For each task (word-pair tasks, SST-2, TREC, AG News) and demo count k, ONE k-shot class-balanced
demonstration prompt is built (``linicl.data.build_eval_set(..., same_demos=True)``: every test query
gets the same k demos) and stored in the model by ``linicl.iclca.convert_approx``; the converted model
then reads each test query alone (its positions continue at the prompt's length n). Compared methods:

* ``zero``: the plain model on the query alone (the k=0 prompt; no demonstrations);
* ``prompt``: the plain model on demos + query (the prompted model, the reference);
* conversion variants of ``convert_approx``: ``taylor2``, ``prf`` (``--n-features`` positive random
  features), ``elu+1`` (shared normaliser, no sinks); ``lsq-<kernel>`` (least-squares fit of (B, b)
  on ``--fit-queries`` OTHER queries of the task's demo pool, never the test queries, all of one token
  length so that no padding enters the fit); ``<kernel>+sinks<s>`` (the first s prompt tokens kept as
  exact keys); ``<kernel>-mix<lam>`` (the lambda-mix normaliser);
* selections (``--select-scores``, ``--select-keeps``): ``<score>@<keep>`` keeps, besides the first
  ``--select-sinks`` and last ``--select-window`` prompt tokens, the exact keys and values the score
  chooses from the whole prompt (``iclca.convert_approx(keep=...)``, ``kernel="none"``, the rest
  dropped) in that share of the prompt's KV floats; ``recent@<keep>`` is the sliding window (with
  sinks) of the same floats, the baseline a selection must beat. The test queries are never seen by
  a score: one kept set serves them all.

Measured per (task, k, method), on the same ``--n-eval`` seeded test queries:

* accuracy with its 95 % Wilson interval, scored as ``linicl.evaluate`` does: label-restricted argmax
  over the label words' single tokens (classification); for open-ended word tasks
  ``open_metric="first_content_token"``: the gold answer's blank prefix (if the tokenizer spells
  " 5" as [" ", "5"]) is appended to every row the query is read in (zero-shot, prompted and
  converted-model rows alike) and the argmax over the whole vocabulary at the new last position must
  be the answer's first content token; the distinct predictions, and a mark for a constant predictor;
* agreement of the prediction with the prompted model's;
* KL(prompted || method) of the next-token distribution at the query's last token, over the label
  words (renormalised; for open-ended tasks over the set of first tokens of the evaluated gold answers)
  and over the full vocabulary;
* per-layer relative error of the attention output (site ``blocks.{l}.attn.hook_z``, every head,
  before the output projection) against the prompted model at the query tokens:
  ||z_method - z_prompt|| / ||z_prompt|| per query over all its tokens (and at its last token only),
  averaged over queries;
* the fraction of the few-shot gain recovered, (acc_method - acc_zero) / (acc_prompt - acc_zero), with
  its bootstrap interval (``linicl.stats.recovered``), only where the few-shot gain is significantly positive;
  whether a method collapsed (significantly below zero-shot, ``linicl.stats.collapsed``); and whether
  the issue's target holds (see ``recovery``).

BOS: ``--bos auto`` (add_bos=None) follows the tokenizer's convention (SmolLM2: none), ``on``/``off``
force it; the JSON records the effective choice.

The paper's synthetic test (iclca.md section 7): ``--synthetic-pairs`` random prompt/input pairs,
copy/induction style: a prompt of ``--synthetic-prompt`` uniform random tokens, then an input that
repeats its first ``--synthetic-input`` tokens. Per method, against the prompted model on the input's
positions: relative error of the logits, KL, argmax agreement, and the copy accuracy (next token =
the prompt's next token) with its NLL.

Compilation: every forward pass is padded to a length bucket (``linicl.batching.bucket_length``) and
a fixed batch (``--batch-size``), so a method compiles once per bucket; the query-only passes of the
converted models share one width per (task, k).

The variants (``linicl.approx.variants``), the evaluation of a (task, k) cell
(``linicl.approx.evaluation``), the synthetic test (``linicl.fidelity.copy_test``), the recovered
share of the gain (``linicl.recovery``) and the tables and figures (``linicl.approx.report``) are the
library's; this script loads the model, resumes finished tasks and writes the report.

Writes ``OUT/approx_conversion.json`` (every number, the settings, wall times) and
``OUT/accuracy.png``, ``OUT/kl.png``, ``OUT/layer_error.png``, ``OUT/synthetic.png``; prints tables.

    python experiments/approx_conversion.py --quick              # CI-sized
    python experiments/approx_conversion.py --n-eval 16          # SmolLM2, default tasks, k 1 4 8 (~1 h, 2 CPUs)
    python experiments/approx_conversion.py --model path/to/gpt2 # an HF GPT-2/Llama dir or a .gguf
"""

from __future__ import annotations

import os
import sys
import time

from tqdm.auto import tqdm

import linicl.lm
from linicl import data, recovery, reporting, selection
from linicl.approx import converters, correctness, evaluate_task, layer_error_summary, selection_specs, variant_specs
from linicl.approx.report import layer_error_figure, per_task_figure, synthetic_figure, tables
from linicl.compiled import enable_persistent_cache
from linicl.errors import LiniclError
from linicl.fidelity import copy_test
from linicl.names import SELECTION_SCORES

DEFAULT_TASKS = ("present-past", "capitalize", "singular-plural", "sst2", "trec", "agnews")
QUICK_TASKS = ("antonym", "sst2")
BOS_FLAG = {"auto": None, "on": True, "off": False}  # --bos -> add_bos (None: the tokenizer's convention)
# settings that change no number: a resumed run may differ in these
PROGRESS_IGNORES = ("out", "progress", "resume", "data_dir")


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(
        p, out="results/approx_conversion", seed="queries, demos, random features, synthetic prompts", data_dir=True,
        quick=f"CI: tasks {' '.join(QUICK_TASKS)}, 4 queries, k 1, 4 synthetic pairs of 16 + 4 tokens")
    p.add_argument("--model", default=None, help="smollm2, gemma3, or a checkpoint (HF directory or .gguf); default smollm2")
    p.add_argument("--tasks", nargs="+", default=None, help=f"task names (default {' '.join(DEFAULT_TASKS)})")
    p.add_argument("--k", nargs="+", type=int, default=None, help="demonstrations (default 1 4 8)")
    p.add_argument("--n-eval", type=int, default=None, help="test queries per task (default 32)")
    p.add_argument("--kernels", nargs="*", default=["taylor2", "prf", "elu+1"], help="plain kernel variants")
    p.add_argument("--lsq-kernels", nargs="*", default=["prf"],
                   help="least-squares variants (taylor2's 4161 features per head make its fit slow)")
    p.add_argument("--extra-kernel", default="taylor2", help="kernel of the sinks and mix variants")
    p.add_argument("--sinks", type=int, default=4, help="exact sink tokens of the sinks variant (0: none)")
    p.add_argument("--mix", type=float, default=0.5, help="lambda of the mix variant (negative: none)")
    p.add_argument("--select-scores", nargs="*", default=[], choices=list(SELECTION_SCORES),
                   help="selections of the prompt's exact keys and values (convert_approx(keep=...), kernel 'none'): "
                        "these scores at every --select-keeps budget, named '<score>@<keep>' (default none)")
    p.add_argument("--select-keeps", nargs="+", type=float, default=[0.1, 0.25],
                   help="selection budgets: shares of the prompt's KV floats")
    p.add_argument("--select-sinks", type=reporting.nonnegative_int, default=2,
                   help="first prompt tokens every selection keeps (short prompts: few)")
    p.add_argument("--select-window", type=reporting.nonnegative_int, default=4,
                   help="last prompt tokens every selection keeps")
    p.add_argument("--n-features", type=int, default=256, help="random features of the prf kernel")
    p.add_argument("--ridge", type=float, default=1e-6, help="ridge of the least-squares fit")
    p.add_argument("--fit-queries", type=int, default=16, help="demo-pool queries of the least-squares fit")
    p.add_argument("--synthetic-pairs", type=int, default=None, help="random prompt/input pairs (default 100; 0: skip)")
    p.add_argument("--synthetic-prompt", type=int, default=24, help="random prompt length")
    p.add_argument("--synthetic-input", type=int, default=6, help="input length (a copy of the prompt's start)")
    p.add_argument("--synthetic-batch", type=int, default=5,
                   help="prompts converted at once (Taylor-2 bias terms of SmolLM2: 290 MB per prompt)")
    p.add_argument("--synthetic-low", type=int, default=256, help="random tokens are drawn from [low, vocab)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bucket", default="geometric", help="length buckets: 'geometric' or a multiple, e.g. 32")
    p.add_argument("--max-len", type=int, default=2048, help="decode-cache size of rope models")
    p.add_argument("--bos", choices=list(BOS_FLAG), default="auto", help="prepend BOS (auto: as the "
                   "checkpoint's tokenizer says)")
    p.add_argument("--resume", action="store_true", help="reuse the tasks an earlier run with the same settings "
                   "finished (OUT/progress.json, written after every task)")
    args = p.parse_args(argv)
    if args.bucket != "geometric":
        args.bucket = int(args.bucket)
    if args.mix is not None and args.mix < 0:
        args.mix = None
    args.tasks = args.tasks or list(QUICK_TASKS if args.quick else DEFAULT_TASKS)
    args.k = args.k or ([1] if args.quick else [1, 4, 8])
    args.n_eval = args.n_eval or (4 if args.quick else 32)
    if args.synthetic_pairs is None:
        args.synthetic_pairs = 4 if args.quick else 100
    if args.quick:
        args.synthetic_prompt, args.synthetic_input = 16, 4
        args.fit_queries = min(args.fit_queries, 4)
    return args


def effective_bos(tok, add_bos) -> bool:
    """Whether prompts really start with BOS: the flag, or the tokenizer's own convention."""
    return bool(getattr(tok, "adds_bos", False)) if add_bos is None else bool(add_bos)


def one_task(model, variables, tok, name: str, args, methods, add_bos, bar) -> dict:
    """``evaluate_task`` on task ``name``: {"entry": its row (None when skipped), "skipped": [...]}."""
    t0 = time.perf_counter()
    try:
        entry, skip = evaluate_task(model, variables, tok, data.load_task(name, args.data_dir), methods, ks=args.k,
                                    n_eval=args.n_eval, seed=args.seed, add_bos=add_bos,
                                    fit_queries=args.fit_queries, batch_size=args.batch_size, bucket=args.bucket,
                                    bar=bar)
    except LiniclError as e:  # e.g. label words that are not single tokens for this tokenizer
        bar.update(len(args.k))
        return dict(entry=None, skipped=[dict(task=name, k=None, method="all", reason=str(e))])
    entry["wall_s"] = time.perf_counter() - t0
    return dict(entry=entry, skipped=skip)


def run(args) -> dict:
    t_start = time.perf_counter()
    source, model, variables, tok = linicl.lm.load(args.model, max_len=args.max_len, require_tokenizer=True)
    load_s = time.perf_counter() - t_start
    add_bos = BOS_FLAG[args.bos]
    if model.cfg.attention != "softmax":
        raise LiniclError("this experiment is about softmax models (a linear model's conversion is exact)")
    specs = variant_specs(args.kernels, args.lsq_kernels, extra_kernel=args.extra_kernel, sinks=args.sinks,
                          mix=args.mix)
    if args.select_scores:  # each selection runs its score on the prompt it converts
        specs.update(selection_specs(args.select_scores, args.select_keeps, sinks=args.select_sinks,
                                     window=args.select_window,
                                     instruction=tok.encode(selection.REPEAT_INSTRUCTION, add_bos=False)))
    methods = converters(model, variables, specs, n_features=args.n_features, ridge=args.ridge, seed=args.seed)
    tasks, skipped = {}, []
    prog = reporting.Progress(os.path.join(args.out, "progress.json"),
                              reporting.fingerprint(vars(args), ignore=PROGRESS_IGNORES), args.resume)
    bar = tqdm(total=len(args.tasks) * len(args.k), desc="approx conversion", disable=not args.progress)
    for name in args.tasks:
        done = prog.get(name)  # a task an earlier run with these settings finished
        if done is None:
            done = prog.put(name, one_task(model, variables, tok, name, args, methods, add_bos, bar))
        else:
            bar.update(len(args.k))
        if done["entry"] is not None:
            tasks[name] = done["entry"]
        skipped += done["skipped"]
    bar.close()
    # the tasks' numbers survive an interrupted synthetic test
    reporting.write_json(os.path.join(args.out, "approx_conversion.json"),
                         dict(experiment="approx_conversion", complete=False, settings=vars(args), tasks=tasks,
                              skipped=skipped))
    t0 = time.perf_counter()
    syn = prog.get("synthetic test")
    if syn is None and args.synthetic_pairs > 0:
        # the paper's synthetic copy test (linicl.fidelity.copy_test) of every variant
        syn = prog.put("synthetic test", copy_test(
            model, variables, methods, prompt_len=args.synthetic_prompt, input_len=args.synthetic_input,
            pairs=args.synthetic_pairs, low=min(args.synthetic_low, model.cfg.vocab_size // 4),
            batch=args.synthetic_batch, seed=args.seed, progress=args.progress))
    syn_s = time.perf_counter() - t0
    cfg = model.cfg
    report = dict(
        experiment="approx_conversion", complete=True, quick=args.quick, variants=list(specs),
        variant_settings={k: {a: b for a, b in v.items()} for k, v in specs.items()},
        model=dict(source=str(source), n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                   kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size, positions=cfg.positions,
                   dtype=cfg.dtype, describe=cfg.describe()),
        settings=dict({k: v for k, v in vars(args).items()}, add_bos=effective_bos(tok, add_bos),
                      data_dir=str(data.resolve_data_dir(args.data_dir))),
        machine=reporting.machine_info(),
        tasks=tasks, skipped=skipped, synthetic=syn)
    report["recovery"] = recovery.recovery(correctness(tasks), list(specs))
    report["layer_error_summary"] = layer_error_summary(tasks)
    report["timing"] = dict(load_s=load_s, tasks_s={t: e["wall_s"] for t, e in tasks.items()}, synthetic_s=syn_s,
                            total_s=time.perf_counter() - t_start)
    return report


def plots(report: dict, out: str) -> list:
    """Write accuracy.png, kl.png, layer_error.png and synthetic.png; the paths written."""
    paths = [reporting.plot(os.path.join(out, "accuracy.png"), per_task_figure, report, "accuracy", "accuracy"),
             reporting.plot(os.path.join(out, "kl.png"), per_task_figure, report, "kl_full_mean",
                            "KL(prompted || method), full vocab"),
             reporting.plot(os.path.join(out, "layer_error.png"), layer_error_figure, report),
             reporting.plot(os.path.join(out, "synthetic.png"), synthetic_figure, report)]
    return [p for p in paths if p is not None]


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    args = parse_args(argv)
    try:
        data.resolve_data_dir(args.data_dir)
        report = run(args)
    except LiniclError as e:
        print(f"approx_conversion: {e}", file=sys.stderr)
        return 2
    report["table"] = text = tables(report)
    reporting.write_json(os.path.join(args.out, "approx_conversion.json"), report)
    print(text)
    written = plots(report, args.out)
    t = report["timing"]
    print(f"\n{sum(len(e['k']) for e in report['tasks'].values())} (task, k) cells, {len(report['skipped'])} "
          f"skipped; total {t['total_s']:.0f} s (load {t['load_s']:.0f} s, synthetic {t['synthetic_s']:.0f} s); "
          f"wrote {args.out}/approx_conversion.json" + (" and the plots" if written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
