"""Which exact prompt keys and values a converted softmax prompt keeps: query-agnostic selection.

``iclca.convert_approx(..., keep=...)`` stores, per global layer and **KV head**, a set of the
prompt's exact (rotated) keys and values, chosen when the whole prompt is known and before any
query (compression.md). This module scores every cached key and allocates the budget:

* ``score_prompt(model, variables, prompt, score)`` -> ``f64[layers, kv_heads, n]`` (global layers in
  order), by a rule of ``names.SELECTION_SCORES``:

  - ``"reconstruction"`` (KVzip, arXiv 2505.23416): the model re-reads its prompt after it, chunk by
    chunk (``chunk`` tokens, after ``instruction`` and, from the second chunk, the 8 tokens before
    the chunk, as kvpress's ``KVzipPress`` writes it); a key's score is the largest attention any
    re-reading query of any head of its group gives it. As in kvpress, each re-reading query's softmax
    runs over the sinks, the chunk's own prompt keys and the re-read tokens before it (the other prompt
    keys do not normalise), and the cache is reset to the prompt between chunks. Equal to kvpress's
    scores for a prompt of one chunk (tests/iclca/test_kvpress_parity.py); its later chunks read
    another request and a suffix, and it leaves a chat template's prefix out (that test's docstring).
  - ``"expected"`` (Expected Attention, arXiv 2510.00636): future queries modelled as a Gaussian
    fitted to the prompt's own queries after the sinks (as the model scores them, before rope),
    rotated by the mean rope rotation of the next ``future`` positions; the closed-form expected
    softmax weight of each key, averaged over its group, times ``||v||``.
  - ``"h2o"`` (arXiv 2306.14048): the attention each key accumulates from every prompt query (a sum,
    as the paper; kvpress's observed attention divides it by the queries that see the key).
  - ``"snapkv"`` (arXiv 2404.14469): the mean attention from an observation window, smoothed over 5
    tokens: the queries of a fixed question-free suffix read after the prompt (``instruction``), or
    without one the prompt's last ``observation`` queries (the converted prompt never holds the
    question).
  - ``"recent"``: the position (StreamingLLM, arXiv 2309.17453, with the sinks); ``"random"``.

  Every pass runs the prompt through the decode cache ``chunk`` tokens at a time, and every score is
  reduced chunk by chunk (``kernels.kv_scores``): no layer holds an ``n x n`` attention map.
* ``allocate(scores, tokens, sinks, window, allocation)`` -> ``bool[layers, kv_heads, n]``: the sinks
  and the last ``window`` tokens of every head, then the best scores: the same number per head
  (``"uniform"``), the top scores over all heads and layers (``"global"``, KVzip's choice: heads
  get unequal shares) or whole heads by their mean score (``"heads"``).
* ``token_budget``: a ``keep`` (a share of the prompt's full KV floats, or tokens per KV head) as
  the number of kept tokens.

Selection is eager (NumPy indices of data-dependent size): it cannot run under ``jax.jit``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import compiled
from linicl.config import ModelConfig
from linicl.errors import BudgetError, LiniclError
from linicl.interventions import sown
from linicl.kernels import kv_scores
from linicl.kernels.positions import apply_rope
from linicl.names import (ALLOCATIONS, DECODE, INTERMEDIATES, POSITIONLESS_SCORES, SELECTION_SCORES, block_site,
                          layer_scope)
from linicl.nn.norms import make_norm
from linicl.nn.transformer import config_of

# kvpress's defaults, kept so that the scores can be compared with its presses.
KVZIP_CHUNK = 2048        # context tokens re-read at once
KVZIP_OVERLAP = 8         # tokens of the previous chunk repeated before the next one
# KVZip's re-read instruction in kvpress's wording: encode it (no BOS) and pass it as "reconstruction"'s
# ``instruction``.
REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
SNAPKV_WINDOW = 64        # observation window
SNAPKV_POOL = 5           # smoothing width
EXPECTED_FUTURE = 512     # future positions whose rope rotations are averaged


def scored_queries(cfg: ModelConfig, attn_params, q: jax.Array) -> jax.Array:
    """The queries a softmax layer scores, from its projections ``q`` (site ``hook_q``, before rope):
    with Gemma's qk-norm and query scale applied as ``nn.attention`` applies them."""
    if cfg.qk_norm:
        q = make_norm(cfg, "q_norm").apply({"params": attn_params["q_norm"]}, q)
    return q * jnp.asarray(cfg.query_scale, q.dtype) if cfg.query_pre_attn_scalar is not None else q


