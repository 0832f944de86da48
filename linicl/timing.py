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


# XLA compile options for small graphs on a CPU, where compiling dominates. QUICK_COMPILE (level 1
# without LLVM's expensive passes) runs as fast as the default here and compiles about a third
# faster: for functions called every step. FAST_COMPILE does not optimise: for functions called a
# few times. Pass as ``jax.jit(fn, compiler_options=...)``.
QUICK_COMPILE = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB: VmHWM on Linux (reset by exec, unlike
    ``ru_maxrss``, which a child inherits from the process that spawned it), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forward_flops(cfg, batch: int, seq: int) -> int:
    """Floating-point operations of the matrix products of one forward pass over ``batch x seq`` tokens
    (2 m n k per product): per layer the q, k, v and output projections, scores and scores @ v over
    all ``seq x seq`` pairs (no causal halving, no window), and the MLP's two or three products; then
    the unembedding. Norms, softmax and rope are left out: the count is what MFU divides by."""
    d, H, Hkv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    n_mlp_in = 2 if cfg.mlp == "gated" else 1
    M = batch * seq
    per_layer = (2 * M * d * (H + 2 * Hkv) * dh + 2 * 2 * batch * H * seq * seq * dh + 2 * M * H * dh * d
                 + 2 * M * d * cfg.d_ff * (n_mlp_in + 1))
    return int(cfg.n_layers * per_layer + 2 * M * d * cfg.vocab_size)


def matmul_rate(n: int = 2048, dtype=None, repeats: int = 5) -> float:
    """FLOP/s of one jitted ``[n, n] @ [n, n]`` product on the default device (float32 unless ``dtype``):
    the peer that a forward pass's rate is compared with on the same machine, in the same run."""
    import jax.numpy as jnp
    dtype = jnp.float32 if dtype is None else dtype
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    return 2 * n ** 3 / time_call(jax.jit(lambda x: x @ x), a, repeats=repeats)
