"""Wall-clock timing of jitted functions for benchmarks, never for assertions: run time with compilation
excluded (``time_call``), compilation itself (``CompileMeter``, ``first_and_second_call``), and the FLOP
count and matmul peer that a forward pass's rate is compared with (``forward_flops``, ``matmul_peer``,
``matmul_rate``)."""

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


def matmul_peer(cfg, batch: int, seq: int, seed: int = 0):
    """``(fn, weights, x, flops)``: a forward pass's matrix products alone, on the same shapes, as one
    jitted chain of ``jnp.dot``/``jnp.matmul``; its rate is the ceiling the model's forward can
    approach on this machine (no norms, softmax, rope or layout changes).

    Per layer: the q, k, v projections ``[b T, d] @ [d, heads d_head]`` (k and v with ``kv_heads``),
    scores ``[b, H, T, d_head] @ [b, H, d_head, T]``, scores @ v, the output projection ``[b T, H d_head]
    @ [H d_head, d]`` and the MLP's two or three products; then the unembedding ``[b T, d] @ [d,
    vocab]``. Float32 weights and input ``x: f32[b T, d]`` drawn with NumPy (``seed``); each layer's
    output feeds the next, so nothing is skipped. Call as ``fn(weights, x)`` -> ``f32[b T, vocab]``.
    ``flops`` is ``forward_flops(cfg, batch, seq)`` (2 m n k per product): the same count as the model.
    """
    import jax.numpy as jnp
    import numpy as np
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"matmul_peer: {name} must be a positive int, got {value!r}")
    d, H, Hkv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    n_mlp_in = 2 if cfg.mlp == "gated" else 1
    rng = np.random.default_rng(seed)

    def w(*shape):  # 1/sqrt(fan_in) keeps activations O(1) through the chain (no inf/NaN slow paths)
        return jnp.asarray(rng.normal(size=shape, scale=shape[0] ** -0.5).astype(np.float32))
    layers = [dict(q=w(d, H * dh), k=w(d, Hkv * dh), v=w(d, Hkv * dh), o=w(H * dh, d),
                   fc_in=[w(d, cfg.d_ff) for _ in range(n_mlp_in)], fc_out=w(cfg.d_ff, d))
              for _ in range(cfg.n_layers)]
    weights = dict(layers=layers, unembed=w(d, cfg.vocab_size))
    x = jnp.asarray(rng.normal(size=(batch * seq, d)).astype(np.float32))
    rep = H // Hkv

    def heads(a, n):  # [b T, n dh] -> [b, n, T, dh]
        return a.reshape(batch, seq, n, dh).transpose(0, 2, 1, 3)

    def fn(weights, x):
        for lw in weights["layers"]:
            q, k, v = heads(x @ lw["q"], H), heads(x @ lw["k"], Hkv), heads(x @ lw["v"], Hkv)
            k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
            a = jnp.matmul(jnp.matmul(q, k.swapaxes(-1, -2)) * (1.0 / seq), v)
            x = a.transpose(0, 2, 1, 3).reshape(batch * seq, H * dh) @ lw["o"]
            h = sum(x @ wi for wi in lw["fc_in"])
            x = h @ lw["fc_out"]
        return x @ weights["unembed"]
    return jax.jit(fn), weights, x, forward_flops(cfg, batch, seq)


# jax.monitoring's names for the three parts of a compilation and the persistent cache's events.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # one per executable built
_COMPILE_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                      "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                      _BACKEND_COMPILE: "backend_s"}
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
                 "/jax/compilation_cache/cache_misses": "cache_misses"}


class CompileMeter:
    """Sums the compile time JAX reports (``jax.monitoring``) and counts the persistent compilation
    cache's hits and misses between ``start()`` and ``read()``.

    ``read()`` gives ``trace_s`` (Python tracing), ``lower_s`` (lowering to StableHLO), ``backend_s``
    (XLA compile, or loading from the persistent cache), ``compile_s`` (their sum), ``programs`` (the
    executables built: one backend compile or cache load each), ``cache_hits`` and ``cache_misses``;
    ``programs_by_name()`` and ``backend_s_by_name()`` the executables and XLA seconds per
    function name.
    JAX offers no way to unregister a listener, so each meter listens for the rest of the process: make
    one per process (a benchmark's child), not one per measurement.
    """

    def __init__(self):
        import collections

        from jax import monitoring
        self.totals = collections.Counter()
        self._name_programs = collections.Counter()
        self._name_s = collections.Counter()
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, event, seconds, fun_name=None, **_):
        if event in _COMPILE_DURATIONS:
            self.totals[_COMPILE_DURATIONS[event]] += seconds
            if event == _BACKEND_COMPILE:
                self.totals["programs"] += 1
                self._name_programs[fun_name or "?"] += 1
                self._name_s[fun_name or "?"] += seconds

    def _event(self, event, **_):
        if event in _CACHE_EVENTS:
            self.totals[_CACHE_EVENTS[event]] += 1

    def start(self) -> None:
        """Forget what was counted so far."""
        self.totals.clear()
        self._name_programs.clear()
        self._name_s.clear()

    def programs_by_name(self) -> dict:
        """``{name: executables built}`` since ``start()``, most first: ``jit(apply)`` for a jitted
        ``model.apply``; an operation run eagerly builds one named after its primitive
        (``jit(add)``, ``jit(concatenate)``), once per shape and dtype."""
        return dict(self._name_programs.most_common())

    def backend_s_by_name(self) -> dict:
        """``{name: seconds}`` of XLA compiling (``backend_s``) since ``start()``, per function name."""
        return dict(self._name_s.most_common())

    def read(self) -> dict:
        """The totals since ``start()`` (see the class)."""
        out = {name: float(self.totals[name]) for name in _COMPILE_DURATIONS.values()}
        out["compile_s"] = sum(out.values())
        out["programs"] = int(self.totals["programs"])
        out.update({name: int(self.totals[name]) for name in _CACHE_EVENTS.values()})
        return out


def first_and_second_call(meter: CompileMeter, fn: Callable) -> dict:
    """``fn()`` called twice, each waited for with ``block_until_ready``: ``first_call_s`` (wall time
    of the first call) with its compile part (``meter.read()``'s fields) and ``run_s`` (the second,
    identical call: running only, when nothing is compiled again)."""
    if not callable(fn):
        raise ValueError(f"first_and_second_call: fn must be a callable of no arguments, got {fn!r}")
    meter.start()
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    row = dict(first_call_s=time.perf_counter() - t0, **meter.read())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    row["run_s"] = time.perf_counter() - t0
    return row
