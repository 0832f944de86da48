"""Task loaders: the data sets (the full ones when LINICL_DATA_DIR is set or `linicl data fetch` filled the
cache, else the committed sample tests/fixtures/data), a small copy written here in the real formats,
malformed, truncated and one-class files, missing directories, deterministic splits. (Specs:
test_data_specs.py; downloads: test_data_fetch.py; the committed sample: test_data_fixture.py.)"""

import collections
import json
import shutil
import re
from pathlib import Path

import pytest
from helpers import DATA_FIXTURE, data_dir, full_data_dir

from linicl.data import (AGNEWS_LABEL_WORDS, CB_LABEL_WORDS_ABC, TREC_LABEL_WORDS_PAPER, DataError, Example,
                         list_tasks, load_task)
from linicl.data import datasets as ds
from linicl.data import specs
from linicl.errors import LiniclError

WORD_TASKS = ["antonym", "capitalize", "commonsense_qa", "country-capital", "country-currency",
              "english-french", "english-spanish", "landmark-country", "national_parks", "next_item",
              "person-instrument", "person-occupation", "present-past", "prev_item", "sentiment",
              "singular-plural", "synonym"]
# (train, test) sizes of the fixed-split tasks in the full data sets (the shared folder's README).
FIXED_SIZES = {"sst2": (6920, 1821), "trec": (5452, 500), "agnews": (6600, 1000), "cb": (250, 56),
               # the ICR suite (icr/ in the shared folder's README; piqa and mr are split from one file,
               # ai2sci keeps its items with four options)
               "csqa": (9741, 1221), "piqa": (1338, 500), "sst5": (8544, 2210), "mr": (9662, 1000),
               "mrpc": (4076, 1725), "copa": (368, 100), "creak": (10176, 1371), "ai2sci": (617, 531),
               "cb_abc": (250, 56)}


@pytest.fixture(scope="module")
def shared_dir() -> Path:
    """The data sets: the full ones when here ($LINICL_DATA_DIR, or the cache `linicl data fetch` filled),
    else the committed sample (helpers.data_dir)."""
    return data_dir()


@pytest.fixture(scope="module")
def full_dir() -> Path:
    """The full data sets, for the tests of the published files themselves (their checksums, row counts,
    the fingerprints of every task): no sample can stand in for those."""
    root = full_data_dir()
    if root is None:
        import os
        from helpers import missing_tasks
        where = Path(os.environ[ds.ENV_VAR]) if os.environ.get(ds.ENV_VAR) else ds.default_data_dir()
        pytest.skip(f"checks the full data sets: {where} ({ds.ENV_VAR} if set, else the cache) lacks the files of "
                    f"{missing_tasks(where)}; run `linicl data fetch` or set {ds.ENV_VAR} to a complete copy")
    return root


# ----------------------------------------------------------------------------- a tiny copy, real formats

SST2_TRAIN = "1 a gorgeous , witty film .\n0 dull and lifeless .\n\n1 a triumph .  \n0 boring .\n"
SST2_TEST = "0 a mess .\n1 lovely .\n"
TREC_TRAIN = ("DESC:manner How did serfdom develop ?\nABBR:exp What does NASA stand for ?\n"
              "HUM:ind Who wrote Hamlet ?\nLOC:city What city is the capital of France ?\n")
TREC_TEST = "NUM:date When did WW2 end ?\nENTY:animal What is a dog ?\n"
AGNEWS_CSV = ('Class Index,Title,Description\n'
              '3,Stocks up,"Shares rose  #36;10 on\\Monday, traders said."\n'
              '1,Talks fail,"Leaders #39; views:  quot;no quot;, and &lt;b&gt; left."\n'
              '2,Win!,The team won again.\n'
              '4,New chip,Intel ships a chip.\n'
              '3,Oil falls,Oil prices fell.\n'
              '2,Cup final,A final was played.\n')
CB_TRAIN = [("It rained.", "the ground is wet", "entailment"), ("He left.", "he stayed", "contradiction"),
            ("She smiled.", "she was happy", "neutral"), ("A dog barked.", "there is a dog", "entailment")]
CB_VAL = [("The door opened.", "the door is shut", "contradiction")]
ANTONYMS = [{"input": w, "output": a} for w, a in
            [("hot", "cold"), ("big", "small"), ("up", "down"), ("left", "right"), ("fast", "slow"),
             ("old", "new"), ("wet", "dry"), (" high ", " low\n"), ("light", "dark"), ("early", "late")]]
