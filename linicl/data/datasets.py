"""In-context learning tasks read from a data directory: typed examples, fixed demo/test splits.

Where the data lives: every loader takes ``data_dir=None`` and falls back to the environment variable
``LINICL_DATA_DIR``. Paths below are relative to that root (the layout of the project's shared data
folder; a user keeps a copy with the same sub-layout anywhere)::

    classification/sst2/stsa.binary.{train,test}   "<0|1> <text>" per line
    classification/trec/{train,test}.txt           "COARSE:fine question" per line
    classification/agnews/test.csv                 header "Class Index,Title,Description"
    classification/cb/{train,val}.jsonl            {"premise", "hypothesis", "label"} per line
    word_tasks/<name>.json                         [{"input": ..., "output": ...}, ...]

Tasks and their splits (``Task.train`` is the demonstration pool, ``Task.test`` the evaluation set):

* ``sst2``: stsa.binary.train / stsa.binary.test (dev is not used). Labels negative, positive.
* ``trec``: train.txt / test.txt, coarse classes only (``TREC_LABEL_WORDS``).
* ``agnews``: only test.csv (7,600 rows) exists, so it is split deterministically, stratified by class,
  into an evaluation set of ``test_size`` rows (default 1,000) and a demo pool (the rest).
* ``cb``: train.jsonl (250) / val.jsonl (56, the SuperGLUE validation set that papers report on);
  test.jsonl has no labels and is not read.
* every ``word_tasks/<name>.json`` as ``<name>``: split deterministically into test (``test_size``,
  default 30 %) and demo pool. ``commonsense_qa`` (letters a-e) and ``sentiment`` (negative/positive)
  have a closed label set and are split stratified; the others are open-ended (``labels=None``).

Deterministic splits sort examples by a BLAKE2 hash of (split_seed, input, output), so a split does
not depend on the file's row order, on NumPy's generator streams, or on the platform.

Text cleanup is minimal: surrounding whitespace is stripped everywhere (internal newlines kept: the
commonsense_qa choices are lines of the input). AG News additionally gets its escapes undone (see
``_clean_agnews``). SST-2 and TREC keep their original tokenised text ("wo n't", " ?").
Malformed files raise ``DataError`` naming the file and the line (JSON lists: the item index).
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from linicl.errors import DataError, LiniclError  # noqa: F401  (DataError is part of this module's API)

ENV_VAR = "LINICL_DATA_DIR"
_FIX = f"set {ENV_VAR}=/path/to/data or pass data_dir="

# Label words: raw class in the file -> the word a model must produce. Single words, chosen to be one
# token with a leading space in the GPT-2 BPE (routing.md §6.1); check with prompts.check_label_words
# for any other tokenizer. Order of the dict = order of Task.labels.
SST2_LABEL_WORDS = {"0": "negative", "1": "positive"}
# The ICR paper's words, except ABBR: " Abbreviation" is 3 GPT-2 tokens, " Short" is one.
TREC_LABEL_WORDS = {"ABBR": "Short", "ENTY": "Entity", "DESC": "Description", "HUM": "Person",
                    "LOC": "Location", "NUM": "Number"}
TREC_LABEL_WORDS_PAPER = {**TREC_LABEL_WORDS, "ABBR": "Abbreviation"}
AGNEWS_LABEL_WORDS = {"1": "World", "2": "Sports", "3": "Business", "4": "Technology"}
# The GPT-3 / Zhao et al. (2021) CB format "... true, false, or neither?"; the ICR paper instead asks
# for A/B/C (use label_words=CB_LABEL_WORDS_ABC with the "cb_abc" template).
CB_LABEL_WORDS = {"entailment": "true", "contradiction": "false", "neutral": "neither"}
CB_LABEL_WORDS_ABC = {"entailment": "A", "contradiction": "B", "neutral": "C"}
LABEL_WORDS = {"sst2": SST2_LABEL_WORDS, "trec": TREC_LABEL_WORDS, "agnews": AGNEWS_LABEL_WORDS,
               "cb": CB_LABEL_WORDS}
# Word tasks whose outputs form a closed set: they are classification tasks (balanced demos).
CLOSED_WORD_TASKS = {"commonsense_qa": ("a", "b", "c", "d", "e"), "sentiment": ("negative", "positive")}

_FILES = {"sst2": ("classification/sst2/stsa.binary.train", "classification/sst2/stsa.binary.test"),
          "trec": ("classification/trec/train.txt", "classification/trec/test.txt"),
          "agnews": ("classification/agnews/test.csv",),
          "cb": ("classification/cb/train.jsonl", "classification/cb/val.jsonl")}
_WORD_DIR = "word_tasks"


@dataclass(frozen=True)
class Example:
    """One input/output pair. ``output`` is the label word (classification) or the answer string.

    ``fields`` holds named parts of the input for templates with several slots (CB: premise and
    hypothesis; AG News: title and description); ``input`` is always the whole input as one string.
    """
    input: str
    output: str
    fields: tuple[tuple[str, str], ...] = ()

    def field_map(self) -> dict[str, str]:
        """``{"input": input, **fields}``: what a template's ``{name}`` slots may refer to."""
        return {"input": self.input, **dict(self.fields)}


