"""In-Context Routing on a real LM with the paper's task suite and protocol (routing.md; ICR, arXiv
2509.22854): PIDs and routers trained once on five in-domain (ID) tasks, evaluated zero-shot on them and
on seven out-of-domain tasks (near-OOD, far-OOD) that neither saw.

Tasks (Table-6 templates, label-restricted argmax over single-token label words; ``linicl.data``):
ID agnews, sst2, trec, csqa, piqa; near-OOD sst5, mr, mrpc; far-OOD cb_abc, copa, creak, ai2sci.

Steps (each timed; ``timings`` in the JSON; everything long is saved as it is made and reused by
``--resume``):
1. PIDs: last-token q/k of ``--pid-prompts`` prompts per ID task, each a training-split query with
   ``--pid-shots`` class-balanced demonstrations per class, PCA per routed layer (the last third), rank
   ``--rank`` (``OUT/pid_acts/<task>.npz`` per task, then ``OUT/pids.npz``).
2. Caching: one frozen forward per zero-shot training query (``--train`` per ID task; PIQA has fewer),
   ``OUT/cache/<task>.npz``.
3. Bases: the PIDs and a random orthonormal basis of the same shapes (the paper's control), each with
   the paper's unscaled bias and on the logit scale (``linicl.routing.on_logit_scale``: one direction
   at |alpha| = 1 moves a layer's logits by one std of the model's own), calibrated on ``--calib``
   training queries. Only at the logit scale do the PIDs and the random basis have the same bias size.
4. Training, one router per arm (``--arms``): ``ICR`` (PIDs, paper's bias, full-vocabulary CE: the
   method as specified), ``ICR-random`` (random basis, paper's bias), ``ICR-logit``, ``ICR-logit-random``
   (the fair control), ``ICR-logit-labels`` (CE over the label words, reported separately), and
   ``ICR-minilm``, ``ICR-logit-minilm``: the router reads the paper's input, a frozen all-MiniLM-L6-v2
   embedding of the zero-shot prompt's text (``linicl.lm.minilm``; the others read the LM's own
   mean-pooled residual, ``linicl.routing.router_input``), ``OUT/cache/<task>.minilm.npz``. AdamW at
   ``--lr``, batch ``--batch``, ``--epochs``, alpha annealed 1.0 -> 0.8 and read at 0.8; the bias size per
   layer is logged (``history``) beside the model's own logit spread.
5. Evaluation, per seed (``--seeds``: which test items and which demonstrations): zero-shot; few-shot
   (ID: ``--shots`` per class, class-balanced; OOD: ``--ood-shots`` from each ID task, each in its own
   template, before the query: the paper's multi-task few-shot) on the first ``--n-eval-fewshot`` of
   the items; a task vector (``linicl.routing.task_vector``: few-shot minus zero-shot mean last-token
   residual at the middle layer, from the task's own training split with one demo per class); on ID
   tasks (as the paper) a function vector (``linicl.routing.function_vector``: the ``--fv-heads`` heads
   whose mean output most restores the answer on the same prompts with wrong demo labels, by activation
   patching of the ``--fv-screen`` heads of largest attribution; added at layer L/3, as Todd et al.),
   ``OUT/fv/<task>.npz``; each arm. ``--n-eval`` items per task (all when fewer: cb_abc 56, copa 100).
   A resumed run evaluates only the methods a (task, seed) row lacks.

Reported: accuracy per task and method (pooled over seeds, 95 % Wilson), each method minus zero-shot on
the same queries (paired bootstrap), the share of the few-shot gain recovered where that gain is
significant, collapses (significantly below zero-shot), ID / near / far / OOD averages, the targets:
no collapse for ICR, ICR's pooled ID gain >= 5 points, PIDs >= random basis at the same bias size on
OOD (pooled, paired), and the bias sizes. Which text the paper embeds (the raw query or the templated
prompt) it does not say; here it is the templated zero-shot prompt, the text the LM reads.

``--protocol paper`` sets the paper's sizes (1,000 PID prompts and 5,000 training queries per ID task,
2 epochs, 500 items and 3 seeds): many hours on 2 CPU cores, run across sessions with ``--resume``.
The default is a reduced size (100 PID prompts and 1,000 training queries per ID task, 1 epoch, 200
items, few-shot on 100, 1 seed); it too takes hours on 2 cores (the 5-per-class PID prompts of AG News
and CSQA are ~1,300 tokens each), so it resumes as well; the JSON records each phase's time.

    python experiments/routing.py --quick           # minutes on 2 CPU cores (CI)
    python experiments/routing.py --resume          # the default size
    python experiments/routing.py --protocol paper --resume --out results/routing_paper
    python experiments/routing.py --model gemma3 --resume --out results/routing_gemma3
"""

from __future__ import annotations

import contextlib
import dataclasses
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
ID_TASKS = ("agnews", "sst2", "trec", "csqa", "piqa")
NEAR_TASKS = ("sst5", "mr", "mrpc")
FAR_TASKS = ("cb_abc", "copa", "creak", "ai2sci")
# arm -> (basis, bias scale, CE target, router input): which PIDs a router routes, how it is trained
# and what it reads ("lm": the LM's own mean-pooled residual; "minilm": the paper's frozen all-MiniLM-L6-v2
# embedding of the zero-shot prompt's text)
ARMS = {"ICR": ("pids", "paper", "vocab", "lm"), "ICR-random": ("random", "paper", "vocab", "lm"),
        "ICR-logit": ("pids", "logit", "vocab", "lm"), "ICR-logit-random": ("random", "logit", "vocab", "lm"),
        "ICR-logit-labels": ("pids", "logit", "labels", "lm"), "ICR-minilm": ("pids", "paper", "vocab", "minilm"),
        "ICR-logit-minilm": ("pids", "logit", "vocab", "minilm")}
