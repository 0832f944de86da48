"""Activations at named sites over many prompts: ``run_with_cache`` batched, bucketed and sharded.

``collect_activations(model, variables, prompts, names)`` runs every prompt (``linicl.batching``: one
compiled forward per length bucket, the batch sharded over the devices) and keeps, per prompt, each
site reduced over positions: the last real token (the next-token position), the mean over the real
tokens, or a function of the whole padded activation. Edits (``linicl.interventions``) apply before the
activations are read, so an edited site reports its edited value.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from linicl import batching, compiled
from linicl.errors import LiniclError
from linicl.interventions import EditPlan, capture, check_names, full_name, plan_edits
from linicl.names import SCORE_SITES
from linicl.nn.transformer import config_of, position_offset

Reduce = Union[str, Callable]


def _position_axis(name: str) -> int:
    """Where the query positions are: axis 2 at score/pattern sites, axis 1 everywhere else."""
    return 2 if name.endswith(SCORE_SITES) else 1


def _reduce(act: jax.Array, name: str, lengths: jax.Array, how: Reduce, tokens: jax.Array) -> jax.Array:
    if callable(how):
        return how(act, name, tokens, lengths)
    axis = _position_axis(name)
    if how == "last":
        return batching.last_positions(act, lengths, axis)
    moved = jnp.moveaxis(act, axis, 1)  # [b, T, ...]
    T = moved.shape[1]
    real = (jnp.arange(T)[None, :] < lengths[:, None]).reshape(moved.shape[:2] + (1,) * (moved.ndim - 2))
    return jnp.sum(jnp.where(real, moved, 0), axis=1) / lengths.reshape((-1,) + (1,) * (moved.ndim - 2))


def _collect_fn(model, names: tuple, how: Reduce, edit_names: tuple, edits_fn: Optional[Callable],
                with_extras: bool):
    cfg = config_of(model)

    def run(variables, edit_values, tokens, lengths, extras):
        more = (extras,) if with_extras else ()
        variables = EditPlan(edit_names, (), edits_fn).apply(variables, cfg, edit_values, tokens, lengths, *more)
        _, acts = capture(model, variables, tokens, names=list(names), hidden=True)
        return {n: _reduce(acts[n], n, lengths, how, tokens) for n in names}
    key = ("activations.collect", model, names, how, edit_names, edits_fn, with_extras)
    return compiled.get(key, lambda: jax.jit(run))


def collect_activations(model, variables: Mapping, prompts, names: Sequence[str], *, reduce: Reduce = "last",
                        batch_size: int = 16, bucket: Union[int, str] = "geometric", edits=None,
                        extras=None, mesh=None, progress: bool = False) -> dict:
    """Activations at the named sites, reduced over positions, for many prompts: ``{name: np.ndarray[N,
    ...]}`` in the order of the prompts.

    Args:
      prompts: a sequence of ``linicl.data.Prompt`` (or 1-D token arrays), a ``PromptBatch``, or an
        iterable of ``PromptBatch`` (their rows are concatenated).
      names: site names (``linicl.interventions.site_names``; ``("q", 20)`` shorthands work).
      reduce: ``"last"``: each prompt's last real token (the next-token position): ``[N, d_model]`` at
        residual sites, ``[N, heads, d_head]`` at ``hook_q``/``hook_k``, ``[N, heads, k_seq]`` at
        ``hook_pattern``/``hook_attn_scores``, whose key axis is cut (or zero-padded) to the longest
        prompt; ``"mean"``: the mean over each prompt's real tokens; or a function
        ``fn(act, name, tokens, lengths) -> [b, ...]`` (traced, on the padded batch).
      batch_size: as in ``linicl.evaluate``.
      bucket: as in ``linicl.evaluate``.
      edits: as in ``linicl.evaluate``.
      extras: as in ``linicl.evaluate``.
      mesh: as in ``linicl.evaluate``.
    """
    cfg = config_of(model)
    names = tuple(full_name(n) for n in names)
    if not names:
        raise LiniclError("collect_activations: no site names")
    check_names(cfg, names)
    if not (callable(reduce) or reduce in ("last", "mean")):
        raise LiniclError(f"collect_activations: reduce must be 'last', 'mean' or a function, got {reduce!r}")
    rows = batching.as_rows(prompts)
    batching.check_vocab(rows, cfg.vocab_size, "prompts")
    batching.check_room(rows, cfg, position_offset(variables))
    batching.check_extras(extras, len(rows))
    plan = plan_edits(edits, cfg)
    fn = _collect_fn(model, names, reduce, plan.names, plan.fn, extras is not None)
    parts = batching.map_rows(lambda rep, t, le, e: fn(rep[0], rep[1], t, le, e), (variables, plan.values), rows,
                              cfg=cfg, batch_size=batch_size, bucket=bucket, extras=extras, mesh=mesh,
                              progress=progress, desc="activations")
    per_row = batching.gather(parts, len(rows))
    longest = max(len(r) for r in rows)
    result = {}
    for n in names:
        arrays = [row[n] for row in per_row]
        if _position_axis(n) == 2 and not callable(reduce):
            arrays = [_fit_last_axis(a, longest) for a in arrays]
        result[n] = np.stack(arrays)
    return result


def _fit_last_axis(a: np.ndarray, size: int) -> np.ndarray:
    if a.shape[-1] >= size:
        return a[..., :size]
    return np.concatenate([a, np.zeros(a.shape[:-1] + (size - a.shape[-1],), a.dtype)], axis=-1)


__all__ = ["collect_activations", "logprobs_and_window"]


def _window_fn(model, names: tuple, width: int):
    cfg = config_of(model)

    def run(variables, tokens, lengths, start):
        h, acts = capture(model, variables, tokens, names=list(names), hidden=True)
        logits = batching.unembed(cfg, variables["params"], batching.last_positions(h, lengths))
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        z = jnp.stack([acts[n] for n in names])  # [sites, B, T, ...]
        z = jax.lax.dynamic_slice_in_dim(z, start, width, axis=2)
        return lp, z.reshape(z.shape[:3] + (-1,)).astype(jnp.float32)
    return compiled.get(("activations.window", model, names, width), lambda: jax.jit(run))


def logprobs_and_window(model, variables: Mapping, rows: Sequence, names: Sequence[str], start: int, width: int, *,
                        batch_size: int = 16, bucket: Union[int, str] = "geometric") -> tuple:
    """Next-token log-probabilities at each row's last token and the named sites' activations at a
    window of positions, for token rows in their order (one device; no sorting, so a row's outputs
    are where it was).

    Args:
      model: the zoo model.
      variables: its variables (possibly holding a converted prompt).
      rows: token rows, 1-D ``int32[n_i]``, each with ``n_i >= 1``.
      names: sites (``linicl.names``), e.g. ``block_site(l, "hook_z")`` for every layer ``l``.
      start: the window's first position, the same in every row.
      width: the window's length: positions ``start .. start + width - 1`` (positions past a row's end
        hold padding's activations: mask them by the row's length).
      batch_size: rows per compiled call (the last batch padded with copies of a row, dropped).
      bucket: ``batching.bucket_length``'s rule for the padded length.
    Returns:
      ``(lp f32[N, vocab], z f32[sites, N, width, features])``, every site's trailing axes flattened
      (``hook_z``: heads times d_head).
    Raises:
      LiniclError: the bucket cannot hold the window, or non-finite log-probabilities.
    """
    if len(rows) == 0:
        raise LiniclError("rows: no token rows")
    cfg = config_of(model)
    lengths = np.asarray([len(r) for r in rows], np.int32)
    T = batching.bucket_length(max(int(lengths.max()), start + width), bucket,
                               cfg.max_len if cfg.positions == "learned" else None)
    if T < start + width:
        raise LiniclError(f"rows of {T} positions cannot hold start {start} + width {width}")
    tokens = batching.pad_tokens(rows, T)
    fn = _window_fn(model, tuple(names), width)
    lps, zs = [], []
    B = min(batch_size, len(rows))
    for i in range(0, len(rows), B):
        t, le = batching.pad_rows(tokens[i:i + B], B), batching.pad_rows(lengths[i:i + B], B)
        lp, z = fn(variables, jnp.asarray(t), jnp.asarray(le), jnp.asarray(start, jnp.int32))
        m = min(B, len(rows) - i)
        lps.append(np.asarray(lp)[:m])
        zs.append(np.asarray(z)[:, :m])
    lp, z = np.concatenate(lps), np.concatenate(zs, axis=1)
    if not np.all(np.isfinite(lp)):
        raise LiniclError("non-finite log-probabilities")
    return lp, z
