"""Implicit weight updates (Dherin et al.; Innocenti & Achour): a block with context equals the block on
one token with a rank-1 first-MLP-matrix update and a last-MLP-bias shift, exactly (float64, every
position, every block, every block form), and the whole network converts."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, reject, strategies as st
from jax.experimental import checkify

import linicl
from linicl import compiled, iclca, implicit
from linicl.implicit.blocks import check_block_params
from linicl.interventions import with_edits
from linicl.errors import DegenerateInputError, LiniclError, NotExactError
from linicl.nn.hooks import Edit
from helpers import BASELINE_MIN, EXACT_RTOL, any_configs, apply, examples, linear_configs, rel_err

RANK_TOL = 1e-12  # second singular value / first, for a matrix that is rank 1 up to rounding


# ------------------------------------------------------------------------------------ strategies
@st.composite
def configs(draw, **fixed):
    """Any zoo config (linear or softmax, every norm, block form, MLP, positions option) with MLP
    biases (the shift needs one); softmax also non-causal."""
    strategy = linear_configs if fixed.get("attention") == "linear" else any_configs
    cfg = draw(strategy(mlp_bias=True, **fixed))
    if cfg.norm == "sandwich":  # no implicit update exists for it (refused: test_sandwich_is_refused)
        cfg = cfg.replace(norm="pre")
    if cfg.attention == "softmax" and "causal" not in fixed:
        cfg = cfg.replace(causal=draw(st.booleans()))
    return cfg


@st.composite
def block_forms(draw, **fixed):
    """Configs for block-level tests: every (norm, skip) form, both MLPs, both attentions."""
    form = draw(st.sampled_from(["plain", "dherin", "residual", "pre", "post"]))
    norm, skip = {"plain": ("none", "none"), "dherin": ("none", "dherin"), "residual": ("none", "residual"),
                  "pre": ("pre", "residual"), "post": ("post", "residual")}[form]
    return draw(configs(norm=norm, skip=skip, n_layers=1, **fixed))


def model_and_variables(cfg, seed):
    """A model and random variables drawn with NumPy from the parameter shapes (``jax.eval_shape``:
    no compilation of the initialisers). Like ``helpers.init``: unit-scale embeddings, z_bias >= 0;
    besides, every bias and norm scale/bias is random (init leaves them 0 and 1: special cases).
    Kernels are N(0, 1/fan_in)."""
    model = linicl.Transformer(cfg)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))

    def draw(path, leaf):
        keys = [getattr(k, "key", "") for k in path]
        rng = np.random.default_rng([seed, zlib.crc32(jax.tree_util.keystr(path).encode())])
        x = rng.standard_normal(leaf.shape)
        if keys[-1] == "kernel":
            fan_in = leaf.shape[0] if keys[-2] in ("q", "k", "v") else int(np.prod(leaf.shape[:-1]))
            x = x / np.sqrt(fan_in)
        elif keys[-1] == "scale":
            x = 1 + 0.3 * x
        elif keys[-1] in ("bias", "S_bias"):
            x = 0.3 * x
        elif keys[-1] == "z_bias":
            x = np.abs(x)
        return jnp.asarray(x, leaf.dtype)
    return model, {"params": jax.tree_util.tree_map_with_path(draw, shapes["params"])}


def tokens(seed: int, batch: int, length: int, vocab: int):
    """Random ids (NumPy: no compilation per shape)."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


def block_and_inputs(cfg, seed, batch, T):
    """One block's (perturbed) params and random inputs ``Z: f[batch, T, d]``."""
    _, variables = model_and_variables(cfg, seed)
    Z = np.random.default_rng(seed + 3).standard_normal((batch, T, cfg.d_model))
    return variables["params"]["layers_0"], jnp.asarray(Z)


_EXAMPLES = [0]


def fresh(every: int = 8):
    """Call at the start of each example: every few examples drop the compiled functions. Each
    example compiles new models; a long (thorough) session otherwise accumulates executables until
    the process runs out of memory mappings (vm.max_map_count) and crashes inside XLA's compiler."""
    _EXAMPLES[0] += 1
    if _EXAMPLES[0] % every == 0:
        jax.clear_caches()
        for cached in (_model_fn, _captured):
            cached.cache_clear()
        compiled.clear()  # implicit.convert's jitted functions


def defined(*trees):
    """Discard an example whose update is undefined: the theorem needs f != 0, and bias-free relu
    features can make the attention output of a token alone exactly 0 (f = A(x) in the plain and
    Dherin blocks). Such updates are NaN under jit (and raise eagerly: tested separately)."""
    assume(all(np.all(np.isfinite(np.asarray(a))) for t in trees for a in jax.tree.leaves(t)))


