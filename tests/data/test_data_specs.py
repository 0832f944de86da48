"""Tasks are data: the shipped specs reproduce the loader that came before them exactly, a new data set
in a known layout needs only a spec file, and malformed specs name the file and the key."""

import dataclasses
import hashlib
import json
import tomllib
from pathlib import Path

import pytest
from test_data import full_dir, write_tiny  # noqa: F401  (full_dir is a fixture)

from linicl.data import (LABEL_WORDS, TEMPLATES, DataError, Example, Template, build_eval_set, list_tasks,
                         load_task, template_for)
from linicl.data import datasets as ds
from linicl.data import specs
from linicl.errors import LiniclError

ROOT = Path(specs.__file__).parents[2]  # the checkout (wherever this test file sits)


def fingerprint(task) -> tuple:
    """(hash of the name, labels, template and every example with its fields, n_train, n_test)."""
    digest = hashlib.sha256()
    digest.update(json.dumps([task.name, task.labels, task.template]).encode())
    for part in (task.train, task.test):
        digest.update(b"\x01")
        for e in part:
            digest.update(json.dumps([e.input, e.output, e.fields]).encode())
    return digest.hexdigest()[:16], len(task.train), len(task.test)


# Computed with the loader before specs existed (hard-coded parsing tables), on the shared data folder
# and on test_data's tiny copy: the spec-driven loader must give the very same tasks.
# Key: task name, or "name/arguments" for load_task(name, **arguments).
BEFORE_SHARED = {
    "agnews": ("d6aaf09f168a2847", 6600, 1000),
    "antonym": ("2bcd5c589a1b2d91", 1679, 719),
    "capitalize": ("042a2d1759ee5c7b", 569, 244),
    "cb": ("103248d9f7da123d", 250, 56),
    "commonsense_qa": ("1a70b7703d5763e6", 7673, 3289),
    "country-capital": ("0b148d3d501e9f08", 138, 59),
    "country-currency": ("227a5a40ea962aae", 138, 59),
    "english-french": ("6154bec1b67f675f", 3289, 1409),
    "english-spanish": ("cde72c5daf120897", 3639, 1560),
    "landmark-country": ("727975a0cb5d3e0d", 585, 251),
    "national_parks": ("69c3194b85b4cde8", 316, 135),
    "next_item": ("5cd0a16616b5bccb", 157, 68),
    "person-instrument": ("2d7d93566b643818", 357, 153),
    "person-occupation": ("4379c4cad8c44ff1", 575, 246),
    "present-past": ("65950799ccd26497", 205, 88),
    "prev_item": ("af48136b7d5e16e9", 157, 68),
    "sentiment": ("883f3fc096e198c7", 817, 350),
    "singular-plural": ("f16ed21bcc045feb", 143, 62),
    "sst2": ("a50e59eb2f258b89", 6920, 1821),
    "synonym": ("d0e5364e3e5da967", 2016, 864),
    "trec": ("30039dcb6ffc5ede", 5452, 500),
    "agnews/test_size=500,split_seed=3": ("28dd0cc8047fcfed", 7100, 500),
    "antonym/test_size=0.5,split_seed=1": ("fc38c1c95e090172", 1199, 1199),
    "sentiment/split_seed=2": ("0e65b73f8c8b2ed8", 817, 350),
    "trec/label_words=TREC_LABEL_WORDS_PAPER": ("553722eee55b2d5c", 5452, 500),
    "cb/label_words=CB_LABEL_WORDS_ABC": ("fe66b3e5ffb0f609", 250, 56),
}
BEFORE_TINY = {
    "antonym": ("7cc031c4fb22d878", 7, 3),
    "cb": ("152538599d73d9a2", 4, 1),
    "commonsense_qa": ("2baf21cce8decb4e", 14, 6),
    "sst2": ("f5a40648460e6a1e", 4, 2),
    "trec": ("54a420f9e9a37d9f", 4, 2),
    "agnews/test_size=2,split_seed=1": ("9d0d22203fd10db4", 4, 2),
    "commonsense_qa/test_size=5": ("c7549cfc66e6d6f0", 15, 5),
    "trec/label_words=TREC_LABEL_WORDS_PAPER": ("9291b8e0a3009790", 4, 2),
}


