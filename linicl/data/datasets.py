"""In-context learning tasks read from a data directory: typed examples, fixed demo/test splits.

A task is data: its spec (``linicl.data.specs``, a JSON file shipped in ``linicl/data/tasks/`` or put
in ``<data_dir>/tasks/``) names its files, their format, the fields of the input, the label words and
the default template. This module reads the formats, splits and returns ``Task`` objects.

Where the data lives: ``data_dir=``, else the environment variable ``LINICL_DATA_DIR``, else the
per-user cache ``default_data_dir()`` (``~/.cache/linicl/data``), where ``linicl data fetch`` puts the
data sets. Paths below are relative to that root (the layout of the project's shared data folder)::

    classification/sst2/stsa.binary.{train,test}   "<0|1> <text>" per line             (label_text)
    classification/trec/{train,test}.txt           "COARSE:fine question" per line     (trec)
    classification/agnews/test.csv                 header "Class Index,Title,Description" (csv)
    classification/cb/{train,val}.jsonl            {"premise", "hypothesis", "label"}  (jsonl)
    word_tasks/<name>.json                         [{"input": ..., "output": ...}, ...] (pairs_json)
    icr/<task>/...                                 the ICR paper's suite (below; each spec says)

The shipped tasks and their splits (``Task.train`` is the demonstration pool, ``Task.test`` the
evaluation set):

* ``sst2``: stsa.binary.train / stsa.binary.test (dev is not used). Labels negative, positive.
* ``trec``: train.txt / test.txt, coarse classes only (``TREC_LABEL_WORDS``).
* ``agnews``: only test.csv (7,600 rows) exists, so it is split deterministically, stratified by class,
  into an evaluation set of ``test_size`` rows (default 1,000) and a demo pool (the rest).
* ``cb``: train.jsonl (250) / val.jsonl (56, the SuperGLUE validation set that papers report on);
  test.jsonl has no labels and is not read.
* the rest of the ICR paper's suite (routing.md section 4; Table-6 templates, answers as letters for
  multiple choice): ``csqa`` (official train / dev), ``piqa`` (only the validation file is public
  offline: 500 evaluation items, the rest a pool), ``sst5``, ``mr`` (one cp1252 file: 1,000 evaluation
  items), ``mrpc`` (tab-separated), ``cb_abc`` (cb's files, A/B/C), ``copa`` (train / val), ``creak``
  (train / dev), ``ai2sci`` (AI2 elementary science, the items with four options).
* every ``word_tasks/<name>.json`` as ``<name>``: split deterministically into test (``test_size``,
  default 30 %) and demo pool. ``commonsense_qa`` (letters a-e) and ``sentiment`` (negative/positive)
  have a closed label set (a list in their specs) and are split stratified; the others are open-ended
  (``labels=None``). A word-task file with no spec is read as an open one.

Deterministic splits sort examples by a BLAKE2 hash of (split_seed, input, output), so a split does
not depend on the file's row order, on NumPy's generator streams, or on the platform.

Text cleanup is minimal: surrounding whitespace is stripped everywhere (internal newlines kept: the
commonsense_qa choices are lines of the input). AG News additionally gets its escapes undone (spec
``"clean": "agnews"``, see ``_clean_agnews``). SST-2 and TREC keep their original tokenised text
("wo n't", " ?"). Malformed files raise ``DataError`` naming the file and the line (JSON lists: the
item index); a missing file names the spec that wants it.

A file whose size differs from the ``size`` its spec gives (a download cut short, another version) is
refused on every load (a stat: free); ``load_task(verify=True)`` and ``linicl data list`` also compare
its SHA-256 with the spec's. A split with no examples, and a demonstration pool of a classification
task that holds a single class, are refused naming the task, the split and the file. A copy of one's
own in the published layout (other rows: a sample, an edited file) gives its tasks specs of its own in
``<data_dir>/tasks/`` with its sizes and checksums, or none.
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

from linicl.data.specs import (CHOICE_LETTERS, CHOICES_SLOT, SPEC_DIR, FileSpec, TaskSpec, all_specs,
                               find_spec)
from linicl.errors import DataError, LiniclError  # noqa: F401  (DataError is part of this module's API)

ENV_VAR = "LINICL_DATA_DIR"
_FIX = f"set {ENV_VAR}=/path/to/data or pass data_dir="

# Label words: raw class in the file -> the word a model must produce. Single words, chosen to be one
# token with a leading space in the GPT-2 BPE (routing.md §6.1); check with prompts.check_label_words
# for any other tokenizer. Order of the dict = order of Task.labels. The shipped specs hold the same
# defaults (a test keeps them equal); the alternatives are for load_task(label_words=...).
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
    (label words, in class order; None for open-ended tasks), and its default template: the name of
    one in ``linicl.data.prompts.TEMPLATES``, or, when ``template_fields`` is not empty, the Template
    built from those (field, value) pairs (a template written in the task's spec)."""
    name: str
    train: tuple[Example, ...]
    test: tuple[Example, ...]
    labels: tuple[str, ...] | None
    template: str = "qa"
    template_fields: tuple[tuple[str, str], ...] = ()

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


