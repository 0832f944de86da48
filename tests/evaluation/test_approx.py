"""linicl.approx: the named variants of convert_approx, one (task, k) cell scored against the prompted
model on the tiny Llama GGUF fixture (a prompt kept whole as sinks is the prompted model), the
summaries over cells and the report's text; bad arguments named."""

import jax.numpy as jnp
import numpy as np
import pytest

import linicl
import linicl.lm
from linicl import approx, recovery
from linicl.approx import report
from linicl.errors import LiniclError
from helpers import EXACT_RTOL, FIXTURES, apply, init, rel_err, tokens

TINY_GGUF = FIXTURES / "llama-tiny.gguf"


def test_variant_specs_name_every_variant():
    specs = approx.variant_specs(["taylor2", "prf"], ["prf"], extra_kernel="elu+1", sinks=3, mix=0.25)
    assert specs == {"taylor2": dict(kernel="taylor2"), "prf": dict(kernel="prf"),
                     "lsq-prf": dict(kernel="prf", fit=True), "elu+1+sinks3": dict(kernel="elu+1", sinks=3),
                     "elu+1-mix0.25": dict(kernel="elu+1", form="mix", lam=0.25)}
    assert list(approx.variant_specs(["elu+1"], [], sinks=0, mix=None)) == ["elu+1"]
    assert list(approx.variant_specs()) == ["taylor2", "prf", "elu+1", "lsq-prf", "taylor2+sinks4", "taylor2-mix0.5"]


def test_convert_variant_keeps_at_most_the_prompt_and_needs_fit_inputs():
    cfg = linicl.ModelConfig(attention="softmax", positions="rope", n_layers=1, d_model=16, n_heads=2,
                             vocab_size=32, dtype="float64")
    model, variables = init(cfg, 0)
    prompt, query = np.asarray(tokens(0, 1, 5, 32))[0], tokens(1, 1, 3, 32)
    # more sinks than prompt tokens: every token kept exact, the prompted model itself
    exact = approx.convert_variant(model, variables, prompt, dict(kernel="taylor2", sinks=100))
    target = apply(model, variables, jnp.concatenate([jnp.asarray(prompt)[None], query], 1))[:, 5:]
    assert rel_err(apply(model, exact, query), target) <= EXACT_RTOL
    methods = approx.converters(model, variables, {"lsq-prf": dict(kernel="prf", fit=True), "prf": dict(kernel="prf")},
                                n_features=8)
    assert [fits for _, fits in methods.values()] == [True, False]
    fitted = methods["lsq-prf"][0](prompt, np.asarray(tokens(2, 4, 3, 32)))
    assert np.isfinite(np.asarray(apply(model, fitted, query))).all()
    with pytest.raises(LiniclError, match="no fit inputs"):
        methods["lsq-prf"][0](prompt, None)
    with pytest.raises(LiniclError, match="prompt must be"):
        approx.convert_variant(model, variables, np.zeros((1, 1, 5), np.int32), dict(kernel="prf"))


def test_selection_specs_keep_what_their_scores_choose_one_prompt_at_a_time():
    specs = approx.selection_specs(["reconstruction", "recent"], [0.5, 1.0], sinks=1, window=2, instruction=[7, 8])
    assert list(specs) == ["reconstruction@0.5", "reconstruction@1", "recent@0.5", "recent@1"]
    assert specs["reconstruction@0.5"] == dict(kernel="none", keep=0.5, score="reconstruction", sinks=1, window=2,
                                               instruction=[7, 8])
    assert "instruction" not in specs["recent@1"]                      # only the re-read needs it
    cfg = linicl.ModelConfig(attention="softmax", positions="rope", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2,
                             vocab_size=32, dtype="float64")
    model, variables = init(cfg, 0)
    prompt, query = np.asarray(tokens(0, 1, 12, 32))[0], tokens(1, 1, 3, 32)
    methods = approx.converters(model, variables, specs)
    assert all(one_at_a_time for _, one_at_a_time in methods.values())
    target = apply(model, variables, jnp.concatenate([jnp.asarray(prompt)[None], query], 1))[:, 12:]
    whole = methods["reconstruction@1"][0](prompt, None)               # the whole budget: every token kept
    assert rel_err(apply(model, whole, query), target) <= EXACT_RTOL
    half = methods["recent@0.5"][0](prompt, np.zeros((2, 3), np.int32))  # fit inputs are ignored
    assert rel_err(apply(model, half, query), target) > 1e-3           # power: half the prompt is gone
    assert sum(linicl.iclca.stored_floats(half).values()) == 2 * 2 * 6 * 2 * cfg.head_dim  # layers, KV heads, tokens
    with pytest.raises(LiniclError, match="at least one score"):
        approx.selection_specs([], [0.1], sinks=1, window=2)


