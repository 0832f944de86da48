"""linicl.training: the schedule, one compiled chunk = the same steps one by one, data drawn per step
(so re-chunking changes nothing), stages of the same data share a compilation, bad sizes named."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from linicl import training
from linicl.errors import LiniclError
from linicl.training import Stage


def quadratic_loss(stage):
    """(w - x)^2 with x ~ N(0, 1) drawn from the step's key; aux: x."""
    def fn(params, key):
        x = jax.random.normal(key, ())
        return jnp.sum((params["w"] - x) ** 2), x
    return fn


def test_schedule_warms_up_from_zero_and_clips():
    opt = training.warmup_cosine_adam(1e-2, 100)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    grads = {"w": jnp.array([30.0, 40.0, 0.0])}                  # global norm 50: clipped to 1
    first, state = opt.update(grads, state, params)
    assert float(jnp.abs(first["w"]).max()) == 0.0                 # the warm-up starts at lr 0
    second, _ = opt.update(grads, state, params)
    # warm-up over min(100, 100 // 10) = 10 steps: step 1 at lr 1e-3; Adam's first steps move by ~lr
    np.testing.assert_allclose(np.abs(np.asarray(second["w"]))[:2], 1e-3, rtol=1e-3)


@pytest.mark.parametrize("lr,steps,match", [(0.0, 10, "lr must be > 0"), (1e-3, -1, "total_steps")])
def test_schedule_names_bad_arguments(lr, steps, match):
    with pytest.raises(LiniclError, match=match):
        training.warmup_cosine_adam(lr, steps)


def test_a_chunk_is_its_steps_one_by_one():
    opt = optax.sgd(0.1)
    fn = quadratic_loss(None)
    key = jax.random.PRNGKey(3)
    params = {"w": jnp.array(1.0)}
    p, _, loss, aux = training.scan_chunk(fn, opt, 3)(params, opt.init(params), key, jnp.int32(5))
    assert loss.shape == (3,) and aux.shape == (3,)
    w = 1.0
    for s in range(5, 8):
        x = float(jax.random.normal(jax.random.fold_in(key, s), ()))
        w -= 0.1 * 2 * (w - x)
    np.testing.assert_allclose(float(p["w"]), w, rtol=1e-12)
    with pytest.raises(LiniclError, match="length"):
        training.scan_chunk(fn, opt, 0)


def test_rechunking_changes_nothing_and_same_data_shares_a_compilation():
    plan = [Stage("a", 5, 0, ((1,),)), Stage("b", 4, 0, ((1,),))]
    calls = []

    def loss_for(stage):
        calls.append(stage.name)
        return quadratic_loss(stage)

    params = {"w": jnp.array(0.5)}
    key = jax.random.PRNGKey(0)
    runs = {c: training.train_stages(params, plan, loss_for, optax.adam(0.05), key, chunk=c,
                                     record=lambda s, aux: {"n": int(aux.shape[0])}) for c in (1, 2, 9)}
    for c, (p, history) in runs.items():
        np.testing.assert_allclose(float(p["w"]), float(runs[1][0]["w"]), rtol=1e-12)
        assert [h["step"] for h in history][-1] == 9 and sum(h["n"] for h in history) == 9
        assert {h["stage"] for h in history} == {"a", "b"}
    # chunk 2: lengths 2 and 1 in stage a, 2 in b (shared with a's): two compilations; chunk 9: 5 and 4
    assert calls == ["a"] + ["a", "a"] + ["a", "b"]
    seen = []
    training.train_stages(params, plan, loss_for, optax.adam(0.05), key, chunk=4,
                          on_chunk=lambda stage, length, entry: seen.append((stage.name, length, entry["step"])))
    assert seen == [("a", 4, 4), ("a", 1, 5), ("b", 4, 9)]
    with pytest.raises(LiniclError, match="chunk"):
        training.train_stages(params, plan, loss_for, optax.adam(0.05), key, chunk=0)


def test_steps_to_threshold_is_the_first_step_strictly_above():
    assert training.steps_to_threshold([0, 5, 10], [0.1, 0.6, 0.95], 0.5) == 5
    assert training.steps_to_threshold([0, 5, 10], [0.1, 0.5, 0.95], 0.5) == 10  # strictly above
    assert training.steps_to_threshold([0, 5, 10], np.array([0.1, 0.6, 0.95]), 0.99) is None
    with pytest.raises(LiniclError, match="aligned"):
        training.steps_to_threshold([0, 5], [0.1], 0.5)


def test_warmup_constant_adamw_decays_matrices_only_after_a_linear_warmup():
    """One step from zero gradients moves only the decayed leaves (by lr_t * wd * w, lr_t = lr / warmup
    after the first step's warm-up), and the rate is constant once warmed up."""
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "embed": jnp.ones(3), "S_bias": jnp.ones(2)}
    assert training.decay_mask(params) == {"dense": {"kernel": True, "bias": False}, "embed": True, "S_bias": False}
    opt = training.warmup_constant_adamw(0.1, 4, 0.5)
    state = opt.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    moved = []
    for _ in range(6):
        updates, state = opt.update(zeros, state, params)
        moved.append(float(-updates["embed"][0]))
        assert not np.any(np.asarray(updates["dense"]["bias"])) and not np.any(np.asarray(updates["S_bias"]))
    np.testing.assert_allclose(moved, 0.5 * np.array([0.0, 0.025, 0.05, 0.075, 0.1, 0.1]), rtol=1e-6)
    with pytest.raises(LiniclError, match="warmup"):
        training.warmup_constant_adamw(0.1, -1, 0.0)
    with pytest.raises(LiniclError, match="lr"):
        training.warmup_constant_adamw(0.0, 1, 0.0)
