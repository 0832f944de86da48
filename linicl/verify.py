"""``linicl verify``: certify the ICLCA identity on a zoo of random models covering every option.

For each linear-attention model: convert a random prompt, run a random query batch, and compare with
the model that reads [prompt; query]: relative error (max-abs over the query logits divided by the
largest reference logit) in float64 and float32, the same for the no-prompt model (the error the
conversion removes), the conversion time and the query-time speed-up. Softmax models cannot be
converted exactly: their row records the refusal and checks the decode cache instead.
"""

from __future__ import annotations

import json
import os
import platform

import jax
import jax.numpy as jnp

from linicl import iclca
from linicl.config import ModelConfig
from linicl.errors import NotExactError
from linicl.metrics import rel_err
from linicl.errors import LiniclError
from linicl.names import DECODE
from linicl.nn.transformer import Transformer
from linicl.timing import time_call

F64_TOL = 1e-12   # exact identity: rounding only (see tests/helpers.py)
F32_TOL = 1e-4    # float32 rounding over a few hundred summed terms per state

_BASE = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_len=4096)


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
        "softmax-learned": dict(attention="softmax", positions="learned"),
        "softmax-rope": dict(attention="softmax", positions="rope", norm="post"),
    }
    return {name: ModelConfig(**{**_BASE, **spec, "dtype": "float64"}) for name, spec in specs.items()}


def _random_variables(model: Transformer, seed: int):
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))
    if model.cfg.trainable_bias:  # a trained-looking bias; z >= 0 keeps denominators positive
        key = jax.random.PRNGKey(seed + 7)
        variables = jax.tree_util.tree_map_with_path(
            lambda p, x: (0.3 * jax.random.normal(key, x.shape, x.dtype) if p[-1].key == "S_bias" else
                          jnp.abs(jax.random.normal(key, x.shape, x.dtype)) if p[-1].key == "z_bias" else x),
            variables)
    learned = ("phi_q_W", "phi_q_b", "phi_k_W", "phi_k_b", "gate")
    if model.cfg.feature_map == "hedgehog" or model.cfg.hybrid:  # trained-looking maps and gates
        key = jax.random.PRNGKey(seed + 11)
        variables = jax.tree_util.tree_map_with_path(
            lambda p, x: (x + 0.3 * jax.random.normal(jax.random.fold_in(key, learned.index(p[-1].key)),
                                                      x.shape, x.dtype) if p[-1].key in learned else x),
            variables)
    return variables


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _check_linear(cfg: ModelConfig, n: int, m: int, batch: int, seed: int) -> dict:
    model = Transformer(cfg)
    variables = _random_variables(model, seed)
    half = cfg.vocab_size // 2  # disjoint prompt and query ids (see tests/helpers.py)
    prompt = jax.random.randint(jax.random.PRNGKey(seed + 1), (1, n), half, cfg.vocab_size, jnp.int32)
    query = jax.random.randint(jax.random.PRNGKey(seed + 2), (batch, m), 0, half, jnp.int32)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (batch, n)), query], axis=1)
    forward = jax.jit(model.apply)

    reference = forward(variables, full)[:, n:]
    converted = iclca.convert(model, variables, prompt)
    row = dict(err_f64=rel_err(forward(converted, query), reference),
               err_no_prompt=rel_err(forward(variables, query), reference))

    model32 = Transformer(cfg.replace(dtype="float32"))
    v32 = _cast(variables, jnp.float32)
    forward32 = jax.jit(model32.apply)
    conv32 = iclca.convert(model32, v32, prompt)
    row["err_f32"] = rel_err(forward32(conv32, query), forward32(v32, full)[:, n:])

    # Timings in float32, the dtype users run.
    absorb = iclca._absorb_fn(model32)
    row["convert_ms"] = 1e3 * time_call(absorb, v32, prompt, repeats=5)
    t_prompted = time_call(forward32, v32, full, repeats=5)
    t_converted = time_call(forward32, conv32, query, repeats=5, min_seconds=0.05)
    row.update(prompted_forward_ms=1e3 * t_prompted, converted_forward_ms=1e3 * t_converted,
               speedup=t_prompted / t_converted, state_floats=iclca.state_floats(cfg))
    row["ok"] = row["err_f64"] <= F64_TOL and row["err_f32"] <= F32_TOL and row["err_no_prompt"] > 1e-3
    return row


def _check_softmax(cfg: ModelConfig, n: int, batch: int, seed: int) -> dict:
    """Conversion is refused; the decode cache is checked against the full forward instead."""
    model = Transformer(cfg)
    variables = _random_variables(model, seed)
    x = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, n), 0, cfg.vocab_size, jnp.int32)
    try:
        iclca.convert(model, variables, x[:1])
        refused = False
    except NotExactError:
        refused = True
    step = jax.jit(lambda v, t: model.apply(v, t, mutable=[DECODE]))
    first = max(1, n // 2)  # a one-token prompt is read whole (a call needs at least one token)
    logits, state = step(variables, x[:, :first])
    outs = [logits]
    for t in range(first, n):
        logits, state = step({**variables, **state}, x[:, t:t + 1])
        outs.append(logits)
    err = rel_err(jnp.concatenate(outs, axis=1), jax.jit(model.apply)(variables, x))
    return dict(conversion="refused (softmax: approximate only)" if refused else "NOT REFUSED",
                decode_cache_err_f64=err, ok=refused and err <= F64_TOL)


def run(prompt_len: int = 500, query_len: int = 16, batch: int = 4, seed: int = 0,
        quick: bool = False, progress: bool = True) -> dict:
    """Check every zoo model; returns the JSON-ready report."""
    if not jax.config.jax_enable_x64:  # library code never flips the process-wide flag itself
        raise LiniclError("verify.run checks float64 models: enable x64 first "
                          "(jax.config.update('jax_enable_x64', True); the `linicl verify` command does)")
    from tqdm.auto import tqdm

    for name, value in (("prompt_len", prompt_len), ("query_len", query_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LiniclError(f"verify.run: {name} must be an int >= 1, got {value!r}")
    models = zoo()
    if quick:
        prompt_len, query_len = min(prompt_len, 50), min(query_len, 8)
    rows = {}
    for i, (name, cfg) in enumerate(tqdm(models.items(), desc="verify", disable=not progress)):
        row = dict(config=cfg.describe())
        if cfg.attention == "linear":
            row.update(_check_linear(cfg, prompt_len, query_len, batch, seed + i))
        else:
            row.update(_check_softmax(cfg, min(prompt_len, 64), batch, seed + i))
        rows[name] = row
    return dict(
        settings=dict(prompt_len=prompt_len, query_len=query_len, batch=batch, seed=seed, quick=quick,
                      f64_tolerance=F64_TOL, f32_tolerance=F32_TOL,
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
            lines.append(f"{name:26s} {r['config']:62s} {r['err_f64']:9.1e} {r['err_f32']:9.1e} "
                         f"{r['err_no_prompt']:9.1e} {r['convert_ms']:7.1f}ms {r['speedup']:7.1f}x  "
                         f"{'yes' if r['ok'] else 'NO'}")
        else:
            lines.append(f"{name:26s} {r['config']:62s} {r['conversion']}; decode cache err "
                         f"{r['decode_cache_err_f64']:.1e}  {'yes' if r['ok'] else 'NO'}")
    s = report["settings"]
    lines.append(f"prompt {s['prompt_len']} tokens, query batch {s['batch']} x {s['query_len']} tokens; "
                 f"error = {s['error']}; timings float32, {report['machine']['cpu_count']} CPUs")
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
