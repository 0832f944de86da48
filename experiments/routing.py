"""In-Context Routing on a real LM: PIDs and a router trained once on in-domain tasks, evaluated
zero-shot on in-domain and out-of-domain tasks (routing.md, a reduced version of the paper's setup).

Steps (each timed; ``timings`` in the JSON holds the wall seconds per phase and in total):
1. PIDs: last-token q/k of class-balanced few-shot prompts of the in-domain (ID) tasks (training
   splits), PCA per routed layer (the last third), rank ``--rank``.
2. Caching: one frozen forward per zero-shot training query (the residual entering the first routed
   layer and the zero-shot entropy), shared by every router trained below.
3. Training: the router on those queries (the paper's objective); with ``--random-basis`` (default) a
   second router on random orthonormal bases of the same shapes (the paper's control).
4. Evaluation on the test splits of ID tasks and of out-of-domain (OOD) tasks never used in 1-3:
   zero-shot, few-shot, ICR, ICR with a random basis, and a task vector (few-shot minus zero-shot mean
   last-token residual at the middle layer, added at the query's last token; built from each task's
   own training split, ``linicl.routing.task_vector``).

Open-ended tasks are scored by exact match of the greedy answer (``linicl.evaluate``'s default).
Reported: accuracy per task and method with its 95 % Wilson interval (a constant predictor marked),
each method's difference to zero-shot on the same queries (paired bootstrap 95 %), the share of the
few-shot gain it recovers (only where that gain is significantly positive, ``linicl.stats.recovered``), ID and
OOD averages, collapses (tasks where a method is significantly below zero-shot,
``linicl.stats.collapsed``), whether ICR meets the targets (no collapse; ID average >= 5 points over
zero-shot).

``--eval-tasks`` evaluates only the tasks named (of the ID and OOD ones; the router is still trained on
every ID task); each (task, method) shows its batches in a progress bar. ``--bos auto|on|off``: BOS
as the tokenizer's convention (SmolLM2: none), always or never, in every prompt built here (PIDs,
training, evaluation, task vectors); the JSON records the effective choice.
Writes ``OUT/routing.json``, ``OUT/routing.md`` (the table, also printed) and ``OUT/routing.png``.

Nothing long is lost: the PIDs (``OUT/pids.npz``), the training state (``OUT/ckpt/*.safetensors``, every
``--checkpoint-every`` steps), the routers (``OUT/router*.safetensors``) and each finished task's row
(``OUT/progress.json``) are written as soon as they exist. ``--resume`` reuses whatever an earlier run
with the same settings left in OUT (a fingerprint of the settings guards against mixing runs).

    python experiments/routing.py --quick           # minutes on 2 CPU cores (CI)
    python experiments/routing.py                    # full sizes
    python experiments/routing.py --model DIR        # an HF GPT-2/Llama checkpoint instead of SmolLM2
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

import numpy as np

from linicl.compiled import enable_persistent_cache
from linicl import reporting
from linicl.reporting import positive_float, positive_int

BOS_FLAG = {"auto": None, "on": True, "off": False}  # --bos -> add_bos (None: the tokenizer's convention)
CONSTANT_MARK = "(const)"
ROW_FIELDS = ("n", "metric", "detail")  # the keys of a result row that are not methods
ID_TASKS = ("sst2", "trec", "agnews", "commonsense_qa", "antonym")
OOD_TASKS = ("cb", "sentiment", "country-capital", "singular-plural")


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/routing", quick="tiny sizes for CI", data_dir=True,
                              seed="queries, demos, PID prompts, router init, random basis")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3' or a checkpoint path (HF dir or .gguf)")
    p.add_argument("--id-tasks", default=",".join(ID_TASKS))
    p.add_argument("--ood-tasks", default=",".join(OOD_TASKS))
    p.add_argument("--rank", type=positive_int, default=8)
    p.add_argument("--pid-prompts", type=positive_int, default=48, help="few-shot prompts per ID task for the PIDs")
    p.add_argument("--pid-shots", type=positive_int, default=1, help="demos per class in a PID prompt")
    p.add_argument("--train", type=positive_int, default=192, help="zero-shot training queries per ID task")
    p.add_argument("--epochs", type=positive_int, default=2)
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--n-eval", type=positive_int, default=100, help="test queries per task")
    p.add_argument("--shots", type=positive_int, default=4, help="demos in the few-shot baseline prompts")
    p.add_argument("--tv-prompts", type=positive_int, default=32, help="prompts per task for the task vector")
    p.add_argument("--random-basis", action=argparse.BooleanOptionalAction, default=True,
                   help="also train and evaluate the random-orthonormal-basis control (doubles training)")
    p.add_argument("--checkpoint-every", type=positive_int, default=50,
                   help="router training steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="reuse what a run with the same settings left in --out")
    p.add_argument("--bos", choices=list(BOS_FLAG), default="auto",
                   help="prepend BOS: as the checkpoint's tokenizer says (auto), always, never")
    p.add_argument("--eval-tasks", default=None,
                   help="comma-separated tasks to evaluate, of --id-tasks and --ood-tasks (default: all of them)")
    args = p.parse_args(argv)
    if args.quick:
        args.id_tasks, args.ood_tasks = "sst2", "cb"
        args.pid_prompts, args.train, args.epochs, args.n_eval, args.tv_prompts = 8, 16, 1, 8, 4
        args.shots = 2
    try:  # refuse unknown tasks before loading anything
        eval_task_names(args)
    except ValueError as e:
        p.error(str(e))
    return args


def load_model(name: str):
    """``(model, variables, tokenizer)``: a packaged model ("smollm2", "gemma3") with a 1024-token
    context, or the checkpoint ``name`` as it is."""
    import linicl.lm
    import linicl.names
    packaged = name in linicl.names.PRETRAINED
    _, model, variables, tokenizer = linicl.lm.load(name, max_len=1024 if packaged else None)
    return model, variables, tokenizer


def eval_task_names(args) -> list:
    """The tasks to evaluate, in the order of --id-tasks then --ood-tasks."""
    known = [t for t in args.id_tasks.split(",") + args.ood_tasks.split(",") if t]
    if args.eval_tasks is None:
        return known
    asked = [t for t in args.eval_tasks.split(",") if t]
    unknown = [t for t in asked if t not in known]
    if unknown or not asked:
        raise ValueError(f"--eval-tasks: {unknown or asked} not among the ID/OOD tasks {known}")
    return [t for t in known if t in asked]


def zero_shot_prompts(task, tokenizer, n: int, seed: int, split: str = "train", add_bos=None):
    """Zero-shot prompts of ``n`` seeded examples of a split, with their answers."""
    from linicl.data import build_prompt, template_for
    pool = getattr(task, split)
    idx = np.random.default_rng([seed, 7]).permutation(len(pool))[:n]
    template = template_for(task)
    return [build_prompt(template, (), pool[i], tokenizer, add_bos=add_bos) for i in idx], template


def few_shot_prompts(task, tokenizer, n: int, k: int, seed: int, add_bos=None):
    """``n`` few-shot prompts whose queries come from the training split (never the test split)."""
    from linicl.data import build_prompt, sample_demos, template_for
    template = template_for(task)
    idx = np.random.default_rng([seed, 8]).permutation(len(task.train))[:n]
    out = []
    for j, i in enumerate(idx):
        demos = [d for d in sample_demos(task, k + 1, [seed, 9, j]) if d != task.train[i]][:k]
        out.append(build_prompt(template, demos, task.train[i], tokenizer, add_bos=add_bos))
    return out


def build_pids(model, variables, tokenizer, tasks, args):
    from linicl import routing
    prompts = []
    for task in tasks:
        k = args.pid_shots * (len(task.labels) if task.labels else 2)
        prompts += few_shot_prompts(task, tokenizer, args.pid_prompts, k, args.seed, BOS_FLAG[args.bos])
    meta = {"tasks": [t.name for t in tasks], "prompts_per_task": args.pid_prompts,
            "demos_per_class": args.pid_shots, "seed": args.seed}
    return routing.extract_pids(model, variables, prompts, r=args.rank, meta=meta,
                                progress=args.progress)


def random_pids(pids, seed: int):
    """The control: random orthonormal bases of the same shapes (Gaussian + QR)."""
    import dataclasses
    rng = np.random.default_rng(seed)
    rand = lambda U: np.stack([np.linalg.qr(rng.normal(size=u.shape))[0] for u in U])  # noqa: E731
    return dataclasses.replace(pids, U_q=rand(pids.U_q), U_k=rand(pids.U_k), meta={**pids.meta, "random": True})


def prepare(model, variables, tokenizer, tasks, pids, args):
    """The cached zero-shot training queries of the ID tasks (``linicl.routing.prepare``)."""
    from linicl import evaluate, routing
    rows, answers = [], []
    for task in tasks:
        ps, template = zero_shot_prompts(task, tokenizer, args.train, args.seed, add_bos=BOS_FLAG[args.bos])
        # The target is the answer's first content token, after its blank prefix (if the tokenizer
        # splits one off): a shared leading blank would teach the router nothing about the answer.
        r, ids = evaluate.first_content_targets(tokenizer, ps, [p.label for p in ps], template.label_prefix)
        rows += r
        answers += list(ids)
    return routing.prepare(model, variables, rows, answers, pids, progress=args.progress)


def train(model, variables, pids, data, args, checkpoint):
    from linicl import routing
    return routing.train_router(model, variables, pids, data, epochs=args.epochs, batch_size=args.batch,
                                lr=args.lr, seed=args.seed, progress=args.progress,
                                checkpoint=checkpoint, checkpoint_every=args.checkpoint_every)


def evaluate_task(model, variables, tokenizer, task, methods: dict, args, bar=None) -> dict:
    """One task's row: per method its accuracy, and under ``detail`` its interval, distinct
    predictions and per-query correctness (every method scores the same queries)."""
    from linicl import routing
    from linicl.evaluate import evaluate
    add_bos = BOS_FLAG[args.bos]
    common = dict(seed=args.seed, n_eval=args.n_eval, progress=args.progress, add_bos=add_bos)
    row, detail = {}, {}

    def record(name, res):
        row[name] = res.accuracy
        detail[name] = dict(ci_low=res.interval.low, ci_high=res.interval.high, distinct=res.distinct,
                            constant=res.constant, correct=res.correct.astype(int).tolist())
        return res

    def status(name):  # inside the task: which method is being scored
        if bar is not None:
            bar.set_postfix_str(f"{task.name}: {name}")

    status("zero-shot")
    zs = record("zero-shot", evaluate(model, variables, tokenizer, task, k=0, **common))
    status("few-shot")
    record("few-shot", evaluate(model, variables, tokenizer, task, k=args.shots, **common))
    for name, (pids, router, params) in methods.items():
        status(name)
        forward = forward_for(model, pids, router)
        record(name, evaluate(model, {**variables, "router": params}, tokenizer, task, k=0, forward=forward,
                              **common))
    status("task-vector")
    layer = model.cfg.n_layers // 2
    fs = few_shot_prompts(task, tokenizer, args.tv_prompts, args.shots, args.seed + 1, add_bos)
    zs_train, _ = zero_shot_prompts(task, tokenizer, args.tv_prompts, args.seed + 1, add_bos=add_bos)
    vector = routing.task_vector(model, variables, fs, zs_train, layer)
    # One vector per evaluated prompt through ``extras``: the edits function is the same object for
    # every task, so the task-vector forward compiles once per length bucket, not once per task.
    record("task-vector", evaluate(model, variables, tokenizer, task, k=0,
                                   edits=routing.task_vector_edits(None, layer),
                                   extras=np.tile(vector.astype(np.float32), (zs.n, 1)), **common))
    row["n"] = zs.n
    row["metric"] = zs.metric
    row["detail"] = detail
    return row


_FORWARDS: dict = {}


def forward_for(model, pids, router):
    """One forward function per (PIDs, router) so the harness compiles it once."""
    from linicl import routing
    key = (id(pids), router)
    if key not in _FORWARDS:
        _FORWARDS[key] = routing.icr_forward(model, pids, router)
    return _FORWARDS[key]


def method_names(results: dict) -> list:
    return [m for m in next(iter(results.values())) if m not in ROW_FIELDS]


def _iv(iv) -> dict:
    return None if iv is None else dict(value=iv.value, low=iv.low, high=iv.high)


def _correct(row: dict, method: str) -> np.ndarray:
    return np.asarray(row["detail"][method]["correct"], float)


def compare(row: dict, methods: list) -> dict:
    """Per method (not zero-shot), on the task's shared queries: the difference to zero-shot (paired
    bootstrap), whether it collapsed (significantly below zero-shot) and the share of the few-shot
    gain it recovers (None unless that gain is significantly positive)."""
    from linicl import stats
    zero, few = _correct(row, "zero-shot"), _correct(row, "few-shot")
    out = {}
    for m in methods:
        if m == "zero-shot":
            continue
        c = _correct(row, m)
        out[m] = dict(vs_zero=_iv(stats.paired_bootstrap(c, zero)), collapsed=stats.collapsed(c, zero),
                      recovered=None if m == "few-shot" else _iv(stats.recovered(c, few, zero)))
    return out


def summarise(results: dict, id_tasks, ood_tasks) -> dict:
    """Group averages (mean over tasks), per task the comparisons of ``compare``, collapses (tasks
    where a method is significantly below zero-shot) and the ICR targets; the ID gain of ICR over
    zero-shot comes with a paired bootstrap interval over the ID tasks' queries pooled."""
    from linicl import stats
    methods = method_names(results)
    out = {}
    for group, names in (("ID", id_tasks), ("OOD", ood_tasks), ("all", list(id_tasks) + list(ood_tasks))):
        names = [t for t in names if t in results]
        if names:
            out[group] = {m: float(np.mean([results[t][m] for t in names])) for m in methods}
    out["compare"] = {t: compare(row, methods) for t, row in results.items()}
    out["collapsed_tasks"] = {m: [t for t in results if out["compare"][t][m]["collapsed"]]
                              for m in methods if m != "zero-shot"}
    out["collapses"] = {m: len(ts) for m, ts in out["collapsed_tasks"].items()}
    ids = [t for t in id_tasks if t in results]
    if "ICR" in methods and ids:
        pooled = stats.paired_bootstrap(np.concatenate([_correct(results[t], "ICR") for t in ids]),
                                        np.concatenate([_correct(results[t], "zero-shot") for t in ids]))
        gain = 100 * (out["ID"]["ICR"] - out["ID"]["zero-shot"])
        out["targets"] = {"ICR_collapses": out["collapses"]["ICR"], "no_collapses": out["collapses"]["ICR"] == 0,
                          "ICR_ID_gain_points": gain, "ICR_ID_gain_pooled": _iv(pooled),
                          "ID_gain_at_least_5_points": bool(gain >= 5.0)}
    return out


