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
  exact keys); ``<kernel>-mix<lam>`` (the lambda-mix normaliser).

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

Writes ``OUT/approx_conversion.json`` (every number, the settings, wall times) and
``OUT/accuracy.png``, ``OUT/kl.png``, ``OUT/layer_error.png``, ``OUT/synthetic.png``; prints tables.

    python experiments/approx_conversion.py --quick              # CI-sized
    python experiments/approx_conversion.py --n-eval 16          # SmolLM2, default tasks, k 1 4 8 (~1 h, 2 CPUs)
    python experiments/approx_conversion.py --model path/to/gpt2 # an HF GPT-2/Llama dir or a .gguf
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from linicl.compiled import enable_persistent_cache
import linicl.lm
from linicl import activations, batching, data, iclca, reporting, stats
from linicl.errors import LiniclError
from linicl.evaluate import first_content_targets
from linicl.fidelity import copy_test, method_scores, predict
from linicl.memory import prompt_floats
from linicl.names import PROMPT_APPROX, block_site
from linicl import recovery as recovery_lib

DEFAULT_TASKS = ("present-past", "capitalize", "singular-plural", "sst2", "trec", "agnews")
QUICK_TASKS = ("antonym", "sst2")
BASE = ("zero", "prompt")
BOS_FLAG = {"auto": None, "on": True, "off": False}  # --bos -> add_bos (None: the tokenizer's convention)
CONSTANT_MARK = "(const)"


# ------------------------------------------------------------------------------------------ variants
def variant_specs(args) -> dict:
    """``{name: convert_approx keyword arguments}`` (plus ``fit: True`` for the least-squares ones)."""
    specs = {}
    for kernel in args.kernels:
        specs[kernel] = dict(kernel=kernel)
    for kernel in args.lsq_kernels:
        specs[f"lsq-{kernel}"] = dict(kernel=kernel, fit=True)
    if args.sinks > 0:
        specs[f"{args.extra_kernel}+sinks{args.sinks}"] = dict(kernel=args.extra_kernel, sinks=args.sinks)
    if args.mix is not None:
        specs[f"{args.extra_kernel}-mix{args.mix:g}"] = dict(kernel=args.extra_kernel, form="mix", lam=args.mix)
    return specs


def convert(model, variables, prompt: np.ndarray, spec: dict, args, fit_inputs=None) -> dict:
    """``iclca.convert_approx`` of a prompt ``[n]`` (or a batch of prompts ``[b, n]``, each serving the
    query row of the same index) with one variant's settings."""
    prompt = np.asarray(prompt)
    prompt = prompt if prompt.ndim == 2 else prompt[None]
    kw = {k: v for k, v in spec.items() if k != "fit"}
    if "sinks" in kw:
        kw["sinks"] = min(kw["sinks"], prompt.shape[1])
    if spec.get("fit"):
        if fit_inputs is None:
            raise LiniclError("no fit inputs")
        kw["fit_inputs"] = jnp.asarray(fit_inputs, jnp.int32)
    return iclca.convert_approx(model, variables, jnp.asarray(prompt, jnp.int32), n_features=args.n_features,
                                seed=args.seed, ridge=args.ridge, **kw)


# ------------------------------------------------------------------------------------------ forward
def run_rows(model, variables, rows: list, start: int, width: int, args) -> tuple[np.ndarray, np.ndarray]:
    """Token rows -> (log-probs [N, vocab] at each row's last token, attention outputs z [L, N, width, H*d]
    from position ``start`` on; ``linicl.activations.logprobs_and_window``)."""
    names = [block_site(layer, "hook_z") for layer in range(model.cfg.n_layers)]
    return activations.logprobs_and_window(model, variables, rows, names, start, width, batch_size=args.batch_size,
                                           bucket=args.bucket)


# ------------------------------------------------------------------------------------------ tasks
def with_blanks(prompts, blanks) -> list:
    """Each prompt's tokens followed by its gold answer's blank prefix."""
    return [np.concatenate([p.tokens, b]) for p, b in zip(prompts, blanks)]


