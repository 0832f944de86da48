"""Named sites, the activation cache and edits (linicl.interventions).

The cache is read from the one forward pass, so the tests check it against the model's own algebra
(a block's output is the next block's input, logits are the unembedded final state) and edits against
independent constructions (param surgery, a re-computed softmax), each exact in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl import interventions as I
from linicl.errors import LiniclError
from helpers import BASELINE_MIN, EXACT_RTOL, any_configs, examples, init, rel_err, tokens

_capture = jax.jit(I.capture, static_argnums=0, static_argnames=("names",))
_edited = jax.jit(lambda model, variables, toks: model.apply(variables, toks), static_argnums=0)


def _run(model, variables, toks, edits):
    return _edited(model, I.with_edits(variables, edits, model.cfg), toks)


@examples(0.5)
@given(cfg=any_configs(), T=st.integers(2, 12), seed=st.integers(0, 2**16))
def test_cache_holds_every_site_with_its_layout_and_the_model_algebra(cfg, T, seed):
    model, variables = init(cfg, seed)
    toks = tokens(seed, 2, T, cfg.vocab_size)
    logits, cache = _capture(model, variables, toks)
    assert set(cache) == set(I.site_names(cfg))
    H, Hkv, dh, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    for l in range(cfg.n_layers):
        assert cache[f"blocks.{l}.attn.hook_q"].shape == (2, T, H, dh)
        assert cache[f"blocks.{l}.attn.hook_k"].shape == (2, T, Hkv, dh)
        assert cache[f"blocks.{l}.hook_mlp_in"].shape == (2, T, D)
        if cfg.attention == "softmax":
            pattern = cache[f"blocks.{l}.attn.hook_pattern"]
            assert pattern.shape == (2, H, T, T)
            assert rel_err(pattern.sum(-1), jnp.ones((2, H, T))) <= EXACT_RTOL
        # One block's output is the next block's input; the MLP output is added to resid_mid.
        if l + 1 < cfg.n_layers:
            assert jnp.array_equal(cache[f"blocks.{l}.hook_resid_post"], cache[f"blocks.{l + 1}.hook_resid_pre"])
        if cfg.norm != "post":
            total = cache[f"blocks.{l}.hook_resid_mid"] + cache[f"blocks.{l}.hook_mlp_out"]
            assert rel_err(cache[f"blocks.{l}.hook_resid_post"], total) <= EXACT_RTOL
    final = cache["ln_final.hook_normalized"] if cfg.has_final_norm else cache[f"blocks.{cfg.n_layers - 1}.hook_resid_post"]
    unembed = variables["params"]["embed"].T if cfg.tie_embeddings else variables["params"]["unembed"]["kernel"]
    assert rel_err(final @ unembed, logits) <= EXACT_RTOL
    assert rel_err(logits, _capture(model, variables, toks, names=("hook_embed",))[0]) == 0


@examples(0.3)
@given(cfg=any_configs(), seed=st.integers(0, 2**16))
def test_identity_edits_change_nothing_and_real_edits_do(cfg, seed):
    model, variables = init(cfg, seed)
    toks = tokens(seed, 2, 6, cfg.vocab_size)
    logits, cache = _capture(model, variables, toks)
    site = "blocks.0.hook_resid_post"
    for e in (I.add(site, 0.0), I.scale(site, 1.0), I.replace(site, cache[site])):
        assert rel_err(_run(model, variables, toks, [e]), logits) <= EXACT_RTOL
    steer = jax.random.normal(jax.random.PRNGKey(seed), (cfg.d_model,), logits.dtype)
    assert rel_err(_run(model, variables, toks, [I.add(site, steer)]), logits) >= BASELINE_MIN


def test_position_masks_respect_causality():
    """An edit at position t leaves every earlier position's logits untouched and moves position t."""
    model, variables = init(linicl.preset("tiny-llama", dtype="float64"), 0)
    toks = tokens(1, 2, 8, model.cfg.vocab_size)
    logits = _edited(model, variables, toks)
    steer = jnp.ones((model.cfg.d_model,))
    out = _run(model, variables, toks, [I.add("blocks.1.hook_resid_pre", steer, positions=I.at_positions(8, 5))])
    assert rel_err(out[:, :5], logits[:, :5]) == 0
    assert rel_err(out[:, 5], logits[:, 5]) >= BASELINE_MIN
    # Per-row positions: the last real token of each row of a right-padded batch.
    lengths = jnp.array([3, 7])
    out = _run(model, variables, toks, [I.add("blocks.1.hook_resid_pre", steer, positions=I.at_last(lengths, 8))])
    assert rel_err(out[0, :2], logits[0, :2]) == 0 and rel_err(out[1, :6], logits[1, :6]) == 0
    assert rel_err(out[0, 2], logits[0, 2]) >= BASELINE_MIN and rel_err(out[1, 6], logits[1, 6]) >= BASELINE_MIN


def test_zeroing_a_head_equals_removing_it_from_the_output_projection():
    model, variables = init(linicl.preset("tiny-softmax", dtype="float64"), 2)
    toks = tokens(3, 2, 9, model.cfg.vocab_size)
    edited = _run(model, variables, toks, [I.zero(("z", 1), heads=[2], n_heads=model.cfg.n_heads)])
    params = jax.tree_util.tree_map(lambda x: x, variables["params"])
    o = params["layers_1"]["attn"]["o"]
    o["kernel"] = o["kernel"].at[2].set(0.0)
    surgery = _edited(model, {"params": params}, toks)
    assert rel_err(edited, surgery) <= EXACT_RTOL
    assert rel_err(edited, _edited(model, variables, toks)) >= BASELINE_MIN


