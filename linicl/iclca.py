"""ICLCA: exact conversion of a prompt into linear-attention bias terms (arXiv 2406.02847).

In causal linear attention a prompt acts on later tokens only through each layer's and head's state
(S = sum phi(k) v^T, z = sum phi(k)). ``convert`` runs the model once over the prompt and stores every
layer's final state, re-based for rope, plus the position offset for learned positions, in the
``"iclca"`` collection of an ordinary variables dict::

    converted = convert(model, variables, prompt)                       # prompt int32[batch or 1, n]
    model.apply(converted, query) == model.apply(variables, concat([prompt, query], 1))[:, n:]

Converting a converted model again with a second prompt equals converting the concatenated prompt,
because the pass over the second prompt starts from the first prompt's state. Softmax models are
refused: for them the prompt is not a finite state, and only an approximate conversion exists.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from linicl._validate import check_fits, check_tokens
from linicl.config import ModelConfig
from linicl.errors import LiniclError, NotExactError
from linicl.nn.attention import ICLCA
from linicl.nn.transformer import config_of, position_offset

Variables = Mapping[str, Any]


def require_exact(model) -> ModelConfig:
    """The model's config, or NotExactError when the ICLCA identity does not hold for it."""
    cfg = config_of(model)
    if cfg.attention != "linear":
        raise NotExactError(
            f"iclca.convert is exact only for linear attention, but this model has "
            f"attention={cfg.attention!r}. A softmax prompt cannot be stored as a finite state; use the "
            f"approximate conversion (iclca.convert_approx, kernel-approximated bias terms) instead.")
    return cfg


def _check_variables(variables) -> None:
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise LiniclError("variables must be the dict returned by model.init (with a 'params' entry), "
                          f"got {type(variables).__name__}"
                          + (f" with keys {sorted(variables)}" if isinstance(variables, Mapping) else ""))


def offset_of(variables: Variables) -> int:
    """Position of the first query token for these converted variables (0 unless learned positions)."""
    return position_offset(variables)


@functools.lru_cache(maxsize=64)
def _absorb_fn(model):
    """jit(variables, prompt) -> the 'iclca' collection after the prompt. Logits are never
    returned, so XLA drops the final norm and the unembedding."""
    def absorb(variables, prompt):
        _, state = model.apply(variables, prompt, mutable=[ICLCA])
        return state[ICLCA]
    return jax.jit(absorb)


def convert(model, variables: Variables, prompt) -> dict:
    """Store ``prompt`` in the model's attention states: the exact ICLCA conversion.

    Args:
      model: a ``linicl.Transformer`` with ``attention="linear"``.
      variables: its variables (``model.init``), possibly already converted: the new prompt then
        follows the earlier one.
      prompt: ``int32[batch, n]``. A batch-1 prompt serves queries of any batch size.
    Returns:
      A new variables dict: ``variables`` with the ``"iclca"`` collection holding, per layer
      ``layers_l/attn``, ``S: [batch, heads, d_phi, d_head]`` and ``z: [batch, heads, d_phi]``, and the
      query's first position ``offset`` (learned positions; 0 otherwise).
    Raises:
      NotExactError: softmax model. LiniclError: bad prompt or variables.
      SequenceTooLongError: learned positions and offset + n > max_len.
    """
    cfg = require_exact(model)
    _check_variables(variables)
    prompt = jnp.asarray(check_tokens("prompt", prompt, cfg.vocab_size))
    if cfg.positions == "learned":
        check_fits("prompt", offset_of(variables), prompt.shape[1], cfg.max_len, "learned positions")
    state = _absorb_fn(model)(dict(variables), prompt)
    return {**variables, ICLCA: state}


def to_trainable(model, converted: Variables):
    """Move a converted prompt's state into trainable parameters.

    Returns ``(model', variables')``: the same model with ``trainable_bias=True`` and variables whose
    ``params`` hold the state as ``S_bias``/``z_bias`` (added to any bias already there), so that the
    stored prompt can be fine-tuned like any weight (e.g. as the initialisation of a PrefixMemory-style
    bias). ``model'.apply(variables', query) == model.apply(converted, query)``. The state must have
    batch 1; a learned-positions offset stays in the ``"iclca"`` collection (it is not a weight).
    """
    cfg = require_exact(model)
    terms = bias_terms(converted)
    if terms[0][0].shape[0] != 1:
        raise LiniclError(f"to_trainable needs a state converted from a batch-1 prompt, got batch "
                          f"{terms[0][0].shape[0]}")
    params = dict(converted["params"])  # each touched layer below is copied, not mutated
    for layer, (S, z) in enumerate(terms):
        attn = dict(params[f"layers_{layer}"]["attn"])
        attn["S_bias"] = attn.get("S_bias", 0) + S[0]
        attn["z_bias"] = attn.get("z_bias", 0) + z[0]
        params[f"layers_{layer}"] = {**params[f"layers_{layer}"], "attn": attn}
    trainable = type(model)(cfg.replace(trainable_bias=True))
    rest = {k: v for k, v in converted.items() if k not in ("params", ICLCA)}
    offset = converted[ICLCA].get("offset")
    if offset is not None and cfg.positions == "learned":
        rest[ICLCA] = {"offset": offset}
    return trainable, {**rest, "params": params}


def strip(variables: Variables) -> dict:
    """The variables without any stored prompt (the no-prompt model)."""
    return {k: v for k, v in variables.items() if k != ICLCA}


def bias_terms(variables: Variables) -> list[tuple[jax.Array, jax.Array]]:
    """The stored (S, z) of every layer, in layer order: ``[(S[b, H, d_phi, d_v], z[b, H, d_phi]), ...]``."""
    if ICLCA not in variables:
        raise LiniclError("variables hold no converted prompt (no 'iclca' collection); call convert")
    layers = variables[ICLCA]
    names = sorted((k for k in layers if k.startswith("layers_")), key=lambda s: int(s.split("_")[1]))
    return [(layers[n]["attn"]["S"], layers[n]["attn"]["z"]) for n in names]


def state_floats(cfg: ModelConfig) -> int:
    """Floats stored per prompt (batch 1), independent of the prompt length: L * H * (d_phi * d_v + d_phi)."""
    return cfg.n_layers * cfg.n_heads * (cfg.feature_dim * cfg.head_dim + cfg.feature_dim)
