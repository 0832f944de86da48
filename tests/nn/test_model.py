"""The zoo's Transformer: shapes and dtypes, causality, kernel forms, cached decoding, jit/vmap/grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl.names import DECODE
from helpers import (BASELINE_MIN, EXACT_RTOL, any_configs, apply, examples, greedy_by_full_forwards, init,
                     linear_configs, rel_err, tokens)


@pytest.mark.parametrize("name", sorted(n for n in linicl.PRESETS if n.startswith("tiny")))
def test_presets_init_and_apply_in_float32(name):
    cfg = linicl.preset(name)
    model, variables = init(cfg)
    logits = apply(model, variables, tokens(0, 3, 7, cfg.vocab_size))
    assert logits.shape == (3, 7, cfg.vocab_size) and logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
    assert set(variables) == {"params"}  # init stores no prompt state and no cache


@given(cfg=any_configs(), T=st.integers(2, 30), seed=st.integers(0, 2**16), data=st.data())
def test_model_is_causal(cfg, T, seed, data):
    model, variables = init(cfg, seed)
    x = tokens(seed, 2, T, cfg.vocab_size)
    t = data.draw(st.integers(1, T - 1))
    y = x.at[:, t:].set((x[:, t:] + 1) % cfg.vocab_size)
    a, b = apply(model, variables, x), apply(model, variables, y)
    assert rel_err(b[:, :t], a[:, :t]) <= EXACT_RTOL
    assert rel_err(b[:, t:], a[:, t:]) >= BASELINE_MIN


@examples(0.4)
@given(cfg=linear_configs(max_layers=2), T=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_kernel_forms_agree_in_the_model(cfg, T, seed):
    x = tokens(seed, 2, T, cfg.vocab_size)
    outs = {}
    for form in ("parallel", "chunked", "recurrent"):
        model, variables = init(cfg.replace(form=form), seed)
        outs[form] = apply(model, variables, x)
    assert rel_err(outs["chunked"], outs["parallel"]) <= EXACT_RTOL
    assert rel_err(outs["recurrent"], outs["parallel"]) <= EXACT_RTOL


def decode_steps(model, variables, x, prefill: int):
    """Logits of x computed as one prefill call then one token at a time with the decode state."""
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=[DECODE]))
    logits, state = step(variables, x[:, :prefill])
    out = [logits]
    for t in range(prefill, x.shape[1]):
        logits, state = step({**variables, **state}, x[:, t:t + 1])
        out.append(logits)
    return jnp.concatenate(out, axis=1)


@examples(0.6)
@given(cfg=any_configs(), T=st.integers(2, 20), seed=st.integers(0, 2**16), data=st.data())
def test_cached_decoding_equals_the_full_forward(cfg, T, seed, data):
    model, variables = init(cfg, seed)
    x = tokens(seed, 2, T, cfg.vocab_size)
    prefill = data.draw(st.integers(1, T - 1))
    full = apply(model, variables, x)
    assert rel_err(decode_steps(model, variables, x, prefill), full) <= EXACT_RTOL
    # Power: each token alone, without the state, is a different model.
    alone = jnp.concatenate([apply(model, variables, x[:, t:t + 1]) for t in range(T)], axis=1)
    assert rel_err(alone, full) >= BASELINE_MIN


@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-softmax-rope", "tiny-linear-learned"])
def test_greedy_generation_matches_repeated_full_forwards(name):
    cfg = linicl.preset(name, dtype="float64")
    model, variables = init(cfg)
    x = tokens(5, 2, 6, cfg.vocab_size)
    out = linicl.generate(model, variables, x, 5)
    np.testing.assert_array_equal(out, greedy_by_full_forwards(model, variables, x, 5))


def test_prompts_of_one_prefill_bucket_share_one_cache_size():
    """Prompts of 13 and 16 tokens share the prefill bucket 16; with 4 new tokens their real lengths
    (16 and 19 slots) straddle the cache buckets 16 and 24, but the cache is sized from the padded
    prompt, so both use one model (one prefill and one decode compiled), and each row's tokens are
    those of its own generation alone."""
    from linicl import compiled
    cfg = linicl.preset("tiny-softmax-rope", dtype="float64").replace(max_len=40)
    model, variables = init(cfg)
    compiled.clear()
    short, full = tokens(3, 1, 13, cfg.vocab_size), tokens(4, 1, 16, cfg.vocab_size)
    outs = [linicl.generate(model, variables, x, 4) for x in (short, full)]
    sized = model.clone(cfg=cfg.replace(max_len=24))
    assert len(compiled.CACHE) == 2 and ("generate.prefill", sized) in compiled.CACHE  # a prefill, a decode
    for x, out in zip((short, full), outs):
        np.testing.assert_array_equal(out, greedy_by_full_forwards(model, variables, x, 4))


@pytest.mark.parametrize("n_new", [1, 11, 19, 35])
def test_decode_cache_cut_to_the_generation_keeps_greedy_tokens(n_new):
    """generate sizes a rope model's softmax cache to the bucket of the slots it fills, the padded
    prompt (6 tokens: 16) and the new tokens (16, 24, ..., at most max_len): the tokens stay those of
    full forwards, up to the last position (n_new 35)."""
    from linicl import compiled
    from linicl.generation import _cache_sized
    cfg = linicl.preset("tiny-softmax-rope", dtype="float64").replace(max_len=40)
    model, variables = init(cfg)
    x = tokens(7, 2, 6, cfg.vocab_size)
    slots = compiled.geometric_bucket(6) + n_new - 1  # the padded prompt (16) and the new tokens
    assert _cache_sized(model, slots).cfg.max_len == min(40, compiled.geometric_bucket(slots))
    out = linicl.generate(model, variables, x, n_new)
    np.testing.assert_array_equal(out, greedy_by_full_forwards(model, variables, x, n_new))


def test_apply_jits_vmaps_and_differentiates():
    cfg = linicl.preset("tiny-linear-rope-decay", dtype="float64")
    model, variables = init(cfg)
    x = tokens(1, 4, 9, cfg.vocab_size)
    batched = apply(model, variables, x)
    per_row = jax.jit(jax.vmap(lambda row: model.apply(variables, row[None])[0]))(x)
    assert rel_err(per_row, batched) <= EXACT_RTOL
    loss = jax.jit(lambda p: jnp.mean(jax.nn.logsumexp(model.apply({"params": p}, x), axis=-1)))
    g = jax.jit(jax.grad(loss))(variables["params"])
    # The gradient is a real derivative: compare one coordinate with a central difference.
    leaf = g["layers_0"]["attn"]["q"]["kernel"]
    h = 1e-6
    bump = lambda s: jax.tree_util.tree_map_with_path(
        lambda path, a: a.at[0, 0, 0].add(s * h) if "layers_0" in str(path) and "'q'" in str(path) and "kernel" in str(path) else a,
        variables["params"])
    fd = (loss(bump(1)) - loss(bump(-1))) / (2 * h)
    assert abs(float(fd) - float(leaf[0, 0, 0])) <= 1e-6 * max(1.0, abs(float(fd)))


@examples(0.3)
@given(cfg=any_configs(), T=st.integers(2, 16), seed=st.integers(0, 2**16))
def test_rematerialised_blocks_give_the_same_outputs_gradients_and_sites(cfg, T, seed):
    """``Transformer(cfg, remat=True)``: the same parameter tree, logits, gradients (recomputed in the
    backward pass instead of kept) and captured sites, in float64 to the exact tolerance; power: the
    gradient of another seed's tokens is far off."""
    from linicl.interventions import capture
    model, variables = init(cfg, seed)
    remat = model.clone(remat=True)
    x, other = tokens(seed, 2, T, cfg.vocab_size), tokens(seed + 1, 2, T, cfg.vocab_size)
    shapes = jax.eval_shape(remat.init, jax.random.PRNGKey(0), x)
    assert jax.tree.structure(shapes["params"]) == jax.tree.structure(variables["params"])
    assert rel_err(apply(remat, variables, x), apply(model, variables, x)) <= EXACT_RTOL

    def grad(m, toks):
        loss = lambda p: jnp.sum(jnp.tanh(m.apply({**variables, "params": p}, toks)))  # noqa: E731
        return jax.jit(jax.grad(loss))(variables["params"])
    flat = lambda g: jnp.concatenate([a.ravel() for a in jax.tree.leaves(g)])  # noqa: E731
    g = flat(grad(model, x))
    assert rel_err(flat(grad(remat, x)), g) <= EXACT_RTOL
    traced = lambda m: str(jax.make_jaxpr(jax.grad(lambda p: m.apply({"params": p}, x).sum()))(variables["params"]))  # noqa: E731
    assert "remat" in traced(remat) and "remat" not in traced(model)  # the option does rematerialise
    assert rel_err(flat(grad(model, other)), g) >= BASELINE_MIN
    name = "blocks.0.hook_resid_post"
    a = capture(model, variables, x, names=[name])[1][name]
    b = capture(remat, variables, x, names=[name])[1][name]
    assert rel_err(b, a) <= EXACT_RTOL
    assert rel_err(decode_steps(remat, variables, x, 1), decode_steps(model, variables, x, 1)) <= EXACT_RTOL
