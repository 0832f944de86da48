"""RESULTS.md: every experiment's headline table, with the command, date and machine that made it.

    python experiments/results.py --run            # run what has no result yet, then write RESULTS.md
    python experiments/results.py                  # only (re)write RESULTS.md from results/
    python experiments/results.py --run --only verify implicit_regression
    python experiments/results.py --run --quick    # the quick modes (CI-sized; says so in RESULTS.md)

Each experiment runs as its own process (``sys.executable experiments/<script> ...``) writing into
``results/<name>/``; its printed output is kept there (``stdout.txt``), with the exact command and its
wall time (``run.json``). A finished experiment is not run again unless ``--force`` (the long ones
resume from their own checkpoints when they support it). The headline of a section is the table the
experiment itself stored in its JSON (``"table"``; intervals included), else the table it printed.
Small PNG plots are copied to ``docs/figures/`` (committed) and linked. Each section also says what
the papers publish to compare with, and says so when they publish nothing comparable.

``results/`` is not committed, so a fresh checkout has none of it: an experiment with no result there
keeps the section the current RESULTS.md already has for it (its measured numbers and linked figure
stay), and only an experiment that was never measured reads "Not run yet".

A long run that spans sessions on fresh machines (each starts from a clone, without ``results/``) carries
its small checkpoint files (``carry`` in its entry of ``experiments/registry.py``: settings, fitted
bases, trained routers; not its large caches, which it rebuilds) in ``experiments/state/<name>/``, which is committed:

    python experiments/results.py --save-state --only routing   # before a session ends: copy them there
    python experiments/results.py --run --only routing          # a later session: copied back, resumed

``--save-state`` on a finished experiment (its JSON exists) removes its state instead: the result is
then in RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
STATE = ROOT / "experiments" / "state"  # committed checkpoints of unfinished long runs (module docstring)

# the table of experiments (data) lives beside this script
sys.path.insert(0, str(Path(__file__).resolve().parent))
from registry import EXPERIMENTS, STATE_LIMIT  # noqa: E402


def _carried(name: str, out: Path) -> list:
    """The files of ``out`` that ``name``'s ``carry`` patterns match (relative paths)."""
    found = {p for pattern in EXPERIMENTS[name].get("carry", []) for p in out.glob(pattern) if p.is_file()}
    return sorted(p.relative_to(out) for p in found)


def save_state(name: str, results: Path) -> None:
    """Copy the carried checkpoint files of an unfinished run into ``STATE/<name>`` (replacing what was
    there); for a finished run remove that folder. With nothing to carry (the run never ran on this machine)
    the folder is left as it was."""
    spec, out, keep = EXPERIMENTS[name], _out(results, name), STATE / name
    if "carry" not in spec:
        raise SystemExit(f"--save-state: {name} carries no state across sessions")
    if (out / spec["json"]).exists():
        shutil.rmtree(keep, ignore_errors=True)
        print(f"{name}: finished; no state kept")
        return
    files = _carried(name, out)
    if not files:  # not run on this machine (or nothing carried yet): what an earlier session kept stays
        print(f"{name}: nothing to carry in {out}; {os.path.relpath(keep, ROOT)} left as it was")
        return
    size, limit = sum((out / f).stat().st_size for f in files), spec.get("state_limit", STATE_LIMIT)
    if size > limit:  # checked before the old state is removed: a refused save keeps what was saved before
        raise SystemExit(f"--save-state: {name}'s carried files are {size / 2**20:.1f} MiB (> {limit >> 20} MiB)")
    shutil.rmtree(keep, ignore_errors=True)
    for f in files:
        (keep / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / f, keep / f)
    print(f"{name}: {len(files)} files ({size / 2**10:.0f} KiB) kept in {os.path.relpath(keep, ROOT)}")


def restore_state(name: str, out: Path) -> None:
    """Copy ``STATE/<name>`` into ``out`` where ``out`` lacks a file (a fresh machine resumes from it)."""
    keep = STATE / name
    if not keep.is_dir():
        return
    copied = 0
    for src in keep.rglob("*"):
        dst = out / src.relative_to(keep)
        if src.is_file() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            copied += 1
    print(f"{name}: resumed from {copied} files of {os.path.relpath(keep, ROOT)}")


def _out(results: Path, name: str) -> Path:
    return results / name