@dataclass(frozen=True)
class Task:
    """A task: demonstration pool ``train``, evaluation set ``test``, closed label set ``labels``
    (label words, in class order; None for open-ended tasks), and the name of its default template
    in ``linicl.data.prompts.TEMPLATES``."""
    name: str
    train: tuple[Example, ...]
    test: tuple[Example, ...]
    labels: tuple[str, ...] | None
    template: str = "qa"

    @property
    def is_classification(self) -> bool:
        return self.labels is not None

    def relabel(self, words: Sequence[str]) -> Task:
        """The same task with label word ``labels[i]`` replaced by ``words[i]`` everywhere (e.g. new
        label words for a pseudo out-of-distribution variant)."""
        if self.labels is None:
            raise LiniclError(f"relabel: task {self.name!r} is open-ended (labels=None)")
        words = tuple(words)
        if len(words) != len(self.labels) or len(set(words)) != len(words):
            raise LiniclError(f"relabel: words must be {len(self.labels)} distinct strings (one per label "
                              f"of {self.labels}), got {words}")
        new = dict(zip(self.labels, words))

        def swap(exs):
            return tuple(replace(e, output=new[e.output]) for e in exs)
        return replace(self, train=swap(self.train), test=swap(self.test), labels=words)


# ----------------------------------------------------------------------------- paths and files

def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir``, else ``$LINICL_DATA_DIR``; DataError if neither is set or it is not a directory."""
    source = "data_dir" if data_dir is not None else ENV_VAR
    raw = data_dir if data_dir is not None else os.environ.get(ENV_VAR)
    if raw is None or str(raw) == "":
        raise DataError(f"no data directory: data_dir is None and {ENV_VAR} is not set ({_FIX})")
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise DataError(f"data directory {str(path)!r} (from {source}) does not exist or is not a "
                        f"directory ({_FIX})")
    return path


def _file(root: Path, rel: str) -> Path:
    path = root / rel
    if not path.is_file():
        raise DataError(f"missing data file {str(path)!r}: expected <data_dir>/{rel} under data "
                        f"directory {str(root)!r} ({_FIX} pointing at a copy with that layout)")
    return path


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte {e.start} (re-save the file as UTF-8)") from None


def _lines(path: Path):
    """(line number, stripped line) for every non-blank line; blank lines are skipped."""
    for no, line in enumerate(_read_text(path).splitlines(), start=1):
        if line.strip():
            yield no, line.strip()


def _bad(path: Path, where: str, why: str) -> DataError:
    return DataError(f"{path}, {where}: {why}")


# ----------------------------------------------------------------------------- parsers (one per format)

def _parse_sst2(path: Path, words: Mapping[str, str]) -> list[Example]:
    out = []
    for no, line in _lines(path):
        cls, _, text = line.partition(" ")
        if cls not in words or not text.strip():
            raise _bad(path, f"line {no}", f"expected '<0|1> <text>', got {line[:60]!r}")
        out.append(Example(text.strip(), words[cls]))
    return out


def _parse_trec(path: Path, words: Mapping[str, str]) -> list[Example]:
    out = []
    for no, line in _lines(path):
        head, _, text = line.partition(" ")
        coarse, colon, fine = head.partition(":")
        if coarse not in words or not colon or not fine or not text.strip():
            raise _bad(path, f"line {no}", f"expected 'COARSE:fine question' with COARSE in "
                       f"{sorted(words)}, got {line[:60]!r}")
        out.append(Example(text.strip(), words[coarse]))
    return out


_AG_ENTITY = re.compile(r" ?#(\d+);| (quot|amp|lt|gt);")


def _clean_agnews(text: str) -> str:
    """Undo AG News escaping. A backslash stands for a line break (-> space). The '&' of HTML entities
    became a space ("Sony&#146;s" -> "Sony #146;s", "&quot;" -> " quot;"), so " #NN;" and " quot;",
    " amp;", " lt;", " gt;" are read as entities, and "&lt;" etc. are unescaped too. Runs of
    whitespace are collapsed; HTML tags that remain are kept."""
    text = _AG_ENTITY.sub(lambda m: f"&#{m[1]};" if m[1] else f"&{m[2]};", text.replace("\\", " "))
    return re.sub(r"\s+", " ", html.unescape(text)).strip()


def _join_title(title: str, desc: str) -> str:
    """"Title. Description", without doubling a title's own end punctuation."""
    if not title or not desc:
        return title or desc
    return f"{title} {desc}" if title.endswith((".", "?", "!")) else f"{title}. {desc}"


