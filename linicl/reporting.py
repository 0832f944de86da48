"""What every experiment and benchmark script does besides its experiment: shared flags, a record of
the machine, JSON results, Markdown tables and optional plots.

A script reads::

    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/mine", quick="CI: a tiny run", seed="data and init")
    args = parser.parse_args(argv)
    ...
    report = dict(machine=reporting.machine_info(), results=...)
    reporting.write_json(os.path.join(args.out, "mine.json"), report)
    print(reporting.markdown_table(["task", "accuracy"], rows))       # the table before any plot
    reporting.plot(os.path.join(args.out, "mine.png"), draw, report)  # draw(plt, report) -> figure

Plots are optional (``pip install 'linicl[plots]'``): without matplotlib ``plot`` prints one line, once
per process, and returns None, so a script never fails after its numbers are written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from linicl.errors import DataError, LiniclError

PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'linicl[plots]')"
_said_skipped = False  # the line above is printed once per process, however many plots are skipped


# ------------------------------------------------------------------------------ arguments
def argument_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring ``doc`` as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(parser: argparse.ArgumentParser, *, out: str, quick: str, seed: Optional[str] = None,
                    progress: bool = True, data_dir: bool = False, plots: bool = False) -> argparse.ArgumentParser:
    """Add the flags the scripts share; returns ``parser``.

    Args:
      out: the default of ``--out``, the results folder (``args.out``).
      quick: the help of ``--quick`` (``args.quick``), which says what the CI-sized run does.
      seed: the help of ``--seed`` (``args.seed``, an int, default 0), which says what it seeds; None:
        no ``--seed`` (a script with several seeds has its own ``--seeds``).
      progress: add ``--no-progress``, which sets ``args.progress`` to False (progress bars off).
      data_dir: add ``--data-dir`` (``args.data_dir``, default None: ``$LINICL_DATA_DIR``).
      plots: add ``--no-plots``, which sets ``args.plots`` to False (the JSON only).
    """
    parser.add_argument("--out", default=out, help=f"results folder (default {out})")
    parser.add_argument("--quick", action="store_true", help=quick)
    if seed is not None:
        parser.add_argument("--seed", type=int, default=0, help=seed)
    if progress:
        parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    if data_dir:
        parser.add_argument("--data-dir", default=None, help="data directory (default $LINICL_DATA_DIR)")
    if plots:
        parser.add_argument("--no-plots", dest="plots", action="store_false", help="write no plots")
    return parser


# ------------------------------------------------------------------------------ argument types
def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (counts, sizes, lengths); argparse turns the ValueError into
    ``error: argument --x: invalid positive_int value``, with the usage line."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse ``type``: an int >= 0 (a count that may be zero, e.g. demonstrations per prompt)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_int_list(text: str) -> list:
    """An argparse ``type``: comma-separated ints >= 1 (``"5,10,25"``)."""
    return [positive_int(part) for part in text.split(",")]


def nonnegative_int_list(text: str) -> list:
    """An argparse ``type``: comma-separated ints >= 0 (``"0,50,90"``, e.g. training steps)."""
    return [nonnegative_int(part) for part in text.split(",")]


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float > 0 (learning rates, scales)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """An argparse ``type``: a finite float >= 0 (weight decay, regularisers)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def writable_dir(path: str) -> str:
    """Create ``path`` if needed and check a file can be written there, so that a run fails at its
    start, not after hours of work, when it cannot save its results. Raises OSError."""
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".linicl-write-test-"):
        pass
    return path


