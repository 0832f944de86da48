"""linicl.diagnostics.normalisers: phi(q_t).z_t of every layer, against a direct NumPy computation that
also rebuilds each head's output from it (so it is what the model divides by)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import diagnostics, iclca, names
from linicl.errors import LiniclError
from linicl.interventions import capture
from linicl.kernels.positions import apply_rope

from helpers import init, tokens

CASES = {  # every part of the normaliser: bias, stored prompt, decay, grouped heads, positions
    "none": dict(preset="tiny-linear", n_kv_heads=2, decay=(0.5, 0.8, 0.9, 1.0)),
    "learned": dict(preset="tiny-linear-learned", n_kv_heads=1),
    "rope": dict(preset="tiny-linear-rope-decay", n_kv_heads=2),
    "hedgehog": dict(preset="tiny-linear", n_kv_heads=2, feature_map="hedgehog"),  # learned maps, per head
}


def _model(case: str):
    options = dict(CASES[case])
    cfg = linicl.preset(options.pop("preset"), dtype="float64", trainable_bias=True, **options)
    model, variables = init(cfg, seed=3)
    if cfg.feature_map == "hedgehog":  # away from the identity initialisation, so that W and b matter
        rng = np.random.default_rng(4)
        variables = jax.tree_util.tree_map_with_path(
            lambda path, a: a + 0.5 * rng.standard_normal(a.shape) if "phi_" in jax.tree_util.keystr(path) else a,
            variables)
    return cfg, model, variables


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _hedgehog(x, W, b):
    """Hedgehog's map in NumPy on ``x: [B, T, heads, d]``: [softmax(xW + b), softmax(-(xW + b))]."""
    a = np.einsum("bthd,hdm->bthm", x, np.asarray(W)) + np.asarray(b)[None, None]
    soft = lambda y: np.exp(y - y.max(-1, keepdims=True)) / np.exp(y - y.max(-1, keepdims=True)).sum(-1, keepdims=True)  # noqa: E731
    return np.concatenate([soft(a), soft(-a)], axis=-1)


def _attn_state(variables, collection, layer, name):
    if collection not in variables:
        return 0.0
    return np.asarray(variables[collection][f"layers_{layer}"]["attn"][name])


def numpy_reference(cfg, variables, acts, stored=names.PROMPT_STATE):
    """Per layer ``(den, bias part, stored part, rebuilt hook_z)`` by the recurrences
    z_t = gamma z_{t-1} + phi(k_t) and S_t = gamma S_{t-1} + rot(phi(k_t)) v_t^T, position by position."""
    gammas = np.asarray(cfg.decay_per_head() or [1.0] * cfg.n_heads)
    rep = cfg.n_heads // cfg.kv_heads
    out = []
    for layer in range(cfg.n_layers):
        q, k, v = (np.asarray(acts[f"blocks.{layer}.attn.hook_{s}"]) for s in "qkv")  # [B, T, heads, d]
        attn = variables["params"][f"layers_{layer}"]["attn"]
        if cfg.feature_map == "hedgehog":
            fq, fk = (_hedgehog(x, attn[f"phi_{s}_W"], attn[f"phi_{s}_b"]) for s, x in
                      (("q", q), ("k", np.repeat(k, rep, axis=2))))
        else:
            fq, fk = _elu1(q), np.repeat(_elu1(k), rep, axis=2)
        v = np.repeat(v, rep, axis=2)
        B, T, H, F = fq.shape
        rq, rk = fq, fk
        if cfg.positions == "rope":  # the numerator's features only; the normaliser keeps phi
            pos = np.arange(T)[:, None]
            rq, rk = (np.asarray(apply_rope(jnp.asarray(f), pos, cfg.rope_base, cfg.rope_style)) for f in (fq, fk))
        z_bias, S_bias = np.asarray(attn["z_bias"]), np.asarray(attn["S_bias"])
        z_st, S_st = _attn_state(variables, stored, layer, "z"), _attn_state(variables, stored, layer, "S")
        z_st, S_st = np.broadcast_to(z_st, (B, H, F)), np.broadcast_to(S_st, (B, H, F, v.shape[-1]))
        den, bias, part = (np.zeros((B, H, T)) for _ in range(3))
        o = np.zeros((B, T, H, v.shape[-1]))
        for b in range(B):
            for h in range(H):
                g = gammas[h]
                z, S = z_bias[h] + z_st[b, h], S_bias[h] + S_st[b, h]
                for t in range(T):
                    z = g * z + fk[b, t, h]
                    S = g * S + np.outer(rk[b, t, h], v[b, t, h])
                    den[b, h, t] = fq[b, t, h] @ z
                    bias[b, h, t] = fq[b, t, h] @ (g ** (t + 1) * z_bias[h])
                    part[b, h, t] = fq[b, t, h] @ (g ** (t + 1) * z_st[b, h])
                    o[b, t, h] = rq[b, t, h] @ S / (den[b, h, t] + cfg.attn_eps)
        out.append((den, bias, part, o))
    return out


