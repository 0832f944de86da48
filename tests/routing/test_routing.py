"""In-Context Routing: PIDs, the router, the routing bias, training (linicl.routing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import routing as R
from linicl.errors import DataError, LiniclError
from linicl.batching import last_token_logits
from linicl.evaluate import run_logprobs
from linicl.interventions import capture, with_edits
from helpers import BASELINE_MIN, EXACT_RTOL, init, random_prompts, rel_err, tokens


@pytest.fixture(scope="module")
def setup():
    cfg = linicl.preset("tiny-llama", n_layers=3, dtype="float64")
    model, variables = init(cfg, 0)
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, 24, cfg.vocab_size)
    pids = R.extract_pids(model, variables, prompts, r=4)
    return model, variables, prompts, pids


def _random_router(model, pids, seed=1):
    """A router with random (non-zero) last layers, so that the bias is not zero."""
    router, params = R.make_router(model, pids, seed=seed)
    key = jax.random.PRNGKey(seed)
    return router, jax.tree_util.tree_map(lambda x: x + 0.5 * jax.random.normal(key, x.shape, x.dtype), params)


def test_routed_layers_are_the_last_third():
    assert R.routed_layers(linicl.preset("tiny-gpt2", n_layers=12)) == (8, 9, 10, 11)
    assert R.routed_layers(linicl.preset("tiny-llama", n_layers=30)) == tuple(range(20, 30))


def test_a_model_with_local_layers_routes_its_global_layers():
    """Gemma's local windows have no logits site: the last third keeps its global layers only, an
    explicit local layer is refused by name, and the router then works as on any softmax model (the
    cached prefix starts at the routed layer, past two local ones)."""
    from helpers import FIXTURES
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / "gemma3-tiny", dtype="float64")
    assert R.routed_layers(model.cfg) == (2,)
    gemma18 = model.cfg.replace(n_layers=18, layer_types=tuple("global" if l % 6 == 5 else "local"
                                                               for l in range(18)))
    assert R.routed_layers(gemma18) == (17,)
    with pytest.raises(LiniclError, match="no global layer"):
        R.routed_layers(gemma18.replace(n_layers=3, layer_types=("global", "local", "local")))
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 12, model.cfg.vocab_size)
    with pytest.raises(LiniclError, match=r"global layers \(2,\).*got \(1,\)"):
        R.extract_pids(model, variables, prompts, layers=[1], r=2)
    pids = R.extract_pids(model, variables, prompts, r=2)
    router, params = _random_router(model, pids)
    toks = tokens(5, 2, 9, model.cfg.vocab_size)
    name = f"blocks.{pids.layers[0]}.hook_resid_pre"
    h0 = capture(model, variables, toks, names=[name])[1][name]
    lengths = jnp.array([9, 6])
    cached, (alpha, gamma) = R.routed_logits(model, variables, pids, router, params, h0, lengths)
    edited = with_edits(variables, R.routing_edits(pids, alpha, gamma), model.cfg)
    full = last_token_logits(model)(edited, toks, lengths)
    assert rel_err(cached, full) <= EXACT_RTOL
    assert rel_err(full, last_token_logits(model)(variables, toks, lengths)) >= BASELINE_MIN


def test_pca_recovers_a_planted_subspace():
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(40, 3)))  # the planted 3-d subspace of R^40
    X = rng.normal(size=(500, 3)) * [5.0, 4.0, 3.0] @ basis.T + 0.01 * rng.normal(size=(500, 40)) + 7.0
    U, mean, explained = R.pca(X, 3, center=True)
    assert np.allclose(U.T @ U, np.eye(3), atol=1e-12)
    # cosines of the principal angles between span(U) and the planted span
    assert np.linalg.svd(U.T @ basis, compute_uv=False).min() > 0.9999
    assert explained.sum() > 0.999 and np.allclose(mean, X.mean(0))
    random = np.linalg.qr(rng.normal(size=(40, 3)))[0]
    assert np.linalg.svd(random.T @ basis, compute_uv=False).min() < 0.9  # the check has power
    with pytest.raises(LiniclError, match="pca needs"):
        R.pca(X, 41)


def test_zero_alpha_is_exactly_the_base_model(setup):
    """An untrained router (alpha's last layer is zero) leaves every logit unchanged, bit for bit."""
    model, variables, prompts, pids = setup
    router, params = R.make_router(model, pids)
    forward = R.icr_forward(model, pids, router)
    base = np.stack(run_logprobs(model, variables, prompts))
    routed = np.stack(run_logprobs(model, {**variables, "router": params}, prompts, forward=forward))
    assert np.array_equal(base, routed)
    _, trained = _random_router(model, pids)
    moved = np.stack(run_logprobs(model, {**variables, "router": trained}, prompts, forward=forward))
    assert rel_err(moved, base) >= BASELINE_MIN


def test_the_cached_prefix_equals_the_full_forward(setup):
    """Training runs only the routed blocks from the cached residual; that equals the full forward
    with the same edits."""
    model, variables, _, pids = setup
    router, params = _random_router(model, pids)
    toks = tokens(3, 2, 9, model.cfg.vocab_size)
    lengths = jnp.array([9, 6])
    name = f"blocks.{pids.layers[0]}.hook_resid_pre"
    h0 = capture(model, variables, toks, names=[name])[1][name]
    cached, (alpha, gamma) = R.routed_logits(model, variables, pids, router, params, h0, lengths)
    edited = with_edits(variables, R.routing_edits(pids, alpha, gamma), model.cfg)
    full = last_token_logits(model)(edited, toks, lengths)
    assert rel_err(cached, full) <= EXACT_RTOL


def test_the_bias_respects_causality(setup):
    """With alpha, gamma fixed, a later token cannot change an earlier position: the bias is added
    before the causal mask."""
    model, variables, _, pids = setup
    B, T = 1, 8
    alpha = jnp.ones((B, len(pids.layers), pids.rank))
    gamma = jnp.ones((B, len(pids.layers), model.cfg.n_heads))
    edited = with_edits(variables, R.routing_edits(pids, alpha, gamma), model.cfg)
    a = tokens(4, B, T, model.cfg.vocab_size)
    b = a.at[0, 5].set((a[0, 5] + 1) % model.cfg.vocab_size)
    la, lb = model.apply(edited, a), model.apply(edited, b)
    assert rel_err(la[:, :5], lb[:, :5]) == 0 and rel_err(la[:, 5:], lb[:, 5:]) >= BASELINE_MIN
    assert rel_err(la, model.apply(variables, a)) >= BASELINE_MIN  # the bias does something


def test_training_moves_only_the_router(setup):
    model, variables, prompts, pids = setup
    y = np.random.default_rng(1).integers(0, model.cfg.vocab_size, len(prompts))
    data = R.prepare(model, variables, prompts, y, pids)
    assert data.h0.shape[:2] == (len(prompts), max(len(p) for p in prompts))
    before = jax.tree_util.tree_map(np.array, variables)
    router, params, history = R.train_router(model, variables, pids, data, epochs=1, batch_size=8,
                                             progress=False, log_every=1)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, np.asarray(b))), before, variables)
    assert all(jax.tree_util.tree_leaves(same))
    _, init_params = R.make_router(model, pids)
    moved = jax.tree_util.tree_map(lambda a, b: bool(jnp.any(a != b)), init_params, params)
    assert all(jax.tree_util.tree_leaves(moved))  # every router weight trained
    assert len(history) == 3 and all(np.isfinite(h["loss"]) for h in history)
    # The loss is differentiable in the router only: its gradient w.r.t. the router is non-zero.
    batch = tuple(jnp.asarray(x[:4]) for x in (data.h0, data.lengths, data.y, data.H_zs))
    grads = jax.grad(lambda p: R.icr_loss(p, model, variables, pids, router, batch, 1.0, R.LossWeights())[0])(params)
    assert float(jnp.abs(grads["alpha_2"]["kernel"]).max()) > 0


