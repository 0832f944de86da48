"""How well a method reproduces a reference model on the same queries: its accuracy and, against the
reference (the prompted model, for a prompt stored by ``linicl.iclca.convert_approx``), the agreement
of predictions, the KL of next-token distributions and the per-layer error of attention outputs.

Inputs are NumPy arrays over the same N queries: ``lp: f[N, vocab]``, the log-probabilities at each
query's last token; ``z: f[layers, N, width, features]``, an activation (the attention output
``hook_z``, heads concatenated) at each query's tokens, the first ``lengths[i]`` of ``width`` real.

``copy_test`` is the synthetic test of iclca.md section 7: a random prompt, then an input repeating its
start, which the prompted model copies (induction); every method is scored against it.
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from linicl import batching, stats
from linicl.errors import LiniclError
from linicl.metrics import kl_rows, layer_rel_errors, log_normalize

__all__ = ["predict", "method_scores", "copy_test"]


def predict(lp, label_ids=None) -> np.ndarray:
    """The predicted token per row of ``lp: f[N, vocab]``, ``int[N]``: the argmax over ``label_ids``
    (classification: label-restricted argmax, as ``linicl.evaluate`` scores) or, when None, over the
    whole vocabulary."""
    lp = np.asarray(lp)
    if lp.ndim != 2:
        raise LiniclError(f"predict: lp must be [rows, vocab], got shape {lp.shape}")
    if label_ids is None:
        return np.argmax(lp, axis=-1)
    return np.asarray(label_ids)[np.argmax(lp[:, label_ids], axis=-1)]


def method_scores(lp, z, ref: Optional[dict], gold_ids, label_ids, kl_ids, lengths) -> dict:
    """One method's scores on N queries.

    Args:
      lp: the method's log-probabilities ``f[N, vocab]``.
      z: the method's activations ``f[layers, N, width, d]``.
      ref: None (the method is the reference), or the reference's ``dict(lp, z, pred)`` (``pred``:
        its ``predict``).
      gold_ids: ``int[N]``, the correct token per query.
      label_ids: the label words' tokens (label-restricted argmax), or None (whole vocabulary).
      kl_ids: the tokens the restricted KL is taken over (renormalised), or None (no restricted KL).
      lengths: ``int[N]``, each query's real positions in ``z``.
    Returns:
      ``accuracy``, its 95 % Wilson ``ci_low``/``ci_high``, per-query ``correct`` (0/1) and
      ``predictions``, ``distinct`` predictions and ``constant`` (one prediction for every query); with
      ``ref`` also ``agree_with_prompt`` (fraction of equal predictions), ``kl_full_mean``/``_median``
      and ``kl_full`` (per query, over the vocabulary), ``kl_label_mean``/``_median`` (over
      ``kl_ids``; None without), ``layer_rel_err``/``layer_rel_err_last`` (``metrics.layer_rel_errors``)
      and ``rel_err_mean_over_layers``.
    """
    pred = predict(lp, label_ids)
    gold_ids = np.asarray(gold_ids)
    if gold_ids.shape != pred.shape:
        raise LiniclError(f"method_scores: gold_ids must hold one token per query ({pred.shape}), got "
                          f"shape {gold_ids.shape}")
    correct = pred == gold_ids
    iv = stats.wilson(int(correct.sum()), correct.size)
    distinct = len(np.unique(pred))
    out = dict(accuracy=iv.value, ci_low=iv.low, ci_high=iv.high, correct=correct.astype(int).tolist(),
               predictions=pred.tolist(), distinct=distinct, constant=bool(pred.size > 1 and distinct == 1))
    if ref is None:
        return out
    kl_full = kl_rows(ref["lp"], lp)
    kl_label = kl_rows(ref["lp"][:, kl_ids], lp[:, kl_ids]) if kl_ids is not None else None
    err, err_last = layer_rel_errors(z, ref["z"], lengths)
    out.update(agree_with_prompt=float(np.mean(pred == ref["pred"])),
               kl_full_mean=float(np.mean(kl_full)), kl_full_median=float(np.median(kl_full)),
               kl_full=kl_full.tolist(),
               kl_label_mean=None if kl_label is None else float(np.mean(kl_label)),
               kl_label_median=None if kl_label is None else float(np.median(kl_label)),
               layer_rel_err=err, layer_rel_err_last=err_last, rel_err_mean_over_layers=float(np.mean(err)))
    return out


def _copy_scores(acc: dict, logits: np.ndarray, ref: np.ndarray, target: np.ndarray) -> None:
    """Append one pair's scores (``logits``, ``ref``: ``f64[m, vocab]``; ``target``: ``int[m]``) to ``acc``."""
    lp = log_normalize(logits)
    acc["rel_err"].append(float(np.linalg.norm(logits - ref) / np.linalg.norm(ref)))
    acc["kl"].append(float(np.mean(kl_rows(ref, logits))))
    acc["agree"].append(float(np.mean(np.argmax(logits, -1) == np.argmax(ref, -1))))
    acc["copy_acc"].append(float(np.mean(np.argmax(logits, -1) == target)))
    acc["nll"].append(float(-np.mean(lp[np.arange(len(target)), target])))