def run_task(model, variables, tok, task, args, specs, add_bos, bar) -> tuple[dict, list]:
    template = data.template_for(task)
    label_ids = (None if task.labels is None
                 else data.check_label_words(task.labels, tok, prefix=template.label_prefix))
    zero_prompts = data.build_eval_set(task, tok, k=0, seed=args.seed, n_eval=args.n_eval, add_bos=add_bos)
    n_bos = zero_prompts[0].query_start
    if label_ids is None:
        rows, gold_ids = first_content_targets(tok, zero_prompts, [p.label for p in zero_prompts],
                                               template.label_prefix)
        blanks = [r[len(p.tokens):] for r, p in zip(rows, zero_prompts)]  # the answers' blank prefixes
        cand = np.unique(gold_ids)
        kl_ids = cand if len(cand) >= 2 else None
    else:
        gold_ids = label_ids[np.asarray([task.labels.index(p.label) for p in zero_prompts])]
        blanks = [np.zeros(0, np.int32)] * len(zero_prompts)
        kl_ids = label_ids
    # every row a query is read in ends with its gold answer's blank prefix (usually none)
    queries = [np.concatenate([p.tokens[p.query_start:], b]) for p, b in zip(zero_prompts, blanks)]
    qlens = np.asarray([len(q) for q in queries], np.int32)
    W = batching.bucket_length(int(qlens.max()), "geometric")
    entry = dict(metric="first_content_token" if label_ids is None else "label",
                 labels=None if task.labels is None else list(task.labels), n=len(queries),
                 query_len=dict(min=int(qlens.min()), max=int(qlens.max()), mean=float(qlens.mean())),
                 width=W, kl_label_set=None if kl_ids is None else [int(i) for i in kl_ids],
                 gold_ids=gold_ids.tolist(), k={})
    skipped = []
    t0 = time.perf_counter()
    lp0, z0 = run_rows(model, variables, with_blanks(zero_prompts, blanks), n_bos, W, args)
    entry["zero_eval_s"] = time.perf_counter() - t0
    for k in args.k:
        bar.set_postfix_str(f"{task.name} k={k}")
        cell: dict = {"methods": {}, "timing": {}}
        t_cell = time.perf_counter()
        try:
            prompts = data.build_eval_set(task, tok, k=k, seed=args.seed, n_eval=args.n_eval, same_demos=True,
                                          add_bos=add_bos)
            n, ctx, q_k = data.shared_context(prompts)
            q_k = [np.concatenate([q, b]) for q, b in zip(q_k, blanks)]
            if any(not np.array_equal(a, b) for a, b in zip(q_k, queries)):
                raise LiniclError("the query tokens differ between the zero-shot and the k-shot prompts")
            if model.cfg.positions == "learned" and n + W > model.cfg.max_len:
                raise LiniclError(f"prompt ({n}) + query width ({W}) exceed the learned positions "
                                  f"(max_len={model.cfg.max_len})")
            t0 = time.perf_counter()
            lp_p, z_p = run_rows(model, variables, with_blanks(prompts, blanks), n, W, args)
            cell["timing"]["prompt_eval_s"] = time.perf_counter() - t0
        except LiniclError as e:
            skipped.append(dict(task=task.name, k=k, method="all", reason=str(e)))
            bar.update(1)
            continue
        pred_p = predict(lp_p, label_ids)
        ref = dict(lp=lp_p, z=z_p, pred=pred_p)
        cell.update(prompt_len=int(n), demos=[dict(input=d.input, output=d.output) for d in prompts[0].demos],
                    kv_cache_floats=int(2 * model.cfg.n_layers * model.cfg.kv_heads * model.cfg.head_dim * n))
        cell["methods"]["prompt"] = method_scores(lp_p, z_p, None, gold_ids, label_ids, kl_ids, qlens)
        cell["methods"]["zero"] = method_scores(lp0, z0, ref, gold_ids, label_ids, kl_ids, qlens)
        fit = None
        if any(s.get("fit") for s in specs.values()):
            fit = data.fit_queries(task, tok, template, set(prompts[0].demos), args.fit_queries,
                              int(np.median(qlens)), args.seed)
            cell["fit_inputs_shape"] = None if fit is None else list(fit.shape)
        for i, (name, spec) in enumerate(specs.items()):
            bar.set_postfix_str(f"{task.name} k={k}: {name} ({i + 1}/{len(specs)})")
            try:
                t0 = time.perf_counter()
                conv = convert(model, variables, ctx, spec, args, fit)
                jax.block_until_ready(conv[PROMPT_APPROX])
                t1 = time.perf_counter()
                lp, z = run_rows(model, conv, queries, 0, W, args)
                t2 = time.perf_counter()
            except LiniclError as e:
                skipped.append(dict(task=task.name, k=k, method=name, reason=str(e)))
                continue
            m = method_scores(lp, z, ref, gold_ids, label_ids, kl_ids, qlens)
            # the seeded random projections are not counted: they are re-drawn from the seed
            m.update(convert_s=t1 - t0, eval_s=t2 - t1, state_floats=prompt_floats(conv, projections=False))
            cell["methods"][name] = m
            del conv, z
        del ref, z_p
        entry["k"][str(k)] = cell
        if args.progress:
            tqdm.write(f"{task.name} k={k} n={n}: " + ", ".join(
                f"{m} {r['accuracy']:.2f}" for m, r in cell["methods"].items())
                + f" ({time.perf_counter() - t_cell:.0f} s)", file=sys.stderr)
        cell["timing"]["cell_s"] = time.perf_counter() - t_cell
        bar.update(1)
    return entry, skipped


