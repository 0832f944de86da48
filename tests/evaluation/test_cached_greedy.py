"""Greedy answers with the decode cache (``linicl.generate``, rows grouped by length) equal the answers
of re-running every prefix at each new token, on softmax (learned positions, rope) and finite-state
(hybrid window + sinks, rope on the inputs) models, for rows of many lengths in batches that need
padding rows; hooks fall back to the re-run path."""

import numpy as np
import pytest

import linicl
from linicl import evaluate as ev
from linicl.interventions import add
from helpers import init, perturb_learned_maps

CONFIGS = {
    "softmax-learned": dict(attention="softmax", positions="learned"),
    "softmax-rope": dict(attention="softmax", positions="rope", norm_type="rmsnorm", mlp="gated"),
    "hybrid-rope-inputs": dict(attention="linear", feature_map="hedgehog", positions="rope", rope_on="inputs",
                               window=3, sinks=1, normalize=True),
}


class Chars:
    """Token i is the character chr(i) (so id 10 is the line break that ends an answer); no EOS."""
    eos_id = None

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)


def _rows(vocab: int) -> list:
    rng = np.random.default_rng(0)
    return [rng.integers(11, vocab, size=n).astype(np.int32) for n in (3, 7, 7, 12, 5, 7, 20, 3, 12)]


def _model(name):
    cfg = linicl.ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=64,
                             dtype="float64", **CONFIGS[name])
    model, variables = init(cfg, 1)
    return model, perturb_learned_maps(variables, 2)


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_greedy_answers_equal_prefix_reruns(name):
    model, variables = _model(name)
    rows, tok = _rows(64), Chars()
    common = dict(batch_size=4, progress=False)
    rerun = ev._rerun_greedy(model, variables, tok, rows, 6, dict(common))
    stats: dict = {}
    cached = ev._cached_greedy(model, variables, tok, rows, 6, dict(common, stats=stats))
    assert cached == rerun
    assert len({tuple(r) for r in rerun}) > 3  # power: the rows get different answers
    assert stats["n_tokens"] == sum(map(len, rows))
    assert ev.greedy_answers(model, variables, tok, rows, max_new=6, common=common) == \
        ev.greedy_answers(model, variables, tok, rows, max_new=6, common=common, cache=False)


def test_a_hook_runs_the_prefix_rerun_path(monkeypatch):
    """An edit has no defined meaning on a one-token decode step, so it takes the re-run path."""
    model, variables = _model("softmax-rope")
    rows, tok = _rows(64)[:3], Chars()
    edits = [add("blocks.0.hook_resid_post", 1.0)]
    monkeypatch.setattr(ev, "_cached_greedy", None)  # calling it would raise TypeError
    out = ev.greedy_answers(model, variables, tok, rows, max_new=3, common=dict(batch_size=4, progress=False,
                                                                                 edits=edits))
    assert len(out) == 3


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("max_new", [0, -2, True, 2.0])
def test_both_paths_refuse_a_bad_max_new_by_its_name(cache, max_new):
    """Before, the cached path blamed ``n_new`` ("got 0" even for -2) and the re-run path returned
    empty answers for 0."""
    model, variables = _model("softmax-rope")
    with pytest.raises(linicl.LiniclError, match=f"greedy_answers: max_new must be a positive int.*got {max_new!r}"):
        ev.greedy_answers(model, variables, Chars(), _rows(64)[:2], max_new=max_new,
                          common=dict(batch_size=4, progress=False), cache=cache)


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_both_paths_refuse_a_bad_batch_size(cache, batch_size):
    model, variables = _model("softmax-rope")
    with pytest.raises(linicl.LiniclError, match=f"batch_size must be an int >= 1, got {batch_size!r}"):
        ev.greedy_answers(model, variables, Chars(), _rows(64)[:2], max_new=2,
                          common=dict(batch_size=batch_size, progress=False), cache=cache)