def fmt_acc(row: dict, m: str) -> str:
    """``"62.5 [45.1, 77.3]"`` (percent, Wilson), marked for a constant predictor."""
    from linicl.stats import Interval
    d = row["detail"][m]
    text = Interval(row[m], d["ci_low"], d["ci_high"]).fmt()
    return f"{text} {CONSTANT_MARK}" if d["constant"] else text


def fmt_compare(c: dict) -> str:
    """``"+12.5 [3.1, 21.9]; rec 0.80 [0.31, 1.20]"``, or ``"... COLLAPSED"``."""
    from linicl.stats import Interval
    v = c["vs_zero"]
    text = Interval(v["value"], v["low"], v["high"]).fmt()
    if c["recovered"] is not None:
        r = c["recovered"]
        text += f"; rec {Interval(r['value'], r['low'], r['high']).fmt(1.0, 2)}"
    return text + (" COLLAPSED" if c["collapsed"] else "")


def table(results: dict, summary: dict, id_tasks, ood_tasks) -> str:
    """The result tables as Markdown: accuracy (%) with 95 % Wilson intervals per task and method, the
    group averages and the number of collapses; then each method minus zero-shot on the same queries
    (paired bootstrap), with the share of the few-shot gain recovered where that gain is significantly positive."""
    methods = method_names(results)
    order = [(group, t) for group, names in (("ID", id_tasks), ("OOD", ood_tasks)) for t in names if t in results]
    rows = [[t, group, results[t]["n"]] + [fmt_acc(results[t], m) for m in methods] for group, t in order]
    rows += [[f"**{group} average**", "", ""] + [f"{100 * summary[group][m]:.1f}" for m in methods]
             for group in ("ID", "OOD", "all") if group in summary]
    rows.append(["**collapses**", "", ""] + ["-" if m == "zero-shot" else summary["collapses"][m] for m in methods])
    others = [m for m in methods if m != "zero-shot"]
    diffs = [[t, group] + [fmt_compare(summary["compare"][t][m]) for m in others] for group, t in order]
    lines = [f"Accuracy in % with 95 % Wilson intervals ({CONSTANT_MARK}: the same prediction for every query):",
             "", reporting.markdown_table(["task", "group", "n"] + methods, rows), "",
             "Method minus zero-shot, points on the same queries (paired bootstrap 95 %); rec: share of the "
             "few-shot gain recovered (only where that gain is significantly positive); COLLAPSED: significantly below "
             "zero-shot:", "", reporting.markdown_table(["task", "group"] + others, diffs)]
    if "targets" in summary:
        t = summary["targets"]
        pooled = t["ICR_ID_gain_pooled"]
        lines.append("")
        lines.append(f"Targets for ICR: no collapses: {'met' if t['no_collapses'] else 'NOT met'} "
                     f"({t['ICR_collapses']}: {', '.join(summary['collapsed_tasks']['ICR']) or 'none'}); "
                     f"ID average {t['ICR_ID_gain_points']:+.1f} points over zero-shot "
                     f"(pooled queries {100 * pooled['value']:+.1f} [{100 * pooled['low']:+.1f}, "
                     f"{100 * pooled['high']:+.1f}]) "
                     f"(>= 5: {'met' if t['ID_gain_at_least_5_points'] else 'NOT met'}).")
    return "\n".join(lines)