def second_singular(m) -> float:
    """s_1 / s_0 of a matrix (0 for the zero matrix)."""
    s = np.linalg.svd(np.asarray(m), compute_uv=False)
    return float(s[1] / s[0]) if s[0] > 0 and len(s) > 1 else 0.0


# ------------------------------------------------------------------------------------ jitted pieces
@functools.lru_cache(maxsize=None)
def _model_fn(model, reference):
    def run(variables, toks):
        mu = implicit.updates(model, variables, toks, reference=reference)
        cfg = model.cfg
        stacked = implicit.stack_blocks(cfg, variables["params"])
        unpatched = jax.vmap(lambda bp, x: implicit.alone(cfg, bp, x)["hook_resid_post"])(stacked, mu.pieces.x)
        return mu, implicit.implied_all(model, variables, mu), implicit.dense(mu.update), unpatched
    return jax.jit(run)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _block_fn(cfg, bp, Z, reference):
    pcs = implicit.pieces(cfg, bp, Z, reference)
    upd = implicit.update(cfg, bp, pcs)
    ctx = implicit.block_sites(cfg, bp, Z)
    ref = implicit.alone(cfg, bp, pcs.x)
    return pcs, upd, implicit.implied(cfg, bp, upd, pcs.x), ctx, ref


# ------------------------------------------------------------------------------------ block operators
@examples(0.6)
@given(cfg=configs(), T=st.integers(1, 24), reference=st.sampled_from(implicit.REFERENCES),
       seed=st.integers(0, 2**16))
def test_every_block_and_position_is_exact_and_rank_one(cfg, T, reference, seed):
    fresh()
    model, variables = model_and_variables(cfg, seed)
    toks = tokens(seed, 2, T, cfg.vocab_size)
    mu, implied, dense, unpatched = _model_fn(model, reference)(variables, toks)
    defined(mu.update.u)
    out = mu.pieces.out
    for layer in range(cfg.n_layers):
        # The patched block on its reference token alone gives the with-context output, at every
        # position of every task.
        assert rel_err(implied[layer], out[layer]) <= EXACT_RTOL, layer
        # Power: the unpatched block on the same token is far off (position 0 of a causal own-token
        # run has no context, so compare over all positions). Skipped for a block that ignores its
        # context exactly (zero updates, e.g. bias-free relu features that vanish).
        moved = any(np.any(np.asarray(u[layer])) for u in mu.update.u.values()) or np.any(np.asarray(mu.update.delta_b[layer]))
        if T > 1 and moved:
            assert rel_err(jnp.broadcast_to(unpatched[layer], out[layer].shape), out[layer]) >= BASELINE_MIN
    # Only the first MLP matrix (or matrices) and the bias: f[L, B, T, h, d] per matrix, each rank <= 1.
    stacked = np.concatenate([np.asarray(d) for d in dense.values()], axis=-2)  # [W_in; W_gate] of a gated MLP
    L, B, T_, hh, d = stacked.shape
    assert max(second_singular(m) for m in stacked.reshape(-1, hh, d)) <= RANK_TOL
    by_block = stacked.reshape(L, B, T_ * hh, d)
    if reference == "query":
        # Shared right factor f: the stacked [ΔW_1; ...; ΔW_N] and the sum over positions are rank 1.
        assert max(second_singular(m) for m in by_block.reshape(-1, T_ * hh, d)) <= RANK_TOL
        assert max(second_singular(m) for m in stacked.sum(axis=2).reshape(-1, hh, d)) <= RANK_TOL
    elif T >= 3 and cfg.d_model >= 2:
        # Power: with each token's own reference the right factors differ, so the stack is not rank 1.
        assert max(second_singular(m) for m in by_block.reshape(-1, T_ * hh, d)) >= BASELINE_MIN


