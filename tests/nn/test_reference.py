"""Every model feature of the zoo against an independent NumPy reference (float64).

The other model tests compare one form of linicl's code with another (parallel with recurrent, the
converted model with the prompted one, a decode with a full pass). A bug that every form shares (say
per-head decays applied in reverse order, or key/value heads tiled instead of repeated) passes all of
them. Here the model is written again from its documentation (``ModelConfig``'s docstring, the
kernels' module docstrings, ``linicl.nn.block``'s table of block forms, iclca.md section 4) as plain
NumPy loops and direct sums over keys, reading only the parameters of the initialised variables:

* embeddings (tied or not, learned positions, scaled by sqrt(d_model)), LayerNorm / RMSNorm /
  Gemma's RMSNorm (1 + w), every block form (sandwich included), plain (any depth) and gated MLPs
  with every activation;
* Gemma's attention options: q/k norms before rope, the scale 1/sqrt(query_pre_attn_scalar), a head
  width set apart from d_model / n_heads;
* softmax attention (causal or not, rope in both pairings, grouped-query heads);
* linear attention: y_t = sum_{s<=t} gamma_h^(t-s) phi(q_t).phi(k_s) v_s / (sum ... + eps), with the
  feature maps (elu+1, relu, identity, taylor2, hedgehog), per-head decays gamma_h in the order
  ``cfg.decay`` lists them, rope on the numerator features (the normaliser unrotated) or on q, k
  before phi, a trainable initial state, and LoLCATs' exact window and sinks;
* the exact ICLCA state after ``iclca.convert``: S = sum_s gamma^(n-1-s) R(s-n) phi(k_s) v_s^T
  (re-based), z = sum_s gamma^(n-1-s) phi(k_s) (unrotated features), the window and sink buffers;
* decoding from a converted prompt, and the kernel-approximated prompt of ``iclca.convert_approx``.

Nothing of linicl is used to compute a reference (no feature map, rope, norm or kernel function, not
even ModelConfig's derived properties), so a bug in linicl cannot cancel on both sides. Tolerance:
``EXACT_RTOL`` (1e-12 relative). Run ``tools/mutate.py`` to see which plausible bugs these tests catch.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import linicl
from linicl import iclca
from linicl.names import DECODE, POSITION, PROMPT_APPROX, PROMPT_STATE
from helpers import (BASELINE_MIN, EXACT_RTOL, any_configs, examples, finite_state_configs, tokens)

# ============================================================================ the NumPy reference


def _err(a, b) -> float:
    """max|a - b| / max|b| in float64 (the reference is b)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    assert scale > 0, "the reference is identically zero: the comparison would test nothing"
    return float(np.max(np.abs(a - b)) / scale)


def _rope(x, pos, base, style):
    """Rotate each row ``x[t]: [d]`` by angles pos[t] * theta_j, theta_j = base^(-2j / d_rot) over the
    d // 2 pairs: (2j, 2j+1) ("interleaved", GPT-J) or (j, j + d//2) ("half", GPT-NeoX / HF Llama);
    an odd last coordinate stays. ``x: [T, d]``, ``pos: [T]`` -> ``[T, d]``."""
    x = np.asarray(x, np.float64)
    n = x.shape[-1] // 2
    out = x.copy()
    for j in range(n):
        theta = base ** (-2.0 * j / (2 * n))
        a, b = (2 * j, 2 * j + 1) if style == "interleaved" else (j, j + n)
        cos, sin = np.cos(pos * theta), np.sin(pos * theta)
        out[:, a] = x[:, a] * cos - x[:, b] * sin
        out[:, b] = x[:, a] * sin + x[:, b] * cos
    return out


def _softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _phi(name, x, W=None, b=None):
    """The feature maps of ``ModelConfig.feature_map``, row-wise: ``x: [T, d]`` -> ``[T, d_phi]``."""
    if name == "elu+1":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "identity":
        return x
    if name == "taylor2":  # [1, x~, vec(x~ x~^T) / sqrt 2], x~ = x / d^(1/4)
        d = x.shape[-1]
        xs = x / d ** 0.25
        outer = np.stack([np.outer(r, r).ravel() for r in xs])
        return np.concatenate([np.ones((x.shape[0], 1)), xs, outer / math.sqrt(2.0)], axis=1)
    if name == "hedgehog":  # [softmax(xW + b), softmax(-(xW + b))]
        a = x @ W + b
        return np.concatenate([_softmax(a), _softmax(-a)], axis=1)
    raise AssertionError(name)


_GELU_TANH_C = math.sqrt(2.0 / math.pi)
_ERF = np.vectorize(math.erf)