def _load(key: str, root: Path):
    name, _, args = key.partition("/")
    kwargs = {}
    for item in filter(None, args.split(",")):
        arg, _, value = item.partition("=")
        kwargs[arg] = getattr(ds, value) if value.isupper() else json.loads(value)
    return load_task(name, root, **kwargs)


@pytest.mark.parametrize("key", BEFORE_SHARED)
def test_shared_tasks_are_exactly_what_the_old_loader_gave(full_dir, key):  # noqa: F811
    assert fingerprint(_load(key, full_dir)) == BEFORE_SHARED[key]


def test_tiny_tasks_are_exactly_what_the_old_loader_gave(tmp_path):
    root = write_tiny(tmp_path / "data")
    assert {key: fingerprint(_load(key, root)) for key in BEFORE_TINY} == BEFORE_TINY


# ----------------------------------------------------------------------------- the shipped specs

# Tasks of the ICR paper's suite that came after the old loader (routing.md section 4).
ICR_NEW = ("csqa", "piqa", "sst5", "mr", "mrpc", "cb_abc", "copa", "creak", "ai2sci")


def test_shipped_specs_cover_every_task_and_are_complete():
    shipped = specs.all_specs(None)
    assert sorted(shipped) == sorted((BEFORE_SHARED.keys() - {k for k in BEFORE_SHARED if "/" in k}) | set(ICR_NEW))
    for name, spec in shipped.items():
        assert spec.origin == specs.SHIPPED_DIR / f"{name}.json"
        assert spec.template in TEMPLATES and not spec.template_fields
        assert spec.licence != "unknown" and spec.source.startswith("https://github.com/")
        for f in spec.all_files():
            assert f.url.startswith("https://raw.githubusercontent.com/") and len(f.sha256) == 64 and f.size
        if name in LABEL_WORDS:  # the module's constants are the specs' defaults
            assert dict(spec.labels) == LABEL_WORDS[name] and spec.word_map
    assert dict(shipped["commonsense_qa"].labels) == {c: c for c in "abcde"}
    assert shipped["antonym"].labels is None and shipped["agnews"].test_size == 1000


def test_shipped_checksums_are_those_of_the_shared_copies(full_dir):  # noqa: F811
    for spec in specs.all_specs(None).values():
        for f in spec.all_files():
            data = (full_dir / f.path).read_bytes()
            assert (hashlib.sha256(data).hexdigest(), len(data)) == (f.sha256, f.size), f.path


def test_spec_vocabularies_are_implemented():
    assert specs.FORMATS == tuple(ds.PARSERS)
    assert specs.JOINS == tuple(ds.JOINS) and specs.CLEANERS == tuple(ds.CLEANERS)
    assert specs.TEMPLATE_FIELDS == tuple(f.name for f in dataclasses.fields(Template))


def test_the_package_ships_its_specs():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "tasks/*.json" in config["tool"]["setuptools"]["package-data"]["linicl.data"]
    assert specs.SHIPPED_DIR == ROOT / "linicl" / "data" / "tasks"


# ----------------------------------------------------------------------------- new tasks need no code

NLI_TRAIN = [("A man plays a guitar.", "A person makes music.", "entailment"),
             ("A cat sleeps.", "The cat is running.", "contradiction"),
             ("Kids play outside.", "It is summer.", "neutral"),
             ("Two dogs run.", "Animals are moving.", "entailment"),
             ("She reads a book.", "She is asleep.", "contradiction"),
             ("He cooks dinner.", "He is a chef.", "neutral")]
NLI_DEV = [("A bird sings.", "There is a bird.", "entailment"),
           ("The shop is closed.", "The shop is open.", "contradiction")]
NLI_SPEC = {
    "description": "a toy two-sentence entailment set",
    "format": "jsonl",
    "files": {"train": "nli/train.jsonl", "test": "nli/dev.jsonl"},
    "fields": ["sentence1", "sentence2"],
    "label_field": "gold",
    "labels": {"entailment": "yes", "contradiction": "no", "neutral": "maybe"},
    "template": {"input_prefix": "", "input_format": "{sentence1}\nQuestion: {sentence2} yes, no, or maybe?",
                 "output_prefix": "Answer:"},
    "licence": "CC0",
    "source": "written for this test",
}


