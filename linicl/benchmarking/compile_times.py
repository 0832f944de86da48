"""Compile time of linicl's calls: each call's first run (compilation and run) against its second
(run only), split into tracing, lowering and XLA / persistent-cache time by
``linicl.timing.CompileMeter``; and the ratios that compare two processes' measurements (a cold
against a warm persistent cache, the scanned against the looped blocks)."""

from __future__ import annotations

from typing import Sequence

from linicl.timing import CompileMeter, first_and_second_call


def counting_prompt(n: int):
    """``int32[1, n]``: the ids ``1 + (7 i mod 100)``, a fixed prompt of any length."""
    import jax.numpy as jnp
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"counting_prompt: n must be a positive int, got {n!r}")
    return jnp.asarray([[1 + (7 * i) % 100 for i in range(n)]], jnp.int32)


def _check_lengths(lengths: Sequence[int]) -> list:
    lengths = list(lengths)
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths!r}")
    return lengths


def forward_compile_times(meter: CompileMeter, model, variables, lengths: Sequence[int], scan: bool = False) -> list:
    """``jax.jit(model.apply)`` on ``counting_prompt(T)`` for each T of ``lengths`` in turn, in one jitted
    function (a new length is a new shape: compiled again). With ``scan`` the model's blocks run under
    ``jax.lax.scan`` (one block in the traced program). One row per length: ``prompt_len`` and
    ``first_and_second_call``'s fields."""
    import jax
    forward = jax.jit(model.clone(scan=scan).apply)
    rows = []
    for n in _check_lengths(lengths):
        tokens = counting_prompt(n)  # made before the clock starts
        rows.append(dict(prompt_len=n, **first_and_second_call(meter, lambda: forward(variables, tokens))))
    return rows


def generate_compile_times(meter: CompileMeter, model, variables, lengths: Sequence[int], new: int) -> list:
    """``linicl.generate`` of ``new`` tokens after ``counting_prompt(T)`` for each T of ``lengths`` in turn
    (a length in a bucket already compiled reuses its prefill; the decode scan never depends on the
    prompt's length). One row per length: ``prompt_len``, ``new`` and ``first_and_second_call``'s fields."""
    from linicl.generation import generate
    if not isinstance(new, int) or new < 1:
        raise ValueError(f"generate_compile_times: new must be a positive int, got {new!r}")
    rows = []
    for n in _check_lengths(lengths):
        tokens = counting_prompt(n)
        rows.append(dict(prompt_len=n, new=new, **first_and_second_call(
            meter, lambda: generate(model, variables, tokens, new))))
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def warm_over_cold(cold: dict, warm: dict) -> dict:
    """warm / cold of two measurements of one task: for an end-to-end one (``total_s``, ``compile_s``)
    ``{"total", "compile"}``; for one with ``calls`` (rows of ``first_call_s`` and ``compile_s``) the
    whole process's wall time (``process_wall_s``) and per call the first-call and compile time. A
    zero denominator gives NaN."""
    if "total_s" in cold:
        return dict(total=_ratio(warm["total_s"], cold["total_s"]),
                    compile=_ratio(warm["compile_s"], cold["compile_s"]))
    if len(cold["calls"]) != len(warm["calls"]):
        raise ValueError(f"warm_over_cold: {len(cold['calls'])} cold calls against {len(warm['calls'])} warm ones")
    return dict(process=_ratio(warm["process_wall_s"], cold["process_wall_s"]),
                calls=[dict(prompt_len=c["prompt_len"], first_call=_ratio(w["first_call_s"], c["first_call_s"]),
                            compile=_ratio(w["compile_s"], c["compile_s"]))
                       for c, w in zip(cold["calls"], warm["calls"])])


def scan_over_loop(loop: dict, scan: dict) -> dict:
    """The scanned forward over the looped one: for each phase (``cold``, ``warm``) and call, the
    ratio of first-call and of compile time (``{"cold": [{"prompt_len", "first_call", "compile"}],
    "warm": [...]}``)."""
    return {phase: [dict(prompt_len=a["prompt_len"], first_call=_ratio(b["first_call_s"], a["first_call_s"]),
                         compile=_ratio(b["compile_s"], a["compile_s"]))
                    for a, b in zip(loop[phase]["calls"], scan[phase]["calls"])]
            for phase in ("cold", "warm")}