PAPER = dict(pid_prompts=1000, train=5000, epochs=2, n_eval=500, n_eval_fewshot=500, seeds="0,1,2")
QUICK = dict(id_tasks="sst2", near_tasks="mr", far_tasks="cb_abc", pid_prompts=10, pid_shots=1, train=12,
             epochs=1, n_eval=8, n_eval_fewshot=4, tv_prompts=3, calib=8, seeds="0", shots=1, ood_shots=1,
             arms="ICR,ICR-logit,ICR-logit-random,ICR-minilm", fv_heads=2, fv_screen=4)
FV_SETTINGS = ("fv_heads", "fv_screen", "tv_prompts", "seed", "bos")  # what a function vector depends on


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/routing", quick="tiny sizes for CI", data_dir=True,
                              seed="training queries, PID prompts, router init, random basis")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3' or a checkpoint path (HF dir or .gguf)")
    p.add_argument("--protocol", choices=["default", "paper"], default="default",
                   help="'paper': the paper's sizes (the defaults of the size flags below)")
    p.add_argument("--id-tasks", default=",".join(ID_TASKS))
    p.add_argument("--near-tasks", default=",".join(NEAR_TASKS))
    p.add_argument("--far-tasks", default=",".join(FAR_TASKS))
    p.add_argument("--arms", default=",".join(ARMS), help=f"routers to train, of {list(ARMS)}")
    p.add_argument("--rank", type=positive_int, default=8)
    p.add_argument("--pid-prompts", type=positive_int, default=100, help="few-shot prompts per ID task for the PIDs")
    p.add_argument("--pid-shots", type=positive_int, default=5, help="demos per class in a PID prompt")
    p.add_argument("--train", type=positive_int, default=1000, help="zero-shot training queries per ID task")
    p.add_argument("--calib", type=positive_int, default=256, help="training queries calibrating the logit scale")
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--lr", type=positive_float, default=1e-4)
    p.add_argument("--n-eval", type=positive_int, default=200, help="test items per task and seed")
    p.add_argument("--n-eval-fewshot", type=positive_int, default=100,
                   help="of those, the first ones the few-shot baseline is scored on (its prompts are long)")
    p.add_argument("--seeds", default="0", help="comma-separated evaluation seeds (items and demonstrations)")
    p.add_argument("--shots", type=positive_int, default=5, help="ID few-shot: demos per class")
    p.add_argument("--ood-shots", type=positive_int, default=3, help="OOD few-shot: demos from each ID task")
    p.add_argument("--tv-prompts", type=positive_int, default=16,
                   help="prompts per task (one demo per class) for the task and function vectors")
    p.add_argument("--fv-heads", type=positive_int, default=10, help="heads summed into a function vector")
    p.add_argument("--fv-screen", type=positive_int, default=20,
                   help="heads of largest attribution that are patched to choose them")
    p.add_argument("--checkpoint-every", type=positive_int, default=100,
                   help="router training steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="reuse what a run with the same settings left in --out")
    p.add_argument("--bos", choices=list(BOS_FLAG), default="auto",
                   help="prepend BOS: as the checkpoint's tokenizer says (auto), always, never")
    p.add_argument("--eval-tasks", default=None,
                   help="comma-separated tasks to evaluate, of the ID, near and far tasks (default: all of them)")
    args = p.parse_args(argv)
    if args.protocol == "paper" or args.quick:  # their sizes as defaults: a flag given explicitly still wins
        p.set_defaults(**{**(PAPER if args.protocol == "paper" else {}), **(QUICK if args.quick else {})})
        args = p.parse_args(argv)
    try:  # refuse unknown tasks and arms before loading anything
        eval_task_names(args)
        arm_names(args)
        seeds_of(args)
        if args.pid_prompts * len(groups(args)["ID"]) <= args.rank:
            raise ValueError(f"--pid-prompts x ID tasks ({args.pid_prompts} x {len(groups(args)['ID'])}) must exceed "
                             f"--rank {args.rank}: a PCA of rank r needs more than r prompts")
    except ValueError as e:
        p.error(str(e))
    return args


def _names(text: str) -> list:
    return [t for t in text.split(",") if t]


def groups(args) -> dict:
    return {"ID": _names(args.id_tasks), "near": _names(args.near_tasks), "far": _names(args.far_tasks)}


def arm_names(args) -> list:
    arms = _names(args.arms)
    if not arms or [a for a in arms if a not in ARMS]:
        raise ValueError(f"--arms: expected some of {list(ARMS)}, got {arms}")
    return arms


def seeds_of(args) -> list:
    try:
        seeds = [int(s) for s in _names(args.seeds)]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ValueError(f"--seeds: expected comma-separated ints >= 0, got {args.seeds!r}")
    return seeds


def eval_task_names(args) -> list:
    """The tasks to evaluate, in the order ID, near, far."""
    known = [t for names in groups(args).values() for t in names]
    if args.eval_tasks is None:
        return known
    asked = _names(args.eval_tasks)
    unknown = [t for t in asked if t not in known]
    if unknown or not asked:
        raise ValueError(f"--eval-tasks: {unknown or asked} not among the ID/near/far tasks {known}")
    return [t for t in known if t in asked]


def load_model(name: str):
    """``(model, variables, tokenizer)``: a packaged model ("smollm2", "gemma3") with a 2,048-token
    context (the ID few-shot prompts reach ~1,500 tokens), or the checkpoint ``name`` as it is."""
    import linicl.lm
    import linicl.names
    packaged = name in linicl.names.PRETRAINED
    _, model, variables, tokenizer = linicl.lm.load(name, max_len=2048 if packaged else None)
    return model, variables, tokenizer


# ----------------------------------------------------------------------------- prompts

def _pick(n_pool: int, n: int, seed) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n_pool)[:n]


