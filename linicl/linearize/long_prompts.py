"""Scoring methods on long prompts (``linicl.data.long_context``): what a finite state remembers that a
sliding window of the same size cannot.

A *cell* is one probe at one prompt length (or one many-shot task): the same prompts for every method
(``baselines.compared_methods``). Per method and cell:

* ``score_method``: accuracy, keyed (the answer's first number must be the key,
  ``long_context.key_answered``) or by exact match as ``linicl.evaluate`` scores, with a 95 % Wilson
  interval; the floats the method keeps per prompt row; and for a finite-state method the check that
  the prompts converted (``iclca.convert`` of all but the question) answer the question read alone as
  the prompted model does (``converted_check``).
* ``oracle_window``: a diagnostic, not a method: the teacher restricted to its sinks, its last W tokens
  and a passkey prompt's key line, as if a cache had kept exactly that line in every head.
* ``versus_equal_window``: each method minus the equal-state window, paired over the same prompts.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import compiled, iclca, stats
from linicl import interventions as iv
from linicl.data import long_context as lc
from linicl.errors import LiniclError
from linicl.evaluate import evaluate_prompts, greedy_answers
from linicl.linearize.baselines import window_floats
from linicl.memory import kv_cache_floats
from linicl.metrics import rel_err
from linicl.names import NO_LINEAR_PART, block_site

__all__ = ["converted_check", "scored_row", "score_method", "oracle_window", "versus_equal_window"]


def converted_check(model, variables, prompts: Sequence, predictions: Sequence[str], tokenizer, max_new: int) -> dict:
    """Convert each prompt's context (all but the question) and read the question alone: its greedy
    answer must equal the prompted model's (``predictions``), and its logits the prompted model's at
    the question. ``dict(answers_equal, of, max_rel_err)``: the answers that agree, of how many, and
    the largest relative logit error (float32: ~1e-6 expected)."""
    if len(prompts) != len(predictions) or not prompts:
        raise LiniclError(f"converted_check needs one prediction per prompt and at least one prompt, got "
                          f"{len(prompts)} prompts and {len(predictions)} predictions")
    same, errs = 0, []
    forward = _forward(model)
    for p, want in zip(prompts, predictions):
        ctx, query = jnp.asarray(p.tokens[:p.query_start])[None], p.tokens[p.query_start:]
        conv = iclca.convert(model, variables, ctx)
        ref = forward(variables, jnp.asarray(p.tokens)[None])[:, p.query_start:]
        errs.append(float(rel_err(forward(conv, jnp.asarray(query)[None]), ref)))
        got = greedy_answers(model, conv, tokenizer, [query], max_new=max_new,
                             common=dict(batch_size=1, progress=False))
        same += int(got[0] == want)
    return dict(answers_equal=same, of=len(prompts), max_rel_err=max(errs))


def _forward(model):
    """``model.apply`` compiled (once per model, shape and variable structure): run eagerly, every
    operation of the forward is a small program compiled for each new prompt length (the quick run of
    experiments/long_context.py spent 76 of its 271 s there)."""
    return compiled.get(("long_prompts.forward", model), lambda: jax.jit(model.apply))


def scored_row(name: str, correct, predictions: Sequence[str], prompts: Sequence, t0: float) -> dict:
    """A cell's record of one method: per-prompt correctness (0/1) and answers, accuracy with its
    Wilson interval, ``n``, the seconds since ``t0`` (``time.perf_counter``) and the prompts' length."""
    correct = np.asarray(correct)
    return dict(method=name, correct=correct.astype(int).tolist(), predictions=list(predictions),
                accuracy=float(correct.mean()), wilson=list(stats.wilson(int(correct.sum()), len(correct))),
                n=len(correct), eval_s=time.perf_counter() - t0, tokens=int(len(prompts[0])))


