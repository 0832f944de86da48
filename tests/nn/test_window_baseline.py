"""feature_map="none": a hybrid layer with no linear part is softmax over its sinks and window alone
(the StreamingLLM baseline, ``linearize.window_config``): equal to a teacher whose attention scores are
masked outside sinks + window (an independent construction through the interventions), converts
exactly, and bad combinations are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca, linearize
from linicl.errors import ConfigError, LiniclError
from linicl.interventions import add
from helpers import BASELINE_MIN, EXACT_RTOL, apply, init, prompt_and_query, rel_err

TEACHER = linicl.ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32,
                             max_len=64, attention="softmax", positions="rope", norm_type="rmsnorm",
                             mlp="gated", dtype="float64", attn_eps=0.0)  # eps 0: the gates cancel exactly


def _mask(T: int, window: int, sinks: int) -> np.ndarray:
    """0 where key i is visible to query t (i <= t and (i < sinks or t - i < window)), -inf elsewhere."""
    t, i = np.arange(T)[:, None], np.arange(T)[None, :]
    keep = (i <= t) & ((i < sinks) | (t - i < window))
    return np.where(keep, 0.0, -np.inf)


@pytest.mark.parametrize("window, sinks", [(3, 1), (5, 0), (1, 2)])
def test_window_baseline_is_the_teacher_with_masked_scores(window, sinks):
    teacher, tv = init(TEACHER, 0)
    base = linicl.Transformer(linearize.window_config(TEACHER, window=window, sinks=sinks))
    bv = linearize.student_variables(base, tv)
    x = jax.random.randint(jax.random.PRNGKey(1), (2, 20), 0, 32)
    mask = jnp.asarray(_mask(20, window, sinks))[None, None]
    edits = [add(f"blocks.{layer}.attn.hook_attn_scores", mask) for layer in range(TEACHER.n_layers)]
    masked = teacher.apply(linicl.interventions.with_edits(tv, edits, TEACHER), x)
    # The window gate g = 1/2 cancels between numerator and denominator (attn_eps = 0 here): only the
    # order of the sums differs.
    assert rel_err(base.apply(bv, x), masked) <= EXACT_RTOL
    assert rel_err(teacher.apply(tv, x), masked) >= 1e-3  # power: the mask matters at 20 tokens


def test_window_baseline_converts_exactly():
    teacher, tv = init(TEACHER, 0)
    base = linicl.Transformer(linearize.window_config(TEACHER, window=4, sinks=2))
    bv = linearize.student_variables(base, tv)
    prompt, query = prompt_and_query(3, 1, 11, 2, 5, 32)
    full = jnp.concatenate([jnp.repeat(prompt, 2, 0), query], 1)
    ref = apply(base, bv, full)[:, 11:]
    conv = iclca.convert(base, bv, prompt)
    assert rel_err(apply(base, conv, query), ref) <= EXACT_RTOL
    assert rel_err(apply(base, bv, query), ref) >= BASELINE_MIN


@pytest.mark.parametrize("changes, match", [
    (dict(attention="linear", feature_map="none"), "feature_map='none' .* needs attention='linear' with window"),
    (dict(attention="linear", feature_map="none", window=2, positions="rope"), "rope_on='inputs'"),
])
def test_no_linear_part_needs_a_window_and_rope_on_the_inputs(changes, match):
    with pytest.raises(ConfigError, match=match):
        linicl.ModelConfig(vocab_size=8, d_model=8, n_heads=2, d_ff=8, n_layers=1, **changes)
    with pytest.raises(LiniclError, match="softmax teacher"):
        linearize.window_config(linicl.ModelConfig(vocab_size=8, d_model=8, n_heads=2, d_ff=8, n_layers=1,
                                                   attention="linear"), window=2)