def _check_model(cfg: ModelConfig) -> None:
    if cfg.attention != "softmax" or not cfg.causal:
        raise LiniclError(f"selection scores the keys of a causal softmax model's decode cache, got "
                          f"attention={cfg.attention!r}, causal={cfg.causal}")


def _cache_model(model, slots: int):
    """The model with a decode cache of ``slots`` (bucketed) instead of ``max_len``: the passes below
    read every slot of it. With rope (or no positions) ``max_len`` bounds nothing but the cache, so it
    may also grow past the model's (KVzip's re-read sits after the prompt); learned positions are a
    table of ``max_len`` rows and must hold every slot."""
    cfg = config_of(model)
    if cfg.positions == "learned":
        if slots > cfg.max_len:
            raise LiniclError(f"selection needs {slots} positions (the prompt and what re-reads it), but the "
                              f"model's learned positions stop at max_len={cfg.max_len}; use a shorter prompt "
                              f"or another score")
        return model
    size = compiled.geometric_bucket(slots)
    return model if size == cfg.max_len else model.clone(cfg=cfg.replace(max_len=size))


def _step_fn(model):
    """jit ``(variables, state, tokens) -> (decode state, {global layer: scored queries f[1, H, t, d],
    not rotated})``: the model reads ``tokens`` after the decode cache ``state`` (empty: a fresh one)."""
    cfg = config_of(model)
    layers = cfg.global_layers

    def step(variables, state, tokens):
        _, new = model.apply({**variables, **state}, tokens, hidden=True, mutable=[DECODE, INTERMEDIATES])
        acts = sown(new[INTERMEDIATES])
        qs = {l: jnp.swapaxes(scored_queries(cfg, variables["params"][layer_scope(l)]["attn"],
                                             acts[block_site(l, "hook_q")]), 1, 2) for l in layers}
        return {DECODE: new[DECODE]}, qs
    return compiled.get(("selection.step", model), lambda: jax.jit(step))


def _read(model, variables, tokens: np.ndarray, chunk: int, state: Optional[dict] = None):
    """Yield ``(positions int[t], {layer: scored queries f[1, H, t, d]}, decode state)`` after each
    ``chunk`` of ``tokens`` (``int[T]``) the model reads after ``state``."""
    cfg = config_of(model)
    start = 0 if state is None else int(_first_layer_cache(cfg, state)["index"])
    step = _step_fn(model)
    for a in range(0, len(tokens), chunk):
        part = jnp.asarray(tokens[None, a:a + chunk], jnp.int32)
        state, qs = step(variables, state or {}, part)
        yield start + a + np.arange(part.shape[1]), qs, state


def _first_layer_cache(cfg: ModelConfig, state: dict) -> dict:
    return state[DECODE][layer_scope(cfg.global_layers[0])]["attn"]


def _rotated(cfg: ModelConfig, q: jax.Array, positions: np.ndarray) -> jax.Array:
    if cfg.positions != "rope":
        return q
    return apply_rope(q, jnp.asarray(positions), cfg.rope_base, cfg.rope_style)