def zero_shot_prompts(task, tokenizer, n: int, seed: int, add_bos=None):
    """Zero-shot prompts of ``n`` seeded training-split queries, with their template."""
    from linicl.data import build_prompt, template_for
    template = template_for(task)
    return [build_prompt(template, (), task.train[i], tokenizer, add_bos=add_bos)
            for i in _pick(len(task.train), n, [seed, 7])], template


def few_shot_prompts(task, tokenizer, n: int, per_class: int, seed: int, add_bos=None):
    """``n`` prompts of a training-split query and ``per_class`` class-balanced demos per class (never
    the query itself, never a test item)."""
    from linicl.data import build_prompt, sample_demos, template_for
    template = template_for(task)
    k = per_class * len(task.labels)
    out = []
    for j, i in enumerate(_pick(len(task.train), n, [seed, 8])):
        demos = [d for d in sample_demos(task, k + 1, [seed, 9, j]) if d != task.train[i]][:k]
        out.append(build_prompt(template, demos, task.train[i], tokenizer, add_bos=add_bos))
    return out


def multi_task_prompts(queries, task, id_tasks, per_task: int, tokenizer, seed: int, add_bos=None):
    """The paper's OOD few-shot prompts: ``per_task`` class-balanced demos from each ID task, each in
    its own template, shuffled, before each query in the task's template."""
    from linicl.data import build_prompt, sample_demos, template_for
    out = []
    for j, q in enumerate(queries):
        pairs = [(d, template_for(t)) for i, t in enumerate(id_tasks)
                 for d in sample_demos(t, per_task, [seed, 12, i, j])]
        order = np.random.default_rng([seed, 13, j]).permutation(len(pairs))
        out.append(build_prompt(template_for(task), [pairs[i][0] for i in order], q, tokenizer, add_bos=add_bos,
                                demo_templates=[pairs[i][1] for i in order]))
    return out


# ----------------------------------------------------------------------------- steps 1-4

def pid_activations(model, variables, tokenizer, tasks, args, out):
    """Per ID task, the last-token q/k of its PID prompts (saved per task: a resume skips the done ones),
    concatenated."""
    from linicl import routing
    parts = []
    for task in tasks:
        path = out(f"pid_acts/{task.name}.npz")
        if args.resume and os.path.exists(path):
            with np.load(path) as f:
                parts.append({"layers": tuple(f["layers"]), "q": f["q"], "k": f["k"]})
            continue
        prompts = few_shot_prompts(task, tokenizer, args.pid_prompts, args.pid_shots, args.seed, BOS_FLAG[args.bos])
        acts = routing.pid_activations(model, variables, prompts, batch_size=4, progress=args.progress)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.savez(path, layers=np.asarray(acts["layers"]), q=acts["q"], k=acts["k"])
        parts.append(acts)
    return {"layers": parts[0]["layers"], **{s: np.concatenate([p[s] for p in parts], 1) for s in ("q", "k")}}


def cached_queries(model, variables, tokenizer, tasks, pids, args, out, encoder=None):
    """The zero-shot training queries of the ID tasks (``linicl.routing.prepare``, with each query's
    label tokens), per task saved as made, joined right-padded. With a sentence ``encoder`` also the
    embeddings of the prompts' text (``TrainingData.e``; ``OUT/cache/<task>.minilm.npz``)."""
    from linicl import evaluate, routing
    from linicl.data import check_label_words
    from linicl.routing.training import TrainingData
    parts, embedded = [], []
    for task in tasks:
        path = out(f"cache/{task.name}.npz")
        if encoder is not None:
            embedded.append(query_embeddings(encoder, out(f"cache/{task.name}.minilm.npz"),
                                             lambda t=task: zero_shot_prompts(t, tokenizer, args.train, args.seed,
                                                                               BOS_FLAG[args.bos])[0]))
        if not (args.resume and os.path.exists(path)):
            ps, template = zero_shot_prompts(task, tokenizer, args.train, args.seed, BOS_FLAG[args.bos])
            rows, y = evaluate.first_content_targets(tokenizer, ps, [p.label for p in ps], template.label_prefix)
            labels = check_label_words(task.labels, tokenizer, prefix=template.label_prefix)
            d = routing.prepare(model, variables, rows, y, pids, candidates=[labels] * len(rows),
                                progress=args.progress)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            np.savez(path, **{k: v for k, v in dataclasses.asdict(d).items() if v is not None})
        with np.load(path) as f:
            parts.append({k: f[k] for k in f.files})
    T = max(p["h0"].shape[1] for p in parts)
    h0 = np.concatenate([np.pad(p["h0"], ((0, 0), (0, T - p["h0"].shape[1]), (0, 0))) for p in parts])
    width = max(p["candidates"].shape[1] for p in parts)
    cand = np.concatenate([np.pad(p["candidates"], ((0, 0), (0, width - p["candidates"].shape[1])),
                                  constant_values=-1) for p in parts])
    return TrainingData(h0=h0, lengths=np.concatenate([p["lengths"] for p in parts]),
                        y=np.concatenate([p["y"] for p in parts]), H_zs=np.concatenate([p["H_zs"] for p in parts]),
                        candidates=cand, e=np.concatenate(embedded) if embedded else None)