@examples(0.3)
@given(cfg=block_forms(), T=st.integers(2, 16), seed=st.integers(0, 2**16), data=st.data())
def test_the_rank_one_update_is_the_minimal_norm_solution(cfg, T, seed, data):
    fresh()
    bp, Z = block_and_inputs(cfg, seed, 1, T)
    pcs, upd, _, _, _ = _block_fn(cfg, bp, Z, "query")
    defined(upd.u)
    i = data.draw(st.integers(0, T - 1))
    f, g = np.asarray(pcs.f[0, 0]), np.asarray(pcs.g[0, i])
    W = np.asarray(implicit.first_matrices(cfg, bp)["fc_in"])
    dW = np.asarray(implicit.dense(upd)["fc_in"][0, i])
    assert rel_err(dW @ f, W @ (g - f)) <= EXACT_RTOL
    # W(g - f) f⁺: the least-squares (minimum Frobenius norm) solution of ΔW f = W(g - f).
    assert rel_err(dW, np.outer(W @ (g - f), np.linalg.pinv(f[:, None]))) <= EXACT_RTOL
    # Any M with M f = 0 also solves it, stays exact, and is never smaller.
    R = np.random.default_rng(seed).standard_normal(dW.shape)
    M = R - np.outer(R @ f, f) / (f @ f)
    assert np.linalg.norm(dW) <= np.linalg.norm(dW + M)
    x = pcs.x[0, 0]
    target = pcs.out[0, i]
    one = jax.tree.map(lambda a: a[0], upd).at(i)
    with_m = implicit.patch(cfg, bp, one)
    with_m["mlp"]["fc_in"]["kernel"] = with_m["mlp"]["fc_in"]["kernel"] + M.T
    assert rel_err(_alone_out(cfg, with_m, x), target) <= EXACT_RTOL
    # Power: a perturbation outside the null space of f breaks the identity.
    with_r = implicit.patch(cfg, bp, one)
    with_r["mlp"]["fc_in"]["kernel"] = with_r["mlp"]["fc_in"]["kernel"] + R.T
    assert rel_err(_alone_out(cfg, with_r, x), target) >= BASELINE_MIN


_pieces = jax.jit(implicit.pieces, static_argnums=(0, 3))


@functools.partial(jax.jit, static_argnums=0)
def _alone_out(cfg, bp, x):
    return implicit.alone(cfg, bp, x)["hook_resid_post"]


@examples(0.5)
@given(cfg=block_forms(), T=st.integers(2, 16), seed=st.integers(0, 2**16))
def test_special_cases_of_dherin_and_innocenti_achour(cfg, T, seed):
    """The general rule ΔW = W(g - f)fᵀ/‖f‖², Δb' = q - p reduces to the papers' formulas, written here
    with the attention output A (site hook_attn_out) and the block input z (Δz_i = z_i - x)."""
    fresh()
    bp, Z = block_and_inputs(cfg, seed, 2, T)
    pcs, upd, implied, ctx, ref = _block_fn(cfg, bp, Z, "query")
    defined(upd.u)
    W = implicit.first_matrices(cfg, bp)["fc_in"]
    dW, db = implicit.dense(upd)["fc_in"], upd.delta_b
    dA = ctx["hook_attn_out"] - ref["hook_attn_out"]         # ΔA_(i) = A(C, x)_(i) - A(x)
    dz = Z - Z[:, -1:]                                       # Δz_(i)
    A_x = ref["hook_attn_out"]                               # [B, 1, d]
    outer = lambda a, r: (a @ W.T)[..., :, None] * (r / jnp.sum(r * r, -1, keepdims=True))[..., None, :]  # noqa: E731
    if cfg.norm == "none" and cfg.skip == "none":            # Dherin Thm 2.2: plain block, b' unchanged
        assert not np.any(np.asarray(db))
        assert rel_err(dW, outer(dA, A_x)) <= EXACT_RTOL
    elif cfg.norm == "none" and cfg.skip == "dherin":        # Dherin's skip variant: Δb' = ΔA at x
        assert rel_err(dW, outer(dA, A_x)) <= EXACT_RTOL
        assert rel_err(db, dA + dz) <= EXACT_RTOL and rel_err(db[:, -1], dA[:, -1]) <= EXACT_RTOL
    elif cfg.norm == "none":                                 # Innocenti & Achour Eqs. 11-12
        assert rel_err(dW, outer(dA + dz, A_x + Z[:, -1:])) <= EXACT_RTOL
        assert rel_err(db, dA + dz) <= EXACT_RTOL
    elif cfg.norm == "pre":                                  # Eqs. 29-30: Δb' = h_i - h_x = ΔA + Δz
        assert rel_err(db, dA + dz) <= EXACT_RTOL
        assert rel_err(pcs.f, ref["hook_mlp_in"]) <= EXACT_RTOL
    else:                                                    # post-LN: f = p = LN1(x + A(x)), g = q
        assert rel_err(pcs.f, pcs.p) <= EXACT_RTOL and rel_err(pcs.g, pcs.q) <= EXACT_RTOL
    assert rel_err(implied, pcs.out) <= EXACT_RTOL
    assert rel_err(dA[:, -1], ctx["hook_attn_out"][:, -1]) >= BASELINE_MIN  # the context moves A(x)