def _parse_agnews(path: Path, words: Mapping[str, str]) -> list[Example]:
    rows = csv.reader(io.StringIO(_read_text(path), newline=""))
    header = next(rows, None)
    if header != ["Class Index", "Title", "Description"]:
        raise _bad(path, "line 1", f"expected the header 'Class Index,Title,Description', got {header}")
    out = []
    # csv joins quoted multi-line fields, so report the reader's own line number.
    for row in rows:
        if not row:
            continue
        if len(row) != 3 or row[0].strip() not in words:
            raise _bad(path, f"line {rows.line_num}", f"expected 3 fields with class in {sorted(words)}, "
                       f"got {row!r:.80}")
        title, desc = _clean_agnews(row[1]), _clean_agnews(row[2])
        joined = _join_title(title, desc)
        if not joined:
            raise _bad(path, f"line {rows.line_num}", "empty title and description")
        out.append(Example(joined, words[row[0].strip()], (("title", title), ("description", desc))))
    return out


def _parse_cb(path: Path, words: Mapping[str, str]) -> list[Example]:
    out = []
    for no, line in _lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, f"line {no}", f"invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in
                                                ("premise", "hypothesis", "label")):
            raise _bad(path, f"line {no}", "expected an object with string premise, hypothesis, label")
        if obj["label"] not in words:
            raise _bad(path, f"line {no}", f"label {obj['label']!r} not in {sorted(words)}")
        p, h = obj["premise"].strip(), obj["hypothesis"].strip()
        out.append(Example(f"{p}\n{h}", words[obj["label"]], (("premise", p), ("hypothesis", h))))
    return out


def _parse_word_task(path: Path) -> list[Example]:
    try:
        items = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise _bad(path, f"line {e.lineno}", f"invalid JSON ({e.msg})") from None
    if not isinstance(items, list) or not items:
        raise _bad(path, "top level", "expected a non-empty JSON list of {\"input\", \"output\"} objects")
    out = []
    for i, item in enumerate(items):
        ok = isinstance(item, dict) and all(isinstance(item.get(k), str) and item[k].strip()
                                            for k in ("input", "output"))
        if not ok:
            raise _bad(path, f"item {i}", f"expected non-empty string 'input' and 'output', got {item!r:.80}")
        out.append(Example(item["input"].strip(), item["output"].strip()))
    return out


# ----------------------------------------------------------------------------- deterministic splits

def _hash_key(seed: int, ex: Example) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{ex.input}\x00{ex.output}".encode(), digest_size=8).digest()


def _n_test(test_size: int | float, n: int, name: str) -> int:
    """Rows in the test set: an int count or a fraction in (0, 1); both sides must be non-empty."""
    if isinstance(test_size, bool) or not isinstance(test_size, (int, float, np.integer, np.floating)):
        raise LiniclError(f"test_size must be an int count or a float fraction, got {test_size!r}")
    count = round(test_size * n) if isinstance(test_size, (float, np.floating)) else int(test_size)
    if not 0 < count < n:
        raise LiniclError(f"test_size={test_size!r} gives {count} of the {n} examples of {name!r} to the "
                          f"test set; both the test set and the demo pool must be non-empty")
    return count