def query_embeddings(encoder, path: str, prompts_fn) -> np.ndarray:
    """The sentence embeddings ``f32[n, d]`` of the prompts' text (``Prompt.text``: the rendered zero-shot
    prompt without BOS), kept in ``path``."""
    if not os.path.exists(path):
        e = encoder.embed([p.text for p in prompts_fn()])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.savez(path, e=e)
    with np.load(path) as f:
        return f["e"]


def calibration_prompts(tokenizer, tasks, args):
    """``--calib`` zero-shot training queries, spread over the ID tasks."""
    per = -(-args.calib // len(tasks))
    return [p for t in tasks for p in zero_shot_prompts(t, tokenizer, per, args.seed + 3, BOS_FLAG[args.bos])[0]]


def bases(model, variables, tokenizer, tasks, pids, args, out) -> dict:
    """(basis, scale) -> PIDs for the arms asked for: the PIDs and the random basis, paper's bias and
    logit scale (``OUT/pids_<basis>_<scale>.npz``)."""
    from linicl import routing
    raw = {"pids": pids, "random": routing.random_basis(pids, args.seed)}
    need = {ARMS[a][:2] for a in arm_names(args)}  # (basis, scale)
    found, calib = {}, None
    for basis, scale in sorted(need):
        path = out(f"pids_{basis}_{scale}.npz")
        if args.resume and os.path.exists(path):
            found[basis, scale] = routing.PIDs.load(path)
            continue
        p = raw[basis]
        if scale == "logit":
            calib = calib or calibration_prompts(tokenizer, tasks, args)
            p = routing.on_logit_scale(model, variables, p, calib, batch_size=16)
        p.save(path)
        found[basis, scale] = p
    return found


def train(model, variables, pids, data, target: str, args, checkpoint):
    from linicl import routing
    return routing.train_router(model, variables, pids, data, epochs=args.epochs, batch_size=args.batch,
                                lr=args.lr, target=target, seed=args.seed, progress=args.progress,
                                checkpoint=checkpoint, checkpoint_every=args.checkpoint_every)


# ----------------------------------------------------------------------------- step 5

def evaluate_task(model, variables, tokenizer, task, id_tasks, methods: dict, seed: int, args, fv=None, done=(),
                  bar=None, encoder=None) -> dict:
    """One task's row for one seed, for the methods not in ``done``: per method its accuracy and, under
    ``detail``, its interval, distinct predictions, per-query correctness and ``items`` (positions in
    the zero-shot item list: the few-shot baseline scores the first ``--n-eval-fewshot``). ``methods``:
    arm -> (its PIDs, router params, forward function, whether it reads the ``encoder``'s embedding of
    each item's text); ``fv``: the task's (layer, function vector) on ID tasks, or None."""
    from linicl import routing
    from linicl.data import build_eval_set, build_prompt, sample_demos, template_for
    from linicl.evaluate import evaluate, evaluate_prompts
    add_bos = BOS_FLAG[args.bos]
    common = dict(seed=seed, n_eval=args.n_eval, progress=args.progress, add_bos=add_bos)
    template = template_for(task)
    items = build_eval_set(task, tokenizer, k=0, seed=seed, n_eval=args.n_eval, add_bos=add_bos)
    queries = [p.query for p in items][:args.n_eval_fewshot]

    def few_shot():
        if task.name in [t.name for t in id_tasks]:  # the first items, each with its own balanced demos
            k = args.shots * len(task.labels)
            prompts = [build_prompt(template, sample_demos(task, k, [seed, 14, j]), q, tokenizer, add_bos=add_bos)
                       for j, q in enumerate(queries)]
        else:
            prompts = multi_task_prompts(queries, task, id_tasks, args.ood_shots, tokenizer, seed, add_bos)
        return evaluate_prompts(model, variables, tokenizer, prompts, labels=task.labels,
                                label_prefix=template.label_prefix, task=task.name, progress=args.progress)

    def vector(layer, v):
        # one vector per evaluated prompt through ``extras``: the same edits function for every task, so
        # the forward compiles once per (layer, length bucket)
        return evaluate(model, variables, tokenizer, task, k=0, edits=routing.task_vector_edits(None, layer),
                        extras=np.tile(np.asarray(v, np.float32), (len(items), 1)), **common)

    def task_vector():
        layer = model.cfg.n_layers // 2
        tv_fs = few_shot_prompts(task, tokenizer, args.tv_prompts, 1, args.seed + 1, add_bos)
        tv_zs, _ = zero_shot_prompts(task, tokenizer, args.tv_prompts, args.seed + 1, add_bos)
        return vector(layer, routing.task_vector(model, variables, tv_fs, tv_zs, layer, batch_size=4))

    shared = {}  # made once per (task, seed) for every arm; the items are those evaluate(k=0) builds, in order

    def arm(arm_pids, params, forward, embedded):
        # the basis as an argument: one compiled forward serves every arm (same router and basis shapes)
        arm_vars = {**variables, "router": params, "routing_bias": arm_pids.routing_bias()}
        first = arm_pids.layers[0]
        if first not in shared:  # the blocks below the routed ones run once for all arms
            shared[first] = routing.entry_residuals(model, variables, items, first, batch_size=8)
        if embedded and "e" not in shared:
            shared["e"] = encoder.embed([p.text for p in items])
        extras = {"h0": shared[first], **({"e": shared["e"]} if embedded else {})}
        return evaluate(model, arm_vars, tokenizer, task, k=0, forward=forward, extras=extras, **common)

    runs = {"zero-shot": lambda: evaluate(model, variables, tokenizer, task, k=0, **common),
            "few-shot": few_shot, "task-vector": task_vector}
    if fv is not None:
        runs["function-vector"] = lambda: vector(*fv)
    runs.update({name: (lambda m=m: arm(*m)) for name, m in methods.items()})
    row, detail = {}, {}
    for name, run in runs.items():
        if name in done:
            continue
        if bar is not None:
            bar.set_postfix_str(f"{task.name} seed {seed}: {name}")
        res = run()
        row[name] = res.accuracy
        detail[name] = dict(ci_low=res.interval.low, ci_high=res.interval.high, distinct=res.distinct,
                            constant=res.constant, correct=res.correct.astype(int).tolist(),
                            items=list(range(res.n)))
    return dict(row, n=len(items), metric="label", detail=detail)


def vector_prompts(task, tokenizer, n: int, seed: int, add_bos=None):
    """The function vector's prompts: ``n`` training queries with one demo per class, and the same
    prompts with every demo's label made wrong (``linicl.data.wrong_labels``)."""
    from linicl.data import build_prompt, sample_demos, template_for, wrong_labels
    template = template_for(task)
    clean, bad = [], []
    for j, i in enumerate(_pick(len(task.train), n, [seed, 8])):
        q = task.train[i]
        demos = [d for d in sample_demos(task, len(task.labels) + 1, [seed, 9, j]) if d != q][:len(task.labels)]
        clean.append(build_prompt(template, demos, q, tokenizer, add_bos=add_bos))
        bad.append(build_prompt(template, wrong_labels(demos, task.labels, [seed, 15, j]), q, tokenizer,
                                add_bos=add_bos))
    return clean, bad


def function_vectors(model, variables, tokenizer, tasks, args, out) -> dict:
    """task name -> (layer, function vector), each saved as made (``OUT/fv/<task>.npz``, with its heads
    and their effects)."""
    from linicl import evaluate, routing
    from linicl.data import template_for
    found = {}
    for task in tasks:
        path = out(f"fv/{task.name}.npz")
        if not os.path.exists(path):
            clean, bad = vector_prompts(task, tokenizer, args.tv_prompts, args.seed + 2, BOS_FLAG[args.bos])
            rows, gold = evaluate.first_content_targets(tokenizer, bad, [p.label for p in bad],
                                                        template_for(task).label_prefix)
            mean_z = routing.mean_head_outputs(model, variables, clean, batch_size=8)
            heads, effects = routing.function_vector_heads(model, variables, rows, gold, mean_z, n_heads=args.fv_heads,
                                                           screen=args.fv_screen, batch_size=8)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            np.savez(path, layer=model.cfg.n_layers // 3, vector=routing.function_vector(model, variables, mean_z, heads),
                     heads=np.asarray(heads), effects=effects)
        with np.load(path) as f:
            found[task.name] = (int(f["layer"]), f["vector"])
    return found


def pool_seeds(per_seed: dict) -> dict:
    """One row from a task's rows per seed: correctness concatenated in seed order (``items`` shifted
    to the pooled zero-shot list), accuracy and Wilson interval of the pool."""
    from linicl.stats import wilson
    seeds = sorted(per_seed, key=int)
    methods = [m for m in per_seed[seeds[0]] if m not in ROW_FIELDS]
    row, detail, offset = {}, {}, 0
    for m in methods:
        detail[m] = dict(correct=[], items=[], distinct=0)
    for s in seeds:
        r = per_seed[s]
        for m in methods:
            d = r["detail"][m]
            detail[m]["correct"] += d["correct"]
            detail[m]["items"] += [offset + i for i in d["items"]]
            detail[m]["distinct"] = max(detail[m]["distinct"], d["distinct"])
        offset += r["n"]
    for m in methods:
        c = detail[m]["correct"]
        iv = wilson(int(sum(c)), len(c))
        row[m] = sum(c) / len(c)
        detail[m].update(ci_low=iv.low, ci_high=iv.high, constant=detail[m]["distinct"] == 1)
    return dict(row, n=offset, metric=per_seed[seeds[0]]["metric"], detail=detail, seeds=[int(s) for s in seeds])


# ----------------------------------------------------------------------------- summary

def method_names(results: dict) -> list:
    """Every method of any task, in first-seen order (the function vector is on the ID tasks only)."""
    names = [m for row in results.values() for m in row if m not in ROW_FIELDS + ("seeds",)]
    return list(dict.fromkeys(names))


def _iv(iv) -> dict:
    return None if iv is None else dict(value=iv.value, low=iv.low, high=iv.high)


def aligned(row: dict, *methods) -> list:
    """Per method, its correctness (float array) on the items every one of ``methods`` scored."""
    shared = set.intersection(*(set(row["detail"][m].get("items", range(row["n"]))) for m in methods))
    out = []
    for m in methods:
        d = row["detail"][m]
        items = d.get("items", list(range(len(d["correct"]))))
        out.append(np.asarray([c for i, c in zip(items, d["correct"]) if i in shared], float))
    return out


def compare(row: dict, methods: list) -> dict:
    """Per method (not zero-shot), on the queries it shares with zero-shot: the difference (paired
    bootstrap), whether it collapsed (significantly below zero-shot) and the share of the few-shot gain
    it recovers (None unless that gain is significantly positive; on the few-shot items)."""
    from linicl import stats
    out = {}
    for m in methods:
        if m == "zero-shot" or m not in row:
            continue
        c, zero = aligned(row, m, "zero-shot")
        rec = None
        if m != "few-shot" and "few-shot" in row["detail"]:
            cf, few, zf = aligned(row, m, "few-shot", "zero-shot")
            rec = _iv(stats.recovered(cf, few, zf))
        out[m] = dict(vs_zero=_iv(stats.paired_bootstrap(c, zero)), collapsed=stats.collapsed(c, zero), recovered=rec)
    return out


def _pooled(results, names, a: str, b: str):
    from linicl import stats
    pairs = [aligned(results[t], a, b) for t in names]
    return stats.paired_bootstrap(np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs]))


