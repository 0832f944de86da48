"""experiments/bias_training.py (ICLCA Figure 1): the arms start from the same shared parameters and
differ only in the bias terms, only the bias arm gets gradients for them, the denominators the script
reports are the model's, and the quick mode writes finite numbers and a plot."""

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from linicl.diagnostics import normalisers_from
from linicl.iclca import nonnegative_z_bias
from linicl.kernels import feature_maps
from linicl.nn import Transformer
from helpers import REPO

ROOT = REPO
SCRIPT = ROOT / "experiments" / "bias_training.py"

_spec = importlib.util.spec_from_file_location("bias_training", SCRIPT)
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)


def _seed0(tree):
    return jax.tree.map(lambda x: x[0], tree)


def test_arms_share_init_and_only_the_bias_arm_has_bias_gradients():
    opts = bt.options(quick=True, seeds=[0])
    bias_p, base_p = bt.shared_init(opts, jax.random.PRNGKey(7)[None])
    flat_bias, flat_base = traverse_util.flatten_dict(bias_p), traverse_util.flatten_dict(base_p)
    bias_keys = {k for k in flat_bias if k[-1] in ("S_bias", "z_bias")}
    assert len(bias_keys) == 2 * opts["n_layers"]
    assert set(flat_base) == set(flat_bias) - bias_keys
    for k, v in flat_base.items():  # every shared parameter identical
        np.testing.assert_array_equal(v, flat_bias[k])
    for k in bias_keys:  # zero-initialised bias
        assert not np.any(np.asarray(flat_bias[k]))

    batch = bt.make_sampler(opts)(jax.random.PRNGKey(1))
    grads, losses = {}, {}
    for arm, params in (("bias", bias_p), ("baseline", base_p)):
        f = bt.make_fns(opts, arm == "bias")
        g, metrics = jax.jit(jax.grad(f.loss_fn, has_aux=True))(_seed0(params), batch)
        grads[arm], losses[arm] = traverse_util.flatten_dict(g), float(metrics["loss"])
    # Zero bias: the same function, so the same loss and the same gradients of the shared params.
    assert losses["bias"] == pytest.approx(losses["baseline"], rel=1e-6)
    for k, g in grads["baseline"].items():
        np.testing.assert_allclose(g, grads["bias"][k], rtol=1e-4, atol=1e-7)
    for k in bias_keys:
        assert float(jnp.abs(grads["bias"][k]).max()) > 1e-6, k
    assert not any(k[-1] in ("S_bias", "z_bias") for k in grads["baseline"])


def test_denominators_are_the_models():
    """Rebuild every head's output from the captured q, k, v, the bias terms and the script's
    denominators; it must equal the model's own (hook_z), with decay and learned positions."""
    opts = bt.options(quick=True)
    cfg = bt.model_config(opts, True).replace(dtype="float64", decay=(0.5, 0.9))
    model = Transformer(cfg)
    tokens = bt.make_sampler(opts)(jax.random.PRNGKey(2)).inputs
    params = jax.jit(model.init)(jax.random.PRNGKey(3), tokens)["params"]
    flat = traverse_util.flatten_dict(params)
    for i, k in enumerate(sorted(k for k in flat if k[-1] in ("S_bias", "z_bias"))):
        flat[k] = jax.random.uniform(jax.random.PRNGKey(10 + i), flat[k].shape, jnp.float64, 0.0, 2.0)
    params = traverse_util.unflatten_dict(flat)
    names = [f"blocks.{l}.attn.hook_{s}" for l in range(cfg.n_layers) for s in "qkvz"]
    run = jax.jit(lambda p: bt.capture(model, {"params": p}, tokens, names=names)[1])
    acts = run(params)
    phi = feature_maps.get(cfg.feature_map)
    T = tokens.shape[1]
    t = np.arange(T)
    g = np.asarray(cfg.decay_per_head())[:, None, None]
    D = np.where(t[:, None] >= t[None, :], g ** np.maximum(t[:, None] - t[None, :], 0), 0.0)
    for layer in range(cfg.n_layers):
        q, k, v = (np.swapaxes(np.asarray(acts[f"blocks.{layer}.attn.hook_{s}"]), 1, 2) for s in "qkv")
        fq, fk = np.asarray(phi(q)), np.asarray(phi(k))
        attn = params[f"layers_{layer}"]["attn"]
        num = (np.einsum("bhtf,bhsf,hts,bhsd->bhtd", fq, fk, D, v)
               + np.einsum("bhtf,hfd->bhtd", fq, attn["S_bias"]) * (g[:, :, 0] ** (t + 1))[None, :, :, None])
        normaliser = normalisers_from(cfg, {"params": params}, acts)[layer]
        den, bias_term = normaliser.value, normaliser.bias
        assert float(jnp.min(bias_term)) > 0
        o = num / (np.asarray(den) + cfg.attn_eps)[..., None]
        z = np.swapaxes(np.asarray(acts[f"blocks.{layer}.attn.hook_z"]), 1, 2)
        np.testing.assert_allclose(o, z, rtol=1e-10, atol=1e-12)
    denominators = jax.jit(bt.denominators, static_argnums=0)
    summary = denominators(cfg, params, acts)
    assert float(summary["den_min"]) > 0 and float(summary["z_bias_min"]) >= 0
    # A negative z_bias can make a denominator negative, and the summary shows it.
    neg = jax.tree.map(lambda x: x, params)
    neg["layers_1"]["attn"]["z_bias"] = -100.0 * jnp.ones_like(params["layers_1"]["attn"]["z_bias"])
    summary = denominators(cfg, neg, run(neg))
    assert float(summary["den_min"]) < 0 and float(summary["z_bias_min"]) == -100.0
    clipped = nonnegative_z_bias(neg)
    assert float(clipped["layers_1"]["attn"]["z_bias"].min()) == 0.0
    np.testing.assert_array_equal(clipped["layers_0"]["attn"]["S_bias"], neg["layers_0"]["attn"]["S_bias"])