@examples(0.3)
@given(cfg=block_forms(), n=st.integers(2, 14), contiguous=st.booleans(), seed=st.integers(0, 2**16),
       data=st.data())
def test_subcontext_update_of_dherin(cfg, n, contiguous, seed, data):
    """T_W(C, x) = T_{W + ΔW(Y)}(C∖Y, x) for Y ⊂ C, contiguous or not; Y = C is the full update."""
    fresh()
    bp, Z = block_and_inputs(cfg, seed, 1, n + 1)
    Z = Z[0]
    if contiguous:
        a = data.draw(st.integers(0, n - 1))
        Y = list(range(a, data.draw(st.integers(a + 1, n))))
    else:
        Y = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    pcs, rest = implicit.subcontext(cfg, bp, Z, Y)
    try:
        patched = implicit.patch(cfg, bp, implicit.update(cfg, bp, pcs).at(0))
    except DegenerateInputError:
        reject()  # A(C∖Y, x) = 0: the theorem's condition fails (see ``defined``)
    full = pcs.out[0]
    assert rel_err(_block_out(cfg, patched, rest)[-1], full) <= EXACT_RTOL
    assert rel_err(_block_out(cfg, bp, rest)[-1], full) >= BASELINE_MIN  # power: without ΔW(Y)
    # Y = C: the reference is x alone (the query reference of the full update).
    every, rest = implicit.subcontext(cfg, bp, Z, range(n))
    assert rest.shape == (1, cfg.d_model)
    assert rel_err(every.f, _block_sites(cfg, bp, Z[-1:])["hook_mlp_in"]) <= EXACT_RTOL


_block_sites = jax.jit(implicit.block_sites, static_argnums=0)


def _block_out(cfg, bp, Z):
    return _block_sites(cfg, bp, Z)["hook_resid_post"]


# ------------------------------------------------------------------------------------ implicit GD
@functools.partial(jax.jit, static_argnums=0)
def _trajectory_fn(cfg, bp, Z, order):
    traj = implicit.trajectory(cfg, bp, Z)
    permuted = implicit.trajectory(cfg, bp, Z, order=order, chunk=3)
    full = implicit.update(cfg, bp, implicit.pieces(cfg, bp, Z)).at(Z.shape[0] - 1)
    implied = implicit.implied(cfg, bp, traj.update, Z[-1:])
    return traj, permuted, full, implied


@examples(0.3)
@given(cfg=block_forms(positions="none", decay=None), n=st.integers(2, 14), seed=st.integers(0, 2**16))
def test_implicit_gradient_descent_telescopes_and_ends_where_the_context_does(cfg, n, seed):
    fresh()
    bp, Z = block_and_inputs(cfg, seed, 1, n + 1)
    Z = Z[0]
    order = jnp.asarray(np.random.default_rng(seed).permutation(n))
    traj, permuted, full, implied = _trajectory_fn(cfg, bp, Z, order)
    defined(traj.update.u)
    # Discard the rare example whose context does not move the block at all, or whose f vanishes
    # (e.g. relu features of a bias-free projection that are all zero: A(x) = 0 whatever the context).
    assume(np.max(np.abs(traj.g[-1] - traj.g[0])) > BASELINE_MIN * np.max(np.abs(traj.g)))
    # Every prefix: W + ΔW(C_i) on x alone gives the block on [C_i, x] at x.
    assert rel_err(implied, traj.out) <= EXACT_RTOL
    W = implicit.first_matrices(cfg, bp)
    grad = jax.jit(jax.grad(implicit.gd_loss))
    W_i = {k: np.asarray(w) for k, w in W.items()}
    for i in range(1, n + 1):
        Delta = implicit.gradient(cfg, bp, traj, i)
        for k in W_i:
            g_k = grad(jnp.asarray(W_i[k]), Delta[k])          # ∇_W trace(Δ_iᵀ W) = Δ_i, for any W
            np.testing.assert_allclose(g_k, Delta[k], rtol=EXACT_RTOL, atol=0)
            W_i[k] = W_i[k] - traj.lr * np.asarray(g_k)          # one step, learning rate 1/‖f‖²
    assert traj.step_norms.shape == (n,) and np.all(np.isfinite(traj.step_norms))
    dense_full = implicit.dense(jax.tree.map(lambda a: a[None], full))
    for k in W_i:  # the steps telescope to W + ΔW(C), ΔW(C) from a separate full-context pass
        assert rel_err(W_i[k], W[k] + dense_full[k][0]) <= EXACT_RTOL
        step_sum = (traj.step_u[k].sum(0))[:, None] * traj.update.v[0][None, :]
        assert rel_err(step_sum, dense_full[k][0]) <= EXACT_RTOL
    # Another order: another path, the same end point (no positions: attention at x is order-free).
    end = lambda t: t.update.u["fc_in"][-1]  # noqa: E731
    assert rel_err(end(permuted), end(traj)) <= EXACT_RTOL
    if n >= 3:
        assert rel_err(permuted.update.u["fc_in"][1:-1], traj.update.u["fc_in"][1:-1]) >= BASELINE_MIN


