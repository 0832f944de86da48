"""`linicl data fetch` end to end against a local HTTP server (127.0.0.1, a thread, shut down after each
test): download, idempotence, resume of a .part file, checksum mismatch, unreachable server; then the
loaders read the fetched folder. Fixtures are tiny files written here with their own checksums."""

import hashlib
import json
import re
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_data import full_dir  # noqa: F401  (a fixture)

from linicl import cli
from linicl.data import DataError, list_tasks, load_task
from linicl.data import datasets as ds
from linicl.data import fetch as F
from linicl.data import specs

UPSTREAM = "https://raw.example.org/someone/nli-data/0123abc"
GOLD = ["entailment", "contradiction", "neutral"]
TRAIN = "".join(json.dumps({"premise": f"Premise number {i} is here.", "hypothesis": f"Claim {i}.",
                            "label": GOLD[i % 3]}) + "\n" for i in range(60))
TEST = "".join(json.dumps({"premise": f"Test premise {i}.", "hypothesis": f"Test claim {i}.",
                           "label": GOLD[i % 3]}) + "\n" for i in range(9))
LICENCE = "Do what you like with these sentences.\n"
# Served path -> bytes (the upstream URLs' paths, so that --base-url maps one onto the other).
SERVED = {"someone/nli-data/0123abc/train.jsonl": TRAIN.encode(),
          "someone/nli-data/0123abc/test.jsonl": TEST.encode(),
          "someone/nli-data/0123abc/LICENSE": LICENCE.encode()}