def test_a_router_can_read_an_external_embedding_of_each_query(setup):
    """The paper's router reads a sentence embedding of the query, not the LM's residual: trained on
    ``TrainingData.e`` it takes their width, and evaluation with ``extras=e`` equals routing the same
    alpha/gamma by hand; other embeddings give other logits (the input is read), and a missing or
    mis-shaped embedding is refused by name. Reading the cached entry residual (``cached=True``)
    instead of running the blocks below gives the same logits."""
    model, variables, prompts, pids = setup
    rng = np.random.default_rng(2)
    e = rng.normal(size=(len(prompts), 6))
    y = rng.integers(0, model.cfg.vocab_size, len(prompts))
    data = R.prepare(model, variables, prompts, y, pids, e=e)
    router, params, _ = R.train_router(model, variables, pids, data, epochs=1, batch_size=8, lr=1e-2,
                                       progress=False)
    assert R.input_width(params) == 6
    forward = R.icr_forward(model, pids, router, embedded=True)
    routed = {**variables, "router": params}
    got = np.stack(run_logprobs(model, routed, prompts, forward=forward, extras={"e": e}))
    alpha, gamma = router.apply({"params": params}, jnp.asarray(e, jnp.float32))
    by_hand = []
    for i in range(6):  # row by row: evaluation groups the prompts by length
        edits = R.routing_edits(pids, alpha[i:i + 1], gamma[i:i + 1])  # alpha already at the read scale
        by_hand.append(run_logprobs(model, with_edits(variables, edits, model.cfg), prompts[i:i + 1])[0])
    # The router is float32 (its params and input): its alpha moves by ~1e-7 with the batch's shape, the
    # float64 logits by ~1e-8 (measured 1.1e-8); a wrong row, input or scale moves them by >= 1e-2.
    assert rel_err(got[:6], np.stack(by_hand)) <= 1e-6
    other = np.stack(run_logprobs(model, routed, prompts, forward=forward, extras={"e": e[::-1].copy()}))
    assert rel_err(other, got) >= 1e-3
    h0 = R.entry_residuals(model, variables, prompts, pids.layers[0])
    assert h0.dtype == np.float32 and h0.shape == (len(prompts), max(map(len, prompts)), model.cfg.d_model)
    cached = R.icr_forward(model, pids, router, embedded=True, cached=True)
    from_cache = np.stack(run_logprobs(model, routed, prompts, forward=cached, extras={"e": e, "h0": h0}))
    assert rel_err(from_cache, got) <= 1e-6  # the cache is float32, the model float64
    with pytest.raises(LiniclError, match="extras=\\{'e': ...\\}"):
        run_logprobs(model, routed, prompts, forward=forward)
    with pytest.raises(LiniclError, match="'h0'"):
        run_logprobs(model, routed, prompts, forward=cached, extras={"e": e})
    with pytest.raises(LiniclError, match=r"e \(the router's input embeddings\): expected shape \(\d+, 6\)"):
        run_logprobs(model, routed, prompts, forward=forward, extras={"e": e[:, :5].copy()})
    with pytest.raises(LiniclError, match="e: expected finite router inputs"):
        R.prepare(model, variables, prompts, y, pids, e=e[:3])


