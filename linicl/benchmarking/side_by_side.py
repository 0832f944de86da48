"""linicl's forward and decode speed against a PyTorch reference and against its matmul peer, measured
side by side in one run on a shared machine.

The two sides run in alternating rounds (each PyTorch variant, then JAX, shape by shape) and every
reported time is a median: of ``repeats`` calls after a warm-up call within a round, then of the
rounds; the ratios are also given as the median of the per-round ratios (``_paired``). The load
average is recorded around every round. ``side`` is a ``torch_reference.TorchSide`` or
``TorchWorker`` (``open_torch``), or None for linicl alone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from linicl.benchmarking.torch_reference import random_tokens
from linicl.names import PRETRAINED


def compare_logits(side, name: str, model, variables, tokens: np.ndarray, tmp) -> dict:
    """linicl's logits against those of the PyTorch model ``name`` on the same ``int32[batch, seq]``
    ids (float32 both; arrays pass through ``.npy`` files in the folder ``tmp``): ``max_rel_err``
    (max |a - b| / max |b|), ``max_abs_err``, ``max_abs_logit`` and ``argmax_agreement``."""
    import jax
    import jax.numpy as jnp

    from linicl.metrics import rel_err
    tmp = Path(tmp)
    np.save(tmp / f"{name}_tokens.npy", tokens)
    ref = np.load(side.call("logits", name, str(tmp / f"{name}_tokens.npy"), str(tmp / f"{name}_logits.npy")))
    ours = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(tokens)), np.float64)
    return dict(shape=list(tokens.shape), max_rel_err=rel_err(ours, ref),
                max_abs_err=float(np.max(np.abs(ours - ref))), max_abs_logit=float(np.max(np.abs(ref))),
                argmax_agreement=float(np.mean(ours.argmax(-1) == ref.argmax(-1))))


def torch_variants(side, name: str, threads: Sequence[int], compile: bool = False) -> dict:
    """The PyTorch variants of model ``name`` to time: ``{variant: spec}`` with ``eager`` at
    ``threads[0]`` intra-op threads, ``eager_tN`` at N threads for every further value, and ``compiled``
    (``torch.compile``) when ``compile``; a variant that could not be set up maps to ``"failed: ..."``.
    None when ``side`` is None."""
    if side is None:
        return {}
    if not threads or min(threads) < 1:
        raise ValueError(f"torch_variants: threads must be positive ints, got {threads!r}")
    variants = {"eager": dict(compiled=False, threads=threads[0])}
    for t in threads[1:]:
        variants[f"eager_t{t}"] = dict(compiled=False, threads=t)
    if compile:
        try:
            side.call("compile", name)
            variants["compiled"] = dict(compiled=True, threads=threads[0])
        except RuntimeError as e:
            variants["compiled"] = f"failed: {e}"
    return variants


def torch_twin(side, name: str, model, variables, check: np.ndarray, tmp, threads: Sequence[int]) -> tuple:
    """The same float32 weights in PyTorch: written by ``linicl.lm.save_pretrained`` into ``tmp``,
    loaded by HF as ``name``, logits compared on the ``check`` ids. Returns ``(variants, fields)``:
    the eager variants to time (``torch_variants``; none when any step failed) and the report's
    ``torch_checkpoint`` (the load's info, or ``"failed: ..."``) and ``logits_check``."""
    import linicl.lm
    fields = {}
    try:
        linicl.lm.save_pretrained(Path(tmp) / f"{name}-hf", model, variables)
        fields["torch_checkpoint"] = side.call("load", name, str(Path(tmp) / f"{name}-hf"))
        fields["logits_check"] = compare_logits(side, name, model, variables, check, tmp)
        print(f"{name} logits vs {fields['torch_checkpoint']['model_class']}: max rel err "
              f"{fields['logits_check']['max_rel_err']:.2e}", flush=True)
        return torch_variants(side, name, threads), fields
    except (RuntimeError, OSError) as e:
        return {}, dict(torch_checkpoint=f"failed: {e}")


def variant_status(variants: dict) -> dict:
    """``{variant: spec + status "ok"}``, or the failure string, for the report."""
    return {v: (spec if isinstance(spec, str) else dict(spec, status="ok")) for v, spec in variants.items()}


def _check_shapes(shapes) -> list:
    shapes = [tuple(s) for s in shapes]
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"shapes must be a non-empty list of positive (batch, seq) pairs, got {shapes!r}")
    return shapes