# ----------------------------------------------------------------------------- the data directory

def default_data_dir() -> Path:
    """The per-user data cache: ``$XDG_CACHE_HOME/linicl/data``, else ``~/.cache/linicl/data``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "linicl" / "data"


def locate_data_dir(data_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """(folder, where that choice came from): ``data_dir``, else ``$LINICL_DATA_DIR``, else
    ``default_data_dir()``. The folder may not exist (``linicl data fetch`` creates it)."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser(), "data_dir"
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser(), ENV_VAR
    return default_data_dir(), "default"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """``locate_data_dir``'s folder; DataError saying how to get the data when it is not a directory."""
    path, source = locate_data_dir(data_dir)
    if path.is_dir():
        return path
    if source == "default":
        raise DataError(f"data directory {str(path)!r} (the default cache, as {ENV_VAR} is not set) does not "
                        f"exist: run `linicl data fetch` to download the data sets into it, or {_FIX}")
    raise DataError(f"data directory {str(path)!r} (from {source}) does not exist or is not a directory "
                    f"({_FIX}; or run `linicl data fetch --data-dir {path}`)")


def _file(root: Path, spec: TaskSpec, file: FileSpec, checksum: bool = False) -> Path:
    path = root / file.path
    if not path.is_file():
        fetch = f"run `linicl data fetch {spec.name}`, or " if file.url else ""
        raise DataError(f"{path} not found (spec {spec.where}): expected <data_dir>/{file.path} under data "
                        f"directory {str(root)!r}; {fetch}{_FIX} pointing at a copy with that layout")
    return _checked(path, spec, file, root, checksum)


