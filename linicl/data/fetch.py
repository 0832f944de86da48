"""Download the data sets of tasks from their public sources: verified, idempotent, resumable.

Every file that a task's spec (``linicl.data.specs``) gives with a ``url`` and a ``sha256`` is
downloaded to ``<data_dir>/<path>``, the layout the loaders read (``linicl data fetch``):

* idempotent: a file already there with the right SHA-256 is skipped (one with another checksum is
  downloaded again and replaced only once the new copy checks out);
* resumable: bytes go to ``<path>.part``; a later run asks for the rest with an HTTP Range request
  and appends, or starts over when the server answers with the whole file;
* verified: the finished ``.part`` is hashed; a mismatch deletes it and names the file, the expected
  and the actual checksum; only a verified file is renamed into place.

``base_url`` (or ``$LINICL_DATA_BASE_URL``) replaces the origin (scheme://host[:port]) of every URL:
a mirror, or a local server in the tests. HTTP is the standard library's urllib.
The data directory is ``data_dir``, else ``$LINICL_DATA_DIR``, else the per-user cache
(``datasets.default_data_dir``), which the loaders read with no setting.
"""

from __future__ import annotations

import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tqdm.auto import tqdm

from linicl.data.datasets import file_problem, locate_data_dir, sha256_of
from linicl.data.specs import TaskSpec, all_specs, find_spec
from linicl.errors import DataError

BASE_URL_ENV = "LINICL_DATA_BASE_URL"
_CHUNK = 1 << 16
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


# ----------------------------------------------------------------------------- one file

def rebase_url(url: str, base_url: str | None) -> str:
    """``url`` with its scheme://host[:port] replaced by ``base_url`` (which may end in a path prefix:
    ``http://127.0.0.1:8000/mirror``); ``url`` itself when ``base_url`` is None or empty."""
    if not base_url:
        return url
    base = urllib.parse.urlsplit(base_url)
    if base.scheme not in ("http", "https") or not base.netloc or base.query or base.fragment:
        raise DataError(f"base_url {base_url!r}: expected http(s)://host[:port][/prefix]")
    rest = urllib.parse.urlsplit(url)
    path = base.path.rstrip("/") + rest.path
    return urllib.parse.urlunsplit((base.scheme, base.netloc, path, rest.query, ""))