# ------------------------------------------------------------------------------------ whole network
@examples(0.6)
@given(cfg=configs(), n=st.integers(0, 20), seed=st.integers(0, 2**16), data=st.data())
def test_convert_puts_the_context_into_the_weights(cfg, n, seed, data):
    fresh()
    model, variables = model_and_variables(cfg, seed)
    # Context from the upper half of the vocabulary, query from the lower half (as helpers does).
    half = cfg.vocab_size // 2
    context = half + tokens(seed + 1, 1, max(n, 1), cfg.vocab_size - half)[0, :n]
    query = tokens(seed + 2, 1, 1, half)[0]
    full = apply(model, variables, jnp.concatenate([context, query])[None])[0]
    position = data.draw(st.one_of(st.none(), st.integers(0, n)))
    i = n if position is None else position
    try:
        patched = implicit.convert(model, variables, context, query, position=position)
    except DegenerateInputError:
        reject()  # f = 0 in some block (see ``defined``)
    out = apply(model, patched, query[None])[0, -1]
    assert rel_err(out, full[i]) <= EXACT_RTOL
    if not (n == 0 or (i == 0 and cfg.positions != "learned")):  # otherwise nothing to absorb
        # Power: the unpatched model on the query alone is far off. (Rarely a random model ignores
        # its context, e.g. relu features that are all zero for this query make a normalised
        # attention output 0 whatever the context: such an example is discarded, not passed.)
        assume(rel_err(apply(model, variables, query[None])[0, -1], full[i]) >= BASELINE_MIN)
    # Only the first MLP matrices (a rank-1 change) and the last MLP bias differ.
    names = ("fc_in", "fc_gate") if cfg.mlp == "gated" else ("fc_in",)
    for layer in range(cfg.n_layers):
        old, new = variables["params"][f"layers_{layer}"], patched["params"][f"layers_{layer}"]
        flat_old = dict(jax.tree_util.tree_flatten_with_path(old)[0])
        for path, leaf in jax.tree_util.tree_flatten_with_path(new)[0]:
            key = jax.tree_util.keystr(path)
            if not (any(f"'{m}']['kernel" in key for m in names) or "'fc_out']['bias" in key):
                np.testing.assert_array_equal(leaf, flat_old[path], err_msg=key)
        stored = np.concatenate([np.asarray(new["mlp"][m]["kernel"]) for m in names], 1)
        change = stored - np.concatenate([np.asarray(old["mlp"][m]["kernel"]) for m in names], 1)
        # Rank 1 up to rounding: the outer product u vᵀ, the stored W + ΔW and the subtraction each
        # perturb elementwise by at most u = eps/2 relative, so by Weyl's inequality the second
        # singular value of the difference is at most u (‖W + ΔW‖ + 2‖ΔW‖) to first order. (A ratio
        # s_1/s_0 would fail when ΔW itself is at rounding level, e.g. position 0 without positions,
        # where nothing is absorbed.)
        s = np.linalg.svd(change, compute_uv=False)
        assert s[1] <= 2 * np.finfo(stored.dtype).eps * (np.linalg.norm(stored) + np.linalg.norm(change))
    # The vector form (two additive edits per block, no weight change) is the same patch.
    edits = implicit.convert_edits(model, variables, context, query, position=position)
    assert rel_err(apply(model, with_edits(variables, edits, model.cfg), query[None])[0, -1], full[i]) <= EXACT_RTOL