# ------------------------------------------------------------------------------------------ recovery
def recovery(tasks: dict, variants: list) -> dict:
    """``linicl.recovery.recovery`` of every evaluated (task, k) cell's per-query correctness."""
    return recovery_lib.recovery({name: {k: {m: np.asarray(r["correct"], float) for m, r in cell["methods"].items()}
                                         for k, cell in e["k"].items()} for name, e in tasks.items()}, variants)


# ------------------------------------------------------------------------------------------ synthetic
def synthetic(model, variables, specs: dict, args, progress: bool) -> dict:
    """The paper's synthetic copy test (``linicl.fidelity.copy_test``) of every variant."""
    def converter(spec):
        return lambda prompts, fit: convert(model, variables, prompts, spec, args, fit)
    methods = {name: (converter(spec), bool(spec.get("fit"))) for name, spec in specs.items()}
    return copy_test(model, variables, methods, prompt_len=args.synthetic_prompt, input_len=args.synthetic_input,
                     pairs=args.synthetic_pairs, low=min(args.synthetic_low, model.cfg.vocab_size // 4),
                     batch=args.synthetic_batch, seed=args.seed, progress=progress)


# ------------------------------------------------------------------------------------------ output
def _fmt(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _cells(report: dict):
    """Every (task, k, task entry, cell) of the report, in order."""
    return [(t, k, e, cell) for t, e in report["tasks"].items() for k, cell in e["k"].items()]


def fmt_acc(r: dict) -> str:
    """``"62.5 [45.1, 77.3]"`` (percent, Wilson), marked for a constant predictor."""
    text = stats.Interval(r["accuracy"], r["ci_low"], r["ci_high"]).fmt()
    return f"{text} {CONSTANT_MARK}" if r.get("constant") else text


def fmt_iv(d, scale: float = 100.0, digits: int = 1, empty: str = "-") -> str:
    return empty if d is None else stats.Interval(d["value"], d["low"], d["high"]).fmt(scale, digits)


def fmt_recovered(p: dict, v: str) -> str:
    """The recovered share of the gain with its interval; 'n.s.' where the gain is not significant,
    'collapsed' appended where the variant is significantly below zero-shot."""
    if v not in p["variant_acc"]:
        return "-"
    text = "n.s." if not p["significant"] else fmt_iv(p["fraction"][v], 1.0, 2)
    return text + (" collapsed" if p["collapsed"].get(v) else "")


def best_line(rec: dict) -> str:
    """The best variant and its count of tasks, or that there is none (every variant at 0) or a tie."""
    best, tied = rec["best_variant"], rec.get("tied_variants", [])
    if best is not None:
        return f"best variant {best}: {len(rec['passing'][best])} of {rec['tasks']} tasks"
    if not tied:
        return "no variants"
    passing = len(rec["passing"][tied[0]])
    if passing == 0:
        return f"no best variant: every variant recovers half the gain on 0 of {rec['tasks']} tasks"
    return f"no single best variant: {', '.join(tied)} tie at {passing} of {rec['tasks']} tasks"


def tables(report: dict) -> str:
    methods, rest, variants = list(BASE) + report["variants"], ["zero"] + report["variants"], report["variants"]
    table = reporting.markdown_table
    acc = table(["task", "k", "n"] + methods, [
        [t, k, e["n"]] + [fmt_acc(c["methods"][m]) if m in c["methods"] else "-" for m in methods]
        for t, k, e, c in _cells(report)])
    rec = report["recovery"]
    diff = table(["task", "k"] + rest, [
        [c["task"], c["k"]] + [fmt_iv(c["vs_prompt"].get(v)) for v in rest]
        for c in rec["per_task_k"].values()])
    kl = table(["task", "k"] + rest, [
        [t, k] + [f"{_fmt(c['methods'][m]['kl_full_mean'], '.3g')} / {_fmt(c['methods'][m]['kl_label_mean'], '.3g')}"
                  if m in c["methods"] else "-" for m in rest]
        for t, k, e, c in _cells(report)])
    err = table(["method", "first layer", "middle", "last layer", "mean over layers"], [
        [m] + [_fmt(x, ".3f") for x in (curve[0], curve[len(curve) // 2], curve[-1], float(np.mean(curve)))]
        for m, curve in report["layer_error_summary"].items()])
    gain = table(["task", "zero", "prompt", "gain"] + variants, [
        [t, _fmt(100 * p["zero"], ".1f"), _fmt(100 * p["prompt"], ".1f"),
         fmt_iv(p["gain"]) + ("" if p["significant"] else " (n.s.)")] + [fmt_recovered(p, v) for v in variants]
        for t, p in rec["per_task_pooled"].items()])
    lines = ["Accuracy in % with 95 % Wilson intervals (label-restricted for classification, first content "
             f"token for word tasks; {CONSTANT_MARK}: the same prediction for every query):", "", acc,
             "", "Method minus prompted model, accuracy points on the same queries (paired bootstrap 95 %):", "",
             diff,
             "", "Mean KL(prompted || method), full vocabulary / label words, at the query's last token:", "", kl,
             "", "hook_z relative error vs the prompted model (mean over queries, tasks and k), by layer:", "", err,
             "", "Share of the few-shot gain recovered, with its 95 % bootstrap interval (every (query, k) of a "
                 "task one pair; 'n.s.': the few-shot gain is not significant, so no share is defined; "
                 "'collapsed': significantly below zero-shot):", "", gain,
             f"\nTarget (best variant recovers >= half the gain on >= half the tasks): "
             f"{'MET' if rec['target_met'] else 'NOT MET'} ({best_line(rec)}, "
             f"{rec['tasks_with_gain']} with a significant gain, {rec['needed']} needed)"]
    syn = report.get("synthetic")
    if syn and syn["methods"]:
        s = syn["settings"]
        lines += ["", f"Synthetic copy test: {s['pairs']} random prompts of {s['prompt_len']} tokens, input = "
                      f"their first {s['input_len']}:", "",
                  table(["method", "logit rel. err (median)", "KL (mean)", "argmax agrees", "copy acc", "copy NLL"], [
                      [m, _fmt(r["logit_rel_err_median"], ".3f"), _fmt(r["kl_mean"], ".3g"), _fmt(r["argmax_agree"]),
                       _fmt(r["copy_acc"]), _fmt(r["copy_nll"], ".2f")] for m, r in syn["methods"].items()])]
    return "\n".join(lines)


def layer_error_summary(report: dict) -> dict:
    curves: dict = {}
    for e in report["tasks"].values():
        for cell in e["k"].values():
            for m, r in cell["methods"].items():
                if "layer_rel_err" in r:
                    curves.setdefault(m, []).append(r["layer_rel_err"])
    return {m: np.mean(np.asarray(c), 0).tolist() for m, c in curves.items()}


def _colors(report: dict) -> dict:
    return {m: f"C{i}" for i, m in enumerate(list(BASE) + report["variants"])}


def per_task_figure(plt, report: dict, what: str, ylabel: str):
    """``what`` (a method metric) against k, one panel per task, one line per method."""
    names = [t for t, e in report["tasks"].items() if e["k"]]
    colors = _colors(report)
    ncols = min(3, max(1, len(names)))
    nrows = max(1, -(-len(names) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.9 * nrows), squeeze=False)
    for ax, t in zip(axes.flat, names):
        cells = report["tasks"][t]["k"]
        ks = list(cells)
        for m in colors:
            ys = [cells[k]["methods"].get(m, {}).get(what, np.nan) for k in ks]
            if what == "kl_full_mean" and m == "prompt":
                continue
            ax.plot(range(len(ks)), [np.nan if y is None else y for y in ys], "o-" if m not in BASE else "s--",
                    color=colors[m], label=m, lw=2.2 if m in BASE else 1.2, ms=4)
        ax.set_xticks(range(len(ks)), ks)
        ax.set_title(f"{t} ({report['tasks'][t]['metric']})", fontsize=9)
        ax.set_xlabel("k (demonstrations)", fontsize=8)
        if what == "accuracy":
            ax.set_ylim(-0.03, 1.03)
        else:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=7)
    fig.suptitle(f"{Path(report['model']['source']).name}: {ylabel} per task and k, n={report['settings']['n_eval']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def layer_error_figure(plt, report: dict):
    """The hook_z relative error by layer: over every task and k, then at each k."""
    colors = _colors(report)
    ks = report["settings"]["k"]
    fig, axes = plt.subplots(1, len(ks) + 1, figsize=(3.8 * (len(ks) + 1), 3.2), squeeze=False)
    for ax, k in zip(axes[0], [None] + list(ks)):
        curves: dict = {}
        for e in report["tasks"].values():
            cell = e["k"].get(str(k)) if k is not None else None
            cells = [cell] if cell else (list(e["k"].values()) if k is None else [])
            for c in cells:
                for m, r in c["methods"].items():
                    if "layer_rel_err" in r:
                        curves.setdefault(m, []).append(r["layer_rel_err"])
        for m, cs in curves.items():
            ax.plot(np.mean(np.asarray(cs), 0), "s--" if m in BASE else "o-", color=colors[m], label=m, ms=3)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title("all tasks and k" if k is None else f"k = {k}", fontsize=9)
        ax.set_ylabel("rel. error of hook_z vs prompted", fontsize=8)
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    return fig


def synthetic_figure(plt, report: dict):
    """The synthetic copy test: logit error, argmax agreement and copy accuracy per method."""
    colors = _colors(report)
    syn = report.get("synthetic") or {}
    ms = syn.get("methods") or {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    labels = list(ms)
    for ax, (key, title) in zip(axes, (("logit_rel_err_median", "logit rel. error (median)"),
                                       ("argmax_agree", "argmax agrees with prompted"),
                                       ("copy_acc", "copy accuracy"))):
        ax.bar(range(len(labels)), [ms[m][key] for m in labels], color=[colors.get(m, "0.5") for m in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    if syn:
        fig.suptitle(f"synthetic copy test: {syn['settings']['pairs']} random prompts of "
                     f"{syn['settings']['prompt_len']} tokens", fontsize=10)
    fig.tight_layout()
    return fig


def plots(report: dict, out: str) -> list:
    """Write accuracy.png, kl.png, layer_error.png and synthetic.png; the paths written."""
    paths = [reporting.plot(os.path.join(out, "accuracy.png"), per_task_figure, report, "accuracy", "accuracy"),
             reporting.plot(os.path.join(out, "kl.png"), per_task_figure, report, "kl_full_mean",
                            "KL(prompted || method), full vocab"),
             reporting.plot(os.path.join(out, "layer_error.png"), layer_error_figure, report),
             reporting.plot(os.path.join(out, "synthetic.png"), synthetic_figure, report)]
    return [p for p in paths if p is not None]


# ------------------------------------------------------------------------------------------ main
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


# settings that change no number: a resumed run may differ in these
PROGRESS_IGNORES = ("out", "progress", "resume", "data_dir")


def one_task(model, variables, tok, name: str, args, specs, add_bos, bar) -> dict:
    """``run_task`` on task ``name``: {"entry": its row (None when skipped), "skipped": [...]}."""
    t0 = time.perf_counter()
    try:
        entry, skip = run_task(model, variables, tok, data.load_task(name, args.data_dir), args, specs, add_bos, bar)
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
    specs = variant_specs(args)
    tasks, skipped = {}, []
    prog = reporting.Progress(os.path.join(args.out, "progress.json"),
                              reporting.fingerprint(vars(args), ignore=PROGRESS_IGNORES), args.resume)
    bar = tqdm(total=len(args.tasks) * len(args.k), desc="approx conversion", disable=not args.progress)
    for name in args.tasks:
        done = prog.get(name)  # a task an earlier run with these settings finished
        if done is None:
            done = prog.put(name, one_task(model, variables, tok, name, args, specs, add_bos, bar))
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
        syn = prog.put("synthetic test", synthetic(model, variables, specs, args, args.progress))
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
    report["recovery"] = recovery(tasks, list(specs))
    report["layer_error_summary"] = layer_error_summary(report)
    report["timing"] = dict(load_s=load_s, tasks_s={t: e["wall_s"] for t, e in tasks.items()}, synthetic_s=syn_s,
                            total_s=time.perf_counter() - t_start)
    return report


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