def _check(cfg, model, variables, query, stored=names.PROMPT_STATE):
    result = jax.jit(lambda v, x: diagnostics.normalisers(model, v, x))(variables, query)
    sites = [f"blocks.{l}.attn.hook_{s}" for l in range(cfg.n_layers) for s in "qkvz"]
    _, acts = capture(model, variables, query, names=sites)
    assert len(result) == cfg.n_layers
    for layer, (n, (den, bias, part, o)) in enumerate(zip(result, numpy_reference(cfg, variables, acts, stored))):
        assert n.value.shape == (query.shape[0], cfg.n_heads, query.shape[1])
        np.testing.assert_allclose(n.value, den, rtol=1e-12)
        np.testing.assert_allclose(n.bias, bias, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(n.prompt, part, rtol=1e-12, atol=1e-14)
        # numerator / (this normaliser + eps) is the model's own head output
        np.testing.assert_allclose(o, acts[f"blocks.{layer}.attn.hook_z"], rtol=1e-10, atol=1e-13)
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_normalisers_are_what_the_model_divides_by(case):
    cfg, model, variables = _model(case)
    query = tokens(5, 2, 7, cfg.vocab_size)
    plain = _check(cfg, model, variables, query)
    assert all(float(jnp.abs(n.prompt).max()) == 0 and float(n.bias.min()) > 0 for n in plain)
    converted = iclca.convert(model, variables, tokens(6, 1, 5, cfg.vocab_size))
    stored = _check(cfg, model, converted, query)
    assert all(float(n.prompt.min()) > 0 for n in stored)  # the prompt raises every normaliser


def test_a_decode_state_supersedes_the_prompt():
    cfg, model, variables = _model("none")
    converted = iclca.convert(model, variables, tokens(6, 1, 5, cfg.vocab_size))
    running = jax.tree.map(lambda x: 2.0 * x, converted[names.PROMPT_STATE])  # another state, as the model reads it
    decoding = {**converted, names.DECODE: running}
    result = _check(cfg, model, decoding, tokens(5, 1, 4, cfg.vocab_size), stored=names.DECODE)
    again = diagnostics.normalisers(model, converted, tokens(5, 1, 4, cfg.vocab_size))
    np.testing.assert_allclose(result[0].prompt, 2.0 * again[0].prompt, rtol=1e-12)


def test_from_captured_activations_and_errors():
    cfg, model, variables = _model("none")
    query = tokens(5, 2, 7, cfg.vocab_size)
    _, acts = capture(model, variables, query, names=diagnostics.normaliser_sites(cfg))
    assert diagnostics.normaliser_sites(cfg) == ("blocks.0.attn.hook_q", "blocks.0.attn.hook_k",
                                                 "blocks.1.attn.hook_q", "blocks.1.attn.hook_k")
    one = diagnostics.normalisers_from(cfg, variables, acts, layers=[1])
    np.testing.assert_array_equal(one[0].value, diagnostics.normalisers(model, variables, query)[1].value)
    with pytest.raises(LiniclError, match="blocks.1.attn.hook_k"):
        diagnostics.normalisers_from(cfg, variables, {k: v for k, v in acts.items() if "1.attn.hook_k" not in k})
    for preset in ("tiny-softmax", "tiny-linear-unnormalized"):
        other = linicl.preset(preset)
        with pytest.raises(LiniclError, match="normalised linear attention"):
            diagnostics.normalisers(linicl.Transformer(other), {}, query)
    gated = linicl.preset("tiny-linear", gate="scalar")
    with pytest.raises(LiniclError, match="gate='scalar'"):
        diagnostics.normalisers(linicl.Transformer(gated), {}, query)
    with pytest.raises(LiniclError, match="short_conv=3 is not supported"):
        diagnostics.normalisers(linicl.Transformer(linicl.preset("tiny-linear", short_conv=3)), {}, query)
