"""linicl.approx.selected: the loss of held-out text after a selected prefix. The whole budget is the
prompted model's own loss (float64, <= 1e-12), no prefix is far from it, and the pooled rows carry
paired differences against the whole prefix and the equal-float window; bad input is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl.approx import selected
from linicl.errors import LiniclError
from helpers import init, tokens

CFG = linicl.ModelConfig(attention="softmax", positions="rope", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2,
                         vocab_size=32, dtype="float64")


def _prompted_nll(model, variables, row: np.ndarray, prefix: int) -> float:
    """The plain model's mean NLL of row[prefix + 1:] read after all of row: the reference."""
    lp = jax.nn.log_softmax(model.apply(variables, jnp.asarray(row)[None])[0], -1)
    targets = np.arange(prefix + 1, len(row))
    return float(-np.mean(np.asarray(lp)[targets - 1, row[targets]]))


def test_prefix_loss_whole_budget_is_the_prompted_model_and_no_prefix_is_not():
    model, variables = init(CFG, 0)
    row = np.asarray(tokens(3, 1, 30, 32))[0]
    got = selected.prefix_loss(model, variables, row, 20, scores=["h2o", "recent"], keeps=[1.0, 0.5], sinks=1,
                               window=2)
    nll, ref = got["nll"], _prompted_nll(model, variables, row, 20)
    assert abs(nll["full"] - ref) <= 1e-12 * ref
    assert abs(nll["h2o@1"] - ref) <= 1e-12 * ref and abs(nll["recent@1"] - ref) <= 1e-12 * ref
    assert abs(nll["no prefix"] - ref) > 1e-3 * ref                 # power: the prefix changes the loss
    assert abs(nll["recent@0.5"] - ref) > 1e-6 * ref                 # half the prefix dropped
    kv = 2 * CFG.n_layers * 2 * 20 * CFG.head_dim                     # layers, KV heads, tokens, keys + values
    assert got["floats"]["full"] == got["floats"]["h2o@1"] == kv and got["floats"]["no prefix"] == 0
    assert got["floats"]["recent@0.5"] == kv // 2
    assert set(got["seconds"]) == {"prefill", "h2o", "recent"}


def test_loss_rows_pair_each_selection_with_the_whole_prefix_and_its_window():
    records = [dict(nll={"full": 1.0 + i, "no prefix": 2.0 + i, "h2o@0.5": 1.5 + i, "recent@0.5": 1.75 + i},
                     floats={"full": 8, "no prefix": 0, "h2o@0.5": 4, "recent@0.5": 4}) for i in range(3)]
    rows = selected.loss_rows(records)
    assert rows["full"]["mean"] == 2.0 and "vs_full" not in rows["full"] and rows["h2o@0.5"]["n"] == 3
    assert rows["h2o@0.5"]["vs_full"] == pytest.approx([0.5, 0.5, 0.5])
    assert rows["h2o@0.5"]["vs_recent"] == pytest.approx([-0.25, -0.25, -0.25])
    assert "vs_recent" not in rows["recent@0.5"] and "vs_recent" not in rows["no prefix"]
    text = selected.loss_table(rows, 20, 10)
    assert "after a 20-token prefix" in text and "| h2o@0.5 | 2.500 | +0.500 [+0.500, +0.500] | -0.250" in text
    with pytest.raises(LiniclError, match="at least one"):
        selected.loss_rows([])


def test_prefix_loss_names_bad_input():
    model, variables = init(CFG, 0)
    row = np.asarray(tokens(3, 1, 30, 32))[0]
    for prefix in (0, 29, True, 2.5):
        with pytest.raises(LiniclError, match="prefix must be"):
            selected.prefix_loss(model, variables, row, prefix, scores=["recent"], keeps=[0.5], sinks=1, window=1)
    with pytest.raises(LiniclError, match="row must be"):
        selected.prefix_loss(model, variables, row[None], 20, scores=["recent"], keeps=[0.5], sinks=1, window=1)
    with pytest.raises(LiniclError, match="scores must be"):
        selected.prefix_loss(model, variables, row, 20, scores=["nope"], keeps=[0.5], sinks=1, window=1)