def test_convert_with_embeddings_vmaps_over_tasks_and_keeps_a_learned_offset():
    cfg = linicl.ModelConfig(vocab_size=16, d_model=6, n_layers=2, n_heads=2, d_ff=12, attention="softmax",
                             positions="learned", norm="pre", dtype="float64")
    model, variables = model_and_variables(cfg, 3)
    X = jax.random.normal(jax.random.PRNGKey(0), (3, 8, cfg.d_model), jnp.float64)
    full = jax.jit(lambda v, x: model.apply(v, embeds=x))(variables, X)[:, -1]
    batched = jax.vmap(lambda c, q: implicit.convert(model, variables, c, q))(X[:, :-1], X[:, -1:])
    out = jax.jit(jax.vmap(lambda v, q: model.apply(v, embeds=q[None])[0, -1]))(batched, X[:, -1:])
    assert rel_err(out, full) <= EXACT_RTOL
    one = implicit.convert(model, variables, X[1, :-1], X[1, -1:])
    assert rel_err(one["params"]["layers_1"]["mlp"]["fc_in"]["kernel"],
                   batched["params"]["layers_1"]["mlp"]["fc_in"]["kernel"][1]) <= EXACT_RTOL
    # A learned-positions offset (the "position" collection): the query alone sits at it.
    shifted = {**variables, "position": {"offset": jnp.asarray(5, jnp.int32)}}
    toks = tokens(1, 1, 7, cfg.vocab_size)[0]
    patched = implicit.convert(model, shifted, toks[:-1], toks[-1:])
    assert rel_err(apply(model, patched, toks[None, -1:])[0, -1], apply(model, shifted, toks[None])[0, -1]) <= EXACT_RTOL


@st.composite
def unnormalised_linear(draw):
    feature_map = draw(st.sampled_from(["identity", "elu+1", "relu", "taylor2"]))
    return draw(configs(attention="linear", feature_map=feature_map, normalize=False, max_layers=2))


@examples(0.3)
@given(cfg=unnormalised_linear(), n=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_linear_attention_context_term_is_the_stored_state(cfg, n, seed):
    """Unnormalised linear attention: ΔA = A(C, x) - A(x) = W_O (γ ⊙ Sᵀφ(q)) with S the ICLCA state of
    the context, and feeding that ΔA to the block on x alone reproduces the block with context."""
    fresh()
    model, variables = model_and_variables(cfg, seed)
    context, query = tokens(seed + 1, 1, n, cfg.vocab_size), tokens(seed + 2, 1, 1, cfg.vocab_size)
    states = iclca.bias_terms(iclca.convert(model, variables, context))
    acts = _captured(model)(variables, jnp.concatenate([context, query], 1))
    for layer, (S, _) in enumerate(states):
        bp = variables["params"][f"layers_{layer}"]
        x = acts["hook_resid_pre"][layer, 0, -1]
        closed, A_x, shifted, out = _closed_form(cfg, bp, S[0], x)
        defined(out)
        with_context = acts["hook_attn_out"][layer, 0, -1]
        dA = with_context - A_x                                   # two forward passes
        if not np.any(dA):  # relu features all zero for this query: no context term at all
            assert not np.any(closed)
            continue
        assert rel_err(closed, dA) <= EXACT_RTOL
        assert rel_err(dA, with_context) >= BASELINE_MIN          # the context term is not negligible
        # x alone with A(x) + ΔA is the block with context; so is the MLP patch built from it.
        assert rel_err(shifted["hook_mlp_in"], acts["hook_mlp_in"][layer, 0, -1]) <= EXACT_RTOL
        assert rel_err(shifted["hook_resid_post"], acts["hook_resid_post"][layer, 0, -1]) <= EXACT_RTOL
        assert rel_err(out, acts["hook_resid_post"][layer, 0, -1]) <= EXACT_RTOL


@functools.lru_cache(maxsize=None)
def _captured(model):
    names = ("hook_resid_pre", "hook_attn_out", "hook_mlp_in", "hook_resid_post")
    return jax.jit(lambda v, t: implicit.capture_blocks(model, v, t, names=names))


@functools.partial(jax.jit, static_argnums=0)
def _closed_form(cfg, bp, S, x):
    closed = implicit.context_term(cfg, bp, S, x)
    ref = implicit.alone(cfg, bp, x)
    shifted = implicit.alone(cfg, bp, x, interventions={"hook_attn_out": (Edit(closed),)})
    pcs = implicit.Pieces(shifted["hook_mlp_in"][None], shifted["hook_resid_mid"][None], ref["hook_mlp_in"][None],
                          ref["hook_resid_mid"][None], shifted["hook_resid_post"][None], x[None])
    out = implicit.implied(cfg, bp, implicit.update(cfg, bp, pcs), pcs.x)[0]
    return closed, ref["hook_attn_out"], shifted, out


# ------------------------------------------------------------------------------------ batches, float32
def test_updates_for_a_batch_in_one_call_match_the_block_operators():
    """The model-level call (every block, every position, a batch of tasks) agrees with the
    block-level operators on the captured inputs, for both references."""
    cfg = linicl.ModelConfig(vocab_size=20, d_model=6, n_layers=3, n_heads=3, d_ff=12, attention="softmax",
                             norm="pre", mlp="gated", activation="silu", positions="rope", dtype="float64")
    model, variables = model_and_variables(cfg, 1)
    toks = tokens(2, 3, 9, cfg.vocab_size)
    Z = _captured(model)(variables, toks)["hook_resid_pre"]
    for reference in ("own", "query"):
        mu, implied, _, _ = _model_fn(model, reference)(variables, toks)
        assert mu.update.u["fc_gate"].shape == (3, 3, 9, cfg.d_ff)
        assert mu.update.v.shape == (3, 3, 1 if reference == "query" else 9, cfg.d_model)
        for layer in range(cfg.n_layers):
            bp = variables["params"][f"layers_{layer}"]
            _, upd, _, _, _ = _block_fn(cfg, bp, Z[layer], reference)
            for k in upd.u:
                assert rel_err(mu.update.u[k][layer], upd.u[k]) <= EXACT_RTOL
            assert rel_err(mu.update.delta_b[layer], upd.delta_b) <= EXACT_RTOL
    # Metrics from the factors equal those of the dense matrices (query reference: no zero update).
    d = implicit.dense(mu.update)
    flat = np.concatenate([np.asarray(m) for m in d.values()], -2).reshape(3, 3, 9, -1)
    fro = np.linalg.norm(flat, axis=-1)
    assert rel_err(implicit.frobenius(mu.update), fro) <= EXACT_RTOL
    gram = np.einsum("lbik,lbjk->lbij", flat, flat) / (fro[..., :, None] * fro[..., None, :])
    assert rel_err(implicit.alignment(mu.update), gram) <= EXACT_RTOL


def test_float32_is_exact_to_float32_rounding():
    """float32 (eps 1.2e-7): the patched model differs by a few eps; the no-context baseline is O(1)."""
    cfg = linicl.ModelConfig(vocab_size=1, d_model=3, n_layers=5, n_heads=3, d_ff=12, mlp_depth=3,
                             attention="softmax", norm="none", final_norm=False, attn_bias=False,
                             mlp_bias=True, max_len=64)
    model, variables = model_and_variables(cfg, 1)
    X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 51, 3)), jnp.float32)
    fn = jax.jit(lambda v, x: (lambda mu: (mu.pieces.out, implicit.implied_all(model, v, mu)))(
        implicit.updates(model, v, embeds=x)))
    out, implied = fn(variables, X)
    assert implied.dtype == jnp.float32
    assert float(implicit.msd(implied, out)) <= 1e-10
    assert rel_err(implied, out) <= 1e-5
    patched = implicit.convert(model, variables, X[0, :-1], X[0, -1:])
    hidden = jax.jit(lambda v, x: model.apply(v, embeds=x, hidden=True))
    assert rel_err(hidden(patched, X[:1, -1:])[0, -1], hidden(variables, X[:1])[0, -1]) <= 1e-5