def test_alpha_schedule_is_a_cosine_from_one_to_point_eight():
    assert R.alpha_schedule(0.0) == pytest.approx(1.0) and R.alpha_schedule(1.0) == pytest.approx(0.8)
    assert R.alpha_schedule(0.5) == pytest.approx(0.9)


def test_activations_read_back_from_npz_fit_and_save(setup, tmp_path):
    """Collected in parts and saved (as a resumed run does), the layers come back as numpy ints: the
    PIDs fitted on them hold plain ints and save (JSON) like fresh ones."""
    model, variables, prompts, pids = setup
    acts = R.pid_activations(model, variables, prompts)
    np.savez(tmp_path / "acts.npz", layers=np.asarray(acts["layers"]), q=acts["q"], k=acts["k"])
    with np.load(tmp_path / "acts.npz") as f:
        back = {"layers": tuple(f["layers"]), "q": f["q"], "k": f["k"]}
    assert isinstance(back["layers"][0], np.integer)
    refit = R.fit_pids(back, r=4)
    assert refit.layers == pids.layers and all(type(l) is int for l in refit.layers)
    assert R.PIDs.load(refit.save(tmp_path / "p")).layers == pids.layers


def test_save_and_load_round_trips(setup, tmp_path):
    model, _, _, pids = setup
    loaded = R.PIDs.load(pids.save(tmp_path / "pids"))
    assert loaded.layers == pids.layers and loaded.meta == pids.meta and loaded.centered
    for name in ("U_q", "U_k", "mean_q", "mean_k", "explained_q", "explained_k"):
        assert np.array_equal(getattr(loaded, name), getattr(pids, name))
    router, params = _random_router(model, pids)
    router2, params2 = R.load_router(R.save_router(tmp_path / "router", router, params))
    assert router2 == router
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), params, params2)
    assert all(jax.tree_util.tree_leaves(same))
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="bad.npz"):
        R.PIDs.load(tmp_path / "bad.npz")
    with pytest.raises(DataError, match="nowhere"):
        R.load_router(tmp_path / "nowhere.safetensors")