def _summary(a: dict) -> dict:
    return dict(pairs=len(a["rel_err"]), logit_rel_err_mean=float(np.mean(a["rel_err"])),
                logit_rel_err_median=float(np.median(a["rel_err"])), kl_mean=float(np.mean(a["kl"])),
                kl_median=float(np.median(a["kl"])), argmax_agree=float(np.mean(a["agree"])),
                copy_acc=float(np.mean(a["copy_acc"])), copy_nll=float(np.mean(a["nll"])),
                per_pair=dict(rel_err=a["rel_err"], kl=a["kl"], agree=a["agree"], copy_acc=a["copy_acc"]))


def copy_test(model, variables, methods: Mapping[str, tuple], *, prompt_len: int, input_len: int, pairs: int,
              low: int, batch: int, seed: int, progress: bool = False) -> dict:
    """The synthetic copy test: per pair, a prompt r of ``prompt_len`` = P uniform random tokens of
    ``[low, vocab)`` and the input r[:m] (``input_len`` = m); the prompted model reads r + r[:m] and
    copies (the target at input position i is r[i + 1]). ``"zero"`` (the input alone) and every method
    are scored against it at the input's m positions: the logits' relative error ||l - l_ref|| /
    ||l_ref||, KL(prompted || method), argmax agreement, copy accuracy and the copy NLL.

    Args:
      model: the zoo model.
      variables: its plain variables (no prompt stored).
      methods: ``{name: (convert, per_prompt)}`` with ``convert(prompts int32[b, P], fit_inputs) ->
        variables`` holding the prompts (row i serving input row i). ``per_prompt``: converted one prompt
        at a time with ``fit_inputs`` ``int32[w, m]``, the prompt's later windows ``r[j:j + m]`` (j = m,
        2m, ... <= P - m; None when there are none), e.g. for a least-squares fit; else a batch at a
        time with ``fit_inputs=None``. A method whose ``convert`` raises ``LiniclError`` is skipped
        (recorded once).
      prompt_len: P, the prompt's length.
      input_len: m, the input's length.
      pairs: the number of prompt/input pairs.
      low: the lowest token drawn (tokens below it, e.g. special ones, are left out).
      batch: pairs per forward pass (the last batch padded with copies, dropped).
      seed: the pairs come from ``numpy.random.default_rng([seed, 21])``.
    Returns:
      ``dict(settings, methods={name: dict(pairs, logit_rel_err_mean/_median, kl_mean/_median,
      argmax_agree, copy_acc, copy_nll, per_pair)}, skipped=[dict(method, reason)])``.
    """
    vocab = model.cfg.vocab_size
    P, m = prompt_len, input_len
    if not 1 <= m < P:  # the copy target of input position i is r[i + 1]
        raise LiniclError(f"copy_test: input_len must be in [1, prompt_len - 1 = {P - 1}], got {m}")
    if not 0 <= low < vocab:
        raise LiniclError(f"copy_test: low must be in [0, vocab = {vocab}), got {low}")
    rng = np.random.default_rng([seed, 21])
    fwd = jax.jit(lambda v, t: model.apply(v, t))
    acc = {n: dict(rel_err=[], kl=[], agree=[], copy_acc=[], nll=[]) for n in ["prompt", "zero", *methods]}
    skipped = []
    fit_windows = [(j, j + m) for j in range(m, P - m + 1, m)]
    rows = [rng.integers(low, vocab, size=P).astype(np.int32) for _ in range(pairs)]
    sb = max(1, min(batch, pairs))
    bar = tqdm(total=pairs, desc="synthetic", disable=not progress, leave=False)
    for i in range(0, pairs, sb):
        nb = min(sb, pairs - i)
        R = batching.pad_rows(np.stack(rows[i:i + nb]), sb)  # [sb, P]; padding rows (copies) are dropped
        inp = R[:, :m]
        ref = np.asarray(fwd(variables, jnp.asarray(np.concatenate([R, inp], 1))))[:nb, P:].astype(np.float64)
        outs = {"prompt": ref, "zero": np.asarray(fwd(variables, jnp.asarray(inp)))[:nb].astype(np.float64)}
        for name, (convert, per_prompt) in methods.items():
            try:
                if per_prompt:
                    out = np.concatenate([np.asarray(fwd(convert(
                        R[j], np.stack([R[j, a:b] for a, b in fit_windows]) if fit_windows else None),
                        jnp.asarray(inp[j:j + 1]))) for j in range(nb)])
                else:  # a batch of prompts, each serving its own input
                    out = np.asarray(fwd(convert(R, None), jnp.asarray(inp)))[:nb]
            except LiniclError as e:
                if not any(s["method"] == name for s in skipped):
                    skipped.append(dict(method=name, reason=str(e)))
                continue
            outs[name] = out.astype(np.float64)
        for j in range(nb):
            for name, lgs in outs.items():
                _copy_scores(acc[name], lgs[j], ref[j], R[j, 1:m + 1])
        bar.update(nb)
    bar.close()
    return dict(settings=dict(pairs=pairs, prompt_len=P, input_len=m, token_low=low, vocab=vocab,
                              fit_windows=fit_windows,
                              description="prompt = P uniform random tokens in [low, vocab); input = its "
                                          "first m tokens; scored at the input's m positions; copy target "
                                          "= the prompt's next token; lsq fits on later windows of the "
                                          "prompt (not the input)"),
                methods={name: _summary(a) for name, a in acc.items() if a["rel_err"]}, skipped=skipped)