def _entry(rel: str, served: str, data: bytes | None = None) -> dict:
    data = SERVED[served] if data is None else data
    return {"path": rel, "url": f"https://raw.example.org/{served}", "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data)}


def nli_spec(**changes) -> dict:
    spec = {"description": "a tiny entailment set served by the test", "format": "jsonl",
            "files": {"train": _entry("nli/train.jsonl", "someone/nli-data/0123abc/train.jsonl"),
                      "test": _entry("nli/test.jsonl", "someone/nli-data/0123abc/test.jsonl")},
            "fields": ["premise", "hypothesis"], "label_field": "label",
            "labels": {"entailment": "yes", "contradiction": "no", "neutral": "maybe"},
            "template": "cb", "licence": "test data", "source": UPSTREAM,
            "extra_files": [_entry("nli/LICENSE", "someone/nli-data/0123abc/LICENSE")]}
    return {**spec, **changes}


def with_spec(root: Path, spec: dict, name: str = "tiny_nli") -> Path:
    (root / "tasks").mkdir(parents=True, exist_ok=True)
    (root / "tasks" / f"{name}.json").write_text(json.dumps(spec))
    return root


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # a stuck client cannot hold the server

    def do_GET(self):
        state = self.server.state
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        ask = self.headers.get("Range")
        state.requests.append((path, ask))
        data = state.files.get(path)
        if data is None:
            self.send_error(404)
            return
        start = int(m[1]) if (m := re.fullmatch(r"bytes=(\d+)-", ask or "")) and state.ranges else 0
        if start >= len(data) > 0:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if state.cut_after is not None:  # drop the connection part way, once
            body, state.cut_after = body[:state.cut_after], None
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server:
    """A local server of ``files`` (path -> bytes) that records (path, Range header) per request.
    ``ranges=False`` makes it ignore Range; ``cut_after=n`` sends only n bytes of the next body."""

    def __init__(self, files: dict):
        self.files, self.requests, self.ranges, self.cut_after = dict(files), [], True, None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.state = self
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.guard = threading.Timer(120, self.httpd.shutdown)  # stops itself if a test hangs

    def __enter__(self):
        self.thread.start()
        self.guard.start()
        return self

    def __exit__(self, *exc):
        self.guard.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def server():
    with Server(SERVED) as s:
        yield s


def _fetch(root: Path, server: Server, names=("tiny_nli",), **kw):
    return F.fetch(names, root, base_url=server.url, progress=False, timeout=10, **kw)


# ----------------------------------------------------------------------------- fetching

def test_fetch_then_load_and_idempotent_second_fetch(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec())
    lines = []
    files = _fetch(root, server, log=lines.append)
    assert sorted(p.relative_to(root).as_posix() for p in files) == ["nli/LICENSE", "nli/test.jsonl",
                                                                    "nli/train.jsonl"]
    assert (root / "nli/train.jsonl").read_text() == TRAIN and not list(root.rglob("*.part"))
    assert all(line.endswith("downloaded") for line in lines) and len(server.requests) == 3
    assert {p for p, _ in server.requests} == set(SERVED)  # the upstream paths under the base URL
    task = load_task("tiny_nli", root)
    assert (len(task.train), len(task.test)) == (60, 9) and task.labels == ("yes", "no", "maybe")
    assert task.test[1].field_map()["premise"] == "Test premise 1." and task.test[1].output == "no"
    assert "tiny_nli" in list_tasks(root)
    again = []
    _fetch(root, server, log=again.append)
    assert len(server.requests) == 3 and all(line.endswith("present") for line in again)


def test_a_changed_file_is_downloaded_again(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec())
    _fetch(root, server)
    (root / "nli/test.jsonl").write_text("edited\n")
    lines = []
    _fetch(root, server, log=lines.append)
    assert (root / "nli/test.jsonl").read_text() == TEST
    assert "tiny_nli: nli/test.jsonl replaced (its checksum differed)" in lines


def test_resume_a_partial_part_file(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec())
    dest = root / "nli/train.jsonl"
    dest.parent.mkdir(parents=True)
    half = len(TRAIN) // 2
    Path(f"{dest}.part").write_bytes(TRAIN.encode()[:half])
    _fetch(root, server)
    assert dest.read_text() == TRAIN and not Path(f"{dest}.part").exists()
    assert ("someone/nli-data/0123abc/train.jsonl", f"bytes={half}-") in server.requests


def test_an_interrupted_download_keeps_its_part_and_resumes(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec(extra_files=[]))
    server.cut_after = 100
    with pytest.raises(DataError, match=r"download interrupted: http://127\.0\.0\.1:\d+/someone/nli-data/"
                                        r"0123abc/train\.jsonl.*run the fetch again to resume"):
        _fetch(root, server)
    part = root / "nli/train.jsonl.part"
    assert part.stat().st_size == 100 and not (root / "nli/train.jsonl").exists()
    _fetch(root, server)
    assert (root / "nli/train.jsonl").read_text() == TRAIN and not part.exists()
    assert server.requests[-2] == ("someone/nli-data/0123abc/train.jsonl", "bytes=100-")


def test_a_server_without_ranges_sends_it_all_again(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec())
    (root / "nli").mkdir()
    (root / "nli/train.jsonl.part").write_bytes(b"stale bytes from elsewhere")
    server.ranges = False
    _fetch(root, server)
    assert (root / "nli/train.jsonl").read_text() == TRAIN


def test_stale_part_bytes_are_retried_from_scratch(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec())
    (root / "nli").mkdir()
    (root / "nli/train.jsonl.part").write_bytes(b"X" * 50)  # another version's first bytes
    _fetch(root, server)
    assert (root / "nli/train.jsonl").read_text() == TRAIN
    asked = [r for p, r in server.requests if p.endswith("train.jsonl")]
    assert asked == ["bytes=50-", None]


def test_checksum_mismatch_names_file_and_both_sums_and_deletes(tmp_path, server):
    wrong = "0" * 64
    spec = nli_spec()
    spec["files"]["test"] = {**spec["files"]["test"], "sha256": wrong}
    root = with_spec(tmp_path / "data", spec)
    with pytest.raises(DataError) as err:
        _fetch(root, server)
    got = hashlib.sha256(TEST.encode()).hexdigest()
    dest = root / "nli/test.jsonl"
    assert f"checksum mismatch for {dest}" in str(err.value)
    assert f"expected sha256 {wrong}, got {got}" in str(err.value)
    assert not dest.exists() and not Path(f"{dest}.part").exists()


def test_a_damaged_file_shows_in_the_list_and_is_fetched_again(tmp_path, server, capsys):
    """A file cut short (size) or changed in place (SHA-256) is 'damaged' in `linicl data list`, which
    says how to fetch it again; the fetch replaces it."""
    root = with_spec(tmp_path / "data", nli_spec())
    _fetch(root, server)
    test = root / "nli/test.jsonl"
    test.write_bytes(TEST.encode()[:100])
    assert cli.main(["data", "list", "--data-dir", str(root)]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"tiny_nli +damaged \(nli/test.jsonl: 100 bytes where its spec says {len(TEST):,}\)", table)
    assert f"download the damaged ones again with: linicl data fetch tiny_nli --data-dir {root}" in table
    with pytest.raises(DataError, match="nli/test.jsonl: 100 bytes"):
        load_task("tiny_nli", root)
    test.write_text(TEST.replace("Test claim 1.", "Test claim 9."))  # the same size
    rows = {r.name: r for r in F.status(root)[2]}
    assert rows["tiny_nli"].where is None and "SHA-256" in rows["tiny_nli"].damaged[0]
    lines = []
    _fetch(root, server, log=lines.append)
    assert "tiny_nli: nli/test.jsonl replaced (its checksum differed)" in lines
    row = {r.name: r for r in F.status(root)[2]}["tiny_nli"]
    assert row.where == root / "nli" and not row.damaged


def test_a_data_dir_under_a_file_is_refused_saying_what_was_expected(tmp_path, capsys):
    """--data-dir below (or at) an existing file: a DataError saying a folder was expected, not a bare
    NotADirectoryError from mkdir (fetch), nor a table of "not found" tasks ending in a suggested fetch
    that would fail so (list, issue 52 item 9)."""
    file = tmp_path / "notes.txt"
    file.write_text("not a folder\n")
    for where, says in ((file / "data", f"lies under {file}, which is a file"), (file, "is a file")):
        for command in (["fetch", "next_item", "--no-progress"], ["list"]):
            assert cli.main(["data", *command, "--data-dir", str(where)]) == 1
            out, err = capsys.readouterr()
            assert f"linicl data {command[0]}: error: data directory {str(where)!r} (from data_dir) {says}: " \
                   f"expected a directory" in err and "--data-dir" in err
            assert "not found" not in out and "linicl data fetch" not in out
        with pytest.raises(DataError, match="expected a directory"):
            F.status(where)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_and_missing_file_name_the_url(tmp_path, server):
    root = with_spec(tmp_path / "data", nli_spec())
    base = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(DataError, match=rf"download failed: {re.escape(base)}/someone/nli-data/0123abc/"
                                        rf"train\.jsonl: "):
        F.fetch(["tiny_nli"], root, base_url=base, progress=False, timeout=5)
    server.files.pop("someone/nli-data/0123abc/test.jsonl")
    with pytest.raises(DataError, match=rf"download failed: {re.escape(server.url)}/someone/nli-data/0123abc/"
                                        r"test\.jsonl: HTTP 404"):
        _fetch(root, server)


def test_tasks_without_urls_and_unknown_tasks(tmp_path, server):
    root = with_spec(tmp_path / "data", {**nli_spec(), "files": {"train": "nli/a.jsonl", "test": "nli/b.jsonl"},
                                         "extra_files": []}, name="local")
    with pytest.raises(DataError, match=r"'local' cannot be fetched.*no url and sha256 for \['nli/a.jsonl'"):
        _fetch(root, server, names=["local"])
    with pytest.raises(DataError, match="unknown task 'nope'"):
        _fetch(root, server, names=["nope"])


# ----------------------------------------------------------------------------- where the data goes

def test_the_default_cache_is_where_fetch_writes_and_loaders_read(tmp_path, server, monkeypatch):
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(F.BASE_URL_ENV, server.url)
    cache = tmp_path / "cache" / "linicl" / "data"
    assert ds.default_data_dir() == cache and ds.locate_data_dir() == (cache, "default")
    with pytest.raises(DataError, match="default cache.*linicl data fetch"):
        load_task("tiny_nli")
    with_spec(cache, nli_spec())
    F.fetch(["tiny_nli"], progress=True, timeout=10)  # the progress bars run too
    assert load_task("tiny_nli").test[0].output == "yes"
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path / "elsewhere"))  # the variable still wins
    with pytest.raises(DataError, match=f"from {ds.ENV_VAR}"):
        load_task("tiny_nli")