def summarise(results: dict, task_groups: dict) -> dict:
    """Group averages (mean over tasks), per task the comparisons of ``compare``, collapses, and the
    targets: ICR without collapse, its pooled ID gain, PIDs against the random basis at the same
    bias size on OOD (pooled, paired)."""
    methods = method_names(results)
    out = {}
    present = {g: [t for t in names if t in results] for g, names in task_groups.items()}
    present["OOD"] = present.get("near", []) + present.get("far", [])
    present["all"] = present.get("ID", []) + present["OOD"]
    out["tasks"] = present
    for group, names in present.items():
        if names:  # a method's average over the group's tasks that have it
            out[group] = {m: float(np.mean([results[t][m] for t in names if m in results[t]])) for m in methods
                          if any(m in results[t] for t in names)}
    out["compare"] = {t: compare(row, methods) for t, row in results.items()}
    out["collapsed_tasks"] = {m: [t for t in results if m in out["compare"][t] and out["compare"][t][m]["collapsed"]]
                              for m in methods if m != "zero-shot"}
    out["collapses"] = {m: len(ts) for m, ts in out["collapsed_tasks"].items()}
    targets = {}
    icr = [m for m in methods if m.startswith("ICR")]
    for m in icr:
        targets[m] = {"collapses": out["collapses"][m], "no_collapses": out["collapses"][m] == 0}
        if present.get("ID"):
            pooled = _pooled(results, present["ID"], m, "zero-shot")
            targets[m].update(ID_gain_points=100 * (out["ID"][m] - out["ID"]["zero-shot"]), ID_gain_pooled=_iv(pooled),
                              ID_gain_at_least_5_points=bool(100 * (out["ID"][m] - out["ID"]["zero-shot"]) >= 5.0),
                              ID_gain_significant=bool(pooled.low > 0))
    for pid_arm, rand_arm in (("ICR-logit", "ICR-logit-random"), ("ICR", "ICR-random")):
        if pid_arm in methods and rand_arm in methods and present["OOD"]:
            targets[f"{pid_arm}_vs_{rand_arm}_OOD"] = _iv(_pooled(results, present["OOD"], pid_arm, rand_arm))
    out["targets"] = targets
    return out


