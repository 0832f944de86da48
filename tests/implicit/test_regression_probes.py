"""linicl.implicit.regression: the paper's in-context regression model, its per-step metrics and
probes (the implicit models equal the model with context), and the training loop that records them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import implicit
from linicl.data import regression
from linicl.errors import LiniclError

D_X, N, B = 2, 7, 4


@pytest.fixture(scope="module", params=["none", "pre"])
def setup(request):
    cfg = implicit.fig1_config(d_x=D_X, n_layers=2, n_heads=3, n_tokens=N, norm=request.param, dtype="float64")
    model = linicl.Transformer(cfg)
    variables = regression.numpy_init(model, jnp.zeros((1, N, cfg.d_model), jnp.float64), seed=1)
    batch = regression.sample(jax.random.PRNGKey(2), B, N, D_X, dtype=jnp.float64)
    return model, variables, batch


def test_fig1_config_is_the_papers_model():
    cfg = implicit.fig1_config()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.mlp_depth, cfg.max_len) == (3, 5, 3, 12, 3, 51)
    assert cfg.positions == "none" and not cfg.final_norm and not cfg.attn_bias and cfg.mlp_bias and cfg.causal
    with pytest.raises(LiniclError, match="d_x"):
        implicit.fig1_config(d_x=0)


def test_step_metrics_and_the_implicit_models_match_the_model(setup):
    model, variables, batch = setup
    out = model.apply(variables, embeds=batch.tokens, hidden=True)
    want = regression.loss(regression.readout(out, D_X), batch.target)
    m = implicit.step_metrics(model, variables, batch, D_X)
    assert float(m["model"]) == pytest.approx(float(want), rel=1e-12)
    assert float(m["implicit_last_block"]) == pytest.approx(float(want), rel=1e-10)  # the identity, float64
    assert m["dW_fro_last_token"].shape == (2,) and np.all(np.asarray(m["dW_fro_last_token"]) > 0)
    mu = implicit.updates(model, variables, embeds=batch.tokens)
    net = implicit.patched_network_prediction(model, variables, mu, batch.tokens[:, -1], D_X)
    np.testing.assert_allclose(net, regression.readout(out, D_X), rtol=1e-9, atol=1e-12)


def test_exactness_probe(setup):
    model, variables, batch = setup
    p = implicit.exactness(model, variables, batch, D_X, align_tasks=2)
    assert np.all(np.asarray(p["msd"]) < 1e-20) and np.all(np.asarray(p["max_abs_err"]) < 1e-9)
    assert np.all(np.asarray(p["rank_sum_max"]) == 1) and np.all(np.asarray(p["rank_sum_min"]) == 1)
    assert float(p["loss_implicit_network"]) == pytest.approx(float(p["loss_model"]), rel=1e-9)
    assert p["align_tokens"].shape == (2, 2, N, N) and p["align_blocks"].shape == (2, 2, 2)
    blocks = np.asarray(p["align_blocks"])
    np.testing.assert_allclose(blocks[:, [0, 1], [0, 1]], 1.0, rtol=1e-12)  # an update aligns with itself


def test_train_with_probes_records_every_step(setup):
    model, variables, _ = setup
    kw = dict(steps=3, batch=B, n_tokens=N, d_x=D_X, lr=5e-2, seed=0, msd_steps=[1, 3], align_steps=[0])
    run = implicit.train_with_probes(model, variables, **kw)
    c = run["curves"]
    assert run["steps"] == [0, 1, 2, 3] and len(c["train_loss"]) == 3 and len(c["model"]) == 4
    assert np.asarray(c["dW_fro_last_token"]).shape == (4, 2)
    assert sorted(run["msd_steps"]) == [1, 3] and list(run["alignment_steps"]) == [0]
    assert "align_tokens" not in run["msd_steps"][1] and max(run["msd_steps"][3]["msd"]) < 1e-20
    assert np.asarray(run["alignment_steps"][0]["tokens"]).shape == (2, 3, N, N)
    # Step 0 is the initialisation: its test loss is step_metrics of the variables on test batch 0.
    k_test = jax.random.split(jax.random.PRNGKey(0))[1]
    batch0 = regression.sample(jax.random.fold_in(k_test, 0), B, N, D_X, d_model=D_X + 1, dtype=jnp.float64)
    assert c["model"][0] == pytest.approx(float(implicit.step_metrics(model, variables, batch0, D_X)["model"]))
    for bad, match in ((dict(msd_steps=[4]), "msd_steps"), (dict(align_tasks=B + 1), "align_tasks"),
                       (dict(steps=-1), "steps")):
        with pytest.raises(LiniclError, match=match):
            implicit.train_with_probes(model, variables, **{**kw, **bad})