def score_method(name: str, model, variables, prompts: Sequence, tokenizer, *, finite: bool, keyed: bool,
                 max_new: int = 8, batch_size: int = 4, convert_check: Optional[int] = None) -> dict:
    """One method on one cell's prompts: ``scored_row`` plus ``state_floats`` and, for a finite-state
    method, ``converted`` (``converted_check`` of the first ``convert_check`` prompts; None: all, 0:
    none).

    Args:
      name: the method's name in the tables.
      model: the method's model.
      variables: its variables.
      prompts: the cell's ``linicl.data.Prompt``-s, all of one length for a keyed probe.
      tokenizer: decodes the greedy answers.
      finite: the method keeps a fixed-size state (its floats: ``window_floats`` for a window with no
        linear part, ``iclca.state_floats`` otherwise); else a KV cache of the whole prompt.
      keyed: score by ``long_context.key_answered`` (passkey, key-value); else exact match.
      max_new: greedy tokens generated per answer.
      batch_size: prompts per forward pass.
    """
    t0 = time.perf_counter()
    res = evaluate_prompts(model, variables, tokenizer, prompts, label_prefix=" ", max_new_tokens=max_new,
                           batch_size=batch_size, progress=False)
    correct = res.correct
    if keyed:  # passkey / key-value: the answer's first number must be the key
        correct = np.asarray([lc.key_answered(a, p.label) for a, p in zip(res.predictions, prompts)])
    row = scored_row(name, correct, res.predictions, prompts, t0)
    if not finite:
        row["state_floats"] = kv_cache_floats(model.cfg, len(prompts[0]))
        return row
    row["state_floats"] = (window_floats(model.cfg) if model.cfg.feature_map == NO_LINEAR_PART
                           else iclca.state_floats(model.cfg))
    checked = len(prompts) if convert_check is None else min(convert_check, len(prompts))
    if checked:
        row["converted"] = converted_check(model, variables, prompts[:checked], res.predictions[:checked],
                                           tokenizer, max_new)
    return row


def oracle_window(name: str, teacher, variables, prompts: Sequence, tokenizer, *, window: int, sinks: int,
                  max_new: int = 8) -> dict:
    """The teacher with every global layer's attention limited to the first ``sinks`` tokens, the last
    ``window`` and the passkey prompt's key line (``long_context.key_line``; an edit of
    ``hook_attn_scores`` per prompt): what a cache that kept exactly that line could at best give.
    Local (sliding-window) layers keep their own exact windows, as a linearized student keeps them (they
    have no ``hook_attn_scores``; without local layers every layer is edited).
    ``scored_row`` (keyed) with ``state_floats`` the KV of the window, the sinks and the longest line."""
    def keep(x, span, ctx):
        q_pos, k_pos = ctx["q_pos"][:, None], ctx["k_pos"][None, :]
        ok = (k_pos < sinks) | (q_pos - k_pos < window) | ((k_pos >= span[0]) & (k_pos < span[1]))
        return jnp.where(ok, x, -jnp.inf)

    t0, correct, predictions, kept = time.perf_counter(), [], [], []
    for p in prompts:
        span = lc.key_line(p)
        edits = [iv.apply_fn(block_site(layer, "hook_attn_scores"), keep, jnp.asarray(span))
                 for layer in teacher.cfg.global_layers]
        res = evaluate_prompts(teacher, iv.with_edits(variables, edits, teacher.cfg), tokenizer, [p],
                               label_prefix=" ", max_new_tokens=max_new, batch_size=1, progress=False)
        predictions.append(res.predictions[0])
        correct.append(lc.key_answered(res.predictions[0], p.label))
        kept.append(span[1] - span[0])
    return dict(scored_row(name, correct, predictions, prompts, t0),
                state_floats=kv_cache_floats(teacher.cfg, window - 1 + sinks + max(kept)))


def versus_equal_window(cells: Mapping[str, dict], methods: Sequence[str]) -> dict:
    """Each method minus the equal-state window (the largest plain ``window<W>`` of ``methods``), per
    cell, paired over the same prompts (``stats.paired_bootstrap`` of the ``correct`` lists):
    ``dict(reference, differences={cell: {method: [difference, low, high]}})``; ``{}`` without a plain
    window. ``cells``: ``{key: dict(methods={name: scored_row})}``."""
    windows = [m for m in methods if m.startswith("window") and m[len("window"):].isdigit()]
    if not windows:
        return {}
    ref = max(windows, key=lambda m: int(m[len("window"):]))
    out = {}
    for key, c in cells.items():
        if ref not in c["methods"]:
            continue
        base = c["methods"][ref]["correct"]
        out[key] = {m: list(stats.paired_bootstrap(r["correct"], base)) for m, r in c["methods"].items() if m != ref}
    return dict(reference=ref, differences=out)
