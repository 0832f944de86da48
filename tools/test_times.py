"""Where the test suite's time goes: the table of the last recorded run.

``make test`` records every test (``LINICL_TEST_TIMES``, tests/conftest.py): its wall time, the XLA
programs it built and their compile seconds, and each test process's peak resident memory. This tool
reads that folder and prints the suite's wall time, the time per test file (with its compile share and
programs) and the slowest tests::

    python tools/test_times.py                  # the last `make test` (.test-times/)
    python tools/test_times.py DIR --top 30 --json out.json

A test's compile seconds and programs include those of the Python subprocesses it starts (the
experiments' quick runs, the notebooks' kernels: tests/timing_site/sitecustomize.py records them).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read(folder: Path) -> dict:
    """``dict(tests=[{test, s, compile_s, programs, names, worker, sub_compile_s, sub_programs}], wall_s,
    workers={worker: peak_rss_mib}, subprocesses=[{of, command, compile_s, programs, names, peak_rss_mib}])``
    (``names``, ``name_s``: programs built and their XLA seconds per function name; absent in runs
    recorded before they were counted)
    from the JSON-lines files of one recorded run. A subprocess's compiles (``sub-<pid>.jsonl``,
    tests/timing_site) are added to the test that started it, and also kept apart (``sub_*``)."""
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no recorded run in {folder}: run `make test` (or pytest with LINICL_TEST_TIMES={folder})")
    tests, starts, finishes, workers, subs = [], {}, {}, {}, []
    for path in files:
        worker = path.stem
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "of" in r:
                subs.append(r)
            elif r.get("event") == "start":
                starts[worker] = r["t"]
            elif r.get("event") == "finish":
                finishes[worker] = r["t"]
                workers[worker] = r["peak_rss_mib"]
            else:
                tests.append(dict(r, worker=worker, sub_compile_s=0.0, sub_programs=0,
                                  names=dict(r.get("names", {})), name_s=dict(r.get("name_s", {}))))
    by_id = {t["test"]: t for t in tests}
    for r in subs:
        t = by_id.get(r["of"])
        if t is not None:  # (a subprocess of a test that did not finish has no row to join)
            t["sub_compile_s"] += r["compile_s"]
            t["sub_programs"] += r["programs"]
            t["compile_s"] += r["compile_s"]
            t["programs"] += r["programs"]
            for key in ("names", "name_s"):
                for name, n in r.get(key, {}).items():
                    t[key][name] = t[key].get(name, 0) + n
    wall = (max(finishes.values()) - min(starts.values())) if starts and finishes else None
    return dict(tests=tests, wall_s=wall, workers=workers, subprocesses=subs)


def by_file(tests: list) -> list:
    """Per test file: ``[file, tests, seconds, compile seconds, programs]``, slowest first."""
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for t in tests:
        a = agg[t["test"].split("::")[0]]
        a[0] += 1
        a[1] += t["s"]
        a[2] += t["compile_s"]
        a[3] += t["programs"]
    return sorted(([f, *v] for f, v in agg.items()), key=lambda r: -r[2])


def by_name(tests: list) -> list:
    """``[name, programs, XLA seconds, tests that built one]`` over the run, most seconds first:
    ``jit(apply)`` is a jitted forward, a primitive's name (``jit(add)``) an operation run eagerly."""
    programs, seconds, users = collections.Counter(), collections.Counter(), collections.Counter()
    for t in tests:
        for name, n in t.get("names", {}).items():
            programs[name] += n
            users[name] += 1
            seconds[name] += t.get("name_s", {}).get(name, 0.0)
    order = sorted(programs, key=lambda name: (-seconds[name], -programs[name], name))
    return [[name, programs[name], seconds[name], users[name]] for name in order]


def table(run: dict, top: int) -> str:
    tests = run["tests"]
    total = sum(t["s"] for t in tests)
    compile_s = sum(t["compile_s"] for t in tests)
    wall = run["wall_s"]
    lines = [f"{len(tests)} tests; wall {wall / 60:.1f} min" if wall is not None else f"{len(tests)} tests",
             f"test time summed over processes {total / 60:.1f} min, of it compiling {compile_s / 60:.1f} min "
             f"({100 * compile_s / max(total, 1e-9):.0f} %), {sum(t['programs'] for t in tests)} XLA programs built",
             "peak resident memory per process (MiB): " + ", ".join(
                 f"{w} {m:.0f}" for w, m in sorted(run["workers"].items())),
             *_subprocess_lines(run),
             "", f"By file (the {top} slowest):", "",
             "| file | tests | s | compile s | programs |", "|---|---|---|---|---|"]
    lines += [f"| {f} | {n} | {s:.0f} | {c:.0f} | {p} |" for f, n, s, c, p in by_file(tests)[:top]]
    lines += ["", f"The {top} slowest tests:", "", "| test | s | compile s | programs |", "|---|---|---|---|"]
    lines += [f"| {t['test']} | {t['s']:.1f} | {t['compile_s']:.1f} | {t['programs']} |"
              for t in sorted(tests, key=lambda t: -t["s"])[:top]]
    names = by_name(tests)
    if names:
        lines += ["", f"Programs by function name (the {top} of most XLA seconds):", "",
                  "| name | programs | XLA s | tests |", "|---|---|---|---|"]
        lines += [f"| {name} | {n} | {c:.1f} | {k} |" for name, n, c, k in names[:top]]
    return "\n".join(lines)


def _subprocess_lines(run: dict) -> list:
    """The subprocesses' share of the compiles and the largest of them in memory (none: no line)."""
    subs = run["subprocesses"]
    if not subs:
        return []
    largest = max(subs, key=lambda r: r["peak_rss_mib"])
    return [f"{len(subs)} subprocesses started by tests (counted in their tests' rows): compiling "
            f"{sum(r['compile_s'] for r in subs) / 60:.1f} min, {sum(r['programs'] for r in subs)} programs; "
            f"largest {largest['peak_rss_mib']:.0f} MiB ({largest['command']})"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default=str(ROOT / ".test-times"),
                   help="the recorded run (default .test-times)")
    p.add_argument("--top", type=int, default=30, help="rows of each table")
    p.add_argument("--json", default=None, help="also write the per-file rows and the slowest tests here")
    args = p.parse_args(argv)
    run = read(Path(args.folder))
    print(table(run, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(wall_s=run["wall_s"], workers=run["workers"],
                                                   files=by_file(run["tests"]), subprocesses=run["subprocesses"],
                                                   names=by_name(run["tests"]),
                                                   slowest=sorted(run["tests"], key=lambda t: -t["s"])[:args.top]),
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