def run_one(name: str, results: Path, quick: bool, force: bool) -> None:
    spec = EXPERIMENTS[name]
    out = _out(results, name)
    if (out / spec["json"]).exists() and not force:
        print(f"{name}: result exists ({out / spec['json']}); --force to run again")
        return
    if spec.get("device") and not quick:
        print(f"{name}: runs on a lent accelerator, not here ({spec['cmd'][0]}'s docstring); its --quick mode "
              f"runs here")
        return
    out.mkdir(parents=True, exist_ok=True)
    if not quick:
        restore_state(name, out)
    cmd = [PY, *spec["cmd"], *(spec["quick"] if quick else spec.get("full", [])), "--out", str(out)]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    with open(out / "stdout.txt", "w") as log:
        code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    shown = [os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(str(ROOT)) else c for c in cmd[1:]]
    record = dict(command=" ".join(["python", *shown]), quick=quick, exit_code=code,
                  wall_s=round(time.time() - start, 1),
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    (out / "run.json").write_text(json.dumps(record, indent=1))
    print(f"{name}: exit {code} after {record['wall_s']} s", flush=True)


def _headline(name: str, report: dict, out: Path) -> str:
    for key in ("table", "headline"):  # the table the experiment stored (an experiment's own "table" may be data)
        if isinstance(report.get(key), str):
            return report[key]
    if name == "verify":
        from linicl.verify import format_table
        return "```\n" + format_table(report) + "\n```"
    printed = (out / "stdout.txt").read_text(errors="replace") if (out / "stdout.txt").exists() else ""
    progress = re.compile(r"\d+%\|")  # tqdm bars
    # tqdm's cursor moves ("\x1b[A", or "[A" where the escape byte was dropped) leave lines of their own
    lines = [ln for ln in printed.splitlines() if ln.strip() and "\r" not in ln and not progress.search(ln)
             and not ln.startswith("wrote ") and "[A" not in ln]
    return "```\n" + "\n".join(lines[-40:]) + "\n```" if lines else "(no table)"


def _machine(report: dict) -> str:
    m = report.get("machine") or {}
    if not m:
        return "not recorded"
    return ", ".join(f"{k} {m[k]}" for k in ("platform", "cpu_count", "jax") if k in m)


def existing_sections(path: Path) -> dict:
    """``{title: text}`` of the sections of the RESULTS.md at ``path`` (none if it does not exist)."""
    if not path.exists():
        return {}
    parts = re.split(r"^## ", path.read_text(), flags=re.M)[1:]
    # ``write`` joins sections with "\n": every part but the last ends with that separator
    parts = [p[:-1] if i < len(parts) - 1 and p.endswith("\n") else p for i, p in enumerate(parts)]
    return {part.split("\n", 1)[0].strip(): "## " + part for part in parts}


def section(name: str, results: Path, figures: Path, base: Path, kept: Optional[dict] = None) -> str:
    """The RESULTS.md section of ``name`` from ``results/``; without a result there, the section of
    ``kept`` (the current file's) of the same title if it holds a measurement."""
    spec = EXPERIMENTS[name]
    out = _out(results, name)
    head = f"## {spec['title']}\n\n"
    if not (out / spec["json"]).exists():
        old = (kept or {}).get(spec["title"])
        if old and "Not run yet" not in old:
            return old
        return head + f"Not run yet: `python experiments/results.py --run --only {name}`.\n"
    report = json.loads((out / spec["json"]).read_text())
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    lines = [head.rstrip("\n"), "",
             f"- command: `{run.get('command', 'not recorded (run outside experiments/results.py)')}`"
             + (" (quick mode: CI-sized, not the experiment's default sizes)" if run.get("quick") else ""),
             f"- date: {run.get('date', 'not recorded')}; wall time: {run.get('wall_s', '?')} s; "
             f"machine: {_machine(report)}",
             f"- papers: {spec['reference']}"] + ([f"- note: {spec['note']}"] if "note" in spec else []) + [
             "", _headline(name, report, out), ""]
    for png in spec["plots"]:
        if (out / png).exists():
            figures.mkdir(parents=True, exist_ok=True)
            target = figures / f"{name}_{png}"
            shutil.copyfile(out / png, target)
            lines.append(f"![{name} {png}]({Path(os.path.relpath(target, base)).as_posix()})")
    return "\n".join(lines) + "\n"


def write(results: Path, path: Path, figures: Path) -> None:
    parts = ["# Results\n",
             "Every number below was measured by the command shown, on the machine shown (`make results` "
             "regenerates this file; `python experiments/results.py --run --only NAME` one section). "
             "Accuracies carry 95 % Wilson intervals and differences of methods on the same queries paired "
             "bootstrap intervals (`linicl.stats`).\n"]
    kept = existing_sections(path)
    parts += [section(name, results, figures, path.parent, kept) for name in EXPERIMENTS]
    path.write_text("\n".join(parts))
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="run the experiments that have no result yet")
    p.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), help="these experiments only")
    p.add_argument("--quick", action="store_true", help="quick modes (CI-sized)")
    p.add_argument("--force", action="store_true", help="run again even when a result exists")
    p.add_argument("--save-state", action="store_true",
                   help="keep the small checkpoints of unfinished runs in experiments/state/ (to commit)")
    p.add_argument("--results", default=str(ROOT / "results"), help="results folder (default: results/)")
    p.add_argument("--output", default=str(ROOT / "RESULTS.md"), help="the file to write")
    p.add_argument("--figures", default=str(ROOT / "docs" / "figures"), help="where plots are copied")
    args = p.parse_args(argv)
    results = Path(args.results)
    if args.run:
        for name in args.only or EXPERIMENTS:
            run_one(name, results, args.quick, args.force)
    if args.save_state:
        for name in args.only or [n for n in EXPERIMENTS if "carry" in EXPERIMENTS[n]]:
            save_state(name, results)
    write(results, Path(args.output), Path(args.figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