def _act(name, x):
    if name == "gelu":
        return 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(_GELU_TANH_C * (x + 0.044715 * x ** 3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "tanh":
        return np.tanh(x)
    raise AssertionError(name)


def _dense(p, x, bias: bool):
    """``x @ kernel (+ bias)``, the kernel stored [in, out] (Flax's Dense)."""
    y = x @ p["kernel"]
    if bias:
        y = y + p["bias"]
    else:
        assert "bias" not in p, "a layer configured without bias has one"
    return y


def _norm(cfg, p, x):
    """LayerNorm ((x - mean) / sqrt(var + eps) * scale + bias), RMSNorm (x / rms * scale) or Gemma's
    RMSNorm (x / rms * (1 + scale)), over the last axis."""
    if cfg.norm_type == "rmsnorm":
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.ln_eps) * p["scale"]
    if cfg.norm_type == "gemma_rmsnorm":
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.ln_eps) * (1.0 + p["scale"])
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + cfg.ln_eps) * p["scale"] + p["bias"]


def _mlp(cfg, p, x):
    bias = _bias(cfg, "mlp")
    if cfg.mlp == "gated":  # fc_out(act(fc_gate(x)) * fc_in(x))
        h = _act(cfg.activation, _dense(p["fc_gate"], x, bias)) * _dense(p["fc_in"], x, bias)
    else:  # fc_out(act(... act(fc_in(x)))) with mlp_depth - 2 hidden layers
        h = _act(cfg.activation, _dense(p["fc_in"], x, bias))
        for j in range(cfg.mlp_depth - 2):
            h = _act(cfg.activation, _dense(p[f"fc_mid_{j}"], h, bias))
    return _dense(p["fc_out"], h, bias)


def _gammas(cfg):
    """gamma_h for h = 0..H-1 from ``cfg.decay`` itself (None, one float, or one per head in order)."""
    if cfg.decay is None:
        return [1.0] * cfg.n_heads
    if isinstance(cfg.decay, (int, float)):
        return [float(cfg.decay)] * cfg.n_heads
    return [float(g) for g in cfg.decay]


def _kv_heads(cfg):
    return cfg.n_heads if cfg.n_kv_heads is None else cfg.n_kv_heads


def _hybrid(cfg):
    """Linear attention with an exact window or sinks."""
    return cfg.attention == "linear" and (cfg.window > 0 or cfg.sinks > 0)


def _bias(cfg, which):
    """Whether the attention or MLP projections have biases (``attn_bias``/``mlp_bias``, else ``use_bias``)."""
    own = cfg.attn_bias if which == "attn" else cfg.mlp_bias
    return cfg.use_bias if own is None else own


def _kv_head(cfg, h):
    """Grouped-query attention: query head h reads key/value head h // (H / kv_heads) (HF order)."""
    return h // (cfg.n_heads // _kv_heads(cfg))


def _linear_head(cfg, p, h, q, k, v, pos, rec):
    """One linear-attention head by direct sums: ``q, k, v: [T, d]`` at positions ``pos: [T]`` (the
    first token of the sequence at 0). Records the keys' features for the state test in ``rec``."""
    T, d = q.shape
    rope = cfg.positions == "rope"
    rot = lambda x: _rope(x, pos, cfg.rope_base, cfg.rope_style)  # noqa: E731
    if rope and cfg.rope_on == "inputs":  # phi(R_t q).phi(R_s k), numerator and normaliser alike
        q, k = rot(q), rot(k)
    if cfg.feature_map == "hedgehog":
        fq = _phi("hedgehog", q, p["phi_q_W"][h], p["phi_q_b"][h])
        fk = _phi("hedgehog", k, p["phi_k_W"][h], p["phi_k_b"][h])
    else:
        fq, fk = _phi(cfg.feature_map, q), _phi(cfg.feature_map, k)
    fqd, fkd = fq, fk  # the normaliser's features: never rotated on the features
    if rope and cfg.rope_on == "features":
        fq, fk = rot(fq), rot(fk)
    # The exact (window/sink) logits score rotated q, k whichever features rope rotates.
    qe, ke = (rot(q), rot(k)) if rope and cfg.rope_on == "features" else (q, k)
    gam = _gammas(cfg)[h]
    g = 1.0 / (1.0 + math.exp(-float(p["gate"][h]))) if _hybrid(cfg) else 0.0
    y = np.zeros_like(v)
    for t in range(T):
        exact = [s for s in range(t + 1) if pos[s] < cfg.sinks or pos[t] - pos[s] < cfg.window]
        logits = {s: float(qe[t] @ ke[s]) / math.sqrt(d) for s in exact}
        c = max(logits.values()) if logits else 0.0
        num, den = np.zeros(v.shape[1]), 0.0
        for s in range(t + 1):
            w = gam ** (t - s)
            if s in logits:
                e = g * w * math.exp(logits[s] - c)
                num, den = num + e * v[s], den + e
            else:
                num, den = num + w * float(fq[t] @ fk[s]) * v[s], den + w * float(fqd[t] @ fkd[s])
        if cfg.trainable_bias:  # an initial state before position 0: decayed by gamma^(t + 1)
            num = num + gam ** (t + 1) * (fq[t] @ p["S_bias"][h])
            den = den + gam ** (t + 1) * float(fqd[t] @ p["z_bias"][h])
        y[t] = num / (den + cfg.attn_eps) if cfg.normalize else num
    rec.append(dict(fk=fk, fkd=fkd, ke=ke, v=v))
    return y