def test_training_resumes_from_a_checkpoint(setup, tmp_path, monkeypatch):
    """A run stopped after step 4 of 6 and restarted from its checkpoint ends with the same params and
    history as an uninterrupted run."""
    model, variables, prompts, pids = setup
    y = np.random.default_rng(2).integers(0, model.cfg.vocab_size, len(prompts))
    data = R.prepare(model, variables, prompts, y, pids)
    kw = dict(epochs=2, batch_size=8, progress=False, log_every=1)
    _, whole, whole_history = R.train_router(model, variables, pids, data, **kw)

    class Stop(Exception):
        pass
    schedule, calls = R.alpha_schedule, []

    def stopping(progress):
        calls.append(progress)
        if len(calls) == 5:  # the 5th step (t = 4) never runs
            raise Stop
        return schedule(progress)
    ckpt = tmp_path / "ckpt.safetensors"
    monkeypatch.setattr(R.training, "alpha_schedule", stopping)
    with pytest.raises(Stop):
        R.train_router(model, variables, pids, data, checkpoint=ckpt, checkpoint_every=2, **kw)
    monkeypatch.setattr(R.training, "alpha_schedule", schedule)
    assert ckpt.exists()
    _, resumed, history = R.train_router(model, variables, pids, data, checkpoint=ckpt, checkpoint_every=2, **kw)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), whole, resumed)
    assert all(jax.tree_util.tree_leaves(same))
    assert [h["step"] for h in history] == list(range(6))
    assert history == whole_history  # the logged losses too (JSON keeps floats exactly)
    with pytest.raises(DataError, match="6-step run"):  # other settings refuse the checkpoint
        R.train_router(model, variables, pids, data, checkpoint=ckpt, **{**kw, "epochs": 1})


def test_task_vector_edits_one_vector_or_one_per_row(setup):
    """The fixed-vector form and the per-row (``extras``) form add the same vector at the last token;
    the per-row form is one function per layer (one compilation for every task)."""
    model, variables, prompts, _ = setup
    layer = 1
    few, zero = prompts[:12], [p[-4:] for p in prompts[12:]]
    v = R.task_vector(model, variables, few, zero, layer)
    assert v.shape == (model.cfg.d_model,) and np.all(np.isfinite(v))
    base = np.stack(run_logprobs(model, variables, prompts))
    fixed = np.stack(run_logprobs(model, variables, prompts, edits=R.task_vector_edits(v, layer)))
    per_row = np.stack(run_logprobs(model, variables, prompts, edits=R.task_vector_edits(None, layer),
                                    extras=np.tile(v, (len(prompts), 1))))
    assert rel_err(per_row, fixed) <= 1e-6 and rel_err(fixed, base) >= BASELINE_MIN
    assert R.task_vector_edits(None, layer) is R.task_vector_edits(None, layer)


def test_router_input_leaves_out_the_first_token():
    """The mean runs over the real tokens after the first (the attention sink), or the first alone."""
    h = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 4)))
    h = h.at[:, 0].set(1e4)  # a massive first-token residual must not enter
    out = R.router_input(h, jnp.array([5, 3, 1]))
    assert np.allclose(out[0], h[0, 1:5].mean(0), atol=1e-5) and np.allclose(out[1], h[1, 1:3].mean(0), atol=1e-5)
    assert np.allclose(out[2], h[2, 0]) and out.dtype == jnp.float32


# ----------------------------------------------------------------------------- the bias's size

def _scores_shift(model, variables, pids, alpha, gamma, toks):
    """The bias as the model applies it: edited minus plain ``hook_attn_scores`` of the (single)
    routed layer, ``[batch, heads, T, T]``, and the plain scores."""
    name = f"blocks.{pids.layers[0]}.attn.hook_attn_scores"
    plain = capture(model, variables, toks, names=[name])[1][name]
    edited = with_edits(variables, R.routing_edits(pids, alpha, gamma), model.cfg)
    return capture(model, edited, toks, names=[name])[1][name] - plain, plain


