"""convert_approx(kernel="learned"): a linearized student's trained maps as the prompt kernel of its
unmodified softmax teacher, joined to the query's exact softmax as in the student's hybrid.

The formula is checked against direct NumPy sums at hook_z of every layer (exact, for any maps); a
prompt kept entirely as sinks gives the prompted teacher (exact); trained maps are measured to keep
more of the prompt than the untrained ones and than dropping it (approximate, fixed seed).
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca
from linicl import linearize as LZ
from linicl.errors import LiniclError
from linicl.interventions import capture
from linicl.names import block_site, layer_scope
from helpers import BASELINE_MIN, EXACT_RTOL, apply, init, rel_err, tokens


@pytest.fixture(scope="module")
def teacher():
    return init(linicl.preset("tiny-llama", dtype="float64", max_len=64), 0)


def _student(teacher, window: int, sinks: int):
    model, variables = teacher
    student = linicl.Transformer(LZ.student_config(model.cfg, window=window, sinks=sinks))
    return student, LZ.student_variables(student, variables)


def _random_maps(student_variables, seed: int):
    """The student's variables with every map and gate drawn at random: the identity maps would
    leave W = I untested."""
    key = jax.random.PRNGKey(seed)

    def draw(path, x):
        if getattr(path[-1], "key", None) not in LZ.student.TRAINED:
            return x
        return 0.7 * jax.random.normal(jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode())),
                                       x.shape, x.dtype)
    return {"params": jax.tree_util.tree_map_with_path(draw, student_variables["params"])}


def _prompted(model, variables, prompt, query):
    n = prompt.shape[1]
    full = jnp.concatenate([jnp.broadcast_to(prompt, (query.shape[0], n)), query], axis=1)
    return apply(model, variables, full)[:, n:]


# ------------------------------------------------------------------------------ the formula in NumPy
def _rope_half(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """Rotate ``x: [seq, d]`` at positions ``pos: [seq]`` (the "half" layout of tiny-llama)."""
    h = x.shape[-1] // 2
    angle = pos[:, None] * base ** (-np.arange(0, 2 * h, 2) / (2 * h))[None, :]
    a, b = x[:, :h], x[:, h:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)


def _hedgehog(x: np.ndarray, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x: [seq, d]`` -> ``[seq, 2m]``: [softmax(xW + b), softmax(-(xW + b))]."""
    a = x @ W + b

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return np.concatenate([softmax(a), softmax(-a)], -1)


def _formula(cfg, maps, layer, acts, prompt_acts, n: int, sinks: int, window: int) -> np.ndarray:
    """hook_z ``[batch, T, heads, d]`` of ``layer`` by direct sums: for the query token at absolute
    position n + t, head h, with exact keys E (the prompt's first ``sinks`` and last ``window``, and the
    query's tokens up to t) and linearised prompt keys L,
        o = [sum_E g e^{s_i - c} v_i + sum_L phi_q(q).phi_k(k_i) v_i] / [sum_E g e^{s_i - c} + sum_L phi_q(q).phi_k(k_i)]
    with s_i = q.k_i / sqrt(d), c = max_E s_i, g = sigmoid(gate) (1 without a gate)."""
    attn = maps["params"][layer_scope(layer)]["attn"]
    Q, K, V = (np.asarray(acts[block_site(layer, f"hook_{x}")]) for x in "qkv")
    Kp, Vp = (np.asarray(prompt_acts[block_site(layer, f"hook_{x}")])[0] for x in "kv")
    batch, T, H, d = Q.shape
    group = H // K.shape[2]
    out = np.zeros_like(Q)
    for bt in range(batch):
        for h in range(H):
            kv = h // group  # grouped-query attention: query head h reads key/value head h // group
            g = 1 / (1 + np.exp(-float(attn["gate"][h]))) if "gate" in attn else 1.0
            Wq, bq, Wk, bk = (np.asarray(attn[f"phi_{x}"][h]) for x in ("q_W", "q_b", "k_W", "k_b"))
            q = _rope_half(Q[bt, :, h], n + np.arange(T), cfg.rope_base)
            k_own = _rope_half(K[bt, :, kv], n + np.arange(T), cfg.rope_base)
            k_prompt = _rope_half(Kp[:, kv], np.arange(n), cfg.rope_base)
            exact = np.r_[0:sinks, n - window:n]
            lin = np.setdiff1d(np.arange(n), exact)
            fk = _hedgehog(k_prompt[lin], Wk, bk)
            fq = _hedgehog(q, Wq, bq)
            for t in range(T):
                keys = np.concatenate([k_prompt[exact], k_own[:t + 1]])
                vals = np.concatenate([Vp[exact, kv], V[bt, :t + 1, kv]])
                s = keys @ q[t] / math.sqrt(d)
                w = g * np.exp(s - s.max())
                a = fk @ fq[t]
                num = w @ vals + a @ Vp[lin, kv]
                out[bt, t, h] = num / (w.sum() + a.sum())
    return out


