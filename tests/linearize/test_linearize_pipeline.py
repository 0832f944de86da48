"""linicl.linearize's run helpers (what experiments/linearize.py calls): the stages with their records
and maps files, held-out losses of the student read with other windows, the ICL table and its gains,
and the cost of a converted query."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXACT_RTOL, CharTokenizer

import linicl
from linicl import checkpoint, stats
from linicl import linearize as LZ
from linicl.errors import LiniclError
from linicl.linearize import icl as ICL


@pytest.fixture(scope="module")
def teacher():
    cfg = linicl.preset("tiny-llama", max_len=64, dtype="float64")
    model = linicl.Transformer(cfg)
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


@pytest.fixture(scope="module")
def student(teacher):
    model, variables = teacher
    s = linicl.Transformer(LZ.student_config(model.cfg, window=4, sinks=1))
    return s, LZ.student_variables(s, variables)


@pytest.fixture(scope="module")
def sequences(teacher):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(1), (8, 12), 0, teacher[0].cfg.vocab_size), np.int32)


def test_stages_write_the_maps_and_their_records(tmp_path, teacher, student, sequences):
    (model, tv), (s, sv) = teacher, student
    maps = tmp_path / "maps.safetensors"
    sv1, rec = LZ.transfer_stage(model, tv, s, sv, sequences, maps_path=maps, steps=2, batch_size=4, lr=1e-2,
                                 progress=False, checkpoint=tmp_path / "stage1.safetensors", teacher_name="tiny")
    assert rec["tokens_seen"] == 2 * 4 * 12 and rec["train_sequences"] == [8, 12] and rec["wall_s"] > 0
    assert rec["history"]["step"] == [0, 1] and len(rec["history"]["layers"][0]) == model.cfg.n_layers
    assert checkpoint.header(maps).meta == dict(tokens=96, steps=2, seq_len=12, teacher="tiny")
    # The same maps from the finished checkpoint, with the record of how far it got.
    sv_c, rec_c = LZ.checkpoint_stage(tmp_path / "stage1.safetensors", s, sv, maps_path=tmp_path / "c.safetensors")
    assert rec_c["steps_reached"] == rec_c["of_steps"] == 2 and rec_c["tokens_seen"] == 96
    for a, b in zip(jax.tree_util.tree_leaves(sv_c), jax.tree_util.tree_leaves(sv1)):
        np.testing.assert_array_equal(a, b)
    sv2, rec2 = LZ.distill_stage(model, tv, s, sv1, sequences, maps_path=maps, rank=2, steps=2, batch_size=2,
                                 lr=1e-3, progress=False, stage1_tokens=96, teacher_name="tiny")
    assert rec2["tokens_seen"] == 2 * 2 * 12 and len(rec2["history"]["kl"]) == 2 and rec2["rank"] == 2
    head = checkpoint.header(maps)
    assert head.meta["tokens"] == 96 and head.meta["stage2_tokens"] == 48 and head.settings["lora_rank"] == 2
    _, loaded, _ = LZ.load_maps(maps, model, tv)  # the correction travels with the maps
    x = jnp.asarray(sequences[:2])
    assert float(jnp.max(jnp.abs(s.apply(loaded, x) - s.apply(sv2, x)))) < 1e-5  # float32 in the file
    with pytest.raises(LiniclError, match="sequences"):
        LZ.transfer_stage(model, tv, s, sv, sequences[0], maps_path=maps, steps=1, batch_size=1, lr=1e-2)


def test_window_variants_and_held_out_losses(teacher, student, sequences):
    (model, tv), (s, sv) = teacher, student
    variants = LZ.window_variants(s)
    assert list(variants) == ["student w0 s0 (same maps)", "student w0 s1 (same maps)", "student w4 s0 (same maps)",
                              "student w16 s1 (same maps)"]
    assert variants["student w16 s1 (same maps)"].cfg == s.cfg.replace(window=16)
    # Other settings than the student's own (e.g. maps loaded under other flags): those are the base.
    assert list(LZ.window_variants(s, window=8, sinks=1)) == [
        "student w0 s0 (same maps)", "student w0 s1 (same maps)", "student w8 s0 (same maps)", "student w32 s1 (same maps)"]
    with pytest.raises(LiniclError, match="window"):
        LZ.window_variants(s, window=-1)
    out = LZ.held_out_losses({"softmax": (model, tv), "narrow": (variants["student w0 s0 (same maps)"], sv)},
                             sequences[:3])
    assert list(out) == ["softmax", "narrow"] and set(out["softmax"]) == {"mean", "by_position", "n"}
    assert out["softmax"]["mean"] == LZ.next_token_loss(model, tv, sequences[:3], batch_size=2)["mean"]
    with pytest.raises(LiniclError, match="models"):
        LZ.held_out_losses({}, sequences)
    with pytest.raises(LiniclError, match="pair"):
        LZ.held_out_losses({"softmax": model}, sequences)


def test_conversion_cost_rows(student):
    s, sv = student
    rows = LZ.conversion_cost(s, sv, [8, 20], query_len=4, repeats=1)
    assert [r["prompt_len"] for r in rows] == [8, 20]
    assert rows[0]["state_floats"] == rows[1]["state_floats"] > 0  # a finite state: independent of n
    assert rows[1]["kv_cache_floats"] > rows[0]["kv_cache_floats"]
    assert all(r["logits_rel_err"] <= EXACT_RTOL and r["prompted_s"] > 0 and r["converted_s"] > 0 for r in rows)
    with pytest.raises(LiniclError, match="lengths"):
        LZ.conversion_cost(s, sv, [0])


def _cell(softmax, student, **more):
    row = {ICL.SOFTMAX: {"correct": softmax}, ICL.STUDENT: {"correct": student}}
    return row | {m: {"correct": c} for m, c in more.items()}


def test_gains_and_pooled_gain_follow_linicl_stats():
    zero, few = [0] * 20, [1] * 16 + [0] * 4
    half = [1] * 8 + [0] * 12
    rows = {"a k=0": _cell(zero, zero), "a k=4": _cell(few, half, **{ICL.APPROX: few, ICL.KEPT_ONLY: half}),
            "b k=0": _cell(zero, zero)}  # b has no k=4 cell: left out
    g = LZ.gains(rows, ["a", "b"], 4)
    assert list(g) == ["a"] and g["a"]["gain"] == stats.gain(few, zero)._asdict()
    assert g["a"]["student_recovered"] == stats.recovered(half, few, zero)._asdict()
    assert g["a"]["learned_kernel_recovered"]["value"] == 1.0 and "stage1_recovered" not in g["a"]
    p = LZ.pooled_gain(rows, ["a", "b"], 4)
    assert p["tasks"] == ["a"] and p["n"] == 20 and p[ICL.STUDENT]["value"] == pytest.approx(0.5)
    assert p["kernel_adds"] == stats.paired_bootstrap(few, half)._asdict()
    assert LZ.pooled_gain(rows, ["a"], 0) is None and LZ.pooled_gain(rows, ["c"], 4) is None
    rows["a k=4"] = _cell(zero, zero)  # no gain: no share
    assert LZ.gains(rows, ["a"], 4)["a"]["student_recovered"] is None


def test_a_constant_student_is_flagged_and_left_out_of_the_pooled_share_and_the_counts():
    """Issue 52 item 19: a student answering one word to every query (" 5" on a numeric task) "kept"
    1.20 of the gain, counted among the tasks keeping half and went into the pooled share, marked only in
    the accuracy table. Now flagged in the gains table and left out of both (its share over every task
    reported beside, named)."""
    zero, few = [0] * 20, [1] * 10 + [0] * 10
    lucky, half = [1] * 12 + [0] * 8, [1] * 5 + [0] * 15
    rows = {"num k=0": _cell(zero, zero), "num k=4": _cell(few, lucky),
            "word k=0": _cell(zero, zero), "word k=4": _cell(few, half)}
    rows["num k=4"][ICL.STUDENT]["constant"] = True  # " 5" every time: gold 12 times of 20
    g = LZ.gains(rows, ["num", "word"], 4)
    assert g["num"]["constant"] == [ICL.STUDENT] and g["word"]["constant"] == []
    assert g["num"]["student_recovered"]["value"] == pytest.approx(1.2)  # the share itself, as measured
    assert ICL.kept_half(g, ICL.STUDENT) == dict(half=["word"], of=["word"], constant=["num"])
    p = LZ.pooled_gain(rows, ["num", "word"], 4)
    assert p[ICL.STUDENT] == stats.recovered(half, few, zero)._asdict()  # the varied task alone
    assert p["constant"] == {ICL.STUDENT: ["num"]}
    assert p["with_constant"][ICL.STUDENT] == stats.recovered(lucky + half, few + few, zero + zero)._asdict()
    table = ICL.gains_table(g, p, [ICL.STUDENT]).splitlines()
    assert "| num | 4 | 50.0 [" in table[2] and table[2].endswith("(const) |")
    assert "(const)" not in table[3] and "(without const num; all tasks: 0.85 [" in table[4]
    # Without a constant method nothing is set apart, and the table reads as before.
    rows["num k=4"][ICL.STUDENT]["constant"] = False
    p = LZ.pooled_gain(rows, ["num", "word"], 4)
    assert p["constant"] == {} and p[ICL.STUDENT]["value"] == pytest.approx(0.85)
    assert "const" not in ICL.gains_table(LZ.gains(rows, ["num", "word"], 4), p, [ICL.STUDENT])


def test_shortest_prompt_is_a_demonstration_prompt():
    """Issue 52 item 20: "Shortest converted prompt: 1 tokens" came from the k = 0 cells (BOS alone)."""
    def cell(k, n):
        return {ICL.SOFTMAX: {"k": k, "correct": [0]}, "prompt_tokens": n}
    rows = {"a k=0": cell(0, 1), "a k=1": cell(1, 9), "b k=0": cell(0, 0), "b k=4": cell(4, 30)}
    assert ICL.shortest_prompt(rows) == dict(tokens=9, cell="a k=1")
    assert ICL.shortest_prompt({"a k=0": cell(0, 1)}) is None


def test_icl_table_resumes_from_its_store_and_runs_headline_cells_first(monkeypatch):
    calls = []

    def fake_cell(teacher, tv, student, sv, tok, task, k, **kw):
        calls.append((task.name, k, kw))
        return {"k": k}
    monkeypatch.setattr(ICL, "icl_cell", fake_cell)
    monkeypatch.setattr(ICL, "load_task", lambda name, data_dir=None: SimpleNamespace(name=name))
    store = ICL._Memory({"b k=0": {"k": 0, "wall_s": 1.0}})
    table = LZ.icl_table(None, None, None, None, None, ["a", "b"], [0, 1, 4], store=store, seed=3)
    assert list(table) == ["a k=0", "a k=1", "a k=4", "b k=0", "b k=1", "b k=4"]
    assert [(t, k) for t, k, _ in calls] == [("a", 0), ("a", 4), ("b", 4), ("a", 1), ("b", 1)]
    assert all(kw == {"seed": 3} for *_, kw in calls) and table["b k=0"]["wall_s"] == 1.0
    assert all("wall_s" in row for row in table.values())
    with pytest.raises(LiniclError, match="task"):
        LZ.icl_table(None, None, None, None, None, [], [0])


def test_bos_for_and_training_text():
    tok = SimpleNamespace(adds_bos=True, bos_id=7)
    assert LZ.bos_for(tok) == 7 and LZ.bos_for(tok, False) is None
    assert LZ.bos_for(SimpleNamespace(adds_bos=False, bos_id=7)) is None
    assert LZ.bos_for(SimpleNamespace(adds_bos=False, bos_id=7), True) == 7
    with pytest.raises(LiniclError, match="add"):
        LZ.bos_for(tok, "on")
    with pytest.raises(LiniclError, match="sampled"):
        LZ.training_text(None, None, CharTokenizer(), ["antonym"], n=2, length=16, sampled=-1)


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_training_text_appends_teacher_samples_and_label_words_are_checked():
    model = linicl.Transformer(linicl.preset("tiny-llama", max_len=32, vocab_size=1024))  # code points fit
    tv = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    tok = CharTokenizer()
    base = LZ.training_sequences(tok, ["antonym"], n=3, length=16, seed=2)
    assert np.array_equal(LZ.training_text(model, tv, tok, ["antonym"], n=3, length=16, seed=2), base)
    text = LZ.training_text(model, tv, tok, ["antonym"], n=3, length=16, seed=2, sampled=2)
    assert text.shape == (5, 16) and np.array_equal(text[:3], base)
    assert any(np.array_equal(text[3, :8], row[:8]) for row in base)  # a sample continues a training row
    LZ.check_scorable(tok, ["antonym"])  # open-ended: nothing to check
    with pytest.raises(LiniclError, match="cb: a label task is scored by its label words"):
        LZ.check_scorable(tok, ["antonym", "cb"])  # a character tokenizer spells " true" in 5 tokens