def _random_alpha_gamma(seed, batch, rank, heads):
    """alpha ``[batch, 1, rank]`` (normal) and gamma ``[batch, 1, heads]`` (uniform) for one routed layer."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(batch, 1, rank))), jnp.asarray(rng.uniform(size=(batch, 1, heads)))


def _qk(model, variables, toks, layer):
    """The layer's hook_q and hook_k of ``toks`` (the unrouted model)."""
    names = [f"blocks.{layer}.attn.hook_q", f"blocks.{layer}.attn.hook_k"]
    acts = capture(model, variables, toks, names=names)[1]
    return acts[names[0]], acts[names[1]]


def _row_std(x, T):
    """Mean over rows t >= 1 of the std over keys s <= t of ``x: [..., T, T]`` (all rows real)."""
    return np.mean([x[..., t, :t + 1].std(-1).mean() for t in range(1, T)])


@pytest.fixture(scope="module")
def last_layer(setup):
    """PIDs of the last layer only (a bias elsewhere would change what reaches it) and 12 prompts of
    one length (every row real)."""
    model, variables, prompts, _ = setup
    pids = R.extract_pids(model, variables, prompts, layers=[model.cfg.n_layers - 1], r=3)
    toks = tokens(7, 12, 10, model.cfg.vocab_size)
    return pids, toks


def test_the_paper_bias_is_the_formula(setup, last_layer):
    """bias = gamma_h (Q U_q) diag(alpha) (K U_k)^T, Q and K the projections at hook_q/hook_k (before
    rope), unscaled: checked against the model's own edited scores."""
    model, variables, _, _ = setup
    pids, toks = last_layer
    alpha, gamma = _random_alpha_gamma(3, 12, 3, model.cfg.n_heads)
    shift, _ = _scores_shift(model, variables, pids, alpha, gamma, toks)
    q, k = _qk(model, variables, toks, pids.layers[0])
    q = np.asarray(q).reshape(12, 10, -1) @ pids.U_q[0]
    k = np.asarray(k).reshape(12, 10, -1) @ pids.U_k[0]
    want = np.einsum("bh,btr,br,bsr->bhts", gamma[:, 0], q, alpha[:, 0], k)
    assert rel_err(shift, want) <= EXACT_RTOL


def test_on_logit_scale_one_direction_moves_the_logits_by_their_own_spread(setup, last_layer):
    """After ``on_logit_scale`` one direction at alpha = 1 (gate 1) moves the logits by the model's own
    spread over keys, on the calibration prompts, as the model applies the bias; the whitened
    projections have unit spread. A random basis calibrated alike has the same bias size, which the
    paper's bias does not give either of them."""
    model, variables, _, _ = setup
    pids, toks = last_layer
    prompts = list(np.asarray(toks))
    sizes = {}
    for name, p in (("pids", pids), ("random", R.random_basis(pids, 5))):
        logit = R.on_logit_scale(model, variables, p, prompts)
        assert logit.bias == "logit" and logit.bias_scale.shape == (1,) and logit.sd_q.shape == (1, 3)
        gamma = jnp.ones((12, 1, model.cfg.n_heads))
        per_dir, paper = [], []
        for j in range(3):
            alpha = jnp.zeros((12, 1, 3)).at[:, :, j].set(1.0)
            shift, plain = _scores_shift(model, variables, logit, alpha, gamma, toks)
            per_dir.append(_row_std(np.asarray(shift[:, 0]), 10))  # the bias is the same for every head
            paper.append(_row_std(np.asarray(_scores_shift(model, variables, p, alpha, gamma, toks)[0][:, 0]), 10))
        own = _row_std(np.asarray(plain), 10)
        sizes[name] = (np.mean(per_dir), np.mean(paper))
        assert abs(np.mean(per_dir) / own - 1) <= 1e-10, name
    assert abs(sizes["pids"][0] / sizes["random"][0] - 1) <= 1e-10  # matched at the logit scale
    assert abs(sizes["pids"][1] / sizes["random"][1] - 1) >= 0.05  # not at the paper's
    # whitening: the centred, projected, scaled q has unit spread over positions after the first
    p = R.on_logit_scale(model, variables, pids, prompts)
    l = pids.layers[0]
    q = np.asarray(capture(model, variables, toks, names=[f"blocks.{l}.attn.hook_q"])[1][f"blocks.{l}.attn.hook_q"])
    z = ((q.reshape(12, 10, -1)[:, 1:] - p.mean_q[0]) @ p.U_q[0]).reshape(-1, 3) / p.sd_q[0]
    assert np.allclose(z.std(0), 1.0, rtol=1e-12)


