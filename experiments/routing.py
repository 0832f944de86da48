"""In-Context Routing on a real LM with the paper's task suite and protocol (routing.md; ICR, arXiv
2509.22854): PIDs and routers trained once on five in-domain (ID) tasks, evaluated zero-shot on them and
on seven out-of-domain tasks (near-OOD, far-OOD) that neither saw.

Tasks (Table-6 templates, label-restricted argmax over single-token label words; ``linicl.data``):
ID agnews, sst2, trec, csqa, piqa; near-OOD sst5, mr, mrpc; far-OOD cb_abc, copa, creak, ai2sci.

Steps (``linicl.routing``; each timed in the JSON's ``timings``; all saved as made, reused by ``--resume``):
1. PIDs (``gather_pid_activations``, ``fit_pids``): ``--pid-prompts`` prompts per ID task with ``--pid-shots``
   demos per class, rank ``--rank``; ``OUT/pid_acts/``, ``OUT/pids.npz``.
2. Caching (``gather_training_data``): ``--train`` zero-shot training queries per ID task, ``OUT/cache/``.
3. Bases (``fit_bases``): PIDs and random basis, paper's bias and logit scale (``--calib`` queries).
4. Training: one router per arm of ``--arms`` (``linicl.routing.ARMS``; ``ICR`` is the method as the
   paper specifies it), AdamW at ``--lr``, batch ``--batch``, ``--epochs``; bias sizes in ``history``.
5. Evaluation (``evaluate_task``) per seed of ``--seeds``, ``--n-eval`` items per task: zero-shot,
   few-shot on the first ``--n-eval-fewshot`` (ID: ``--shots`` per class; OOD: ``--ood-shots`` from each
   ID task, the paper's multi-task few-shot), a task vector, on ID tasks a function vector (``--fv-heads``
   of the ``--fv-screen`` heads of largest attribution, ``OUT/fv/``), each arm. A resumed run evaluates
   only the methods a (task, seed) row lacks.

Reported (``summarise``, ``results_table``): accuracy per task and method pooled over seeds, each method
minus zero-shot on the same queries, the few-shot gain recovered, collapses, group averages, the targets
(no collapse for ICR, its ID gain >= 5 points, PIDs >= random basis at the same bias size on OOD) and the
bias sizes. The paper does not say which text it embeds; here it is the templated zero-shot prompt.

``--protocol paper`` sets the paper's sizes (1,000 PID prompts and 5,000 training queries per ID task,
2 epochs, 500 items, 3 seeds): many hours on 2 CPU cores, across sessions with ``--resume``. The default
is reduced (100 PID prompts, 1,000 training queries per ID task, 1 epoch, 200 items, few-shot on 100,
1 seed) and takes hours on 2 cores too (AG News and CSQA's PID prompts are ~1,300 tokens), so it resumes.

    python experiments/routing.py --quick           # minutes on 2 CPU cores (CI)
    python experiments/routing.py --resume          # the default size
    python experiments/routing.py --protocol paper --resume --out results/routing_paper
    python experiments/routing.py --model gemma3 --resume --out results/routing_gemma3
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

from linicl import reporting, routing
from linicl.compiled import enable_persistent_cache
from linicl.reporting import positive_float, positive_int
from linicl.routing import ARMS  # name -> (basis, bias scale, CE target, router input): linicl.routing.arms

BOS_FLAG = {"auto": None, "on": True, "off": False}  # --bos -> add_bos (None: the tokenizer's convention)
ID_TASKS = ("agnews", "sst2", "trec", "csqa", "piqa")
NEAR_TASKS = ("sst5", "mr", "mrpc")
FAR_TASKS = ("cb_abc", "copa", "creak", "ai2sci")
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


# which tasks are evaluated changes no task's numbers: a resume may evaluate more (or fewer) of them
# and the function vectors' own settings: a change recomputes them and their entries (``function_vectors``)
# and which arms: each arm is trained and evaluated on its own, so adding one changes no other's numbers
FINGERPRINT_IGNORES = ("out", "progress", "resume", "checkpoint_every", "data_dir", "eval_tasks", "fv_heads",
                       "fv_screen", "arms")


def fingerprint(args) -> str:
    """A hash of every setting that changes a result (not the output folder or the progress bars)."""
    return reporting.fingerprint(vars(args), FINGERPRINT_IGNORES)


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
    os.makedirs(args.out, exist_ok=True)
    fp = fingerprint(args)
    if not args.resume:
        clear(args.out)
    out = lambda name: os.path.join(args.out, name)  # noqa: E731
    try:  # progress.json: fingerprint, finished phases (wall seconds), (task, seed) rows, training histories
        prog = reporting.Progress(out("progress.json"), fp, args.resume, refuse_other=True)
    except linicl.errors.LiniclError as e:
        raise SystemExit(f"--resume: {e}")
    for key in ("rows", "eval_s", "history"):
        prog.state.setdefault(key, {})
    args.resume = True  # from here on: reuse whatever this run itself saved (and say so in the JSON's args)
    timings = prog.state["timings"]
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    # a packaged model with a 2,048-token context (the ID few-shot prompts reach ~1,500 tokens); a checkpoint as it is
    max_len = 2048 if args.model in linicl.names.PRETRAINED else None
    _, model, variables, tokenizer = linicl.lm.load(args.model, max_len=max_len)
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
            acts = routing.gather_pid_activations(model, variables, tokenizer, id_tasks, n_prompts=args.pid_prompts,
                                                  per_class=args.pid_shots, seed=args.seed, add_bos=add_bos,
                                                  folder=out("pid_acts"), progress=args.progress)
            meta = {"tasks": task_groups["ID"], "prompts_per_task": args.pid_prompts,
                    "demos_per_class": args.pid_shots, "seed": args.seed, "model": model.cfg.describe()}
            pids = routing.fit_pids(acts, r=args.rank, meta=meta)
            pids.save(out("pids"))
    log(f"PIDs: layers {pids.layers}, rank {pids.rank}, {pids.meta['n_prompts']} prompts")

    arms = arm_names(args)
    with prog.phase("bases"):  # the calibration queries are drawn only if a logit-scale basis is not saved
        calibration = functools.partial(routing.calibration_prompts, id_tasks, tokenizer, args.calib, args.seed + 3,
                                        add_bos)
        needed = {(ARMS[a].basis, ARMS[a].scale) for a in arms}
        found = routing.fit_bases(model, variables, pids, needed, seed=args.seed, calibration=calibration,
                                  folder=args.out)
    trained = {a: os.path.exists(out(f"router_{a}.safetensors")) for a in arms}
    encoder = linicl.lm.minilm() if any(ARMS[a].reads == "minilm" for a in arms) else None
    data = arm_data = None
    if not all(trained.values()):
        with prog.phase("caching"):
            data = routing.gather_training_data(model, variables, tokenizer, id_tasks, pids, n=args.train,
                                                seed=args.seed, add_bos=add_bos, folder=out("cache"),
                                                encoder=encoder, progress=args.progress)
        log(f"cached {len(data.y)} training queries of <= {data.h0.shape[1]} tokens")
    routers = {}
    for a in arms:
        basis, scale, target, reads = ARMS[a]
        arm_pids = found[basis, scale]
        if trained[a]:
            router, params = routing.load_router(out(f"router_{a}.safetensors"))
        else:
            arm_data = data if reads == "minilm" else dataclasses.replace(data, e=None)
            with prog.phase(f"training_{a}"):
                router, params, history = routing.train_router(
                    model, variables, arm_pids, arm_data, epochs=args.epochs, batch_size=args.batch, lr=args.lr,
                    target=target, seed=args.seed, progress=args.progress,
                    checkpoint=out(f"ckpt/router_{a}.safetensors"), checkpoint_every=args.checkpoint_every)
                routing.save_router(out(f"router_{a}"), router, params)
                # the saved router supersedes its training checkpoint: not carried across sessions twice
                if os.path.exists(out(f"ckpt/router_{a}.safetensors")):
                    os.remove(out(f"ckpt/router_{a}.safetensors"))
                prog.state["history"][a] = history
            log(f"training {a}: final loss {history[-1]['loss']:.3f}, bias size {history[-1]['bias_size']}")
        routers[a] = (arm_pids, router, params, reads == "minilm")
    methods = routing.routed_methods(model, routers)  # one compiled forward for the arms that can share it
    # the cached residuals (~5 GB for Gemma 3's 5,000 queries, held by arm_data too) must not live on into
    # the evaluation: an uninterrupted Gemma 3 run was killed for memory (24 GB RSS) at its function vectors
    data = arm_data = None
    timings["training_s"] = sum(timings.get(f"training_{a}_s", 0.0) for a in arms)

    from tqdm.auto import tqdm
    rows = prog.state["rows"]
    fv_settings = {k: vars(args)[k] for k in FV_SETTINGS}
    if prog.state.get("fv_settings", fv_settings) != fv_settings:  # other function-vector settings: redo them
        forget_function_vectors(args.out, rows)
    prog.state["fv_settings"] = fv_settings
    with prog.phase("function_vectors"):
        fvs = routing.function_vectors(model, variables, tokenizer, id_tasks, folder=out("fv"), seed=args.seed + 2,
                                       n_prompts=args.tv_prompts, n_heads=args.fv_heads, screen=args.fv_screen,
                                       add_bos=add_bos)
    todo = [(tasks[t], s) for t in eval_names for s in seeds_of(args)]
    bar = tqdm(todo, desc="evaluate", disable=not args.progress)
    for task, seed in bar:
        old = rows.get(task.name, {}).get(str(seed), {})
        t0 = time.perf_counter()
        row = routing.evaluate_task(
            model, variables, tokenizer, task, id_tasks, methods, seed=seed, n_eval=args.n_eval,
            n_eval_fewshot=args.n_eval_fewshot, shots=args.shots, ood_shots=args.ood_shots,
            tv_prompts=args.tv_prompts, tv_seed=args.seed + 1, add_bos=add_bos, fv=fvs.get(task.name),
            done=[m for m in old if m not in routing.ROW_FIELDS], encoder=encoder, progress=args.progress,
            on_method=lambda name, t=task.name, s=seed: bar.set_postfix_str(f"{t} seed {s}: {name}"))
        if not row["detail"]:
            continue
        rows.setdefault(task.name, {})[str(seed)] = row = routing.merge_row(old, row)
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

    results = {t: routing.pool_seeds(rows[t]) for t in eval_names}
    shown = {g: [t for t in names if t in eval_names] for g, names in task_groups.items()}
    summary = routing.summarise(results, shown)
    histories = prog.state["history"]
    logit_std = next((found[k].meta.get("logit_std") for k in found if k[1] == "logit"), None)
    text = routing.results_table(results, summary) + "\n\nBias sizes:\n\n" + routing.bias_lines(histories, logit_std)
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
    reporting.plot(out("routing.png"), routing.results_figure, results, summary, dpi=120)
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