def fmt_acc(row: dict, m: str) -> str:
    """``"62.5 [45.1, 77.3]"`` (percent, Wilson), marked for a constant predictor; "-" if not run."""
    from linicl.stats import Interval
    if m not in row:
        return "-"
    d = row["detail"][m]
    text = Interval(row[m], d["ci_low"], d["ci_high"]).fmt()
    return f"{text} {CONSTANT_MARK}" if d["constant"] else text


def _fmt_iv(v, scale=100.0, digits=1) -> str:
    from linicl.stats import Interval
    return Interval(v["value"], v["low"], v["high"]).fmt(scale, digits)


def fmt_compare(c: dict) -> str:
    """``"+12.5 [3.1, 21.9]; rec 0.80 [0.31, 1.20]"``, or ``"... COLLAPSED"``."""
    text = _fmt_iv(c["vs_zero"])
    if c["recovered"] is not None:
        text += f"; rec {_fmt_iv(c['recovered'], 1.0, 2)}"
    return text + (" COLLAPSED" if c["collapsed"] else "")


def table(results: dict, summary: dict) -> str:
    """The result tables as Markdown: accuracy per task and method, group averages, collapses; each
    method minus zero-shot; the targets."""
    methods = method_names(results)
    order = [(g, t) for g in ("ID", "near", "far") for t in summary["tasks"].get(g, [])]
    rows = [[t, g, results[t]["n"]] + [fmt_acc(results[t], m) for m in methods] for g, t in order]
    rows += [[f"**{g} average**", "", ""] + [f"{100 * summary[g][m]:.1f}" if m in summary[g] else "-"
                                              for m in methods]
             for g in ("ID", "near", "far", "OOD", "all") if g in summary]
    rows.append(["**collapses**", "", ""] + ["-" if m == "zero-shot" else summary["collapses"][m] for m in methods])
    others = [m for m in methods if m != "zero-shot"]
    diffs = [[t, g] + [fmt_compare(summary["compare"][t][m]) if m in summary["compare"][t] else "-" for m in others]
             for g, t in order]
    lines = [f"Accuracy in % with 95 % Wilson intervals, pooled over seeds ({CONSTANT_MARK}: the same prediction "
             "for every query; few-shot on its own first items):", "",
             reporting.markdown_table(["task", "group", "n"] + methods, rows), "",
             "Method minus zero-shot, points on the same queries (paired bootstrap 95 %); rec: share of the "
             "few-shot gain recovered (only where that gain is significantly positive); COLLAPSED: significantly below "
             "zero-shot:", "", reporting.markdown_table(["task", "group"] + others, diffs), ""]
    for name, t in summary["targets"].items():
        if name.endswith("_OOD"):
            a, b = name[:-4].split("_vs_")
            lines.append(f"- {a} minus {b} on the OOD tasks' pooled queries: {_fmt_iv(t)} points "
                         f"({'PIDs >= random basis' if t['low'] >= 0 or t['value'] >= 0 else 'PIDs BELOW the random basis'}"
                         f"{', significantly' if t['low'] > 0 or t['high'] < 0 else ', not significantly'}).")
        else:
            gain = (f"; ID {t['ID_gain_points']:+.1f} points over zero-shot (pooled {_fmt_iv(t['ID_gain_pooled'])}; "
                    f">= 5: {'met' if t['ID_gain_at_least_5_points'] else 'NOT met'})") if "ID_gain_points" in t else ""
            lines.append(f"- {name}: collapses {t['collapses']} "
                         f"({', '.join(summary['collapsed_tasks'][name]) or 'none'}){gain}.")
    return "\n".join(lines)