CSQA = [{"input": f"Question {i}?\na: x\nb: y\nc: z\nd: u\ne: v", "output": "abcde"[i % 5]}
        for i in range(20)]


def _jsonl(rows) -> str:
    return "".join(json.dumps({"premise": p, "hypothesis": h, "label": lab, "idx": i}) + "\n"
                   for i, (p, h, lab) in enumerate(rows))


def own_spec(name: str) -> dict:
    """The shipped spec of ``name`` for a copy of one's own: its files without url, size and sha256 (the
    loaders compare a file's size with its spec's, and these are not the published files)."""
    raw = json.loads((specs.SHIPPED_DIR / f"{name}.json").read_text(encoding="utf-8"))
    raw["files"] = {role: entry["path"] for role, entry in raw["files"].items()}
    raw.pop("extra_files", None)
    return raw


TINY_TASKS = ("sst2", "trec", "agnews", "cb", "antonym", "commonsense_qa")


def write_tiny(root: Path, overrides: dict | None = None) -> Path:
    """Write the tiny data set under root, with specs of its own (``own_spec``); files in ``overrides``
    replace or add contents."""
    files = {**{f"tasks/{name}.json": json.dumps(own_spec(name)) for name in TINY_TASKS},
             "classification/sst2/stsa.binary.train": SST2_TRAIN,
             "classification/sst2/stsa.binary.test": SST2_TEST,
             "classification/trec/train.txt": TREC_TRAIN, "classification/trec/test.txt": TREC_TEST,
             "classification/agnews/test.csv": AGNEWS_CSV,
             "classification/cb/train.jsonl": _jsonl(CB_TRAIN), "classification/cb/val.jsonl": _jsonl(CB_VAL),
             "word_tasks/antonym.json": json.dumps(ANTONYMS, indent=1),
             "word_tasks/commonsense_qa.json": json.dumps(CSQA), **(overrides or {})}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny(tmp_path / "data")


# ----------------------------------------------------------------------------- the shared folder

def test_list_tasks_on_shared_folder(shared_dir):
    assert list_tasks(shared_dir) == sorted([*FIXED_SIZES, *WORD_TASKS])


@pytest.mark.parametrize("name", [*FIXED_SIZES, *WORD_TASKS])
def test_every_task_loads_from_shared_folder(shared_dir, name):
    task = load_task(name, shared_dir)
    assert task.name == name and task.train and task.test
    for ex in task.train + task.test:
        assert isinstance(ex, Example) and ex.input == ex.input.strip() and ex.input
        assert ex.output == ex.output.strip() and ex.output
        if task.labels is not None:
            assert ex.output in task.labels
    if name in FIXED_SIZES and full_data_dir() is not None:
        assert (len(task.train), len(task.test)) == FIXED_SIZES[name]
    elif name not in FIXED_SIZES:  # the 30 % default, and nothing lost or duplicated by the split
        n = len(json.loads((shared_dir / "word_tasks" / f"{name}.json").read_text(encoding="utf-8")))
        assert len(task.train) + len(task.test) == n and len(task.test) == round(0.3 * n)
    assert (task.labels is None) == (name not in {*FIXED_SIZES, "commonsense_qa", "sentiment"})