def sha256_of(path: Path) -> str:
    """The SHA-256 of the file ``path``, hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_problem(path: Path, file: FileSpec, *, checksum: bool = False) -> str | None:
    """Why the present file ``path`` is not the one spec entry ``file`` describes: its size differs
    from ``file.size`` (a stat), or, with ``checksum``, its SHA-256 from ``file.sha256`` (reads the
    file); None when it matches, or the spec gives neither."""
    if file.size is not None and (size := path.stat().st_size) != file.size:
        return f"{size:,} bytes where its spec says {file.size:,}"
    if checksum and file.sha256 is not None and (got := sha256_of(path)) != file.sha256:
        return f"SHA-256 {got[:16]}... where its spec says {file.sha256[:16]}..."
    return None


def refetch_hint(spec: TaskSpec, root: Path) -> str:
    """How to get the files a spec describes back into ``root``."""
    if all(f.url for f in spec.all_files()):
        return f"run `linicl data fetch {spec.name} --data-dir {root}` to download it again"
    return "put the file its spec describes there"


def _checked(path: Path, spec: TaskSpec, file: FileSpec, root: Path, checksum: bool) -> Path:
    """``path`` when it is the file its spec describes (``file_problem``); DataError otherwise."""
    if problem := file_problem(path, file, checksum=checksum):
        own = root / SPEC_DIR / f"{spec.name}.json"
        other = "" if spec.origin == own else \
            f"; for a file of your own, give the task a spec of its own, {own}, without size and sha256"
        raise DataError(f"{path}: {problem} (spec {spec.where}): a truncated download or another version "
                        f"of the file; {refetch_hint(spec, root)}{other}")
    return path


def _read_text(path: Path, encoding: str = "utf-8") -> str:
    try:
        return path.read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        name = {"utf-8": "UTF-8", "cp1252": "cp1252"}.get(encoding, encoding)
        raise DataError(f"{path}: not valid {name} at byte {e.start} (re-save the file as UTF-8, or give its "
                        f"spec the file's encoding)") from None


def _lines(path: Path, encoding: str = "utf-8"):
    """(line number, stripped line) for every non-blank line; blank lines are skipped."""
    for no, line in enumerate(_read_text(path, encoding).splitlines(), start=1):
        if line.strip():
            yield no, line.strip()


def _bad(path: Path, where: str, why: str) -> DataError:
    return DataError(f"{path}, {where}: {why}")


# ----------------------------------------------------------------------------- text: cleanup and joins

_AG_ENTITY = re.compile(r" ?#(\d+);| (quot|amp|lt|gt);")


def _clean_agnews(text: str) -> str:
    """Undo AG News escaping. A backslash stands for a line break (-> space). The '&' of HTML entities
    became a space ("Sony&#146;s" -> "Sony #146;s", "&quot;" -> " quot;"), so " #NN;" and " quot;",
    " amp;", " lt;", " gt;" are read as entities, and "&lt;" etc. are unescaped too. Runs of
    whitespace are collapsed; HTML tags that remain are kept."""
    text = _AG_ENTITY.sub(lambda m: f"&#{m[1]};" if m[1] else f"&{m[2]};", text.replace("\\", " "))
    return re.sub(r"\s+", " ", html.unescape(text)).strip()


def _join_sentences(parts: Sequence[str]) -> str:
    """"Title. Description": a period between parts, unless the left one already ends a sentence;
    empty parts are left out."""
    out = ""
    for part in parts:
        if not out or not part:
            out = out or part
        else:
            out = f"{out} {part}" if out.endswith((".", "?", "!")) else f"{out}. {part}"
    return out


# Keyed by the names of the spec format (specs.CLEANERS, specs.JOINS).
CLEANERS: dict[str, Callable[[str], str]] = {"strip": str.strip, "agnews": _clean_agnews}
JOINS: dict[str, Callable[[Sequence[str]], str]] = {"newline": "\n".join, "space": " ".join,
                                                    "sentence": _join_sentences}


def _label(path: Path, where: str, raw: str, words: Mapping[str, str] | None) -> str:
    """The output of an example: the label word of raw label ``raw`` (closed), or ``raw`` (open)."""
    raw = raw.strip()
    if words is None:
        if not raw:
            raise _bad(path, where, "empty answer")
        return raw
    if raw not in words:
        raise _bad(path, where, f"label {raw!r} is not in the closed label set {list(words)}")
    return words[raw]


def _from_fields(path: Path, where: str, spec: TaskSpec, values: Sequence[str], raw_label: str,
                 words: Mapping[str, str] | None) -> Example:
    """An example from the raw values of the spec's fields (in order): cleaned, named, joined."""
    return _from_named(path, where, spec, list(zip([n for n, _ in spec.fields], values)), raw_label, words)


def _from_named(path: Path, where: str, spec: TaskSpec, named: Sequence[tuple[str, str]], raw_label: str,
                words: Mapping[str, str] | None) -> Example:
    """An example from (field name, raw value) pairs: cleaned, joined into the whole input."""
    clean = CLEANERS[spec.clean]
    named = tuple((name, clean(v)) for name, v in named)
    text = JOINS[spec.join]([v for _, v in named])
    if not text.strip():
        raise _bad(path, where, f"empty input (fields {[name for name, _ in named]})")
    return Example(text, _label(path, where, raw_label, words), named)


# ----------------------------------------------------------------------------- parsers (one per format)
# Each reads one file into examples: parse(path, spec, words), words = raw label -> word (None: open).