def test_every_score_and_budget_of_a_prompt_share_one_compiled_query():
    """select_prompt pads every cut of a prompt to the prompt's length: once its scores and one budget
    have run, more budgets build no new XLA program (they built one per kept-set size before)."""
    import linicl.lm
    from linicl.data import long_context as lc
    from linicl.timing import CompileMeter
    from helpers import FIXTURES

    model, variables, tok = linicl.lm.from_pretrained(FIXTURES / "llama-tiny.gguf", max_len=512)
    prompt = lc.probe_prompts("passkey", tok, lc.classic_filler(tok, min_tokens=400), 320, 1, seed=0)[0]
    meter = CompileMeter()

    def run(keeps):
        meter.start()
        got = selected.select_prompt(model, variables, prompt, tok, scores=["h2o", "recent"], keeps=keeps, sinks=2,
                                     window=4, max_new=3)
        return got, meter.read()["programs"]
    first, built = run([0.5])
    assert built > 0 and set(first["answers"]) == {"h2o@0.5", "recent@0.5"}
    more, again = run([0.3, 0.5, 0.7])
    assert again == 0 and more["answers"]["h2o@0.5"] == first["answers"]["h2o@0.5"]
    assert more["floats"]["recent@0.3"] < more["floats"]["recent@0.5"] < more["floats"]["recent@0.7"]


def test_a_selection_may_store_what_it_drops_as_kernel_terms_within_its_budget():
    """kernels={name: ...}: each (score, budget) again with the dropped tokens as that kernel's terms,
    the terms counted in the budget; where the budget cannot hold them the method is left out."""
    import linicl.lm
    from linicl import iclca, selection
    from linicl.data import long_context as lc
    from helpers import FIXTURES

    model, variables, tok = linicl.lm.from_pretrained(FIXTURES / "llama-tiny.gguf", max_len=512)
    prompts = lc.probe_prompts("passkey", tok, lc.classic_filler(tok, min_tokens=400), 320, 2, seed=0)
    n = prompts[0].query_start
    terms = iclca.stored_floats(iclca.convert_approx(model, variables, jnp.asarray(prompts[0].tokens[:n])[None],
                                                     "elu+1"))["kernel"]
    full = selection.token_budget(model.cfg, n, 1.0) * 2 * model.cfg.head_dim
    small = round(0.5 * terms / full, 3)          # holds the forced tokens, not the kernel's terms
    assert selection.token_budget(model.cfg, n, small) >= 6 * len(model.cfg.global_layers) * model.cfg.kv_heads
    records = [selected.select_prompt(model, variables, p, tok, scores=["recent"], keeps=[small, 0.9], sinks=2,
                                      window=4, max_new=2, kernels={"elu+1": dict(kernel="elu+1")},
                                      span=lc.key_line(p)) for p in prompts]
    got = records[0]
    assert set(got["answers"]) == {f"recent@{small:g}", "recent@0.9", "recent@0.9+elu+1"}
    assert terms < got["floats"]["recent@0.9+elu+1"] <= 0.9 * full < got["floats"]["recent@0.9"] + terms
    # the same ranking with fewer tokens (the terms take their share): no more of the key line kept
    assert 0 <= got["line_kept"]["recent@0.9+elu+1"] <= got["line_kept"]["recent@0.9"] <= 1
    rows = selected.selected_rows(records, prompts, keyed=True)
    assert set(rows) == set(got["answers"]) and rows["recent@0.9+elu+1"]["n"] == 2
    with pytest.raises(LiniclError, match="must name its kernel"):
        selected.select_prompt(model, variables, prompts[0], tok, scores=["recent"], keeps=[0.9], sinks=2, window=4,
                               max_new=2, kernels={"x": {}})