class _Bar:
    """A progress bar that counts."""

    disable = True

    def __init__(self):
        self.n, self.postfix = 0, []

    def update(self, n):
        self.n += n

    def set_postfix_str(self, s):
        self.postfix.append(s)


@pytest.mark.usefixtures("data_env")
def test_evaluate_task_scores_every_method_against_the_prompted_model():
    model, variables, tok = linicl.lm.from_pretrained(TINY_GGUF, max_len=2048)
    specs = {"taylor2": dict(kernel="taylor2"), "taylor2+sinks1000": dict(kernel="taylor2", sinks=1000),
             "lsq-prf": dict(kernel="prf", fit=True),
             **approx.selection_specs(["h2o"], [1.0], sinks=1, window=1)}
    methods = approx.converters(model, variables, specs, n_features=16)
    task, bar = linicl.data.load_task("antonym"), _Bar()
    entry, skipped = approx.evaluate_task(model, variables, tok, task, methods, ks=[1], n_eval=3, seed=0,
                                          fit_queries=2, batch_size=4, bar=bar)
    assert skipped == [] and bar.n == 1 and any("lsq-prf" in s for s in bar.postfix)
    assert entry["metric"] == "first_content_token" and entry["n"] == 3 and entry["labels"] is None
    assert entry["width"] >= entry["query_len"]["max"] and len(entry["gold_ids"]) == 3
    cell = entry["k"]["1"]
    assert list(cell["methods"]) == ["prompt", "zero", *specs] and cell["prompt_len"] > 0
    assert len(cell["demos"]) == 1 and cell["fit_inputs_shape"][0] >= 1
    assert cell["kv_cache_floats"] == 2 * model.cfg.n_layers * model.cfg.kv_heads * model.cfg.head_dim * cell["prompt_len"]
    exact, prompt = cell["methods"]["taylor2+sinks1000"], cell["methods"]["prompt"]
    assert exact["predictions"] == prompt["predictions"] and exact["agree_with_prompt"] == 1.0
    assert exact["kl_full_mean"] < 1e-6 and max(exact["layer_rel_err"]) < 1e-4
    assert max(cell["methods"]["zero"]["layer_rel_err"]) > 1e-2
    assert all(cell["methods"][m]["state_floats"] > 0 for m in specs)
    # the whole budget keeps every prompt token of every layer: the prompted model, and its KV floats
    kept = cell["methods"]["h2o@1"]
    assert kept["predictions"] == prompt["predictions"] and kept["kl_full_mean"] < 1e-6
    assert kept["state_floats"] == cell["kv_cache_floats"]
    # the targets of the same queries, read alone
    t = approx.task_targets(task, tok, n_eval=3, seed=0)
    assert t.metric == entry["metric"] and t.gold_ids.tolist() == entry["gold_ids"] and len(t.queries) == 3
    assert all(np.array_equal(q[:len(p.tokens) - p.query_start], p.tokens[p.query_start:])
               for q, p in zip(t.queries, t.prompts))
    with pytest.raises(LiniclError, match="one distinct token"):
        approx.task_targets(linicl.data.load_task("sst2"), tok, n_eval=3)   # label words: not single tokens


