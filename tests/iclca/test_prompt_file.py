"""A converted prompt is a file (``linicl.prompt_file``): converted in one process, queried in a fresh
one, the logits are identical; a file is refused for another model or other parameters."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import iclca, prompt_file
from linicl.errors import DataError
from helpers import REPO, init, tokens

QUERY = [[3, 1, 4, 1, 5]]


def _cases():
    soft = linicl.preset("tiny-softmax-rope", dtype="float64", n_kv_heads=2)
    lin = linicl.preset("tiny-linear-rope-decay", dtype="float64")
    return [
        ("selection", soft, lambda m, v, p: iclca.convert_approx(m, v, p, "none", keep=0.5, score="h2o", sinks=1,
                                                               window=2)),
        ("taylor2+sinks", soft, lambda m, v, p: iclca.convert_approx(m, v, p, "taylor2", sinks=2, window=3)),
        ("exact", lin, lambda m, v, p: iclca.convert(m, v, p)),
    ]


@pytest.mark.parametrize("name, cfg, convert", _cases(), ids=[c[0] for c in _cases()])
def test_a_prompt_file_queried_in_a_fresh_process_gives_identical_logits(tmp_path, name, cfg, convert):
    model, variables = init(cfg, 0)
    converted = convert(model, variables, tokens(0, 1, 23, cfg.vocab_size))
    path = prompt_file.save(tmp_path / "p.prompt", model, converted)
    want = np.asarray(model.apply(converted, jnp.asarray(QUERY)))
    np.save(tmp_path / "want.npy", want)
    script = f"""
import jax, numpy as np, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)  # as the test session (conftest.py) compiles
import sys; sys.path.insert(0, {str(REPO / 'tests')!r})
import linicl
from linicl import prompt_file
from helpers import init
model, variables = init(linicl.{cfg!r}, 0)
got = model.apply(prompt_file.load({str(path)!r}, model, variables), jnp.asarray({QUERY}))
assert np.array_equal(np.asarray(got), np.load({str(tmp_path / 'want.npy')!r})), "logits differ"
print("same")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(REPO))
    assert run.returncode == 0 and "same" in run.stdout, run.stderr[-2000:]
    # Power: the model without the stored prompt answers otherwise.
    assert not np.allclose(np.asarray(model.apply(variables, jnp.asarray(QUERY))), want)


def test_a_prompt_file_is_refused_for_another_model_or_other_parameters(tmp_path):
    cfg = linicl.preset("tiny-softmax-rope", dtype="float64", n_kv_heads=2)
    model, variables = init(cfg, 0)
    path = prompt_file.save(tmp_path / "p.prompt", model, iclca.convert_approx(
        model, variables, tokens(0, 1, 23, cfg.vocab_size), "none", keep=0.5, score="recent", sinks=1, window=2))
    _, other = init(cfg, 1)
    with pytest.raises(DataError, match="other settings .*params"):
        prompt_file.load(path, model, other)
    bigger = linicl.Transformer(cfg.replace(d_ff=cfg.d_ff * 2))
    with pytest.raises(DataError, match="other settings .*config"):
        prompt_file.load(path, bigger, bigger.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32)))
    with pytest.raises(linicl.LiniclError, match="holds no prompt"):
        prompt_file.save(tmp_path / "q.prompt", model, variables)