def _write(root: Path, files: dict) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content, indent=1), encoding="utf-8")
    return root


def _nli_lines(rows) -> str:
    return "".join(json.dumps({"sentence1": a, "sentence2": b, "gold": g}) + "\n" for a, b, g in rows)


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_a_new_entailment_task_is_a_spec_and_data_files(tmp_path):
    root = _write(tmp_path / "data", {"tasks/toy_nli.json": NLI_SPEC, "nli/train.jsonl": _nli_lines(NLI_TRAIN),
                                      "nli/dev.jsonl": _nli_lines(NLI_DEV)})
    assert "toy_nli" in list_tasks(root)
    task = load_task("toy_nli", root)
    assert task.labels == ("yes", "no", "maybe") and (len(task.train), len(task.test)) == (6, 2)
    assert task.test[0] == Example("A bird sings.\nThere is a bird.", "yes",
                                   (("sentence1", "A bird sings."), ("sentence2", "There is a bird.")))
    template = template_for(task)
    assert template.output_prefix == "Answer:" and "{sentence2}" in template.input_format
    prompts = build_eval_set(task, CharTokenizer(), k=3, seed=0)
    assert len(prompts) == 2 and sorted(d.output for d in prompts[0].demos) == ["maybe", "no", "yes"]
    assert prompts[1].text.endswith(f"{prompts[1].query.field_map()['sentence1']}\nQuestion: "
                                    f"{prompts[1].query.field_map()['sentence2']} yes, no, or maybe?\nAnswer:")
    assert " yes\n\n" in prompts[0].text or " no\n\n" in prompts[0].text or " maybe\n\n" in prompts[0].text
    abc = load_task("toy_nli", root, label_words={"entailment": "A", "contradiction": "B", "neutral": "C"})
    assert abc.labels == ("A", "B", "C") and abc.test[1].output == "B"


def test_one_file_tasks_split_by_the_spec(tmp_path):
    rows = "label,headline,body\n" + "".join(f"{i % 2},Head {i},Body {i}.\n" for i in range(20))
    spec = {"format": "csv", "files": {"all": "news/all.csv"}, "test_size": 4,
            "fields": {"headline": "headline", "body": "body"}, "label_field": "label", "join": "sentence",
            "labels": {"0": "sport", "1": "money"}, "template": "qa"}
    answers = "".join(json.dumps({"q": f"What is {i}+1?", "a": i + 1}) + "\n" for i in range(10))
    open_spec = {"format": "jsonl", "files": {"all": "qa.jsonl"}, "fields": ["q"], "label_field": "a",
                 "labels": "open", "template": "qa"}
    root = _write(tmp_path / "d", {"tasks/news.json": spec, "news/all.csv": rows, "tasks/sums.json": open_spec,
                                   "qa.jsonl": answers})
    news = load_task("news", root)
    assert len(news.test) == 4 and sorted(e.output for e in news.test) == ["money", "money", "sport", "sport"]
    head3 = Example("Head 3. Body 3.", "money", (("headline", "Head 3"), ("body", "Body 3.")))
    assert head3 in news.train + news.test
    assert len(load_task("news", root, test_size=0.5).test) == 10
    sums = load_task("sums", root)
    assert sums.labels is None and len(sums.test) == 3
    assert Example("What is 2+1?", "3", (("q", "What is 2+1?"),)) in sums.train + sums.test


def test_a_spec_in_the_data_dir_overrides_the_shipped_one(tmp_path):
    override = {"format": "label_text", "files": {"train": "classification/sst2/stsa.binary.train",
                                                  "test": "classification/sst2/stsa.binary.test"},
                "labels": {"0": "bad", "1": "good"}, "template": {"input_prefix": "Text: "}}
    root = write_tiny(tmp_path / "data", {"tasks/sst2.json": json.dumps(override)})
    task = load_task("sst2", root)
    assert task.labels == ("bad", "good") and task.train[0].output == "good"
    assert template_for(task) == Template(input_prefix="Text: ")
    assert load_task("trec", root).template == "trec"  # the others are still the shipped ones


