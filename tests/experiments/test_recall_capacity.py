"""experiments/recall_capacity.py: the quick mode runs both tasks and writes its JSON and plots, every
finite-state mixer's converted accuracy (MQAR) and error (regression) are its prompted ones (same
predictions), the regression baselines are what they must be (least squares exact past d_x pairs, the
zero predictor at 1), a second run reuses the checkpoints of both tasks, and the pieces (curriculum,
vocabulary widening, gate initialisation, matched state sizes, fingerprints, option checks) do what
the docstring says."""

import importlib.util
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from linicl import iclca
from linicl.data.synthetic import mqar_batch
from linicl.errors import LiniclError
from helpers import REPO, json_numbers, run_script

SCRIPT = REPO / "experiments" / "recall_capacity.py"

_spec = importlib.util.spec_from_file_location("recall_capacity", SCRIPT)
rc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rc)


def run(*args) -> str:
    return run_script(SCRIPT, *args)


def test_help():
    out = run("--help")
    for flag in ("--quick", "--seed", "--steps", "--mixers", "--pairs", "--out", "--tasks", "--reg-steps", "--reg-dx",
                 "--reg-examples", "--reg-batch", "--reg-k", "--reg-eval-batch"):
        assert flag in out


def test_quick_run_converted_equals_prompted_and_resume_reuses_checkpoints(tmp_path):
    printed = run("--quick", "--no-progress", "--out", str(tmp_path))
    report = json.loads((tmp_path / "recall_capacity.json").read_text())
    assert (tmp_path / "recall_capacity.png").stat().st_size > 0
    assert printed.index("| mixer |") < printed.index("wrote ")          # the table comes first
    assert all(math.isfinite(x) for x in json_numbers(report))
    results = report["results"]
    assert list(results) == list(rc.MIXERS)
    pairs = report["config"]["pairs"]
    for mixer, r in results.items():
        assert not r["reused_checkpoint"]
        assert [e["pairs"] for e in r["eval"]] == pairs
        for e in r["eval"]:
            assert e["queries"] == report["config"]["eval_batch"] * report["config"]["eval_queries"]
            assert e["prompted"]["low"] <= e["prompted"]["acc"] <= e["prompted"]["high"]
            if mixer == "softmax":                                       # a KV cache grows with the prompt
                assert "converted" not in e and e["prompt_floats"] == 2 * 2 * 2 * 8 * (2 * e["pairs"])
                continue
            assert e["identical"] and e["correct_converted"] == e["correct"]
            assert e["converted"] == e["prompted"]
            assert e["max_rel_logit_diff"] <= 1e-10                     # float64 evaluation
        assert (tmp_path / "checkpoints" / f"{mixer}.ckpt").is_file()
    assert {c["delta"] for c in report["comparisons"]} == {"delta", "gated_delta"}
    assert "same predictions" in report["table"]
    check_regression(report["regression"], tmp_path)
    assert (tmp_path / "recall_capacity_regression.png").stat().st_size > 0
    assert printed.index("| mixer |") < printed.index("In-context linear regression") < printed.index("wrote ")
    assert "In-context linear regression" in report["table"]                # RESULTS.md's headline has both

    # A second run (a subset of the mixers) loads the checkpoints of both tasks and reproduces the numbers.
    files = [f"{prefix}{m}.ckpt" for prefix in ("", "regression_") for m in ("linear", "gated_delta")]
    stamps = {f: (tmp_path / "checkpoints" / f).stat().st_mtime_ns for f in files}
    run("--quick", "--no-progress", "--out", str(tmp_path), "--mixers", "linear", "gated_delta")
    report2 = json.loads((tmp_path / "recall_capacity.json").read_text())
    again, reg_again = report2["results"], report2["regression"]["results"]
    assert list(again) == list(reg_again) == ["linear", "gated_delta"]
    assert {f: (tmp_path / "checkpoints" / f).stat().st_mtime_ns for f in files} == stamps
    for mixer, r in again.items():
        assert r["reused_checkpoint"] and reg_again[mixer]["reused_checkpoint"]
        assert [e["correct"] for e in r["eval"]] == [e["correct"] for e in results[mixer]["eval"]]
        assert reg_again[mixer]["eval"] == report["regression"]["results"][mixer]["eval"]

    # The regression alone: no MQAR part, no MQAR plot written.
    (tmp_path / "recall_capacity.png").unlink()
    printed = run("--quick", "--no-progress", "--out", str(tmp_path), "--mixers", "delta", "--tasks", "regression")
    alone = json.loads((tmp_path / "recall_capacity.json").read_text())
    assert "results" not in alone and list(alone["regression"]["results"]) == ["delta"]
    assert alone["regression"]["results"]["delta"]["reused_checkpoint"] and "MQAR" not in printed
    assert not (tmp_path / "recall_capacity.png").exists()