# ------------------------------------------------------------------------------------ errors
def _degenerate_model():
    """Pre-LN with zero biases: a constant token has LN1(x) = 0, so A = 0, h = x and f = LN2(x) = 0."""
    cfg = linicl.ModelConfig(vocab_size=8, d_model=6, n_layers=2, n_heads=2, d_ff=8, attention="softmax",
                             norm="pre", dtype="float64")
    model = linicl.Transformer(cfg)
    return model, jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))


def test_a_vanishing_reference_raises_instead_of_dividing_by_epsilon():
    model, variables = _degenerate_model()
    const = jnp.ones((4, 6), jnp.float64)
    with pytest.raises(DegenerateInputError, match="no epsilon"):
        implicit.convert(model, variables, const[:3], const[3:])
    bp = variables["params"]["layers_0"]
    with pytest.raises(DegenerateInputError, match="too small"):
        implicit.update(model.cfg, bp, _pieces(model.cfg, bp, const, "query"))
    # Under jit: NaN weights, never a finite wrong answer; checkify reports the message.
    fn = jax.jit(lambda c, q: implicit.convert(model, variables, c, q))
    assert np.all(np.isnan(fn(const[:3], const[3:])["params"]["layers_0"]["mlp"]["fc_in"]["kernel"]))
    err, _ = checkify.checkify(fn)(const[:3], const[3:])
    assert "too small to divide by" in str(err.get())
    # The plain block: A(x) = 0 for x = 0 without attention biases (Dherin's condition A(x) != 0).
    cfg = linicl.ModelConfig(d_model=4, n_heads=2, d_ff=8, n_layers=1, attention="softmax", norm="none",
                             skip="none", attn_bias=False, dtype="float64")
    bp, Z = block_and_inputs(cfg, 0, 1, 5)
    with pytest.raises(DegenerateInputError):
        implicit.update(cfg, bp, _pieces(cfg, bp, Z.at[0, -1].set(0.0), "query"))
    # The threshold: sqrt(eps) relative to ‖g‖.
    g = jnp.ones((1, 4))
    assert implicit.degenerate(g, 1e-9 * g)[0] and not implicit.degenerate(g, 1e-7 * g)[0]


