"""``linicl verify``: certify the ICLCA identity on a zoo of random models covering every option.

For each linear-attention model: convert a random prompt, run a random query batch, and compare with
the model that reads [prompt; query]: relative error (max-abs over the query logits divided by the
largest reference logit) in float64 and float32, the same for the no-prompt model (the error the
conversion removes), the conversion time and the query-time speed-up. Softmax models cannot be
converted exactly: their row records the refusal and checks the decode cache instead.

Compiling is most of the run, so each model compiles few programs: its random initialisation (shared
by the models whose initialisers lower to the same program), every float64 computation of its check
in one program, both built for a short compile (``_check_options``); and the three float32 programs
that are timed (conversion, prompted and converted forward), compiled as a user's are, which also
give the float32 errors. ``run(timings=False)`` checks float32 in the float64 program instead.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import platform
import threading
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import iclca
from linicl.config import ModelConfig
from linicl.errors import NotExactError
from linicl.metrics import rel_err
from linicl.errors import LiniclError
from linicl.names import DECODE, SHORT_CONV_STATE
from linicl.nn.transformer import Transformer
from linicl.timing import FAST_COMPILE, time_call

F64_TOL = 1e-12   # exact identity: rounding only (see tests/helpers.py)
F32_TOL = 1e-4    # float32 rounding over a few hundred summed terms per state

_BASE = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_len=4096)
_GEMMA = dict(n_layers=3, layer_types=("local", "global", "local"), sliding_window=8, rope_local_base=1e4,
              rope_base=1e6, positions="rope", rope_on="inputs", rope_style="half", n_kv_heads=2, d_head=24,
              qk_norm=True, norm="sandwich", norm_type="gemma_rmsnorm", scale_embeddings=True,
              query_pre_attn_scalar=20.0, mlp="gated", activation="gelu_tanh", use_bias=False)


def zoo() -> dict[str, ModelConfig]:
    """At least one model for every option of ModelConfig that matters for exactness."""
    specs = {
        "elu-plain": dict(),
        "elu-learned-post": dict(positions="learned", norm="post"),
        "elu-rope": dict(positions="rope", n_layers=3),
        "elu-decay": dict(decay=0.95),
        "elu-rope-headdecay": dict(positions="rope", decay=(0.8, 0.9, 0.97, 1.0)),
        "relu-learned": dict(feature_map="relu", positions="learned", activation="relu"),
        "relu-headdecay-post": dict(feature_map="relu", decay=(0.9, 0.95, 0.99, 0.999), norm="post"),
        "identity-unnorm": dict(feature_map="identity", normalize=False),
        "identity-rope-decay-post": dict(feature_map="identity", normalize=False, positions="rope",
                                         decay=0.97, norm="post"),
        "taylor2": dict(feature_map="taylor2", d_model=32),
        "taylor2-unnorm-learned": dict(feature_map="taylor2", normalize=False, positions="learned", d_model=32),
        "elu-unnorm-rope-post": dict(normalize=False, positions="rope", norm="post", activation="silu"),
        "elu-trainable-bias-decay": dict(trainable_bias=True, decay=0.9, tie_embeddings=False),
        "elu-recurrent-form": dict(form="recurrent", positions="rope", use_bias=False),
        # Linearised-LM options: learned hedgehog maps (identity init), rope before phi, LoLCATs'
        # exact window + sinks (the state is bounded; the query keeps the prompt's offset).
        "hedgehog-rope-inputs": dict(feature_map="hedgehog", positions="rope", rope_on="inputs",
                                     rope_style="half", n_kv_heads=2),
        "hedgehog-window16-sinks4": dict(feature_map="hedgehog", positions="rope", rope_on="inputs",
                                         window=16, sinks=4, rope_style="half", n_kv_heads=2),
        "elu-window8-sinks2-decay": dict(window=8, sinks=2, decay=0.97, positions="learned",
                                         form="recurrent"),
        # LoLA's sparse cache beside the window (recurrent), and the window + sinks baseline with no
        # linear part (StreamingLLM).
        "hedgehog-window4-sinks2-cache8": dict(feature_map="hedgehog", positions="rope", rope_on="inputs",
                                               window=4, sinks=2, cache=8),
        "window8-sinks2-no-linear": dict(feature_map="none", positions="rope", rope_on="inputs", window=8,
                                         sinks=2),
        # Data-dependent recurrences: a per-head gate (Mamba-2 style) with re-based rope and
        # grouped-query heads, GLA's per-feature gate with rope on the inputs (a per-feature decay
        # cannot be re-based), and Gated DeltaNet (delta rule + scalar gate, unnormalised) chunked.
        "elu-scalar-gate-rope": dict(gate="scalar", positions="rope", n_kv_heads=2),
        "gla-vector-rope-inputs": dict(gate="vector", positions="rope", rope_on="inputs"),
        "gated-delta-rope-chunked": dict(update="delta", gate="scalar", normalize=False, positions="rope",
                                         form="chunked", chunk_size=32),
        # The short causal convolution of q, k, v (Mamba, GLA, DeltaNet): its last K - 1 inputs are
        # stored beside the state. Gated DeltaNet as published (K = 4, SiLU), and a hybrid's window.
        "gated-delta-conv4-silu": dict(update="delta", gate="scalar", normalize=False, positions="rope",
                                       short_conv=4, short_conv_activation="silu"),
        "hedgehog-window8-sinks2-conv3": dict(feature_map="hedgehog", positions="rope", rope_on="inputs",
                                              window=8, sinks=2, short_conv=3),
        # Gemma 3 style: local sliding-window softmax layers (exact, window 8 < the prompt) around a
        # linear global layer, with Gemma's q/k norms, sandwich (1 + w) norms, separate head size and
        # attention scale, scaled embeddings, two rope bases; the global layer a hedgehog hybrid (the
        # linearized Gemma), a scalar-gated one, or a gated delta rule.
        "gemma-local8-hedgehog-window16": dict(_GEMMA, feature_map="hedgehog", window=16, sinks=4),
        "gemma-local8-scalar-gate": dict(_GEMMA, gate="scalar"),
        "gemma-local8-gated-delta": dict(_GEMMA, update="delta", gate="scalar", normalize=False),
        "softmax-learned": dict(attention="softmax", positions="learned"),
        "softmax-rope": dict(attention="softmax", positions="rope", norm="post"),
    }
    return {name: ModelConfig(**{**_BASE, **spec, "dtype": "float64"}) for name, spec in specs.items()}


def _check_options() -> dict:
    """XLA options of the programs verify runs once (the checks, not the timings): no backend
    optimisation and, on a CPU, XLA's classic fusion emitters. A 2-layer model then compiles 3-4x
    faster (and runs a few times slower, which is less than the compile time saved); rounding only
    differs, and both sides of every identity come from the same program."""
    if jax.default_backend() == "cpu":
        return {**FAST_COMPILE, "xla_cpu_use_fusion_emitters": False}
    return dict(FAST_COMPILE)


def _random_variables(model: Transformer, seed):
    """A random model (``seed``: an int, or an int array under ``jit``): ``model.init``, plus
    trained-looking values for the parameters that init sets to a constant."""
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))
    if model.cfg.trainable_bias:  # a trained-looking bias; z >= 0 keeps denominators positive
        key = jax.random.PRNGKey(seed + 7)
        variables = jax.tree_util.tree_map_with_path(
            lambda p, x: (0.3 * jax.random.normal(key, x.shape, x.dtype) if p[-1].key == "S_bias" else
                          jnp.abs(jax.random.normal(key, x.shape, x.dtype)) if p[-1].key == "z_bias" else x),
            variables)
    learned = ("phi_q_W", "phi_q_b", "phi_k_W", "phi_k_b", "gate") + SHORT_CONV_STATE
    # trained-looking maps, gates and convolution taps (identity-initialised: a no-op untrained)
    if model.cfg.feature_map == "hedgehog" or model.cfg.hybrid or model.cfg.short_conv:
        key = jax.random.PRNGKey(seed + 11)
        variables = jax.tree_util.tree_map_with_path(
            lambda p, x: (x + 0.3 * jax.random.normal(jax.random.fold_in(key, learned.index(p[-1].key)),
                                                      x.shape, x.dtype) if p[-1].key in learned else x),
            variables)
    return variables


def _cast(tree, dtype):
    """Floating leaves cast to ``dtype`` on the host (numpy rounds as XLA does; nothing to compile)."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(dtype))
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


