"""In-context linear regression (Garg et al. style), the task of the implicit-update papers.

One task: w ~ N(0, I_{d_x}); inputs x_j ~ N(0, I_{d_x}); labels y_j = <w, x_j> (+ optional noise).
A sequence of N tokens holds N - 1 context pairs [x_j; y_j] and the query [x_q; 0]; the model's
prediction is the last coordinate of its last output token, and the loss is (1/2) mean (y_q - ŷ)².
Tokens are fed as continuous inputs (``model.apply(variables, embeds=tokens)``); with ``d_model``
larger than d_x + 1 they are zero-padded.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from linicl.errors import LiniclError


class Tasks(NamedTuple):
    tokens: jax.Array  # f[batch, N, d_model]: N - 1 pairs [x; y] then the query [x_q; 0]
    target: jax.Array  # f[batch]: y_q
    w: jax.Array       # f[batch, d_x]


def sample(key, batch: int, n_tokens: int, d_x: int, *, d_model: Optional[int] = None,
           noise: float = 0.0, dtype=jnp.float32) -> Tasks:
    """``batch`` fresh tasks of ``n_tokens`` tokens (``n_tokens - 1`` context pairs and the query)."""
    d_model = d_x + 1 if d_model is None else d_model
    if n_tokens < 1 or d_x < 1 or d_model < d_x + 1:
        raise LiniclError(f"need n_tokens >= 1, d_x >= 1 and d_model >= d_x + 1; got n_tokens={n_tokens}, "
                          f"d_x={d_x}, d_model={d_model}")
    kw, kx, kn = jax.random.split(key, 3)
    w = jax.random.normal(kw, (batch, d_x), dtype)
    x = jax.random.normal(kx, (batch, n_tokens, d_x), dtype)
    y = jnp.einsum("bnd,bd->bn", x, w) + noise * jax.random.normal(kn, (batch, n_tokens), dtype)
    labels = y.at[:, -1].set(0)  # the query's label slot is empty
    pad = jnp.zeros((batch, n_tokens, d_model - d_x - 1), dtype)
    return Tasks(jnp.concatenate([x, labels[..., None], pad], axis=-1), y[:, -1], w)


def readout(out: jax.Array, d_x: int) -> jax.Array:
    """The prediction: the label coordinate (index d_x; the last one without padding) of the last
    token. ``out: f[..., N, d_model]`` -> ``f[...]``."""
    return out[..., -1, d_x]


def loss(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """(1/2) mean squared error."""
    return 0.5 * jnp.mean(jnp.square(prediction - target))


def numpy_init(model, example_embeds, seed: int = 0) -> dict:
    """Variables for ``model`` drawn with NumPy from the parameter shapes (``jax.eval_shape``), with
    Flax's default distributions: kernels lecun-normal (truncated at 2 sigma, variance 1/fan_in),
    biases 0, norm scales 1, embeddings N(0, 0.02²). ``jax.jit(model.init)`` compiles the forward
    pass and the random generator for every parameter (seconds on a CPU); this takes milliseconds
    and compiles nothing (``example_embeds`` may be a ``jax.ShapeDtypeStruct``).
    """
    import numpy as np

    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), embeds=x), example_embeds)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        keys = [getattr(k, "key", "") for k in path]
        name, parent = keys[-1], keys[-2] if len(keys) > 1 else ""
        if name == "kernel":
            fan_in = leaf.shape[0] if parent in ("q", "k", "v") else int(np.prod(leaf.shape[:-1]))
            x = rng.standard_normal(leaf.shape)
            while np.any(bad := np.abs(x) > 2):   # truncated normal by rejection
                x[bad] = rng.standard_normal(int(bad.sum()))
            x = x / 0.87962566103423978 / np.sqrt(fan_in)  # std of N(0, 1) truncated at +-2
        elif name == "scale":
            x = np.ones(leaf.shape)
        elif name in ("embed", "pos_embed"):
            x = 0.02 * rng.standard_normal(leaf.shape)
        else:
            x = np.zeros(leaf.shape)
        return jax.device_put(np.asarray(x, leaf.dtype))  # cast by NumPy, copied as is: nothing to compile
    return jax.tree_util.tree_map_with_path(draw, shapes)