def bias_lines(histories: dict, logit_std) -> str:
    """The routers' final bias size per routed layer (std over keys at the last query, mean gate)
    beside the model's own logit spread there."""
    lines = []
    if logit_std is not None:
        lines.append(f"- model's own logit std over keys, per routed layer: {', '.join(f'{v:.2f}' for v in logit_std)}")
    for name, h in histories.items():
        if h and "bias_size" in h[-1]:
            lines.append(f"- {name}: bias std at the end of training: {', '.join(f'{v:.2f}' for v in h[-1]['bias_size'])}")
    return "\n".join(lines)


def figure(plt, results, summary):
    """Accuracy per task, one bar per method."""
    tasks = list(results)
    methods = method_names(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(tasks)), 4))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar(np.arange(len(tasks)) + j * w, [results[t].get(m, np.nan) for t in tasks], w, label=m)
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - w / 2, tasks, rotation=30, ha="right")
    ax.set_ylabel("accuracy")
    group = next(g for g in ("ID", "OOD", "all") if g in summary)
    ax.set_title(f"In-Context Routing: {group} avg " + ", ".join(f"{m} {v:.2f}" for m, v in summary[group].items()),
                 fontsize=6)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


# which tasks are evaluated changes no task's numbers: a resume may evaluate more (or fewer) of them
# and the function vectors' own settings: a change recomputes them and their entries (``function_vectors``)
# and which arms: each arm is trained and evaluated on its own, so adding one changes no other's numbers
FINGERPRINT_IGNORES = ("out", "progress", "resume", "checkpoint_every", "data_dir", "eval_tasks", "fv_heads",
                       "fv_screen", "arms")


def fingerprint(args) -> str:
    """A hash of every setting that changes a result (not the output folder or the progress bars)."""
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in FINGERPRINT_IGNORES}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