# ------------------------------------------------------------------------------ the machine
def load_average() -> list:
    """The 1, 5 and 15 minute load averages, rounded to 0.01 (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict:
    """Where the numbers were measured: ``platform``, ``processor``, ``python``, ``jax``, ``devices``
    (``str(jax.devices())``), ``cpu_count`` and ``xla_flags`` (``$XLA_FLAGS``)."""
    import jax  # here, not at import: a script may set jax options before the backend starts

    return dict(platform=platform.platform(), processor=platform.processor(),
                python=platform.python_version(), jax=jax.__version__, devices=str(jax.devices()),
                cpu_count=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS", ""))


# ------------------------------------------------------------------------------ results
def _plain(x: Any) -> Any:
    """``json.dump``'s fallback: NumPy and JAX scalars and arrays as numbers and lists, paths as
    strings. Anything else raises TypeError naming its type."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if hasattr(x, "__array__") and hasattr(x, "dtype"):  # a jax.Array, without importing jax
        return np.asarray(x).tolist()
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    raise TypeError(f"write_json: a {type(x).__name__} is not JSON serialisable")


def write_json(path, obj: Any, *, indent: Optional[int] = 1) -> Path:
    """Write ``obj`` as JSON to ``path`` (NumPy/JAX values converted), creating its folder. The file is
    replaced atomically: an interrupted write leaves the previous file, never half of a new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent, default=_plain)
    os.replace(tmp, path)
    return path


def read_json(path, *, what: str, fix: str, kind: type = dict) -> Any:
    """The JSON value in ``path`` (a file this package wrote, e.g. a run's progress or summary), which
    must be a ``kind`` (a dict by default). An unreadable file, bad JSON (say, a copy cut short) or
    another type is a ``DataError`` naming the path, ``what`` the file should hold and ``fix`` (what to
    do, e.g. "delete it to restart"), never a bare JSON traceback."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot be read as {what} ({e}); {fix}") from None
    if not isinstance(value, kind):
        raise DataError(f"{path}: should hold {what} ({_json_kind(kind)}), got {_json_kind(type(value))}; {fix}")
    return value


def _json_kind(t: type) -> str:
    """What JSON calls values of the Python type ``t`` (``dict``: "an object"), for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(t, f"a {t.__name__}")


def markdown_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table: ``| a | b |``, ``|---|---|``, then one line per row. An empty cell is
    written ``| |``."""
    def line(cells) -> str:
        return "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