def split_examples(examples: Sequence[Example], n_test: int, seed: int,
          labels: Sequence[str] | None = None) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(train, test) with ``n_test`` test examples chosen by hash order. With ``labels``, stratified:
    each label gets a share of n_test proportional to its count (largest remainders). Both parts keep
    the input order."""
    order = sorted(range(len(examples)), key=lambda i: (_hash_key(seed, examples[i]), i))
    if labels is None:
        chosen = set(order[:n_test])
    else:
        groups = {lab: [i for i in order if examples[i].output == lab] for lab in labels}
        exact = {lab: n_test * len(g) / len(examples) for lab, g in groups.items()}
        quota = {lab: int(x) for lab, x in exact.items()}
        for lab in sorted(exact, key=lambda lab: quota[lab] - exact[lab])[:n_test - sum(quota.values())]:
            quota[lab] += 1
        chosen = {i for lab, g in groups.items() for i in g[:quota[lab]]}
    train = tuple(e for i, e in enumerate(examples) if i not in chosen)
    return train, tuple(e for i, e in enumerate(examples) if i in chosen)


# ----------------------------------------------------------------------------- public loaders

def list_tasks(data_dir: str | os.PathLike | None = None) -> list[str]:
    """Names of the tasks whose files are present under the data directory, sorted."""
    root = resolve_data_dir(data_dir)
    names = [n for n, files in _FILES.items() if all((root / f).is_file() for f in files)]
    names += [p.stem for p in (root / _WORD_DIR).glob("*.json")]
    return sorted(set(names))


def _label_words(name: str, label_words: Mapping[str, str] | None) -> dict[str, str]:
    default = LABEL_WORDS[name]
    if label_words is None:
        return dict(default)
    words = dict(label_words)
    if set(words) != set(default) or len(set(words.values())) != len(words):
        raise LiniclError(f"label_words for {name!r} must map each raw class {sorted(default)} to a "
                          f"distinct word, got {words}")
    return {k: words[k] for k in default}


def load_task(name: str, data_dir: str | os.PathLike | None = None, *,
              test_size: int | float | None = None, split_seed: int = 0,
              label_words: Mapping[str, str] | None = None) -> Task:
    """Load task ``name`` (see the module docstring for the tasks, files and splits).

    test_size: agnews and word tasks only: evaluation rows as a count or a fraction (defaults 1,000 and
        0.3). The other tasks have fixed splits and refuse it.
    split_seed: seed of the hash-ordered split (agnews and word tasks).
    label_words: classification tasks from ``classification/`` only: raw class -> label word, replacing
        the defaults in ``LABEL_WORDS[name]`` (e.g. ``TREC_LABEL_WORDS_PAPER``, ``CB_LABEL_WORDS_ABC``).
    """
    root = resolve_data_dir(data_dir)
    if name in _FILES:
        words = _label_words(name, label_words)
        paths = [_file(root, f) for f in _FILES[name]]
        labels = tuple(words.values())
        if name == "agnews":
            examples = _parse_agnews(paths[0], words)
            n = _n_test(1000 if test_size is None else test_size, len(examples), name)
            train, test = split_examples(examples, n, split_seed, labels)
        else:
            if test_size is not None:
                raise LiniclError(f"test_size: task {name!r} has fixed train/test files; leave it None")
            parse: Callable = {"sst2": _parse_sst2, "trec": _parse_trec, "cb": _parse_cb}[name]
            train, test = (tuple(parse(p, words)) for p in paths)
        return Task(name, train, test, labels, template=name)
    word_file = root / _WORD_DIR / f"{name}.json"
    if not word_file.is_file():
        known = list_tasks(root) if (root / _WORD_DIR).is_dir() else sorted(_FILES)
        raise DataError(f"unknown task {name!r}: no file {str(word_file)!r} (tasks available under "
                        f"{str(root)!r}: {known}; {_FIX})")
    if label_words is not None:
        raise LiniclError(f"label_words: word task {name!r} uses its outputs as label words; use "
                          f"Task.relabel instead")
    examples = _parse_word_task(word_file)
    labels = CLOSED_WORD_TASKS.get(name)
    if labels is not None and (bad := {e.output for e in examples} - set(labels)):
        raise _bad(word_file, "outputs", f"{sorted(bad)[:5]} are not in the closed label set {labels}")
    n = _n_test(0.3 if test_size is None else test_size, len(examples), name)
    train, test = split_examples(examples, n, split_seed, labels)
    return Task(name, train, test, labels, template="qa")