def _softmax_head(cfg, q, k, v, qpos, kpos, approx=None):
    """One softmax head: ``q: [T, d]`` at ``qpos``, ``k, v: [S, d]`` at ``kpos`` (rotated already).
    ``approx``: a kernel-approximated prompt (see ``_approx_terms``)."""
    d = q.shape[1]
    y = np.zeros((q.shape[0], v.shape[1]))
    for t in range(q.shape[0]):
        vis = [s for s in range(k.shape[0]) if kpos[s] <= qpos[t] or not cfg.causal]
        s_ = np.array([float(q[t] @ k[s]) / math.sqrt(d) for s in vis])
        e = np.exp(s_)
        if approx is None:
            y[t] = (e[:, None] * v[vis]).sum(0) / e.sum()
            continue
        fq = approx["phi"](q[t:t + 1])[0]
        N, Z = fq @ approx["B"], float(fq @ approx["b"])
        if approx["lam"] is None:  # one normaliser shared by the prompt and the visible keys
            y[t] = ((e[:, None] * v[vis]).sum(0) + N) / (e.sum() + Z)
        else:  # lam * softmax over the visible keys + (1 - lam) * the prompt's kernel attention
            y[t] = approx["lam"] * (e[:, None] * v[vis]).sum(0) / e.sum() + (1 - approx["lam"]) * N / Z
    return y


def _local_head(cfg, q, k, v, pos):
    """A local layer's head: softmax over the keys s with 0 <= t - s < sliding_window, q and k rotated
    at the local rope base (``rope_local_base``, else ``rope_base``) when the model has rope."""
    if cfg.positions == "rope":
        base = cfg.rope_base if cfg.rope_local_base is None else cfg.rope_local_base
        q, k = (_rope(a, pos, base, cfg.rope_style) for a in (q, k))
    d = q.shape[1]
    y = np.zeros((q.shape[0], v.shape[1]))
    for t in range(q.shape[0]):
        vis = [s for s in range(k.shape[0]) if 0 <= pos[t] - pos[s] < cfg.sliding_window]
        e = np.exp(np.array([float(q[t] @ k[s]) / math.sqrt(d) for s in vis]))
        y[t] = (e[:, None] * v[vis]).sum(0) / e.sum()
    return y


def _attention(cfg, p, x, pos, rec, approx=None, local=False):
    """Multi-head attention of ``x: [B, T, D]`` at ``pos: [T]`` -> ``[B, T, D]`` (``local``: a
    sliding-window layer of ``cfg.layer_types``)."""
    H, bias = cfg.n_heads, _bias(cfg, "attn")
    d = cfg.d_model // cfg.n_heads if cfg.d_head is None else cfg.d_head
    q = np.einsum("btm,mhd->bthd", x, p["q"]["kernel"]) + (p["q"]["bias"] if bias else 0)
    k = np.einsum("btm,mhd->bthd", x, p["k"]["kernel"]) + (p["k"]["bias"] if bias else 0)
    v = np.einsum("btm,mhd->bthd", x, p["v"]["kernel"]) + (p["v"]["bias"] if bias else 0)
    if cfg.qk_norm:  # each head's q and k over d, before rope
        q, k = _norm(cfg, p["q_norm"], q), _norm(cfg, p["k_norm"], k)
    if cfg.query_pre_attn_scalar is not None:  # q.k / sqrt(d) becomes q.k / sqrt(s)
        q = q * math.sqrt(d / cfg.query_pre_attn_scalar)
    assert q.shape[2] == H and k.shape[2] == _kv_heads(cfg) and q.shape[3] == d
    out = np.zeros(q.shape)
    for b in range(x.shape[0]):
        for h in range(H):
            qh, kh, vh = q[b, :, h], k[b, :, _kv_head(cfg, h)], v[b, :, _kv_head(cfg, h)]
            if local:
                out[b, :, h] = _local_head(cfg, qh, kh, vh, pos)
                continue
            if cfg.attention == "linear":
                out[b, :, h] = _linear_head(cfg, p, h, qh, kh, vh, pos, rec)
                continue
            if cfg.positions == "rope":
                qh, kh = (_rope(a, pos, cfg.rope_base, cfg.rope_style) for a in (qh, kh))
            kpos, a = pos, None
            if approx is not None:  # the prompt's exact sinks come first, at positions 0..sinks-1
                a = approx[b][h]
                kh, vh = np.concatenate([a["sink_k"], kh]), np.concatenate([a["sink_v"], vh])
                kpos = np.concatenate([np.arange(len(a["sink_k"])), pos])
            out[b, :, h] = _softmax_head(cfg, qh, kh, vh, pos, kpos, a)
            rec.append(dict(k=kh, v=vh))
    o = np.einsum("bthd,hdm->btm", out, p["o"]["kernel"])
    return o + (p["o"]["bias"] if bias else 0)