def figure(plt, results, summary):
    """Accuracy per task, one bar per method."""
    tasks = list(results)
    methods = method_names(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)), 4))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar(np.arange(len(tasks)) + j * w, [results[t][m] for t in tasks], w, label=m)
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - w / 2, tasks, rotation=30, ha="right")
    ax.set_ylabel("accuracy")
    group = next(g for g in ("ID", "OOD", "all") if g in summary)  # --eval-tasks may leave out a group
    ax.set_title(f"In-Context Routing: {group} avg " + ", ".join(f"{m} {v:.2f}" for m, v in summary[group].items()),
                 fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# which tasks are evaluated changes no task's numbers: a resume may evaluate more (or fewer) of them
FINGERPRINT_IGNORES = ("out", "progress", "resume", "checkpoint_every", "data_dir", "eval_tasks")


def fingerprint(args) -> str:
    """A hash of every setting that changes a result (not the output folder or the progress bars)."""
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in FINGERPRINT_IGNORES}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


class Progress:
    """``OUT/progress.json``: the settings' fingerprint, finished phases with their wall seconds, and
    finished tasks' rows; rewritten (atomically) after every step, read back by ``--resume``."""

    def __init__(self, out: str, fp: str, resume: bool):
        self.path = os.path.join(out, "progress.json")
        self.state = {"fingerprint": fp, "timings": {}, "results": {}, "eval_task_s": {}, "history": {}}
        if resume and os.path.exists(self.path):
            with open(self.path) as f:
                old = json.load(f)
            if old.get("fingerprint") == fp:
                self.state = old
            else:
                print(f"--resume: {self.path} is from other settings ({old.get('fingerprint')} != {fp}); "
                      "starting afresh", file=sys.stderr)
        self.resumed = bool(self.state["timings"] or self.state["results"])

    def done(self, phase: str) -> bool:
        return f"{phase}_s" in self.state["timings"]

    def save(self) -> None:
        reporting.write_json(self.path, self.state)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase and record it when it finishes."""
        t0 = time.perf_counter()
        yield
        self.state["timings"][f"{name}_s"] = time.perf_counter() - t0
        self.save()


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    args = parse_args(argv)
    t_session = time.perf_counter()
    import linicl
    from linicl import routing
    os.makedirs(args.out, exist_ok=True)
    fp = fingerprint(args)
    prog = Progress(args.out, fp, args.resume)
    timings = prog.state["timings"]
    out = lambda name: os.path.join(args.out, name)  # noqa: E731
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    model, variables, tokenizer = load_model(args.model)
    eval_names = eval_task_names(args)
    add_bos = BOS_FLAG[args.bos]
    bos_used = bool(getattr(tokenizer, "adds_bos", False)) if add_bos is None else add_bos
    id_tasks = [linicl.data.load_task(t, args.data_dir) for t in args.id_tasks.split(",") if t]
    ood_tasks = [linicl.data.load_task(t, args.data_dir) for t in args.ood_tasks.split(",") if t]
    timings["load_s"] = timings.get("load_s", 0.0) + time.perf_counter() - t0  # paid again on resume
    log(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s; settings {fp}")

    if prog.done("pids") and os.path.exists(out("pids.npz")):
        pids = routing.PIDs.load(out("pids.npz"))
    else:
        with prog.phase("pids"):
            pids = build_pids(model, variables, tokenizer, id_tasks, args)
            pids.save(out("pids"))
    log(f"PIDs: {timings['pids_s']:.1f} s, layers {pids.layers}, rank {pids.rank}, "
        f"{pids.meta['n_prompts']} prompts")

    arms = {"ICR": (pids, "router")}
    if args.random_basis:
        arms["ICR-random-basis"] = (random_pids(pids, args.seed), "router_random_basis")
    trained = {name: os.path.exists(out(f"{file}.safetensors")) and prog.done(f"training_{name}")
               for name, (_, file) in arms.items()}
    if not all(trained.values()):
        with prog.phase("caching"):  # paid again on resume (the cache is large), cheap next to training
            data = prepare(model, variables, tokenizer, id_tasks, pids, args)
        log(f"caching: {timings['caching_s']:.1f} s, {len(data.y)} queries of <= {data.h0.shape[1]} tokens")
    methods = {}
    for name, (arm_pids, file) in arms.items():
        if trained[name]:
            router, params = routing.load_router(out(f"{file}.safetensors"))
        else:
            with prog.phase(f"training_{name}"):
                router, params, history = train(model, variables, arm_pids, data, args,
                                                out(f"ckpt/{file}.safetensors"))
                routing.save_router(out(file), router, params)
                prog.state["history"][name] = history
            log(f"training {name}: {timings[f'training_{name}_s']:.1f} s, final loss {history[-1]['loss']:.3f}")
        methods[name] = (arm_pids, router, params)
    timings["training_s"] = sum(timings[f"training_{name}_s"] for name in arms)

    from tqdm.auto import tqdm
    results, task_s = prog.state["results"], prog.state["eval_task_s"]
    to_eval = [t for t in id_tasks + ood_tasks if t.name in eval_names]
    bar = tqdm(to_eval, desc="evaluate", disable=not args.progress)
    for task in bar:
        if task.name in results:
            continue
        t0 = time.perf_counter()
        results[task.name] = evaluate_task(model, variables, tokenizer, task, methods, args, bar)
        task_s[task.name] = time.perf_counter() - t0
        prog.save()
        log(f"{task.name} ({task_s[task.name]:.1f} s):",
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in results[task.name].items()})
    timings["eval_s"] = sum(task_s.values())
    timings["total_s"] = sum(v for k, v in timings.items() if k in
                             ("load_s", "pids_s", "caching_s", "training_s", "eval_s"))
    timings["this_session_s"] = time.perf_counter() - t_session
    prog.save()

    id_names = [t.name for t in id_tasks if t.name in eval_names]
    ood_names = [t.name for t in ood_tasks if t.name in eval_names]
    results = {t: results[t] for t in id_names + ood_names}  # the tasks asked for, in order, also on resume
    summary = summarise(results, id_names, ood_names)
    text = table(results, summary, id_names, ood_names)
    command = "python experiments/routing.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {"args": vars(args), "command": command, "fingerprint": fp, "resumed": prog.resumed,
              "add_bos": bos_used, "eval_tasks": id_names + ood_names,
              "model": model.cfg.describe(), "routed_layers": list(pids.layers),
              "pids_explained_q": pids.explained_q.tolist(), "pids_explained_k": pids.explained_k.tolist(),
              "results": results, "summary": summary, "table": text,
              "history": prog.state["history"].get("ICR", []),
              "random_history": prog.state["history"].get("ICR-random-basis", []),
              "timings": timings, "eval_task_s": task_s, "machine": reporting.machine_info()}
    reporting.write_json(out("routing.json"), record)
    with open(out("routing.md"), "w") as f:
        f.write(f"`{command}` ({model.cfg.describe()}), wall time {timings['total_s'] / 60:.1f} min\n\n{text}\n")
    print(text)
    reporting.plot(out("routing.png"), figure, results, summary, dpi=120)
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
