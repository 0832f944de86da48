"""Selection at conversion (``convert_approx(keep=...)``, ``linicl.selection``): the scores are the
model's own attention, read chunk by chunk, and a converted prompt that keeps a selection equals the
prompted model whose later queries see, in every KV head, only that head's kept prompt tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import compiled, iclca, interventions as I, selection
from linicl.kernels import kv_scores
from linicl.names import SELECTION_SCORES
from helpers import BASELINE_MIN, EXACT_RTOL, init, rel_err

N = 29  # prompt tokens


# Gemma 3 at toy size: local (sliding-window) layers around a global one, qk-norm, a query scale and
# grouped heads. Only the global layer selects; the local layers keep their exact windows.
GEMMA3 = linicl.ModelConfig(attention="softmax", n_layers=3, layer_types=("local", "global", "local"), vocab_size=23,
                            d_model=16, n_heads=4, n_kv_heads=2, d_ff=24, positions="rope", rope_style="half",
                            norm="sandwich", norm_type="gemma_rmsnorm", qk_norm=True, query_pre_attn_scalar=5.0,
                            scale_embeddings=True, mlp="gated", activation="gelu_tanh", use_bias=False,
                            sliding_window=4, rope_local_base=100.0, dtype="float64")
TINY = {"tiny-softmax-rope-gqa": linicl.preset("tiny-softmax-rope", dtype="float64", n_kv_heads=2),
        "tiny-gpt2": linicl.preset("tiny-gpt2", dtype="float64"), "tiny-gemma3": GEMMA3}


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request):
    cfg = TINY[request.param]
    model, variables = init(cfg, 0)
    rng = np.random.default_rng(1)
    return model, variables, rng.integers(0, cfg.vocab_size, N), rng.integers(0, cfg.vocab_size, (2, 5))


def _patterns(model, variables, tokens):
    """The model's own attention weights of each global layer, ``f[H, T, T]`` (one full forward)."""
    cfg = model.cfg
    names = [f"blocks.{l}.attn.hook_pattern" for l in cfg.global_layers]
    _, acts = I.capture(model, variables, jnp.asarray(tokens)[None], names=names)
    return [np.asarray(acts[name][0]) for name in names]