def _parse_label_text(path: Path, spec: TaskSpec, words: Mapping[str, str] | None) -> list[Example]:
    out = []
    for no, line in _lines(path, spec.encoding):
        raw, _, text = line.partition(" ")
        text = CLEANERS[spec.clean](text)
        if not text or (words is not None and raw not in words):
            raise _bad(path, f"line {no}", f"expected '<label> <text>' with a label in "
                       f"{list(words or ['<answer>'])}, got {line[:60]!r}")
        out.append(Example(text, _label(path, f"line {no}", raw, words)))
    return out


def _parse_trec(path: Path, spec: TaskSpec, words: Mapping[str, str] | None) -> list[Example]:
    out = []
    for no, line in _lines(path, spec.encoding):
        head, _, text = line.partition(" ")
        coarse, colon, fine = head.partition(":")
        text = CLEANERS[spec.clean](text)
        if not colon or not fine or not text or (words is not None and coarse not in words):
            raise _bad(path, f"line {no}", f"expected 'COARSE:fine question' with COARSE in "
                       f"{sorted(words or ['<answer>'])}, got {line[:60]!r}")
        out.append(Example(text, _label(path, f"line {no}", coarse, words)))
    return out


def _column_indices(path: Path, spec: TaskSpec, header: Sequence[str], what: str) -> list[int]:
    """Positions in ``header`` of the spec's field columns, then its label column (csv, tsv)."""
    columns = [col for _, col in spec.fields] + [spec.label_field]
    if missing := [col for col in columns if col not in header]:
        raise _bad(path, "line 1", f"expected {what} with the columns {columns} (spec {spec.where}), "
                   f"got {list(header)}; missing {missing}")
    return [header.index(col) for col in columns]


def _parse_csv(path: Path, spec: TaskSpec, words: Mapping[str, str] | None) -> list[Example]:
    rows = csv.reader(io.StringIO(_read_text(path, spec.encoding), newline=""))
    header = next(rows, None) or []
    at = _column_indices(path, spec, header, "a header")
    out = []
    # csv joins quoted multi-line fields, so report the reader's own line number.
    for row in rows:
        if not row:
            continue
        where = f"line {rows.line_num}"
        if len(row) != len(header):
            raise _bad(path, where, f"expected {len(header)} fields ({','.join(header)}), got {row!r:.80}")
        values = [row[i] for i in at]
        out.append(_from_fields(path, where, spec, values[:-1], values[-1], words))
    return out


def _parse_tsv(path: Path, spec: TaskSpec, words: Mapping[str, str] | None) -> list[Example]:
    """Tab-separated with a header row and no quoting (MRPC's sentences hold unbalanced quotes)."""
    lines = _read_text(path, spec.encoding).lstrip("\ufeff").splitlines()
    header = lines[0].split("\t") if lines else []
    at = _column_indices(path, spec, header, "a tab-separated header")
    out = []
    for no, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        row = line.split("\t")
        if len(row) != len(header):
            raise _bad(path, f"line {no}", f"expected {len(header)} tab-separated fields, got {len(row)}: "
                       f"{line[:80]!r}")
        values = [row[i] for i in at]
        out.append(_from_fields(path, f"line {no}", spec, values[:-1], values[-1], words))
    return out


def _get(obj, key: str):
    """``obj[key]``, where "a.b" reads obj["a"]["b"]; None when a part is missing."""
    for part in key.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _choice_list(path: Path, where: str, spec: TaskSpec, obj, raw_label: str):
    """(the options as lines "A. text", the letter of the option that ``raw_label`` names), or None
    for an item the spec's ``choices.count`` leaves out."""
    ch = spec.choices
    options = _get(obj, ch.key)
    ok = isinstance(options, list) and 2 <= len(options) <= len(CHOICE_LETTERS) and all(
        isinstance(o, dict) and isinstance(o.get(ch.text), str)
        and (ch.label is None or isinstance(o.get(ch.label), str)) for o in options)
    if not ok:
        raise _bad(path, where, f"expected {ch.key!r} to hold a list of 2 to {len(CHOICE_LETTERS)} objects with "
                   f"a string {ch.text!r}{'' if ch.label is None else f' and a string {ch.label!r}'}")
    if ch.count is not None and len(options) != ch.count:
        return None
    names = [str(i) for i in range(len(options))] if ch.label is None else [o[ch.label] for o in options]
    if raw_label not in names:
        raise _bad(path, where, f"the answer {raw_label!r} is none of the options {names}")
    lines = "\n".join(f"{CHOICE_LETTERS[i]}. {CLEANERS[spec.clean](o[ch.text])}" for i, o in enumerate(options))
    return lines, CHOICE_LETTERS[names.index(raw_label)]


