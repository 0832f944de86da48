"""Task specs: one small JSON file per task says where its files are, how to read them and how to
prompt it, so that a new data set in a known layout needs no code.

Where specs are found (first match wins): ``<data_dir>/tasks/<name>.json`` (a user's own, overriding a
shipped spec of the same name), then ``linicl/data/tasks/<name>.json`` (shipped with the package). A
file ``<data_dir>/word_tasks/<name>.json`` with no spec is read as an open word task (format
``pairs_json``, test_size 0.3, template ``qa``), the layout of the function-vectors data.

Keys of a spec (``?``: optional)::

    name          ? the task name; must equal the file name without ".json" (default: that name)
    description   ? one line for people
    format          how each file is read:
                      "label_text"  one example a line, "<label> <text>" (SST-2)
                      "trec"        one example a line, "COARSE:fine question"; the label is COARSE
                      "csv"         CSV with a header row; fields and label are named columns
                      "tsv"         tab-separated with a header row, no quoting (a quote is text,
                                    MRPC); a leading byte-order mark is dropped
                      "jsonl"       one JSON object a line; fields and label are named keys; a key
                                    "a.b" reads obj["a"]["b"] (nested objects: CommonsenseQA, ARC)
                      "pairs_json"  a JSON list of {"input": ..., "output": ...} (the word tasks)
    files           {"train": FILE, "test": FILE}: a fixed split (demo pool, evaluation set); or
                    {"all": FILE}: one file split in hash order into test_size evaluation rows and a
                    demo pool, stratified by label when the labels are closed
    test_size     ? with "all": the default size of the evaluation set, an int count or a fraction
                    in (0, 1) (default 0.3)
    fields          csv, tsv and jsonl only: the parts of the input, a list of keys (column names), or
                    an object {field name: key or column}; each becomes a template slot {field name}
    label_field     csv, tsv and jsonl only: the key (column) holding the label, or the answer when
                    open; not with label_files
    label_files   ? jsonl only: {role: FILE} for each role of files; the labels in a file of their
                    own, one a line, aligned with the data file's rows (PIQA's valid-labels.lst)
    choices       ? jsonl only: a multiple-choice list {"key": path to a list of objects, "text": key
                    of an option's text, "label": key of an option's label (default: none; the answer
                    is then its 0-based position), "count": keep only items with this many options
                    (optional)}. It becomes the template slot {choices}, the options as lines
                    "A. text", "B. text", ... (letters by position), and an example's raw label is the
                    letter of the option whose label (or position) the label field holds
    join          ? how several fields make the whole input: "newline" (default), "space", or
                    "sentence" ("Title. Description", no doubled end punctuation)
    encoding      ? of the data files: "utf-8" (default) or "cp1252" (Windows Latin-1, the MR files)
    clean         ? cleanup of every text: "strip" (default: surrounding whitespace) or "agnews"
                    (also undo the AG News escapes, see datasets._clean_agnews)
    labels          {raw label: label word, ...}: closed, in class order; load_task(label_words=...)
                    may replace the words. [word, ...]: closed, the raw labels are the words.
                    "open": free-form answers (Task.labels is None)
    template        the name of a template in linicl.data.prompts.TEMPLATES, or an object of
                    Template fields (TEMPLATE_FIELDS) for a template of the task's own
    licence       ? the terms of the data ("license" is read too)
    source        ? where the data comes from
    extra_files   ? [FILE, ...]: fetched with the task, never parsed (licence texts)

FILE is a path relative to the data directory ("classification/cb/train.jsonl"), or an object
{"path": ..., "url": ..., "sha256": ..., "size": ...}: ``url`` (with ``sha256``: a download is always
verified) lets ``linicl data fetch`` download the file; ``size`` (bytes) is compared with the file on
every load, ``sha256`` by ``linicl data list`` and ``load_task(verify=True)`` (with or without a url: a
copy of one's own may pin its files too).

Malformed specs raise ``DataError`` naming the spec file and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from linicl.errors import DataError

SHIPPED_DIR = Path(__file__).parent / "tasks"
SPEC_DIR = "tasks"  # under the data directory
WORD_DIR = "word_tasks"

# The vocabularies of the spec format; linicl.data.datasets implements each name (a test ties them).
FORMATS = ("label_text", "trec", "csv", "tsv", "jsonl", "pairs_json")
JOINS = ("newline", "space", "sentence")
CLEANERS = ("strip", "agnews")
ENCODINGS = ("utf-8", "cp1252")
# The fields of linicl.data.prompts.Template (that module imports this package, so it is not read here).
TEMPLATE_FIELDS = ("input_prefix", "output_prefix", "io_sep", "example_sep", "instruction", "label_prefix",
                   "input_format")
DEFAULT_TEST_SIZE = 0.3

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEYS = {"name", "description", "format", "files", "test_size", "fields", "label_field", "label_files",
         "choices", "encoding", "join", "clean", "labels", "template", "licence", "license", "source", "extra_files"}
_REQUIRED = ("format", "files", "labels", "template")
_NAMED = ("csv", "tsv", "jsonl")  # formats whose input parts and label are named by the spec
CHOICE_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
CHOICES_SLOT = "choices"  # the template slot of a multiple-choice list


@dataclass(frozen=True)
class FileSpec:
    """One file of a task: ``path`` relative to the data directory (POSIX), and where to download it."""
    path: str
    url: str | None = None
    sha256: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class ChoiceSpec:
    """A multiple-choice list of a jsonl task (module docstring, key ``choices``)."""
    key: str
    text: str
    label: str | None = None
    count: int | None = None


@dataclass(frozen=True)
class TaskSpec:
    """A parsed spec (module docstring). ``files`` holds ("train", f), ("test", f) or ("all", f);
    ``labels`` the (raw label, word) pairs in order, None when open; ``word_map`` says the labels
    were an object (so load_task may replace the words); ``fields`` the (field name, key or column)
    pairs; ``origin`` the spec file (None for the rule that reads a bare word_tasks/<name>.json)."""
    name: str
    format: str
    files: tuple[tuple[str, FileSpec], ...]
    labels: tuple[tuple[str, str], ...] | None
    template: str
    template_fields: tuple[tuple[str, str], ...] = ()
    word_map: bool = False
    fields: tuple[tuple[str, str], ...] = ()
    label_field: str | None = None
    label_files: tuple[tuple[str, FileSpec], ...] = ()
    choices: ChoiceSpec | None = None
    join: str = "newline"
    clean: str = "strip"
    encoding: str = "utf-8"
    test_size: int | float | None = None
    licence: str = "unknown"
    source: str = "unknown"
    description: str = ""
    extra_files: tuple[FileSpec, ...] = ()
    origin: Path | None = None

    @property
    def fixed_split(self) -> bool:
        return self.files[0][0] == "train"

    @property
    def where(self) -> str:
        """The spec file, for messages."""
        return str(self.origin) if self.origin is not None else f"none: a bare {WORD_DIR}/{self.name}.json"

    def all_files(self) -> tuple[FileSpec, ...]:
        """The data files, their label files, then the extra files: everything ``linicl data fetch``
        downloads."""
        return tuple(f for _, f in self.files) + tuple(f for _, f in self.label_files) + self.extra_files


# ----------------------------------------------------------------------------- reading one spec

class _Checker:
    """Raises DataError naming the spec file and the key that is wrong."""

    def __init__(self, origin: Path):
        self.origin = origin

    def fail(self, key: str, why: str) -> DataError:
        return DataError(f"spec {self.origin}: {key}: {why}")

    def text(self, obj: dict, key: str, default: str | None = None) -> str:
        value = obj.get(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"expected a non-empty string, got {value!r:.80}")
        return value

    def choice(self, obj: dict, key: str, allowed: tuple[str, ...]) -> str:
        value = self.text(obj, key, allowed[0])
        if value not in allowed:
            raise self.fail(key, f"expected one of {list(allowed)}, got {value!r}")
        return value

    def path(self, key: str, raw) -> str:
        if not isinstance(raw, str) or not raw or "\\" in raw:
            raise self.fail(key, f"expected a relative path with '/' separators, got {raw!r:.80}")
        pure = PurePosixPath(raw)
        # Files are written there by `linicl data fetch`: keep them inside the data directory.
        if pure.is_absolute() or ".." in pure.parts:
            raise self.fail(key, f"path {raw!r} must stay inside the data directory (relative, no '..')")
        return pure.as_posix()

    def file(self, key: str, raw) -> FileSpec:
        if isinstance(raw, str):
            return FileSpec(self.path(key, raw))
        if not isinstance(raw, dict) or set(raw) - {"path", "url", "sha256", "size"}:
            raise self.fail(key, f"expected a path or an object with keys path, url, sha256, size; got "
                            f"{raw!r:.80}")
        url, sha, size = raw.get("url"), raw.get("sha256"), raw.get("size")
        if url is not None and sha is None:
            raise self.fail(key, "a url needs its sha256: a download is always verified")
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise self.fail(f"{key}.url", f"expected an http(s) URL, got {url!r:.80}")
        if sha is not None and (not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
            raise self.fail(f"{key}.sha256", f"expected 64 lowercase hex digits, got {sha!r:.80}")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise self.fail(f"{key}.size", f"expected a byte count >= 0, got {size!r}")
        return FileSpec(self.path(f"{key}.path", raw.get("path")), url, sha, size)


def _files(c: _Checker, obj: dict) -> tuple[tuple[str, FileSpec], ...]:
    raw = obj["files"]
    if not isinstance(raw, dict) or set(raw) not in ({"train", "test"}, {"all"}):
        raise c.fail("files", f"expected an object with keys train and test, or the key all; got {raw!r:.80}")
    roles = ("train", "test") if "train" in raw else ("all",)
    return tuple((role, c.file(f"files.{role}", raw[role])) for role in roles)


def _test_size(c: _Checker, obj: dict, fixed: bool) -> int | float | None:
    if fixed:
        if "test_size" in obj:
            raise c.fail("test_size", "only a task with files.all is split; train/test files are fixed")
        return None
    size = obj.get("test_size", DEFAULT_TEST_SIZE)
    ok = (isinstance(size, int) and not isinstance(size, bool) and size > 0) or \
         (isinstance(size, float) and 0 < size < 1)
    if not ok:
        raise c.fail("test_size", f"expected an int count > 0 or a fraction in (0, 1), got {size!r}")
    return size


def _fields(c: _Checker, obj: dict, fmt: str) -> tuple[tuple[tuple[str, str], ...], str | None]:
    if fmt not in _NAMED:
        extra = [k for k in ("fields", "label_field", "label_files", "choices") if k in obj]
        if extra:
            raise c.fail(extra[0], f"format {fmt!r} has fixed parts; fields and label_field are for "
                         f"{list(_NAMED)}")
        return (), None
    raw = obj.get("fields")
    pairs = [(k, k) for k in raw] if isinstance(raw, list) else \
        list(raw.items()) if isinstance(raw, dict) else []
    if not pairs or not all(isinstance(n, str) and n.isidentifier() and isinstance(k, str) and k
                            for n, k in pairs) or len({n for n, _ in pairs}) != len(pairs):
        raise c.fail("fields", f"format {fmt!r} needs the input's parts: a list of keys, or an object "
                     f"{{field name: key}}, with distinct identifier field names; got {raw!r:.80}")
    if CHOICES_SLOT in {n for n, _ in pairs}:
        raise c.fail("fields", f"{CHOICES_SLOT!r} is the slot of the choices key; name the field otherwise")
    if "label_files" in obj:
        if "label_field" in obj:
            raise c.fail("label_field", "the labels come from label_files; give one or the other")
        return tuple(pairs), None
    return tuple(pairs), c.text(obj, "label_field")


def _label_files(c: _Checker, obj: dict, fmt: str, roles: tuple) -> tuple[tuple[str, FileSpec], ...]:
    if "label_files" not in obj:
        return ()
    raw = obj["label_files"]
    if fmt != "jsonl":
        raise c.fail("label_files", f"only format 'jsonl' reads labels from files of their own, not {fmt!r}")
    if not isinstance(raw, dict) or set(raw) != set(roles):
        raise c.fail("label_files", f"expected an object with one file for each role of files {list(roles)}, "
                     f"got {raw!r:.80}")
    return tuple((role, c.file(f"label_files.{role}", raw[role])) for role in roles)


def _choices(c: _Checker, obj: dict, fmt: str) -> ChoiceSpec | None:
    if "choices" not in obj:
        return None
    raw = obj["choices"]
    if fmt != "jsonl":
        raise c.fail("choices", f"only format 'jsonl' reads a list of options, not {fmt!r}")
    if not isinstance(raw, dict) or not {"key", "text"} <= set(raw) <= {"key", "text", "label", "count"}:
        raise c.fail("choices", f"expected an object with keys key, text and optionally label, count; got "
                     f"{raw!r:.80}")
    for k in ("key", "text", "label"):
        if k in raw:
            c.text(raw, k)
    count = raw.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or not 2 <= count <= len(CHOICE_LETTERS)):
        raise c.fail("choices.count", f"expected an int in [2, {len(CHOICE_LETTERS)}], got {count!r}")
    return ChoiceSpec(raw["key"], raw["text"], raw.get("label"), count)


def _labels(c: _Checker, raw) -> tuple[tuple[tuple[str, str], ...] | None, bool]:
    if raw == "open":
        return None, False
    if isinstance(raw, list):
        pairs = [(w, w) for w in raw]
    elif isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        pairs = []
    ok = pairs and all(isinstance(a, str) and a and isinstance(w, str) and w.strip() == w and w
                       for a, w in pairs)
    if not ok or len({w for _, w in pairs}) != len(pairs):
        raise c.fail("labels", f"expected {{raw label: word}}, a list of words, or \"open\"; words must be "
                     f"distinct non-empty strings without surrounding spaces; got {raw!r:.80}")
    return tuple(pairs), isinstance(raw, dict)


def _template(c: _Checker, raw, name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    if isinstance(raw, str) and raw:
        return raw, ()
    if isinstance(raw, dict) and raw and set(raw) <= set(TEMPLATE_FIELDS) and \
            all(isinstance(v, str) for v in raw.values()):
        return name, tuple(sorted(raw.items()))
    raise c.fail("template", f"expected a template name or an object with string values for some of "
                 f"{list(TEMPLATE_FIELDS)}, got {raw!r:.80}")


def parse_spec(obj, origin: Path) -> TaskSpec:
    """A TaskSpec from a spec's JSON value; ``origin`` is the file (its stem is the task name)."""
    c = _Checker(origin)
    if not isinstance(obj, dict):
        raise c.fail("top level", "expected a JSON object")
    if unknown := sorted(set(obj) - _KEYS):
        raise c.fail(unknown[0], f"unknown key (keys of a spec: {sorted(_KEYS - {'license'})})")
    if missing := [k for k in _REQUIRED if k not in obj]:
        raise c.fail(missing[0], "missing (required: " + ", ".join(_REQUIRED) + ")")
    name = c.text(obj, "name", origin.stem)
    if name != origin.stem:
        raise c.fail("name", f"{name!r} differs from the file name {origin.name!r} (a task is found by its "
                     f"file name)")
    fmt = c.choice(obj, "format", FORMATS)
    files = _files(c, obj)
    fields, label_field = _fields(c, obj, fmt)
    label_files = _label_files(c, obj, fmt, tuple(role for role, _ in files))
    choices = _choices(c, obj, fmt)
    labels, word_map = _labels(c, obj["labels"])
    template, template_fields = _template(c, obj["template"], name)
    extra = obj.get("extra_files", [])
    if not isinstance(extra, list):
        raise c.fail("extra_files", f"expected a list of files, got {extra!r:.80}")
    return TaskSpec(
        name=name, format=fmt, files=files, labels=labels, template=template, template_fields=template_fields,
        word_map=word_map, fields=fields, label_field=label_field, label_files=label_files, choices=choices,
        join=c.choice(obj, "join", JOINS),
        clean=c.choice(obj, "clean", CLEANERS), encoding=c.choice(obj, "encoding", ENCODINGS), test_size=_test_size(c, obj, files[0][0] == "train"),
        licence=c.text(obj, "licence", obj.get("license", "unknown")), source=c.text(obj, "source", "unknown"),
        description=c.text(obj, "description") if "description" in obj else "",
        extra_files=tuple(c.file(f"extra_files[{i}]", f) for i, f in enumerate(extra)), origin=origin)


