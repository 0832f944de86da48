"""Indices and positions given to linicl.implicit are checked, never clamped, wrapped or truncated:
an eager call raises a LiniclError naming the argument; under jit, where values are unknown, an
index out of range gives NaN (never the finite result for another context or position)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import implicit
from linicl.errors import LiniclError
from helpers import EXACT_RTOL, rel_err

N = 3  # context tokens: Z = [C; x] has N + 1 rows
CFG = linicl.ModelConfig(vocab_size=16, d_model=4, n_heads=2, d_ff=8, n_layers=1, max_len=16,
                         attention="softmax", positions="rope", dtype="float64")


@functools.lru_cache(maxsize=None)
def _setup():
    """A model, its variables, one block's params and block inputs ``Z: f[N + 1, d]`` (NumPy draws)."""
    model = linicl.Transformer(CFG)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), s.dtype), shapes["params"])
    Z = jnp.asarray(rng.standard_normal((N + 1, CFG.d_model)))
    return model, {"params": params}, params["layers_0"], Z


@functools.lru_cache(maxsize=None)
def _traj_out():
    """The trajectory's outputs for an order passed as an argument (traced under jit)."""
    _, _, bp, Z = _setup()
    return jax.jit(lambda order: implicit.trajectory(CFG, bp, Z, order=order).out)


# ------------------------------------------------------------------------------------ trajectory
@pytest.mark.parametrize("order, match", [
    ([0, 1, 7], r"order must index the context C once each .*entries in \[0, 3\), got \[7\]"),
    ([0, 1, -1], r"entries in \[0, 3\), got \[-1\]"),
    ([0, 0, 1], r"order must index .* it repeats \[0\] \(and so misses \[2\]\)"),
    ([0, 1], r"order must be int\[3\]"),
    ([[0, 1, 2]], r"order must be int\[3\]"),
    ([0.0, 1.0, 2.0], "order must hold ints"),
    ([True, False, True], "order must hold ints"),
    ([[0], [1, 2]], "order must be a 1-d list of ints"),
])
def test_trajectory_order_must_be_a_permutation_of_the_context(order, match):
    """Before: [0, 1, 7] was clamped to [0, 1, 2] and [0, 0, 1] read c_1 twice, both finite."""
    _, _, bp, Z = _setup()
    with pytest.raises(LiniclError, match=match):
        implicit.trajectory(CFG, bp, Z, order=order)


@pytest.mark.parametrize("position", [2.5, 2.0, np.float32(1.0), True, -1, 16, jnp.zeros(1, jnp.int32), "0"])
def test_trajectory_position_must_be_an_int_position_of_the_model(position):
    """Before: 2.5 was truncated to 2, True read as 1."""
    _, _, bp, Z = _setup()
    with pytest.raises(LiniclError, match="position must"):
        implicit.trajectory(CFG, bp, Z, position=position)


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_trajectory_chunk_must_be_a_positive_int(chunk):
    """Before: chunk=0 ran unbatched, -1 and 2.5 failed inside jax.lax.map with a bare TypeError."""
    _, _, bp, Z = _setup()
    with pytest.raises(LiniclError, match="chunk must be None or a positive int"):
        implicit.trajectory(CFG, bp, Z, chunk=chunk)


def test_trajectory_accepts_any_int_kind_and_a_traced_bad_order_is_nan():
    _, _, bp, Z = _setup()
    order = [2, 0, 1]
    want = implicit.trajectory(CFG, bp, Z, order=order).out
    assert np.all(np.isfinite(want))
    for o in (np.asarray(order), jnp.asarray(order, jnp.int32), tuple(np.int64(i) for i in order)):
        assert rel_err(implicit.trajectory(CFG, bp, Z, order=o, position=np.int64(3)).out, want) <= EXACT_RTOL
    run = _traj_out()
    assert rel_err(run(jnp.asarray(order)), want) <= EXACT_RTOL
    for bad in ([0, 1, 7], [0, 0, 1], [-1, 0, 1]):
        assert np.all(np.isnan(run(jnp.asarray(bad)))), bad


def test_gradient_step_must_be_in_one_to_n():
    """Before: i = 0 wrapped to g_n - g_0 and i = n + 1 was clamped to n (both finite)."""
    _, _, bp, Z = _setup()
    traj = implicit.trajectory(CFG, bp, Z)
    for i in (0, N + 1, -1, 1.0, True):
        with pytest.raises(LiniclError, match=r"i must .*a step 1\.\.3 of the trajectory"):
            implicit.gradient(CFG, bp, traj, i)
    grad = jax.jit(lambda i: implicit.gradient(CFG, bp, traj, i)["fc_in"])
    assert rel_err(grad(jnp.asarray(2)), implicit.gradient(CFG, bp, traj, np.int32(2))["fc_in"]) <= EXACT_RTOL
    for i in (0, N + 1, -1):
        assert np.all(np.isnan(grad(jnp.asarray(i)))), i