class _Shared:
    """Executables shared by the models of one ``run`` (text digest -> executable), safe across the
    threads that prepare models: the first thread to ask for a digest compiles it, the others wait."""

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict = {}

    def get(self, digest: str, build: Callable):
        with self._lock:
            future = self._futures.get(digest)
            mine = future is None
            if mine:
                future = self._futures[digest] = concurrent.futures.Future()
        if mine:
            try:
                future.set_result(build())
            except BaseException as e:  # the waiting threads see the same error
                future.set_exception(e)
        return future.result()


def _init_program(model: Transformer, shared: _Shared):
    """``jit(seed) -> variables`` of ``_random_variables``. Its lowered program holds only the
    parameters' initialisers (jit drops the forward pass init runs), so models with the same
    parameter shapes and initialisers lower to the same text: ``shared`` (one per ``run``) compiles
    each distinct one once. The random-number code is most of a small model's compile time."""
    lowered = jax.jit(functools.partial(_random_variables, model), compiler_options=_check_options()).lower(0)
    return shared.get(hashlib.sha256(lowered.as_text().encode()).hexdigest(), lowered.compile)


def _linear_program(model: Transformer, n: int, m: int, batch: int, float32: bool):
    """``jit(variables, seed) -> (prompt, query, full, reference, converted, no_prompt[, converted32,
    reference32])``: every float64 computation of a linear model's check in one program: random
    tokens, the prompted reference ``[batch, m, vocab]`` (the query positions of ``full`` = [prompt;
    query]), the converted model's logits on the query (``iclca.convert``, the public conversion,
    under ``jit``) and the no-prompt model's; with ``float32``, the converted and prompted logits of
    the same model in float32 too."""
    cfg = model.cfg
    model32 = Transformer(cfg.replace(dtype="float32"))

    def run(variables, seed):
        half = cfg.vocab_size // 2  # disjoint prompt and query ids (see tests/helpers.py)
        prompt = jax.random.randint(jax.random.PRNGKey(seed + 1), (1, n), half, cfg.vocab_size, jnp.int32)
        query = jax.random.randint(jax.random.PRNGKey(seed + 2), (batch, m), 0, half, jnp.int32)
        full = jnp.concatenate([jnp.broadcast_to(prompt, (batch, n)), query], axis=1)
        converted = iclca.convert(model, variables, prompt)
        out = (prompt, query, full, model.apply(variables, full)[:, n:], model.apply(converted, query),
               model.apply(variables, query))
        if not float32:
            return out
        v32 = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                           variables)
        return out + (model32.apply(iclca.convert(model32, v32, prompt), query), model32.apply(v32, full)[:, n:])
    return jax.jit(run, compiler_options=_check_options())