def test_logit_scale_pids_save_load_and_refuse_half_settings(setup, last_layer, tmp_path):
    model, variables, _, _ = setup
    pids, toks = last_layer
    logit = R.on_logit_scale(model, variables, pids, list(np.asarray(toks)))
    back = R.PIDs.load(logit.save(tmp_path / "p"))
    assert back.bias == "logit" and np.array_equal(back.bias_scale, logit.bias_scale)
    assert R.PIDs.load(pids.save(tmp_path / "q")).bias == "paper"
    import dataclasses
    with pytest.raises(LiniclError, match="come together and only with bias='logit'"):
        dataclasses.replace(logit, sd_q=None)
    with pytest.raises(LiniclError, match="bias must be one of"):
        dataclasses.replace(pids, bias="unit")
    with pytest.raises(linicl.errors.DegenerateInputError, match="at most 2 tokens"):
        R.on_logit_scale(model, variables, pids, [np.array([1, 2], np.int32)])


def test_bias_size_is_the_last_rows_spread_and_training_logs_it(setup, last_layer):
    """``bias_size``: the std over keys of the bias at each row's last query, times the mean gate,
    averaged over the batch, as the model applies it."""
    model, variables, _, _ = setup
    pids, toks = last_layer
    alpha, gamma = _random_alpha_gamma(4, 12, 3, model.cfg.n_heads)
    shift, _ = _scores_shift(model, variables, pids, alpha, gamma, toks)
    q, k = _qk(model, variables, toks, pids.layers[0])
    size = R.bias_size(pids, [q], [k], alpha, gamma, jnp.full((12,), 10))
    want = np.mean(np.asarray(shift)[:, :, -1, :].std(-1).mean(-1))  # heads differ only by their gate
    assert rel_err(size, np.array([want])) <= EXACT_RTOL


def test_label_restricted_cross_entropy(setup):
    """``target="labels"``: CE over each query's label tokens only; the full-vocabulary CE is larger
    (it also pays for the mass outside the labels). The router keeps the schedule's last alpha scale."""
    from linicl.routing.training import _label_ce
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 20)))
    cand = jnp.array([[2, 5, -1], [7, 1, 3], [0, 4, -1]])
    y = jnp.array([5, 3, 0])
    want = -np.mean([jax.nn.log_softmax(logits[i, [c for c in cand[i] if c >= 0]])[list(cand[i]).index(y[i])]
                     for i in range(3)])
    assert rel_err(_label_ce(logits, y, cand), want) <= EXACT_RTOL
    model, variables, prompts, pids = setup
    y = np.random.default_rng(1).integers(0, 50, len(prompts))
    candidates = [[int(t), (int(t) + 1) % 50] for t in y]
    with pytest.raises(LiniclError, match="needs TrainingData.candidates"):
        R.train_router(model, variables, pids, R.prepare(model, variables, prompts, y, pids), target="labels",
                       epochs=1, progress=False)
    with pytest.raises(LiniclError, match=r"candidates\[0\]: expected distinct label tokens in \[0, 64\) holding the answer"):
        R.prepare(model, variables, prompts, y, pids, candidates=[[999, 998]] + candidates[1:])
    data = R.prepare(model, variables, prompts, y, pids, candidates=candidates)
    router, _, history = R.train_router(model, variables, pids, data, target="labels", epochs=1, batch_size=8,
                                        progress=False, log_every=1)
    assert router.alpha_scale == pytest.approx(0.8) and len(history[0]["bias_size"]) == len(pids.layers)
    assert all(np.isfinite(h["ce"]) for h in history)
    with pytest.raises(LiniclError, match="target must be one of"):
        R.train_router(model, variables, pids, data, target="vocabulary", progress=False)


