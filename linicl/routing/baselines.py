"""The task-vector baseline: the few-shot minus zero-shot mean last-token residual after one layer,
added back at each zero-shot query's last token."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from linicl import compiled
from linicl.interventions import add, at_last
from linicl.names import block_site
from linicl.activations import collect_activations


def task_vector(model, variables, few_shot, zero_shot, layer: int, *, batch_size: int = 16) -> np.ndarray:
    """The task-vector baseline: mean last-token residual after ``layer`` over few-shot prompts minus
    the same mean over zero-shot prompts (added at the query's last token at inference,
    ``task_vector_edits``)."""
    site = block_site(layer, "hook_resid_post")
    fs = collect_activations(model, variables, few_shot, [site], batch_size=batch_size)[site]
    zs = collect_activations(model, variables, zero_shot, [site], batch_size=batch_size)[site]
    return fs.mean(axis=0) - zs.mean(axis=0)


def task_vector_edits(vector: Any, layer: int):
    """An ``edits`` function for ``linicl.evaluate``: add a task vector to the residual after ``layer``
    at each prompt's last token.

    * ``vector: [d_model]``: ``edits(tokens, lengths)``, the vector is a constant of the compiled forward.
    * ``vector=None``: ``edits(tokens, lengths, vectors)`` reading one vector per prompt from the
      harness's ``extras`` (``[n_prompts, d_model]``). The function is the same object for every call
      with this ``layer``, so evaluating many tasks (many vectors) compiles the forward once."""
    if vector is None:
        return _per_row_edits(int(layer))
    v = jnp.asarray(vector, jnp.float32)

    def edits(tokens, lengths):
        return _add_at_last(layer, v, tokens, lengths)
    return edits


def _add_at_last(layer, v, tokens, lengths):
    v = v if v.ndim == 1 else v[:, None, :]  # one vector for all rows, or one per row
    return [add(block_site(layer, "hook_resid_post"), v.astype(jnp.float32),
                positions=at_last(lengths, tokens.shape[1]))]


def _per_row_edits(layer: int):
    """One function object per layer: the harness keys its compiled forward on it."""
    def build():
        def edits(tokens, lengths, vectors):
            return _add_at_last(layer, jnp.asarray(vectors), tokens, lengths)
        return edits
    return compiled.get(("routing.task_vector_extras", layer), build)