def test_a_bare_word_task_file_needs_no_spec(tmp_path):
    pairs = [{"input": f"w{i}", "output": f"W{i}"} for i in range(10)]
    root = write_tiny(tmp_path / "data", {"word_tasks/upper.json": json.dumps(pairs)})
    task = load_task("upper", root)
    assert task.labels is None and task.template == "qa" and len(task.test) == 3
    assert "upper" in list_tasks(root)


# ----------------------------------------------------------------------------- errors

def test_missing_file_names_the_folder_file_and_spec(tmp_path):
    root = _write(tmp_path / "data", {"tasks/foo.json": {**NLI_SPEC, "files": {
        "train": "classification/foo/train.jsonl", "test": "classification/foo/val.jsonl"}}})
    with pytest.raises(DataError) as err:
        load_task("foo", root)
    assert f"{root}/classification/foo/train.jsonl not found (spec {root}/tasks/foo.json)" in str(err.value)
    assert "foo" not in list_tasks(root)
    (root / "word_tasks").mkdir()
    with pytest.raises(DataError, match=r"word_tasks/antonym.json not found \(spec .*antonym.json\).*"
                                        r"linicl data fetch antonym"):
        load_task("antonym", root)


def test_unknown_task_says_where_it_looked_and_what_is_known(tmp_path):
    root = _write(tmp_path / "data", {"tasks/foo.json": NLI_SPEC})
    with pytest.raises(DataError) as err:
        load_task("nope", root)
    message = str(err.value)
    for place in (root / "tasks/nope.json", specs.SHIPPED_DIR / "nope.json", root / "word_tasks/nope.json"):
        assert str(place) in message
    assert "'foo'" in message and "'sst2'" in message
    (root / "classification" / "nope").mkdir(parents=True)
    with pytest.raises(DataError, match=r"the folder .*classification/nope exists, but a task needs a spec"):
        load_task("nope", root)
    with pytest.raises(DataError, match="task name"):
        load_task("../tasks/foo", root)


GOOD = {"format": "jsonl", "files": {"all": "x.jsonl"}, "fields": ["a"], "label_field": "b", "labels": "open",
        "template": "qa"}


@pytest.mark.parametrize("change, key", [
    ({"formt": "jsonl"}, "formt"),
    ({"format": "xml"}, "format"),
    ({"files": {"train": "x.jsonl"}}, "files"),
    ({"files": {"all": "../outside.jsonl"}}, "files.all"),
    ({"files": {"all": "/abs/x.jsonl"}}, "files.all"),
    ({"files": {"all": {"path": "x.jsonl", "url": "https://e.org/x"}}}, "files.all"),
    ({"files": {"all": {"path": "x.jsonl", "sha256": "0" * 63}}}, "files.all.sha256"),
    ({"files": {"all": {"path": "x.jsonl", "size": -1}}}, "files.all.size"),
    ({"files": {"all": {"path": "x.jsonl", "url": "https://e.org/x", "sha256": "abc"}}}, "files.all.sha256"),
    ({"files": {"all": {"path": "x.jsonl", "url": "ftp://e.org/x", "sha256": "0" * 64}}}, "files.all.url"),
    ({"test_size": 1.5}, "test_size"),
    ({"files": {"train": "a", "test": "b"}, "test_size": 3}, "test_size"),
    ({"fields": []}, "fields"),
    ({"fields": ["not an identifier"]}, "fields"),
    ({"label_field": ""}, "label_field"),
    ({"format": "trec"}, "fields"),
    ({"join": "comma"}, "join"),
    ({"clean": "lower"}, "clean"),
    ({"labels": ["x", "x"]}, "labels"),
    ({"labels": {"0": " padded"}}, "labels"),
    ({"labels": "closed"}, "labels"),
    ({"template": {"prefix": "Q: "}}, "template"),
    ({"template": 3}, "template"),
    ({"name": "other"}, "name"),
    ({"extra_files": "LICENSE"}, "extra_files"),
])
def test_bad_specs_name_the_file_and_the_key(tmp_path, change, key):
    bad = {**GOOD, **change}
    if "format" in change and change["format"] == "trec":
        bad["files"] = {"all": "x.txt"}
    path = _write(tmp_path / "data", {"tasks/t.json": bad}) / "tasks" / "t.json"
    with pytest.raises(DataError) as err:
        load_task("t", tmp_path / "data")
    assert str(err.value).startswith(f"spec {path}: {key}:"), str(err.value)