def test_on_gemma_the_bias_projects_q_and_k_as_the_pids_saw_them():
    """Gemma normalises and scales q and k before scoring them; the bias (like the PIDs, read at
    hook_q/hook_k) uses the projections before that. Before the fix it used the normalised ones."""
    from helpers import FIXTURES
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / "gemma3-tiny", dtype="float64")
    assert model.cfg.qk_norm
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, model.cfg.vocab_size, 9).astype(np.int32) for _ in range(12)]
    pids = R.extract_pids(model, variables, prompts, r=2)
    toks = jnp.asarray(np.stack(prompts[:3]))
    alpha, gamma = _random_alpha_gamma(2, 3, 2, model.cfg.n_heads)
    shift, _ = _scores_shift(model, variables, pids, alpha, gamma, toks)
    q, k = _qk(model, variables, toks, 2)
    q = np.asarray(q).reshape(3, 9, -1) @ pids.U_q[0]
    k = np.asarray(k).reshape(3, 9, -1) @ pids.U_k[0]
    assert rel_err(shift, np.einsum("bh,btr,br,bsr->bhts", gamma[:, 0], q, alpha[:, 0], k)) <= EXACT_RTOL


def test_pids_from_activations_collected_in_parts(setup):
    """Collecting the activations in two parts and fitting once gives the PIDs of one collection."""
    model, variables, prompts, pids = setup
    a, b = (R.pid_activations(model, variables, part) for part in (prompts[:10], prompts[10:]))
    joined = {"layers": a["layers"], "q": np.concatenate([a["q"], b["q"]], 1), "k": np.concatenate([a["k"], b["k"]], 1)}
    again = R.fit_pids(joined, r=4)
    for name in ("U_q", "U_k", "mean_q", "mean_k"):
        assert rel_err(getattr(again, name), getattr(pids, name)) <= EXACT_RTOL, name
    assert again.meta["n_prompts"] == len(prompts)


def test_one_icr_forward_serves_every_basis_through_the_variables(setup):
    """``variables["routing_bias"]`` overrides the forward's own basis: the logits equal those of a
    forward built on that basis."""
    model, variables, prompts, pids = setup
    router, params = _random_router(model, pids)
    other = R.random_basis(pids, 3)
    shared = R.icr_forward(model, pids, router)
    via_variables = np.stack(run_logprobs(model, {**variables, "router": params, "routing_bias": other.routing_bias()},
                                          prompts, forward=shared))
    own = np.stack(run_logprobs(model, {**variables, "router": params}, prompts,
                                forward=R.icr_forward(model, other, router)))
    assert rel_err(via_variables, own) <= EXACT_RTOL
    base = np.stack(run_logprobs(model, {**variables, "router": params}, prompts, forward=shared))
    assert rel_err(via_variables, base) >= BASELINE_MIN  # the basis matters


def test_router_training_in_bfloat16_keeps_float32_router_weights(setup, tmp_path):
    """compute_dtype="bfloat16": the routed layers run in bf16 (the first loss differs from the float64
    run's by about bf16's rounding, ~1e-2 relative, and not by 0), the router's weights and the
    optimiser stay in their own dtype, and its checkpoints are not a full-precision run's."""
    model, variables, prompts, pids = setup
    y = np.random.default_rng(3).integers(0, model.cfg.vocab_size, len(prompts))
    data = R.prepare(model, variables, prompts, y, pids)
    kw = dict(epochs=1, batch_size=8, progress=False, log_every=1)
    _, full, full_history = R.train_router(model, variables, pids, data, **kw)
    ckpt = tmp_path / "bf16.safetensors"
    _, half, history = R.train_router(model, variables, pids, data, compute_dtype="bfloat16", checkpoint=ckpt, **kw)
    assert jax.tree_util.tree_map(lambda a: a.dtype, half) == jax.tree_util.tree_map(lambda a: a.dtype, full)
    first, first_full = history[0]["loss"], full_history[0]["loss"]
    assert np.isfinite([h["loss"] for h in history]).all()
    assert 0 < abs(first - first_full) / abs(first_full) < 3e-2
    with pytest.raises(Exception, match="compute_dtype"):  # a float run does not resume a bf16 checkpoint
        R.train_router(model, variables, pids, data, checkpoint=ckpt, **kw)
    with pytest.raises(LiniclError, match="compute_dtype"):
        R.train_router(model, variables, pids, data, compute_dtype="float16", **kw)