def test_logit_bias_is_masked_after_it_is_added():
    """A bias on future keys does nothing; a bias on key 0 shifts every pattern row by softmax rules."""
    model, variables = init(linicl.preset("tiny-llama", dtype="float64"), 4)
    T = 7
    toks = tokens(5, 1, T, model.cfg.vocab_size)
    logits, cache = _capture(model, variables, toks)
    future = jnp.triu(jnp.full((T, T), 50.0), k=1)
    assert rel_err(_run(model, variables, toks, [I.logit_bias(0, future)]), logits) == 0
    bias = jnp.zeros((T, T)).at[:, 0].set(2.0)
    _, edited = _capture(model, I.with_edits(variables, [I.logit_bias(0, bias)], model.cfg), toks,
                         names=("blocks.0.attn.hook_pattern",))
    scores = cache["blocks.0.attn.hook_attn_scores"] + bias
    expected = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf), axis=-1)
    assert rel_err(edited["blocks.0.attn.hook_pattern"], expected) <= EXACT_RTOL
    assert rel_err(expected, cache["blocks.0.attn.hook_pattern"]) >= BASELINE_MIN


def test_fn_edits_see_the_layers_queries_and_keys():
    """fn(scores, _, ctx) = scores + q.k/sqrt(d) doubles the scores: the same as scaling them by 2."""
    model, variables = init(linicl.preset("tiny-softmax-rope", dtype="float64"), 6)
    toks = tokens(7, 2, 6, model.cfg.vocab_size)

    def again(scores, _, ctx):
        return scores + jnp.einsum("bhtd,bhsd->bhts", ctx["q"], ctx["k"]) / jnp.sqrt(ctx["q"].shape[-1])
    a = _run(model, variables, toks, [I.apply_fn(("attn_scores", 1), again)])
    b = _run(model, variables, toks, [I.scale(("attn_scores", 1), 2.0)])
    assert rel_err(a, b) <= EXACT_RTOL and rel_err(a, _edited(model, variables, toks)) >= BASELINE_MIN


def test_edits_are_differentiable_and_vmappable():
    model, variables = init(linicl.preset("tiny-gpt2", dtype="float64"), 8)
    toks = tokens(9, 1, 5, model.cfg.vocab_size)

    def loss(v):
        return _run(model, variables, toks, [I.add("blocks.0.hook_resid_mid", v)])[0, -1, 3]
    v = jnp.zeros((model.cfg.d_model,))
    g = jax.grad(loss)(v)
    e = jnp.eye(model.cfg.d_model)[0] * 1e-6
    assert abs(float(g[0]) - float((loss(v + e) - loss(v - e)) / 2e-6)) < 1e-6 * max(1.0, abs(float(g[0])))
    many = jax.vmap(loss)(jnp.stack([v, v + 1.0]))
    assert many.shape == (2,) and float(many[0]) == pytest.approx(float(loss(v)), rel=1e-12)


def test_cache_shorthand_and_stack():
    model, variables = init(linicl.preset("tiny-softmax", dtype="float64"), 0)
    toks = tokens(1, 1, 4, model.cfg.vocab_size)
    _, cache = I.run_with_cache(model, variables, toks)
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["mlp_pre", 0] is cache["blocks.0.mlp.hook_pre"]
    assert cache.stack("resid_post").shape == (2, 1, 4, model.cfg.d_model)
    _, some = I.run_with_cache(model, variables, toks, names=[("q", 0), "hook_embed"])
    assert set(some) == {"blocks.0.attn.hook_q", "hook_embed"}


def test_bad_sites_and_edits_are_refused():
    model, variables = init(linicl.preset("tiny-linear", dtype="float64"), 0)
    toks = tokens(1, 1, 4, model.cfg.vocab_size)
    with pytest.raises(LiniclError, match="no site.*blocks.7"):
        I.run_with_edits(model, variables, toks, [I.add("blocks.7.hook_resid_pre", 1.0)])
    with pytest.raises(LiniclError, match="linear attention has no hook_attn_scores"):
        I.run_with_edits(model, variables, toks, [I.logit_bias(0, 1.0)])
    with pytest.raises(LiniclError, match="unknown short site"):
        I.full_name(("nonsense", 0))
    with pytest.raises(LiniclError, match="positions.*bool\\[4\\]"):
        I.run_with_edits(model, variables, toks, [I.add("hook_embed", 1.0, positions=np.ones(3, bool))])
    with pytest.raises(LiniclError, match="no head axis"):
        I.run_with_edits(model, variables, toks, [I.add("hook_embed", 1.0, heads=np.ones(4, bool))])
    with pytest.raises(LiniclError, match="does not broadcast"):
        I.run_with_edits(model, variables, toks, [I.replace("hook_embed", jnp.ones((3, 4, model.cfg.d_model)))])
    with pytest.raises(LiniclError, match="op must be one of"):
        I.edit("hook_embed", "multiply", 1.0)