def _block(cfg, p, x, pos, rec, approx=None, local=False):
    """The block forms of ``linicl.nn.block`` (N1 = ln1, N2 = ln2, A attention)."""
    A = lambda u: _attention(cfg, p["attn"], u, pos, rec, approx, local)  # noqa: E731
    M = lambda u: _mlp(cfg, p["mlp"], u)  # noqa: E731
    if cfg.norm == "pre":
        h = x + A(_norm(cfg, p["ln1"], x))
        return h + M(_norm(cfg, p["ln2"], h))
    if cfg.norm == "sandwich":  # N1', N2' = ln1_post, ln2_post on what is added to the residual
        h = x + _norm(cfg, p["ln1_post"], A(_norm(cfg, p["ln1"], x)))
        return h + _norm(cfg, p["ln2_post"], M(_norm(cfg, p["ln2"], h)))
    if cfg.norm == "post":
        h = _norm(cfg, p["ln1"], x + A(x))
        return _norm(cfg, p["ln2"], h + M(h))
    a = A(x)
    if cfg.skip == "residual":
        return x + a + M(x + a)
    if cfg.skip == "dherin":
        return x + a + M(a)
    return M(a)


def np_forward(cfg, params, toks, start: int = 0, approx=None):
    """Logits ``[B, T, vocab]`` of ``toks: int[B, T]`` at positions start, start+1, ..., and per layer
    the records of each (batch row, head) (linear: key features; softmax: rotated keys, values)."""
    toks = np.asarray(toks)
    pos = start + np.arange(toks.shape[1])
    x = params["embed"][toks]
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    if cfg.positions == "learned":
        x = x + params["pos_embed"][pos][None]
    records = []
    for l in range(cfg.n_layers):
        rec = []
        local = cfg.layer_types is not None and cfg.layer_types[l] == "local"
        x = _block(cfg, params[f"layers_{l}"], x, pos, rec, None if approx is None else approx[l], local)
        records.append(rec)
    final_norm = cfg.norm in ("pre", "sandwich") if cfg.final_norm is None else cfg.final_norm
    if final_norm:
        x = _norm(cfg, params["ln_f"], x)
    logits = x @ params["embed"].T if cfg.tie_embeddings else x @ params["unembed"]["kernel"]
    return logits, records


def _record(records, cfg, layer, b, h):
    return records[layer][b * cfg.n_heads + h]


# ============================================================================ models and parameters
_MODELS = {}


