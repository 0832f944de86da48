"""A converted prompt as a file: convert once, query in any later process.

``save(path, model, converted)`` writes the prompt collections of a converted variables dict (``prompt_state``
of ``iclca.convert``, ``prompt_approx`` of ``iclca.convert_approx`` with or without a selection, and
``position``) through ``linicl.checkpoint`` (safetensors, written atomically), with the model's config
and a checksum of its parameters; ``load(path, model, variables)`` gives back ``{**variables, **prompt}``
and refuses a file written for another model or other parameters::

    converted = iclca.convert_approx(model, variables, prompt, "none", keep=0.1, score="reconstruction")
    prompt_file.save("contract.prompt", model, converted)
    ...                                                   # a fresh process
    converted = prompt_file.load("contract.prompt", model, variables)
    model.apply(converted, question)                      # the same logits, bit for bit

The parameters are not stored (they are the model's own); the file holds only what the prompt adds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import jax
import numpy as np
from flax import traverse_util

from linicl import checkpoint
from linicl.errors import DataError, LiniclError
from linicl.iclca import PromptApprox
from linicl.names import PARAMS, PROMPT_APPROX, PROMPT_COLLECTIONS
from linicl.nn.transformer import config_of

__all__ = ["save", "load"]

_ARRAYS = ("B", "b", "W", "sink_k", "sink_v", "sink_pos", "phi_W", "phi_b", "g")  # PromptApprox's arrays
_STATIC = ("kernel", "lam")


def _settings(model_cfg, params) -> dict:
    return {"config": repr(model_cfg), "params": checkpoint.checksum(params)}


def _flat(converted: Mapping) -> tuple:
    """``(arrays {name: array}, approx {layer path: static fields and the arrays present})``."""
    arrays, approx = {}, {}
    for collection in PROMPT_COLLECTIONS:
        for path, leaf in traverse_util.flatten_dict(dict(converted.get(collection, {}))).items():
            name = "/".join((collection,) + path)
            if isinstance(leaf, PromptApprox):
                present = [f for f in _ARRAYS if getattr(leaf, f) is not None]
                approx[name] = {"static": {f: getattr(leaf, f) for f in _STATIC}, "arrays": present}
                arrays.update({f"{name}/{f}": np.asarray(getattr(leaf, f)) for f in present})
            else:
                arrays[name] = np.asarray(leaf)
    return arrays, approx


def save(path, model, converted: Mapping) -> Path:
    """Write the prompt that ``converted`` (``iclca.convert`` or ``convert_approx`` variables of
    ``model``) holds to ``path``, with ``model``'s config and a checksum of the parameters, so that
    ``load`` can refuse another model. Returns the path."""
    if not isinstance(converted, Mapping) or PARAMS not in converted:
        raise LiniclError("converted must be a variables dict with 'params' and a converted prompt")
    if not any(c in converted for c in PROMPT_COLLECTIONS):
        raise LiniclError(f"converted holds no prompt (none of {PROMPT_COLLECTIONS}): convert one first")
    arrays, approx = _flat(converted)
    meta = {"arrays": {k: [list(a.shape), a.dtype.name] for k, a in arrays.items()}, "approx": approx}
    return checkpoint.save(path, _nested(arrays), settings=_settings(config_of(model), converted[PARAMS]),
                           meta=meta)


def _nested(flat: Mapping) -> dict:
    """``{"a/b/c": x}`` -> ``{"a": {"b": {"c": x}}}`` (checkpoint names join the tree's keys by '/')."""
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def load(path, model, variables: Mapping) -> dict:
    """``{**variables, **prompt}``: the prompt stored at ``path`` put back into ``variables`` (the
    model's own, with no prompt). Raises DataError when the file was written for another config or
    other parameters (naming what differs), is not a prompt file, or is damaged."""
    if not isinstance(variables, Mapping) or PARAMS not in variables:
        raise LiniclError("variables must be the model's variables dict (with 'params')")
    head = checkpoint.header(path)
    shapes, approx = head.meta.get("arrays"), head.meta.get("approx")
    if not isinstance(shapes, dict) or not isinstance(approx, dict):
        raise DataError(f"{path} is a linicl checkpoint but not a prompt file (prompt_file.save writes them)")
    template = {k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for k, (s, d) in shapes.items()}
    tree, _ = checkpoint.load(path, _nested(template), settings=_settings(config_of(model), variables[PARAMS]))
    arrays = {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}
    flat = {}
    for layer, spec in approx.items():
        fields = {f: arrays.pop(f"{layer}/{f}") for f in spec["arrays"]}
        flat[tuple(layer.split("/"))] = PromptApprox(**{f: fields.get(f) for f in _ARRAYS}, **spec["static"])
    flat.update({tuple(k.split("/")): v for k, v in arrays.items()})
    prompt = traverse_util.unflatten_dict(flat)
    return {**{k: v for k, v in variables.items() if k not in PROMPT_COLLECTIONS}, **prompt}