def test_rebase_url():
    url = "https://raw.githubusercontent.com/o/r/abc/data/x.txt?raw=1"
    assert F.rebase_url(url, None) == url
    assert F.rebase_url(url, "http://127.0.0.1:8000") == "http://127.0.0.1:8000/o/r/abc/data/x.txt?raw=1"
    assert F.rebase_url(url, "http://mirror:81/m/") == "http://mirror:81/m/o/r/abc/data/x.txt?raw=1"
    with pytest.raises(DataError, match="base_url"):
        F.rebase_url(url, "mirror.example.org")


# ----------------------------------------------------------------------------- the command line

def test_cli_data_fetch_and_list(tmp_path, server, capsys):
    root = with_spec(tmp_path / "data", nli_spec())
    assert cli.main(["data", "fetch", "tiny_nli", "--data-dir", str(root), "--base-url", server.url,
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tiny_nli: nli/train.jsonl downloaded" in out
    assert cli.main(["data", "list", "--data-dir", str(root)]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"tiny_nli +{re.escape(str(root / 'nli'))} +\d+\.\d KB +test data", table)
    assert re.search(r"sst2 +not found +\d+\.\d KB +Apache-2.0", table)
    assert "linicl data fetch agnews ai2sci antonym" in table  # how to get the rest
    assert cli.main(["data", "fetch", "nope", "--data-dir", str(root), "--no-progress"]) == 1
    assert "linicl data fetch: error: unknown task 'nope'" in capsys.readouterr().err


def test_fetch_a_shipped_task_from_a_mirror_of_its_sources(tmp_path, full_dir):  # noqa: F811
    """The shipped specs' URLs and checksums, served from copies of the full files."""
    shared_dir = full_dir
    served = {}
    for name in ("trec", "next_item"):
        for f in specs.find_spec(name, None).all_files():
            served[urllib.parse.urlsplit(f.url).path.lstrip("/")] = (shared_dir / f.path).read_bytes()
    root = tmp_path / "data"
    with Server(served) as mirror:
        F.fetch(["trec", "next_item"], root, base_url=mirror.url, progress=False, timeout=10)
    assert list_tasks(root) == ["next_item", "trec"]
    assert load_task("trec", root) == load_task("trec", shared_dir)
    licence = "classification/LICENSE"
    assert (root / licence).read_bytes() == (shared_dir / licence).read_bytes()