def check_regression(reg: dict, out) -> None:
    """The regression part of a quick run: every mixer and k, converted = prompted for every finite-state
    mixer, the baselines on the same tasks."""
    ks, d_x = reg["config"]["reg_k"], reg["config"]["reg_dx"]
    assert list(reg["results"]) == list(rc.MIXERS)
    for mixer, r in reg["results"].items():
        assert not r["reused_checkpoint"] and r["history"]
        assert [e["k"] for e in r["eval"]] == ks
        for e in r["eval"]:
            assert e["prompted"]["low"] <= e["prompted"]["mean"] <= e["prompted"]["high"]
            if mixer == "softmax":                                       # a KV cache grows with the prompt
                assert "converted" not in e and e["prompt_floats"] == 2 * 2 * 2 * 8 * (2 * e["k"])
                continue
            assert e["identical"] and e["max_rel_diff"] <= 1e-10        # float64 evaluation
            assert e["converted"] == pytest.approx(e["prompted"]["mean"], rel=1e-9)
        assert (out / "checkpoints" / f"regression_{mixer}.ckpt").is_file()
    base = reg["baselines"]
    assert list(base) == list(rc.BASELINES) and any(k >= d_x + 1 for k in ks)
    tasks = rc.regression_tasks(rc.options(quick=True))
    for i, k in enumerate(ks):
        assert [rows[i]["k"] for rows in base.values()] == [k] * 3
        if k >= d_x + 1:                                                 # noise-free: w is determined
            assert base["least squares"][i]["error"]["mean"] <= 1e-6
        zero = base["zero"][i]["error"]["mean"]
        assert zero == pytest.approx(np.mean(tasks.ys[:, k] ** 2) / d_x, rel=1e-12)
        # E[y^2] / d_x = 1; the per-task error y^2 / d_x has sd sqrt(5) at d_x = 2: 4 standard errors
        assert abs(zero - 1) <= 4 * np.sqrt(5 / len(tasks.ys))


def test_regression_settings_and_fingerprints():
    opts = rc.options(quick=True)
    mqar, reg = rc.settings(opts, "gated_delta"), rc.settings(opts, "gated_delta", "regression")
    assert "task" not in mqar and reg["task"] == "regression" and reg["fingerprint"] != mqar["fingerprint"]
    assert reg["model"]["vocab_size"] == 1 and reg["model"]["max_len"] == 2 * opts["reg_examples"]
    assert reg["stages"] == [dict(name="regression", steps=2, sub_vocab=0, sizes=[[4, 2, 8]])]
    # evaluation options never retrain; training options do, and the regression's never touch MQAR's
    assert rc.settings(rc.options(quick=True, reg_k=[1, 64], reg_eval_batch=3), "gated_delta", "regression") == reg
    changed = rc.options(quick=True, reg_dx=3, reg_steps=5)
    assert rc.settings(changed, "gated_delta", "regression") != reg and rc.settings(changed, "gated_delta") == mqar
    params = rc.regression_init(opts, "gated", jax.random.PRNGKey(0))
    assert params["read_in"]["kernel"].shape == (3, 16) and params["read_out"]["kernel"].shape == (16, 1)
    assert params["read_in"]["kernel"].dtype == np.float32
    bias = np.asarray(params["model"]["layers_0"]["attn"]["gate_proj"]["bias"], np.float64)
    np.testing.assert_allclose(1 / (1 + np.exp(-bias)), rc.decays(2), rtol=1e-5)  # the gates as for MQAR


