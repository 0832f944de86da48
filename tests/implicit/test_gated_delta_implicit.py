"""Implicit weight updates on blocks whose mixer is gated linear attention or the (gated) delta rule.

``implicit.convert`` patches only the MLP, and the theorem needs only that the attention of a token
run alone is a function of that token: so it holds for these mixers as they are (every gate and write
strength is computed from the token itself). The closed-form context term ``implicit.context_term``
is extended to them: ΔA stays linear in the stored state, with the token's own gate and write strength.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import linicl
from linicl import iclca, implicit
from linicl.errors import NotExactError
from helpers import EXACT_RTOL, init, rel_err, tokens

FAR = 1e-3  # power: the model without the context (or without the patch) is this far off at least

_BASE = dict(vocab_size=24, d_model=12, n_heads=3, d_ff=16, max_len=64, attention="linear", mlp_bias=True,
             dtype="float64")
CONVERT = [
    dict(gate="scalar", positions="rope", norm="pre", n_layers=2),
    dict(gate="vector", feature_map="identity", normalize=False, positions="learned", norm="none",
         skip="dherin", n_layers=1),
    dict(update="delta", gate="scalar", normalize=False, positions="rope", rope_on="inputs", norm="post",
         mlp="gated", activation="silu", n_kv_heads=1, form="chunked", chunk_size=2, n_layers=2),
]


def _random_mlp_biases(variables, seed):
    """Non-zero MLP biases and gate/beta weights (init leaves the biases at 0: a special case)."""
    rng = np.random.default_rng(seed)

    def draw(path, a):
        keys = [getattr(k, "key", "") for k in path]
        if keys[-1] == "bias" and ("mlp" in keys or "beta_proj" in keys):
            return a + 0.3 * jnp.asarray(rng.standard_normal(a.shape), a.dtype)
        return a
    return {**variables, "params": jax.tree_util.tree_map_with_path(draw, variables["params"])}


@functools.lru_cache(maxsize=None)
def _apply(model):
    return jax.jit(model.apply)


@pytest.mark.parametrize("changes", CONVERT, ids=["scalar-gate", "vector-gate", "gated-delta"])
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16))
def test_implicit_convert_is_exact_on_gated_and_delta_blocks(changes, seed):
    cfg = linicl.ModelConfig(**{**_BASE, **changes})
    model, variables = init(cfg, seed)
    variables = _random_mlp_biases(variables, seed)
    half = cfg.vocab_size // 2
    context = tokens(seed + 1, 1, 6, cfg.vocab_size, low=half)[0]
    query = tokens(seed + 2, 1, 1, half)[0]
    full = _apply(model)(variables, jnp.concatenate([context, query])[None])[0, -1]
    patched = implicit.convert(model, variables, context, query)
    assert rel_err(_apply(model)(patched, query[None])[0, -1], full) <= EXACT_RTOL
    assert rel_err(_apply(model)(variables, query[None])[0, -1], full) >= FAR  # power: the context matters


@functools.lru_cache(maxsize=None)
def _captured(model):
    names = ("hook_resid_pre", "hook_attn_out")
    return jax.jit(lambda v, t: implicit.capture_blocks(model, v, t, names=names))


@functools.partial(jax.jit, static_argnums=0)
def _closed_form(cfg, bp, S, x):
    return implicit.context_term(cfg, bp, S, x), implicit.alone(cfg, bp, x)["hook_attn_out"]


@pytest.mark.parametrize("changes", [
    dict(gate="vector", normalize=False, positions="learned"),
    dict(update="delta", gate="scalar", feature_map="identity", normalize=False, positions="rope",
         n_kv_heads=1),
], ids=["vector-gate", "gated-delta"])
def test_the_context_term_is_linear_in_the_stored_state(changes):
    """ΔA = A(C, x) - A(x) from the stored state in closed form (``implicit.linear``), per layer."""
    cfg = linicl.ModelConfig(**{**_BASE, **changes, "n_layers": 2})
    model, variables = init(cfg, 1)
    context, query = tokens(2, 1, 7, cfg.vocab_size), tokens(3, 1, 1, cfg.vocab_size)
    state = iclca.convert(model, variables, context)["prompt_state"]
    acts = _captured(model)(variables, jnp.concatenate([context, query], 1))
    for layer in range(cfg.n_layers):
        scope = f"layers_{layer}"
        x = acts["hook_resid_pre"][layer, 0, -1]
        closed, alone = _closed_form(cfg, variables["params"][scope], state[scope]["attn"]["S"][0], x)
        with_context = acts["hook_attn_out"][layer, 0, -1]
        assert rel_err(closed, with_context - alone) <= EXACT_RTOL, layer
        assert rel_err(alone, with_context) >= FAR, layer  # power: the context term is not negligible


def test_the_context_term_refuses_absolute_rope():
    cfg = linicl.ModelConfig(**{**_BASE, "gate": "vector", "normalize": False, "positions": "rope",
                                "rope_on": "inputs"})
    with pytest.raises(NotExactError, match="rope_on='inputs'"):
        implicit.context_term(cfg, None, None, jnp.zeros(cfg.d_model))
