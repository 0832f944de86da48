"""Prompt building: roles partition the tokens exactly, query_start, demo sampling (balance and
determinism), label-word checks, right padding, evaluation sets. Toy tokenizers only."""

import collections
import re
import string

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from linicl.data import (BOS, DEMO_INPUT, DEMO_LABEL, INSTRUCTION, PAD, QUERY, SEPARATOR, TEMPLATES, Example,
                         Role, Task, Template, batch_prompts, build_eval_set, build_prompt, check_label_words,
                         fit_queries, load_task, sample_demos, shared_context, template_for,
                         tokenization_mismatch)
from linicl.errors import LiniclError
from test_data import shared_dir  # noqa: F401  (a fixture: the full data sets, else the committed sample)


class CharTokenizer:
    """One token per character (its code point): segment and whole-text encodings always agree."""

    def __init__(self, bos_id=None):
        self.bos_id = bos_id

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class WordTokenizer:
    """GPT-2-like pre-tokenization: a word keeps its leading space, and whitespace before a word leaves
    its last character to the next piece ("\\n\\nQ" -> "\\n", "\\n", "Q", but a lone "\\n\\n" is one
    piece). Known pieces are one token; any other piece is spelled out one token per character."""
    PATTERN = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
    PIECES = ("Q", ":", "A", "\n", "\n\n", "Review", "Sentiment", " negative", " positive", " great",
              " movie", " film", " dull", " hot", " cold", " up", " down", " Entity", " Number")
    CHAR_BASE = 1000

    def __init__(self):
        self.vocab = {p: i for i, p in enumerate(self.PIECES)}

    def encode(self, text):
        ids = []
        for piece in self.PATTERN.findall(text):
            ids += [self.vocab[piece]] if piece in self.vocab else [self.CHAR_BASE + ord(c) for c in piece]
        return ids

    def decode(self, ids):
        return "".join(self.PIECES[i] if i < self.CHAR_BASE else chr(i - self.CHAR_BASE) for i in ids)


