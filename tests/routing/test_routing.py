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
from helpers import BASELINE_MIN, EXACT_RTOL, init, rel_err, tokens


@pytest.fixture(scope="module")
def setup():
    cfg = linicl.preset("tiny-llama", n_layers=3, dtype="float64")
    model, variables = init(cfg, 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, rng.integers(5, 14)).astype(np.int32) for _ in range(24)]
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
    prompts = [rng.integers(0, model.cfg.vocab_size, rng.integers(5, 14)).astype(np.int32) for _ in range(12)]
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


def test_alpha_schedule_is_a_cosine_from_one_to_point_eight():
    assert R.alpha_schedule(0.0) == pytest.approx(1.0) and R.alpha_schedule(1.0) == pytest.approx(0.8)
    assert R.alpha_schedule(0.5) == pytest.approx(0.9)


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
