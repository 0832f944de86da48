"""Wall-clock timing of jitted functions (compile excluded): for benchmarks, never for assertions."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def time_call(fn: Callable, *args, repeats: int = 5, min_seconds: float = 0.0) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up call (which compiles).

    Each call is waited for with ``block_until_ready``. With ``min_seconds`` > 0 the calls are
    repeated until at least that much time has passed, to steady very short timings.
    """
    jax.block_until_ready(fn(*args))
    samples, start = [], time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
