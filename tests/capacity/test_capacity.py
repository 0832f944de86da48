"""linicl.capacity: the mixers' configs, decays and gate start; MQAR's curriculum, widening, metrics and
prompted-against-converted evaluation; the regression's read-in/out, error intervals, evaluation and
baselines; bad arguments named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linicl import iclca
from linicl.capacity import mixers, mqar, regression
from linicl.data.synthetic import TokenBatch, mqar_batch
from linicl.errors import LiniclError
from linicl.memory import kv_cache_floats
from linicl.nn import Transformer

SIZES = dict(d_model=8, n_layers=1, n_heads=2, d_ff=16)


def config(mixer, **changes):
    return mixers.mixer_config(mixer, **dict(SIZES, vocab_size=16, max_len=32, **changes))


def test_decays_span_a_shift_to_a_long_memory():
    g = mixers.decays(4)
    np.testing.assert_allclose(g, 1 - np.exp2(-np.linspace(0.4, 6.6, 4)))
    assert g[0] < 0.3 and g[-1] > 0.98 and mixers.decays(1) == (0.875,)
    with pytest.raises(LiniclError, match="n_heads"):
        mixers.decays(0)


def test_configs_match_state_sizes_and_name_an_unknown_mixer():
    cfgs = {m: config(m) for m in mixers.MIXERS}
    assert cfgs["softmax"].attention == "softmax" and cfgs["softmax"].positions == "rope"
    assert cfgs["decayed"].decay == pytest.approx(mixers.decays(2))
    d = SIZES["d_model"] // SIZES["n_heads"]
    for m, cfg in cfgs.items():
        if m != "softmax":
            assert cfg.form == "chunked" and cfg.feature_dim == d
            assert iclca.state_floats(cfg) == 2 * d * d + (0 if cfg.update == "delta" else 2 * d)
            assert mixers.prompt_floats(cfg, 100) == iclca.state_floats(cfg)
            assert mixers.state_label(cfg) == f"state {iclca.state_floats(cfg)}"
    assert mixers.prompt_floats(cfgs["softmax"], 6) == kv_cache_floats(cfgs["softmax"], 6) == 2 * 2 * 4 * 6
    assert mixers.state_label(cfgs["softmax"]) == "KV cache"
    with pytest.raises(LiniclError, match="mixer: unknown mixer 'mamba'"):
        config("mamba")


@pytest.mark.parametrize("mixer", ["gated", "gated_vector", "linear"])
def test_gates_start_at_the_decays(mixer):
    cfg = config(mixer)
    for embeds in (False, True):
        params = mixers.init_params(cfg, jax.random.PRNGKey(0), embeds=embeds)
        if cfg.gate == "none":
            assert "gate_proj" not in params["layers_0"]["attn"]
            continue
        bias = np.asarray(params["layers_0"]["attn"]["gate_proj"]["bias"], np.float64)
        alpha = 1 / (1 + np.exp(-bias.reshape(2, -1)))
        np.testing.assert_allclose(alpha, np.broadcast_to(np.array(mixers.decays(2))[:, None], alpha.shape),
                                   rtol=1e-5)


def test_eval_model_is_float64_and_recurrent():
    cfg = config("delta")
    model, params = mixers.eval_model(cfg, mixers.init_params(cfg, jax.random.PRNGKey(0)))
    assert model.cfg.dtype == "float64" and model.cfg.form == "recurrent"
    assert all(a.dtype == np.float64 for a in jax.tree.leaves(params))
    model, _ = mixers.eval_model(config("softmax"), {})
    assert model.cfg.dtype == "float64" and model.cfg.attention == "softmax"


def test_curriculum_doubles_the_vocabulary_then_trains_the_pairs():
    plan = mqar.curriculum(64, circuit_steps=3, circuit_batch=8, vocab_steps=2, steps=4, train_pairs=[2, 8],
                           queries=16)
    assert [(s.name, s.steps, s.sub_vocab) for s in plan] == [("circuit", 3, 16), ("vocab 32", 2, 32),
                                                                ("vocab 64", 2, 64), ("pairs", 4, 64)]
    assert plan[-1].sizes == ((2, 1, 16), (8, 4, 4)) and mqar.n_queries(1) == 1
    short = mqar.curriculum(16, circuit_steps=0, circuit_batch=8, vocab_steps=2, steps=4, train_pairs=[2], queries=4)
    assert [s.name for s in short] == ["pairs"]
    with pytest.raises(LiniclError, match="vocab must be even"):
        mqar.curriculum(15, circuit_steps=1, circuit_batch=1, vocab_steps=1, steps=1, train_pairs=[2], queries=1)


def test_widen_moves_values_only():
    b = mqar_batch(jax.random.PRNGKey(0), 4, 2, 1, 16)
    w = mqar.widen(b, 16, 32)
    x = np.asarray(b.inputs)
    np.testing.assert_array_equal(np.asarray(w.inputs), np.where(x < 8, x, x + 8))
    np.testing.assert_array_equal(np.asarray(w.mask), np.asarray(b.mask))
    with pytest.raises(LiniclError, match="sub_vocab"):
        mqar.widen(b, 32, 16)


def test_masked_metrics_count_the_query_keys_only():
    targets = jnp.array([[1, 2, 3]])
    batch = TokenBatch(targets, targets, jnp.array([[False, True, True]]))
    logits = 50.0 * jax.nn.one_hot(jnp.array([[0, 2, 0]]), 4)      # right at position 1, wrong at 2
    loss, acc = mqar.masked_metrics(logits, batch)
    assert float(acc) == 0.5 and float(loss) == pytest.approx(50.0 / 2, rel=1e-6)


@pytest.mark.parametrize("mixer", ["gated_delta", "softmax"])
def test_mqar_evaluation_converts_the_pairs(mixer):
    model, params = mixers.eval_model(config(mixer), mixers.init_params(config(mixer), jax.random.PRNGKey(1)))
    batch = jax.tree.map(np.asarray, mqar.held_out(0, 4, 3, 2, 16))
    row = mqar.evaluate(model, jax.jit(model.apply), {"params": params}, batch, 3)
    assert row["pairs"] == 3 and row["queries"] == 8 == len(row["hits"])
    assert row["prompted"]["low"] <= row["prompted"]["acc"] <= row["prompted"]["high"]
    if mixer == "softmax":
        assert "converted" not in row and row["prompt_floats"] == kv_cache_floats(model.cfg, 6)
    else:
        assert row["identical"] and row["converted"] == row["prompted"] and row["max_rel_logit_diff"] < 1e-10
    rows = {"eval": [row]}
    comps = mqar.compare({"delta": rows, "linear": rows, "gated": rows})
    assert [(c["delta"], c["diff"], c["significant"]) for c in comps] == [("delta", 0.0, False)]


def test_regression_init_and_loss():
    cfg = config("linear").replace(vocab_size=1)
    params = regression.init(cfg, 3, jax.random.PRNGKey(0))
    assert params["read_in"]["kernel"].shape == (4, 8) and params["read_out"]["kernel"].shape == (8, 1)
    assert params["read_in"]["kernel"].dtype == np.float32
    stage = regression.stage(4, 3, 2, steps=5)
    assert stage.sizes == ((4, 3, 2),) and stage.steps == 5
    loss, aux = regression.loss_fn(Transformer(cfg), stage)(params, jax.random.PRNGKey(1))
    assert loss.shape == () and np.isfinite(float(loss)) and aux == ()
    with pytest.raises(LiniclError, match="d_x"):
        regression.init(cfg, 0, jax.random.PRNGKey(0))


def test_error_interval_and_baselines():
    data = regression.held_out(0, 64, 4, 2)
    assert data.xs.dtype == np.float64 and data.xs.shape == (64, 4, 2)
    zero = regression.error_interval(np.zeros(64), data.ys[:, 3], 2)
    assert zero["mean"] == pytest.approx(np.mean(data.ys[:, 3] ** 2) / 2, rel=1e-12)
    assert zero["low"] <= zero["mean"] <= zero["high"]
    base = regression.baselines(data, [1, 3])
    assert list(base) == list(regression.BASELINES) and [r["k"] for r in base["zero"]] == [1, 3]
    assert base["least squares"][1]["error"]["mean"] < 1e-10   # k = 3 > d_x: exact (to f32 data)
    assert base["zero"][1]["error"] == zero
    with pytest.raises(LiniclError, match="pred and y"):
        regression.error_interval(np.zeros(3), np.zeros(4), 2)


@pytest.mark.parametrize("mixer", ["decayed", "softmax"])
def test_regression_evaluation_converts_the_pairs(mixer):
    cfg = config(mixer).replace(vocab_size=1)
    model, params = mixers.eval_model(cfg, regression.init(cfg, 2, jax.random.PRNGKey(0)))
    apply = jax.jit(lambda *a: regression.regress(model, *a))
    data = regression.held_out(0, 8, 4, 2)
    rows = regression.evaluate(model, apply, params, data, [1, 3])
    assert [r["k"] for r in rows] == [1, 3]
    for r in rows:
        if mixer == "softmax":
            assert "converted" not in r and r["prompt_floats"] == kv_cache_floats(model.cfg, 2 * r["k"])
        else:
            assert r["identical"] and r["max_rel_diff"] <= regression.REL_TOL
            assert r["converted"] == pytest.approx(r["prompted"]["mean"], rel=1e-9)
    with pytest.raises(LiniclError, match="ks: k = 4"):
        regression.evaluate(model, apply, params, data, [4])