def timed_rounds(model, variables, shapes, *, seed: int = 0, rounds: int = 3, repeats: int = 3,
                 vocab: Optional[int] = None, side=None, name: str = "model", variants: Optional[dict] = None,
                 progress: bool = True) -> list:
    """Forward tokens/s of ``model`` on ``random_tokens(seed, batch, seq, vocab)`` per ``(batch, seq)``
    in ``shapes``: the full forward (``jax.jit(model.apply)``), the last-position forward
    (``linicl.batching.last_token_logits``, what evaluation runs), the matmul peer
    (``linicl.timing.matmul_peer``) and each PyTorch variant of model ``name`` on ``side``, alternating
    ``rounds`` times. A variant that fails (``torch.compile`` without a C++ toolchain, say) is marked
    ``"failed: ..."`` in ``variants`` (which is updated in place) and dropped.

    Returns one row per shape: its per-round times (``rounds``), their medians, tokens/s and ratios
    (``summarise_rounds``), ``matmul_flops`` and the first call's seconds."""
    import jax
    import jax.numpy as jnp

    from linicl.batching import last_token_logits
    from linicl.reporting import load_average
    from linicl.timing import matmul_peer, time_call
    shapes, variants = _check_shapes(shapes), ({} if variants is None else variants)
    if rounds < 1 or repeats < 1:
        raise ValueError(f"timed_rounds: rounds and repeats must be positive, got {rounds} and {repeats}")
    vocab = model.cfg.vocab_size if vocab is None else vocab
    forward = jax.jit(model.apply)
    last = jax.jit(last_token_logits(model))  # evaluation's forward: only the last position unembedded
    rows, peers = [], []
    for batch, seq in shapes:
        tokens = jnp.asarray(random_tokens(seed, batch, seq, vocab))
        t0 = time.perf_counter()
        jax.block_until_ready(forward(variables, tokens))
        rows.append(dict(batch=batch, seq=seq, tokens=batch * seq, jax_first_call_s=time.perf_counter() - t0,
                         rounds=[]))
        fn, weights, x, flops = matmul_peer(model.cfg, batch, seq, seed)
        peers.append((fn, weights, x))
        rows[-1]["matmul_flops"] = flops
    for r in range(rounds):
        for row, (peer, weights, x) in zip(rows, peers):
            batch, seq = row["batch"], row["seq"]
            rnd = dict(load_before=load_average())
            for variant, spec in list(variants.items()):
                if not isinstance(spec, dict):
                    continue
                try:
                    res = side.call("time_forward", name, batch, seq, vocab, seed, repeats, **spec)
                except RuntimeError as e:
                    print(f"warning: torch {variant} failed: {e}", file=sys.stderr)
                    variants[variant] = f"failed: {e}"
                    continue
                rnd[f"torch_{variant}_s"] = res["seconds"]
                row.setdefault(f"torch_{variant}_first_call_s", res["first_call_s"])
                if "max_rel_diff_vs_eager" in res:
                    row.setdefault(f"torch_{variant}_max_rel_diff_vs_eager", res["max_rel_diff_vs_eager"])
            tokens = jnp.asarray(random_tokens(seed, batch, seq, vocab))
            rnd["jax_s"] = time_call(forward, variables, tokens, repeats=repeats)
            lengths = jnp.full((batch,), seq, jnp.int32)
            rnd["jax_last_s"] = time_call(last, variables, tokens, lengths, repeats=repeats)
            rnd["matmul_s"] = time_call(peer, weights, x, repeats=repeats)
            rnd["load_after"] = load_average()
            row["rounds"].append(rnd)
            if progress:
                print(f"  {name} round {r + 1}/{rounds} [{batch}x{seq}] " + "  ".join(
                    f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in rnd.items() if k.endswith("_s"))
                    + f"  (load {rnd['load_after']})", flush=True)
    for row in rows:
        summarise_rounds(row, [v for v, spec in variants.items() if isinstance(spec, dict)])
    return rows