def test_required_keys_and_invalid_json(tmp_path):
    root = _write(tmp_path / "data", {"tasks/a.json": {k: v for k, v in GOOD.items() if k != "labels"},
                                      "tasks/b.json": '{"format": "jsonl",\n "files": }'})
    with pytest.raises(DataError, match=r"a.json: labels: missing"):
        load_task("a", root)
    with pytest.raises(DataError, match=r"b.json, line 2: invalid JSON"):
        load_task("b", root)
    with pytest.raises(DataError, match=r"tasks/a\.json"):  # listing reads every spec
        list_tasks(root)


def test_malformed_rows_of_spec_formats(tmp_path):
    spec = {**GOOD, "labels": {"x": "ex", "y": "why"}}
    root = _write(tmp_path / "data", {"tasks/t.json": spec,
                                      "x.jsonl": '{"a": "one", "b": "x"}\n{"a": "two", "b": "z"}\n'})
    with pytest.raises(DataError, match=r"x.jsonl, line 2: label 'z' is not in the closed label set"):
        load_task("t", root)
    (root / "x.jsonl").write_text('{"a": "one", "b": "x"}\n{"a": 2, "b": "y"}\n')
    with pytest.raises(DataError, match=r"x.jsonl, line 2: expected an object with string a, b"):
        load_task("t", root)
    (root / "x.jsonl").write_text('{"a": "  ", "b": "x"}\n')
    with pytest.raises(DataError, match=r"x.jsonl, line 1: empty input"):
        load_task("t", root)


def test_label_words_only_for_specs_that_map_labels(tmp_path):
    root = write_tiny(tmp_path / "data")
    with pytest.raises(LiniclError, match="label_words: task 'commonsense_qa' is closed by a list"):
        load_task("commonsense_qa", root, label_words={"a": "A"})
    with pytest.raises(LiniclError, match="label_words: task 'antonym' is open-ended"):
        load_task("antonym", root, label_words={"a": "A"})


def test_the_documented_spec_example_loads(tmp_path):
    """The task spec example of the data guide (moved there from the README) loads as documented."""
    guide = (ROOT / "docs" / "guides" / "data-evaluation.md").read_text()
    block = guide[guide.index("## Data\n"):].split("```json\n", 1)[1].split("```", 1)[0]
    rows = [(p, h, g) for p, h, g in NLI_TRAIN]
    lines = "".join(json.dumps({"premise": p, "hypothesis": h, "label": g}) + "\n" for p, h, g in rows)
    root = _write(tmp_path / "data", {"tasks/readme_nli.json": block, "nli/train.jsonl": lines,
                                      "nli/dev.jsonl": lines})
    task = load_task("readme_nli", root)
    assert task.labels == ("yes", "no", "maybe")
    assert template_for(task).render(task.train[:1], task.test[0]).endswith("yes, no, or maybe?\nAnswer:")


def test_a_spec_may_pin_a_file_of_its_own_without_a_url(tmp_path):
    """size and sha256 without a url: checked like a download (size on load, SHA-256 on request), never
    fetched (a url still needs its sha256: the bad-spec table above)."""
    data = "".join(json.dumps({"a": f"q{i}", "b": f"r{i}"}) + "\n" for i in range(10))
    entry = {"path": "x.jsonl", "sha256": hashlib.sha256(data.encode()).hexdigest(), "size": len(data)}
    root = _write(tmp_path / "data", {"tasks/t.json": {**GOOD, "files": {"all": entry}}, "x.jsonl": data})
    spec = specs.find_spec("t", root)
    assert spec.files[0][1] == specs.FileSpec("x.jsonl", None, entry["sha256"], entry["size"])
    assert len(load_task("t", root, verify=True).test) == 3
    (root / "x.jsonl").write_text(data.replace("q1", "Q1"))
    with pytest.raises(DataError, match=r"x.jsonl: SHA-256 .* where its spec says .*put the file its spec"):
        load_task("t", root, verify=True)


