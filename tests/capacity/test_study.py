"""linicl.capacity.study and linicl.capacity.report: the run's options, configs (matched state sizes,
short convolution), curriculum, checkpoint fingerprints (training options only), one tiny model
trained, saved and reused, and the tables and figures of a report; bad arguments named."""

import json

import jax
import numpy as np
import pytest

from linicl import checkpoint, iclca
from linicl.capacity import mixers, mqar, regression, report, study
from linicl.errors import LiniclError


def test_options_apply_changes_and_name_unknown_ones():
    opts = study.options(quick=True, vocab=32, pairs=None)
    assert opts["vocab"] == 32 and opts["pairs"] == study.QUICK["pairs"] and opts["quick"]
    assert opts["mixers"] == list(mixers.MIXERS) and opts["tasks"] == list(study.TASKS) and opts["seed"] == 0
    assert study.options()["vocab"] == study.FULL["vocab"]
    with pytest.raises(LiniclError, match="unknown option.*vocabulary"):
        study.options(vocabulary=32)


def test_curriculum_stages():
    opts = study.options(vocab=128)
    plan = study.stages(opts)
    assert [s.name for s in plan] == ["circuit", "vocab 32", "vocab 64", "vocab 128", "pairs"]
    assert [s.sub_vocab for s in plan] == [16, 32, 64, 128, 128]
    assert all(s.sizes == ((2, 1, opts["circuit_batch"]),) for s in plan[:-1])
    q = opts["queries"]                                                   # n / 2 queries, q / (n / 2) rows
    assert plan[-1].sizes == ((2, 1, q), (4, 2, q // 2), (8, 4, q // 4), (16, 8, q // 8), (32, 16, q // 16))
    assert plan[-1].steps == opts["steps"]
    # a vocabulary of 16 needs no doubling stage; zero steps drop a stage
    assert [s.name for s in study.stages(study.options(quick=True))] == ["circuit", "pairs"]
    assert [s.name for s in study.stages(study.options(vocab_steps=0))] == ["circuit", "pairs"]
    assert study.regression_stages(study.options(quick=True)) == [regression.stage(4, 2, 8, 2)]


def test_matched_state_sizes_and_gate_initialisation():
    opts = study.options(quick=True, n_heads=4, d_model=32)
    cfgs = {m: study.model_config(opts, m) for m in mixers.MIXERS}
    L, H, d = 2, 4, 8
    for m, cfg in cfgs.items():
        assert cfg.max_len == 4 * 4 and cfg.vocab_size == 16          # 4 x the most pairs (4)
        if m == "softmax":
            continue
        assert cfg.feature_dim == d
        expected = L * H * d * d + (0 if cfg.update == "delta" else L * H * d)   # the delta rule has no z
        assert iclca.state_floats(cfg) == expected
    assert cfgs["decayed"].decay == pytest.approx(mixers.decays(4))
    for m in ("gated", "gated_vector", "gated_delta"):
        params = study.mqar_init(opts, m, jax.random.PRNGKey(0))
        for layer in range(L):
            bias = np.asarray(params[f"layers_{layer}"]["attn"]["gate_proj"]["bias"], np.float64)
            alpha = 1 / (1 + np.exp(-bias))                               # alpha at x W = 0
            np.testing.assert_allclose(alpha.reshape(H, -1), np.broadcast_to(np.array(mixers.decays(4))[:, None],
                                                                             alpha.reshape(H, -1).shape), rtol=1e-5)


def test_short_convolution_reaches_every_linear_mixer_and_the_fingerprint():
    plain, conv = study.options(quick=True), study.options(quick=True, short_conv=4)
    for mixer in mixers.MIXERS:
        cfg = study.model_config(conv, mixer)
        want = 0 if cfg.attention == "softmax" else 4  # softmax keeps no convolution (not a finite state)
        assert cfg.short_conv == want and study.model_config(plain, mixer).short_conv == 0
        if want:
            assert cfg.short_conv_activation == "silu"
            assert study.settings(conv, mixer)["fingerprint"] != study.settings(plain, mixer)["fingerprint"]


def test_regression_settings_and_fingerprints():
    opts = study.options(quick=True)
    mq, reg = study.settings(opts, "gated_delta"), study.settings(opts, "gated_delta", "regression")
    assert mq["trainer"] == reg["trainer"] == study.TRAINER
    assert "task" not in mq and reg["task"] == "regression" and reg["fingerprint"] != mq["fingerprint"]
    assert set(mq["training"]) == set(study.TRAINING) and set(reg["training"]) == set(study.REG_TRAINING)
    assert reg["model"]["vocab_size"] == 1 and reg["model"]["max_len"] == 2 * opts["reg_examples"]
    assert reg["stages"] == [dict(name="regression", steps=2, sub_vocab=0, sizes=[[4, 2, 8]])]
    assert json.loads(json.dumps(reg)) == reg                              # as a checkpoint stores it
    # evaluation options never retrain; training options do, and the regression's never touch MQAR's
    assert study.settings(study.options(quick=True, reg_k=[1, 64], reg_eval_batch=3), "gated_delta",
                          "regression") == reg
    assert study.settings(study.options(quick=True, eval_batch=3, eval_queries=1), "gated_delta") == mq
    changed = study.options(quick=True, reg_dx=3, reg_steps=5)
    assert study.settings(changed, "gated_delta", "regression") != reg
    assert study.settings(changed, "gated_delta") == mq
    params = study.regression_init(opts, "gated", jax.random.PRNGKey(0))
    assert params["read_in"]["kernel"].shape == (3, 16) and params["read_out"]["kernel"].shape == (16, 1)
    bias = np.asarray(params["model"]["layers_0"]["attn"]["gate_proj"]["bias"], np.float64)
    np.testing.assert_allclose(1 / (1 + np.exp(-bias)), mixers.decays(2), rtol=1e-5)  # the gates as for MQAR
    with pytest.raises(LiniclError, match="task: unknown task 'ridge'"):
        study.settings(opts, "linear", "ridge")


def test_trained_saves_then_reuses_and_retrains_on_other_settings(tmp_path, capsys):
    opts = study.options(quick=True, mixers=["linear"], d_model=8, d_ff=8, n_layers=1, circuit_steps=1,
                         steps=1, chunk=1, pairs=[2], eval_batch=4)
    params, meta, reused = study.trained(opts, "linear", str(tmp_path))
    path = tmp_path / "checkpoints" / "linear.ckpt"
    assert not reused and path.is_file() and checkpoint.header(path).settings == study.settings(opts, "linear")
    assert [h["step"] for h in meta["history"]] == [1, 2] and meta["train_s"] > 0
    again, meta2, reused = study.trained(opts, "linear", str(tmp_path))
    assert reused and meta2["history"] == meta["history"]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = dict(opts, lr=1e-3)
    _, _, reused = study.trained(other, "linear", str(tmp_path))
    assert not reused and "trained under other settings" in capsys.readouterr().err

    # run: the checkpoint (now of the other settings) reused, evaluated in float64, converted = prompted
    results = study.run(other, str(tmp_path), progress=False)
    (row,) = results["linear"]["eval"]
    assert results["linear"]["reused_checkpoint"] and results["linear"]["state"].startswith("state ")
    assert row["pairs"] == 2 and row["queries"] == 4 * opts["eval_queries"] and row["identical"]


# ---------------------------------------------------------------------------------------- report
def _mqar_report() -> dict:
    hits = [1, 0, 1, 1]
    row = dict(pairs=4, queries=4, correct=3, prompt_floats=64, prompted=mqar.accuracy(np.array(hits, bool)),
               hits=hits)
    conv = dict(row, converted=row["prompted"], correct_converted=3, identical=True, max_rel_logit_diff=0.0)
    results = {m: dict(eval=[conv if m != "softmax" else row], state="state 64", history=[dict(step=1, loss=1.0)])
               for m in ("softmax", "linear", "delta")}
    return dict(config=dict(pairs=[4], stages=[dict(steps=1)]), results=results, comparisons=mqar.compare(results))


def test_mqar_tables_mark_the_kv_cache_and_the_comparisons():
    rep = _mqar_report()
    text = report.mqar_tables(rep)
    assert "| softmax | 4 | 64 | 75.0 [" in text and "not convertible (KV cache)" in text
    assert "| delta - linear | 4 | 0.0 [0.0, 0.0] (n.s.) |" in text and report.headline(rep) == text
    assert report.mqar_tables(dict(rep, comparisons=[])) == report.mqar_table(rep["results"])


def test_regression_table_and_heading():
    data = regression.held_out(0, 16, 3, 2)
    cfg = dict(reg_k=[1, 2], reg_dx=2, d_model=8, n_layers=1, n_heads=2, reg_examples=4, reg_steps=2,
               reg_batch=8, reg_eval_batch=16)
    iv = dict(mean=0.5, low=0.25, high=0.75)
    rows = [dict(k=k, prompt_floats=10, prompted=iv, converted=0.5, identical=True, max_rel_diff=1e-13)
            for k in (1, 2)]
    reg = dict(config=cfg, results={"linear": dict(eval=rows)}, baselines=regression.baselines(data, [1, 2]))
    text = report.regression_table(reg)
    assert "| linear | 1 | 10 | 0.500 [0.250, 0.750] | 0.500 | yes (1e-13) |" in text
    assert "least squares error" in text and text.count("\n| 2 |") == 1
    heading = report.regression_heading(cfg)
    assert heading.startswith("In-context linear regression, d_x 2") and "16 held-out tasks" in heading
    assert report.headline(dict(regression=dict(reg, table=text))) == heading + "\n\n" + text


def test_figures_draw_every_mixer(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = report.mqar_figure(plt, _mqar_report())
    assert len(fig.axes) == 2 and len(fig.axes[1].lines) == 3                # one loss curve per mixer
    plt.close(fig)
    assert [name for _, name, _ in report.FIGURES] == ["recall_capacity.png", "recall_capacity_regression.png"]
