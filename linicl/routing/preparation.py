"""What router training on a task suite needs, each part kept in a folder as it is made and read
back from there when present (a long run resumes where it stopped; ``folder=None`` keeps nothing):

* ``gather_pid_activations``: the PIDs' last-token q/k, per in-domain task (``<folder>/<task>.npz``);
  ``fit_pids`` makes the PIDs of their concatenation.
* ``gather_training_data``: the router's ``TrainingData`` from the zero-shot training queries, per task
  (``<folder>/<task>.npz``), and with a sentence encoder the embeddings of the prompts' text
  (``<folder>/<task>.minilm.npz``).
* ``fit_bases``: the PIDs and the paper's random-basis control, each with the paper's bias or on the
  logit scale (``<folder>/pids_<basis>_<scale>.npz``).

A file found is trusted: the caller keeps one folder per setting (``experiments/routing.py`` checks
a fingerprint of its flags) and empties it to start afresh.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence, Union

import numpy as np

from linicl.errors import LiniclError
from linicl.names import BIAS_SCALES, ICR_BASES
from linicl.routing.pids import PIDs, on_logit_scale, pid_activations, random_basis
from linicl.routing.prompts import few_shot_prompts, zero_shot_prompts
from linicl.routing.training import TrainingData, prepare


def kept(folder: Optional[str], name: str, make: Callable[[], dict]) -> dict:
    """``make()`` (name -> array), saved as ``<folder>/<name>.npz`` and read back from there; what a
    file already there holds when it exists; ``make()`` itself when ``folder`` is None."""
    if folder is None:
        return make()
    path = os.path.join(folder, f"{name}.npz")
    if not os.path.exists(path):
        arrays = make()
        os.makedirs(folder, exist_ok=True)
        np.savez(path, **arrays)
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _tasks(tasks: Sequence) -> Sequence:
    if not tasks:
        raise LiniclError("tasks must hold one or more in-domain linicl.data.Task objects, got none")
    return tasks


def gather_pid_activations(model, variables, tokenizer, tasks: Sequence, *, n_prompts: int, per_class: int,
                           seed: int, add_bos: Optional[bool] = None, folder: Optional[str] = None,
                           batch_size: int = 4, progress: bool = False) -> dict:
    """The last-token q/k (``linicl.routing.pid_activations``) of ``n_prompts`` few-shot prompts per
    task (``few_shot_prompts`` with ``per_class`` demos per class), concatenated over the tasks in
    order: ``{"layers": (l, ...), "q": f32[n_layers, N, heads * d_head], "k": f32[n_layers, N,
    kv_heads * d_head]}`` with ``N`` the prompts of all tasks, ready for ``fit_pids``."""
    parts = []
    for task in _tasks(tasks):
        def make(task=task):
            prompts = few_shot_prompts(task, tokenizer, n_prompts, per_class, seed, add_bos)
            acts = pid_activations(model, variables, prompts, batch_size=batch_size, progress=progress)
            return {"layers": np.asarray(acts["layers"]), "q": acts["q"], "k": acts["k"]}
        parts.append(kept(folder, task.name, make))
    return {"layers": tuple(int(l) for l in parts[0]["layers"]),
            **{s: np.concatenate([p[s] for p in parts], 1) for s in ("q", "k")}}


def _training_part(model, variables, tokenizer, task, pids: PIDs, n: int, seed: int, add_bos, progress) -> dict:
    """One task's ``prepare`` output as arrays: ``n`` zero-shot queries, each with its answer's first
    content token and its task's label-word tokens."""
    from linicl.data import check_label_words
    from linicl.evaluate import first_content_targets  # heavy, and needed only here
    prompts, template = zero_shot_prompts(task, tokenizer, n, seed, add_bos)
    rows, y = first_content_targets(tokenizer, prompts, [p.label for p in prompts], template.label_prefix)
    labels = check_label_words(task.labels, tokenizer, prefix=template.label_prefix)
    d = prepare(model, variables, rows, y, pids, candidates=[labels] * len(rows), progress=progress)
    return {k: v for k, v in dataclasses.asdict(d).items() if v is not None}


