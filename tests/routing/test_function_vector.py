"""The function-vector baseline (linicl.routing.function_vector): head effects by patching equal the
model run with the patch, attribution is the derivative along the patch, the function vector is the heads'
share of the attention output; and wrong_labels, which makes the corrupted prompts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import routing as R
from linicl.data import Example, wrong_labels
from linicl.errors import LiniclError
from linicl.interventions import apply_fn, at_last, capture, replace, with_edits
from linicl.names import block_site
from helpers import BASELINE_MIN, EXACT_RTOL, init, random_prompts, rel_err

# A central difference with step 1e-4 has a truncation error ~ 1e-8 relative (third derivative of a
# smooth function of O(1) values) and a rounding error ~ 1e-16 / 1e-4 = 1e-12 in float64.
FD_STEP, FD_RTOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def setup():
    cfg = linicl.preset("tiny-llama", n_layers=3, dtype="float64")
    model, variables = init(cfg, 0)
    rng = np.random.default_rng(0)
    clean, corrupted = random_prompts(rng, 10, cfg.vocab_size, 6), random_prompts(rng, 7, cfg.vocab_size, 6)
    gold = rng.integers(0, cfg.vocab_size, len(corrupted)).astype(np.int32)
    mean_z = R.mean_head_outputs(model, variables, clean, batch_size=4)
    return model, variables, clean, corrupted, gold, mean_z


def _gold_prob(model, variables, rows, gold, edits_for=None):
    """Mean p(gold) at each row's last token, one row at a time (no padding), with ``edits_for(T)``."""
    out = []
    for r, g in zip(rows, gold):
        toks = jnp.asarray(r)[None]
        v = variables if edits_for is None else with_edits(variables, edits_for(len(r)), model.cfg)
        logits = model.apply(v, toks)[0, -1]
        out.append(jax.nn.softmax(logits)[g])
    return float(np.mean(out))


def test_mean_head_outputs_are_the_last_token_means(setup):
    model, variables, clean, _, _, mean_z = setup
    cfg = model.cfg
    assert mean_z.shape == (cfg.n_layers, cfg.n_heads, cfg.head_dim)
    name = block_site(1, "hook_z")
    one = np.mean([np.asarray(capture(model, variables, jnp.asarray(p)[None], names=[name])[1][name][0, -1])
                   for p in clean], axis=0)
    assert rel_err(mean_z[1], one) <= EXACT_RTOL


def test_patching_effects_are_the_patched_model_minus_the_clean_one(setup):
    """Batched, padded, one compiled forward for every head = each row run alone with one replace edit."""
    model, variables, _, rows, gold, mean_z = setup
    pairs = [(0, 1), (2, 3), (1, 0)]
    effects = R.head_effects(model, variables, rows, gold, mean_z, heads=pairs, batch_size=3)
    clean = _gold_prob(model, variables, rows, gold)
    for l, h in pairs:
        def patch(T, l=l, h=h):
            return [replace(block_site(l, "hook_z"), jnp.asarray(mean_z[l]), positions=at_last([T], T),
                            heads=np.arange(model.cfg.n_heads) == h)]
        want = _gold_prob(model, variables, rows, gold, patch) - clean
        assert abs(effects[l, h] - want) <= EXACT_RTOL * clean
        assert abs(want) >= BASELINE_MIN * clean  # the patch changes the answer's probability
    others = np.ones(effects.shape, bool)
    others[tuple(zip(*pairs))] = False
    assert np.all(np.isnan(effects[others]))


def test_attribution_is_the_derivative_along_the_patch(setup):
    """attribution[l, h] = d/de mean p(gold | z[l, h] := z + e (mean_z - z)) at e = 0, for every head."""
    model, variables, _, rows, gold, mean_z = setup
    attr = R.head_effects(model, variables, rows, gold, mean_z, method="attribution", batch_size=4)
    cfg = model.cfg
    assert attr.shape == (cfg.n_layers, cfg.n_heads)
    patched = R.head_effects(model, variables, rows, gold, mean_z, heads=[(0, 0)], batch_size=4)
    for l in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            def toward(T, eps, l=l, h=h):
                target = jnp.asarray(mean_z[l])
                return [apply_fn(block_site(l, "hook_z"), lambda x, t, ctx: x + eps * (t - x), target,
                                 positions=at_last([T], T), heads=np.arange(cfg.n_heads) == h)]
            up = _gold_prob(model, variables, rows, gold, lambda T: toward(T, FD_STEP))
            down = _gold_prob(model, variables, rows, gold, lambda T: toward(T, -FD_STEP))
            fd = (up - down) / (2 * FD_STEP)
            assert abs(attr[l, h] - fd) <= FD_RTOL * np.abs(attr).max()
    # a first-order estimate, not the patching effect itself
    assert abs(attr[0, 0] - patched[0, 0]) >= BASELINE_MIN * abs(patched[0, 0])