def _prepare_linear(cfg: ModelConfig, n: int, m: int, batch: int, seed: int, shared: _Shared,
                    timings: bool) -> tuple:
    """A linear model's check but the timings: ``(row, timed)``. With ``timings`` the float32 programs
    that ``_time_linear`` times are compiled here, by their first calls (which give the float32
    errors), and ``timed`` holds them with their arguments; else ``timed`` is None."""
    model = Transformer(cfg)
    variables = _init_program(model, shared)(seed)
    prompt, query, full, reference, converted, no_prompt, *f32 = _linear_program(
        model, n, m, batch, float32=not timings)(variables, seed)
    row = dict(err_f64=rel_err(converted, reference), err_no_prompt=rel_err(no_prompt, reference),
               state_floats=iclca.state_floats(cfg))
    if not timings:
        row["err_f32"] = rel_err(*f32)
        return row, None
    # float32, the dtype users run, in the programs that are timed, compiled as a user's are
    model32 = Transformer(cfg.replace(dtype="float32"))
    v32 = _cast(variables, np.float32)
    forward32 = jax.jit(model32.apply)
    conv32 = iclca.convert(model32, v32, prompt)  # compiles the absorbing pass, called as timed below
    row["err_f32"] = rel_err(forward32(conv32, query), forward32(v32, full)[:, n:])
    return row, (iclca._absorb_fn(model32), forward32, v32, conv32, prompt, query, full)