def _pad_to(x: np.ndarray, width: int, axis: int, value=0) -> np.ndarray:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - x.shape[axis])
    return np.pad(x, pad, constant_values=value)


def gather_training_data(model, variables, tokenizer, tasks: Sequence, pids: PIDs, *, n: int, seed: int,
                         add_bos: Optional[bool] = None, folder: Optional[str] = None, encoder=None,
                         progress: bool = False) -> TrainingData:
    """The router's training data: ``n`` zero-shot training queries per task (fewer where the split is
    smaller; ``zero_shot_prompts``) through the frozen model once (``linicl.routing.prepare``, with each
    query's label-word tokens as ``candidates``), joined in task order: ``h0`` right-padded to the
    longest query ``f32[N, T, d_model]``, ``candidates`` padded with -1. With a sentence ``encoder``
    (``linicl.lm.minilm()``) also ``e: f32[N, d_e]``, its embedding of each prompt's text (the paper's
    router input); else ``e`` is None."""
    parts, embedded = [], []
    for task in _tasks(tasks):
        if encoder is not None:
            def embed(task=task):
                prompts = zero_shot_prompts(task, tokenizer, n, seed, add_bos)[0]
                return {"e": encoder.embed([p.text for p in prompts])}  # the text without BOS
            embedded.append(kept(folder, f"{task.name}.minilm", embed)["e"])
        parts.append(kept(folder, task.name, lambda task=task: _training_part(
            model, variables, tokenizer, task, pids, n, seed, add_bos, progress)))
    T = max(p["h0"].shape[1] for p in parts)
    width = max(p["candidates"].shape[1] for p in parts)
    return TrainingData(h0=np.concatenate([_pad_to(p["h0"], T, 1) for p in parts]),
                        lengths=np.concatenate([p["lengths"] for p in parts]),
                        y=np.concatenate([p["y"] for p in parts]), H_zs=np.concatenate([p["H_zs"] for p in parts]),
                        candidates=np.concatenate([_pad_to(p["candidates"], width, 1, -1) for p in parts]),
                        e=np.concatenate(embedded) if embedded else None)


def fit_bases(model, variables, pids: PIDs, needed, *, seed: int,
              calibration: Union[Sequence, Callable[[], Sequence]] = (), folder: Optional[str] = None,
              batch_size: int = 16) -> dict:
    """``(basis, scale) -> PIDs`` for each pair in ``needed``: basis ``"pids"`` (``pids``) or
    ``"random"`` (``random_basis(pids, seed)``, the paper's control), scale ``"paper"`` (the bias as
    written) or ``"logit"`` (``on_logit_scale`` on the ``calibration`` prompts, or on what
    ``calibration()`` returns, called once and only when a logit-scale basis is not in ``folder``). At
    the logit scale a PID and a random direction move the logits alike, so that their comparison is
    one of directions and not of bias size."""
    needed = sorted({tuple(p) for p in needed})
    bad = [p for p in needed if len(p) != 2 or p[0] not in ICR_BASES or p[1] not in BIAS_SCALES]
    if bad or not needed:
        raise LiniclError(f"needed must be (basis, scale) pairs with basis in {ICR_BASES} and scale in "
                          f"{BIAS_SCALES}, got {bad or needed}")
    found, calib = {}, None
    for basis, scale in needed:
        path = None if folder is None else os.path.join(folder, f"pids_{basis}_{scale}.npz")
        if path is not None and os.path.exists(path):
            found[basis, scale] = PIDs.load(path)
            continue
        p = pids if basis == "pids" else random_basis(pids, seed)
        if scale == "logit":
            calib = calib or (calibration() if callable(calibration) else list(calibration))
            if not calib:
                raise LiniclError("calibration: a logit-scale basis needs one or more prompts, got none")
            p = on_logit_scale(model, variables, p, calib, batch_size=batch_size)
        if path is not None:
            p.save(path)
        found[basis, scale] = p
    return found