def _grouped(cfg: ModelConfig, q: jax.Array) -> jax.Array:
    """``f[1, H, t, d]`` -> ``f[G, H / G, t, d]``: query heads grouped by the KV head they read."""
    return q[0].reshape(cfg.kv_heads, cfg.n_heads // cfg.kv_heads, *q.shape[2:])


def _received_fn(reduce: str, chunk: int, scale: float):
    def run(q, k, visible, scored):
        return kv_scores.received(q, k, visible, scored, scale=scale, reduce=reduce, chunk=chunk)
    return compiled.get(("selection.received", reduce, chunk, scale), lambda: jax.jit(run))


def _received(cfg, q, positions, cache, visible, scored, reduce, chunk):
    """``f64[G, slots]``: one layer's attention received from the rotated, grouped queries ``q``."""
    fn = _received_fn(reduce, min(chunk, 256), 1.0 / math.sqrt(cfg.head_dim))
    out = fn(_grouped(cfg, _rotated(cfg, q, positions)), cache["cached_k"][0], jnp.asarray(visible),
             jnp.asarray(scored))
    return np.asarray(out, np.float64)


def _causal(positions: np.ndarray, slots: int) -> np.ndarray:
    return np.arange(slots)[None, :] <= positions[:, None]


def _h2o(model, variables, prompt, chunk, observation=None, suffix=None):
    """H2O's accumulated attention (``observation=None``), or SnapKV's mean over an observation
    window: the last ``observation`` prompt queries, or with ``suffix`` the queries of those tokens
    read after the prompt. Per global layer ``f64[G, n]``."""
    cfg, n = config_of(model), len(prompt)
    tokens = prompt if suffix is None or not len(suffix) else np.concatenate([prompt, suffix]).astype(np.int64)
    if len(tokens) > n:
        observation = len(tokens) - n
    acc = None
    for pos, qs, state in _read(model, variables, tokens, chunk):
        slots = _first_layer_cache(cfg, state)["cached_k"].shape[2]
        visible = _causal(pos, slots)
        if observation is not None:
            visible &= (pos >= len(tokens) - observation)[:, None]
            if not visible.any():
                continue
        scored = np.arange(slots) < n
        part = [_received(cfg, qs[l], pos, state[DECODE][layer_scope(l)]["attn"], visible, scored, "sum", chunk)
                for l in cfg.global_layers]
        acc = part if acc is None else [a + b for a, b in zip(acc, part)]
    scores = np.stack(acc)[:, :, :n]
    if observation is None:
        return scores
    return np.asarray(kv_scores.pool(jnp.asarray(scores / min(observation, len(tokens))), SNAPKV_POOL))


def _reconstruction(model, variables, prompt, chunk, instruction, sinks):
    """KVzip's reconstruction score per global layer, ``f64[G, n]`` (see the module docstring)."""
    cfg, n = config_of(model), len(prompt)
    prompt_state = None
    for *_, prompt_state in _read(model, variables, prompt, chunk):
        pass
    scores = np.zeros((len(cfg.global_layers), cfg.kv_heads, n))
    for a in range(0, n, KVZIP_CHUNK):
        b = min(n, a + KVZIP_CHUNK)
        prev = prompt[max(0, a - KVZIP_OVERLAP):a]
        reread = np.concatenate([instruction, prev, prompt[a:b]]).astype(np.int32)
        # The whole re-read in one step after the prompt's cache (its size fits what one chunk holds).
        (pos, qs, state), = _read(model, variables, reread, len(reread), prompt_state)
        slots = _first_layer_cache(cfg, state)["cached_k"].shape[2]
        cols = np.arange(slots)
        subset = (cols < min(sinks, a)) | ((cols >= a) & (cols < b)) | (cols >= n)
        visible = _causal(pos, slots) & subset[None, :]
        scored = (cols >= a) & (cols < b)
        for i, l in enumerate(cfg.global_layers):
            got = _received(cfg, qs[l], pos, state[DECODE][layer_scope(l)]["attn"], visible, scored, "max", 256)
            scores[i, :, a:b] = got[:, a:b]
    return scores


def _expected(model, variables, prompt, chunk, sinks, future):
    """Expected Attention per global layer, ``f64[G, n]`` (see the module docstring)."""
    cfg, n = config_of(model), len(prompt)
    H, d = cfg.n_heads, cfg.head_dim
    s1 = {l: np.zeros((H, d)) for l in cfg.global_layers}
    s2 = {l: np.zeros((H, d, d)) for l in cfg.global_layers}
    state = None
    for pos, qs, state in _read(model, variables, prompt, chunk):
        use = pos >= sinks
        for l in cfg.global_layers:
            q = np.asarray(qs[l][0], np.float64)[:, use]  # [H, t, d], before rope
            s1[l] += q.sum(1)
            s2[l] += np.einsum("htd,hte->hde", q, q)
    count = max(n - sinks, 1)
    if cfg.positions == "rope":
        R = np.asarray(kv_scores.mean_rotation(jnp.arange(n, n + future), d, cfg.rope_base, cfg.rope_style,
                                               jnp.result_type(float)), np.float64)  # float64 where enabled
    else:
        R = np.eye(d)
    out = []
    for l in cfg.global_layers:
        mu = s1[l] / count
        cov = s2[l] / count - np.einsum("hd,he->hde", mu, mu)
        mu, cov = mu @ R.T, R @ cov @ R.T
        cache = state[DECODE][layer_scope(l)]["attn"]
        k = np.asarray(cache["cached_k"][0, :, :n], np.float64)
        v = np.asarray(cache["cached_v"][0, :, :n], np.float64)
        G, r = cfg.kv_heads, H // cfg.kv_heads
        got = kv_scores.expected(jnp.asarray(mu.reshape(G, r, d)), jnp.asarray(cov.reshape(G, r, d, d)),
                                 jnp.asarray(k[:, sinks:]), jnp.asarray(v[:, sinks:]), scale=1 / math.sqrt(d))
        layer = np.zeros((G, n))
        layer[:, sinks:] = np.asarray(got, np.float64)
        out.append(layer)
    return np.stack(out)


def score_prompt(model, variables, prompt, score: str, *, chunk: int = 512, sinks: int = 4,
                 instruction: Optional[Sequence[int]] = None, seed: int = 0,
                 observation: int = SNAPKV_WINDOW, future: int = EXPECTED_FUTURE) -> np.ndarray:
    """Scores ``f64[len(cfg.global_layers), kv_heads, n]`` of every prompt key, by ``score`` (a name
    of ``names.SELECTION_SCORES``; the module docstring says what each is).

    Args:
      model: a causal softmax ``linicl.Transformer``.
      variables: its variables (their ``params`` only are read: no stored prompt applies).
      prompt: ``int[n]`` or ``int[1, n]``.
      chunk: tokens read at once by every pass (memory: ``chunk x cache slots`` weights per head).
      sinks: the first tokens, which "reconstruction" and "expected" leave out of their statistics (as
        kvpress does); ``allocate`` keeps them anyway.
      instruction: token ids read after the prompt: "reconstruction"'s, said before each re-read (e.g.
        the ids of "\\n\\nRepeat the previous context exactly."; default none); "snapkv"'s, a fixed
        question-free suffix whose queries are the observation window (default none: the prompt's
        last ``observation`` tokens).
      seed: "random" only.
      observation: "snapkv"'s window without ``instruction``.
      future: "expected"'s future positions.
    Higher is kept first; "recent" scores are the positions, "random" uniform draws.
    """
    cfg = config_of(model)
    _check_model(cfg)
    if score not in SELECTION_SCORES:
        raise LiniclError(f"score must be one of {SELECTION_SCORES}, got {score!r}")
    prompt = np.asarray(prompt)
    prompt = prompt[0] if prompt.ndim == 2 and prompt.shape[0] == 1 else prompt
    if prompt.ndim != 1:
        raise LiniclError(f"selection scores one prompt: int[n] or int[1, n], got shape {np.shape(prompt)}")
    n, shape = len(prompt), (len(cfg.global_layers), cfg.kv_heads, len(prompt))
    if score == "recent":
        return np.broadcast_to(np.arange(n, dtype=np.float64), shape).copy()
    if score == "random":
        return np.random.default_rng(seed).random(shape)
    instruction = np.asarray([] if instruction is None else instruction, np.int64)
    reread = {"reconstruction": len(instruction) + KVZIP_OVERLAP + min(n, KVZIP_CHUNK),
              "snapkv": len(instruction)}.get(score, 0)
    small = _cache_model(model, n + reread)
    variables = {k: v for k, v in variables.items() if k == "params"}
    if score in ("h2o", "snapkv"):
        return _h2o(small, variables, prompt, chunk, None if score == "h2o" else observation,
                    instruction if score == "snapkv" else None)
    if score == "expected":
        return _expected(small, variables, prompt, chunk, sinks, future)
    return _reconstruction(small, variables, prompt, chunk, instruction, sinks)


# ------------------------------------------------------------------------------ the budget
def token_budget(cfg: ModelConfig, n: int, keep, *, extra_floats: int = 0) -> int:
    """Kept tokens over all global layers and KV heads for ``keep``: a float in (0, 1], the share of
    the prompt's full KV floats (``2 * head_dim`` a token and KV head) that everything stored may hold,
    ``extra_floats`` (kernel terms) included; or an int, tokens per KV head (``extra_floats`` apart)."""
    heads = len(cfg.global_layers) * cfg.kv_heads
    per_token = 2 * cfg.head_dim
    if isinstance(keep, (bool, np.bool_)) or not isinstance(keep, (int, np.integer, float, np.floating)):
        raise LiniclError(f"keep must be a float in (0, 1] (a share of the prompt's KV floats) or a positive "
                          f"int (tokens per KV head), got {keep!r}")
    if isinstance(keep, (int, np.integer)):
        if keep < 1:
            raise LiniclError(f"keep as an int is tokens per KV head and must be >= 1, got {keep}")
        return min(int(keep), n) * heads
    if not (math.isfinite(keep) and 0 < keep <= 1):
        raise LiniclError(f"keep as a float is a share of the prompt's KV floats and must lie in (0, 1], "
                          f"got {keep!r}")
    full = heads * n * per_token
    left = keep * full - extra_floats
    if left < 0:
        raise BudgetError(f"keep={keep} allows {keep * full:,.0f} floats, but the kernel terms alone hold "
                          f"{extra_floats:,} (the prompt's full KV holds {full:,}); raise keep or pass "
                          f"kernel='none'")
    return min(int(left // per_token), heads * n)


def allocate(scores: np.ndarray, tokens: int, *, sinks: int, window: int, allocation: str) -> np.ndarray:
    """``bool[layers, kv_heads, n]``: the kept tokens of every head.

    The first ``sinks`` and last ``window`` tokens of every head always; then, by ``allocation``,
    ``"uniform"``: the best scores of each head up to ``tokens // heads`` each, ``"global"``: the
    best of all remaining scores (layers and heads compete), ``tokens`` in all, or ``"heads"``: whole
    heads (every token kept), those of highest mean score first (DuoAttention's long-context heads,
    arXiv 2410.10819, chosen per prompt as KVzip's head-level variant does), the last one partly. Ties go to the earlier
    layer, head and token. Raises when ``tokens`` cannot hold the sinks and windows."""
    if allocation not in ALLOCATIONS:
        raise LiniclError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    L, G, n = scores.shape
    forced = np.zeros(n, bool)
    forced[:min(sinks, n)] = True
    forced[max(n - window, 0):] = True
    need = int(forced.sum()) * L * G
    if tokens < need:
        raise BudgetError(f"keep allows {tokens} tokens over {L * G} KV heads, fewer than the sinks and the "
                          f"window always kept ({need}: sinks={sinks}, window={window} each); raise keep or "
                          f"lower sinks/window")
    kept = np.broadcast_to(forced, scores.shape).copy()
    free = np.where(kept, -np.inf, scores)
    if allocation == "heads":
        return _whole_heads(scores, kept, forced, tokens - need)
    if allocation == "uniform":
        per_head = min(tokens // (L * G), n) - int(forced.sum())
        order = np.argsort(-free, axis=-1, kind="stable")[..., :max(per_head, 0)]
        np.put_along_axis(kept, order, True, axis=-1)
        return kept
    flat = np.argsort(-free.reshape(-1), kind="stable")[:tokens - need]
    kept.reshape(-1)[flat] = True
    return kept


def _whole_heads(scores: np.ndarray, kept: np.ndarray, forced: np.ndarray, left: int) -> np.ndarray:
    """``kept`` plus whole heads (every token), the heads of highest mean score over their free tokens
    first, while ``left`` tokens last; then the next head's best tokens with what remains."""
    L, G, n = scores.shape
    free = ~forced
    per_head = np.where(free, scores, 0).sum(-1).reshape(-1) / max(int(free.sum()), 1)
    flat, rest = kept.reshape(L * G, n), np.where(forced, -np.inf, scores).reshape(L * G, n)
    for h in np.argsort(-per_head, kind="stable"):
        take = min(left, int(free.sum()))
        if take <= 0:
            break
        flat[h, np.argsort(-rest[h], kind="stable")[:take]] = True
        left -= take
    return flat.reshape(L, G, n)


def kept_entries(kept: np.ndarray, size: Optional[int] = None) -> tuple:
    """``(index int32[layers, kv_heads, m], valid bool[layers, kv_heads, m])`` from ``kept``: each
    head's kept token positions in order, padded (index 0, invalid) to ``m``, the
    ``compiled.geometric_bucket`` of ``size`` (default: the longest head's count), so that selections
    of similar sizes share one compiled query program. A fixed ``size`` (e.g. the prompt's length)
    gives every selection of a prompt length one shape: an evaluation of many scores and budgets then
    compiles its query once (padding costs query time, not stored information)."""
    counts = kept.sum(-1)
    longest = max(int(counts.max()), 1)
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < longest):
        raise LiniclError(f"size must be an int >= the most tokens a head keeps ({longest}), got {size!r}")
    m = compiled.geometric_bucket(longest if size is None else int(size))
    index = np.zeros(kept.shape[:2] + (m,), np.int32)
    valid = np.arange(m)[None, None, :] < counts[..., None]
    for l in range(kept.shape[0]):
        for g in range(kept.shape[1]):
            pos = np.flatnonzero(kept[l, g])
            index[l, g, :len(pos)] = pos
    return index, valid


def default_allocation(score: str) -> str:
    """"global" for the attention-derived scores (comparable across heads), "uniform" for
    ``names.POSITIONLESS_SCORES`` (positions and random draws say nothing about which head needs more)."""
    return "uniform" if score in POSITIONLESS_SCORES else "global"
