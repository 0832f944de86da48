"""experiments/benchmarks/lm_speed.py runs and reports what it should (no timing is asserted).

The quick mode runs in a subprocess: a tiny GPT-2 and, standing in for SmolLM2 (``LINICL_SMOLLM2_GGUF``)
and Gemma 3 (``LINICL_GEMMA3_GGUF``), the tiny Llama and Gemma 3 GGUF fixtures, so that every code path runs in seconds. The JAX-only path always runs;
the PyTorch comparison runs in-process when torch and transformers are importable here, and through the
worker process when ``LINICL_TORCH_PYTHON`` names an interpreter that has them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, FIXTURES

ROOT = REPO
SCRIPT = ROOT / "experiments" / "benchmarks" / "lm_speed.py"
TINY_GGUF = FIXTURES / "llama-tiny.gguf"


def _has(*modules) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _run_quick(tmp_path: Path, *extra: str) -> dict:
    env = dict(os.environ, LINICL_SMOLLM2_GGUF=str(TINY_GGUF), LINICL_GEMMA3_GGUF=str(FIXTURES / "gemma3-tiny.gguf"),
               HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--load-repeats", "1", "--out", str(tmp_path),
                          *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert (tmp_path / "lm_speed.png").stat().st_size > 0
    return json.loads((tmp_path / "lm_speed.json").read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_jax_side(report: dict) -> None:
    gpt2, smol = report["gpt2"], report["smollm2"]
    assert gpt2["config"]["n_layer"] == 2 and report["quick"] is True
    assert [[r["batch"], r["seq"]] for r in gpt2["shapes"]] == report["shapes"]
    for part in (gpt2, smol):
        for row in part["shapes"]:
            assert _positive(row["jax_tokens_per_s"]) and _positive(row["jax_s"])
            assert len(row["rounds"]) == report["rounds"] == 1
    assert smol["gguf"] == str(TINY_GGUF)
    assert _positive(smol["load"]["load_s_median"]) and _positive(smol["in_process_load_s"])
    assert _positive(smol["decode"]["step_tokens_per_s"])
    assert report["targets"]["smollm2_load"]["seconds"] == smol["load"]["load_s_median"]


def _check_torch_side(part: dict) -> None:
    assert part["logits_check"]["max_rel_err"] < 1e-4  # float32 against float32 (measured ~1e-6)
    assert part["logits_check"]["argmax_agreement"] > 0.9
    for row in part["shapes"]:
        assert _positive(row["torch_eager_tokens_per_s"]) and _positive(row["jax_over_torch_eager"])
    if "decode" in part:  # SmolLM2
        assert _positive(part["decode"]["torch_eager_step_tokens_per_s"])


def test_help():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--torch-python" in run.stdout and "--quick" in run.stdout


def test_quick_jax_only(tmp_path):
    report = _run_quick(tmp_path, "--no-torch")
    _check_jax_side(report)
    assert report["torch"]["how"].startswith("skipped")
    assert not any(k.startswith("torch_") for r in report["gpt2"]["shapes"] for k in r)
    assert report["gpt2"]["checkpoint"]["source"].startswith("numpy")
    gemma = report["gemma3"]  # the tiny Gemma 3 stands in: its forward against its matmul peer
    assert [r["batch"] * r["seq"] for r in gemma["shapes"]] == [r["tokens"] for r in gemma["shapes"]]
    assert all(_positive(r["jax_over_matmul"]) for r in gemma["shapes"])
    assert set(report["targets"]) >= {f"gemma3_{r['batch']}x{r['seq']}_matmul_share" for r in gemma["shapes"]}


@pytest.mark.skipif(not _has("torch", "transformers"), reason="torch + transformers are not importable here")
def test_quick_with_torch_in_process(tmp_path):
    report = _run_quick(tmp_path)
    _check_jax_side(report)
    assert report["torch"]["how"] == "in-process"
    _check_torch_side(report["gpt2"])
    _check_torch_side(report["smollm2"])
    _check_torch_side(report["gemma3"])  # Gemma3ForCausalLM on linicl.lm.save_pretrained's export


@pytest.mark.skipif(not os.environ.get("LINICL_TORCH_PYTHON"),
                    reason="set LINICL_TORCH_PYTHON to a Python with torch + transformers")
def test_quick_with_torch_worker(tmp_path):
    python = os.environ["LINICL_TORCH_PYTHON"]
    report = _run_quick(tmp_path, "--torch-python", python)
    _check_jax_side(report)
    if _has("torch", "transformers"):  # in-process wins when importable
        assert report["torch"]["how"] == "in-process"
    else:
        assert report["torch"]["how"] == f"worker process: {python}"
    _check_torch_side(report["gpt2"])
    _check_torch_side(report["smollm2"])
    _check_torch_side(report["gemma3"])  # Gemma3ForCausalLM on linicl.lm.save_pretrained's export
