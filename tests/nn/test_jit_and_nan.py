"""Conversion and generation under ``jax.jit`` for every position scheme, and no NaN ever passed off
as a token id or a fit.

Under ``jit`` values cannot be checked eagerly: the offset of converted variables must travel as an
array (not a Python int), and logits that are not finite must come out as the documented -1
(``linicl.generation.FAILED``), never as token 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import linicl
from linicl import iclca
from linicl.errors import LiniclError
from linicl.generation import FAILED
from linicl.nn.transformer import position_offset
from helpers import BASELINE_MIN, EXACT_RTOL, apply, init, prompt_and_query, rel_err, tokens


def _cfg(**changes) -> linicl.ModelConfig:
    base = dict(vocab_size=24, d_model=8, n_layers=1, n_heads=2, d_ff=8, max_len=32, dtype="float64")
    return linicl.ModelConfig(**{**base, **changes})


# Every position scheme (names.POSITIONS, and rope on the features or the inputs), plus a window and
# sinks (absolute positions through the exact part: the offset is kept).
LINEAR = {
    "none": _cfg(positions="none"),
    "learned": _cfg(positions="learned"),
    "rope-features": _cfg(positions="rope"),
    "rope-inputs": _cfg(positions="rope", rope_on="inputs"),
    "window-sinks": _cfg(positions="rope", window=2, sinks=1),
}
SOFTMAX = {name: _cfg(attention="softmax", positions=name) for name in ("none", "learned", "rope")}


def _same_tree(a, b, rtol: float = EXACT_RTOL) -> None:
    """Same structure, and every leaf equal up to ``rtol`` (normwise; all-zero leaves exactly)."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.shape(x) == np.shape(y)
        if np.any(np.asarray(y) != 0):
            assert rel_err(x, y) <= rtol
        else:
            assert not np.any(np.asarray(x))


def _prompted(model, variables, prompt, query):
    n = prompt.shape[1]
    full = jnp.concatenate([jnp.broadcast_to(prompt, (query.shape[0], n)), query], axis=1)
    return apply(model, variables, full)[:, n:]


