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
      batch_size, bucket, edits, extras, mesh: as in ``linicl.evaluate``.
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


__all__ = ["collect_activations"]