def _random_variables(shapes, seed: int):
    """Variables with the shapes and names ``model.init`` gives (``shapes``: its ``jax.eval_shape``),
    every value random: a test with zero biases, unit norm scales, identity hedgehog maps or g = 1/2
    could not see a bug that misuses them. Dense kernels have std 1/sqrt(fan in), embeddings std 1
    (activations of order one), z_bias >= 0 (positive denominators). Drawing the values here instead of
    calling ``init`` saves a compilation per model."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name, shape = "/".join(str(getattr(k, "key", k)) for k in path), x.shape
        if name.endswith("kernel"):  # q, k, v: [D, heads, d]; o: [heads, d, D]; Dense: [in, out]
            fan_in = shape[0] * shape[1] if name.endswith("attn/o/kernel") else shape[0]
            value = rng.normal(size=shape) / math.sqrt(fan_in)
        elif name.endswith("z_bias"):
            value = np.abs(rng.normal(size=shape))
        elif name.endswith("bias"):  # projection and norm biases, S_bias
            value = 0.3 * rng.normal(size=shape)
        elif name.endswith("scale"):
            value = 1.0 + 0.3 * rng.normal(size=shape)
        else:  # embed, pos_embed, gate, hedgehog's phi_*_W and phi_*_b
            value = rng.normal(size=shape)
        return jnp.asarray(value, jnp.float64)
    return jax.tree_util.tree_map_with_path(draw, shapes)


def model_of(cfg, seed: int = 0):
    """``(model, variables, params as NumPy, jitted apply)`` for a float64 config (cached)."""
    key = (cfg, seed)
    if key not in _MODELS:
        model = linicl.Transformer(cfg)
        shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
        variables = _random_variables(shapes, seed + 1)
        params = jax.tree.map(np.asarray, variables["params"])
        _MODELS[key] = (model, variables, params, jax.jit(model.apply))
    return _MODELS[key]


def cfg_(**changes):
    base = dict(vocab_size=11, d_model=8, n_layers=2, n_heads=2, d_ff=12, max_len=64, dtype="float64")
    return linicl.ModelConfig(**{**base, **changes})


# Each option of the zoo at least once, decays always distinct per head (a reversal must show).
LINEAR = {
    "elu+1": cfg_(),
    "elu+1/rope-features/per-head-decay/bias": cfg_(n_heads=3, d_model=12, positions="rope",
                                                    decay=(0.6, 0.85, 0.97), trainable_bias=True),
    "taylor2/rope-half/odd-feature-width": cfg_(feature_map="taylor2", d_model=4, positions="rope",
                                                rope_style="half", decay=(0.7, 0.95)),
    "relu/learned/post-rms/no-bias": cfg_(feature_map="relu", attn_eps=1e-3, positions="learned",
                                          norm="post", norm_type="rmsnorm", use_bias=False),
    "identity/unnormalised/gqa/rope": cfg_(feature_map="identity", normalize=False, n_heads=4,
                                           d_model=16, n_kv_heads=2, positions="rope",
                                           decay=(0.5, 0.7, 0.9, 1.0)),
    "hedgehog-m3/rope-inputs/gqa": cfg_(feature_map="hedgehog", feature_size=3, n_kv_heads=1,
                                        positions="rope", rope_on="inputs", decay=(0.8, 0.95)),
    "hedgehog/window3/sinks1/rope-features": cfg_(feature_map="hedgehog", window=3, sinks=1,
                                                  positions="rope", decay=(0.75, 0.95)),
    "elu+1/window2/rope-inputs/gqa/bias": cfg_(n_heads=4, d_model=16, n_kv_heads=1, window=2,
                                               positions="rope", rope_on="inputs",
                                               rope_style="half", trainable_bias=True,
                                               decay=(0.6, 0.7, 0.8, 0.9)),
    "taylor2/sinks2/no-norm-dherin": cfg_(feature_map="taylor2", d_model=6, n_heads=3, sinks=2,
                                          norm="none", skip="dherin", decay=0.9),
    "elu+1/no-norm-none/gated-silu/untied": cfg_(norm="none", skip="none", mlp="gated",
                                                 activation="silu", tie_embeddings=False),
    "relu/no-norm-residual/depth3/tanh": cfg_(feature_map="relu", attn_eps=1e-3, norm="none",
                                              mlp_depth=3, activation="tanh", final_norm=True),
    "elu+1/chunked/decay/bias/gelu": cfg_(form="chunked", chunk_size=3, decay=(0.7, 0.9),
                                          trainable_bias=True, activation="gelu",
                                          positions="rope"),
    "taylor2/recurrent/learned": cfg_(feature_map="taylor2", d_model=4, form="recurrent",
                                      positions="learned", decay=(0.9, 0.6)),
    "hedgehog/window3/sinks1/recurrent": cfg_(feature_map="hedgehog", window=3, sinks=1,
                                              form="recurrent", chunk_size=2, decay=(0.8, 0.6),
                                              positions="rope", rope_on="inputs"),
    "elu+1/window2/sinks2/chunked": cfg_(window=2, sinks=2, form="chunked", chunk_size=3,
                                         decay=(0.9, 0.7)),
    "hedgehog/window3/gemma-like/local": cfg_(feature_map="hedgehog", window=3, sinks=1, positions="rope",
                                              rope_on="inputs", rope_style="half", n_kv_heads=1, d_head=5,
                                              norm="sandwich", norm_type="gemma_rmsnorm", qk_norm=True,
                                              scale_embeddings=True, query_pre_attn_scalar=7.0, mlp="gated",
                                              use_bias=False, layer_types=("local", "global"), sliding_window=2,
                                              rope_local_base=100.0),
}
SOFTMAX = {
    "gpt2-like/learned": cfg_(attention="softmax", positions="learned"),
    "rope-interleaved/gqa1": cfg_(attention="softmax", positions="rope", n_kv_heads=1),
    "llama-like/rope-half/rms/swiglu/gqa2": cfg_(attention="softmax", positions="rope", rope_style="half",
                                                 n_heads=4, d_model=16, n_kv_heads=2,
                                                 norm_type="rmsnorm", mlp="gated", activation="silu",
                                                 use_bias=False, tie_embeddings=False),
    "non-causal/post": cfg_(attention="softmax", causal=False, norm="post"),
    "gemma-like/sandwich/qk-norm/d_head/scale/local": cfg_(
        attention="softmax", positions="rope", rope_style="half", n_heads=4, d_model=16, n_kv_heads=2, d_head=6,
        norm="sandwich", norm_type="gemma_rmsnorm", qk_norm=True, scale_embeddings=True,
        query_pre_attn_scalar=5.0, mlp="gated", activation="gelu_tanh", use_bias=False, n_layers=3,
        layer_types=("local", "local", "global"), sliding_window=3, rope_base=1e6, rope_local_base=1e4),
    "no-norm-dherin/depth3/relu/attn-bias-only": cfg_(attention="softmax", norm="none", skip="dherin",
                                                      mlp_depth=3, activation="relu", use_bias=True,
                                                      mlp_bias=False),
}
ALL = {**{"linear/" + k: c for k, c in LINEAR.items()}, **{"softmax/" + k: c for k, c in SOFTMAX.items()}}


# ============================================================================ tests: the forward pass
@pytest.mark.parametrize("name", list(ALL))
def test_model_equals_the_numpy_reference(name):
    cfg = ALL[name]
    model, variables, params, apply = model_of(cfg)
    x = tokens(1, 2, 9, cfg.vocab_size)
    reference, _ = np_forward(cfg, params, x)
    assert _err(apply(variables, x), reference) <= EXACT_RTOL


@examples(0.3)
@given(cfg=st.one_of(any_configs(), finite_state_configs()), T=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_random_configs_equal_the_numpy_reference(cfg, T, seed):
    model, variables, params, apply = model_of(cfg, seed % 7)
    x = tokens(seed, 2, T, cfg.vocab_size)
    reference, _ = np_forward(cfg, params, x)
    assert _err(apply(variables, x), reference) <= EXACT_RTOL


def test_the_reference_has_power():
    """The reference tells the options apart: the model differs from the reference of a model with
    reversed decays, the other rope pairing, rope on the other side of phi, another window or no
    sinks (so the tests above can fail)."""
    cfg = cfg_(n_heads=3, d_model=12, feature_map="hedgehog", positions="rope", decay=(0.6, 0.85, 0.97),
               window=2, sinks=1)
    model, variables, params, apply = model_of(cfg)
    x = tokens(2, 1, 8, cfg.vocab_size)
    out = apply(variables, x)
    assert _err(out, np_forward(cfg, params, x)[0]) <= EXACT_RTOL
    for other in (cfg.replace(decay=cfg.decay[::-1]), cfg.replace(rope_style="half"),
                  cfg.replace(rope_on="inputs"), cfg.replace(window=3), cfg.replace(sinks=0)):
        assert _err(out, np_forward(other, params, x)[0]) >= BASELINE_MIN, other.describe()


def test_the_reference_tells_gemma_options_apart():
    """Each of Gemma's options changes the reference: without the post norms (pre), with RMSNorm's w
    for Gemma's 1 + w, without q/k norms, unscaled embeddings or the default attention scale, another
    sliding window, one rope base for every layer, or another layer pattern."""
    cfg = SOFTMAX["gemma-like/sandwich/qk-norm/d_head/scale/local"]
    model, variables, params, apply = model_of(cfg)
    x = tokens(3, 1, 8, cfg.vocab_size)
    out = apply(variables, x)
    assert _err(out, np_forward(cfg, params, x)[0]) <= EXACT_RTOL
    for other in (cfg.replace(norm="pre"), cfg.replace(norm_type="rmsnorm"), cfg.replace(qk_norm=False),
                  cfg.replace(scale_embeddings=False), cfg.replace(query_pre_attn_scalar=None),
                  cfg.replace(sliding_window=4), cfg.replace(rope_local_base=None),
                  cfg.replace(layer_types=("local", "global", "global"))):
        assert _err(out, np_forward(other, params, x)[0]) >= BASELINE_MIN, other.describe()


# ============================================================================ tests: the ICLCA state
def expected_state(cfg, params, records, layer, b, h, n):
    """The stored state of one head after a prompt of n tokens (iclca.md sections 4 and 6):
    S = sum_s gamma^(n-1-s) f_s v_s^T over the tokens that left the window (not sinks), f_s the
    numerator features (rotated to absolute positions; re-based by R(-n) when the model depends on
    t - s only), z likewise from the normaliser's (unrotated) features; a trainable bias B0 enters
    as gamma^n B0 and is subtracted (it is added again on every call). Hybrid layers also keep the
    window's last window-1 tokens and the sinks, with positions (-1: empty)."""
    r = _record(records, cfg, layer, b, h)
    gam = _gammas(cfg)[h]
    lin = [s for s in range(n) if s >= cfg.sinks and n - s >= max(cfg.window, 1)]
    S = sum((gam ** (n - 1 - s) * np.outer(r["fk"][s], r["v"][s]) for s in lin),
            np.zeros((r["fk"].shape[1], r["v"].shape[1])))
    z = sum((gam ** (n - 1 - s) * r["fkd"][s] for s in lin), np.zeros(r["fkd"].shape[1]))
    p = params[f"layers_{layer}"]["attn"]
    if cfg.trainable_bias:
        S, z = S + gam ** n * p["S_bias"][h], z + gam ** n * p["z_bias"][h]
    if cfg.positions == "rope" and cfg.rope_on == "features" and not _hybrid(cfg):
        S = _rope(S.T, np.full(S.shape[1], -n), cfg.rope_base, cfg.rope_style).T
    if cfg.trainable_bias:
        S, z = S - p["S_bias"][h], z - p["z_bias"][h]
    state = dict(S=S, z=z)
    if _hybrid(cfg):
        def rows(key, at):  # the token's entry per slot, zeros in an empty slot (position < 0)
            out = np.zeros((len(at), r[key].shape[1]))
            for j, s in enumerate(at):
                if s >= 0:
                    out[j] = r[key][s]
            return out
        w = max(cfg.window - 1, 0)  # the buffer: the last w positions read, oldest first
        slots = [n - w + j for j in range(w)]
        sinks = [j if j < n else -1 for j in range(cfg.sinks)]
        state.update(win_k=rows("ke", slots), win_fk=rows("fk", slots), win_fkd=rows("fkd", slots),
                     win_v=rows("v", slots), win_pos=np.array([max(s, -1) for s in slots], np.int32),
                     sink_k=rows("ke", sinks), sink_v=rows("v", sinks), sink_pos=np.array(sinks, np.int32))
    return state


