"""Long-prompt probes (linicl.data.long_context): exact token lengths, the key line where the depth
says, key-value lines spread through the filler, the question last, seeds, and clear errors."""

import dataclasses

import numpy as np
import pytest

from linicl.data import long_context as lc
from linicl.data.prompts import BOS, DEMO_INPUT, INSTRUCTION, QUERY
from linicl.errors import LiniclError
from helpers import CharTokenizer


Chars = CharTokenizer


TOK = Chars()
FILLER = np.asarray(TOK.encode("lorem ipsum dolor sit amet " * 200), np.int32)  # 5,400 tokens, no digits


@pytest.mark.parametrize("n_tokens", [300, 1000, 2048])
def test_passkey_prompts_have_the_exact_length_and_the_key_at_its_depth(n_tokens):
    prompts = lc.passkey_prompts(TOK, FILLER, n_tokens, 6, seed=3, digits=5)
    assert all(len(p) == n_tokens for p in prompts)
    for p in prompts:
        assert len(p.label) == 5 and p.label.isdigit()
        assert p.tokens[0] == 1 and p.roles[0] == BOS
        assert p.text.count(p.label) == 2  # "The pass key is K. Remember it. K is the pass key."
        assert p.text.endswith(lc.PASSKEY_QUESTION) and np.all(p.roles[p.query_start:] == QUERY)
    assert len({p.label for p in prompts}) == 6
    again = lc.passkey_prompts(TOK, FILLER, n_tokens, 6, seed=3, digits=5)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(prompts, again))
    other = lc.passkey_prompts(TOK, FILLER, n_tokens, 6, seed=4, digits=5)
    assert not all(np.array_equal(a.tokens, b.tokens) for a, b in zip(prompts, other))


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.75, 1.0])
def test_the_key_line_sits_after_depth_of_the_filler(depth):
    p = lc.passkey_prompt(TOK, FILLER, 700, "12345", depth)
    filler = np.flatnonzero(p.roles == DEMO_INPUT)
    line = np.flatnonzero(p.roles == INSTRUCTION)
    line = line[line > 1 + len(lc.PASSKEY_INSTRUCTION)]  # the key line, after the instruction
    assert np.sum(filler < line[0]) == int(round(depth * len(filler)))


def test_depth_zero_and_one_put_the_key_first_and_last():
    first = lc.passkey_prompt(TOK, FILLER, 400, "12345", 0.0)
    last = lc.passkey_prompt(TOK, FILLER, 400, "12345", 1.0)
    head = len(TOK.encode(lc.PASSKEY_INSTRUCTION)) + 1
    assert first.text.index("12345") < head + len(lc.PASSKEY_LINE)
    assert last.text.rindex("12345") > 400 - len(lc.PASSKEY_QUESTION) - len(lc.PASSKEY_LINE)


def test_kv_recall_prompts_spread_the_lines_and_ask_one_of_them():
    prompts = lc.kv_recall_prompts(TOK, FILLER, 1500, 8, n_pairs=5, seed=0, digits=4)
    for p in prompts:
        assert len(p) == 1500 and len(p.label) == 4
        lines = [line for line in p.text.split("\n") if line.startswith("The code for ")]
        assert len(lines) == 5
        codes = {line[13:].split(" is ")[0]: line.split(" is ")[1].rstrip(".") for line in lines}
        assert codes[p.query.input] == p.label
        assert p.text.endswith(lc.KV_QUESTION.format(name=p.query.input))
        starts = [p.text.index(line) for line in lines]
        gaps = np.diff([0] + starts + [len(p.text)])
        assert gaps.min() > 0.5 * gaps.mean()  # spread evenly, not bunched
    assert len({p.query.input for p in prompts}) > 1


