"""The function-vector baseline (Todd et al., ICLR 2024, arXiv 2310.15213), one of ICR's training-free
baselines (routing.md section 3).

A few attention heads carry the task of a few-shot prompt to its last token. With ``z[l, h]`` the output
of head h of layer l (``hook_z``, before the output projection ``o``) at the last token:

    mean_z[l, h] = mean over clean few-shot prompts of z[l, h]                      f[layers, heads, d_head]
    effect[l, h] = mean over corrupted prompts (demo labels made wrong) of
                   p(gold | z[l, h] := mean_z[l, h]) - p(gold)                      (causal indirect effect)
    FV           = sum over the n_heads heads of largest effect of  mean_z[l, h] @ W_o[l, h]     f[d_model]

and the FV is added to the residual stream at one layer (Todd et al.: |L| / 3) at the zero-shot query's
last token (``task_vector_edits`` applies it). ``p(gold)`` is the softmax over the vocabulary of the
gold answer's first content token (``linicl.evaluate.first_content_targets`` makes the rows and targets).

Two ways to measure the effects (``linicl.names.FV_EFFECTS``):

* ``"patching"``: exact, one forward per head and batch (``layers * heads`` forwards of the corrupted
  prompts). One compiled forward serves every head: the patch is a replace edit at every layer's
  ``hook_z`` whose head mask is an argument.
* ``"attribution"``: attribution patching, the first-order estimate ``(mean_z - z) . d p / d z`` of the
  same difference, from one forward and backward per batch for every head at once. It is the
  derivative of ``p`` along the straight line from ``z`` to ``mean_z`` (the tests check it against a
  finite difference), not the patching effect itself: use it to screen heads, then patch the best
  (``function_vector_heads``).

With a sandwich norm (Gemma) the head's contribution passes through the post-attention norm before the
residual; ``mean_z @ W_o`` is then its contribution before that norm, and the FV an approximation of
what Todd et al. add.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import batching, compiled
from linicl.activations import collect_activations
from linicl.errors import LiniclError
from linicl.interventions import add, at_last, capture, replace, with_edits
from linicl.names import FV_EFFECTS, block_site, layer_scope
from linicl.nn.transformer import config_of, unembed


def _z_sites(n_layers: int) -> list:
    return [block_site(l, "hook_z") for l in range(n_layers)]


def mean_head_outputs(model, variables, prompts, *, batch_size: int = 8) -> np.ndarray:
    """``f[layers, heads, d_head]``: each head's output (``hook_z``) at the last token, averaged over
    ``prompts`` (clean few-shot prompts, ``linicl.data.Prompt`` or token arrays)."""
    names = _z_sites(config_of(model).n_layers)
    acts = collect_activations(model, variables, prompts, names, batch_size=batch_size)
    return np.stack([acts[n].mean(axis=0) for n in names])


def _gold_prob(cfg, variables, h, lengths, gold):
    logits = unembed(cfg, variables["params"], batching.last_positions(h, lengths))
    return jax.nn.softmax(logits, axis=-1)[jnp.arange(h.shape[0]), gold]


def _patched_prob(model):
    """``fn((variables, mean_z, mask), tokens, lengths, gold) -> p(gold)[b]`` with ``z[l, h]`` replaced
    by ``mean_z[l, h]`` at the last token wherever ``mask[l, h]`` (all False: the clean run)."""
    cfg = model.cfg
    names = _z_sites(cfg.n_layers)

    def run(rep, tokens, lengths, gold):
        variables, mean_z, mask = rep
        pos = at_last(lengths, tokens.shape[1])
        edits = [replace(n, mean_z[l], positions=pos, heads=mask[l]) for l, n in enumerate(names)]
        h = model.apply(with_edits(variables, edits, cfg), tokens, hidden=True)
        return _gold_prob(cfg, variables, h, lengths, gold)
    return compiled.get(("routing.fv_patched", model), lambda: jax.jit(run))


def _attribution(model):
    """``fn((variables, mean_z), tokens, lengths, gold) -> f[b, layers, heads]``: per row,
    ``(mean_z - z) . d p(gold) / d z`` at the last token."""
    cfg = model.cfg
    names = _z_sites(cfg.n_layers)

    def run(rep, tokens, lengths, gold):
        variables, mean_z = rep
        pos = at_last(lengths, tokens.shape[1])

        def prob(delta):  # delta: f[layers, b, heads, d_head], added at the last token
            edits = [add(n, delta[l][:, None], positions=pos) for l, n in enumerate(names)]
            h, acts = capture(model, with_edits(variables, edits, cfg), tokens, names=names, hidden=True)
            z = jnp.stack([batching.last_positions(acts[n], lengths) for n in names])
            return _gold_prob(cfg, variables, h, lengths, gold).sum(), z

        zeros = jnp.zeros((cfg.n_layers, tokens.shape[0]) + mean_z.shape[1:], mean_z.dtype)
        grad, z = jax.grad(prob, has_aux=True)(zeros)
        return jnp.einsum("lbhd,lbhd->blh", mean_z[:, None] - z, grad)
    return compiled.get(("routing.fv_attribution", model), lambda: jax.jit(run))


def _check_inputs(cfg, rows, gold_ids, mean_z):
    gold_ids = np.asarray(gold_ids)
    if gold_ids.shape != (len(rows),) or not np.issubdtype(gold_ids.dtype, np.integer):
        raise LiniclError(f"head_effects: gold_ids must be int[{len(rows)}] (one target per row), got "
                          f"{gold_ids.dtype}{gold_ids.shape}")
    if np.any((gold_ids < 0) | (gold_ids >= cfg.vocab_size)):
        raise LiniclError(f"head_effects: gold_ids must be token ids in [0, {cfg.vocab_size})")
    want = (cfg.n_layers, cfg.n_heads, cfg.head_dim)
    if np.shape(mean_z) != want:
        raise LiniclError(f"head_effects: mean_z must be f{list(want)} (mean_head_outputs), got "
                          f"{list(np.shape(mean_z))}")
    return gold_ids.astype(np.int32)


def head_effects(model, variables, rows, gold_ids, mean_z, *, method: str = "patching",
                 heads: Optional[Sequence[tuple]] = None, batch_size: int = 8) -> np.ndarray:
    """``f[layers, heads]``: each head's average effect on ``p(gold)`` over corrupted prompts when its
    last-token output is set to ``mean_z`` (``method="patching"``) or the first-order estimate of it
    (``"attribution"``). ``heads``: the ``(layer, head)`` pairs to patch (default all; the others are
    NaN); attribution always gives every head.

    Args:
      rows: corrupted prompts, teacher-forced to the gold answer's content token
        (``first_content_targets``); ``gold_ids: int[n]`` that token per row.
      mean_z: ``f[layers, heads, d_head]`` from ``mean_head_outputs`` on clean prompts.
    """
    cfg = config_of(model)
    if method not in FV_EFFECTS:
        raise LiniclError(f"head_effects: method must be one of {FV_EFFECTS}, got {method!r}")
    rows = batching.as_rows(rows)
    gold = _check_inputs(cfg, rows, gold_ids, mean_z)
    mean_z = jnp.asarray(mean_z, cfg.jnp_dtype)
    run = dict(cfg=cfg, batch_size=batch_size, extras=gold)
    if method == "attribution":
        per_row = batching.gather(batching.map_rows(_attribution(model), (variables, mean_z), rows, **run), len(rows))
        return np.mean(np.stack(per_row), axis=0)
    heads = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)] if heads is None else list(heads)
    for pair in heads:
        if not (len(pair) == 2 and 0 <= pair[0] < cfg.n_layers and 0 <= pair[1] < cfg.n_heads):
            raise LiniclError(f"head_effects: heads must be (layer, head) pairs within ({cfg.n_layers}, "
                              f"{cfg.n_heads}), got {pair!r}")
    fn = _patched_prob(model)

    def mean_prob(mask):
        parts = batching.map_rows(fn, (variables, mean_z, jnp.asarray(mask)), rows, **run)
        return float(np.mean(np.concatenate([np.asarray(p) for _, p in parts])))

    mask = np.zeros((cfg.n_layers, cfg.n_heads), bool)
    clean = mean_prob(mask)
    out = np.full(mask.shape, np.nan)
    for l, h in heads:
        mask[l, h] = True
        out[l, h] = mean_prob(mask) - clean
        mask[l, h] = False
    return out


def top_heads(effects: np.ndarray, n_heads: int) -> list:
    """The ``n_heads`` ``(layer, head)`` pairs of largest effect (NaN never chosen), best first."""
    effects = np.asarray(effects, float)
    n_valid = int(np.sum(~np.isnan(effects)))
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or not 1 <= n_heads <= n_valid:
        raise LiniclError(f"top_heads: n_heads must be an int in [1, {n_valid}] (the heads with an effect), "
                          f"got {n_heads!r}")
    order = np.argsort(np.where(np.isnan(effects), -np.inf, effects), axis=None)[::-1][:n_heads]
    return [tuple(int(i) for i in np.unravel_index(j, effects.shape)) for j in order]


def function_vector(model, variables, mean_z, heads: Sequence[tuple]) -> np.ndarray:
    """``f[d_model]``: the sum over ``heads`` (``(layer, head)`` pairs) of ``mean_z[l, h] @ W_o[l, h]``,
    each head's mean contribution to the attention output (without the output bias)."""
    cfg = config_of(model)
    params = variables["params"]
    total = np.zeros(cfg.d_model)
    for l, h in heads:
        W_o = np.asarray(params[layer_scope(l)]["attn"]["o"]["kernel"])  # [heads, d_head, d_model]
        total += np.asarray(mean_z[l][h], float) @ W_o[h].astype(float)
    return total


def function_vector_heads(model, variables, rows, gold_ids, mean_z, *, n_heads: int = 10,
                          screen: Optional[int] = None, batch_size: int = 8) -> tuple:
    """``(heads, effects)``: the ``n_heads`` heads of largest patching effect. With ``screen``, only the
    ``screen`` heads of largest attribution are patched (the rest of ``effects`` is NaN), which costs
    ``screen`` forwards per batch instead of ``layers * heads``."""
    cfg = config_of(model)
    pairs = None
    if screen is not None:
        attr = head_effects(model, variables, rows, gold_ids, mean_z, method="attribution", batch_size=batch_size)
        pairs = top_heads(attr, min(int(screen), cfg.n_layers * cfg.n_heads))
    effects = head_effects(model, variables, rows, gold_ids, mean_z, heads=pairs, batch_size=batch_size)
    return top_heads(effects, n_heads), effects


__all__ = ["mean_head_outputs", "head_effects", "top_heads", "function_vector", "function_vector_heads"]
