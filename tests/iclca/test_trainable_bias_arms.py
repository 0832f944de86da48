"""linicl.bias_training (ICLCA Figure 1): the arms start from the same shared parameters and differ only
in the bias terms, only the bias arm gets gradients for them, the denominators it records are the
model's, the warm arm starts from its converted demonstration, a checkpointed run resumes with the same
numbers, and the summary reads its curves as documented."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from linicl import bias_training as bt
from linicl import checkpoint, iclca
from linicl.data.synthetic import facts_table
from linicl.diagnostics import normaliser_summary, normalisers_from
from linicl.interventions import capture
from linicl.kernels import feature_maps
from linicl.nn import Transformer


def _seed0(tree):
    return jax.tree.map(lambda x: x[0], tree)


def test_options_defaults_and_unknown_names():
    opts = bt.options(quick=True)
    assert opts["task"] == "induction" and opts["loss_on"] == "all" and opts["arms"] == list(bt.ARMS)
    assert bt.options(quick=True, task="recall")["loss_on"] == "context"
    assert bt.options(steps=10)["steps"] == 10 and not bt.options()["quick"]
    with pytest.raises(ValueError, match="n_layer"):
        bt.options(n_layer=3)
    with pytest.raises(ValueError, match="multiple of eval_every"):
        bt.run(bt.options(quick=True, steps=7, eval_every=5), progress=False)


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

    batch = bt.sampler(opts, opts["batch_size"])(jax.random.PRNGKey(1))
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


def test_the_recorded_denominators_are_the_models():
    """Rebuild every head's output from the captured q, k, v, the bias terms and the denominators; it
    must equal the model's own (hook_z), with decay and learned positions. The summary's minima follow
    them, and show a negative z_bias driving a denominator below zero."""
    opts = bt.options(quick=True)
    cfg = bt.model_config(opts, True).replace(dtype="float64", decay=(0.5, 0.9))
    model = Transformer(cfg)
    tokens = bt.sampler(opts, opts["batch_size"])(jax.random.PRNGKey(2)).inputs
    params = jax.jit(model.init)(jax.random.PRNGKey(3), tokens)["params"]
    flat = traverse_util.flatten_dict(params)
    for i, k in enumerate(sorted(k for k in flat if k[-1] in ("S_bias", "z_bias"))):
        flat[k] = jax.random.uniform(jax.random.PRNGKey(10 + i), flat[k].shape, jnp.float64, 0.0, 2.0)
    params = traverse_util.unflatten_dict(flat)
    names = [f"blocks.{l}.attn.hook_{s}" for l in range(cfg.n_layers) for s in "qkvz"]
    run = jax.jit(lambda p: capture(model, {"params": p}, tokens, names=names)[1])
    acts = run(params)
    phi = feature_maps.get(cfg.feature_map)
    T = tokens.shape[1]
    t = np.arange(T)
    g = np.asarray(cfg.decay_per_head())[:, None, None]
    D = np.where(t[:, None] >= t[None, :], g ** np.maximum(t[:, None] - t[None, :], 0), 0.0)
    dens = []
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
        dens.append(np.asarray(den))
    summarise = jax.jit(normaliser_summary, static_argnums=0)
    summary = summarise(cfg, params, acts)
    assert float(summary["den_min"]) == pytest.approx(min(d.min() for d in dens), rel=1e-12)
    assert float(summary["den_first_min"]) == pytest.approx(min(d[:, :, 0].min() for d in dens), rel=1e-12)
    assert float(summary["den_min"]) > 0 and float(summary["z_bias_min"]) == 0.0  # min(0, entries >= 0)
    # A negative z_bias can make a denominator negative, and the summary shows it.
    neg = jax.tree.map(lambda x: x, params)
    neg["layers_1"]["attn"]["z_bias"] = -100.0 * jnp.ones_like(params["layers_1"]["attn"]["z_bias"])
    summary = summarise(cfg, neg, run(neg))
    assert float(summary["den_min"]) < 0 and float(summary["z_bias_min"]) == -100.0
    clipped = iclca.nonnegative_z_bias(neg)
    assert float(clipped["layers_1"]["attn"]["z_bias"].min()) == 0.0
    np.testing.assert_array_equal(clipped["layers_0"]["attn"]["S_bias"], neg["layers_0"]["attn"]["S_bias"])
    # No bias: the bias parts are zero.
    base = Transformer(cfg.replace(trainable_bias=False))
    base_params = iclca.without_bias(params)
    _, base_acts = capture(base, {"params": base_params}, tokens, names=names)
    summary = normaliser_summary(base.cfg, base_params, base_acts)
    assert float(summary["bias_term_min"]) == 0.0 and float(summary["z_bias_min"]) == 0.0


def test_token_metrics_on_a_known_batch():
    """Two positions, one in context: the losses and accuracies by hand."""
    from linicl.data.synthetic import TokenBatch
    logits = jnp.log(jnp.asarray([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]]))
    batch = TokenBatch(jnp.zeros((1, 2), jnp.int32), jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[False, True]]))
    loss, m = bt.token_metrics(logits, batch, "all")
    nll = -np.log([0.7, 0.3])
    assert float(loss) == pytest.approx(nll.mean()) and float(m["ctx_loss"]) == pytest.approx(nll[1])
    assert float(m["acc"]) == 0.5 and float(m["ctx_acc"]) == 0.0
    assert float(bt.token_metrics(logits, batch, "context")[0]) == pytest.approx(nll[1])


def test_training_resumes_from_its_checkpoint_with_the_same_numbers(tmp_path, monkeypatch):
    """Interrupted after its first chunk, a run started again resumes and ends with exactly the
    numbers of an uninterrupted run (linicl.checkpoint; the settings must match)."""
    opts = bt.options(quick=True, seeds=[0, 1], steps=4, eval_every=2)
    whole = bt.run(opts, progress=False)
    path = tmp_path / "ckpt.safetensors"
    real = checkpoint.save

    def save_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # the process dies right after the first checkpoint
    monkeypatch.setattr(checkpoint, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        bt.run(opts, progress=False, checkpoint_path=path)
    monkeypatch.setattr(checkpoint, "save", real)
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
    opts = bt.options(quick=True, seeds=[0, 1], task=task, positions="none")
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    bias_p, _ = bt.shared_init(opts, keys)
    warm = bt.warm_bias(opts, bias_p, keys)
    model = Transformer(bt.model_config(opts, True))
    query = bt.sampler(opts, opts["batch_size"])(jax.random.PRNGKey(3)).inputs
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
                                      facts_table(opts["n_facts"], opts["vocab"]))


def test_summarise_reads_its_curves():
    """Two seeds, two chunks of two steps: thresholds, spreads and the denominator checks by hand."""
    opts = dict(seeds=[3, 4], eval_every=2)
    ctx_acc = [np.array([0.0, 0.0]), np.array([0.6, 0.2]), np.array([0.95, 0.7])]
    ev = dict(ctx_acc=ctx_acc, loss=[np.ones(2)] * 3, ctx_loss=[np.ones(2)] * 3, acc=[np.ones(2)] * 3,
              den_min=[np.ones(2)] * 3, den_first_min=[np.ones(2)] * 3, bias_term_min=[np.zeros(2)] * 3)
    train = dict(loss=[np.ones((2, 2)), np.full((2, 2), 0.5)], den_min=[np.array([[1.0, 1.0], [1.0, -1.0]])] * 2,
                 den_first_min=[np.ones((2, 2))] * 2, bias_term_min=[np.zeros((2, 2))] * 2,
                 z_bias_min=[np.zeros((2, 2))] * 2)
    curves = {"baseline": dict(train=train, eval=ev, eval_steps=[0, 2, 4])}
    r = bt.summarise(opts, curves, {"baseline": {}}, {"baseline": None})["arms"]["baseline"]
    assert r["steps_to_ctx_acc"]["0.5"]["per_seed"] == [2, 4] and r["steps_to_ctx_acc"]["0.9"]["per_seed"] == [4, None]
    assert r["steps_to_ctx_acc"]["0.5"]["of_mean_curve"] == 4 and r["steps_to_ctx_acc"]["0.9"]["n_reached"] == 1
    assert r["final"]["ctx_acc"] == pytest.approx(dict(mean=0.825, std=np.std([0.95, 0.7], ddof=1), min=0.7, max=0.95))
    assert r["final"]["train_loss_last_eval_window"]["mean"] == 0.5
    den = r["denominators"]
    assert den["min_train"] == -1.0 and not den["stayed_positive"]
    assert den["first_nonpositive_step"] == {"3": None, "4": 2}
    assert r["train"]["loss"]["3"] == [1.0, 1.0, 0.5, 0.5] and r["eval_steps"] == [0, 2, 4] and r["finite"]


def test_without_bias_and_zero_z_bias_touch_the_bias_terms_only():
    params = {"layers_0": {"attn": {"S_bias": jnp.ones((1, 2, 2)), "z_bias": -jnp.ones((1, 2)),
                                    "W_q": jnp.full((2, 2), 3.0)}}, "embed": jnp.ones(4)}
    stripped = iclca.without_bias(params)
    assert stripped == {"layers_0": {"attn": {"W_q": params["layers_0"]["attn"]["W_q"]}}, "embed": params["embed"]}
    assert stripped["embed"] is params["embed"]
    zeroed = iclca.zero_z_bias(params)
    assert not np.any(np.asarray(zeroed["layers_0"]["attn"]["z_bias"]))
    assert zeroed["layers_0"]["attn"]["S_bias"] is params["layers_0"]["attn"]["S_bias"]
    with pytest.raises(ValueError, match="params"):
        iclca.without_bias([1, 2])
