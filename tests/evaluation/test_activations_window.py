"""linicl.activations.logprobs_and_window: per row, in the rows' order, the last token's log-probs and a
window of a site's activations equal one unbatched, unpadded forward pass each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl.activations import logprobs_and_window
from linicl.errors import LiniclError
from linicl.interventions import capture
from linicl.names import block_site


def test_window_matches_one_pass_per_row():
    cfg = linicl.preset("tiny-llama", dtype="float64")
    model = linicl.Transformer(cfg)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in (5, 3, 7)]
    names = [block_site(layer, "hook_z") for layer in range(cfg.n_layers)]
    lp, z = logprobs_and_window(model, variables, rows, names, start=1, width=4, batch_size=2)
    assert lp.shape == (3, cfg.vocab_size) and z.shape == (cfg.n_layers, 3, 4, cfg.n_heads * cfg.head_dim)
    for i, row in enumerate(rows):
        h, acts = capture(model, variables, jnp.asarray(row[None]), names=names)
        np.testing.assert_allclose(lp[i], jax.nn.log_softmax(h[0, -1]), rtol=1e-5, atol=1e-5)
        real = min(4, len(row) - 1)                                   # the window's real positions
        for layer, name in enumerate(names):
            want = np.asarray(acts[name][0, 1:1 + real]).reshape(real, -1)
            np.testing.assert_allclose(z[layer, i, :real], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(LiniclError, match="rows"):
        logprobs_and_window(model, variables, [], names, start=0, width=1)