def summarise_rounds(row: dict, variants: Sequence[str] = ()) -> None:
    """Adds to a ``timed_rounds`` row (in place) the medians over its rounds, tokens/s and the ratios:
    ``jax_over_matmul`` (the forward's share of its matmul peer's rate: the same products, so the same
    flops), ``last_over_full`` (the last-position forward's speed-up) and per PyTorch variant
    ``jax_over_torch_V`` (of the medians) and ``jax_over_torch_V_paired`` (median of the per-round
    ratios)."""
    if not row.get("rounds"):
        raise ValueError("summarise_rounds: the row has no rounds to summarise")
    n = row["tokens"]
    for k in ("jax_s", "jax_last_s", "matmul_s"):
        row[k] = statistics.median(r[k] for r in row["rounds"])
    row["jax_tokens_per_s"] = n / row["jax_s"]
    # Medians of the per-round ratios: both sides of a ratio were measured side by side.
    row["jax_over_matmul"] = statistics.median(r["matmul_s"] / r["jax_s"] for r in row["rounds"])
    row["matmul_gflops"] = row["matmul_flops"] / row["matmul_s"] / 1e9
    row["last_over_full"] = statistics.median(r["jax_s"] / r["jax_last_s"] for r in row["rounds"])
    for v in variants:
        times = [r[f"torch_{v}_s"] for r in row["rounds"] if f"torch_{v}_s" in r]
        if not times:
            continue
        row[f"torch_{v}_s"] = statistics.median(times)
        row[f"torch_{v}_tokens_per_s"] = n / row[f"torch_{v}_s"]
        row[f"jax_over_torch_{v}"] = row["jax_tokens_per_s"] / row[f"torch_{v}_tokens_per_s"]
        row[f"jax_over_torch_{v}_paired"] = statistics.median(
            r[f"torch_{v}_s"] / r["jax_s"] for r in row["rounds"] if f"torch_{v}_s" in r)


def variant_columns(rows) -> list:
    """The PyTorch variants measured in these rows, in a stable order (eager, eager_tN, compiled)."""
    names = {k[len("torch_"):-len("_tokens_per_s")] for r in rows for k in r
             if k.startswith("torch_") and k.endswith("_tokens_per_s")}
    return sorted(names, key=lambda v: (v == "compiled", v))


def decode_speed(model, variables, *, batch: int, prompt: int, new: int, seed: int = 0, repeats: int = 3,
                 vocab: Optional[int] = None, generate: bool = True) -> dict:
    """Greedy decoding with the KV cache after a ``random_tokens(seed, batch, prompt, vocab)`` prompt.
    ``prefill_s``: the prompt's pass; ``step_s``: one jitted decode step (one new token per row against
    a cache holding the prompt: the call ``linicl.generate`` scans over), median of repeated calls, and
    ``step_tokens_per_s``; with ``generate``, ``generate_s``: ``linicl.generate`` of ``new`` tokens end
    to end (prefill included) and ``generate_tokens_per_s``."""
    import functools

    import jax
    import jax.numpy as jnp

    import linicl
    from linicl.names import DECODE
    from linicl.reporting import load_average
    from linicl.timing import time_call
    vocab = model.cfg.vocab_size if vocab is None else vocab
    tokens = jnp.asarray(random_tokens(seed, batch, prompt, vocab))
    prefill = jax.jit(functools.partial(model.apply, mutable=[DECODE]))
    _, state = prefill(variables, tokens)
    step = jax.jit(lambda v, s, tok: model.apply({**v, **s}, tok, mutable=[DECODE])[0])
    last = tokens[:, -1:]
    out = dict(batch=batch, prompt=prompt, new=new, max_len=model.cfg.max_len, load_before=load_average())
    out["prefill_s"] = time_call(prefill, variables, tokens, repeats=repeats)
    out["step_s"] = time_call(step, variables, state, last, repeats=max(repeats, 5), min_seconds=0.5)
    out["step_tokens_per_s"] = batch / out["step_s"]
    if generate:
        out["generate_s"] = time_call(lambda: linicl.generate(model, variables, tokens, new), repeats=repeats)
        out["generate_tokens_per_s"] = batch * new / out["generate_s"]
    out["load_after"] = load_average()
    return out


def torch_decode_speed(side, name: str, variants: dict, *, batch: int, prompt: int, new: int, vocab: int,
                       seed: int, jax_step_s: float) -> dict:
    """The same greedy decode in PyTorch (``TorchSide.time_decode``, the same prompt ids as
    ``decode_speed`` with this ``seed``) for each eager variant: per variant ``V`` the fields
    ``torch_V_prefill_s``, ``torch_V_step_s``, ``torch_V_steps``, ``torch_V_step_tokens_per_s`` and
    ``jax_over_torch_V_step`` (PyTorch's step time over ``jax_step_s``)."""
    out = {}
    for variant, spec in variants.items():
        if not isinstance(spec, dict) or spec["compiled"]:
            continue
        dec = side.call("time_decode", name, batch, prompt, new, vocab, seed, threads=spec["threads"])
        v = f"torch_{variant}"
        out.update({f"{v}_prefill_s": dec["prefill_s"], f"{v}_step_s": dec["step_s"], f"{v}_steps": dec["steps"],
                    f"{v}_step_tokens_per_s": batch / dec["step_s"], f"jax_over_{v}_step": dec["step_s"] / jax_step_s})
    return out