# ----------------------------------------------------------------------------- the ICR suite's layouts

def _mc_item(stem, options, answer, labels=True):
    choices = [{"text": t, **({"label": "ABCDE"[i]} if labels else {})} for i, t in enumerate(options)]
    return json.dumps({"question": {"stem": stem, "choices": choices}, "answerKey": answer}) + "\n"


def test_multiple_choice_with_nested_keys_and_an_option_count(tmp_path):
    """CommonsenseQA/ARC: the stem and the options sit inside "question"; the options become the slot
    {choices} as lines "A. ..."; the answer is the letter of the option whose label it names; items
    with another number of options are left out when the spec says how many."""
    spec = {"format": "jsonl", "files": {"train": "mc/train.jsonl", "test": "mc/test.jsonl"},
            "fields": {"stem": "question.stem"}, "label_field": "answerKey",
            "choices": {"key": "question.choices", "text": "text", "label": "label", "count": 3},
            "labels": ["A", "B", "C"], "template": "csqa"}
    train = (_mc_item("Red?", [" rose", "sky", "grass"], "A") + _mc_item("Blue?", ["rose", "sky", "grass"], "B")
             + _mc_item("Four options?", ["a", "b", "c", "d"], "D") + _mc_item("Green?", ["x", "y", "grass"], "C"))
    root = _write(tmp_path / "d", {"tasks/mc.json": spec, "mc/train.jsonl": train,
                                   "mc/test.jsonl": _mc_item("Sky?", ["sea", "sky", "cloud"], "B")})
    task = load_task("mc", root)
    assert len(task.train) == 3 and [e.output for e in task.train] == ["A", "B", "C"]  # the 4-option item left out
    assert task.train[0] == Example("Red?\nA. rose\nB. sky\nC. grass", "A",
                                    (("stem", "Red?"), ("choices", "A. rose\nB. sky\nC. grass")))
    text = TEMPLATES["csqa"].render(task.train[:1], task.test[0])
    assert text.endswith("Question: Sky?\nA. sea\nB. sky\nC. cloud\nAnswer (A/B/C/D/E):")
    # Without option labels the answer is a 0-based position; an answer naming no option is refused.
    spec2 = {**spec, "choices": {"key": "question.choices", "text": "text"}}
    items = "".join(_mc_item(f"{q}?", ["u", "v", "w"], a, labels=False) for q, a in zip("PQRS", (2, 0, 2, 0)))
    _write(root, {"tasks/pos.json": {**spec2, "files": {"all": "pos.jsonl"}, "test_size": 2}, "pos.jsonl": items})
    task = load_task("pos", root)
    assert sorted((e.fields[0][1], e.output) for e in task.train + task.test) == [
        ("P?", "C"), ("Q?", "A"), ("R?", "C"), ("S?", "A")]
    _write(root, {"mc/test.jsonl": _mc_item("Sky?", ["sea", "sky", "cloud"], "E")})
    with pytest.raises(DataError, match=r"test.jsonl, line 1: the answer 'E' is none of the options"):
        load_task("mc", root)
    _write(root, {"mc/test.jsonl": json.dumps({"question": {"stem": "S", "choices": "abc"}, "answerKey": "A"})})
    with pytest.raises(DataError, match=r"line 1: expected 'question.choices' to hold a list"):
        load_task("mc", root)