@pytest.mark.parametrize("call, match", [
    (lambda: lc.passkey_prompt(TOK, FILLER, 50, "1", 0.5), "n_tokens must be an int above"),
    (lambda: lc.passkey_prompt(TOK, FILLER, 500, "1", 1.5), r"depth must be in \[0, 1\]"),
    (lambda: lc.passkey_prompt(TOK, FILLER[:100], 500, "1", 0.5), "filler stream holds 100 tokens"),
    (lambda: lc.passkey_prompts(TOK, FILLER, 500, 0), "n >= 1"),
    (lambda: lc.kv_recall_prompts(TOK, FILLER, 500, 2, n_pairs=0), r"n_pairs must be an int in \[1, 32\]"),
    (lambda: lc.kv_recall_prompt(TOK, FILLER, 500, [("a", "1")], 1), "0 <= asked < len"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(LiniclError, match=match):
        call()


@pytest.mark.parametrize("answer, right", [(" 86556", True), (" 86556. Remember it", True), ("86556", True),
                                           (" 8655", False), (" 865561", False), (" the key is 86556", True),
                                           (" 12345 86556", False), (" no digits", False), ("", False)])
def test_a_key_is_answered_by_the_first_number(answer, right):
    assert lc.key_answered(answer, "86556") == right


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_key_line_is_the_span_of_the_key_line(depth):
    p = lc.passkey_prompt(TOK, FILLER, 600, "54321", depth)
    start, end = lc.key_line(p)
    line = TOK.decode(p.tokens[start:end].tolist())
    assert line.endswith(lc.PASSKEY_LINE.format(key="54321"))  # at depth 0 the instruction comes with it
    assert np.all(p.roles[start:end] == INSTRUCTION) and p.roles[end] != INSTRUCTION
    if depth > 0:
        assert line == lc.PASSKEY_LINE.format(key="54321")
    with pytest.raises(LiniclError, match="INSTRUCTION"):
        lc.key_line(dataclasses.replace(p, roles=np.full_like(p.roles, DEMO_INPUT)))


def test_probe_prompts_by_name_are_the_builders_own():
    for probe, direct in (("passkey", lambda: lc.passkey_prompts(TOK, FILLER, 400, 2, seed=5)),
                          ("kv", lambda: lc.kv_recall_prompts(TOK, FILLER, 400, 2, n_pairs=3, seed=5))):
        got = lc.probe_prompts(probe, TOK, FILLER, 400, 2, seed=5, n_pairs=3)
        assert [p.tokens.tolist() for p in got] == [p.tokens.tolist() for p in direct()]
    with pytest.raises(LiniclError, match="probe must be one of"):
        lc.probe_prompts("shots", TOK, FILLER, 400, 2)


def test_filler_windows_are_seeded_slices_of_the_stream():
    rows = lc.filler_windows(FILLER, 3, 50, seed=[0, 7])
    assert rows.shape == (3, 50) and rows.dtype == FILLER.dtype
    starts = np.random.default_rng([0, 7]).integers(0, len(FILLER) - 50, 3)
    for row, s in zip(rows, starts):
        np.testing.assert_array_equal(row, FILLER[s:s + 50])
    with pytest.raises(LiniclError, match="longer stream"):
        lc.filler_windows(FILLER[:50], 1, 50)
    with pytest.raises(LiniclError, match="n >= 1"):
        lc.filler_windows(FILLER, 0, 50)



def test_kv_codes_within_a_prompt_are_distinct():
    """With one digit there are 9 codes: 9 pairs use each once (before, repeats let a model that
    recalled the wrong line score), and 10 pairs cannot be told apart, so they are refused."""
    for p in lc.kv_recall_prompts(TOK, FILLER, 800, 3, n_pairs=9, seed=1, digits=1):
        codes = [line.split(" is ")[1].rstrip(".") for line in p.text.split("\n") if line.startswith("The code for ")]
        assert sorted(codes) == [str(d) for d in range(1, 10)]
    with pytest.raises(LiniclError, match="n_pairs=10 distinct codes do not fit among the 9 codes of digits=1"):
        lc.kv_recall_prompts(TOK, FILLER, 800, 1, n_pairs=10, digits=1)


PAIRS = [("apple", "12"), ("river", "34"), ("tiger", "56")]


@pytest.mark.parametrize("call, match", [
    # silent wrong answers before: every code "0", an ambiguous question, truncated filler, True as 1
    (lambda: lc.kv_recall_prompts(TOK, FILLER, 500, 2, n_pairs=3, digits=0),
     r"kv_recall_prompts: digits must be an int in \[1, 12\], got 0"),
    (lambda: lc.kv_recall_prompt(TOK, FILLER, 500, [("apple", "12"), ("apple", "34")], 0),
     r"pairs must have distinct names .* got \['apple'\]"),
    (lambda: lc.passkey_prompt(TOK, FILLER + 0.5, 500, "12345", 0.5),
     "passkey_prompt: filler must be a 1-d array of int token ids.*float64"),
    (lambda: lc.kv_recall_prompt(TOK, FILLER.astype(float), 500, PAIRS, 0), "kv_recall_prompt: filler must be"),
    (lambda: lc.kv_recall_prompt(TOK, FILLER, 500, PAIRS, True), "asked must be one int indexing pairs.*got True"),
    (lambda: lc.passkey_prompts(TOK, FILLER, 500, 1, digits=True), r"digits must be an int in \[1, 12\], got True"),
    (lambda: lc.passkey_prompts(TOK, FILLER, 500, True), "n must be an int with n >= 1, got True"),
    (lambda: lc.kv_recall_prompts(TOK, FILLER, 500, 1, n_pairs=True), r"n_pairs must be an int in \[1, 32\]"),
    (lambda: lc.passkey_prompt(TOK, FILLER, 500, 12345, 0.5), "a key must be a string of digits.*got 12345"),
    # raw tracebacks before
    (lambda: lc.passkey_prompt(TOK, FILLER, 500, "12345", "0.5"), r"depth must be in \[0, 1\].*got '0.5'"),
    (lambda: lc.passkey_prompt(TOK, FILLER, 500, "12345", True), r"depth must be in \[0, 1\].*got True"),
    (lambda: lc.kv_recall_prompt(TOK, FILLER, 500, PAIRS, 1.5), "asked must be one int indexing pairs.*got 1.5"),
    (lambda: lc.kv_recall_prompts(TOK, FILLER, 500, 1, digits=25), r"digits must be an int in \[1, 12\], got 25"),
    (lambda: lc.kv_recall_prompts(TOK, FILLER, 500, 1, digits=-2), r"digits must be an int in \[1, 12\], got -2"),
    (lambda: lc.passkey_prompt(TOK, FILLER, 500, "12345", 0.5, start=3.5), "start must be an int, got 3.5"),
    (lambda: lc.filler_windows(FILLER, True, 50), "n must be an int with n >= 1, got True"),
])
def test_bad_long_prompt_arguments_are_refused_by_name(call, match):
    with pytest.raises(LiniclError, match=match):
        call()


def test_numpy_ints_and_int_depths_are_taken():
    a = lc.kv_recall_prompt(TOK, FILLER, 500, PAIRS, np.int64(1), start=np.int64(7))
    b = lc.kv_recall_prompt(TOK, FILLER, 500, PAIRS, 1, start=7)
    assert a.label == "34" and np.array_equal(a.tokens, b.tokens)
    assert np.array_equal(lc.passkey_prompt(TOK, FILLER, 500, "12345", 1).tokens,
                          lc.passkey_prompt(TOK, FILLER, 500, "12345", 1.0).tokens)
    assert len(lc.kv_recall_prompts(TOK, FILLER, 500, np.int64(1), n_pairs=np.int64(2), digits=np.int64(3))) == 1


@pytest.mark.parametrize("min_tokens", [0, 1, 1000, 4097])
def test_classic_filler_repeats_the_original_sentences_and_holds_enough_tokens(min_tokens):
    ids = lc.classic_filler(TOK, min_tokens=min_tokens)
    assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids) >= min_tokens + len(lc.CLASSIC_FILLER)
    text = TOK.decode(ids)
    assert text.replace(lc.CLASSIC_FILLER, "") == ""  # only whole repetitions of the five sentences
    # a passkey prompt over it: the key line is the only text that is not the filler's
    p = lc.passkey_prompt(TOK, lc.classic_filler(TOK, min_tokens=700), 700, "12345", 0.5)
    a, b = lc.key_line(p)
    assert "12345" in TOK.decode(p.tokens[a:b]) and "12345" not in TOK.decode(ids)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "10"])
def test_classic_filler_refuses_a_bad_min_tokens(bad):
    with pytest.raises(LiniclError, match="min_tokens"):
        lc.classic_filler(TOK, min_tokens=bad)
