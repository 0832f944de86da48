"""The short causal convolution kernel (``linicl.kernels.short_conv``): it is the documented sum, a
sequence run in pieces (each from the state the last left, pieces shorter than K - 1 included) is the
sequence run whole, and bad arguments are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from linicl.kernels.short_conv import short_conv, zero_state
from helpers import EXACT_RTOL, examples, rel_err


def _numpy_conv(x, w, state, activation):
    """y_t[c] = act(sum_j w[j, c] x_{t-K+1+j}[c]) with x_{<0} from ``state``, by direct loops."""
    K, (B, T) = w.shape[0], x.shape[:2]
    xs = np.concatenate([state, x], axis=1)  # index t + K - 1 is x_t
    y = np.zeros_like(x)
    for b in range(B):
        for t in range(T):
            for j in range(K):
                y[b, t] += w[j] * xs[b, t + j]
    if activation == "silu":
        y = y / (1 + np.exp(-y))
    return y, xs[:, -(K - 1):]


def _random(seed, B, T, K, channels):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, T) + channels), rng.normal(size=(K,) + channels),
            rng.normal(size=(B, K - 1) + channels))


@examples(1.0)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 2), T=st.integers(1, 7), K=st.integers(2, 4),
       activation=st.sampled_from(["none", "silu"]), fresh=st.booleans())
def test_the_kernel_is_the_documented_sum(seed, B, T, K, activation, fresh):
    x, w, state = _random(seed, B, T, K, (2, 3))
    if fresh:
        state = np.zeros_like(state)
    y, final = short_conv(jnp.asarray(x), jnp.asarray(w), None if fresh else jnp.asarray(state), activation)
    y_ref, final_ref = _numpy_conv(x, w, state, activation)
    assert y.shape == x.shape and final.shape == state.shape
    assert rel_err(y, y_ref) <= EXACT_RTOL
    np.testing.assert_array_equal(final, final_ref)  # the state is a copy of inputs, not a sum
    # Power: the state reaches the first K - 1 outputs (and only them, without an activation's mixing).
    if not fresh:
        y0, _ = short_conv(jnp.asarray(x), jnp.asarray(w), None, activation)
        assert rel_err(y0, y_ref) >= 1e-3
        np.testing.assert_array_equal(y0[:, K - 1:], y[:, K - 1:])


@examples(1.0)
@given(seed=st.integers(0, 2**16), K=st.integers(2, 4),
       cuts=st.lists(st.integers(1, 4), min_size=1, max_size=4), activation=st.sampled_from(["none", "silu"]))
def test_pieces_from_the_carried_state_equal_the_whole(seed, K, cuts, activation):
    """Pieces of 1..4 tokens (shorter than K - 1 too: older state entries shift along)."""
    T = sum(cuts)
    x, w, state = _random(seed, 2, T, K, (3,))
    whole, final = short_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state), activation)
    carried, outs, start = jnp.asarray(state), [], 0
    for n in cuts:
        y, carried = short_conv(jnp.asarray(x[:, start:start + n]), jnp.asarray(w), carried, activation)
        outs.append(y)
        start += n
    assert rel_err(jnp.concatenate(outs, axis=1), whole) <= EXACT_RTOL
    np.testing.assert_array_equal(carried, final)


def test_identity_taps_pass_the_input_and_a_batch_1_state_serves_any_batch():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2))
    w = jnp.zeros((3, 2)).at[-1].set(1.0)
    y, final = short_conv(x, w, jnp.ones((1, 2, 2)))
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(final, x[:, -2:])
    assert zero_state(2, 4, (3, 5), jnp.float64).shape == (2, 3, 3, 5)


@pytest.mark.parametrize("kwargs, says", [
    (dict(w=jnp.ones((1, 2))), "at least 2 taps"),
    (dict(w=jnp.ones((3, 4))), "does not match"),
    (dict(activation="gelu"), "activation must be one of"),
])
def test_bad_arguments_are_refused(kwargs, says):
    args = dict(x=jnp.ones((1, 4, 2)), w=jnp.ones((3, 2)), state=None, activation="none")
    with pytest.raises(ValueError, match=says):
        short_conv(**{**args, **kwargs})