_LOAD_SNIPPET = """
import json, time
t0 = time.perf_counter()
import jax
import linicl.lm
t1 = time.perf_counter()
model, variables, tokenizer = linicl.lm.{loader}(max_len={max_len})
jax.block_until_ready(variables)
t2 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1)))
"""


def fresh_process_load_times(loader: str = "smollm2", n: int = 3, max_len: int = 2048) -> dict:
    """``linicl.lm.<loader>(max_len=...)`` (a name of ``linicl.names.PRETRAINED``) in ``n`` fresh
    processes: per run the import (jax + linicl) and load (file read, dequantisation, mapping, transfer
    to the device) seconds, the whole process's wall time and the load average after it; and the
    medians ``import_s_median``, ``load_s_median``, ``process_s_median``."""
    from linicl.reporting import load_average
    if loader not in PRETRAINED:
        raise ValueError(f"fresh_process_load_times: loader must be one of {PRETRAINED}, got {loader!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"fresh_process_load_times: n must be a positive int, got {n!r}")
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET.format(loader=loader, max_len=int(max_len))],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"{loader} load subprocess failed: {proc.stderr[-2000:]}")
        runs.append(dict(json.loads(proc.stdout.strip().splitlines()[-1]), process_s=wall,
                         load_average=load_average()))
    return dict(runs=runs, **{f"{k}_median": statistics.median(r[k] for r in runs)
                              for k in ("import_s", "load_s", "process_s")})


def format_rounds(name: str, rows) -> str:
    """A text table of ``timed_rounds``'s rows: tokens/s of JAX and of each PyTorch variant with the
    JAX / variant ratio per shape, then per shape the forward's share of its matmul peer's rate and the
    last-position forward's speed-up."""
    variants = variant_columns(rows)
    header = ["b x T", "JAX tok/s"] + [h for v in variants for h in (f"{v} tok/s", f"JAX/{v}")]
    lines = [name + "".join(f"{h:>17s}" for h in header)]
    for r in rows:
        cells = [f"{r['batch']} x {r['seq']}", f"{r['jax_tokens_per_s']:.0f}"]
        for v in variants:
            cells += [f"{r[f'torch_{v}_tokens_per_s']:.0f}", f"{r[f'jax_over_torch_{v}']:.2f}x"]
        lines.append(f"{'':{len(name)}s}" + "".join(f"{c:>17s}" for c in cells))
    for r in rows:
        if "jax_over_matmul" in r:
            lines.append(f"  {r['batch']} x {r['seq']}: forward at {100 * r['jax_over_matmul']:.0f} % of its matmul "
                         f"peer's rate ({r['matmul_gflops']:.1f} GFLOP/s on the same products); last-position "
                         f"forward {r['last_over_full']:.2f}x the full forward's tokens/s")
    return "\n".join(lines)


def plot_rounds(ax, rows, title: str, decode: Optional[dict] = None) -> None:
    """Bars on the matplotlib axes ``ax``: tokens/s of linicl and of each PyTorch variant per shape of
    ``timed_rounds``'s rows, annotated with the JAX / eager ratio; with ``decode`` (``decode_speed``'s
    result, with ``torch_decode_speed``'s fields) one more group for the decode step."""
    labels = [f"{r['batch']}x{r['seq']}" for r in rows]
    if decode:
        labels.append(f"decode step\n(batch {decode['batch']})")
    series = [("jax_tokens_per_s", "linicl (JAX)")] + [
        (f"torch_{v}_tokens_per_s", f"PyTorch {v.replace('_t', ', threads=')}") for v in variant_columns(rows)]
    width = 0.8 / len(series)
    for i, (k, name) in enumerate(series):
        vals = [r.get(k, 0.0) for r in rows]
        if decode:
            vals.append(decode.get(k.replace("_tokens_per_s", "_step_tokens_per_s") if k.startswith("torch_")
                                   else "step_tokens_per_s", 0.0))
        ax.bar(np.arange(len(labels)) + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
    for j, r in enumerate(rows):
        if "jax_over_torch_eager" in r:
            ax.annotate(f"{r['jax_over_torch_eager']:.2f}x eager", (j, r["jax_tokens_per_s"]), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set(xlabel="batch x seq", ylabel="tokens / s (float32)", title=title)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend and the ratios
    ax.legend(fontsize=8, ncols=2)