def test_shared_label_sets_and_cleanup(shared_dir):
    assert load_task("trec", shared_dir).labels == ("Short", "Entity", "Description", "Person", "Location",
                                                    "Number")
    agnews = load_task("agnews", shared_dir)
    counts = collections.Counter(e.output for e in agnews.test)  # stratified: as many of each class
    assert counts == {w: len(agnews.test) // 4 for w in AGNEWS_LABEL_WORDS.values()}
    assert len(agnews.test) == 1000 or full_data_dir() is None
    texts = [e.input for e in agnews.train + agnews.test]
    assert not any(bad in t for t in texts for bad in ("\\", " #39;", " quot;", "&lt;", "  "))
    assert any("$" in t for t in texts) and any("'s" in t for t in texts)
    cb = load_task("cb", shared_dir)
    assert cb.labels == ("true", "false", "neither")
    assert all(e.input == f"{e.field_map()['premise']}\n{e.field_map()['hypothesis']}" for e in cb.test)


# ----------------------------------------------------------------------------- the tiny copy

def test_tiny_fixed_split_tasks(tiny):
    sst2 = load_task("sst2", tiny)
    assert sst2.train[0] == Example("a gorgeous , witty film .", "positive")
    assert [e.output for e in sst2.train] == ["positive", "negative", "positive", "negative"]
    assert sst2.train[2].input == "a triumph ." and len(sst2.test) == 2   # stripped; blank line skipped
    trec = load_task("trec", tiny)
    assert [e.output for e in trec.train] == ["Description", "Short", "Person", "Location"]
    assert trec.test[0] == Example("When did WW2 end ?", "Number")
    cb = load_task("cb", tiny)
    assert cb.labels == ("true", "false", "neither") and len(cb.train) == 4
    assert cb.test[0].field_map() == {"input": "The door opened.\nthe door is shut",
                                      "premise": "The door opened.", "hypothesis": "the door is shut"}
    assert cb.test[0].output == "false"


def test_tiny_agnews_split_and_cleanup(tiny):
    task = load_task("agnews", tiny, test_size=2)
    assert len(task.train) == 4 and len(task.test) == 2 and task.template == "agnews"
    everything = {e.input: e for e in task.train + task.test}
    assert "Stocks up. Shares rose $10 on Monday, traders said." in everything
    assert 'Talks fail. Leaders\' views: "no", and <b> left.' in everything
    assert "Win! The team won again." in everything                 # no doubled punctuation
    assert everything["Win! The team won again."].field_map()["title"] == "Win!"
    # Stratified: 2 of 6 rows, proportional to the class counts (two classes have 2 rows each).
    assert {e.output for e in task.test} <= {"Business", "Sports"}


def test_tiny_word_tasks(tiny):
    ant = load_task("antonym", tiny)
    assert ant.labels is None and ant.template == "qa" and (len(ant.train), len(ant.test)) == (7, 3)
    assert Example("high", "low") in ant.train + ant.test          # stripped
    csqa = load_task("commonsense_qa", tiny, test_size=5)
    assert csqa.labels == tuple("abcde") and sorted(e.output for e in csqa.test) == list("abcde")
    assert "\nb: y\n" in csqa.test[0].input                         # choices stay lines of the input
    # cb_abc reads cb's files (the ICR paper's A/B/C format)
    assert list_tasks(tiny) == ["agnews", "antonym", "cb", "cb_abc", "commonsense_qa", "sst2", "trec"]
    assert list_tasks(tiny, answers="open") == ["antonym"]
    assert list_tasks(tiny, answers="closed") == ["agnews", "cb", "cb_abc", "commonsense_qa", "sst2", "trec"]
    with pytest.raises(LiniclError, match="answers"):
        list_tasks(tiny, answers="words")


def test_split_is_deterministic_and_independent_of_row_order(tmp_path):
    a = write_tiny(tmp_path / "a")
    b = write_tiny(tmp_path / "b", {"word_tasks/antonym.json": json.dumps(ANTONYMS[::-1])})
    t1, t2 = load_task("antonym", a), load_task("antonym", b)
    assert t1 == load_task("antonym", a) and set(t1.test) == set(t2.test)
    others = {frozenset(load_task("antonym", a, split_seed=s).test) for s in range(1, 6)}
    assert len(others | {frozenset(t1.test)}) > 1
    assert len(load_task("antonym", a, test_size=0.5).test) == 5


def test_env_var_fallback_and_argument_precedence(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(ds.ENV_VAR, str(tiny))
    assert load_task("sst2").train == load_task("sst2", tiny).train
    other = write_tiny(tmp_path / "other", {"classification/sst2/stsa.binary.train": "0 only one .\n1 two .\n"})
    assert len(load_task("sst2", other).train) == 2                 # the argument wins over the env var


def test_label_word_overrides_and_relabel(tiny):
    trec = load_task("trec", tiny, label_words=TREC_LABEL_WORDS_PAPER)
    assert trec.train[1].output == "Abbreviation" and trec.labels[0] == "Abbreviation"
    assert load_task("cb", tiny, label_words=CB_LABEL_WORDS_ABC).labels == ("A", "B", "C")
    sst2 = load_task("sst2", tiny).relabel(["bad", "good"])
    assert sst2.labels == ("bad", "good") and sst2.train[0].output == "good"
    with pytest.raises(LiniclError, match="distinct"):
        load_task("sst2", tiny).relabel(["x", "x"])
    with pytest.raises(LiniclError, match="raw class"):
        load_task("sst2", tiny, label_words={"0": "bad"})
    with pytest.raises(LiniclError, match="open-ended"):
        load_task("antonym", tiny).relabel(["a"])


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("rel, content, where", [
    ("classification/sst2/stsa.binary.train", "1 fine .\n0 ok .\n2 bad label .\n", "line 3"),
    ("classification/sst2/stsa.binary.test", "1 fine .\n\n1\n", "line 3"),
    ("classification/trec/train.txt", "DESC:manner How ?\nWHAT is this ?\n", "line 2"),
    ("classification/trec/test.txt", "XYZ:foo Who ?\n", "line 1"),
    ("classification/agnews/test.csv", "Class,Title\n1,a,b\n", "line 1"),
    ("classification/agnews/test.csv", "Class Index,Title,Description\n1,a,b\n9,c,d\n", "line 3"),
    ("classification/agnews/test.csv", 'Class Index,Title,Description\n1,a,b\n2,"c\nd",e\n3,f\n', "line 5"),
    ("classification/cb/train.jsonl", '{"premise": "a", "hypothesis": "b", "label": "neutral"}\n{oops\n',
     "line 2"),
    ("classification/cb/val.jsonl", '{"premise": "a", "hypothesis": "b", "label": "maybe"}\n', "line 1"),
    ("classification/cb/val.jsonl", '{"premise": "a", "label": "neutral"}\n', "line 1"),
    ("word_tasks/antonym.json", '[{"input": "a", "output": "b"},\n {"input": "c", "output": }]', "line 2"),
    ("word_tasks/antonym.json", '[{"input": "a", "output": "b"}, {"input": "c"}]', "item 1"),
    ("word_tasks/antonym.json", '{"input": "a", "output": "b"}', "top level"),
    ("word_tasks/commonsense_qa.json", '[{"input": "q", "output": "f"}, {"input": "r", "output": "a"}]',
     "not in the closed label set"),
    ("classification/sst2/stsa.binary.train", b"1 caf\xe9 .\n", "not valid UTF-8"),
])
def test_malformed_files_name_file_and_line(tmp_path, rel, content, where):
    root = write_tiny(tmp_path / "data", {rel: content})
    task = rel.split("/")[1] if rel.startswith("classification/") else Path(rel).stem
    with pytest.raises(DataError) as err:
        load_task(task, root)
    assert str(root / rel) in str(err.value) and where in str(err.value)


def test_missing_directory_and_files_explain_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))  # the default folder is missing too
    with pytest.raises(DataError, match=f"no-cache/linicl/data.*{ds.ENV_VAR}.*linicl data fetch.*data_dir="):
        load_task("sst2")
    with pytest.raises(DataError, match=f"{ds.ENV_VAR}.*data_dir="):
        list_tasks()
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"{re.escape(str(missing))}.*from data_dir.*{ds.ENV_VAR}"):
        load_task("sst2", missing)
    monkeypatch.setenv(ds.ENV_VAR, str(missing))
    with pytest.raises(DataError, match=f"{re.escape(str(missing))}.*from {ds.ENV_VAR}"):
        load_task("sst2")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="classification/sst2/stsa.binary.train not found .spec .*sst2.json.*"
                                        "linicl data fetch sst2.*data_dir="):
        load_task("sst2", empty)
    with pytest.raises(DataError, match="unknown task 'nope'"):
        load_task("nope", empty)
    assert list_tasks(empty) == []
    assert issubclass(DataError, LiniclError) and issubclass(DataError, ValueError)


