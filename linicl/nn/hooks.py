"""Named activation sites: where the forward pass can be read (captured) and edited (intervened on).

Every module of the zoo passes its interesting values through ``site(self, name, x)``. A site does two
things, both driven by variable collections so that the forward pass stays one pure function:

* **edits** stored in ``variables["interventions"]`` under the module's path and the site name (a
  tuple of ``Edit``) are applied to ``x``;
* when the ``"intermediates"`` collection is mutable, the (edited) value is sown there.

A site with neither costs nothing: both checks happen at trace time. The user-facing API (TransformerLens
names such as ``blocks.3.attn.hook_pattern``, ``run_with_cache``, ready-made edits) lives in
``linicl.interventions``; this module only knows module paths.

Site layouts (``pos_axis`` / ``head_axis`` tell an edit where positions and heads are):

* residual-stream sites ``f[batch, seq, d_model]`` (positions on axis 1);
* per-head sites ``hook_q``, ``hook_k``, ``hook_v``, ``hook_z`` ``f[batch, seq, heads, d_head]``;
* ``hook_attn_scores`` (scaled q.k before the causal mask: an added bias can never break causality)
  and ``hook_pattern`` ``f[batch, heads, q_seq, k_seq]`` (query positions on axis 2, heads on axis 1).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from linicl.errors import LiniclError
from linicl.names import EDIT_OPS, INTERMEDIATES, INTERVENTIONS



@struct.dataclass
class Edit:
    """One edit at one site.

    Attributes:
      value: the payload, a pytree of arrays (differentiable): the added vector, the scale, the
        replacement, or the parameters passed to ``fn``. Broadcast against the site's value.
      positions: ``bool[seq]`` or ``bool[batch, seq]`` (query positions for score/pattern sites);
        ``None`` means every position.
      heads: ``bool[heads]`` for per-head sites; ``None`` means every head.
      op: ``"add"`` (x + value), ``"scale"`` (x * value), ``"replace"`` (value), or ``"fn"``
        (``fn(x, value, context)`` with ``context`` a dict of the other values the module has at
        that site, e.g. ``q`` and ``k`` at ``hook_attn_scores``).
      fn: the function of an ``"fn"`` edit (static: a new function retraces).
    """

    value: Any = None
    positions: Optional[jax.Array] = None
    heads: Optional[jax.Array] = None
    op: str = struct.field(pytree_node=False, default="add")
    fn: Optional[Callable] = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        if self.op not in EDIT_OPS:
            raise LiniclError(f"Edit.op must be one of {EDIT_OPS}, got {self.op!r}")
        if (self.op == "fn") != (self.fn is not None):
            raise LiniclError("Edit.fn must be given exactly when op='fn'")


def _mask(edit: Edit, x: jax.Array, name: str, pos_axis: int, head_axis: Optional[int]):
    """The boolean mask (broadcastable to x) of the entries an edit touches, or None for all."""
    mask = None
    if edit.positions is not None:
        p = jnp.asarray(edit.positions)
        T, B = x.shape[pos_axis], x.shape[0]
        if p.dtype != jnp.bool_ or p.shape not in ((T,), (B, T)):
            raise LiniclError(f"Edit.positions at {name} must be bool[{T}] or bool[{B}, {T}] (the "
                              f"site's sequence length); got {p.dtype}{tuple(p.shape)}")
        shape = [1] * x.ndim
        shape[pos_axis] = T
        if p.ndim == 2:
            shape[0] = B
        mask = p.reshape(shape)
    if edit.heads is not None:
        if head_axis is None:
            raise LiniclError(f"Edit.heads given for {name}, which has no head axis")
        h = jnp.asarray(edit.heads)
        H = x.shape[head_axis]
        if h.dtype != jnp.bool_ or h.shape != (H,):
            raise LiniclError(f"Edit.heads at {name} must be bool[{H}], got {h.dtype}{tuple(h.shape)}")
        shape = [1] * x.ndim
        shape[head_axis] = H
        mask = h.reshape(shape) if mask is None else mask & h.reshape(shape)
    return mask


def _check_broadcast(edit: Edit, x: jax.Array, name: str) -> None:
    shape = tuple(jnp.shape(edit.value))
    try:
        ok = jnp.broadcast_shapes(shape, x.shape) == x.shape
    except ValueError:
        ok = False
    if not ok:
        raise LiniclError(f"an edit at {name} has a value of shape {shape}, which does not broadcast to "
                          f"the site's shape {tuple(x.shape)}")


def apply_edit(edit: Edit, x: jax.Array, name: str, pos_axis: int = 1,
               head_axis: Optional[int] = None, context: Optional[Mapping[str, jax.Array]] = None):
    """``x`` with one edit applied (entries outside the edit's mask unchanged, in x's dtype)."""
    if edit.op != "fn":
        _check_broadcast(edit, x, name)
    if edit.op == "fn":
        new = edit.fn(x, edit.value, dict(context or {}))
    elif edit.op == "add":
        new = x + edit.value
    elif edit.op == "scale":
        new = x * edit.value
    else:
        new = jnp.broadcast_to(jnp.asarray(edit.value), x.shape)
    if new.shape != x.shape:
        raise LiniclError(f"an edit at {name} gives shape {tuple(new.shape)}; the site has "
                          f"{tuple(x.shape)} (check the edit's value broadcasts to it)")
    mask = _mask(edit, x, name, pos_axis, head_axis)
    new = new.astype(x.dtype)
    return new if mask is None else jnp.where(mask, new, x)


def site(module: nn.Module, name: str, x: jax.Array, *, pos_axis: int = 1,
         head_axis: Optional[int] = None, context: Optional[Mapping[str, jax.Array]] = None):
    """Pass ``x`` through the named site of ``module``: apply its edits, then capture it."""
    if module.has_variable(INTERVENTIONS, name):
        edits = module.get_variable(INTERVENTIONS, name)
        for edit in (edits if isinstance(edits, (tuple, list)) else (edits,)):
            x = apply_edit(edit, x, f"{'/'.join(module.scope.path)}/{name}", pos_axis, head_axis,
                           context)
    if not module.is_initializing():  # init must not return captured activations as "variables"
        module.sow(INTERMEDIATES, name, x)
    return x