def test_subcontext_indices_must_be_ints_of_the_context():
    """Before: [0.5] was truncated to [0] and a bool mask [True, False, True] read as indices [1, 0, 1]."""
    _, _, bp, Z = _setup()
    for Y, match in (([0.5], "Y must hold ints"), ([True, False, True], "Y must hold ints"),
                     ([N], r"Y must index the context C \(3 tokens\): entries in \[0, 3\), got \[3\]"),
                     ([[0], [1, 2]], "Y must be a 1-d list of ints"), ([[0, 1]], "Y must be a 1-d list")):
        with pytest.raises(LiniclError, match=match):
            implicit.subcontext(CFG, bp, Z, Y)
    # A set (repeats are harmless), a range, one int and an int array name the same sub-context.
    want, _ = implicit.subcontext(CFG, bp, Z, [0, 2])
    for Y in ({0, 2}, [2, 0, 2], np.asarray([0, 2]), jnp.asarray([0, 2])):
        assert rel_err(implicit.subcontext(CFG, bp, Z, Y)[0].f, want.f) <= EXACT_RTOL
    one = implicit.subcontext(CFG, bp, Z, 1)[0].f
    assert rel_err(one, implicit.subcontext(CFG, bp, Z, range(1, 2))[0].f) <= EXACT_RTOL


# ------------------------------------------------------------------------------------ blocks, updates
def test_block_positions_and_the_position_alone_are_checked():
    _, _, bp, Z = _setup()
    for positions, match in (([0, 1.5, 2, 3], "positions must hold ints"),
                             ([0, 1, 2], r"positions must be int\[4\]"),
                             ([0, 1, 2, 16], r"positions must index the model's positions \(max_len=16\)"),
                             ([-1, 0, 1, 2], r"entries in \[0, 16\), got \[-1\]")):
        with pytest.raises(LiniclError, match=match):
            implicit.block_sites(CFG, bp, Z, positions)
    for position in (0.5, True, -1, 16):
        with pytest.raises(LiniclError, match="position must"):
            implicit.alone(CFG, bp, Z[-1], position)
        with pytest.raises(LiniclError, match="position must"):
            implicit.pieces(CFG, bp, Z, position=position)


def test_update_at_refuses_positions_outside_the_update():
    """Before: a float index failed inside jnp.take; now every bad index names ``i``; traced: NaN."""
    _, _, bp, Z = _setup()
    upd = implicit.update(CFG, bp, implicit.pieces(CFG, bp, Z))
    T = N + 1
    for i in (T, -T - 1, 1.0, True):
        with pytest.raises(LiniclError, match=r"i must .*the 4 positions of the update"):
            upd.at(i)
    last = upd.at(-1)
    assert rel_err(last.delta_b, upd.at(T - 1).delta_b) <= EXACT_RTOL
    at = jax.jit(lambda i: upd.at(i).u["fc_in"])
    assert rel_err(at(jnp.asarray(1)), upd.at(1).u["fc_in"]) <= EXACT_RTOL
    for i in (T, -T - 1):
        assert np.all(np.isnan(at(jnp.asarray(i)))), i
    with pytest.raises(LiniclError, match="position must"):
        implicit.implied(CFG, bp, upd, Z[-1:], position=1.5)


# ------------------------------------------------------------------------------------ convert
def test_convert_position_is_an_int_never_truncated():
    """Before: position=2.5 converted for token 2 and position=True for token 1."""
    model, variables, _, _ = _setup()
    ctx, q = jnp.asarray([3, 5, 7], jnp.int32), jnp.asarray([1], jnp.int32)
    for position in (2.5, 2.0, True, np.float64(1.0), jnp.zeros(2, jnp.int32)):
        with pytest.raises(LiniclError, match=r"position must be one int indexing the 4 tokens"):
            implicit.convert(model, variables, ctx, q, position=position)
    with pytest.raises(LiniclError, match=r"position must index the 4 tokens of \[context; query\]"):
        implicit.convert_edits(model, variables, ctx, q, position=-5)
    a = implicit.convert(model, variables, ctx, q, position=np.int64(2))
    b = implicit.convert(model, variables, ctx, q, position=-2)
    kernel = lambda v: v["params"]["layers_0"]["mlp"]["fc_in"]["kernel"]  # noqa: E731
    assert rel_err(kernel(a), kernel(b)) <= EXACT_RTOL


# ------------------------------------------------------------------------------------ block params
def test_block_functions_name_the_whole_params_tree_instead_of_one_block():
    """Before: Flax's ScopeParamNotFoundError ("Could not find parameter named scale in /ln1")."""
    _, variables, bp, Z = _setup()
    with pytest.raises(LiniclError, match=r"got the whole model's params .*variables\['params'\]\['layers_0'\]"):
        implicit.trajectory(CFG, variables["params"], Z)
    with pytest.raises(LiniclError, match=r"block_params must be one block's params .*got list"):
        implicit.trajectory(CFG, [bp], Z)


def test_block_functions_name_params_of_another_config():
    """A block of a wider model (d_ff 8 -> 16) is refused by shape, naming the first mismatches."""
    _, _, bp, Z = _setup()
    wider = CFG.replace(d_ff=16)
    with pytest.raises(LiniclError, match=r"not one block of this config's model: shapes \['mlp'\]"):
        implicit.trajectory(wider, bp, Z)
    sub = {k: v for k, v in bp.items() if k != "mlp"}
    with pytest.raises(LiniclError, match=r"missing \[\"\['mlp'\]"):
        implicit.block_sites(CFG, sub, Z)
