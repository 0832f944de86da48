"""The approximate conversion of a softmax prompt (iclca.convert_approx).

What is exact is tested as exact (a linear model, a prompt kept entirely as sink tokens, decoding
after a conversion); what is approximate is tested for the properties the theory predicts (the Taylor
kernel's error falls with the logit scale; a least-squares fit beats the fixed kernels on its sample).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl import iclca, selection
from linicl.nn.transformer import position_offset
from linicl.errors import LiniclError, NotExactError, SequenceTooLongError
from helpers import BASELINE_MIN, EXACT_RTOL, softmax_configs, apply, examples, init, linear_configs, rel_err, tokens


def _prompted(model, variables, prompt, query):
    n = prompt.shape[1]
    full = jnp.concatenate([jnp.broadcast_to(prompt, (query.shape[0], n)), query], axis=1)
    return apply(model, variables, full)[:, n:]


@examples(0.3)
@given(cfg=linear_configs(max_layers=2), seed=st.integers(0, 2**16))
def test_linear_models_get_the_exact_conversion(cfg, seed):
    model, variables = init(cfg, seed)
    prompt = tokens(seed, 1, 7, cfg.vocab_size)
    approx = iclca.convert_approx(model, variables, prompt, kernel="prf", sinks=2)
    exact = iclca.convert(model, variables, prompt)
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), approx, exact)
    assert all(jax.tree_util.tree_leaves(same))


@examples(0.4)
@given(cfg=softmax_configs(), n=st.integers(1, 10), m=st.integers(1, 6),
       kernel=st.sampled_from(["taylor2", "prf", "elu+1"]), split=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_a_prompt_kept_exact_is_exact(cfg, n, m, kernel, split, seed):
    """With every prompt token kept exact (the first ``sinks``, the last ``window``) nothing is
    linearised: the conversion is exact, however the prompt is split between the two."""
    model, variables = init(cfg, seed)
    prompt, query = tokens(seed, 1, n, cfg.vocab_size), tokens(seed + 1, 2, m, cfg.vocab_size)
    sinks = int(split * n)
    converted = iclca.convert_approx(model, variables, prompt, kernel=kernel, sinks=sinks, window=n - sinks)
    target = _prompted(model, variables, prompt, query)
    assert rel_err(apply(model, converted, query), target) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), target) >= BASELINE_MIN


@pytest.mark.parametrize("kernel", ["taylor2", "prf"])
def test_dropping_the_kernel_terms_leaves_the_kept_tokens(kernel):
    """Without positions a softmax layer sees a set of keys, and on one layer a key does not depend on
    the tokens before it, so a conversion with its kernel terms dropped is the model prompted with the
    kept tokens alone: the first sinks and the last window."""
    cfg = linicl.ModelConfig(attention="softmax", positions="none", n_layers=1, d_model=16, n_heads=2,
                             vocab_size=32, dtype="float64")
    model, variables = init(cfg, 4)
    n, sinks, window = 9, 2, 3
    prompt, query = tokens(41, 1, n, cfg.vocab_size), tokens(42, 2, 4, cfg.vocab_size)
    converted = iclca.convert_approx(model, variables, prompt, kernel=kernel, sinks=sinks, window=window)
    kept = jnp.concatenate([prompt[:, :sinks], prompt[:, n - window:]], axis=1)
    target = _prompted(model, variables, kept, query)
    assert rel_err(apply(model, iclca.drop_approx_terms(converted), query), target) <= EXACT_RTOL
    assert rel_err(apply(model, converted, query), target) >= BASELINE_MIN
    with pytest.raises(LiniclError, match="no approximated prompt"):
        iclca.drop_approx_terms(variables)
    mixed = iclca.convert_approx(model, variables, prompt, form="mix", sinks=sinks)
    with pytest.raises(LiniclError, match="0 / 0"):
        iclca.drop_approx_terms(mixed)


def _one_layer(alpha: float, seed: int = 0):
    """A one-layer softmax model whose query/key kernels are scaled by alpha: logits scale by alpha^2."""
    cfg = linicl.ModelConfig(attention="softmax", positions="rope", n_layers=1, d_model=16, n_heads=2,
                             vocab_size=32, dtype="float64")
    model, variables = init(cfg, seed)
    params = jax.tree_util.tree_map(lambda x: x, variables["params"])
    for n in "qk":
        params["layers_0"]["attn"][n]["kernel"] = alpha * params["layers_0"]["attn"][n]["kernel"]
    return model, {"params": params}


def test_taylor_error_falls_with_the_logit_scale():
    """e^s - (1 + s + s^2/2) = O(s^3): halving q and k quarters the logits, so the error of the
    prompt terms should fall by about 4^3 = 64 per step; we require a factor 8 (the output error also
    contains the input part, which is exact)."""
    prompt, query = tokens(1, 1, 16, 32), tokens(2, 2, 6, 32)
    errors = []
    for alpha in (1.0, 0.5, 0.25):
        model, variables = _one_layer(alpha)
        converted = iclca.convert_approx(model, variables, prompt, kernel="taylor2")
        errors.append(rel_err(apply(model, converted, query), _prompted(model, variables, prompt, query)))
    assert errors[0] > 8 * errors[1] > 64 * errors[2] > 0
    model, variables = _one_layer(0.25)
    dropped = rel_err(apply(model, variables, query), _prompted(model, variables, prompt, query))
    assert errors[2] < 1e-3 * dropped  # the approximation keeps the prompt's effect


@pytest.mark.parametrize("kernel", ["elu+1", "taylor2"])
def test_least_squares_beats_the_fixed_kernel_on_its_own_sample(kernel):
    model, variables = _one_layer(1.0)
    prompt, inputs = tokens(3, 1, 20, 32), tokens(4, 24, 8, 32)
    target = _prompted(model, variables, prompt, inputs)
    summed = iclca.convert_approx(model, variables, prompt, kernel=kernel)
    fitted = iclca.convert_approx(model, variables, prompt, kernel=kernel, fit_inputs=inputs)
    err_sum = rel_err(apply(model, summed, inputs), target)
    err_fit = rel_err(apply(model, fitted, inputs), target)
    assert err_fit < 0.8 * err_sum  # measured: 0.14 vs 0.24 (elu+1)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_decoding_after_conversion_matches_the_full_forward(preset):
    """The converted prompt and a decode cache compose: one token at a time equals one pass."""
    cfg = linicl.preset(preset, dtype="float64")
    model, variables = init(cfg, 5)
    converted = iclca.convert_approx(model, variables, tokens(6, 1, 9, cfg.vocab_size), kernel="prf", sinks=2)
    query = tokens(7, 2, 5, cfg.vocab_size)
    full = apply(model, converted, query)
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=["decode"]))
    v, outs = converted, []
    for t in range(query.shape[1]):
        out, cache = step(v, query[:, t:t + 1])
        v = {**v, **cache}
        outs.append(out)
    assert rel_err(jnp.concatenate(outs, axis=1), full) <= EXACT_RTOL


def test_shapes_dtypes_and_learned_offset():
    cfg = linicl.preset("tiny-gpt2", dtype="float32", n_kv_heads=2)
    model, variables = init(cfg, 0)
    converted = iclca.convert_approx(model, variables, tokens(0, 1, 5, cfg.vocab_size), kernel="prf",
                                     n_features=32, sinks=1)
    approx = converted["prompt_approx"]["layers_0"]["attn"]["approx"]
    assert approx.B.shape == (1, cfg.n_heads, 32, cfg.head_dim) and approx.B.dtype == jnp.float32
    assert approx.sink_k.shape == (1, 2, 1, cfg.head_dim) and position_offset(converted) == 5
    out = apply(model, converted, tokens(1, 3, 4, cfg.vocab_size))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_bad_arguments_are_refused():
    cfg = linicl.preset("tiny-gpt2", dtype="float64", max_len=16)
    model, variables = init(cfg, 0)
    prompt = tokens(0, 1, 6, cfg.vocab_size)
    for kwargs, match in [(dict(kernel="cosine"), "kernel must be one of"),
                          (dict(form="concat"), "form must be one of"),
                          (dict(form="mix", lam=1.5), "lam must lie in"),
                          (dict(sinks=7), "sinks must be an int in \\[0, 6\\]"),
                          (dict(window=-1), "window must be an int in \\[0, 6\\]"),
                          (dict(sinks=2, window=5), "window must be an int in \\[0, 4\\]"),
                          (dict(sinks=True), "sinks must be an int"),
                          (dict(form="mix", sinks=6), "at least one linearised"),
                          (dict(form="mix", sinks=2, window=4), "at least one linearised")]:
        with pytest.raises(LiniclError, match=match):
            iclca.convert_approx(model, variables, prompt, **kwargs)
    with pytest.raises(SequenceTooLongError):
        iclca.convert_approx(model, variables, tokens(0, 1, 16, cfg.vocab_size))
    converted = iclca.convert_approx(model, variables, prompt)
    with pytest.raises(LiniclError, match="already hold"):
        iclca.convert_approx(model, converted, prompt)
    with pytest.raises(LiniclError, match="batch-1 prompt"):
        iclca.convert_approx(model, variables, tokens(0, 2, 6, cfg.vocab_size), fit_inputs=prompt)
    with pytest.raises(NotExactError, match="convert_approx"):
        iclca.convert(model, variables, prompt)


@examples(0.25)
@given(cfg=softmax_configs(local=True), n=st.integers(1, 10), m=st.integers(1, 6),
       kernel=st.sampled_from(["taylor2", "prf", "elu+1"]), seed=st.integers(0, 2**16))
def test_local_layers_keep_their_exact_windows(cfg, n, m, kernel, seed):
    """Gemma-style models: only the global layers are approximated, each local layer stores its exact
    window (prompts shorter and longer than it). With every prompt token of the global layers kept
    exact the conversion is exact, in one pass and decoding a token at a time."""
    model, variables = init(cfg, seed)
    prompt, query = tokens(seed, 1, n, cfg.vocab_size), tokens(seed + 1, 2, m, cfg.vocab_size)
    converted = iclca.convert_approx(model, variables, prompt, kernel=kernel, sinks=n // 2, window=n - n // 2)
    assert sorted(converted.get("prompt_approx", {})) == [f"layers_{l}" for l in cfg.global_layers]
    assert sorted(converted["prompt_state"]) == [f"layers_{l}" for l in range(cfg.n_layers)
                                                 if l not in cfg.global_layers]
    target = _prompted(model, variables, prompt, query)
    assert rel_err(apply(model, converted, query), target) <= EXACT_RTOL
    if cfg.global_layers or cfg.sliding_window > 1 or cfg.positions == "learned":
        # (local windows of 1 token alone, with no absolute positions, cannot see a prompt at all)
        assert rel_err(apply(model, variables, query), target) >= BASELINE_MIN
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=["decode"]))
    v, outs = converted, []
    for t in range(m):
        out, cache = step(v, query[:, t:t + 1])
        v, outs = {**v, **cache}, outs + [out]
    assert rel_err(jnp.concatenate(outs, axis=1), target) <= EXACT_RTOL


@pytest.fixture(scope="module")
def tiny_gemma():
    """The HF-written tiny Gemma 3 (window 4; layers local, local, global) in float64."""
    from helpers import FIXTURES
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / "gemma3-tiny", dtype="float64")
    return model, variables


def test_gemma_approximates_its_global_layer_next_to_exact_windows(tiny_gemma):
    """A 20-token prompt (5 windows long): the local layers store the windows the prompt leaves in the
    model (its last window - 1 keys and values, at their positions), and the approximation is far closer
    to the prompted model than the query alone."""
    model, variables = tiny_gemma
    cfg = model.cfg
    prompt, query = tokens(31, 1, 20, cfg.vocab_size), tokens(32, 2, 5, cfg.vocab_size)
    converted = iclca.convert_approx(model, variables, prompt, kernel="taylor2", sinks=2)
    target = _prompted(model, variables, prompt, query)
    approx_err = rel_err(apply(model, converted, query), target)
    assert approx_err < 0.5 * rel_err(apply(model, variables, query), target)
    # the local layers see the softmax model's own layers below them, so their windows are those the
    # prompt leaves in an (eager) pass of the model itself
    _, dec = model.apply(variables, prompt, mutable=["decode", "prompt_state"])
    for l in range(cfg.n_layers):
        if l in cfg.global_layers:
            continue
        stored, expected = converted["prompt_state"][f"layers_{l}"]["attn"], dec["prompt_state"][f"layers_{l}"]["attn"]
        assert sorted(stored) == sorted(expected)
        for name in ("win_k", "win_v"):  # jit and eager round rope differently: equal to 1e-12, not bitwise
            assert rel_err(stored[name], expected[name]) <= EXACT_RTOL, (l, name)
        assert jnp.array_equal(stored["win_pos"], jnp.arange(20 - cfg.sliding_window + 1, 20))


def test_the_fit_reads_the_queries_gemma_scores(tiny_gemma):
    """The least-squares fit regresses on the queries the layer scores: Gemma's q-norm and query scale
    applied to hook_q (the projection). Rebuilt from them, the logits equal hook_attn_scores."""
    from linicl.interventions import capture
    from linicl.kernels.positions import apply_rope
    from linicl.kernels.softmax_attention import attention_logits, repeat_kv
    from linicl.names import block_site
    from linicl.nn.norms import make_norm
    model, variables = tiny_gemma
    cfg = model.cfg
    (l,) = cfg.global_layers
    x = tokens(33, 2, 9, cfg.vocab_size)
    names = [block_site(l, h) for h in ("hook_q", "hook_k", "hook_attn_scores")]
    _, acts = capture(model, variables, x, names=names)
    attn = variables["params"][f"layers_{l}"]["attn"]
    q = selection.scored_queries(cfg, attn, acts[names[0]])
    k = make_norm(cfg, "k_norm").apply({"params": attn["k_norm"]}, acts[names[1]])
    pos = jnp.arange(x.shape[1])
    q, k = (apply_rope(jnp.swapaxes(a, 1, 2), pos, cfg.rope_base, cfg.rope_style) for a in (q, k))
    logits = attention_logits(q, repeat_kv(k, cfg.n_heads))
    assert rel_err(logits, acts[names[2]]) <= EXACT_RTOL
    unscored = attention_logits(apply_rope(jnp.swapaxes(acts[names[0]], 1, 2), pos, cfg.rope_base, cfg.rope_style),
                                repeat_kv(k, cfg.n_heads))
    assert rel_err(unscored, acts[names[2]]) >= BASELINE_MIN
    prompt, inputs = tokens(34, 1, 12, cfg.vocab_size), tokens(35, 24, 6, cfg.vocab_size)
    target = _prompted(model, variables, prompt, inputs)
    summed = iclca.convert_approx(model, variables, prompt, kernel="elu+1")
    fitted = iclca.convert_approx(model, variables, prompt, kernel="elu+1", fit_inputs=inputs)
    assert rel_err(apply(model, fitted, inputs), target) < rel_err(apply(model, summed, inputs), target)


def test_gemma_learned_kernel_needs_maps_of_the_global_layers_only(tiny_gemma):
    """The linearized student of a Gemma model has maps on its global layers alone; they convert the
    softmax teacher, and a prompt kept as sinks gives the prompted teacher exactly."""
    from linicl import linearize as LZ
    model, variables = tiny_gemma
    cfg = model.cfg
    student = linicl.Transformer(LZ.student_config(cfg, window=4, sinks=1))
    maps = LZ.student_variables(student, variables)
    prompt, query = tokens(36, 1, 10, cfg.vocab_size), tokens(37, 2, 4, cfg.vocab_size)
    target = _prompted(model, variables, prompt, query)
    kept = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, sinks=10)
    assert rel_err(apply(model, kept, query), target) <= EXACT_RTOL
    approx = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, sinks=1, window=3)
    assert rel_err(apply(model, approx, query), target) < rel_err(apply(model, variables, query), target)