def test_bad_input_to_convert_names_the_argument():
    cfg = linicl.ModelConfig(vocab_size=16, d_model=4, n_heads=2, d_ff=8, n_layers=1, attention="softmax",
                             dtype="float64")
    model, variables = model_and_variables(cfg, 0)
    ctx, q = tokens(0, 1, 5, 16)[0], tokens(1, 1, 1, 16)[0]
    with pytest.raises(LiniclError, match=r"context must be int32\[n\]"):
        implicit.convert(model, variables, ctx[None], q)
    with pytest.raises(LiniclError, match=r"query must be int32\[1\]"):
        implicit.convert(model, variables, ctx, ctx[:2])
    with pytest.raises(LiniclError, match="query holds token ids"):
        implicit.convert(model, variables, ctx, q + 100)
    with pytest.raises(LiniclError, match=r"query as embeddings must be float\[1, 4\]"):
        implicit.convert(model, variables, jnp.zeros((5, 4)), jnp.zeros((2, 4)))
    with pytest.raises(LiniclError, match="both be tokens or both embeddings"):
        implicit.convert(model, variables, ctx, jnp.zeros((1, 4)))
    with pytest.raises(LiniclError, match="position must index the 6 tokens"):
        implicit.convert(model, variables, ctx, q, position=6)
    with pytest.raises(LiniclError, match="linicl.Transformer"):
        implicit.convert(object(), variables, ctx, q)
    with pytest.raises(LiniclError, match="'params'"):
        implicit.convert(model, variables["params"], ctx, q)
    with pytest.raises(LiniclError, match="reference must be one of"):
        implicit.updates(model, variables, ctx[None], reference="token")
    lin = linicl.ModelConfig(vocab_size=16, d_model=4, n_heads=2, d_ff=8, n_layers=1, dtype="float64")
    lmodel, lvars = model_and_variables(lin, 0)
    with pytest.raises(LiniclError, match="iclca.strip"):
        implicit.convert(lmodel, iclca.convert(lmodel, lvars, ctx[None]), ctx, q)
    with pytest.raises(NotExactError, match="normalize=False"):
        implicit.context_term(lin, lvars["params"]["layers_0"], None, jnp.zeros(4))
    with pytest.raises(LiniclError, match="Y must index the context"):
        implicit.subcontext(cfg, variables["params"]["layers_0"], jnp.zeros((6, 4)), [5])


def test_no_mlp_bias_is_refused_except_for_the_plain_block():
    base = dict(vocab_size=16, d_model=4, n_heads=2, d_ff=8, n_layers=2, attention="softmax",
                mlp_bias=False, dtype="float64")
    ctx, q = tokens(0, 1, 5, 16)[0], tokens(1, 1, 1, 16)[0]
    model, variables = model_and_variables(linicl.ModelConfig(**base), 0)
    with pytest.raises(LiniclError, match=r"mlp_bias=True\); a zero bias is the same model"):
        implicit.convert(model, variables, ctx, q)
    # Dherin's plain block changes only W: no bias needed.
    model, variables = model_and_variables(linicl.ModelConfig(**base, norm="none", skip="none"), 0)
    patched = implicit.convert(model, variables, ctx, q)
    assert rel_err(apply(model, patched, q[None])[0, -1],
                   apply(model, variables, jnp.concatenate([ctx, q])[None])[0, -1]) <= EXACT_RTOL


def test_sandwich_is_refused():
    """Gemma's sandwich block normalises the MLP output before adding it: no rank-1 patch of the MLP
    reproduces the context there, so convert and the block functions refuse it by name."""
    cfg = linicl.ModelConfig(attention="softmax", norm="sandwich", norm_type="gemma_rmsnorm", mlp_bias=True,
                             n_layers=1, dtype="float64")
    model, variables = model_and_variables(cfg, 0)
    with pytest.raises(LiniclError, match="sandwich"):
        implicit.convert(model, variables, jnp.arange(3), jnp.arange(1))
    with pytest.raises(LiniclError, match="sandwich"):
        check_block_params(cfg, variables["params"]["layers_0"])