# ------------------------------------------------------------------------------ offset under jit
@pytest.mark.parametrize("name", sorted(LINEAR))
def test_convert_and_generate_under_jit_equal_eager(name):
    cfg = LINEAR[name]
    model, variables = init(cfg, seed=3)
    p1, query = prompt_and_query(5, 1, 5, 2, 4, cfg.vocab_size)
    p2 = tokens(7, 1, 4, cfg.vocab_size, low=cfg.vocab_size // 2)
    convert = jax.jit(lambda v, p: iclca.convert(model, v, p))

    # Converting converted (traced) variables again reads the stored offset inside the trace.
    once = convert(variables, p1)
    twice = convert(once, p2)
    _same_tree(once, iclca.convert(model, variables, p1))
    _same_tree(twice, iclca.convert(model, iclca.convert(model, variables, p1), p2))
    expected = 9 if cfg.keeps_offset else 0  # an int32 array, read as a number
    assert int(position_offset(twice)) == expected

    # The ICLCA identity, everything under jit.
    both = jnp.concatenate([p1, p2], axis=1)
    reference = _prompted(model, variables, both, query)
    assert rel_err(jax.jit(model.apply)(twice, query), reference) <= EXACT_RTOL
    assert rel_err(apply(model, variables, query), reference) >= BASELINE_MIN  # power

    # Sampled generation from converted (traced) variables: the eager call's tokens.
    key = jax.random.PRNGKey(11)
    out = jax.jit(lambda v, t, k: linicl.generate(model, v, t, 3, key=k))(twice, query, key)
    assert np.array_equal(out, linicl.generate(model, twice, query, 3, key=key))
    assert np.all(np.asarray(out) >= 0)


@pytest.mark.parametrize("name", sorted(SOFTMAX))
@pytest.mark.parametrize("options", [{"sinks": 6}, {"kernel": "prf", "n_features": 8, "sinks": 2},
                                     {"fit_inputs": "sample"}], ids=["all-sinks", "prf", "fit"])
def test_convert_approx_and_generate_under_jit_equal_eager(name, options):
    cfg = SOFTMAX[name]
    model, variables = init(cfg, seed=4)
    prompt, query = prompt_and_query(6, 1, 6, 2, 3, cfg.vocab_size)
    if options.get("fit_inputs") == "sample":
        options = {"fit_inputs": tokens(8, 4, 5, cfg.vocab_size)}
    eager = iclca.convert_approx(model, variables, prompt, **options)
    traced = jax.jit(lambda v, p: iclca.convert_approx(model, v, p, **options))(variables, prompt)
    # A fit is solved in NumPy eagerly and by jnp.linalg under jit: the ridge (1e-6 of the mean
    # diagonal) bounds the normal equations' condition number by ~1e6, which may amplify the
    # rounding of either solve (1e-16) to ~1e-10. Every other leaf is the same computation.
    _same_tree(traced, eager, 1e-9 if "fit_inputs" in options else EXACT_RTOL)
    assert int(position_offset(traced)) == 6
    out = jax.jit(lambda v, t: linicl.generate(model, v, t, 3))(traced, query)
    assert np.array_equal(out, linicl.generate(model, eager, query, 3))
    if options.get("sinks") == 6:  # the whole prompt kept exact: the conversion is exact
        logits = jax.jit(model.apply)(traced, query)
        assert rel_err(logits, _prompted(model, variables, prompt, query)) <= EXACT_RTOL


# ------------------------------------------------------------------------------ NaN logits
def _converted_learned(max_len: int = 32, **changes):
    cfg = _cfg(positions="learned", max_len=max_len, **changes)
    model, variables = init(cfg, seed=1)
    return cfg, model, iclca.convert(model, variables, tokens(2, 1, 5, cfg.vocab_size))


def test_eager_out_of_range_tokens_raise_naming_tokens_and_the_range():
    cfg, model, converted = _converted_learned()
    for bad in ([[99, 1]], [[1, -1]]):
        with pytest.raises(LiniclError, match=r"tokens holds token ids .* outside the vocabulary \[0, 24\)"):
            linicl.generate(model, converted, jnp.array(bad, jnp.int32), 3)
    with pytest.raises(LiniclError, match=r"prompt holds token ids .* \[0, 24\)"):
        iclca.convert(model, converted, jnp.array([[24]], jnp.int32))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_under_jit_out_of_range_tokens_give_failed_rows_not_token_zero(sampled):
    cfg, model, converted = _converted_learned()
    key = jax.random.PRNGKey(0) if sampled else None
    gen = jax.jit(lambda t: linicl.generate(model, converted, t, 3, key=key))
    out = np.asarray(gen(jnp.array([[99, 1], [1, 2]], jnp.int32)))
    assert np.all(out[0] == FAILED)
    # The good row is untouched (rows never mix) and is what the eager call gives.
    good = linicl.generate(model, converted, jnp.array([[1, 2]], jnp.int32), 3, key=key)
    if not sampled:  # a sampled row depends on the batch's shape through the per-row Gumbel noise
        assert np.array_equal(out[1:], good)
    assert np.all(out[1] >= 0)
    # checkify turns the failure into an error with the reason.
    err, _ = checkify.checkify(gen)(jnp.array([[99, 1]], jnp.int32))
    with pytest.raises(Exception, match="logits are not finite"):
        err.throw()
    err, _ = checkify.checkify(gen)(jnp.array([[3, 1]], jnp.int32))
    err.throw()  # no failure: no error


def test_under_jit_positions_past_max_len_fail_from_that_token_on():
    """Traced variables hide the offset from the eager check: the tokens fed back at positions
    >= max_len give NaN logits, so the tokens from there on are FAILED, the earlier ones exact."""
    cfg, model, converted = _converted_learned(max_len=8)  # offset 5
    query = tokens(3, 2, 2, cfg.vocab_size)  # positions 5, 6
    out = np.asarray(jax.jit(lambda v, t: linicl.generate(model, v, t, 4))(converted, query))
    assert np.array_equal(out[:, :2], linicl.generate(model, converted, query, 2))  # fed back at 7
    assert np.all(out[:, 2:] == FAILED)  # the third new token would need position 8


def test_eager_non_finite_logits_raise():
    cfg, model, converted = _converted_learned(tie_embeddings=False)  # NaN in one row's input only
    params = jax.tree_util.tree_map(lambda x: x, converted["params"])
    params["embed"] = params["embed"].at[4].set(jnp.nan)
    broken = {**converted, "params": params}
    with pytest.raises(LiniclError, match=r"logits are not finite .*batch rows \[1\]"):
        linicl.generate(model, broken, jnp.array([[1, 2], [4, 2]], jnp.int32), 2)


# ------------------------------------------------------------------------------ convert_approx arguments
@pytest.mark.parametrize("options, match", [
    ({"kernel": "prf", "n_features": 0}, "n_features must be a positive int"),
    ({"kernel": "prf", "n_features": -3}, "n_features must be a positive int"),
    ({"kernel": "prf", "n_features": 2.0}, "n_features must be a positive int"),
    ({"ridge": -1.0}, "ridge must be a finite number >= 0"),
    ({"ridge": float("nan")}, "ridge must be a finite number >= 0"),
    ({"ridge": "1e-3"}, "ridge must be a finite number >= 0"),
])
def test_convert_approx_refuses_bad_n_features_and_ridge(options, match):
    cfg = SOFTMAX["rope"]
    model, variables = init(cfg)
    prompt = tokens(0, 1, 4, cfg.vocab_size)
    with pytest.raises(LiniclError, match=match):
        iclca.convert_approx(model, variables, prompt, fit_inputs=tokens(1, 2, 3, cfg.vocab_size), **options)


@pytest.mark.parametrize("kernel", ["taylor2", "elu+1"])
def test_a_singular_fit_says_so_and_suggests_a_ridge(kernel):
    """One query row cannot determine a weight per feature: with ridge=0 the normal equations are
    singular. Eagerly a LiniclError; under jit non-finite bias terms and a checkify error."""
    cfg = SOFTMAX["rope"]
    model, variables = init(cfg)
    prompt, sample = tokens(0, 1, 4, cfg.vocab_size), tokens(1, 1, 1, cfg.vocab_size)
    with pytest.raises(LiniclError, match=r"fit of layer 0 is singular .*ridge > 0"):
        iclca.convert_approx(model, variables, prompt, kernel=kernel, fit_inputs=sample, ridge=0.0)
    fit = jax.jit(lambda v: iclca.convert_approx(model, v, prompt, kernel=kernel, fit_inputs=sample, ridge=0.0))
    err, converted = checkify.checkify(fit)(variables)
    with pytest.raises(Exception, match="singular"):
        err.throw()
    assert not np.all(np.isfinite(converted["prompt_approx"]["layers_0"]["attn"]["approx"].B))
    # The default ridge makes the same fit well posed.
    iclca.convert_approx(model, variables, prompt, kernel=kernel, fit_inputs=sample)