def _entries(flags: dict) -> dict:
    """Task entries holding only what the summaries read: per method its correct flags and errors."""
    methods = {m: dict(correct=c, layer_rel_err=[float(i), 1.0]) for i, (m, c) in enumerate(flags.items())}
    methods["prompt"].pop("layer_rel_err")                            # the reference has none
    return {t: {"k": {"1": {"methods": methods}, "4": {"methods": methods}}} for t in ("antonym", "capitalize")}


def test_correctness_and_layer_error_summary():
    flags = {"zero": [1, 0, 0, 0], "prompt": [1, 1, 1, 0], "prf": [1, 1, 0, 0]}
    tasks = _entries(flags)
    correct = approx.correctness(tasks)
    assert set(correct) == {"antonym", "capitalize"} and set(correct["antonym"]) == {"1", "4"}
    np.testing.assert_array_equal(correct["antonym"]["4"]["prf"], [1.0, 1.0, 0.0, 0.0])
    assert approx.layer_error_summary(tasks) == {"zero": [0.0, 1.0], "prf": [2.0, 1.0]}


def _tasks(variants: dict) -> dict:
    """Two tasks whose few-shot gain is 50 points on 40 queries (significant), with each variant's
    correct flags: "zero" (none of the gain), "prompt" (all of it)."""
    flags = {"zero": [1] * 10 + [0] * 30, "prompt": [1] * 30 + [0] * 10}
    methods = {m: {"correct": flags[m]} for m in ("zero", "prompt")}
    methods.update({v: {"correct": flags[like]} for v, like in variants.items()})
    return {t: {"k": {"1": {"methods": methods}}} for t in ("antonym", "capitalize")}


def test_no_variant_is_named_best_when_they_tie():
    rec = recovery.recovery(approx.correctness(_tasks({"taylor2": "zero", "prf": "zero"})), ["taylor2", "prf"])
    assert rec["tasks_with_gain"] == 2 and rec["best_variant"] is None and rec["best_mean_fraction"] is None
    assert rec["tied_variants"] == ["taylor2", "prf"] and not rec["target_met"]
    assert report.best_line(rec) == "no best variant: every variant recovers half the gain on 0 of 2 tasks"
    rec = recovery.recovery(approx.correctness(_tasks({"taylor2": "prompt", "prf": "prompt", "elu+1": "zero"})),
                            ["taylor2", "prf", "elu+1"])
    assert rec["best_variant"] is None and rec["tied_variants"] == ["taylor2", "prf"] and rec["target_met"]
    assert report.best_line(rec) == "no single best variant: taylor2, prf tie at 2 of 2 tasks"
    rec = recovery.recovery(approx.correctness(_tasks({"taylor2": "zero", "prf": "prompt"})), ["taylor2", "prf"])
    assert rec["best_variant"] == "prf" and rec["tied_variants"] == [] and rec["target_met"]
    assert report.best_line(rec) == "best variant prf: 2 of 2 tasks"
    pooled = rec["per_task_pooled"]["antonym"]
    assert report.fmt_recovered(pooled, "prf") == "1.00 [1.00, 1.00]" and report.fmt_recovered(pooled, "lsq") == "-"
    assert report.fmt_recovered(pooled, "taylor2") == "0.00 [0.00, 0.00]"


def test_accuracy_text_marks_a_constant_predictor():
    r = dict(accuracy=0.5, ci_low=0.25, ci_high=0.75, constant=True)
    assert report.fmt_acc(r) == f"50.0 [25.0, 75.0] {report.CONSTANT_MARK}"
    assert report.fmt_acc(dict(r, constant=False)) == "50.0 [25.0, 75.0]"
    assert report.fmt_iv(None) == "-" and report.fmt_iv(dict(value=0.1, low=0.0, high=0.2)) == "10.0 [0.0, 20.0]"