def test_steps_to_threshold_and_argument_errors(capsys):
    assert bt.steps_to([0, 5, 10], [0.1, 0.6, 0.95], 0.5) == 5
    assert bt.steps_to([0, 5, 10], [0.1, 0.6, 0.95], 0.99) is None
    with pytest.raises(SystemExit) as e:
        bt.main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
    for argv, match in ((["--steps", "7", "--eval-every", "5"], "multiple"),
                        (["--seeds", "1", "1"], "different"),
                        (["--seq-len", "9"], "even")):
        with pytest.raises(SystemExit) as e:
            bt.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_quick_run_writes_finite_json_and_plot(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "bias_training.json").read_text())
    cfg = report["config"]
    assert cfg["quick"] and cfg["seeds"] == [0, 1, 2]
    assert set(report["arms"]) == {"baseline", "bias", "bias_nonneg", "bias_B_only", "bias_warm"}
    for arm, r in report["arms"].items():
        assert r["finite"], arm
        assert r["eval_steps"] == list(range(0, cfg["steps"] + 1, cfg["eval_every"]))
        for seed in ("0", "1", "2"):
            assert len(r["train"]["loss"][seed]) == cfg["steps"]
            assert len(r["eval"]["ctx_acc"][seed]) == len(r["eval_steps"])
            assert all(np.isfinite(r["train"]["loss"][seed]))
        assert set(r["steps_to_ctx_acc"]) == {"0.5", "0.9"}
        assert np.isfinite(r["final"]["ctx_acc"]["mean"]) and 0 <= r["final"]["ctx_acc"]["mean"] <= 1
        assert r["denominators"]["min_train"] > 0 and r["timing"]["train_s"] > 0
    # the same init and held-out batch, and a zero bias: at step 0 every arm but the warm one has the same loss
    first = {arm: r["eval"]["loss"]["0"][0] for arm, r in report["arms"].items()}
    cold = [v for arm, v in first.items() if arm not in bt.WARM]
    assert cold == pytest.approx([cold[0]] * len(cold), rel=1e-5)
    assert first["bias_warm"] != pytest.approx(cold[0], rel=1e-5)
    assert report["arms"]["bias_nonneg"]["denominators"]["min_z_bias_entry"] >= 0
    assert (tmp_path / "bias_training.png").stat().st_size > 0
    assert report["wall_s"] > 0


def test_training_resumes_from_its_checkpoint_with_the_same_numbers(tmp_path, monkeypatch):
    """Interrupted after its first chunk, a run started again resumes and ends with exactly the
    numbers of an uninterrupted run (linicl.checkpoint; the settings must match)."""
    opts = bt.options(quick=True, seeds=[0, 1], steps=4, eval_every=2)
    whole = bt.run(opts, progress=False)
    path = tmp_path / "ckpt.safetensors"
    real = bt.checkpoint.save

    def save_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # the process dies right after the first checkpoint
    monkeypatch.setattr(bt.checkpoint, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        bt.run(opts, progress=False, checkpoint_path=path)
    monkeypatch.setattr(bt.checkpoint, "save", real)
    resumed = bt.run(opts, progress=False, checkpoint_path=path)
    for arm in whole["arms"]:
        assert resumed["arms"][arm]["final"] == whole["arms"][arm]["final"], arm
        assert resumed["arms"][arm]["eval"] == whole["arms"][arm]["eval"], arm
    other = bt.options(quick=True, seeds=[0, 1], steps=6, eval_every=2)
    with pytest.raises(Exception, match="other settings"):
        bt.run(other, progress=False, checkpoint_path=path)


@pytest.mark.parametrize("task", ["facts", "induction"])
def test_the_warm_bias_is_the_converted_demonstration(task):
    """bias_warm starts as the model holding its converted demonstration (no positions: nothing is
    dropped), not as the zero bias."""
    from linicl import iclca
    opts = bt.options(quick=True, seeds=[0, 1], task=task, positions="none")
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    bias_p, _ = bt.shared_init(opts, keys)
    warm = bt.warm_bias(opts, bias_p, keys)
    model = bt.Transformer(bt.model_config(opts, True))
    query = bt.make_sampler(opts)(jax.random.PRNGKey(3)).inputs
    for r in range(2):
        demo = bt.demonstration(opts, keys[r])
        converted = iclca.convert(model, {"params": _seed0(jax.tree.map(lambda a: a[r:], bias_p))}, demo)
        want = model.apply(converted, query)
        got = model.apply({"params": jax.tree.map(lambda a: a[r], warm)}, query)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        cold = model.apply({"params": jax.tree.map(lambda a: a[r], bias_p)}, query)
        assert float(jnp.abs(cold - want).max()) > 1e-2  # power: the demonstration changes the outputs
    if task == "facts":
        np.testing.assert_array_equal(bt.demonstration(opts, keys[0])[0, 1::2],
                                      bt.facts_table(opts["n_facts"], opts["vocab"]))