@pytest.mark.parametrize("window, sinks, kept, recent", [(0, 0, 0, 0), (4, 1, 2, 0), (4, 1, 1, 3)])
def test_the_converted_layer_is_the_hybrid_formula(teacher, window, sinks, kept, recent):
    """window 0, sinks 0: a student without an exact part (no gate, g = 1); (4, 1): a gated student,
    converted with the first 2 prompt tokens kept exact, or the first and the last 3. Every layer's
    hook_z equals the direct sums on the converted pass's own q, k, v and the prompt's exact keys and
    values."""
    model, variables = teacher
    cfg = model.cfg
    maps = _random_maps(_student(teacher, window, sinks)[1], seed=window)
    assert ("gate" in maps["params"]["layers_0"]["attn"]) == (window > 0)
    n = 7
    prompt, query = tokens(11, 1, n, cfg.vocab_size), tokens(12, 2, 5, cfg.vocab_size)
    converted = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, sinks=kept,
                                     window=recent)
    names = [block_site(l, f"hook_{x}") for l in range(cfg.n_layers) for x in "qkvz"]
    _, acts = jax.jit(lambda v, t: capture(model, v, t, names=names))(converted, query)
    # The prompt's keys and values are the prompted teacher's (causality: the prompt alone gives them).
    _, prompt_acts = jax.jit(lambda v, t: capture(model, v, t, names=names))(variables, prompt)
    for layer in range(cfg.n_layers):
        z = np.asarray(acts[block_site(layer, "hook_z")])
        expected = _formula(cfg, maps, layer, acts, prompt_acts, n, kept, recent)
        assert rel_err(z, expected) <= EXACT_RTOL, layer
    assert rel_err(apply(model, converted, query), _prompted(model, variables, prompt, query)) >= BASELINE_MIN


def test_a_prompt_kept_as_sinks_is_the_prompted_teacher(teacher):
    """sinks = n: nothing is linearised, g_h cancels in the one normaliser, and decoding after the
    conversion equals one pass."""
    model, variables = teacher
    cfg = model.cfg
    maps = _random_maps(_student(teacher, 4, 1)[1], seed=3)
    n = 9
    prompt, query = tokens(21, 1, n, cfg.vocab_size), tokens(22, 2, 6, cfg.vocab_size)
    converted = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, sinks=n)
    target = _prompted(model, variables, prompt, query)
    assert rel_err(apply(model, converted, query), target) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), target) >= BASELINE_MIN
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=["decode"]))
    v, outs = converted, []
    for t in range(query.shape[1]):
        out, cache = step(v, query[:, t:t + 1])
        v, outs = {**v, **cache}, outs + [out]
    assert rel_err(jnp.concatenate(outs, axis=1), target) <= EXACT_RTOL


def test_a_student_keeps_selected_entries_beside_its_kernel_terms(teacher):
    """A selection with the student's maps: what a KV head keeps stays exact, what it drops goes into
    the kernel terms. Keeping the sinks and the last tokens by selection ("recent", tokens per KV head)
    is the conversion that keeps them by ``sinks``/``window``: two code paths, one answer. A selection
    by the prompt's own attention keeps other tokens, within the budget, and reads differently."""
    model, variables = teacher
    cfg = model.cfg
    maps = _random_maps(_student(teacher, 4, 1)[1], seed=5)
    n = 12
    prompt, query = tokens(31, 1, n, cfg.vocab_size), tokens(32, 2, 5, cfg.vocab_size)
    direct = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, sinks=1, window=3)
    chosen = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, keep=4, score="recent",
                                  sinks=1, window=3)
    assert rel_err(apply(model, chosen, query), apply(model, direct, query)) <= EXACT_RTOL
    by_attention = iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, keep=6, score="h2o",
                                        sinks=1, window=3)
    floats = iclca.stored_floats(by_attention)
    assert floats["kernel"] == iclca.stored_floats(direct)["kernel"] > 0  # the same maps, other weights
    assert floats["kept"] == cfg.n_layers * cfg.kv_heads * 6 * 2 * cfg.head_dim
    assert rel_err(apply(model, by_attention, query), apply(model, direct, query)) >= BASELINE_MIN