def read_spec(path: Path) -> TaskSpec:
    """Parse the spec file ``path``."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"spec {path}: not valid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"spec {path}, line {e.lineno}: invalid JSON ({e.msg})") from None
    return parse_spec(obj, path)


def word_task_spec(name: str) -> TaskSpec:
    """The spec of a bare ``word_tasks/<name>.json``: open answers, 30 % evaluation rows, template qa."""
    return TaskSpec(name=name, format="pairs_json", files=(("all", FileSpec(f"{WORD_DIR}/{name}.json")),),
                    labels=None, template="qa", test_size=DEFAULT_TEST_SIZE)


# ----------------------------------------------------------------------------- finding specs

def spec_dirs(root: Path | None) -> list[Path]:
    """Where specs are searched, first match first: ``<root>/tasks``, then the shipped folder."""
    return ([root / SPEC_DIR] if root is not None else []) + [SHIPPED_DIR]


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DataError(f"task name {name!r}: expected letters, digits, '_', '-', '.' (it names a spec "
                        f"file <name>.json)")
    return name


def all_specs(root: Path | None) -> dict[str, TaskSpec]:
    """Every task known with data directory ``root`` (None: shipped specs only), by name, sorted."""
    found: dict[str, TaskSpec] = {}
    for folder in reversed(spec_dirs(root)):  # later folders override earlier ones
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            found[path.stem] = read_spec(path)
    if root is not None and (root / WORD_DIR).is_dir():
        for path in sorted((root / WORD_DIR).glob("*.json")):
            if path.stem not in found and _NAME.fullmatch(path.stem):
                found[path.stem] = word_task_spec(path.stem)
    return dict(sorted(found.items()))


def find_spec(name: str, root: Path | None) -> TaskSpec:
    """The spec of task ``name`` (module docstring for the search order); DataError listing where it
    looked and the known names when there is none."""
    check_name(name)
    for folder in spec_dirs(root):
        if (folder / f"{name}.json").is_file():
            return read_spec(folder / f"{name}.json")
    if root is not None and (root / WORD_DIR / f"{name}.json").is_file():
        return word_task_spec(name)
    looked = [str(folder / f"{name}.json") for folder in spec_dirs(root)]
    if root is not None:
        looked.append(str(root / WORD_DIR / f"{name}.json"))
    # Data without a spec (say classification/<name>/) is the likely mistake: say so.
    folders = [str(p) for p in sorted(root.glob(f"*/{name}")) if p.is_dir()] if root is not None else []
    found = f"; the folder {folders[0]} exists, but a task needs a spec" if folders else ""
    raise DataError(f"unknown task {name!r}: none of {looked} exists{found} (known tasks: "
                    f"{list(all_specs(root))}); to add it, write a spec {name}.json in {spec_dirs(root)[0]} "
                    f"(format: linicl/data/specs.py)")