def _label_lines(label_path: Path, n_rows: int, data_path: Path) -> list[str]:
    labels = [line for _, line in _lines(label_path)]
    if len(labels) != n_rows:
        raise DataError(f"{label_path}: {len(labels)} labels for the {n_rows} rows of {data_path}: the two "
                        f"files must align line by line")
    return labels


def _parse_jsonl(path: Path, spec: TaskSpec, words: Mapping[str, str] | None,
                 label_path: Path | None = None) -> list[Example]:
    keys = [key for _, key in spec.fields]
    rows = list(_lines(path, spec.encoding))
    labels = _label_lines(label_path, len(rows), path) if label_path is not None else None
    out = []
    for j, (no, line) in enumerate(rows):
        where = f"line {no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, where, f"invalid JSON ({e.msg})") from None
        label = labels[j] if labels is not None else _get(obj, spec.label_field)
        if isinstance(label, int) and not isinstance(label, bool):
            label = str(label)  # integer class ids read as their decimal strings
        values = [_get(obj, k) for k in keys]
        if not all(isinstance(v, str) for v in values) or not isinstance(label, str):
            raise _bad(path, where, f"expected an object with string {', '.join(keys)}"
                       f"{'' if labels is not None else ', ' + spec.label_field}")
        named = list(zip([n for n, _ in spec.fields], values))
        if spec.choices is not None:
            picked = _choice_list(path, where, spec, obj, label.strip())
            if picked is None:
                continue
            options, label = picked
            named.append((CHOICES_SLOT, options))
        out.append(_from_named(path, where, spec, named, label, words))
    return out


def _parse_pairs_json(path: Path, spec: TaskSpec, words: Mapping[str, str] | None) -> list[Example]:
    try:
        items = json.loads(_read_text(path, spec.encoding))
    except json.JSONDecodeError as e:
        raise _bad(path, f"line {e.lineno}", f"invalid JSON ({e.msg})") from None
    if not isinstance(items, list) or not items:
        raise _bad(path, "top level", "expected a non-empty JSON list of {\"input\", \"output\"} objects")
    clean, out = CLEANERS[spec.clean], []
    for i, item in enumerate(items):
        ok = isinstance(item, dict) and all(isinstance(item.get(k), str) and clean(item[k])
                                            for k in ("input", "output"))
        if not ok:
            raise _bad(path, f"item {i}", f"expected non-empty string 'input' and 'output', got {item!r:.80}")
        out.append(Example(clean(item["input"]), _label(path, f"item {i}", clean(item["output"]), words)))
    return out


# Keyed by the names of the spec format (specs.FORMATS).
PARSERS: dict[str, Callable[[Path, TaskSpec, Mapping[str, str] | None], list[Example]]] = {
    "label_text": _parse_label_text, "trec": _parse_trec, "csv": _parse_csv, "tsv": _parse_tsv,
    "jsonl": _parse_jsonl, "pairs_json": _parse_pairs_json}


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

def list_tasks(data_dir: str | os.PathLike | None = None, *, answers: str | None = None) -> list[str]:
    """Names of the tasks whose files are all present under the data directory, sorted.

    answers: None (every task), "open" (open-ended answers, e.g. the word tasks) or "closed" (a fixed
        set of label words, e.g. classification)."""
    if answers not in (None, "open", "closed"):
        raise LiniclError(f"answers must be None, 'open' or 'closed', got {answers!r}")
    root = resolve_data_dir(data_dir)
    return [name for name, spec in all_specs(root).items()
            if all((root / f.path).is_file() for _, f in spec.files + spec.label_files)
            and (answers is None or (spec.labels is None) == (answers == "open"))]


