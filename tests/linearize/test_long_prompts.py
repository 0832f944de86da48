"""linicl.linearize.baselines and long_prompts: the equal-state window (local windows counted once per kv
head), the methods of a long-prompt comparison by name, a method scored on passkey prompts with its
converted = prompted check, the key-line oracle, and paired differences against the equal-state window."""

import numpy as np
import pytest

import linicl
from linicl import iclca, linearize
from linicl.data import long_context as lc
from linicl.errors import LiniclError
from linicl.linearize import baselines, long_prompts
from helpers import FIXTURES


def _teacher_and_student(name: str):
    teacher, tv, tok = linicl.lm.from_pretrained(FIXTURES / name, max_len=320)
    student = linicl.Transformer(linearize.student_config(teacher.cfg, window=4, sinks=1))
    return teacher, tv, tok, student, linearize.student_variables(student, tv)


@pytest.mark.parametrize("name", ["gemma3-tiny", "llama-tiny"])
def test_the_equal_state_window_counts_local_windows_once_per_kv_head(name):
    """Gemma's student stores its exact local windows' keys and values per kv head and, per query head,
    the empty linear part of a window-only hybrid; the window it is compared with must hold as many
    floats as the student needs (those windows' keys and values), no more. Without
    local layers the budget is the state as stored, and W the closed form kv(W - 1 + sinks) <= state."""
    teacher, _, _ = linicl.lm.from_pretrained(FIXTURES / name)
    student = linicl.Transformer(linearize.student_config(teacher.cfg, window=4, sinks=1))
    budget = baselines.student_budget(student)
    w = baselines.equal_window(student, teacher)
    floats = lambda w: baselines.window_floats(linearize.window_config(teacher.cfg, window=w, sinks=1))  # noqa: E731
    assert floats(w) <= budget < floats(w + 1)
    cfg = teacher.cfg
    if cfg.has_local_layers:
        stored = iclca.state_floats(student.cfg)
        # not counted, per query head: each buffered token's two 1-wide feature slots and the zero
        # 1-feature S and z of a window with no linear part (its keys and values are per kv head)
        per_query_head = cfg.n_heads * ((cfg.sliding_window - 1) * 2 + cfg.head_dim + 1)
        n_local = cfg.n_layers - len(cfg.global_layers)
        assert stored - budget == n_local * per_query_head > 0
    else:
        assert budget == iclca.state_floats(student.cfg)
        per_token = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim
        assert w == budget // per_token - student.cfg.sinks + 1
    # a cache costs floats: the window beside it is shorter, and a cache that alone exceeds the budget fits no window
    cached = baselines.equal_cached_window(student, teacher, 2)
    assert cached is not None and cached < w
    assert baselines.window_floats(linearize.window_config(cfg, window=cached, sinks=1, cache=2)) <= budget
    assert baselines.equal_cached_window(student, teacher, budget) is None
    with pytest.raises(LiniclError, match="cache must be"):
        baselines.equal_cached_window(student, teacher, -1)


def test_compared_methods_are_named_as_the_tables_name_them():
    teacher, tv, _, student, sv = _teacher_and_student("llama-tiny.gguf")
    w = baselines.equal_window(student, teacher)
    ms = baselines.compared_methods(teacher, tv, student, sv, caches=[0, 4], cache_rules=["recall", "attention"],
                                    windows=["student", baselines.EQUAL, "3"], window_caches=[2])
    wc = baselines.equal_cached_window(student, teacher, 2)
    assert list(ms) == ["softmax", "student", "student+cache4", "student+attcache4", "window4", f"window{w}",
                        "window3", f"window{wc}+attcache2"]
    assert ms["softmax"] == (teacher, tv, False) and ms["student"][2]
    assert ms["student+attcache4"][0].cfg.cache == 4 and ms["student+attcache4"][0].cfg.cache_rule == "attention"
    assert ms[f"window{wc}+attcache2"][0].cfg.cache == 2 and ms["window3"][0].cfg.feature_map == "none"
    only = baselines.compared_methods(teacher, tv, student, sv, only=["student", "window4"])
    assert list(only) == ["student", "window4"]
    with pytest.raises(LiniclError, match="unknown methods"):
        baselines.compared_methods(teacher, tv, student, sv, only=["window999"])
    with pytest.raises(LiniclError, match="alone holds more floats"):
        baselines.compared_methods(teacher, tv, student, sv, windows=[], window_caches=[10 ** 6])


def test_a_finite_method_on_passkey_prompts_converts_to_the_same_answers():
    teacher, tv, tok, student, sv = _teacher_and_student("llama-tiny.gguf")
    filler = np.asarray(tok.encode(" the cat sat on the mat and looked at the door." * 60), np.int32)
    prompts = lc.passkey_prompts(tok, filler, 240, 2, seed=1)
    row = long_prompts.score_method("student", student, sv, prompts, tok, finite=True, keyed=True, convert_check=1)
    assert row["n"] == len(row["correct"]) == 2 and row["tokens"] == 240 and set(row["correct"]) <= {0, 1}
    assert row["accuracy"] == np.mean(row["correct"]) and row["wilson"][1] <= row["accuracy"] <= row["wilson"][2]
    assert row["state_floats"] == iclca.state_floats(student.cfg)
    assert row["converted"]["answers_equal"] == row["converted"]["of"] == 1
    assert row["converted"]["max_rel_err"] <= 1e-4
    soft = long_prompts.score_method("softmax", teacher, tv, prompts, tok, finite=False, keyed=True)
    assert soft["state_floats"] == linicl.memory.kv_cache_floats(teacher.cfg, 240) and "converted" not in soft
    # the oracle that keeps every token is the teacher itself
    whole = long_prompts.oracle_window("oracle", teacher, tv, prompts, tok, window=300, sinks=1)
    assert whole["predictions"] == soft["predictions"]
    start, end = lc.key_line(prompts[0])
    assert whole["state_floats"] >= linicl.memory.kv_cache_floats(teacher.cfg, 300 + end - start)


def test_versus_equal_window_pairs_every_method_with_the_largest_window():
    rows = {"student": [1, 1, 0, 1], "window8": [0, 1, 0, 1], "window3": [0, 0, 0, 0], "window8+attcache2": [1, 1, 1, 1]}
    cells = {"passkey 512": dict(methods={m: dict(correct=c) for m, c in rows.items()}),
             "kv 512": dict(methods={"student": dict(correct=[1, 0])})}  # no reference: skipped
    out = long_prompts.versus_equal_window(cells, list(rows))
    assert out["reference"] == "window8" and set(out["differences"]) == {"passkey 512"}
    diffs = out["differences"]["passkey 512"]
    assert set(diffs) == {"student", "window3", "window8+attcache2"}
    assert diffs["student"][0] == pytest.approx(0.25) and diffs["window3"][0] == pytest.approx(-0.5)
    assert long_prompts.versus_equal_window(cells, ["student", "softmax"]) == {}


def test_scored_row_and_converted_check_inputs():
    row = long_prompts.scored_row("m", [True, False, True], ["1", "2", "3"], [np.zeros(7)], 0.0)
    assert row["correct"] == [1, 0, 1] and row["accuracy"] == pytest.approx(2 / 3) and row["tokens"] == 7
    with pytest.raises(LiniclError, match="one prediction per prompt"):
        long_prompts.converted_check(None, None, [object()], [], None, 8)