def _assert_state(stored, expected, what):
    """Integer positions equal, floats to EXACT_RTOL; an all-zero expected array must be zero."""
    if expected.dtype.kind == "i":
        np.testing.assert_array_equal(stored, expected, err_msg=what)
    elif not np.any(expected):
        np.testing.assert_array_equal(stored, 0.0, err_msg=what)
    else:
        assert _err(stored, expected) <= EXACT_RTOL, what


_KV_FIELDS = ("win_k", "win_v", "sink_k", "sink_v")  # a hybrid state's fields with kv_heads heads

# (config, prompt length): prompts shorter than the window or the sinks leave empty slots.
STATES = [("elu+1/rope-features/per-head-decay/bias", 6), ("taylor2/rope-half/odd-feature-width", 5),
          ("identity/unnormalised/gqa/rope", 5), ("hedgehog-m3/rope-inputs/gqa", 5),
          ("relu/learned/post-rms/no-bias", 5), ("hedgehog/window3/sinks1/rope-features", 1),
          ("hedgehog/window3/sinks1/rope-features", 6), ("elu+1/window2/rope-inputs/gqa/bias", 6),
          ("taylor2/sinks2/no-norm-dherin", 1), ("taylor2/sinks2/no-norm-dherin", 5)]


@pytest.mark.parametrize("name,n", STATES)
def test_converted_state_and_model_equal_the_numpy_reference(name, n):
    """The state ``iclca.convert`` stores, field by field, equals the NumPy sums; the converted model
    on a query, and after a second prompt converted on top, equals the reference run on
    [prompt(s); query]."""
    cfg = LINEAR[name]
    model, variables, params, apply = model_of(cfg)
    prompt, query, p2 = (tokens(3 + i, 2, m, cfg.vocab_size) for i, m in enumerate((n, 4, 3)))
    converted = iclca.convert(model, variables, prompt)
    _, records = np_forward(cfg, params, prompt)
    for layer in range(cfg.n_layers):
        stored = jax.tree.map(np.asarray, converted[PROMPT_STATE][f"layers_{layer}"]["attn"])
        for b in range(2):
            for h in range(cfg.n_heads):
                for field, want in expected_state(cfg, params, records, layer, b, h, n).items():
                    # keys and values are stored per key/value head (query head h reads h // group)
                    at = h // (cfg.n_heads // cfg.kv_heads) if field in _KV_FIELDS else h
                    got = stored[field] if field.endswith("_pos") else stored[field][b, at]
                    _assert_state(got, want, f"layer {layer} row {b} head {h} {field}")
    # The query continues at n when the model depends on absolute positions, else restarts at 0.
    absolute = cfg.positions == "learned" or _hybrid(cfg) or (cfg.positions == "rope" and cfg.rope_on == "inputs")
    assert int(converted[POSITION]["offset"]) == (n if absolute else 0)
    full = np.concatenate([prompt, query], 1)
    assert _err(apply(converted, query), np_forward(cfg, params, full)[0][:, n:]) <= EXACT_RTOL
    twice = iclca.convert(model, converted, p2)
    full = np.concatenate([prompt, p2, query], 1)
    assert _err(apply(twice, query), np_forward(cfg, params, full)[0][:, n + 3:]) <= EXACT_RTOL