def _label_words(spec: TaskSpec, label_words: Mapping[str, str] | None) -> dict[str, str] | None:
    """raw label -> word: the spec's, or ``label_words`` (same raw labels, distinct words)."""
    default = None if spec.labels is None else dict(spec.labels)
    if label_words is None:
        return default
    if not spec.word_map:
        kind = "open-ended" if default is None else "closed by a list of words"
        raise LiniclError(f"label_words: task {spec.name!r} is {kind} (spec {spec.where}); its outputs are "
                          f"its label words: use Task.relabel instead")
    words = dict(label_words)
    if set(words) != set(default) or len(set(words.values())) != len(words):
        raise LiniclError(f"label_words for {spec.name!r} must map each raw class {sorted(default)} to a "
                          f"distinct word, got {words}")
    return {k: words[k] for k in default}


def _check_split(spec: TaskSpec, role: str, examples: Sequence[Example], where: str, root: Path,
                 labels: Sequence[str] | None) -> None:
    """Refuse a split that cannot serve: one with no examples, or the demonstration pool ("train") of a
    task with several classes holding a single one (class-balanced demonstrations need two or more).
    ``where``: the file, for the message."""
    if not examples:
        raise DataError(f"task {spec.name!r}, split {role!r}: {where} holds no examples (spec {spec.where}): "
                        f"an empty or cut-short file; {refetch_hint(spec, root)}")
    present = {e.output for e in examples}
    if role == "train" and labels is not None and len(labels) > 1 and len(present) < 2:
        raise DataError(f"task {spec.name!r}, split 'train' (the demonstration pool, {where}): every example "
                        f"has the label {present.pop()!r} of {list(labels)} (spec {spec.where}), but "
                        f"class-balanced demonstrations need two or more classes: a cut-short or one-class "
                        f"file; {refetch_hint(spec, root)}")


def load_task(name: str, data_dir: str | os.PathLike | None = None, *,
              test_size: int | float | None = None, split_seed: int = 0,
              label_words: Mapping[str, str] | None = None, verify: bool = False) -> Task:
    """Load task ``name`` as its spec says (module docstring; ``linicl.data.specs`` for the format).

    test_size: tasks read from one file only (spec ``files.all``): evaluation rows as a count or a
        fraction (default: the spec's test_size; agnews 1,000, word tasks 0.3). Tasks with fixed
        train/test files refuse it.
    split_seed: seed of the hash-ordered split (tasks read from one file).
    label_words: raw class -> label word, replacing the spec's words (e.g. ``TREC_LABEL_WORDS_PAPER``,
        ``CB_LABEL_WORDS_ABC``); for tasks whose spec maps raw labels to words.
    verify: also compare each file's SHA-256 with its spec's (reads every file once more); the size is
        compared on every load.

    DataError: a missing, truncated (size), changed (``verify``) or malformed file; a split with no
    examples; a classification task's demonstration pool with a single class.
    """
    root = resolve_data_dir(data_dir)
    spec = find_spec(name, root)
    words = _label_words(spec, label_words)
    labels = None if words is None else tuple(words.values())
    paths = {role: _file(root, spec, f, verify) for role, f in spec.files}
    label_paths = {role: _file(root, spec, f, verify) for role, f in spec.label_files}

    def parse(role):
        more = {"label_path": label_paths[role]} if role in label_paths else {}
        return PARSERS[spec.format](paths[role], spec, words, **more)
    if spec.fixed_split:
        if test_size is not None:
            raise LiniclError(f"test_size: task {name!r} has fixed train/test files; leave it None")
        train, test = (tuple(parse(role)) for role in ("train", "test"))
        for role, part in (("train", train), ("test", test)):
            _check_split(spec, role, part, str(paths[role]), root, labels)
    else:
        examples = parse("all")
        _check_split(spec, "all", examples, str(paths["all"]), root, labels)
        n = _n_test(spec.test_size if test_size is None else test_size, len(examples), name)
        train, test = split_examples(examples, n, split_seed, labels)
        _check_split(spec, "train", train, f"split from {paths['all']}", root, labels)
    return Task(name, train, test, labels, template=spec.template, template_fields=spec.template_fields)