def test_labels_in_a_file_of_their_own(tmp_path):
    """PIQA: the labels are lines of another file, aligned with the data rows."""
    rows = "".join(json.dumps({"goal": f"g{i}", "sol1": f"a{i}", "sol2": f"b{i}"}) + "\n" for i in range(6))
    spec = {"format": "jsonl", "files": {"all": "p/valid.jsonl"}, "label_files": {"all": "p/valid-labels.lst"},
            "test_size": 2, "fields": ["goal", "sol1", "sol2"], "labels": {"0": "A", "1": "B"}, "template": "piqa"}
    root = _write(tmp_path / "d", {"tasks/p.json": spec, "p/valid.jsonl": rows, "p/valid-labels.lst": "0\n1\n" * 3})
    task = load_task("p", root)
    everything = {e.fields[0][1]: e.output for e in task.train + task.test}
    assert everything == {f"g{i}": "AB"[i % 2] for i in range(6)} and len(task.test) == 2
    assert "p" in list_tasks(root)
    (root / "p/valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(DataError, match=r"valid-labels.lst: 2 labels for the 6 rows of .*valid.jsonl"):
        load_task("p", root)
    (root / "p/valid-labels.lst").unlink()
    assert "p" not in list_tasks(root)  # a task is listed only with all its files


def test_tab_separated_files_with_a_byte_order_mark_and_quotes(tmp_path):
    """MRPC: tab-separated, a header after a byte-order mark, quotes that are text."""
    text = ("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
            '1\t1\t2\tHe said "yes.\tHe agreed.\n0\t3\t4\tIt rained.\tIt was "sunny".\n')
    spec = {"format": "tsv", "files": {"train": "m.txt", "test": "m.txt"},
            "fields": {"sentence1": "#1 String", "sentence2": "#2 String"}, "label_field": "Quality",
            "labels": {"1": "A", "0": "B"}, "template": "mrpc"}
    root = _write(tmp_path / "d", {"tasks/m.json": spec, "m.txt": text})
    task = load_task("m", root)
    assert task.train[0] == Example('He said "yes.\nHe agreed.', "A",
                                    (("sentence1", 'He said "yes.'), ("sentence2", "He agreed.")))
    assert task.train[1].output == "B"
    _write(root, {"m.txt": text + "1\tonly three\tfields\n"})
    with pytest.raises(DataError, match=r"m.txt, line 4: expected 5 tab-separated fields, got 3"):
        load_task("m", root)
    _write(root, {"m.txt": "Quality\tS1\n1\tx\n"})
    with pytest.raises(DataError, match=r"line 1: expected a tab-separated header with the columns"):
        load_task("m", root)


def test_files_in_another_encoding(tmp_path):
    """MR is Windows Latin-1 (cp1252): read as the spec says; as UTF-8 it is refused by name."""
    spec = {"format": "label_text", "files": {"all": "mr.all"}, "test_size": 2, "encoding": "cp1252",
            "labels": {"0": "negative", "1": "positive"}, "template": "sst2"}
    root = tmp_path / "d"
    _write(root, {"tasks/mr.json": spec})
    rows = ["0 a clich\u00e9 \u2026 dull .", "1 a caf\u00e9 gem .", "0 flat .", "1 fine ."]
    (root / "mr.all").write_bytes("".join(r + "\n" for r in rows).encode("cp1252"))
    task = load_task("mr", root)
    assert {e.input for e in task.train + task.test} == {r[2:] for r in rows}
    _write(root, {"tasks/mr.json": {k: v for k, v in spec.items() if k != "encoding"}})
    with pytest.raises(DataError, match=r"mr.all: not valid UTF-8 at byte .*give its spec the file's encoding"):
        load_task("mr", root)


@pytest.mark.parametrize("change, key", [
    ({"label_files": {"all": "l.lst"}}, "label_field"),  # both label_field and label_files
    ({"label_files": {"train": "l.lst"}, "label_field": None}, "label_files"),  # roles differ from files'
    ({"choices": {"key": "c"}}, "choices"),
    ({"choices": {"key": "c", "text": "t", "count": 1}}, "choices.count"),
    ({"choices": {"key": "c", "text": ""}}, "text"),
    ({"fields": ["choices"]}, "fields"),
    ({"encoding": "latin-9"}, "encoding"),
    ({"format": "csv", "choices": {"key": "c", "text": "t"}}, "choices"),
    ({"format": "csv", "label_files": {"all": "l.lst"}, "label_field": None}, "label_files"),
])
def test_bad_keys_of_the_suite_layouts(tmp_path, change, key):
    bad = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = _write(tmp_path / "data", {"tasks/t.json": bad}) / "tasks" / "t.json"
    with pytest.raises(DataError) as err:
        load_task("t", tmp_path / "data")
    assert str(err.value).startswith(f"spec {path}: {key}:"), str(err.value)