def _time_linear(timed: tuple) -> dict:
    """Conversion time and prompted / converted forward times of ``_prepare_linear``'s programs."""
    absorb, forward32, v32, conv32, prompt, query, full = timed
    # (variables, prompt, embeds) as iclca.convert calls it: the executable compiled there is reused
    t = dict(convert_ms=1e3 * time_call(absorb, dict(v32), prompt, None, repeats=5),
             prompted_forward_ms=1e3 * time_call(forward32, v32, full, repeats=5),
             converted_forward_ms=1e3 * time_call(forward32, conv32, query, repeats=5, min_seconds=0.05))
    t["speedup"] = t["prompted_forward_ms"] / t["converted_forward_ms"]
    return t


def _ok_linear(row: dict) -> bool:
    return row["err_f64"] <= F64_TOL and row["err_f32"] <= F32_TOL and row["err_no_prompt"] > 1e-3


def _softmax_program(model: Transformer, n: int, batch: int):
    """``jit(variables, seed) -> (x, decoded, full)``: random tokens ``x: int32[batch, n]`` and the
    model's logits ``[batch, n, vocab]`` read through the decode cache (the first half of the tokens
    in one call, then one token per step of a scan) and in one forward pass, in one program."""
    cfg = model.cfg
    first = max(1, n // 2)  # a one-token prompt is read whole (a call needs at least one token)

    def run(variables, seed):
        x = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, n), 0, cfg.vocab_size, jnp.int32)
        logits, state = model.apply(variables, x[:, :first], mutable=[DECODE])

        def step(state, tok):  # tok: int32[batch], one new token per row
            out, state = model.apply({**variables, **state}, tok[:, None], mutable=[DECODE])
            return state, out[:, 0]
        _, rest = jax.lax.scan(step, state, x[:, first:].T)
        decoded = jnp.concatenate([logits, jnp.swapaxes(rest, 0, 1)], axis=1)
        return x, decoded, model.apply(variables, x)
    return jax.jit(run, compiler_options=_check_options())


def _check_softmax(cfg: ModelConfig, n: int, batch: int, seed: int, shared: Optional[_Shared] = None) -> dict:
    """Conversion is refused; the decode cache is checked against the full forward instead."""
    model = Transformer(cfg)
    variables = _init_program(model, _Shared() if shared is None else shared)(seed)
    x, decoded, full = _softmax_program(model, n, batch)(variables, seed)
    try:
        iclca.convert(model, variables, x[:1])
        refused = False
    except NotExactError:
        refused = True
    err = rel_err(decoded, full)
    return dict(conversion="refused (softmax: approximate only)" if refused else "NOT REFUSED",
                decode_cache_err_f64=err, ok=refused and err <= F64_TOL)


