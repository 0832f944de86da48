"""experiments/benchmarks/compile_speed.py: the scanned forward is one of its tasks, measured in process at
its quick size (``linicl.benchmarking.forward_compile_times``, as its child process runs it), and
``scan_over_loop`` divides each scanned call's times by the loop's of the same run. (The full benchmark
spawns fresh processes, cold and warm; it is run by hand, not here.)"""

from __future__ import annotations

import pytest

from helpers import REPO, load_module
from linicl.benchmarking import forward_compile_times, scan_over_loop, tiny_softmax_lm
from linicl.timing import CompileMeter

SCRIPT = REPO / "experiments" / "benchmarks" / "compile_speed.py"


@pytest.fixture(scope="module")
def bench():
    return load_module(SCRIPT, "compile_speed")


def test_the_scanned_forward_is_measured_like_the_loop(bench):
    assert {"forward", "forward_scan"} <= set(bench.TASKS)
    model, variables = tiny_softmax_lm()
    (call,) = forward_compile_times(CompileMeter(), model, variables, lengths=[3], scan=True)
    assert call["prompt_len"] == 3 and call["first_call_s"] >= call["compile_s"] > 0
    assert call["run_s"] >= 0 and call["cache_misses"] + call["cache_hits"] >= 0


def test_scan_over_loop_divides_each_call():
    calls = lambda first, compile_s: dict(calls=[dict(prompt_len=7, first_call_s=first, compile_s=compile_s)])  # noqa: E731
    loop = dict(cold=calls(4.0, 2.0), warm=calls(1.0, 0.5))
    scan = dict(cold=calls(1.0, 1.0), warm=calls(0.5, 0.5))
    r = scan_over_loop(loop, scan)
    assert r == dict(cold=[dict(prompt_len=7, first_call=0.25, compile=0.5)],
                     warm=[dict(prompt_len=7, first_call=0.5, compile=1.0)])