def _by_group(cfg, a, how):
    """``f[H, s]`` -> ``f[G, s]``: over the query heads sharing a KV head."""
    g = a.reshape(cfg.kv_heads, cfg.n_heads // cfg.kv_heads, -1)
    return g.max(1) if how == "max" else g.mean(1)


@pytest.mark.parametrize("chunk", [4, 11, 64])
def test_h2o_and_snapkv_are_the_full_forwards_attention_whatever_the_chunk(tiny, chunk):
    model, variables, prompt, _ = tiny
    cfg = model.cfg
    pats = _patterns(model, variables, prompt)
    h2o = np.stack([_by_group(cfg, p.sum(1), "mean") for p in pats])
    assert rel_err(selection.score_prompt(model, variables, prompt, "h2o", chunk=chunk), h2o) <= EXACT_RTOL
    snap = np.stack([_by_group(cfg, p[:, -8:].sum(1) / 8, "mean") for p in pats])
    snap = np.asarray(kv_scores.pool(jnp.asarray(snap), selection.SNAPKV_POOL))
    got = selection.score_prompt(model, variables, prompt, "snapkv", chunk=chunk, observation=8)
    assert rel_err(got, snap) <= EXACT_RTOL


def test_reconstruction_is_the_largest_attention_of_the_reread(tiny):
    """KVzip's score against a full forward over [prompt; instruction; prompt]: each re-reading query's
    softmax over the sinks, the chunk's prompt keys and the re-read so far (kvpress's subset), the
    largest weight over re-reading queries and the group's heads."""
    model, variables, prompt, _ = tiny
    cfg = model.cfg
    instruction = [3, 1, 4]
    seq = np.concatenate([prompt, instruction, prompt])
    names = [f"blocks.{l}.attn.hook_attn_scores" for l in cfg.global_layers]
    _, acts = I.capture(model, variables, jnp.asarray(seq)[None], names=names)
    T, rows = len(seq), np.arange(N, len(seq))
    subset = (np.arange(T) < N) | (np.arange(T)[None, :] <= rows[:, None])
    subset[:, N:] &= np.arange(N, T)[None, :] <= rows[:, None]  # causal among the re-read
    want = []
    for name in names:
        s = np.asarray(acts[name][0])[:, rows]  # [H, rows, T]
        s = np.where(subset[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        want.append(_by_group(cfg, w[:, :, :N].max(1), "max"))
    got = selection.score_prompt(model, variables, prompt, "reconstruction", instruction=instruction, chunk=7)
    assert rel_err(got, np.stack(want)) <= EXACT_RTOL


def test_expected_attention_matches_its_closed_form_on_a_sample(tiny):
    """The Gaussian closed form E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2) against a Monte Carlo
    mean over queries drawn from N(mu, Sigma) (power: the mean alone is far off)."""
    rng = np.random.default_rng(0)
    G, r, d, s = 1, 1, 4, 6
    mu = rng.normal(size=(G, r, d))
    A = rng.normal(size=(d, d)) * 0.5
    cov = np.broadcast_to(A @ A.T, (G, r, d, d))
    k, v = rng.normal(size=(G, s, d)), np.ones((G, s, d))
    q = rng.multivariate_normal(mu[0, 0], cov[0, 0], size=400_000)
    mc = np.exp(q @ k[0].T * 0.5).mean(0)
    mc = mc / mc.sum() * np.linalg.norm(v[0], axis=-1)
    got = np.asarray(kv_scores.expected(jnp.asarray(mu), jnp.asarray(cov), jnp.asarray(k), jnp.asarray(v), scale=0.5))
    mean_only = np.asarray(kv_scores.expected(jnp.asarray(mu), None, jnp.asarray(k), jnp.asarray(v), scale=0.5))
    assert rel_err(got[0], mc) < 0.02 < rel_err(mean_only[0], mc)


def _masked_reference(model, variables, prompt, query, kept):
    """Logits of [prompt; query] at the query, every query row's attention to prompt tokens restricted
    in each KV head to ``kept[layer, kv_head, token]`` (the prompt's own rows untouched)."""
    cfg = model.cfg
    n = len(prompt)
    edits = []
    for i, l in enumerate(cfg.global_layers):
        allow = np.repeat(kept[i], cfg.n_heads // cfg.kv_heads, axis=0)  # [H, n]

        def mask(x, _, ctx, allow=jnp.asarray(allow)):
            T = x.shape[-1]
            cols = jnp.concatenate([allow, jnp.ones((allow.shape[0], T - n), bool)], axis=1)  # [H, T]
            rows = (jnp.arange(x.shape[-2]) >= n)[:, None]
            return jnp.where(rows[None, None] & ~cols[None, :, None, :], -jnp.inf, x)
        edits.append(I.apply_fn(f"blocks.{l}.attn.hook_attn_scores", mask))
    tokens = jnp.concatenate([jnp.broadcast_to(jnp.asarray(prompt)[None], (query.shape[0], n)), query], 1)
    return I.run_with_edits(model, variables, tokens, edits)[:, n:]


@pytest.mark.parametrize("score", SELECTION_SCORES)
def test_a_kept_selection_is_the_prompted_model_restricted_to_it(tiny, score):
    model, variables, prompt, query = tiny
    cfg = model.cfg
    converted = iclca.convert_approx(model, variables, prompt[None], "none", keep=0.4, score=score, sinks=2,
                                     window=3)
    approx = [converted["prompt_approx"][f"layers_{l}"]["attn"]["approx"] for l in cfg.global_layers]
    kept = np.zeros((len(approx), cfg.kv_heads, N), bool)
    for i, a in enumerate(approx):
        for g in range(cfg.kv_heads):
            pos = np.asarray(a.sink_pos[0, g])
            kept[i, g, pos[pos >= 0]] = True
    assert kept[:, :, :2].all() and kept[:, :, -3:].all()  # sinks and window in every head
    assert 0 < kept.sum() <= 0.4 * kept.size  # the budget, and something left out
    got = model.apply(converted, jnp.asarray(query))
    want = _masked_reference(model, variables, prompt, jnp.asarray(query), kept)
    assert rel_err(got, want) <= EXACT_RTOL
    full = _masked_reference(model, variables, prompt, jnp.asarray(query), np.ones_like(kept))
    assert rel_err(got, full) > BASELINE_MIN  # power: the prompted model (all kept) is far off


def test_keep_everything_is_the_prompted_model(tiny):
    model, variables, prompt, query = tiny
    converted = iclca.convert_approx(model, variables, prompt[None], "none", keep=1.0)
    full = _masked_reference(model, variables, prompt, jnp.asarray(query), np.ones((1, 1, N), bool).repeat(
        model.cfg.kv_heads, 1).repeat(len(model.cfg.global_layers), 0))
    assert rel_err(model.apply(converted, jnp.asarray(query)), full) <= EXACT_RTOL
    assert iclca.stored_floats(converted)["kept"] == len(model.cfg.global_layers) * model.cfg.kv_heads * N * 2 * \
        model.cfg.head_dim


def test_global_allocation_gives_heads_unequal_shares_within_the_budget():
    rng = np.random.default_rng(0)
    scores = rng.random((2, 3, 50))
    scores[1, 2] += 10  # one head's keys all matter more
    kept = selection.allocate(scores, 60, sinks=1, window=2, allocation="global")
    assert kept.sum() == 60 and kept[1, 2].sum() > 3 * kept[0, 0].sum()
    uniform = selection.allocate(scores, 60, sinks=1, window=2, allocation="uniform")
    assert (uniform.sum(-1) == 10).all()
    with pytest.raises(linicl.LiniclError, match="fewer than the sinks and the window"):
        selection.allocate(scores, 10, sinks=1, window=2, allocation="global")
    # Whole heads: the head of highest mean score first, every token of it, then the next one's best.
    heads = selection.allocate(scores, 6 * 3 + 47 + 10, sinks=1, window=2, allocation="heads")
    assert heads.sum() == 6 * 3 + 47 + 10 and heads[1, 2].all()
    assert sorted(heads.sum(-1).reshape(-1).tolist()) == [3, 3, 3, 3, 13, 50]


def test_the_budget_counts_every_stored_float(tiny):
    model, variables, prompt, query = tiny
    cfg = model.cfg
    full = len(cfg.global_layers) * cfg.kv_heads * N * 2 * cfg.head_dim
    conv = iclca.convert_approx(model, variables, prompt[None], "none", keep=0.5, score="h2o", sinks=1, window=2)
    assert iclca.stored_floats(conv)["kept"] <= 0.5 * full
    # local layers (Gemma 3) keep their exact windows, once per KV head, counted apart from the budget
    windows = [x["attn"] for x in conv.get("prompt_state", {}).values()]
    assert len(windows) == cfg.n_layers - len(cfg.global_layers)
    assert all(w["win_k"].shape[1:3] == w["win_v"].shape[1:3] == (cfg.kv_heads, cfg.sliding_window - 1)
               for w in windows)
    assert iclca.stored_floats(conv)["local"] == sum(x.size for w in windows for x in jax.tree_util.tree_leaves(w)
                                                     if x.dtype == np.float64)
    conv = iclca.convert_approx(model, variables, prompt[None], "elu+1", keep=0.9, score="h2o", sinks=1, window=2)
    floats = iclca.stored_floats(conv)
    assert floats["kernel"] > 0 and floats["kept"] + floats["kernel"] <= 0.9 * full
    by_int = iclca.convert_approx(model, variables, prompt[None], "none", keep=6, score="recent", sinks=1, window=2)
    assert iclca.stored_floats(by_int)["kept"] == len(cfg.global_layers) * cfg.kv_heads * 6 * 2 * cfg.head_dim


@pytest.mark.parametrize("kwargs, match", [
    (dict(keep=0.0), r"keep as a float .* \(0, 1\]"),
    (dict(keep=1.5), r"keep as a float .* \(0, 1\]"),
    (dict(keep=True), "keep must be a float"),
    (dict(keep=0), "keep as an int"),
    (dict(keep=0.1, score="kvzip"), "score must be one of"),
    (dict(keep=0.5, score="random", allocation="global"), "allocation='global' ranks"),
    (dict(keep=0.5, score="recent", allocation="heads"), "allocation='heads' ranks"),
    (dict(keep=0.5, allocation="even"), "allocation must be one of"),
    (dict(keep=0.01), "fewer than the sinks and the window"),
    (dict(keep=0.5, chunk=0), "chunk must be a positive int"),
])
def test_bad_selection_arguments_are_refused(tiny, kwargs, match):
    model, variables, prompt, _ = tiny
    with pytest.raises(linicl.LiniclError, match=match):
        iclca.convert_approx(model, variables, prompt[None], "none", **kwargs)


def test_selection_refuses_batches_jit_and_kernel_terms_over_budget(tiny):
    model, variables, prompt, _ = tiny
    with pytest.raises(linicl.LiniclError, match="batch-1 prompt"):
        iclca.convert_approx(model, variables, np.stack([prompt, prompt]), "none", keep=0.5)
    with pytest.raises(linicl.LiniclError, match="eagerly"):
        jax.jit(lambda p: iclca.convert_approx(model, variables, p, "none", keep=0.5))(prompt[None])
    with pytest.raises(linicl.LiniclError, match="kernel terms alone hold"):
        iclca.convert_approx(model, variables, prompt[None], "taylor2", keep=0.1)


def test_keep_only_cuts_a_whole_conversion_to_the_same_selection(tiny):
    """One exact conversion of the whole prompt serves every score and budget: cut to a kept set it
    equals convert_approx(keep=...) with that set, bit for bit at the query."""
    model, variables, prompt, query = tiny
    scores = selection.score_prompt(model, variables, prompt, "h2o")
    direct = iclca.convert_approx(model, variables, prompt[None], "none", keep=0.3, score="h2o", scores=scores,
                                  sinks=1, window=2)
    whole = iclca.convert_approx(model, variables, prompt[None], "none", sinks=N, window=0)
    kept = selection.allocate(scores, selection.token_budget(model.cfg, N, 0.3), sinks=1, window=2,
                              allocation="global")
    cut = iclca.keep_only(whole, kept)
    assert rel_err(model.apply(cut, jnp.asarray(query)), model.apply(direct, jnp.asarray(query))) == 0
    # padded to the prompt's length: one shape for every cut of this prompt, the same outputs
    padded = iclca.keep_only(whole, kept, size=N)
    a = padded["prompt_approx"][f"layers_{model.cfg.global_layers[0]}"]["attn"]["approx"]
    assert a.sink_k.shape[2] == a.sink_pos.shape[-1] == compiled.geometric_bucket(N) > kept.sum(-1).max()
    assert rel_err(model.apply(padded, jnp.asarray(query)), model.apply(direct, jnp.asarray(query))) <= EXACT_RTOL
    assert iclca.stored_floats(padded) == iclca.stored_floats(cut)  # padding is not information
    with pytest.raises(linicl.LiniclError, match="size must be an int >= the most tokens a head keeps"):
        iclca.keep_only(whole, kept, size=int(kept.sum(-1).max()) - 1)
    assert iclca.stored_floats(cut) == iclca.stored_floats(direct)
    with pytest.raises(linicl.LiniclError, match="converted whole and exact"):
        iclca.keep_only(direct, kept)
    with pytest.raises(linicl.LiniclError, match="kept must be bool"):
        iclca.keep_only(whole, kept[:, :, :-1])
    with pytest.raises(linicl.LiniclError, match="scores must be finite"):
        iclca.convert_approx(model, variables, prompt[None], "none", keep=0.3, scores=scores[:, :, 1:])
