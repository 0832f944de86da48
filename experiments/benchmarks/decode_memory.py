"""Decode memory of a model with local (sliding-window) layers: what each layer's decode state holds
after a long prompt, measured on the state itself.

The model reads a ``--tokens - 1`` token prompt (random ids, seeded) with the decode cache
(``model.apply(..., mutable=["decode"])``, as ``linicl.generate`` prefills) and decodes one more token,
so that the state has seen ``--tokens`` tokens. The same is done at ``--short`` tokens. For every layer
the floats of its decode state are counted (``linicl.memory``'s convention: floating leaves only) with
the number of keys it holds; a local layer's count must be the same at both lengths (its window of
``sliding_window - 1`` keys: bounded), a global layer's is its ``max_len`` cache. The totals are set
beside ``linicl.memory.kv_cache_floats`` (a KV cache of exactly the tokens seen, keys shared by
grouped-query heads), the least the local layers need (each kv head's window of keys and values, which
is how the zoo's window stores them; it also keeps the empty linear part of the window-only hybrid,
a zero state and feature slots per query head) and the same model with every layer global. The peak
resident memory of the process is recorded too.

    python experiments/benchmarks/decode_memory.py --quick      # the tiny Gemma 3 fixture, 64 tokens
    python experiments/benchmarks/decode_memory.py              # Gemma 3 270M at 8,192 tokens

Writes ``OUT/decode_memory.json``.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import linicl
from linicl import reporting
from linicl.memory import kv_cache_floats
from linicl.names import DECODE, layer_scope

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "hf", "gemma3-tiny.gguf")


def parse_args(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/decode_memory", quick="the tiny Gemma 3 fixture, 64 tokens",
                              seed="seeds the prompt's token ids", progress=False)
    p.add_argument("--model", default="gemma3", help="gemma3 or a checkpoint with local layers (HF dir or .gguf)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens seen by the decode state")
    p.add_argument("--short", type=int, default=1024, help="the shorter length compared with --tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.tokens, args.short = FIXTURE, 64, 16
    if not 2 <= args.short < args.tokens:
        p.error(f"need 2 <= --short < --tokens, got --short {args.short} and --tokens {args.tokens}")
    return args


def layer_floats(state: dict, n_layers: int) -> list:
    """Per layer: ``(floats, keys)``, the floating-point values of its decode state and the number of
    keys it holds (the key buffer's length: ``win_k`` of a window, ``cached_k`` of a KV cache)."""
    out = []
    for l in range(n_layers):
        leaves = jax.tree_util.tree_flatten_with_path(state[layer_scope(l)])[0]
        floats = sum(int(np.size(x)) for _, x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
        keys = [x.shape[2] for path, x in leaves if getattr(path[-1], "key", None) in ("win_k", "cached_k")]
        out.append((floats, keys[0] if keys else 0))
    return out


def decode_state(model, variables, n_tokens: int, seed: int) -> dict:
    """The decode state after an ``n_tokens - 1`` token prompt and one decoded token."""
    ids = np.random.default_rng(seed).integers(3, model.cfg.vocab_size, (1, n_tokens), dtype=np.int64)
    prompt, last = jnp.asarray(ids[:, :-1], jnp.int32), jnp.asarray(ids[:, -1:], jnp.int32)
    _, state = jax.jit(lambda v, t: model.apply(v, t, mutable=[DECODE]))(variables, prompt)
    _, state = jax.jit(lambda v, s, t: model.apply({**v, **s}, t, mutable=[DECODE]))(variables, state, last)
    # waited for: the floats are counted from shapes alone, and the peak memory must include the passes
    return jax.block_until_ready(state[DECODE])


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    _, model, variables, _ = linicl.lm.load(args.model, max_len=args.tokens)
    cfg = model.cfg
    if not cfg.has_local_layers:
        print(f"{args.model} has no local layers: nothing bounded to measure", file=sys.stderr)
        return 2
    kinds = cfg.layer_types
    per_len = {}
    for n in (args.short, args.tokens):
        rows = layer_floats(decode_state(model, variables, n, args.seed), cfg.n_layers)
        per_len[n] = [dict(layer=l, kind=kinds[l], floats=f, keys=k) for l, (f, k) in enumerate(rows)]
    long, short = per_len[args.tokens], per_len[args.short]
    local = [r for r in long if r["kind"] == "local"]
    report = dict(
        settings=vars(args), model=str(args.model), tokens=args.tokens, short=args.short,
        sliding_window=cfg.sliding_window, max_len=cfg.max_len, layers=long, layers_short=short,
        local_bounded=all(a["floats"] == b["floats"] for a, b in zip(long, short) if a["kind"] == "local"),
        local_keys=sorted({r["keys"] for r in local}),
        local_floats=sum(r["floats"] for r in local),
        # what the local layers need at least: each kv head's last window - 1 keys and values
        local_kv_floats=2 * cfg.kv_heads * cfg.head_dim * (cfg.sliding_window - 1) * len(local),
        global_floats=sum(r["floats"] for r in long if r["kind"] == "global"),
        total_floats=sum(r["floats"] for r in long),
        kv_cache_floats=kv_cache_floats(cfg, args.tokens),
        all_global_kv_floats=kv_cache_floats(cfg.replace(layer_types=None, sliding_window=0, rope_local_base=None),
                                             args.tokens),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        machine=reporting.machine_info(),
        wall_s=time.perf_counter() - t0)
    reporting.publish(args.out, "decode_memory", report, table(report), plots=False)
    return 0 if report["local_bounded"] else 1


def table(r: dict) -> str:
    m = lambda x: f"{x:,}"  # noqa: E731
    return "\n".join(["```",
        f"Decode state after {r['tokens']} tokens ({r['model']}, window {r['sliding_window']}, max_len {r['max_len']}):",
        f"  local layers: {m(r['local_floats'])} floats, {r['local_keys']} keys per layer; the same at "
        f"{r['short']} tokens: {r['local_bounded']}",
        f"  global layers: {m(r['global_floats'])} floats (their max_len caches)",
        f"  total {m(r['total_floats'])}; a KV cache of the tokens seen {m(r['kv_cache_floats'])}; "
        f"every layer global {m(r['all_global_kv_floats'])}",
        f"  the local layers' minimum, each kv head's window of keys and values: {m(r['local_kv_floats'])}",
        f"  (they hold {r['local_floats'] / r['local_kv_floats']:.2f}x that: the window's keys and values per kv "
        f"head, and per query head its feature slots and the empty linear state)",
        f"  peak resident memory {r['peak_rss_mib']:.0f} MiB", "```"])


if __name__ == "__main__":
    sys.exit(main())