def test_curriculum_stages():
    opts = rc.options(vocab=128)
    plan = rc.stages(opts)
    assert [s.name for s in plan] == ["circuit", "vocab 32", "vocab 64", "vocab 128", "pairs"]
    assert [s.sub_vocab for s in plan] == [16, 32, 64, 128, 128]
    assert all(s.sizes == ((2, 1, opts["circuit_batch"]),) for s in plan[:-1])
    q = opts["queries"]                                                   # n / 2 queries, q / (n / 2) rows
    assert plan[-1].sizes == ((2, 1, q), (4, 2, q // 2), (8, 4, q // 4), (16, 8, q // 8), (32, 16, q // 16))
    assert plan[-1].steps == opts["steps"]
    # a vocabulary of 16 needs no doubling stage; zero steps drop a stage
    assert [s.name for s in rc.stages(rc.options(quick=True))] == ["circuit", "pairs"]
    assert [s.name for s in rc.stages(rc.options(vocab_steps=0))] == ["circuit", "pairs"]


def test_widen_keeps_the_task():
    b = mqar_batch(jax.random.PRNGKey(0), 16, 2, 1, 16)
    w = rc.widen(b, 16, 64)
    x, y = np.asarray(b.inputs), np.asarray(w.inputs)
    np.testing.assert_array_equal(y[x < 8], x[x < 8])                    # keys stay
    np.testing.assert_array_equal(y[x >= 8], x[x >= 8] + 24)             # values move to [32, 40)
    mask = np.asarray(b.mask)
    np.testing.assert_array_equal(np.asarray(w.targets)[mask], np.asarray(b.targets)[mask] + 24)  # answers too
    np.testing.assert_array_equal(np.asarray(rc.widen(b, 64, 64).inputs), x)


def test_matched_state_sizes_and_gate_initialisation():
    opts = rc.options(quick=True, n_heads=4, d_model=32)
    cfgs = {m: rc.model_config(opts, m) for m in rc.MIXERS}
    L, H, d = 2, 4, 8
    for m, cfg in cfgs.items():
        if m == "softmax":
            continue
        assert cfg.feature_dim == d
        expected = L * H * d * d + (0 if cfg.update == "delta" else L * H * d)   # the delta rule has no z
        assert iclca.state_floats(cfg) == expected
    assert cfgs["decayed"].decay == pytest.approx(rc.decays(4)) and rc.decays(4)[0] < 0.3 < 0.98 < rc.decays(4)[-1]
    for m in ("gated", "gated_vector", "gated_delta"):
        params = rc.init_params(opts, m, jax.random.PRNGKey(0))
        for layer in range(L):
            bias = np.asarray(params[f"layers_{layer}"]["attn"]["gate_proj"]["bias"], np.float64)
            alpha = 1 / (1 + np.exp(-bias))                               # alpha at x W = 0
            np.testing.assert_allclose(alpha.reshape(H, -1), np.broadcast_to(np.array(rc.decays(4))[:, None],
                                                                             alpha.reshape(H, -1).shape), rtol=1e-5)


@pytest.mark.parametrize("changes,match", [
    (dict(pairs=[4, 40]), "--pairs 40 distinct keys"),
    (dict(train_pairs=[64]), "--train-pairs 64"),
    (dict(eval_queries=8, pairs=[4, 8]), "--eval-queries 8"),
    (dict(vocab=15), "--vocab must be even"),
    (dict(mixers=["mamba"]), "unknown mixer 'mamba'"),
    (dict(tasks=["mqar", "ridge"]), "--tasks: unknown task 'ridge'"),
    (dict(d_model=30), "divisible by n_heads"),
])
def test_bad_options_name_the_option(changes, match):
    with pytest.raises(LiniclError, match=match):
        rc.check_options(rc.options(**changes))


def test_bad_option_is_a_usage_error():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--pairs", "4,40"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 2 and "--pairs 40" in proc.stderr


def test_short_convolution_option_reaches_every_linear_mixer_and_the_fingerprint():
    plain = rc.options(quick=True)
    conv = rc.options(quick=True, short_conv=4)
    for mixer in rc.MIXERS:
        cfg = rc.model_config(conv, mixer)
        want = 0 if cfg.attention == "softmax" else 4  # softmax keeps no convolution (not a finite state)
        assert cfg.short_conv == want and rc.model_config(plain, mixer).short_conv == 0
        if want:
            assert cfg.short_conv_activation == "silu"
            assert rc.settings(conv, mixer)["fingerprint"] != rc.settings(plain, mixer)["fingerprint"]
    with pytest.raises(Exception, match="short_conv"):
        rc.check_options(rc.options(quick=True, short_conv=1))
