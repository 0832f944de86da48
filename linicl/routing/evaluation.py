"""The ICR protocol's evaluation of one task (routing.md; arXiv 2509.22854, section 5): zero-shot,
the few-shot baseline, the task vector, on in-domain tasks the function vector, and each trained
router, all on the same seeded test items (label-restricted argmax, ``linicl.evaluate``).

``evaluate_task`` gives one row per (task, seed); ``linicl.routing.summary`` pools the rows over
seeds and compares the methods on the queries they share. ``function_vectors`` makes the in-domain
tasks' function vectors once (kept in a folder, like ``linicl.routing.preparation``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from linicl.data import build_eval_set, template_for
from linicl.errors import LiniclError
from linicl.routing.baselines import task_vector, task_vector_edits
from linicl.routing.function_vector import function_vector, function_vector_heads, mean_head_outputs
from linicl.routing.pids import PIDs
from linicl.routing.preparation import kept
from linicl.routing.prompts import (balanced_prompts, few_shot_prompts, multi_task_prompts, wrong_label_prompts,
                                    zero_shot_prompts)
from linicl.routing.router import entry_residuals, icr_forward


class RoutedMethod(NamedTuple):
    """A trained router to evaluate: its basis (``fit_bases``), its parameters, its forward function
    (``icr_forward(..., cached=True)``: it reads the residual entering the first routed layer from the
    evaluation's ``extras``) and whether it reads a sentence embedding of each item's text too
    (``icr_forward(embedded=True)``)."""
    pids: PIDs
    params: Any
    forward: Callable
    embedded: bool = False


def routed_methods(model, routers: dict) -> dict:
    """``name -> RoutedMethod`` from ``name -> (pids, router, params, embedded)``, with one
    ``icr_forward(cached=True)`` per (routed layers, router module, embedded) for all the routers that
    share them: the harness compiles a forward function once, and the bases (which differ) go in
    through ``variables["routing_bias"]`` (``evaluate_task``)."""
    forwards, out = {}, {}
    for name, (pids, router, params, embedded) in routers.items():
        key = (pids.layers, router, bool(embedded))
        forwards[key] = forwards.get(key) or icr_forward(model, pids, router, embedded=bool(embedded), cached=True)
        out[name] = RoutedMethod(pids, params, forwards[key], bool(embedded))
    return out


def task_function_vector(model, variables, tokenizer, task, *, n_prompts: int, n_heads: int, screen: Optional[int],
                         seed: int, add_bos: Optional[bool] = None, batch_size: int = 8) -> dict:
    """The function-vector baseline of one task (Todd et al.): the ``n_heads`` heads whose mean output
    on ``n_prompts`` clean one-demo-per-class prompts most restores the gold answer on the same prompts
    with wrong demo labels (``wrong_label_prompts``; activation patching of the ``screen`` heads of
    largest attribution), their mean outputs summed into ``vector: f[d_model]``, added at
    ``layer = n_layers // 3`` (as Todd et al.). Returns ``{"layer", "vector", "heads": int[n_heads, 2]
    ((layer, head) pairs), "effects": f[layers, heads]}`` (NaN where a head was not patched)."""
    from linicl.evaluate import first_content_targets  # heavy, and needed only here
    clean, bad = wrong_label_prompts(task, tokenizer, n_prompts, seed, add_bos)
    rows, gold = first_content_targets(tokenizer, bad, [p.label for p in bad], template_for(task).label_prefix)
    mean_z = mean_head_outputs(model, variables, clean, batch_size=batch_size)
    heads, effects = function_vector_heads(model, variables, rows, gold, mean_z, n_heads=n_heads, screen=screen,
                                           batch_size=batch_size)
    return {"layer": model.cfg.n_layers // 3, "vector": function_vector(model, variables, mean_z, heads),
            "heads": np.asarray(heads), "effects": effects}


def function_vectors(model, variables, tokenizer, tasks: Sequence, *, folder: Optional[str] = None, **settings) -> dict:
    """``task name -> (layer, f[d_model])``: ``task_function_vector(**settings)`` of each task, each
    kept as ``<folder>/<task>.npz`` (with its heads and their effects) as it is made."""
    found = {}
    for task in tasks:
        saved = kept(folder, task.name, lambda task=task: task_function_vector(model, variables, tokenizer, task,
                                                                                **settings))
        found[task.name] = (int(saved["layer"]), saved["vector"])
    return found


def _detail(res) -> dict:
    """What a pooled summary needs of one ``EvalResult``: its interval, whether it was constant, and
    the correctness per item (``items``: positions in the task's zero-shot item list)."""
    return dict(ci_low=res.interval.low, ci_high=res.interval.high, distinct=res.distinct, constant=res.constant,
                correct=res.correct.astype(int).tolist(), items=list(range(res.n)))


def evaluate_task(model, variables, tokenizer, task, id_tasks: Sequence, methods: dict, *, seed: int, n_eval: int,
                  n_eval_fewshot: int, shots: int, ood_shots: int, tv_prompts: int, tv_seed: int,
                  add_bos: Optional[bool] = None, fv: Optional[tuple] = None, done: Sequence[str] = (),
                  encoder=None, progress: bool = False, on_method: Optional[Callable[[str], None]] = None) -> dict:
    """One task's row for evaluation seed ``seed`` (which ``n_eval`` test items, which demos) over the
    methods not in ``done``:

    * ``zero-shot``; ``few-shot`` on the first ``n_eval_fewshot`` items (its prompts are long): on an
      in-domain task (one of ``id_tasks``) ``shots`` class-balanced demos per class
      (``balanced_prompts``), else ``ood_shots`` from each in-domain task (``multi_task_prompts``);
    * ``task-vector``: few-shot minus zero-shot mean last-token residual at layer ``n_layers // 2``
      from ``tv_prompts`` of the task's training prompts (seed ``tv_seed``, one demo per class);
    * ``function-vector`` when ``fv = (layer, vector)`` is given (``function_vectors``);
    * each of ``methods``: name -> ``RoutedMethod``. The blocks below the first routed layer run once
      for every router (``entry_residuals``); a router that reads embeddings needs ``encoder``.

    Returns ``{method: accuracy, ..., "n": items, "metric": "label", "detail": {method: {ci_low,
    ci_high, distinct, constant, correct: [0/1 per item], items: [positions in the item list]}}}``.
    ``on_method(name)`` is called before each method runs (a progress bar's label)."""
    from linicl.evaluate import evaluate, evaluate_prompts  # heavy, and needed only here
    methods = {name: RoutedMethod(*m) for name, m in methods.items()}
    if encoder is None and any(m.embedded for m in methods.values()):
        raise LiniclError(f"encoder: the methods {[n for n, m in methods.items() if m.embedded]} read sentence "
                          "embeddings of the items; pass the encoder they were trained with (linicl.lm.minilm())")
    common = dict(seed=seed, n_eval=n_eval, progress=progress, add_bos=add_bos)
    items = build_eval_set(task, tokenizer, k=0, seed=seed, n_eval=n_eval, add_bos=add_bos)  # as evaluate(k=0)
    queries = [p.query for p in items][:n_eval_fewshot]

    def few_shot():
        if task.name in [t.name for t in id_tasks]:
            prompts = balanced_prompts(queries, task, shots, tokenizer, seed, add_bos)
        else:
            prompts = multi_task_prompts(queries, task, id_tasks, ood_shots, tokenizer, seed, add_bos)
        return evaluate_prompts(model, variables, tokenizer, prompts, labels=task.labels,
                                label_prefix=template_for(task).label_prefix, task=task.name, progress=progress)

    def vector(layer, v):
        # one vector per item through ``extras``: the same edits function for every task, so the forward
        # compiles once per (layer, length bucket)
        return evaluate(model, variables, tokenizer, task, k=0, edits=task_vector_edits(None, layer),
                        extras=np.tile(np.asarray(v, np.float32), (len(items), 1)), **common)

    def the_task_vector():
        layer = model.cfg.n_layers // 2
        fs = few_shot_prompts(task, tokenizer, tv_prompts, 1, tv_seed, add_bos)
        zs, _ = zero_shot_prompts(task, tokenizer, tv_prompts, tv_seed, add_bos)
        return vector(layer, task_vector(model, variables, fs, zs, layer, batch_size=4))

    shared = {}  # made once per call for every router

    def routed(m: RoutedMethod):
        # the basis as an argument: one compiled forward serves every router of the same shapes
        arm_vars = {**variables, "router": m.params, "routing_bias": m.pids.routing_bias()}
        first = m.pids.layers[0]
        if first not in shared:
            shared[first] = entry_residuals(model, variables, items, first, batch_size=8)
        if m.embedded and "e" not in shared:
            shared["e"] = encoder.embed([p.text for p in items])
        extras = {"h0": shared[first], **({"e": shared["e"]} if m.embedded else {})}
        return evaluate(model, arm_vars, tokenizer, task, k=0, forward=m.forward, extras=extras, **common)

    runs = {"zero-shot": lambda: evaluate(model, variables, tokenizer, task, k=0, **common),
            "few-shot": few_shot, "task-vector": the_task_vector}
    if fv is not None:
        runs["function-vector"] = lambda: vector(*fv)
    runs.update({name: (lambda m=m: routed(m)) for name, m in methods.items()})
    row, detail = {}, {}
    for name, run in runs.items():
        if name in done:
            continue
        if on_method is not None:
            on_method(name)
        res = run()
        row[name], detail[name] = res.accuracy, _detail(res)
    return dict(row, n=len(items), metric="label", detail=detail)
