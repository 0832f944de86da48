"""The prompts of the ICR protocol (routing.md; arXiv 2509.22854, section 5) on a task of
``linicl.data``, each in the task's template (``linicl.data.template_for``).

* ``zero_shot_prompts``: seeded training-split queries alone (router training, calibration).
* ``few_shot_prompts``: training-split queries, each after about ``per_class`` demos per class (the
  PIDs' prompts; with one per class, the task vector's).
* ``balanced_prompts``: given queries (test items), each after its own class-balanced demos: the
  in-domain few-shot baseline.
* ``multi_task_prompts``: the paper's out-of-domain few-shot baseline: demos of the in-domain tasks,
  each in its own template, before a query of another task.
* ``wrong_label_prompts``: few-shot prompts with one demo per class and the same prompts with every
  demo's label made wrong (the function vector's head selection).
* ``calibration_prompts``: zero-shot queries spread over several tasks (``on_logit_scale``).

Every draw is seeded by ``np.random.default_rng([seed, stream, ...])``, one stream number per kind of
draw, so that one call always gives the same prompts and two kinds never share their draws (the
stream numbers are part of the protocol: changing one changes every result made with it). Demos come
from the training split, never a test item; a training query is never its own demo.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from linicl.data import Task, build_prompt, sample_demos, template_for, wrong_labels
from linicl.errors import LiniclError

# stream numbers of the seeded draws (see the module docstring)
_QUERIES_ZS, _QUERIES_FS, _DEMOS_FS, _DEMOS_MT, _ORDER_MT, _DEMOS_EVAL, _WRONG = 7, 8, 9, 12, 13, 14, 15


def _count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise LiniclError(f"{name} must be an int >= 1, got {n!r}")
    return int(n)


def _classification(task: Task) -> Task:
    if not isinstance(task, Task) or not task.labels:
        raise LiniclError(f"task must be a classification linicl.data.Task (labels not None), got "
                          f"{getattr(task, 'name', task)!r}")
    return task


def _pick(n_pool: int, n: int, seed) -> np.ndarray:
    """``min(n, n_pool)`` distinct indices into a pool, seeded."""
    return np.random.default_rng(seed).permutation(n_pool)[:n]


def _demos_without(task: Task, query, k: int, seed) -> list:
    """``k`` training demos, none of them ``query``: the first ``k`` of ``k + 1`` class-balanced ones
    (shuffled) without the query, so that the classes' counts may differ by up to two."""
    return [d for d in sample_demos(task, k + 1, seed) if d != query][:k]


def zero_shot_prompts(task: Task, tokenizer, n: int, seed: int, add_bos: Optional[bool] = None) -> tuple:
    """``(prompts, template)``: zero-shot prompts of ``n`` seeded training-split queries (all of them
    when the split is smaller) and the task's template (its ``label_prefix`` scores the answers)."""
    _classification(task)
    template = template_for(task)
    return [build_prompt(template, (), task.train[i], tokenizer, add_bos=add_bos)
            for i in _pick(len(task.train), _count("n", n), [seed, _QUERIES_ZS])], template


def few_shot_prompts(task: Task, tokenizer, n: int, per_class: int, seed: int,
                     add_bos: Optional[bool] = None) -> list:
    """``n`` prompts, each a seeded training-split query after ``per_class * len(task.labels)`` demos
    of about ``per_class`` per class (``_demos_without``: never the query itself)."""
    template = template_for(_classification(task))
    k = _count("per_class", per_class) * len(task.labels)
    return [build_prompt(template, _demos_without(task, task.train[i], k, [seed, _DEMOS_FS, j]), task.train[i],
                         tokenizer, add_bos=add_bos)
            for j, i in enumerate(_pick(len(task.train), _count("n", n), [seed, _QUERIES_FS]))]


def balanced_prompts(queries: Sequence, task: Task, per_class: int, tokenizer, seed: int,
                     add_bos: Optional[bool] = None) -> list:
    """The in-domain few-shot baseline: each of ``queries`` (``linicl.data.Example``, e.g. test items)
    after its own ``per_class`` class-balanced training demos per class."""
    template = template_for(_classification(task))
    k = _count("per_class", per_class) * len(task.labels)
    return [build_prompt(template, sample_demos(task, k, [seed, _DEMOS_EVAL, j]), q, tokenizer, add_bos=add_bos)
            for j, q in enumerate(queries)]


def multi_task_prompts(queries: Sequence, task: Task, id_tasks: Sequence[Task], per_task: int, tokenizer,
                       seed: int, add_bos: Optional[bool] = None) -> list:
    """The paper's out-of-domain few-shot prompts: per query, ``per_task`` class-balanced demos from
    each of ``id_tasks``, each demo in its own task's template, shuffled together, before the query in
    ``task``'s template (whose separators join them)."""
    _classification(task)
    if not id_tasks:
        raise LiniclError("id_tasks must name one or more tasks whose demos fill the prompts, got none")
    per_task = _count("per_task", per_task)
    out = []
    for j, q in enumerate(queries):
        pairs = [(d, template_for(t)) for i, t in enumerate(id_tasks)
                 for d in sample_demos(_classification(t), per_task, [seed, _DEMOS_MT, i, j])]
        order = np.random.default_rng([seed, _ORDER_MT, j]).permutation(len(pairs))
        out.append(build_prompt(template_for(task), [pairs[i][0] for i in order], q, tokenizer, add_bos=add_bos,
                                demo_templates=[pairs[i][1] for i in order]))
    return out


def wrong_label_prompts(task: Task, tokenizer, n: int, seed: int, add_bos: Optional[bool] = None) -> tuple:
    """``(clean, bad)``: ``n`` training queries each after as many demos as classes (the prompts of
    ``few_shot_prompts(per_class=1)``), and the same prompts with every demo's label replaced by
    another (``linicl.data.wrong_labels``): where the function vector's heads must restore the answer."""
    template = template_for(_classification(task))
    clean, bad = [], []
    for j, i in enumerate(_pick(len(task.train), _count("n", n), [seed, _QUERIES_FS])):
        q = task.train[i]
        demos = _demos_without(task, q, len(task.labels), [seed, _DEMOS_FS, j])
        clean.append(build_prompt(template, demos, q, tokenizer, add_bos=add_bos))
        bad.append(build_prompt(template, wrong_labels(demos, task.labels, [seed, _WRONG, j]), q, tokenizer,
                                add_bos=add_bos))
    return clean, bad


def calibration_prompts(tasks: Sequence[Task], tokenizer, n: int, seed: int, add_bos: Optional[bool] = None) -> list:
    """About ``n`` zero-shot training queries spread over ``tasks`` (``ceil(n / len(tasks))`` each, in
    task order): what ``on_logit_scale`` measures the model's own logit spread on."""
    if not tasks:
        raise LiniclError("tasks must hold one or more tasks to draw calibration queries from, got none")
    per = -(-_count("n", n) // len(tasks))
    return [p for t in tasks for p in zero_shot_prompts(t, tokenizer, per, seed, add_bos)[0]]