def test_bad_split_arguments(tiny):
    with pytest.raises(LiniclError, match="fixed train/test"):
        load_task("sst2", tiny, test_size=10)
    for bad in (0, 10, 1.0, "3", True):
        with pytest.raises(LiniclError, match="test_size"):
            load_task("antonym", tiny, test_size=bad)
    with pytest.raises(LiniclError, match="label_words"):
        load_task("antonym", tiny, label_words={"a": "b"})


# ----------------------------------------------------------------------------- files that are not their spec's

def test_a_file_cut_short_is_refused_on_load_naming_it_and_the_fix(tmp_path):
    """The issue: a cached stsa.binary.test cut mid-line loaded as 10 of 1,821 rows. Every load compares
    the size with the spec's: the committed sample's own spec, then the shipped one."""
    root = shutil.copytree(DATA_FIXTURE, tmp_path / "data")
    test = root / "classification/sst2/stsa.binary.test"
    whole = test.read_bytes()
    test.write_bytes(whole[:len(whole) // 2])  # mid-line: every line before the cut still parses
    with pytest.raises(DataError) as err:
        load_task("sst2", root)
    message = str(err.value)
    assert f"{test}: {len(whole) // 2:,} bytes where its spec says {len(whole):,}" in message
    assert f"(spec {root / 'tasks' / 'sst2.json'}): a truncated download" in message
    assert "linicl data fetch" not in message  # the sample's spec has no url: nothing to fetch
    (root / "tasks" / "sst2.json").unlink()  # now the shipped spec, with its url, size and sha256
    test.write_bytes(whole)
    with pytest.raises(DataError) as err:
        load_task("sst2", root)
    message = str(err.value)
    assert f"{root / 'classification/sst2/stsa.binary.train'}: " in message
    assert f"where its spec says 738,844 (spec {specs.SHIPPED_DIR / 'sst2.json'})" in message
    assert f"run `linicl data fetch sst2 --data-dir {root}` to download it again" in message


def test_verify_compares_the_checksum_too(tmp_path):
    """Same size, other bytes: only the SHA-256 tells (load_task(verify=True), `linicl data list`)."""
    root = write_tiny(tmp_path / "data")
    train = root / "classification/sst2/stsa.binary.train"
    sha = ds.sha256_of(train)
    pinned = {**own_spec("sst2"), "files": {"train": {"path": "classification/sst2/stsa.binary.train",
                                                      "sha256": sha, "size": train.stat().st_size},
                                            "test": "classification/sst2/stsa.binary.test"}}
    (root / "tasks/sst2.json").write_text(json.dumps(pinned))
    assert len(load_task("sst2", root, verify=True).train) == 4
    train.write_text(SST2_TRAIN.replace("witty", "silly"))  # as long as before
    assert len(load_task("sst2", root).train) == 4  # the size matches: a plain load cannot tell
    with pytest.raises(DataError, match=rf"{re.escape(str(train))}: SHA-256 [0-9a-f]{{16}}\.\.\. where its "
                                        rf"spec says {sha[:16]}\.\.\."):
        load_task("sst2", root, verify=True)


@pytest.mark.parametrize("rel, content, split", [
    ("classification/sst2/stsa.binary.test", "", "test"),
    ("classification/sst2/stsa.binary.test", "\n \n", "test"),
    ("classification/sst2/stsa.binary.train", "", "train"),
    ("classification/cb/val.jsonl", "", "test"),
])
def test_an_empty_split_is_refused_naming_task_split_and_file(tmp_path, rel, content, split):
    root = write_tiny(tmp_path / "data", {rel: content})
    task = rel.split("/")[1]
    with pytest.raises(DataError, match=rf"task '{task}', split '{split}': {re.escape(str(root / rel))} holds no "
                                        rf"examples"):
        load_task(task, root)


def test_a_one_class_demo_pool_is_refused_naming_task_split_and_file(tmp_path):
    only_positive = "1 good .\n1 fine .\n1 great .\n"
    root = write_tiny(tmp_path / "data", {"classification/sst2/stsa.binary.train": only_positive})
    train = root / "classification/sst2/stsa.binary.train"
    with pytest.raises(DataError, match=rf"task 'sst2', split 'train' \(the demonstration pool, "
                                        rf"{re.escape(str(train))}\): every example has the label 'positive' of "
                                        rf"\['negative', 'positive'\]"):
        load_task("sst2", root)
    # One file split in two: the pool is what the split leaves.
    csv_text = "Class Index,Title,Description\n" + "".join(f"2,Game {i},A match.\n" for i in range(6))
    root = write_tiny(tmp_path / "data2", {"classification/agnews/test.csv": csv_text})
    with pytest.raises(DataError, match=r"task 'agnews', split 'train' \(the demonstration pool, split from "
                                        r".*agnews/test.csv\): every example has the label 'Sports'"):
        load_task("agnews", root, test_size=2)
    # One class in the evaluation set is not refused (a subset of queries may well be one class).
    root = write_tiny(tmp_path / "data3", {"classification/sst2/stsa.binary.test": "1 nice .\n"})
    assert [e.output for e in load_task("sst2", root).test] == ["positive"]