class Progress:
    """``OUT/progress.json``: the settings' fingerprint, finished phases with their wall seconds,
    finished (task, seed) rows and training histories; rewritten (atomically) after every step."""

    def __init__(self, out: str, fp: str, resume: bool):
        self.path = os.path.join(out, "progress.json")
        self.state = {"fingerprint": fp, "timings": {}, "rows": {}, "eval_s": {}, "history": {}}
        if resume and os.path.exists(self.path):
            with open(self.path) as f:
                old = json.load(f)
            if old.get("fingerprint") == fp:
                self.state = old
            else:
                raise SystemExit(f"--resume: {self.path} is from other settings ({old.get('fingerprint')} != {fp}); "
                                 f"use another --out or delete it")
        self.resumed = bool(self.state["timings"] or self.state["rows"])

    def done(self, phase: str) -> bool:
        return f"{phase}_s" in self.state["timings"]

    def save(self) -> None:
        reporting.write_json(self.path, self.state)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase; time spent in it is added up over resumed sessions."""
        t0 = time.perf_counter()
        yield
        key = f"{name}_s"
        self.state["timings"][key] = self.state["timings"].get(key, 0.0) + time.perf_counter() - t0
        self.save()


SAVED = ("pid_acts", "cache", "ckpt", "fv", "progress.json", "pids.npz")  # and pids_*.npz, router_*.safetensors


def forget_function_vectors(folder: str, rows: dict) -> None:
    """Remove the saved function vectors and their entries in the rows (made with other settings)."""
    import shutil
    shutil.rmtree(os.path.join(folder, "fv"), ignore_errors=True)
    for per_seed in rows.values():
        for row in per_seed.values():
            row.pop("function-vector", None)
            row.get("detail", {}).pop("function-vector", None)


def clear(folder: str) -> None:
    """Remove what an earlier run saved in ``folder`` (a run without --resume starts afresh)."""
    import shutil
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name in SAVED or (name.startswith(("pids_", "router_")) and name.endswith((".npz", ".safetensors"))):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    args = parse_args(argv)
    t_session = time.perf_counter()
    import linicl
    from linicl import routing
    os.makedirs(args.out, exist_ok=True)
    fp = fingerprint(args)
    if not args.resume:
        clear(args.out)
    prog = Progress(args.out, fp, args.resume)
    args.resume = True  # from here on: reuse whatever this run itself saved
    timings = prog.state["timings"]
    out = lambda name: os.path.join(args.out, name)  # noqa: E731
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    model, variables, tokenizer = load_model(args.model)
    task_groups = groups(args)
    eval_names = eval_task_names(args)
    add_bos = BOS_FLAG[args.bos]
    bos_used = bool(getattr(tokenizer, "adds_bos", False)) if add_bos is None else add_bos
    tasks = {t: linicl.data.load_task(t, args.data_dir) for names in task_groups.values() for t in names}
    id_tasks = [tasks[t] for t in task_groups["ID"]]
    timings["load_s"] = timings.get("load_s", 0.0) + time.perf_counter() - t0
    log(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s; settings {fp}")

    if prog.done("pids") and os.path.exists(out("pids.npz")):
        pids = routing.PIDs.load(out("pids.npz"))
    else:
        with prog.phase("pids"):
            acts = pid_activations(model, variables, tokenizer, id_tasks, args, out)
            meta = {"tasks": task_groups["ID"], "prompts_per_task": args.pid_prompts,
                    "demos_per_class": args.pid_shots, "seed": args.seed, "model": model.cfg.describe()}
            pids = routing.fit_pids(acts, r=args.rank, meta=meta)
            pids.save(out("pids"))
    log(f"PIDs: layers {pids.layers}, rank {pids.rank}, {pids.meta['n_prompts']} prompts")

    with prog.phase("bases"):
        found = bases(model, variables, tokenizer, id_tasks, pids, args, out)
    arms = arm_names(args)
    trained = {a: os.path.exists(out(f"router_{a}.safetensors")) for a in arms}
    encoder = linicl.lm.minilm() if any(ARMS[a][3] == "minilm" for a in arms) else None
    data = None
    if not all(trained.values()):
        with prog.phase("caching"):
            data = cached_queries(model, variables, tokenizer, id_tasks, pids, args, out, encoder)
        log(f"cached {len(data.y)} training queries of <= {data.h0.shape[1]} tokens")
    methods, forwards = {}, {}
    for a in arms:
        basis, scale, target, reads = ARMS[a]
        arm_pids = found[basis, scale]
        if trained[a]:
            router, params = routing.load_router(out(f"router_{a}.safetensors"))
        else:
            arm_data = data if reads == "minilm" else dataclasses.replace(data, e=None)
            with prog.phase(f"training_{a}"):
                router, params, history = train(model, variables, arm_pids, arm_data, target, args,
                                                out(f"ckpt/router_{a}.safetensors"))
                routing.save_router(out(f"router_{a}"), router, params)
                prog.state["history"][a] = history
            log(f"training {a}: final loss {history[-1]['loss']:.3f}, bias size {history[-1]['bias_size']}")
        # one forward function per (routed layers, router) object: the harness compiles it once for every
        # arm that shares it (the basis comes in variables["routing_bias"])
        key = (arm_pids.layers, router, reads)
        forwards[key] = forwards.get(key) or routing.icr_forward(model, arm_pids, router, embedded=reads == "minilm",
                                                                 cached=True)
        methods[a] = (arm_pids, params, forwards[key], reads == "minilm")
    del data
    timings["training_s"] = sum(timings.get(f"training_{a}_s", 0.0) for a in arms)

    from tqdm.auto import tqdm
    rows = prog.state["rows"]
    fv_settings = {k: vars(args)[k] for k in FV_SETTINGS}
    if prog.state.get("fv_settings", fv_settings) != fv_settings:  # other function-vector settings: redo them
        forget_function_vectors(args.out, rows)
    prog.state["fv_settings"] = fv_settings
    with prog.phase("function_vectors"):
        fvs = function_vectors(model, variables, tokenizer, id_tasks, args, out)
    todo = [(tasks[t], s) for t in eval_names for s in seeds_of(args)]
    bar = tqdm(todo, desc="evaluate", disable=not args.progress)
    for task, seed in bar:
        old = rows.get(task.name, {}).get(str(seed), {})
        done = [m for m in old if m not in ROW_FIELDS]
        t0 = time.perf_counter()
        row = evaluate_task(model, variables, tokenizer, task, id_tasks, methods, seed, args, fvs.get(task.name),
                            done, bar, encoder)
        if not row["detail"]:
            continue
        row = dict(old, **{k: v for k, v in row.items() if k != "detail"}, detail={**old.get("detail", {}),
                                                                                   **row["detail"]})
        rows.setdefault(task.name, {})[str(seed)] = row
        key = f"{task.name}/{seed}"
        prog.state["eval_s"][key] = prog.state["eval_s"].get(key, 0.0) + time.perf_counter() - t0
        prog.save()
        log(f"{task.name} seed {seed} ({time.perf_counter() - t0:.1f} s):",
            {k: round(v, 3) for k, v in row.items() if isinstance(v, float)})
    timings["eval_s"] = sum(prog.state["eval_s"].values())
    timings["total_s"] = sum(v for k, v in timings.items() if k in ("load_s", "pids_s", "bases_s", "caching_s",
                                                                   "training_s", "function_vectors_s", "eval_s"))
    timings["this_session_s"] = time.perf_counter() - t_session
    prog.save()

    results = {t: pool_seeds(rows[t]) for t in eval_names}
    shown = {g: [t for t in names if t in eval_names] for g, names in task_groups.items()}
    summary = summarise(results, shown)
    histories = prog.state["history"]
    logit_std = next((found[k].meta.get("logit_std") for k in found if k[1] == "logit"), None)
    text = table(results, summary) + "\n\nBias sizes:\n\n" + bias_lines(histories, logit_std)
    command = "python experiments/routing.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {"args": vars(args), "command": command, "fingerprint": fp, "resumed": prog.resumed,
              "add_bos": bos_used, "eval_tasks": eval_names, "groups": shown,
              "model": model.cfg.describe(), "routed_layers": list(pids.layers),
              "pids_explained_q": pids.explained_q.tolist(), "pids_explained_k": pids.explained_k.tolist(),
              "bias_scale": {f"{b}_{s}": (None if p.bias_scale is None else p.bias_scale.tolist())
                             for (b, s), p in found.items()},
              "logit_std": logit_std, "results": results, "rows": rows, "summary": summary, "table": text,
              "history": histories, "timings": timings, "eval_s": prog.state["eval_s"],
              "machine": reporting.machine_info()}
    reporting.write_json(out("routing.json"), record)
    with open(out("routing.md"), "w") as f:
        f.write(f"`{command}` ({model.cfg.describe()}), wall time {timings['total_s'] / 60:.1f} min\n\n{text}\n")
    print(text)
    reporting.plot(out("routing.png"), figure, results, summary, dpi=120)
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
