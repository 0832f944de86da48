"""experiments/approx_conversion.py: the quick mode runs end to end and writes every number.

The tiny Llama GGUF fixture stands in for SmolLM2 (``LINICL_SMOLLM2_GGUF``), so every code path runs in
seconds: its 97-token tokenizer cannot score sst2 (label words are not single tokens), which must be
recorded as skipped, while antonym (first-content-token accuracy) is scored. The run keeps every prompt token
as an exact sink in the sinks variant (``--sinks 1000``): that variant is then the exact prompted model,
which checks the alignment of positions, query tokens and attention outputs end to end.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import REPO
import linicl
import linicl.lm
from linicl.evaluate import evaluate

ROOT = REPO
SCRIPT = ROOT / "experiments" / "approx_conversion.py"
TINY_GGUF = ROOT / "tests" / "fixtures" / "hf" / "llama-tiny.gguf"
VARIANTS = ["taylor2", "prf", "elu+1", "lsq-prf", "taylor2+sinks1000", "taylor2-mix0.5"]


def _finite_numbers(x, where="report"):
    """Every number in a JSON tree is finite (None is allowed for 'not applicable')."""
    if isinstance(x, dict):
        for k, v in x.items():
            _finite_numbers(v, f"{where}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _finite_numbers(v, f"{where}[{i}]")
    elif isinstance(x, float):
        assert math.isfinite(x), where


def test_help():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert run.returncode == 0
    for flag in ("--quick", "--model", "--seed", "--out", "--data-dir", "--tasks", "--k", "--n-eval", "--no-progress"):
        assert flag in run.stdout


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_quick_run_writes_complete_json_and_plots(tmp_path):
    env = dict(os.environ, LINICL_SMOLLM2_GGUF=str(TINY_GGUF), JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--sinks", "1000",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, cwd=str(ROOT),
                         timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "approx_conversion.json").read_text())
    for png in ("accuracy.png", "kl.png", "layer_error.png", "synthetic.png"):
        assert (tmp_path / png).stat().st_size > 0
    _finite_numbers(report)
    assert report["quick"] and report["variants"] == VARIANTS
    assert report["model"]["n_layers"] == 2 and report["settings"]["k"] == [1]
    assert [s["task"] for s in report["skipped"]] == ["sst2"]
    assert "one distinct token" in report["skipped"][0]["reason"]

    entry = report["tasks"]["antonym"]
    cell = entry["k"]["1"]
    assert entry["n"] == 4 and entry["metric"] == "first_content_token" and cell["prompt_len"] > 0
    assert set(cell["methods"]) == {"zero", "prompt", *VARIANTS}
    for name, m in cell["methods"].items():
        assert m["accuracy"] == pytest.approx(sum(m["correct"]) / 4)
        assert m["ci_low"] <= m["accuracy"] <= m["ci_high"] and m["constant"] == (m["distinct"] == 1)
        if name != "prompt":
            assert m["kl_full_mean"] >= -1e-6 and len(m["layer_rel_err"]) == 2 == len(m["layer_rel_err_last"])
            assert 0.0 <= m["agree_with_prompt"] <= 1.0
    # Every prompt token kept exact: the prompted model itself, up to float32 rounding.
    exact = cell["methods"]["taylor2+sinks1000"]
    assert exact["predictions"] == cell["methods"]["prompt"]["predictions"]
    assert exact["kl_full_mean"] < 1e-6 and max(exact["layer_rel_err"]) < 1e-4
    # Dropping the prompt is far from the prompted model.
    assert max(cell["methods"]["zero"]["layer_rel_err"]) > 1e-2
    assert cell["methods"]["lsq-prf"]["state_floats"] > 0 and cell["fit_inputs_shape"][0] >= 1

    # The prompted and zero-shot accuracies are those of linicl.evaluate on the same prompts, scored
    # by the gold answer's first content token (after its blank prefix, if the tokenizer has one).
    model, variables, tok = linicl.lm.from_pretrained(TINY_GGUF, max_len=2048)
    task = linicl.data.load_task("antonym")
    for k, name in ((1, "prompt"), (0, "zero")):
        res = evaluate(model, variables, tok, task, k=k, n_eval=4, same_demos=True,
                       add_bos=report["settings"]["add_bos"], progress=False, open_metric="first_content_token")
        assert res.correct.astype(int).tolist() == cell["methods"][name]["correct"]
        assert res.pred_ids.tolist() == cell["methods"][name]["predictions"]

    rec = report["recovery"]
    assert set(rec["per_task_pooled"]) == {"antonym"} and isinstance(rec["target_met"], bool)
    pooled = rec["per_task_pooled"]["antonym"]
    assert set(pooled["fraction"]) == set(VARIANTS)
    assert pooled["gain"]["low"] <= pooled["gain"]["value"] <= pooled["gain"]["high"]
    if not pooled["significant"]:  # no share of a gain that may be zero
        assert all(f is None for f in pooled["fraction"].values())
    # the exact variant is the prompted model: no difference on any query
    assert pooled["vs_prompt"]["taylor2+sinks1000"] == dict(value=0.0, low=0.0, high=0.0)
    assert report["settings"]["bos"] == "auto" and report["settings"]["add_bos"] is False

    syn = report["synthetic"]
    assert syn["settings"]["pairs"] == 4 and not syn["skipped"]
    assert set(syn["methods"]) == {"prompt", "zero", *VARIANTS}
    assert syn["methods"]["prompt"]["logit_rel_err_mean"] == 0.0
    assert syn["methods"]["taylor2+sinks1000"]["logit_rel_err_median"] < 1e-4
    assert syn["methods"]["zero"]["logit_rel_err_median"] > 1e-2
    assert report["timing"]["total_s"] > 0 and "| antonym | 1 | 4 |" in run.stdout and "Wilson" in run.stdout

    # --resume: every finished task and the synthetic test come back from OUT/progress.json unchanged
    again = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--sinks", "1000", "--resume",
                            "--out", str(tmp_path)], capture_output=True, text=True, env=env, cwd=str(ROOT),
                           timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    resumed = json.loads((tmp_path / "approx_conversion.json").read_text())
    assert resumed["tasks"] == report["tasks"] and resumed["synthetic"] == report["synthetic"]
    assert resumed["skipped"] == report["skipped"] and resumed["recovery"] == report["recovery"]
    assert resumed["timing"]["total_s"] < report["timing"]["total_s"]
