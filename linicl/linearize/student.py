"""The linear-attention student of a softmax teacher, and which of its parameters attention transfer
trains.

The student is the teacher's ``ModelConfig`` with ``attention="linear"``, the learned ``"hedgehog"``
feature map (normalised: its features are positive) and, optionally, LoLCATs' exact softmax window
and attention sinks, and LoLA's sparse cache of exact tokens beside them (``cache``). The cache has
no parameters: maps trained without it (e.g. the shipped SmolLM2 maps, ``load_maps``) serve a student
with one unchanged, ``Transformer(student.cfg.replace(cache=C))`` with the same variables. Rope sits
on the inputs of the maps (``rope_on="inputs"``, as LoLCATs does for
rope-trained teachers: the maps see the same rotated q, k the teacher's softmax saw); a converted
student then keeps the prompt's absolute positions (``position`` collection). Every other weight is
the teacher's, unchanged: only the maps (``phi_q_W``, ``phi_q_b``, ``phi_k_W``, ``phi_k_b``) and, with
a window or sinks, the per-head ``gate`` of the exact part are new, and only they train.
"""

from __future__ import annotations

from typing import Mapping, Tuple

import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.errors import ConfigError, LiniclError
from linicl.names import CACHE_RULES, NO_LINEAR_PART, PARAMS

TRAINED = ("phi_q_W", "phi_q_b", "phi_k_W", "phi_k_b", "gate")


def trained_layers(cfg: ModelConfig) -> Tuple[int, ...]:
    """The blocks that get maps: every block, or only the global ones of a model with local layers
    (Gemma's sliding windows are finite states already and the student keeps them exact; their
    per-head window gates, which cancel in a window with no linear part, get no gradient)."""
    return cfg.global_layers


def student_config(teacher: ModelConfig, *, window: int = 16, sinks: int = 4, feature_size: int = 0,
                   rope_on: str = "inputs", cache: int = 0, cache_rule: str = "recall") -> ModelConfig:
    """The student of a softmax ``teacher`` config (any position option; rope_on applies to rope).
    ``cache``, ``cache_rule``: ``ModelConfig.cache`` and how it chooses (needs a window or sinks; the
    model then runs the recurrent form)."""
    if not isinstance(teacher, ModelConfig) or teacher.attention != "softmax":
        raise LiniclError(f"student_config needs the ModelConfig of a softmax teacher, got "
                          f"{getattr(teacher, 'attention', type(teacher).__name__)!r}")
    if not teacher.causal:
        raise LiniclError("student_config: the teacher must be causal (a linear state is causal)")
    return teacher.replace(attention="linear", feature_map="hedgehog", feature_size=feature_size,
                           normalize=True, window=window, sinks=sinks, cache=cache, cache_rule=cache_rule,
                           rope_on=rope_on if teacher.positions == "rope" else "features")


def student_variables(student, teacher_variables: Mapping, seed: int = 0) -> dict:
    """The student's variables: its new parameters at their initial values (identity maps, gate 0),
    every other parameter the teacher's (same names and shapes: checked)."""
    tokens, key = jnp.zeros((1, 1), jnp.int32), jax.random.PRNGKey(seed)
    # Only the new parameters are drawn: the program returns nothing else, so XLA drops the draws of
    # the teacher-shaped ones (SmolLM2: 34 -> 3 s); their shapes come from an abstract init.
    new = jax.jit(lambda k: split(student.init(k, tokens)[PARAMS])[0])(key)
    _, student_rest = split(jax.eval_shape(student.init, key, tokens)[PARAMS])
    _, teacher_rest = split(teacher_variables[PARAMS])
    want = jax.tree_util.tree_structure(student_rest)
    if jax.tree_util.tree_structure(teacher_rest) != want:
        raise LiniclError("the teacher's parameters do not match the student's (another architecture?)")
    for a, b in zip(jax.tree_util.tree_leaves(teacher_rest), jax.tree_util.tree_leaves(student_rest)):
        if a.shape != b.shape:
            raise LiniclError(f"a teacher parameter has shape {a.shape}, the student expects {b.shape}")
    return {PARAMS: merge(new, teacher_rest)}


def _is_trained(path) -> bool:
    return getattr(path[-1], "key", None) in TRAINED


def split(params) -> Tuple[dict, dict]:
    """``(trained, frozen)``: two trees of the same nesting, each holding only its own leaves."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    trained, frozen = {}, {}
    for path, leaf in flat:
        target = trained if _is_trained(path) else frozen
        node = target
        for key in path[:-1]:
            node = node.setdefault(key.key, {})
        node[path[-1].key] = leaf
    return trained, frozen


def merge(trained, frozen) -> dict:
    """The inverse of ``split``: one params tree."""
    out = dict(frozen)
    for key, value in trained.items():
        out[key] = merge(value, out.get(key, {})) if isinstance(value, Mapping) else value
    return out


def window_config(teacher: ModelConfig, *, window: int, sinks: int = 4, cache: int = 0,
                  cache_rule: str = "attention") -> ModelConfig:
    """The untrained baseline of a student: the teacher's softmax restricted to its first ``sinks``
    tokens and its last ``window`` (sliding-window attention with sinks, StreamingLLM), with no linear
    part (``feature_map="none"``) and no maps to train. A finite state like the student's (its KV is
    that of ``window - 1 + sinks`` tokens), so prompts convert exactly. Its variables:
    ``student_variables(Transformer(cfg), teacher_variables)`` (its per-head window gates cancel between
    numerator and denominator, up to the model's own epsilon). ``cache``: also keep that many tokens
    that left the window, per key/value head, chosen by ``cache_rule`` (default "attention": with no
    linear part, LoLA's "recall" score is just |v|^2). ``cache_rule`` must be one of ``CACHE_RULES`` even with
    ``cache=0`` (where it has nothing to choose and the config keeps "recall"): a misspelt rule is
    refused, not dropped."""
    if not isinstance(cache_rule, str) or cache_rule not in CACHE_RULES:  # as ModelConfig would refuse it
        raise ConfigError(f"window_config: cache_rule must be one of {CACHE_RULES}, got {cache_rule!r}")
    if not isinstance(teacher, ModelConfig) or teacher.attention != "softmax":
        raise LiniclError(f"window_config needs the ModelConfig of a softmax teacher, got "
                          f"{getattr(teacher, 'attention', type(teacher).__name__)!r}")
    if not teacher.causal:
        raise LiniclError("window_config: the teacher must be causal")
    return teacher.replace(attention="linear", feature_map=NO_LINEAR_PART, normalize=True, window=window,
                           sinks=sinks, cache=cache, cache_rule=cache_rule if cache else "recall",
                           rope_on="inputs" if teacher.positions == "rope" else "features")