# ============================================================================ tests: decoding
DECODES = ["linear/elu+1/rope-features/per-head-decay/bias", "linear/hedgehog/window3/sinks1/rope-features",
           "softmax/llama-like/rope-half/rms/swiglu/gqa2"]


@pytest.mark.parametrize("name", DECODES)
def test_decoding_equals_the_numpy_reference(name):
    """A prefill of 3 tokens, then one token at a time through the decode state (from a converted
    prompt for linear models), against the reference on the whole sequence."""
    cfg = ALL[name]
    model, variables, params, apply = model_of(cfg)
    x = tokens(7, 2, 7, cfg.vocab_size)
    start = variables
    n = 0
    if cfg.attention == "linear":
        n = 4
        prompt = tokens(8, 1, n, cfg.vocab_size)
        start = iclca.convert(model, variables, prompt)
        full = np.concatenate([np.broadcast_to(prompt, (2, n)), x], 1)
    else:
        full = np.asarray(x)
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=[DECODE]))
    logits, state = step(start, x[:, :3])
    out = [logits]
    for t in range(3, x.shape[1]):
        logits, state = step({**start, **state}, x[:, t:t + 1])
        out.append(logits)
    assert _err(jnp.concatenate(out, 1), np_forward(cfg, params, full)[0][:, n:]) <= EXACT_RTOL