class ByteTokenizer:
    """UTF-8 bytes: a non-ASCII character takes several tokens that decode only together."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def ex(text, label, **fields):
    return Example(text, label, tuple(fields.items()))


# Every slot a ready-made template names besides {input} (CB: premise/hypothesis; the ICR suite: stem,
# choices, goal, sol1, ...), each a field of the toy examples, so that every template renders them.
SLOTS = sorted({name for t in TEMPLATES.values() for _, name, _, _ in string.Formatter().parse(t.input_format)
                if name and name not in ("input", "premise", "hypothesis")})


def make_task(n_per_label=(4, 4, 4), labels=("yes", "no", "maybe"), n_test=6) -> Task:
    """A classification task whose examples also carry premise/hypothesis fields (for the CB templates)
    and the other slots of the ready-made templates (``SLOTS``)."""
    def more(tag):
        return {slot: f"{slot[:2]}{tag}" for slot in SLOTS}
    train = tuple(ex(f"p{lab}{i}\nh{lab}{i}", lab, premise=f"p{lab}{i}", hypothesis=f"h{lab}{i}", **more(f"{lab}{i}"))
                  for lab, n in zip(labels, n_per_label) for i in range(n))
    test = tuple(ex(f"pq{i}\nhq{i}", labels[i % len(labels)], premise=f"pq{i}", hypothesis=f"hq{i}", **more(f"q{i}"))
                 for i in range(n_test))
    return Task("toy", train, test, tuple(labels), template="qa")


WORDS = Task("words", tuple(ex(f"w{i}", f"o{i}") for i in range(20)),
             tuple(ex(f"t{i}", f"u{i}") for i in range(5)), None)


def text_of(tok, prompt, role):
    return tok.decode(prompt.tokens[prompt.roles == role].tolist())


def expected_query(template, query):
    slots = template.input_format.format(**query.field_map())
    return template.input_prefix + slots + template.io_sep + template.output_prefix


# ----------------------------------------------------------------------------- roles

@pytest.mark.parametrize("name", [*TEMPLATES, "instructed"])
def test_roles_partition_the_tokens(name):
    template = TEMPLATES.get(name) or Template(instruction="Find the label.")
    tok, task = CharTokenizer(), make_task()
    demos = sample_demos(task, 5, seed=0)
    p = build_prompt(template, demos, task.test[0], tok)
    assert p.tokens.dtype == np.int32 and p.roles.dtype == np.int8 and p.tokens.shape == p.roles.shape
    assert tok.decode(p.tokens.tolist()) == p.text == template.render(demos, task.test[0])
    assert text_of(tok, p, DEMO_LABEL) == "".join(" " + d.output for d in demos)
    slots = re.findall(r"{(\w+)}", template.input_format)
    want = "".join(d.field_map()[s] for d in demos for s in slots)
    assert text_of(tok, p, DEMO_INPUT).replace(" ", "") == want           # plus spaces moved from prefixes
    assert text_of(tok, p, INSTRUCTION) == template.instruction
    # The query is one QUERY run at the end; query_start is its first token.
    assert (p.roles[p.query_start:] == QUERY).all() and not (p.roles[:p.query_start] == QUERY).any()
    assert tok.decode(p.tokens[p.query_start:].tolist()) == expected_query(template, task.test[0])
    assert p.label == task.test[0].output and p.text.endswith(template.output_prefix)
    assert set(np.unique(p.roles)) <= {SEPARATOR, DEMO_INPUT, DEMO_LABEL, QUERY, INSTRUCTION}
    assert len(p.positions(DEMO_LABEL)) == sum(len(" " + d.output) for d in demos)


_piece = st.text(alphabet=" Q:a\n", max_size=4)
_word = st.text(alphabet="xyz", min_size=1, max_size=3)


def spaces(text):
    """The run of spaces that ends text."""
    return text[len(text.rstrip(" ")):]


@given(prefix=_piece, out_prefix=_piece, io_sep=_piece, ex_sep=_piece,
       label_prefix=st.sampled_from(["", " "]),
       pairs=st.lists(st.tuples(_word, _word), min_size=1, max_size=4))
def test_roles_for_any_template(prefix, out_prefix, io_sep, ex_sep, label_prefix, pairs):
    """Whatever the separators, the text is the plain rendering and each role holds exactly its text."""
    template = Template(prefix, out_prefix, io_sep, ex_sep, label_prefix=label_prefix)
    examples = [Example(i, o) for i, o in pairs]
    demos, query = examples[:-1], examples[-1]
    tok = CharTokenizer()
    p = build_prompt(template, demos, query, tok, strict=True)
    naive = "".join(f"{prefix}{d.input}{io_sep}{out_prefix}{label_prefix}{d.output}{ex_sep}" for d in demos)
    assert p.text == naive + f"{prefix}{query.input}{io_sep}{out_prefix}"
    # Spaces that end the template text before an input or label travel with it.
    assert text_of(tok, p, DEMO_LABEL) == "".join(spaces(io_sep + out_prefix) + label_prefix + d.output
                                                  for d in demos)
    assert text_of(tok, p, DEMO_INPUT) == "".join(spaces((ex_sep if i else "") + prefix) + d.input
                                                  for i, d in enumerate(demos))
    assert tok.decode(p.tokens[p.query_start:].tolist()) == expected_query(template, query)
    assert (p.roles[p.query_start:] == QUERY).all() and (p.roles[:p.query_start] != QUERY).all()
    # Each demo label is one contiguous run.
    runs = np.flatnonzero(np.diff((p.roles == DEMO_LABEL).astype(int)) == 1)
    assert len(runs) + (p.roles[0] == DEMO_LABEL) == len(demos)


def test_bos_instruction_and_zero_shot():
    task, query = make_task(), make_task().test[1]
    p = build_prompt(Template(), (), query, CharTokenizer())
    assert p.query_start == 0 and (p.roles == QUERY).all() and p.text == f"Q: {query.input}\nA:"
    p = build_prompt(Template(instruction="Answer."), sample_demos(task, 2, 0), query,
                     CharTokenizer(bos_id=0))
    assert p.tokens[0] == 0 and p.roles[0] == BOS and (p.roles[1:] != BOS).all()
    assert p.query_start == 1 + p.text.index("Q: pq1") and p.text.startswith("Answer.\n\nQ:")
    assert build_prompt(Template(), (), query, CharTokenizer(bos_id=0), add_bos=False).query_start == 0
    with pytest.raises(LiniclError, match="no bos_id"):
        build_prompt(Template(), (), query, CharTokenizer(), add_bos=True)


def test_label_tokens_are_the_scored_ids():
    """With a tokenizer where label words are single tokens, the DEMO_LABEL tokens are exactly the ids
    check_label_words returns, in demo order."""
    tok = WordTokenizer()
    pairs = [("great movie", "positive"), ("dull film", "negative")] * 3
    task = Task("s", tuple(ex(t, lab) for t, lab in pairs), (ex("great film", "positive"),),
                ("negative", "positive"))
    ids = check_label_words(task.labels, tok)
    assert ids.dtype == np.int32 and ids.tolist() == [tok.vocab[" negative"], tok.vocab[" positive"]]
    demos = sample_demos(task, 4, seed=3)
    p = build_prompt(template_for(task), demos, task.test[0], tok)
    assert p.tokens[p.positions(DEMO_LABEL)].tolist() == [ids[task.labels.index(d.output)] for d in demos]


def test_segment_versus_whole_text_tokenization():
    tok, template = WordTokenizer(), Template()
    demos, query = (Example("hot", "cold"), Example("up", "down")), Example("hot", "cold")
    p = build_prompt(template, demos, query, tok)
    # The lone "\n\n" before the query is one token; in the whole text it is "\n", "\n".
    assert tokenization_mismatch(p, tok) == p.query_start - 1
    with pytest.raises(LiniclError, match="strict"):
        build_prompt(template, demos, query, tok, strict=True)
    same = build_prompt(Template(example_sep="\n"), demos, query, tok, strict=True)
    assert tokenization_mismatch(same, tok) is None
    whole = build_prompt(template, demos, query, tok, tokenization="whole")
    assert whole.tokens.tolist() == tok.encode(p.text) and whole.text == p.text
    assert text_of(tok, whole, DEMO_LABEL) == " cold down" and text_of(tok, whole, DEMO_INPUT) == " hot up"
    assert tok.decode(whole.tokens[whole.query_start:].tolist()) == "Q: hot\nA:"
    assert whole.query_start == p.query_start + 1


def test_whole_text_mode_groups_bytes_and_refuses_straddling():
    tok = ByteTokenizer()
    demos, query = (Example("café", "oui"),), Example("thé", "non")
    p = build_prompt(Template(), demos, query, tok, tokenization="whole")
    assert p.tokens.tolist() == tok.encode(p.text) and text_of(tok, p, DEMO_INPUT) == " café"
    with pytest.raises(LiniclError, match="straddle"):   # " c" + "old": the one token " cold"
        build_prompt(Template(input_prefix="Q: c"), (Example("old", "hot"),), query, WordTokenizer(),
                     tokenization="whole")

    class Lower(CharTokenizer):
        def decode(self, ids):
            return super().decode(ids).lower()
    with pytest.raises(LiniclError, match="does not reproduce"):
        build_prompt(Template(), demos, query, Lower(), tokenization="whole")
    with pytest.raises(LiniclError, match="tokenization must be"):
        build_prompt(Template(), demos, query, tok, tokenization="bpe")


def test_check_label_words_names_the_offenders():
    tok = WordTokenizer()
    ids = check_label_words(["Entity", "Number"], tok)
    assert ids.tolist() == [tok.vocab[" Entity"], tok.vocab[" Number"]]
    with pytest.raises(LiniclError) as err:
        check_label_words(["Entity", "Abbreviation", "Location"], tok)
    msg = str(err.value)
    assert "' Abbreviation'" in msg and "' Location'" in msg and "Entity" not in msg.split("offending")[1]
    with pytest.raises(LiniclError, match=r"\[' positive', ' positive'\] all ->"):
        check_label_words(["positive", "positive"], tok)
    with pytest.raises(LiniclError, match="prefix ''"):
        check_label_words(["positive"], tok, prefix="")
    with pytest.raises(LiniclError, match="empty"):
        check_label_words([], tok)


def test_template_errors():
    with pytest.raises(LiniclError, match="plain names"):
        Template(input_format="{0}")
    with pytest.raises(LiniclError, match="plain names"):
        Template(input_format="{input!r}")
    with pytest.raises(LiniclError, match="premise"):
        build_prompt(TEMPLATES["cb"], (), Example("x", "y"), CharTokenizer())
    with pytest.raises(LiniclError, match="names template"):
        template_for(Task("t", WORDS.train, WORDS.test, None, template="nope"))


# ----------------------------------------------------------------------------- demonstrations

@pytest.mark.parametrize("k", range(13))
def test_sample_demos_is_balanced_and_deterministic(k):
    task = make_task()
    demos = sample_demos(task, k, seed=k)
    counts = collections.Counter(d.output for d in demos)
    assert len(demos) == k == len(set(demos)) and set(demos) <= set(task.train)
    assert all(counts[lab] in (k // 3, -(-k // 3)) for lab in task.labels)
    assert demos == sample_demos(task, k, seed=k)


def test_sample_demos_seeds_order_and_exhausted_classes():
    task = make_task()
    draws = {sample_demos(task, 6, seed=s) for s in range(6)}
    assert len(draws) > 1
    labels = [d.output for d in sample_demos(task, 9, seed=0, shuffle=False)]
    assert labels[:3] == labels[3:6] == labels[6:] and len(set(labels[:3])) == 3   # round-robin
    assert collections.Counter(d.output for d in sample_demos(make_task((1, 5, 5)), 9, seed=1)) == \
        {"yes": 1, "no": 4, "maybe": 4}
    unbalanced = [collections.Counter(d.output for d in sample_demos(task, 3, s, balanced=False))
                  for s in range(20)]
    assert any(len(c) < 3 for c in unbalanced)          # plain sampling does not force balance
    words = sample_demos(WORDS, 7, seed=2)
    assert len(set(words)) == 7 and set(words) <= set(WORDS.train) and words == sample_demos(WORDS, 7, 2)
    for bad in (-1, 2.0, True):
        with pytest.raises(LiniclError, match="k must be"):
            sample_demos(task, bad, 0)
    with pytest.raises(LiniclError, match="only 12"):
        sample_demos(task, 13, 0)


def test_balanced_demos_from_a_one_class_pool_are_refused():
    """Round-robin over the labels would quietly give k demos of the one class there is."""
    task = make_task((0, 5, 0))
    with pytest.raises(LiniclError, match=r"task 'toy': class-balanced demonstrations need two or more classes, "
                                          r"but every example of its demo pool \(split 'train'\) has the label "
                                          r"'no' of \['yes', 'no', 'maybe'\]; pass balanced=False"):
        sample_demos(task, 2, 0)
    with pytest.raises(LiniclError, match="two or more classes"):
        build_eval_set(task, CharTokenizer(), k=1)
    assert [d.output for d in sample_demos(task, 2, 0, balanced=False)] == ["no", "no"]
    assert sample_demos(task, 0, 0) == () and len(build_eval_set(task, CharTokenizer(), k=0)) == 6  # zero-shot
    assert len(sample_demos(make_task((0, 2, 1)), 3, 0)) == 3  # two classes of three: as before


# ----------------------------------------------------------------------------- batches and eval sets

def test_batch_prompts_right_pads():
    tok, task = CharTokenizer(), make_task()
    prompts = [build_prompt(Template(), sample_demos(task, k, 0), task.test[k], tok) for k in (0, 3, 1)]
    batch = batch_prompts(prompts, pad_id=7)
    lengths = [len(p) for p in prompts]
    assert batch.tokens.shape == batch.roles.shape == (3, max(lengths))
    assert batch.tokens.dtype == np.int32 and batch.roles.dtype == np.int8 and batch.lengths.dtype == np.int32
    assert batch.lengths.tolist() == lengths
    assert batch.query_start.tolist() == [p.query_start for p in prompts]
    for b, p in enumerate(prompts):
        assert (batch.tokens[b, :len(p)] == p.tokens).all() and (batch.roles[b, :len(p)] == p.roles).all()
        assert (batch.tokens[b, len(p):] == 7).all() and (batch.roles[b, len(p):] == PAD).all()
        # The last real token, where a causal model's prediction is read, ends the query.
        assert batch.roles[b, batch.lengths[b] - 1] == QUERY
    assert batch.labels == tuple(p.label for p in prompts)
    assert batch.label_index(task.labels).tolist() == [task.labels.index(p.label) for p in prompts]
    assert batch_prompts(prompts, pad_to=500).tokens.shape == (3, 500)
    with pytest.raises(LiniclError, match="shorter"):
        batch_prompts(prompts, pad_to=5)
    with pytest.raises(LiniclError, match="no prompts"):
        batch_prompts([])
    with pytest.raises(LiniclError, match="not in"):
        batch.label_index(["yes"])
    assert Role.PAD == PAD == 0


def test_build_eval_set():
    tok, task = CharTokenizer(), make_task(n_test=6)
    prompts = build_eval_set(task, tok, k=3, seed=5, n_eval=4)
    assert len(prompts) == 4 and len({p.query for p in prompts}) == 4
    assert all(p.query in task.test and p.label == p.query.output and len(p.demos) == 3 for p in prompts)
    one_each = {"yes": 1, "no": 1, "maybe": 1}
    assert all(collections.Counter(d.output for d in p.demos) == one_each for p in prompts)
    again = build_eval_set(task, tok, k=3, seed=5, n_eval=4)
    assert [p.text for p in again] == [p.text for p in prompts]
    assert len({p.demos for p in prompts}) > 1                            # own demos per query
    shared = build_eval_set(task, tok, k=3, seed=5, n_eval=4, same_demos=True)
    assert len({p.demos for p in shared}) == 1
    assert len(build_eval_set(task, tok, k=0, seed=0, n_eval=100)) == 6   # all, when fewer
    assert [p.text for p in build_eval_set(task, tok, k=2, seed=6)] != [p.text for p in prompts]
    for bad in (dict(n_eval=0), dict(seed=-1), dict(k=-2)):
        with pytest.raises(LiniclError):
            build_eval_set(task, tok, **{"k": 1, **bad})
    for n_eval in (None, 3):  # no queries: refused here, not as a rate of 0 of 0 later (wilson)
        with pytest.raises(LiniclError, match=r"task 'toy': its evaluation set \(split 'test'\) is empty"):
            build_eval_set(make_task(n_test=0), tok, k=1, n_eval=n_eval)


@pytest.mark.parametrize("name", ["sst2", "trec", "agnews", "cb", "commonsense_qa", "antonym"])
def test_eval_sets_on_shared_folder(name, shared_dir):  # noqa: F811
    task, tok = load_task(name, shared_dir), CharTokenizer()
    k = len(task.labels) if task.labels else 4
    prompts = build_eval_set(task, tok, k=k, seed=0, n_eval=8)
    template = template_for(task)
    for p in prompts:
        assert text_of(tok, p, DEMO_LABEL) == "".join(" " + d.output for d in p.demos)
        assert tok.decode(p.tokens[p.query_start:].tolist()) == expected_query(template, p.query)
        if task.labels:
            assert sorted(d.output for d in p.demos) == sorted(task.labels)
    assert batch_prompts(prompts).tokens.shape[0] == 8


def test_a_multi_task_prompt_writes_each_demo_in_its_own_template():
    """The ICR paper's OOD few-shot baseline: demos of other tasks, each as its task writes them,
    then the query in its own template."""
    tok = CharTokenizer()
    demos = [ex("good film", "positive"), ex("Who?", "Person")]
    query = ex("fine", "positive")
    p = build_prompt(TEMPLATES["sst5"], demos, query, tok, demo_templates=[TEMPLATES["sst2"], TEMPLATES["trec"]])
    assert p.text == ("Review: good film\nSentiment: positive\n\nQuestion: Who?\nAnswer Type: Person\n\n"
                      "Sentence: fine\nSentiment:")
    assert text_of(tok, p, DEMO_LABEL) == " positive Person"
    same = build_prompt(TEMPLATES["sst2"], demos, query, tok)
    assert same.text == build_prompt(TEMPLATES["sst2"], demos, query, tok,
                                     demo_templates=[TEMPLATES["sst2"]] * 2).text
    with pytest.raises(LiniclError, match="one template per demonstration"):
        build_prompt(TEMPLATES["sst2"], demos, query, tok, demo_templates=[TEMPLATES["sst2"]])


def test_shared_context_splits_same_demo_prompts():
    tok, task = CharTokenizer(), make_task(n_test=6)
    shared = build_eval_set(task, tok, k=3, seed=5, n_eval=4, same_demos=True)
    n, ctx, queries = shared_context(shared)
    assert n == shared[0].query_start and np.array_equal(ctx, shared[0].tokens[:n])
    assert all(np.array_equal(np.concatenate([ctx, q]), p.tokens) for q, p in zip(queries, shared))
    with pytest.raises(LiniclError, match="do not share one demonstration context"):
        shared_context(build_eval_set(task, tok, k=3, seed=5, n_eval=4))
    with pytest.raises(LiniclError, match="no prompts"):
        shared_context([])


def test_fit_queries_one_length_from_the_demo_pool():
    tok, task = CharTokenizer(), make_task()
    template = template_for(task)
    rows = fit_queries(task, tok, template, set(task.train[:2]), 3, 10, seed=0)
    assert rows.dtype == np.int32 and rows.ndim == 2 and len(rows) <= 3
    pool = {tuple(build_prompt(template, (), e, tok, add_bos=False).tokens[
        build_prompt(template, (), e, tok, add_bos=False).query_start:]) for e in task.train[2:]}
    assert all(tuple(r) in pool for r in rows)                           # never an excluded demo
    assert np.array_equal(fit_queries(task, tok, template, set(), 3, 10, seed=0),
                          fit_queries(task, tok, template, set(), 3, 10, seed=0))
    assert fit_queries(task, tok, template, set(task.train), 3, 10, seed=0) is None
    with pytest.raises(LiniclError, match="m must be"):
        fit_queries(task, tok, template, set(), 0, 10, seed=0)