# ------------------------------------------------------------------------------ plots
def _pyplot():
    """matplotlib.pyplot (the Agg backend unless pyplot was already in use), or None."""
    try:
        import matplotlib
        if "matplotlib.pyplot" not in sys.modules:  # files only: no window, no display needed
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(path, draw: Callable, *args, dpi: int = 110) -> Optional[Path]:
    """Save the figure ``draw(plt, *args)`` returns as ``path`` (a PNG) and close it; returns the
    path. Without matplotlib: prints ``PLOTS_SKIPPED`` (once per process) and returns None."""
    global _said_skipped
    plt = _pyplot()
    if plt is None:
        if not _said_skipped:
            print(PLOTS_SKIPPED, flush=True)
            _said_skipped = True
        return None
    fig = draw(plt, *args)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def run_logged(cmd: Sequence[str], folder) -> None:
    """Run one step of a grid of runs (``cmd``, e.g. ``[sys.executable, script, ...]``) with its output
    in ``folder/stdout.txt`` (``folder`` created); a RuntimeError naming the log when it fails."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stdout.txt", "w") as log:
        code = subprocess.call(list(cmd), stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"{folder.name}: {Path(cmd[1]).name if len(cmd) > 1 else cmd[0]} exited {code}; "
                           f"see {folder / 'stdout.txt'}")


def publish(out, name: str, report: dict, table: str, figure: Optional[Callable] = None, plots: bool = True) -> None:
    """The end of an experiment: ``report["table"] = table``, ``OUT/name.json``, the table printed, and
    ``OUT/name.png`` from ``figure(plt, report)`` (when given and ``plots``); says what it wrote."""
    report["table"] = table
    write_json(Path(out) / f"{name}.json", report)
    print(table)
    png = plot(Path(out) / f"{name}.png", figure, report) if figure is not None and plots else None
    wall = f" ({report['wall_s']:.0f} s)" if "wall_s" in report else ""
    print(f"wrote {out}/{name}.json" + (f" and {name}.png" if png else "") + wall)


# ------------------------------------------------------------------------------ resumable runs
def fingerprint(settings: dict, ignore: Sequence[str] = ()) -> str:
    """A short hash of the settings that change a result (``ignore``: output folder, progress bars and
    the like), so that a resumed run never mixes numbers made under other settings."""
    import hashlib

    kept = {k: v for k, v in sorted(settings.items()) if k not in set(ignore)}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=_plain).encode()).hexdigest()[:12]


class Progress:
    """A long run's finished work in ``path`` (JSON, rewritten atomically after every ``put``), so that an
    interrupted run resumes where it stopped.

    ``state`` holds the ``fingerprint`` of the settings, ``results`` (a finished unit's row by key, e.g.
    one task or one (task, k) cell) and ``timings`` (wall seconds by phase name). A file made under other
    settings, or ``resume=False``, starts afresh (said on stderr when a file is set aside); with
    ``refuse_other`` a file made under other settings is an error instead (``LiniclError``: a run whose
    saved work is expensive should not be thrown away by a mistyped flag).
    A file that holds no progress (bad JSON, e.g. cut short; not an object; ``results`` or ``timings``
    not objects) is a ``DataError`` naming it, whatever the settings: never read as empty progress;
    deleting it restarts the run.

        prog = reporting.Progress(os.path.join(out, "progress.json"), fingerprint(vars(args), ignore), resume)
        for key in cells:
            row = prog.get(key) or prog.put(key, compute(key))
    """

    def __init__(self, path, fp: str, resume: bool = True, *, refuse_other: bool = False):
        self.path = Path(path)
        self.state = {"fingerprint": fp, "timings": {}, "results": {}}
        if resume and self.path.exists():
            old = self._read()
            if old.get("fingerprint") == fp:
                self.state = {**self.state, **old}
            elif refuse_other:
                raise LiniclError(f"resume: {self.path} is from other settings ({old.get('fingerprint')} != {fp}); "
                                  "use another output folder or delete it")
            else:
                print(f"resume: {self.path} was made under other settings ({old.get('fingerprint')} != {fp}); "
                      "starting afresh", file=sys.stderr)
        self.resumed = bool(self.state["timings"] or self.state["results"])

    def _read(self) -> dict:
        """The saved state; a ``DataError`` naming the file when it is not one (cut short, edited, or
        another file by that name): its work cannot be reused, and deleting it restarts the run."""
        fix = "delete it to start this run afresh (or use another output folder)"
        old = read_json(self.path, what="a run's progress", fix=fix)
        for part in ("results", "timings"):  # what get, put, done and timed read and write in place
            if not isinstance(old.get(part, {}), dict):
                raise DataError(f"{self.path}: its {part!r} should be an object, got "
                                f"{_json_kind(type(old[part]))}; {fix}")
        return old

    @property
    def results(self) -> dict:
        return self.state["results"]

    def get(self, key: str):
        """The finished row of ``key``, or None."""
        return self.state["results"].get(key)

    def put(self, key: str, row):
        """Record ``row`` as the finished result of ``key`` and save; returns it as a resumed run reads it
        back (JSON types: lists, not arrays), so that a fresh and a resumed run compute alike after it."""
        row = json.loads(json.dumps(row, default=_plain))
        self.state["results"][key] = row
        self.save()
        return row

    def done(self, phase: str) -> bool:
        return f"{phase}_s" in self.state["timings"]

    def save(self) -> None:
        write_json(self.path, self.state)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block and record it as finished phase ``name`` when it ends without an error."""
        t0 = time.perf_counter()
        yield
        self.timed(name, time.perf_counter() - t0)

    def timed(self, phase: str, seconds: float) -> None:
        """Record that ``phase`` finished after ``seconds`` of wall time (added to an earlier part)."""
        key = f"{phase}_s"
        self.state["timings"][key] = self.state["timings"].get(key, 0.0) + float(seconds)
        self.save()
