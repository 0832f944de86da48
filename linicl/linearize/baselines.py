"""The finite-state methods a linearized student is compared with, at its own state size.

A linearized student keeps a fixed number of floats per prompt row, whatever the prompt's length. The
fair untrained baseline keeps no more: sliding-window softmax with the student's sinks and no linear
part (``window_config``), at the largest window whose KV fits the student's budget, optionally with a
cache of tokens that left the window, chosen by the attention they got in it.

* ``window_floats``: what a window baseline keeps of a prompt (its KV and its cache per kv head).
* ``student_budget``: what the student must keep (its state; its local layers' exact windows: their
  keys and values, per kv head, as a window's KV is).
* ``equal_window``, ``equal_cached_window``: the largest window (with a cache) within that budget.
* ``compared_methods``: the teacher, the student, the student with LoLA's sparse cache and the window
  baselines, by the names the long-prompt tables use (``experiments/long_context.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from linicl.errors import LiniclError
from linicl.iclca import state_floats
from linicl.linearize.student import student_variables, window_config
from linicl.memory import kv_cache_floats
from linicl.nn import Transformer

__all__ = ["RULE_NAMES", "EQUAL", "window_floats", "student_budget", "equal_window", "equal_cached_window",
           "compared_methods"]

RULE_NAMES = {"recall": "cache", "attention": "attcache"}  # method-name part of each cache rule (ModelConfig.cache_rule)
EQUAL = "equal"  # compared_methods' windows: the window whose KV matches the student's state


def window_floats(cfg) -> int:
    """What a window baseline (its config ``cfg``, ``window_config``) must keep of a prompt: the KV of
    its sinks and last ``window - 1`` tokens, per kv head; with a cache, per global layer and kv head
    (each chooses its own tokens for its group of query heads) each cached key, value and score, and
    the window's scores. Its stored state holds these and, per query head, the empty linear part of
    ``feature_map="none"`` (a zero state and feature slots), which is not counted."""
    per_head = cfg.cache * (2 * cfg.head_dim + 1) + max(cfg.window - 1, 0) if cfg.cache else 0
    return kv_cache_floats(cfg, cfg.window - 1 + cfg.sinks) + len(cfg.global_layers) * cfg.kv_heads * per_head


def student_budget(student) -> int:
    """The floats the student (a ``Transformer``) must keep of a prompt: its state as stored
    (``iclca.state_floats``), except that of its local layers' exact windows only the keys and values
    count (per kv head, as stored and as a window baseline's KV is), not the empty linear part that
    the window-only hybrid stores beside them (a zero state and feature slots per query head)."""
    cfg = student.cfg
    local = [layer for layer in range(cfg.n_layers) if layer not in cfg.global_layers]
    shared = 2 * cfg.kv_heads * cfg.head_dim * max(cfg.sliding_window - 1, 0)
    return state_floats(cfg) - sum(state_floats(cfg.single_layer(layer)) - shared for layer in local)


def equal_window(student, teacher) -> int:
    """The largest window W whose KV cache (its W - 1 earlier tokens and the student's sinks, a key and
    a value per kv head and layer; a local layer's at most its own window) holds no more floats than
    the student must keep (``student_budget``); at least 1."""
    return _largest_window(student, teacher, cache=0) or 1


def equal_cached_window(student, teacher, cache: int) -> Optional[int]:
    """The largest window W whose window + attention-chosen cache of ``cache`` tokens
    (``window_floats``) holds no more floats than the student must keep; None if even W = 1 does not
    fit."""
    if not isinstance(cache, int) or cache < 0:
        raise LiniclError(f"cache must be an int >= 0 (tokens), got {cache!r}")
    return _largest_window(student, teacher, cache)


def _largest_window(student, teacher, cache: int) -> Optional[int]:
    """Binary search for the largest W with ``window_floats`` of the window baseline (the student's
    sinks, ``cache``) <= ``student_budget``; None if W = 1 does not fit. Every token of the window
    costs at least one layer's key and value, so W - 1 <= budget / (2 kv_heads d_head) bounds it."""
    budget = student_budget(student)

    def fits(w: int) -> bool:
        return window_floats(window_config(teacher.cfg, window=w, sinks=student.cfg.sinks, cache=cache)) <= budget

    if not fits(1):
        return None
    lo, hi = 1, budget // (2 * teacher.cfg.kv_heads * teacher.cfg.head_dim) + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _window_method(teacher, teacher_variables, window: int, sinks: int, cache: int = 0) -> tuple:
    model = Transformer(window_config(teacher.cfg, window=window, sinks=sinks, cache=cache))
    return model, student_variables(model, teacher_variables), True


def compared_methods(teacher, teacher_variables, student, variables, *, caches: Sequence[int] = (),
                     cache_rules: Sequence[str] = ("recall",), windows: Sequence = ("student", EQUAL),
                     window_caches: Sequence[int] = (), only: Optional[Sequence[str]] = None) -> dict:
    """The methods of a long-prompt comparison, ``{name: (model, variables, finite)}`` in table order
    (``finite``: the method keeps a fixed-size state, so a prompt converts into it):

    * ``softmax``: the teacher (full KV cache); ``student``: the linearized student;
    * ``student+cache<C>`` / ``student+attcache<C>``: the student's maps with a sparse cache of C exact
      tokens chosen by each rule of ``cache_rules`` (``RULE_NAMES``; no training), for every C > 0 of
      ``caches``;
    * ``window<W>`` for each of ``windows``: ``"student"`` (the student's window), ``EQUAL`` (its
      state size, ``equal_window``) or a number;
    * ``window<W>+attcache<C>`` for each C of ``window_caches``: W from ``equal_cached_window``.

    ``only``: keep just these names (each must exist). Raises ``LiniclError`` for a cache that alone
    holds more floats than the student's state, or an unknown name in ``only``.
    """
    out = {"softmax": (teacher, teacher_variables, False), "student": (student, variables, True)}
    for c in caches:
        for rule in cache_rules if c else ():
            if rule not in RULE_NAMES:
                raise LiniclError(f"cache_rules: unknown rule {rule!r}; one of {list(RULE_NAMES)}")
            out[f"student+{RULE_NAMES[rule]}{c}"] = (
                Transformer(student.cfg.replace(cache=c, cache_rule=rule)), variables, True)
    sinks = student.cfg.sinks
    for w in windows:
        w = student.cfg.window if w == "student" else equal_window(student, teacher) if w == EQUAL else int(w)
        out[f"window{w}"] = _window_method(teacher, teacher_variables, w, sinks)
    for c in window_caches:
        w = equal_cached_window(student, teacher, c)
        if w is None:
            raise LiniclError(f"window_caches {c}: a cache of {c} tokens alone holds more floats than the "
                              f"student's state")
        out[f"window{w}+attcache{c}"] = _window_method(teacher, teacher_variables, w, sinks, cache=c)
    if only:
        unknown = sorted(set(only) - set(out))
        if unknown:
            raise LiniclError(f"unknown methods {unknown}; these exist: {list(out)}")
        out = {k: v for k, v in out.items() if k in only}
    return out
