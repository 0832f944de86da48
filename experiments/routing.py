"""In-Context Routing on a real LM: PIDs and a router trained once on in-domain tasks, evaluated
zero-shot on in-domain and out-of-domain tasks (routing.md, a reduced version of the paper's setup).

Steps:
1. PIDs: last-token q/k of class-balanced few-shot prompts of the in-domain (ID) tasks (training
   splits), PCA per routed layer (the last third), rank ``--rank``.
2. Router: trained on zero-shot queries of the ID tasks' training splits (the paper's objective).
3. Evaluation on the test splits of ID tasks and of out-of-domain (OOD) tasks never used in 1-2:
   zero-shot, few-shot, ICR, ICR with a random orthogonal basis (the paper's control), and a task
   vector (few-shot minus zero-shot mean last-token residual at the middle layer, added at the query's
   last token; built from each task's own training split).

Reported: accuracy per task and method, ID and OOD averages, collapses (tasks where a method scores
below zero-shot), timings. Writes ``OUT/routing.json`` and ``OUT/routing.png``; PIDs and router to OUT.

    python experiments/routing.py --quick           # minutes on 2 CPU cores (CI)
    python experiments/routing.py                    # the documented full run
    python experiments/routing.py --model DIR        # an HF GPT-2/Llama checkpoint instead of SmolLM2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ID_TASKS = ("sst2", "trec", "agnews", "commonsense_qa", "antonym")
OOD_TASKS = ("cb", "sentiment", "country-capital", "singular-plural")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a checkpoint path (HF dir or .gguf)")
    p.add_argument("--data-dir", default=None, help="data directory (default: $LINICL_DATA_DIR)")
    p.add_argument("--id-tasks", default=",".join(ID_TASKS))
    p.add_argument("--ood-tasks", default=",".join(OOD_TASKS))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--pid-prompts", type=int, default=48, help="few-shot prompts per ID task for the PIDs")
    p.add_argument("--pid-shots", type=int, default=1, help="demos per class in a PID prompt")
    p.add_argument("--train", type=int, default=192, help="zero-shot training queries per ID task")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-eval", type=int, default=100, help="test queries per task")
    p.add_argument("--shots", type=int, default=4, help="demos in the few-shot baseline prompts")
    p.add_argument("--tv-prompts", type=int, default=32, help="prompts per task for the task vector")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes for CI")
    p.add_argument("--out", default="results/routing")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.id_tasks, args.ood_tasks = "sst2", "cb"
        args.pid_prompts, args.train, args.epochs, args.n_eval, args.tv_prompts = 8, 16, 1, 8, 4
        args.shots = 2
    return args


def load_model(name: str):
    import linicl
    if name == "smollm2":
        return linicl.lm.smollm2(max_len=1024)
    return linicl.lm.from_pretrained(name)


def zero_shot_prompts(task, tokenizer, n: int, seed: int, split: str = "train"):
    """Zero-shot prompts of ``n`` seeded examples of a split, with their answers."""
    from linicl.data import build_prompt, template_for
    pool = getattr(task, split)
    idx = np.random.default_rng([seed, 7]).permutation(len(pool))[:n]
    template = template_for(task)
    return [build_prompt(template, (), pool[i], tokenizer) for i in idx], template


def few_shot_prompts(task, tokenizer, n: int, k: int, seed: int):
    """``n`` few-shot prompts whose queries come from the training split (never the test split)."""
    from linicl.data import build_prompt, sample_demos, template_for
    template = template_for(task)
    idx = np.random.default_rng([seed, 8]).permutation(len(task.train))[:n]
    out = []
    for j, i in enumerate(idx):
        demos = [d for d in sample_demos(task, k + 1, [seed, 9, j]) if d != task.train[i]][:k]
        out.append(build_prompt(template, demos, task.train[i], tokenizer))
    return out


def build_pids(model, variables, tokenizer, tasks, args):
    from linicl import routing
    prompts = []
    for task in tasks:
        k = args.pid_shots * (len(task.labels) if task.labels else 2)
        prompts += few_shot_prompts(task, tokenizer, args.pid_prompts, k, args.seed)
    meta = {"tasks": [t.name for t in tasks], "prompts_per_task": args.pid_prompts,
            "demos_per_class": args.pid_shots, "seed": args.seed}
    return routing.extract_pids(model, variables, prompts, r=args.rank, meta=meta,
                                progress=not args.no_progress)


def random_pids(pids, seed: int):
    """The control: random orthonormal bases of the same shapes (Gaussian + QR)."""
    import dataclasses
    rng = np.random.default_rng(seed)
    rand = lambda U: np.stack([np.linalg.qr(rng.normal(size=u.shape))[0] for u in U])  # noqa: E731
    return dataclasses.replace(pids, U_q=rand(pids.U_q), U_k=rand(pids.U_k), meta={**pids.meta, "random": True})


def train(model, variables, tokenizer, tasks, pids, args):
    from linicl import routing
    prompts, answers = [], []
    for task in tasks:
        ps, template = zero_shot_prompts(task, tokenizer, args.train, args.seed)
        prompts += ps
        answers += [tokenizer.encode(template.label_prefix + p.label)[0] for p in ps]
    data = routing.prepare(model, variables, prompts, answers, pids, progress=not args.no_progress)
    return routing.train_router(model, variables, pids, data, epochs=args.epochs, batch_size=args.batch,
                                lr=args.lr, seed=args.seed, progress=not args.no_progress)


def evaluate_task(model, variables, tokenizer, task, methods: dict, args) -> dict:
    from linicl import routing
    from linicl.evaluate import evaluate
    common = dict(seed=args.seed, n_eval=args.n_eval, progress=False)
    row = {}
    zs = evaluate(model, variables, tokenizer, task, k=0, **common)
    row["zero-shot"] = zs.accuracy
    row["few-shot"] = evaluate(model, variables, tokenizer, task, k=args.shots, **common).accuracy
    for name, (pids, router, params) in methods.items():
        forward = forward_for(model, pids, router)
        row[name] = evaluate(model, {**variables, "router": params}, tokenizer, task, k=0, forward=forward,
                             **common).accuracy
    layer = model.cfg.n_layers // 2
    fs = few_shot_prompts(task, tokenizer, args.tv_prompts, args.shots, args.seed + 1)
    zs_train, _ = zero_shot_prompts(task, tokenizer, args.tv_prompts, args.seed + 1)
    vector = routing.task_vector(model, variables, fs, zs_train, layer)
    n = min(args.n_eval, len(task.test))
    row["task-vector"] = evaluate(model, variables, tokenizer, task, k=0, edits=edits_for(layer),
                                  extras=np.tile(vector.astype(np.float32), (n, 1)), **common).accuracy
    row["n"] = zs.n
    row["metric"] = zs.metric
    return row


_FORWARDS: dict = {}
_EDITS: dict = {}


def forward_for(model, pids, router):
    """One forward function per (PIDs, router) so the harness compiles it once."""
    from linicl import routing
    key = (id(pids), router)
    if key not in _FORWARDS:
        _FORWARDS[key] = routing.icr_forward(model, pids, router)
    return _FORWARDS[key]


def edits_for(layer):
    """Add each row's vector (``extras``: [batch, d_model]) after ``layer`` at its last token; one
    function per layer, so every task reuses the compiled forward."""
    from linicl import interventions as I
    if layer not in _EDITS:
        def edits(tokens, lengths, vectors):
            return [I.add(f"blocks.{layer}.hook_resid_post", vectors[:, None, :],
                          positions=I.at_last(lengths, tokens.shape[1]))]
        _EDITS[layer] = edits
    return _EDITS[layer]


def summarise(results: dict, id_tasks, ood_tasks) -> dict:
    methods = [m for m in next(iter(results.values())) if m not in ("n", "metric")]
    out = {}
    for group, names in (("ID", id_tasks), ("OOD", ood_tasks), ("all", list(id_tasks) + list(ood_tasks))):
        names = [t for t in names if t in results]
        if names:
            out[group] = {m: float(np.mean([results[t][m] for t in names])) for m in methods}
    out["collapses"] = {m: int(sum(results[t][m] < results[t]["zero-shot"] for t in results))
                        for m in methods if m != "zero-shot"}
    return out


def plot(results, summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(results)
    methods = [m for m in results[tasks[0]] if m not in ("n", "metric")]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)), 4))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar(np.arange(len(tasks)) + j * w, [results[t][m] for t in tasks], w, label=m)
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - w / 2, tasks, rotation=30, ha="right")
    ax.set_ylabel("accuracy")
    ax.set_title("In-Context Routing: ID avg " + ", ".join(f"{m} {v:.2f}" for m, v in summary["ID"].items()),
                 fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    import linicl
    from linicl import routing
    os.makedirs(args.out, exist_ok=True)
    timings = {}
    t0 = time.perf_counter()
    model, variables, tokenizer = load_model(args.model)
    timings["load_s"] = time.perf_counter() - t0
    id_tasks = [linicl.data.load_task(t, args.data_dir) for t in args.id_tasks.split(",") if t]
    ood_tasks = [linicl.data.load_task(t, args.data_dir) for t in args.ood_tasks.split(",") if t]

    t0 = time.perf_counter()
    pids = build_pids(model, variables, tokenizer, id_tasks, args)
    pids.save(os.path.join(args.out, "pids"))
    timings["pids_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    router, params, history = train(model, variables, tokenizer, id_tasks, pids, args)
    routing.save_router(os.path.join(args.out, "router"), router, params)
    rand = random_pids(pids, args.seed)
    _, rand_params, rand_history = train(model, variables, tokenizer, id_tasks, rand, args)
    timings["train_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    methods = {"ICR": (pids, router, params), "ICR-random-basis": (rand, router, rand_params)}
    results = {}
    from tqdm.auto import tqdm
    for task in tqdm(id_tasks + ood_tasks, desc="evaluate", disable=args.no_progress):
        results[task.name] = evaluate_task(model, variables, tokenizer, task, methods, args)
        print(task.name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in results[task.name].items()},
              file=sys.stderr)
    timings["eval_s"] = time.perf_counter() - t0
    summary = summarise(results, [t.name for t in id_tasks], [t.name for t in ood_tasks])
    record = {"args": vars(args), "model": model.cfg.describe(), "routed_layers": list(pids.layers),
              "pids_explained_q": pids.explained_q.tolist(), "pids_explained_k": pids.explained_k.tolist(),
              "results": results, "summary": summary, "history": history, "random_history": rand_history,
              "timings": timings}
    with open(os.path.join(args.out, "routing.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(results, summary, os.path.join(args.out, "routing.png"))
    print(json.dumps({"summary": summary, "timings": timings}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
