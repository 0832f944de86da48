"""In-context linear regression data (linicl.data.synthetic.regression_batch, regression_embeds): shapes
and dtypes, y = w . x with no noise (and the noise's size when there is some), the interleaved x / y
token layout, determinism, jit and vmap, and errors that name the argument."""

import functools

import jax
import numpy as np
import pytest

from linicl.data.synthetic import RegressionBatch, regression_batch, regression_embeds
from linicl.errors import LiniclError

KEY = jax.random.PRNGKey(0)


def as64(b: RegressionBatch):
    return [np.asarray(a, np.float64) for a in b]


@pytest.mark.parametrize("batch,n,d_x", [(1, 1, 1), (3, 5, 4), (2, 16, 8)])
def test_shapes_dtypes_and_noise_free_labels(batch, n, d_x):
    b = regression_batch(KEY, batch, n, d_x)
    assert isinstance(b, RegressionBatch)
    assert b.xs.shape == (batch, n, d_x) and b.ys.shape == (batch, n) and b.w.shape == (batch, d_x)
    assert b.xs.dtype == b.ys.dtype == b.w.dtype == np.float32          # also under x64 (conftest)
    xs, ys, w = as64(b)
    # y = w . x: the float32 dot product, up to its rounding only
    np.testing.assert_allclose(ys, np.einsum("bnd,bd->bn", xs, w), rtol=0, atol=1e-5 * np.sqrt(d_x))


def test_standard_normal_inputs_weights_and_noise():
    xs, ys, w = as64(regression_batch(KEY, 4000, 4, 3, noise=0.5))
    assert abs(xs.mean()) < 0.02 and abs(xs.std() - 1) < 0.02 and abs(w.std() - 1) < 0.05
    residual = ys - np.einsum("bnd,bd->bn", xs, w)
    assert abs(residual.std() - 0.5) < 0.01                             # the noise's standard deviation
    assert abs(np.mean(ys ** 2) - 3.25) < 0.4                           # E[y^2] = d_x + noise^2
    # the same key without noise: the same x and w (the noise is drawn from its own key)
    x0, _, w0 = as64(regression_batch(KEY, 4000, 4, 3))
    np.testing.assert_array_equal(x0, xs)
    np.testing.assert_array_equal(w0, w)


def test_embeds_layout():
    b = regression_batch(KEY, 3, 4, 5)
    e = np.asarray(regression_embeds(b.xs, b.ys))
    xs, ys = np.asarray(b.xs), np.asarray(b.ys)
    assert e.shape == (3, 8, 6) and e.dtype == np.float32
    np.testing.assert_array_equal(e[:, 0::2, :5], xs)                   # x-tokens: [x, 0]
    np.testing.assert_array_equal(e[:, 0::2, 5], 0)
    np.testing.assert_array_equal(e[:, 1::2, :5], 0)                    # y-tokens: [0, ..., 0, y]
    np.testing.assert_array_equal(e[:, 1::2, 5], ys)
    # a prompt of k pairs is the first 2k tokens
    np.testing.assert_array_equal(np.asarray(regression_embeds(xs[:, :2], ys[:, :2])), e[:, :4])


def test_determinism_jit_and_vmap():
    gen = functools.partial(regression_batch, batch=2, n_examples=3, d_x=4)
    keys = jax.random.split(KEY, 3)
    eager = [gen(k) for k in keys]
    np.testing.assert_array_equal(gen(keys[0]).xs, eager[0].xs)
    assert not np.array_equal(eager[0].w, eager[1].w)
    jitted = jax.jit(gen)(keys[1])
    for a, b in zip(jitted, eager[1]):
        np.testing.assert_array_equal(a, b)
    stacked = jax.jit(jax.vmap(gen))(keys)
    assert stacked.xs.shape == (3, 2, 3, 4)
    for i in range(3):
        np.testing.assert_array_equal(stacked.ys[i], eager[i].ys)
    # a traced noise under jit
    noisy = jax.jit(lambda k, s: regression_batch(k, 2, 3, 4, noise=s))(KEY, 0.0)
    np.testing.assert_array_equal(noisy.ys, gen(KEY).ys)
    e = jax.jit(jax.vmap(regression_embeds))(stacked.xs, stacked.ys)
    np.testing.assert_array_equal(e[2], regression_embeds(eager[2].xs, eager[2].ys))


@pytest.mark.parametrize("args,kwargs,match", [
    ((0, 3, 2), {}, "batch must be at least 1"),
    ((2, 0, 2), {}, "n_examples must be at least 1"),
    ((2, 3, 0), {}, "d_x must be at least 1"),
    ((2, 3.0, 2), {}, "n_examples must be a Python int"),
    ((2, 3, np.int64(2)), {}, "d_x must be a Python int"),
    ((2, 3, 2), dict(noise=-0.1), "noise must be a finite"),
    ((2, 3, 2), dict(noise=float("nan")), "noise must be a finite"),
])
def test_batch_errors_name_the_argument(args, kwargs, match):
    with pytest.raises(LiniclError, match=match):
        regression_batch(KEY, *args, **kwargs)


def test_embeds_errors_name_the_argument():
    xs, ys = np.zeros((2, 3, 4)), np.zeros((2, 3))
    with pytest.raises(LiniclError, match="xs must be"):
        regression_embeds(xs[0], ys)
    with pytest.raises(LiniclError, match=r"ys must be f\[batch, n\] = \(2, 3\)"):
        regression_embeds(xs, ys[:, :2])
    with pytest.raises(LiniclError, match="ys must be"):
        regression_embeds(xs, ys[..., None])