# ============================================================================ tests: approximate conversion
def _approx_features(kernel, x, W=None):
    """The kernels of ``iclca.convert_approx`` on rows ``x: [T, d]``: taylor2 (as the feature map);
    elu+1 and prf on x~ = x / d^(1/4), prf = exp(W x~ - |x~|^2 / 2) / sqrt(m) with W: [m, d]."""
    if kernel == "taylor2":
        return _phi("taylor2", x)
    xs = x / x.shape[1] ** 0.25
    if kernel == "elu+1":
        return _phi("elu+1", xs)
    return np.exp(xs @ W.T - 0.5 * (xs * xs).sum(1, keepdims=True)) / math.sqrt(W.shape[0])


def _approx_terms(cfg, records, stored, kernel, sinks, lam, n):
    """Per layer, row and query head: B = sum_{s >= sinks} phi(k_s) v_s^T and b = sum phi(k_s) over the
    prompt's rotated keys (of the head's key/value head), the sinks' keys and values, the kernel."""
    out = []
    for l in range(cfg.n_layers):
        W = stored[l].W
        rows = []
        for b in range(len(records[l]) // cfg.n_heads):
            heads = []
            for h in range(cfg.n_heads):
                r = _record(records, cfg, l, b, h)  # the head's own (repeated) key/value head
                Wh = None if W is None else np.asarray(W)[h]
                phi = lambda x, Wh=Wh: _approx_features(kernel, x, Wh)  # noqa: E731
                fk = phi(r["k"][sinks:n])
                heads.append(dict(B=fk.T @ r["v"][sinks:n], b=fk.sum(0), phi=phi, lam=lam,
                                  sink_k=r["k"][:sinks], sink_v=r["v"][:sinks]))
            rows.append(heads)
        out.append(rows)
    return out


@pytest.mark.parametrize("name,kernel,form,sinks", [
    ("softmax/llama-like/rope-half/rms/swiglu/gqa2", "taylor2", "shared", 0),
    ("softmax/llama-like/rope-half/rms/swiglu/gqa2", "prf", "shared", 2),
    ("softmax/llama-like/rope-half/rms/swiglu/gqa2", "taylor2", "mix", 1),
    ("softmax/gpt2-like/learned", "elu+1", "shared", 1)])
def test_approximate_conversion_equals_the_numpy_formula(name, kernel, form, sinks):
    """The query continues at position n; the prompt's keys are the prompted model's (rotated to
    0..n-1); e^{q.k/sqrt d} to a linearised prompt key is replaced by phi(q).phi(k)."""
    cfg = ALL[name]
    model, variables, params, apply = model_of(cfg)
    n = 5
    prompt, query = tokens(9, 1, n, cfg.vocab_size), tokens(10, 2, 4, cfg.vocab_size)
    converted = iclca.convert_approx(model, variables, prompt, kernel, form=form, sinks=sinks, n_features=16)
    stored = [converted[PROMPT_APPROX][f"layers_{l}"]["attn"]["approx"] for l in range(cfg.n_layers)]
    _, records = np_forward(cfg, params, np.broadcast_to(prompt, (2, n)))
    terms = _approx_terms(cfg, records, stored, kernel, sinks, 0.5 if form == "mix" else None, n)
    for l in range(cfg.n_layers):  # the stored sums themselves (batch-1 prompt: row 0)
        for h in range(cfg.n_heads):
            assert _err(np.asarray(stored[l].B)[0, h], terms[l][0][h]["B"]) <= EXACT_RTOL
            assert _err(np.asarray(stored[l].b)[0, h], terms[l][0][h]["b"]) <= EXACT_RTOL
    reference, _ = np_forward(cfg, params, query, start=n, approx=terms)
    assert _err(apply(converted, query), reference) <= EXACT_RTOL