@pytest.mark.parametrize("window, sinks", [(4, 1), (1, 2), (6, 0)])
def test_with_the_students_sinks_and_window_the_first_query_token_reads_the_student(window, sinks):
    """On one layer the teacher and its student see the same q, k, v, so converting the prompt with the
    student's sinks and window - 1 (the prompt tokens still in its window at the first query token)
    gives the student's output at that token: exact once the student's own epsilon is 0. Keeping
    none of them exact (sinks 0, window 0) is far off."""
    cfg = linicl.preset("tiny-llama", dtype="float64", max_len=64, n_layers=1)
    model, variables = init(cfg, 1)
    student = linicl.Transformer(LZ.student_config(cfg, window=window, sinks=sinks).replace(attn_eps=0.0))
    maps = _random_maps(LZ.student_variables(student, variables), seed=window)
    n = 11
    prompt, query = tokens(31, 1, n, cfg.vocab_size), tokens(32, 3, 1, cfg.vocab_size)
    target = _prompted(student, maps, prompt, query)  # maps hold every parameter of the student

    def converted(**kw):
        return apply(model, iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps, **kw),
                     query)
    assert rel_err(converted(sinks=sinks, window=window - 1), target) <= EXACT_RTOL
    assert rel_err(converted(), target) >= 1e-3


def test_trained_maps_keep_more_of_the_prompt(teacher):
    """Attention transfer (a student with window 8, 40 steps on random tokens) makes the maps a better
    prompt kernel (the query's 6 tokens then fit the window, as in the conversion). Measured
    on this seed, relative error of the query logits against the prompted teacher: dropping the
    prompt 0.84, untrained maps (identity, g = 1/2) 0.47, trained 0.38."""
    model, variables = teacher
    cfg = model.cfg
    student, untrained = _student(teacher, 8, 0)
    sequences = np.asarray(tokens(3, 32, 32, cfg.vocab_size))
    trained, _ = LZ.train_maps(model, variables, student, untrained, sequences, steps=40, batch_size=8,
                               lr=2e-2, progress=False)
    n = 24
    prompt, query = tokens(1, 1, n, cfg.vocab_size), tokens(2, 8, 6, cfg.vocab_size)
    target = _prompted(model, variables, prompt, query)

    def error(maps):
        return rel_err(apply(model, iclca.convert_approx(model, variables, prompt, kernel="learned", maps=maps),
                             query), target)
    dropped, before, after = rel_err(apply(model, variables, query), target), error(untrained), error(trained)
    assert after < 0.9 * before < 0.6 * dropped, (dropped, before, after)


def test_bad_maps_are_refused(teacher):
    model, variables = teacher
    cfg = model.cfg
    prompt = tokens(0, 1, 6, cfg.vocab_size)
    maps = _student(teacher, 0, 0)[1]
    convert = lambda m=model, v=variables, **kw: iclca.convert_approx(m, v, prompt, **kw)  # noqa: E731
    with pytest.raises(LiniclError, match="needs maps="):
        convert(kernel="learned")
    for kernel in ("taylor2", "prf"):
        with pytest.raises(LiniclError, match="maps are the 'learned' kernel's"):
            convert(kernel=kernel, maps=maps)
    with pytest.raises(LiniclError, match="form='hybrid' goes with kernel='learned'"):
        convert(kernel="taylor2", form="hybrid")
    with pytest.raises(LiniclError, match="form='hybrid' goes with kernel='learned'"):
        convert(kernel="learned", maps=maps, form="shared")
    with pytest.raises(LiniclError, match="fit_inputs"):
        convert(kernel="learned", maps=maps, fit_inputs=prompt)
    with pytest.raises(LiniclError, match="lack layers_0/attn/{phi_q_W, phi_q_b, phi_k_W, phi_k_b}"):
        convert(kernel="learned", maps=variables)  # the teacher's own weights: no maps
    # Maps of other models: another head size, fewer layers, more layers.
    wide = init(cfg.replace(n_heads=2, n_kv_heads=1), 0)
    with pytest.raises(LiniclError, match=r"phi_q_W of shape \(2, 16, 16\); this model \(n_heads=4, head_dim=8\)"):
        convert(kernel="learned", maps=_student(wide, 0, 0)[1])
    deeper = init(cfg.replace(n_layers=3), 0)
    with pytest.raises(LiniclError, match="lack layers_2/attn"):
        convert(*deeper, kernel="learned", maps=maps)
    shallow = init(cfg.replace(n_layers=1), 0)
    with pytest.raises(LiniclError, match=r"hold \['layers_1'\] but the model has 1 layers"):
        convert(*shallow, kernel="learned", maps=maps)
    linear = init(linicl.preset("tiny-linear", dtype="float64"), 0)
    with pytest.raises(LiniclError, match="attention='linear'"):
        iclca.convert_approx(*linear, tokens(0, 1, 6, linear[0].cfg.vocab_size), kernel="learned", maps=maps)