def _open(url: str, offset: int, timeout: float):
    """The server's response, asking for bytes from ``offset`` on when it is > 0; None when the server
    says that range is empty (HTTP 416: the partial file is already whole, or is not this file)."""
    headers = {"User-Agent": "linicl-data-fetch"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:
            return None
        raise DataError(f"download failed: {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(f"download failed: {url}: {reason} (check the network, or the --base-url / "
                        f"{BASE_URL_ENV} mirror)") from None


def _resumes(response, offset: int) -> bool:
    """Whether the server sent the rest of the file from ``offset`` (206 with a matching range)."""
    found = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    return response.status == 206 and found is not None and int(found[1]) == offset


def _receive(url: str, part: Path, size: int | None, progress: bool, timeout: float) -> None:
    """Bring ``part`` to the whole file: resume it when the server allows, else start over."""
    offset = part.stat().st_size if part.exists() else 0
    if size is not None and offset >= size:
        if offset == size:
            return  # whole already: the checksum decides
        part.unlink()
        offset = 0
    response = _open(url, offset, timeout)
    if response is None:  # 416: nothing after offset; start over
        part.unlink()
        offset, response = 0, _open(url, 0, timeout)
    with response:
        if offset and not _resumes(response, offset):
            offset = 0  # the server sent the whole file
        length = response.headers.get("Content-Length", "")
        expected = offset + int(length) if length.isdigit() else None
        name = part.name[:-len(".part")]
        with open(part, "ab" if offset else "wb") as f, \
                tqdm(total=expected or size, initial=offset, unit="B", unit_scale=True, desc=name,
                     disable=not progress, leave=False) as bar:
            try:
                while chunk := response.read(_CHUNK):
                    f.write(chunk)
                    bar.update(len(chunk))
                # http.client ends a body cut short by the server silently: compare with its length.
                short = expected is not None and f.tell() < expected
                why = f"the connection closed after {f.tell()} of {expected} bytes"
            except (OSError, http.client.HTTPException) as e:
                short, why = True, repr(e)
            if short:
                raise DataError(f"download interrupted: {url}: {why}; the {f.tell()} bytes received are kept "
                                f"in {part}: run the fetch again to resume")


def download(url: str, dest: Path, sha256: str, *, size: int | None = None, progress: bool = True,
             timeout: float = 60.0) -> bool:
    """Download ``url`` to ``dest`` and verify its SHA-256 (module docstring). Returns False when
    ``dest`` was already there with this checksum (nothing downloaded), True otherwise.
    DataError names the URL (network, HTTP errors) or the file and both checksums (a mismatch)."""
    dest = Path(dest)
    if dest.is_file() and sha256_of(dest) == sha256:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    resumed = part.exists()
    _receive(url, part, size, progress, timeout)
    got = sha256_of(part)
    if got != sha256 and resumed:  # the kept bytes may be from another version: one fresh try
        part.unlink()
        _receive(url, part, size, progress, timeout)
        got = sha256_of(part)
    if got != sha256:
        part.unlink()
        raise DataError(f"checksum mismatch for {dest} (from {url}): expected sha256 {sha256}, got {got}; "
                        f"the bad download was deleted")
    os.replace(part, dest)
    return True


# ----------------------------------------------------------------------------- tasks

def _fetchable(spec: TaskSpec) -> bool:
    return all(f.url is not None for f in spec.all_files())


def _chosen(names: Sequence[str], root: Path) -> list[TaskSpec]:
    """The specs of ``names`` (all fetchable ones when empty); DataError for a task with no URLs."""
    if not names:
        return [s for s in all_specs(root).values() if _fetchable(s)]
    specs = [find_spec(name, root) for name in dict.fromkeys(names)]
    for spec in specs:
        if not _fetchable(spec):
            missing = [f.path for f in spec.all_files() if f.url is None]
            raise DataError(f"task {spec.name!r} cannot be fetched: its spec ({spec.where}) gives no url and "
                            f"sha256 for {missing}; put those files under {root} yourself")
    return specs


def _check_writable(root: Path, source: str) -> None:
    """DataError unless ``root`` is a directory or can be made one: the nearest existing path at or
    above it must be a directory (``mkdir`` would otherwise fail with a bare NotADirectoryError, and
    ``linicl data list`` would call every task "not found" and suggest a fetch that fails so)."""
    here = next((p for p in (root, *root.parents) if p.exists()), None)
    if here is not None and not here.is_dir():
        what = "is a file" if here == root else f"lies under {here}, which is a file"
        raise DataError(f"data directory {str(root)!r} (from {source}) {what}: expected a directory, or a path "
                        f"where one can be created; pass --data-dir (or set LINICL_DATA_DIR to) a folder")


def fetch(names: Sequence[str] = (), data_dir: str | os.PathLike | None = None, *,
          base_url: str | None = None, progress: bool = True, timeout: float = 60.0,
          log: Callable[[str], None] | None = None) -> list[Path]:
    """Download the files of tasks ``names`` (every task whose spec has URLs when empty) into the data
    directory (created if missing). ``base_url``: module docstring (default ``$LINICL_DATA_BASE_URL``).
    ``log`` receives one line per file. Returns every file of those tasks, all present and verified."""
    root, source = locate_data_dir(data_dir)
    _check_writable(root, source)
    base_url = base_url if base_url is not None else os.environ.get(BASE_URL_ENV)
    say = log or (lambda line: None)
    done: dict[str, Path] = {}
    for spec in _chosen(names, root):
        for f in spec.all_files():
            if f.path in done:  # a licence file shared by several tasks
                continue
            dest = root / f.path
            url = rebase_url(f.url, base_url)
            was_there = dest.exists()
            try:
                fresh = download(url, dest, f.sha256, size=f.size, progress=progress, timeout=timeout)
            except OSError as e:  # the data directory, not the network (those are DataErrors already)
                raise DataError(f"{e.filename or dest}: {e.strerror or e} (fetching {f.path} of task "
                                f"{spec.name!r} into {root})") from None
            state = ("replaced (its checksum differed)" if was_there else "downloaded") if fresh else "present"
            say(f"{spec.name}: {f.path} {state}")
            done[f.path] = dest
    return list(done.values())


# ----------------------------------------------------------------------------- what is there

@dataclass(frozen=True)
class TaskStatus:
    """One task in a data directory: ``where`` its files are (their common folder; None when some are
    missing or damaged), the ``missing`` paths, the ``damaged`` ones ("path: what differs from the
    spec", size or SHA-256), ``size`` in bytes (of the files on disk when all are present, else as the
    spec says, 0 when it does not), its licence, its spec and whether it can be fetched."""
    name: str
    where: Path | None
    missing: tuple[str, ...]
    n_files: int
    size: int
    licence: str
    spec: str
    fetchable: bool
    damaged: tuple[str, ...] = ()


def _status(spec: TaskSpec, root: Path) -> TaskStatus:
    files = [f for _, f in spec.files]
    missing = tuple(f.path for f in files if not (root / f.path).is_file())
    # Present files are hashed: a file cut short mid-line still parses (the 10 of 1,821 rows).
    damaged = tuple(f"{f.path}: {problem}" for f in files if f.path not in missing
                    and (problem := file_problem(root / f.path, f, checksum=True)))
    if missing:
        size = sum(f.size or 0 for f in files)
        where = None
    else:
        size = sum((root / f.path).stat().st_size for f in files)
        where = None if damaged else Path(os.path.commonpath([str((root / f.path).parent) for f in files]))
    return TaskStatus(spec.name, where, missing, len(files), size, spec.licence, spec.where, _fetchable(spec),
                      damaged)


def status(data_dir: str | os.PathLike | None = None) -> tuple[Path, str, list[TaskStatus]]:
    """(data directory, where that choice came from, one TaskStatus per known task, by name). The
    directory need not exist: then only the shipped specs are known and every task is missing. A
    ``data_dir`` that is a file, or lies under one, is refused (DataError): it can hold no task."""
    root, source = locate_data_dir(data_dir)
    _check_writable(root, source)
    return root, source, [_status(spec, root) for spec in all_specs(root).values()]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _where(row: TaskStatus) -> str:
    if row.where is not None:
        return str(row.where)
    if row.damaged and not row.missing:
        where = f"damaged ({'; '.join(row.damaged)})"
    else:
        where = "not found" if len(row.missing) == row.n_files else f"incomplete (missing {', '.join(row.missing)})"
    return where if row.fetchable else where + " (its spec has no download)"


def format_status(data_dir: str | os.PathLike | None = None) -> str:
    """The table ``linicl data list`` prints: task, where found (or not found), size, licence."""
    root, source, rows = status(data_dir)
    origin = {"data_dir": "--data-dir", "default": "the default cache; set LINICL_DATA_DIR or pass "
              "--data-dir to use another"}.get(source, source)
    state = "" if root.is_dir() else " - does not exist yet"  # a file is refused by status
    lines = [f"data directory: {root} ({origin}){state}"]
    table = [("task", "where", "size", "licence")]
    for row in rows:
        table.append((row.name, _where(row), _human(row.size) if row.size else "?", row.licence))
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in table]
    damaged = [r.name for r in rows if r.damaged and r.fetchable]
    if damaged:  # fetch replaces a file whose checksum differs
        lines.append("download the damaged ones again with: linicl data fetch " + " ".join(damaged)
                     + f" --data-dir {root}")
    missing = [r.name for r in rows if r.where is None and not r.damaged and r.fetchable]
    if missing:
        every = len(missing) == sum(r.fetchable for r in rows)
        lines.append("get " + ("them" if every else "the missing ones") + " with: linicl data fetch"
                     + ("" if every else " " + " ".join(missing))
                     + (f" --data-dir {root}" if source == "data_dir" else ""))
    return "\n".join(lines)
