"""linicl.metrics (log_normalize, kl_rows, layer_rel_errors), linicl.fidelity (predict, method_scores,
copy_test) and linicl.recovery: hand-computed values, padding ignored, bad shapes named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import fidelity, metrics, recovery
from linicl.errors import LiniclError


def test_kl_rows_renormalises_and_is_zero_on_itself():
    rng = np.random.default_rng(0)
    lp = metrics.log_normalize(rng.normal(size=(3, 5)))
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0)
    np.testing.assert_allclose(metrics.kl_rows(lp, lp + 7.0), 0.0, atol=1e-12)   # a shift changes nothing
    p, q = np.log([[0.5, 0.5]]), np.log([[0.9, 0.1]])
    np.testing.assert_allclose(metrics.kl_rows(p, q), 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1))
    with pytest.raises(LiniclError, match="lp_p and lp_q"):
        metrics.kl_rows(np.zeros((2, 3)), np.zeros((2, 4)))


def test_layer_rel_errors_ignore_padding():
    z_ref = np.ones((2, 2, 3, 4))                                  # [layers, rows, width, features]
    z = z_ref.copy()
    z[1, 0, 0] = 2.0                                               # layer 1, row 0, first token: error 1
    z[:, 1, 2] = np.nan                                            # row 1's padding (length 2)
    every, last = metrics.layer_rel_errors(z, z_ref, np.array([3, 2]))
    assert every == [0.0, pytest.approx(np.sqrt(1 / 3) / 2)] and last == [0.0, 0.0]
    with pytest.raises(LiniclError, match="lengths"):
        metrics.layer_rel_errors(z, z_ref, np.array([4, 2]))
    with pytest.raises(LiniclError, match="z and z_ref"):
        metrics.layer_rel_errors(z[0], z_ref[0], np.array([3, 2]))


def test_predict_restricts_to_the_labels():
    lp = np.log([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    np.testing.assert_array_equal(fidelity.predict(lp), [1, 0])
    np.testing.assert_array_equal(fidelity.predict(lp, [0, 2]), [2, 0])
    with pytest.raises(LiniclError, match="lp must be"):
        fidelity.predict(lp[0])


def test_method_scores_against_a_reference():
    lp = np.log([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    z = np.ones((1, 2, 2, 3))
    ref = dict(lp=lp, z=z, pred=fidelity.predict(lp))
    alone = fidelity.method_scores(lp, z, None, [1, 2], None, None, np.array([2, 1]))
    assert alone["accuracy"] == 0.5 and alone["correct"] == [1, 0] and alone["predictions"] == [1, 0]
    assert alone["distinct"] == 2 and not alone["constant"] and "kl_full" not in alone
    same = fidelity.method_scores(lp, z, ref, [1, 2], None, [0, 2], np.array([2, 1]))
    assert same["agree_with_prompt"] == 1.0 and same["kl_full_mean"] == pytest.approx(0, abs=1e-12)
    assert same["kl_label_mean"] == pytest.approx(0, abs=1e-12) and same["layer_rel_err"] == [0.0]
    assert fidelity.method_scores(lp, z, ref, [1, 2], None, None, np.array([2, 1]))["kl_label_mean"] is None
    with pytest.raises(LiniclError, match="gold_ids"):
        fidelity.method_scores(lp, z, None, [1], None, None, np.array([2, 1]))


def _correct(variant_like: str, n: int = 40) -> dict:
    """zero all wrong, prompt all right, the variant as one of them."""
    zero, prompt = np.zeros(n), np.ones(n)
    return {"zero": zero, "prompt": prompt, "v": prompt if variant_like == "prompt" else zero}


def test_recovery_fraction_target_and_ties():
    cell = recovery.compare(_correct("prompt"), ["v", "missing"])
    assert cell["significant"] and cell["gain"]["value"] == 1.0 and cell["fraction"]["v"]["value"] == 1.0
    assert cell["fraction"]["missing"] is None and not cell["collapsed"]["v"]
    rec = recovery.recovery({"a": {"1": _correct("prompt"), "4": _correct("zero")}, "b": {"1": _correct("prompt")}},
                            ["v"])
    assert rec["per_task_pooled"]["a"]["fraction"]["v"]["value"] == pytest.approx(0.5)   # pooled over k
    assert rec["across_tasks"]["fraction"]["v"]["value"] == pytest.approx(2 / 3)          # and over tasks
    assert recovery.recovery({}, ["v"])["across_tasks"] is None
    assert rec["passing"] == {"v": ["a", "b"]} and rec["best_variant"] == "v" and rec["target_met"]
    assert rec["per_k"]["4"]["target_met"] is False and rec["definition"] == recovery.DEFINITION
    assert recovery.best_variant({"x": ["a"], "y": ["a"]}, lambda v: 0.7) == (None, ["x", "y"])
    assert recovery.best_variant({"x": [], "y": []}, lambda v: 0.0) == (None, ["x", "y"])
    with pytest.raises(LiniclError, match="'prompt'"):
        recovery.compare({"zero": np.zeros(3)}, [])


def test_copy_test_scores_methods_against_the_prompted_model():
    cfg = linicl.preset("tiny-llama", dtype="float64")
    model = linicl.Transformer(cfg)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    seen = []

    def plain(prompts, fit):                  # a "conversion" that forgets the prompt: the zero-shot model
        seen.append((np.shape(prompts), None if fit is None else np.shape(fit)))
        return variables

    def refuses(prompts, fit):
        raise LiniclError("no")

    out = fidelity.copy_test(model, variables, {"plain": (plain, False), "fit": (plain, True), "bad": (refuses, False)},
                             prompt_len=8, input_len=2, pairs=3, low=4, batch=2, seed=0)
    methods = out["methods"]
    assert list(methods) == ["prompt", "zero", "plain", "fit"] and out["skipped"] == [dict(method="bad", reason="no")]
    assert methods["prompt"]["logit_rel_err_mean"] == 0.0 and methods["prompt"]["argmax_agree"] == 1.0
    for name in ("plain", "fit"):
        assert methods[name]["per_pair"] == methods["zero"]["per_pair"] and methods[name]["pairs"] == 3
    assert ((2, 8), None) in seen and ((8,), (3, 2)) in seen     # per prompt: the windows [2:4], [4:6], [6:8]
    assert out["settings"]["fit_windows"] == [(2, 4), (4, 6), (6, 8)]
    with pytest.raises(LiniclError, match="input_len"):
        fidelity.copy_test(model, variables, {}, prompt_len=4, input_len=4, pairs=1, low=0, batch=1, seed=0)