def test_function_vector_is_the_heads_share_of_the_attention_output(setup):
    """Summed over every head of a layer, the function vector is that layer's attention output when all
    its heads output their means (tiny-llama's ``o`` has no bias)."""
    model, variables, clean, _, _, mean_z = setup
    cfg = model.cfg
    assert "bias" not in variables["params"]["layers_1"]["attn"]["o"]
    l, toks = 1, jnp.asarray(clean[0])[None]
    out_name = block_site(l, "hook_attn_out")
    edits = [replace(block_site(l, "hook_z"), jnp.asarray(mean_z[l]), positions=at_last([toks.shape[1]],
                                                                                        toks.shape[1]))]
    patched = capture(model, with_edits(variables, edits, cfg), toks, names=[out_name])[1][out_name][0, -1]
    plain = capture(model, variables, toks, names=[out_name])[1][out_name][0, -1]
    fv = R.function_vector(model, variables, mean_z, [(l, h) for h in range(cfg.n_heads)])
    assert fv.shape == (cfg.d_model,)
    assert rel_err(fv, patched) <= EXACT_RTOL and rel_err(fv, plain) >= BASELINE_MIN
    parts = [R.function_vector(model, variables, mean_z, [(l, h)]) for h in range(cfg.n_heads)]
    assert rel_err(np.sum(parts, axis=0), fv) <= EXACT_RTOL


def test_screened_heads_are_patched_and_ranked(setup):
    model, variables, _, rows, gold, mean_z = setup
    heads, effects = R.function_vector_heads(model, variables, rows, gold, mean_z, n_heads=3, screen=5)
    assert np.sum(~np.isnan(effects)) == 5 and len(heads) == 3
    assert [effects[p] for p in heads] == sorted(effects[~np.isnan(effects)].tolist(), reverse=True)[:3]
    full_heads, full = R.function_vector_heads(model, variables, rows, gold, mean_z, n_heads=3)
    assert not np.any(np.isnan(full)) and full_heads == R.top_heads(full, 3)


def test_top_heads_never_picks_a_missing_effect():
    e = np.array([[0.1, np.nan], [-0.5, 0.3]])
    assert R.top_heads(e, 3) == [(1, 1), (0, 0), (1, 0)]
    with pytest.raises(LiniclError, match=r"n_heads must be an int in \[1, 3\]"):
        R.top_heads(e, 4)
    with pytest.raises(LiniclError, match="n_heads"):
        R.top_heads(e, 0)


def test_bad_input_is_named(setup):
    model, variables, _, rows, gold, mean_z = setup
    with pytest.raises(LiniclError, match="method must be one of"):
        R.head_effects(model, variables, rows, gold, mean_z, method="ablation")
    with pytest.raises(LiniclError, match=r"gold_ids must be int\[7\]"):
        R.head_effects(model, variables, rows, gold[:3], mean_z)
    with pytest.raises(LiniclError, match="gold_ids must be token ids"):
        R.head_effects(model, variables, rows, gold + model.cfg.vocab_size, mean_z)
    with pytest.raises(LiniclError, match="mean_z must be"):
        R.head_effects(model, variables, rows, gold, mean_z[:2])
    with pytest.raises(LiniclError, match=r"\(layer, head\) pairs"):
        R.head_effects(model, variables, rows, gold, mean_z, heads=[(3, 0)])


def test_wrong_labels_change_every_label_to_another():
    labels = ["A", "B", "C"]
    demos = [Example(f"q{i}", labels[i % 3]) for i in range(30)]
    bad = wrong_labels(demos, labels, 0)
    assert [d.input for d in bad] == [d.input for d in demos]
    assert all(b.output != d.output and b.output in labels for b, d in zip(bad, demos))
    assert len({b.output for b, d in zip(bad, demos) if d.output == "A"}) == 2  # both others are drawn
    assert wrong_labels(demos, labels, 0) == bad and wrong_labels(demos, labels, 1) != bad
    with pytest.raises(LiniclError, match="two or more"):
        wrong_labels(demos, ["A"], 0)
    with pytest.raises(LiniclError, match=r"demo labels \['C'\] are not among"):
        wrong_labels(demos, ["A", "B"], 0)