def run(prompt_len: int = 500, query_len: int = 16, batch: int = 4, seed: int = 0,
        quick: bool = False, progress: bool = True, names: Optional[Sequence[str]] = None,
        timings: bool = True, workers: Optional[int] = None) -> dict:
    """Check every zoo model (or those ``names``, in zoo order); returns the JSON-ready report.

    timings: also time the float32 conversion and the prompted and converted forward passes, with
      programs compiled as a user's are (most of a cold run's compile time). False checks the same
      identities, float32 included, in the programs compiled for a short compile, and leaves the
      timing columns out.
    workers: threads that check models side by side (default: the CPU count, at most 4). XLA
      compiles without holding Python's lock, but tracing holds it: on 2 cores 2 threads took 143 s
      where 1 took 172 s (cold cache). The timings are taken afterwards, one model at a time, on a
      quiet process; every number is the same for any ``workers``."""
    if not jax.config.jax_enable_x64:  # library code never flips the process-wide flag itself
        raise LiniclError("verify.run checks float64 models: enable x64 first "
                          "(jax.config.update('jax_enable_x64', True); the `linicl verify` command does)")
    from tqdm.auto import tqdm

    for name, value in (("prompt_len", prompt_len), ("query_len", query_len), ("batch", batch)) + (
            () if workers is None else (("workers", workers),)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LiniclError(f"verify.run: {name} must be an int >= 1, got {value!r}")
    models = zoo()
    if names is not None:
        unknown = sorted(set(names) - set(models))
        if unknown or not names:
            raise LiniclError(f"verify.run: names must be zoo models ({', '.join(models)}), got {list(names)!r}")
    if quick:
        prompt_len, query_len = min(prompt_len, 50), min(query_len, 8)
    # Each model's seed is seed + its index in the whole zoo, so that a model checked alone (names)
    # is the same random model as in a full run.
    chosen = [(i, name, cfg) for i, (name, cfg) in enumerate(models.items()) if names is None or name in names]
    shared = _Shared()  # init executables, one per distinct initialisation (_init_program)

    def prepare(i, cfg):
        if cfg.attention == "linear":
            return _prepare_linear(cfg, prompt_len, query_len, batch, seed + i, shared, timings)
        return _check_softmax(cfg, min(prompt_len, 64), batch, seed + i, shared), None

    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
            tqdm(total=len(chosen), desc="verify", disable=not progress) as bar:
        futures = {name: pool.submit(prepare, i, cfg) for i, name, cfg in chosen}
        for f in futures.values():
            f.add_done_callback(lambda _: bar.update())
        prepared = {name: f.result() for name, f in futures.items()}
    rows = {}
    for i, name, cfg in chosen:
        row, timed = prepared[name]
        if timed is not None:
            row.update(_time_linear(timed))
        if cfg.attention == "linear":
            row["ok"] = _ok_linear(row)
        rows[name] = dict(config=cfg.describe(), **row)
    return dict(
        settings=dict(prompt_len=prompt_len, query_len=query_len, batch=batch, seed=seed, quick=quick,
                      timings=timings, f64_tolerance=F64_TOL, f32_tolerance=F32_TOL,
                      error="max|converted - prompted| / max|prompted| over the query logits"),
        machine=dict(platform=platform.platform(), jax=jax.__version__, devices=str(jax.devices()),
                     cpu_count=os.cpu_count()),
        models=rows, all_ok=all(r["ok"] for r in rows.values()))


def format_table(report: dict) -> str:
    head = (f"{'model':26s} {'config':62s} {'err f64':>9s} {'err f32':>9s} {'no prompt':>9s} "
            f"{'convert':>9s} {'speed-up':>8s}  ok")
    lines = [head, "-" * len(head)]
    for name, r in report["models"].items():
        if "err_f64" in r:
            timed = (f"{r['convert_ms']:7.1f}ms {r['speedup']:7.1f}x" if "speedup" in r
                     else f"{'-':>9s} {'-':>8s}")
            lines.append(f"{name:26s} {r['config']:62s} {r['err_f64']:9.1e} {r['err_f32']:9.1e} "
                         f"{r['err_no_prompt']:9.1e} {timed}  {'yes' if r['ok'] else 'NO'}")
        else:
            lines.append(f"{name:26s} {r['config']:62s} {r['conversion']}; decode cache err "
                         f"{r['decode_cache_err_f64']:.1e}  {'yes' if r['ok'] else 'NO'}")
    s = report["settings"]
    lines.append(f"prompt {s['prompt_len']} tokens, query batch {s['batch']} x {s['query_len']} tokens; "
                 f"error = {s['error']}; "
                 + (f"timings float32, {report['machine']['cpu_count']} CPUs" if s.get("timings", True)
                    else "not timed"))
    return "\n".join(lines)


def main(out: str = "results", **kwargs) -> int:
    from linicl.reporting import writable_dir
    try:  # before the run, which takes minutes: a folder that cannot be written would waste it
        writable_dir(out)
    except OSError as e:
        raise LiniclError(f"verify: cannot write results to out={out!r}: {e.strerror or e}") from None
    report = run(**kwargs)
    print(format_table(report))
    path = os.path.join(out, "verify.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}; all exact: {report['all_ok']}")
    return 0 if report["all_ok"] else 1
