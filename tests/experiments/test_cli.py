"""The main job and the benchmark run in their quick modes and write every number; the README's
example does what it says."""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from linicl import cli
from helpers import REPO

ROOT = REPO


def test_verify_quick_covers_the_zoo_and_passes(tmp_path, capsys):
    assert cli.main(["verify", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    report = json.loads((tmp_path / "verify.json").read_text())
    rows = report["models"]
    linear = {k: r for k, r in rows.items() if "err_f64" in r}
    assert len(linear) >= 12 and report["all_ok"]
    assert max(r["err_f64"] for r in linear.values()) <= 1e-12
    assert min(r["err_no_prompt"] for r in linear.values()) >= 1e-3
    configs = " ".join(r["config"] for r in rows.values())
    for option in ("elu+1", "relu", "identity", "taylor2", "unnorm", "decay=", "per-head", "pos=none",
                   "pos=learned", "pos=rope", "pre-LN", "post-LN", "trainable-bias", "softmax"):
        assert option in configs, option
    assert "err f64" in capsys.readouterr().out


def test_verify_threads_change_no_number():
    """Models checked side by side (the compile-bound part of a run, in threads) give the same rows,
    in zoo order, as one at a time: each model's programs and seed are its own."""
    from linicl import verify
    names = ["elu-rope", "gemma-local8-scalar-gate", "softmax-rope"]
    common = dict(quick=True, progress=False, names=names, timings=False)
    one, two = verify.run(workers=1, **common), verify.run(workers=3, **common)
    assert list(one["models"]) == list(two["models"]) == names
    assert one["models"] == two["models"] and one["all_ok"]


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "linicl.cli", "verify", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--quick" in out.stdout


def test_benchmark_quick_writes_json_and_plot(tmp_path):
    script = ROOT / "experiments" / "benchmarks" / "iclca_speed.py"
    assert subprocess.run([sys.executable, str(script), "--help"], capture_output=True).returncode == 0
    run = subprocess.run([sys.executable, str(script), "--quick", "--repeats", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "iclca_speed.json").read_text())
    assert {r["prompt_len"] for r in report["conversion"]} == {256, 512}
    assert all(r["query_speedup"] > 0 for r in report["conversion"])
    assert (tmp_path / "iclca_speed.png").stat().st_size > 0


def test_readme_example_runs_and_holds():
    block = re.search(r"## The contract\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    scope = {}
    exec(block, scope)
    model, converted, variables = scope["model"], scope["converted"], scope["variables"]
    prompt, query = scope["prompt"], scope["query"]
    forward = jax.jit(model.apply)
    a = forward(converted, query)
    b = forward(variables, jnp.concatenate([jnp.repeat(prompt, 2, 0), query], 1))[:, 5:]
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))  # a float32 model: float32 rounding
