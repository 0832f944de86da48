"""Multi-head causal attention as a Linen module: linear (with a state) or softmax (with a KV cache).

Variable collections:
* ``params``: ``q`` (DenseGeneral, kernel ``[d_model, heads, d_head]``), ``k``, ``v`` (kernel
  ``[d_model, kv_heads, d_head]``; grouped-query attention shares each key/value head among
  ``heads // kv_heads`` query heads), ``o`` (kernel ``[heads, d_head, d_model]``); with ``cfg.trainable_bias``, ``S_bias: [heads, d_phi, d_head]`` and
  ``z_bias: [heads, d_phi]``, zero-initialised.
* ``iclca`` (linear attention only): ``S: [batch or 1, heads, d_phi, d_head]``, ``z: [batch or 1, heads,
  d_phi]``, the state a prompt left behind. Read as the initial state when present; when the
  collection is mutable, the final state is written back (re-based for rope), so one ``apply`` with
  ``mutable=["iclca"]`` both converts a prompt and advances a decode.
* ``cache`` (softmax attention only, when mutable): keys, values (``kv_heads`` of them) and their
  positions for decoding.

Sites (``linicl.nn.hooks``): ``hook_q``, ``hook_k``, ``hook_v`` (projections before rope),
``hook_z`` (per-head output before ``o``), all ``[batch, seq, heads, d_head]``; softmax attention also
has ``hook_attn_scores`` (scaled logits before the causal mask) and ``hook_pattern``, both
``[batch, heads, q_seq, k_seq]``.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
from flax import struct
import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.kernels import feature_maps, prompt_kernels
from linicl.kernels.linear_attention import LinearState, linear_attention
from linicl.kernels.positions import apply_rope
from linicl.kernels.softmax_attention import attention_logits, causal_mask
from linicl.nn.hooks import site

ICLCA = "iclca"
CACHE = "cache"
_EMPTY_SLOT = jnp.iinfo(jnp.int32).max  # key position of an unfilled cache slot: later than any query


@struct.dataclass
class PromptApprox:
    """A softmax layer's kernel-approximated prompt (``variables["iclca"][layer]["attn"]["approx"]``).

    Attributes:
      B: ``f[batch or 1, heads, F, d_head]``, b: ``f[batch or 1, heads, F]``: the prompt's bias terms.
      W: positive-random-feature projections ``f[heads, m, d_head]`` (kernel ``"prf"``), else None.
      sink_k, sink_v: ``f[batch or 1, kv_heads, s, d_head]`` prompt keys (rotated) and values kept
        exact, with their positions ``sink_pos: int32[s]``; None when no token is kept.
      kernel: ``"taylor2"``, ``"prf"`` or ``"elu+1"`` (static).
      lam: None for the shared normaliser, else the fixed input weight of the lambda-mix (static).
    """

    B: jax.Array
    b: jax.Array
    W: Optional[jax.Array] = None
    sink_k: Optional[jax.Array] = None
    sink_v: Optional[jax.Array] = None
    sink_pos: Optional[jax.Array] = None
    kernel: str = struct.field(pytree_node=False, default="taylor2")
    lam: Optional[float] = struct.field(pytree_node=False, default=None)


def rebase_state(S: jax.Array, shift: int, base: float, style: str = "interleaved") -> jax.Array:
    """Rotate the feature axis of ``S: [..., d_phi, d_v]`` by position ``-shift``.

    A rope state holds features rotated to absolute positions; after ``shift`` tokens this moves it to
    the frame in which the next token sits at position 0 (iclca.md, section 4).
    """
    return jnp.swapaxes(apply_rope(jnp.swapaxes(S, -1, -2), -shift, base, style), -1, -2)


def _advancing(module: nn.Module, collection: str) -> bool:
    """True when this call should write its state back: the collection is mutable and this is not
    ``init`` (which makes every collection mutable but must not store the init tokens)."""
    return module.is_mutable_collection(collection) and not module.is_initializing()


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x: f[batch, seq, d_model]``, ``positions: int[seq]`` -> ``f[batch, seq, d_model]``."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        dense = functools.partial(nn.DenseGeneral, use_bias=cfg.has_attn_bias, dtype=dt, param_dtype=dt)
        sizes = {"q": (cfg.n_heads, cfg.head_dim), "k": (cfg.kv_heads, cfg.head_dim),
                 "v": (cfg.kv_heads, cfg.head_dim)}
        # [batch, seq, heads, d_head] (the sites' layout) -> [batch, heads, seq, d_head]
        q, k, v = (jnp.swapaxes(site(self, f"hook_{n}", dense(sizes[n], name=n)(x), head_axis=2), 1, 2)
                   for n in ("q", "k", "v"))
        if cfg.attention == "linear":
            o = self._linear(q, self._repeat_kv(k), self._repeat_kv(v), positions)
        else:
            o = self._softmax(q, k, v, positions)
        z = site(self, "hook_z", jnp.swapaxes(o, 1, 2), head_axis=2)
        return dense(cfg.d_model, axis=(-2, -1), name="o")(z)

    def _repeat_kv(self, a: jax.Array) -> jax.Array:
        """``[batch, kv_heads, seq, d]`` -> ``[batch, heads, seq, d]``: query head h reads key/value
        head ``h // (heads // kv_heads)`` (the HF ``repeat_kv`` order)."""
        rep = self.cfg.n_heads // self.cfg.kv_heads
        return a if rep == 1 else jnp.repeat(a, rep, axis=1)

    # ------------------------------------------------------------------ linear attention
    def _linear(self, q, k, v, positions):
        cfg = self.cfg
        phi = feature_maps.get(cfg.feature_map)
        fq, fk = phi(q), phi(k)
        q_den = k_den = None
        if cfg.positions == "rope":
            # Rotate the numerator features only; the normaliser keeps the unrotated (positive) ones.
            q_den, k_den = fq, fk
            fq, fk = (apply_rope(f, positions, cfg.rope_base, cfg.rope_style) for f in (fq, fk))
        state, bias = self._initial_state(q.shape[0])
        o, final = linear_attention(fq, fk, v, state, q_den=q_den, k_den=k_den,
                                    log_gamma=self._log_gamma(), normalize=cfg.normalize,
                                    eps=cfg.attn_eps, form=cfg.form, chunk_size=cfg.chunk_size)
        if _advancing(self, ICLCA):
            self._store(final, bias, q.shape[2])
        return o

    def _log_gamma(self):
        gammas = self.cfg.decay_per_head()
        if gammas is None:
            return None
        return jnp.log(jnp.asarray(gammas, self.cfg.jnp_dtype))

    def _initial_state(self, batch: int):
        """(S0, z0) broadcast to the batch: the trainable bias (if any) plus the stored ICL state."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        F, H, dv = cfg.feature_dim, cfg.n_heads, cfg.head_dim
        S, z = jnp.zeros((1, H, F, dv), dt), jnp.zeros((1, H, F), dt)
        bias = None
        if cfg.trainable_bias:
            bias = LinearState(self.param("S_bias", nn.initializers.zeros, (H, F, dv), dt),
                               self.param("z_bias", nn.initializers.zeros, (H, F), dt))
            S, z = S + bias.S, z + bias.z
        if self.has_variable(ICLCA, "S"):
            S_icl, z_icl = self.get_variable(ICLCA, "S"), self.get_variable(ICLCA, "z")
            if S_icl.shape[1:] != (H, F, dv) or z_icl.shape[1:] != (H, F):
                raise LiniclError(
                    f"variables['{ICLCA}'] of {self.path_str()} has S{tuple(S_icl.shape)}, "
                    f"z{tuple(z_icl.shape)}; this model expects S[batch, {H}, {F}, {dv}], z[batch, {H}, {F}]")
            if S_icl.shape[0] not in (1, batch):
                raise LiniclError(
                    f"variables['{ICLCA}'] holds a state for batch {S_icl.shape[0]} but the tokens "
                    f"have batch {batch}; convert with a batch-1 prompt to serve any query batch")
            S, z = S + S_icl.astype(dt), z + z_icl.astype(dt)
        S = jnp.broadcast_to(S, (batch, H, F, dv))
        z = jnp.broadcast_to(z, (batch, H, F))
        return LinearState(S, z), bias

    def _store(self, final: LinearState, bias, n_tokens: int):
        S, z = final
        if self.cfg.positions == "rope":
            S = rebase_state(S, n_tokens, self.cfg.rope_base, self.cfg.rope_style)
        if bias is not None:  # the bias is added again on every call: store only the rest
            S, z = S - bias.S, z - bias.z
        self.put_variable(ICLCA, "S", S)
        self.put_variable(ICLCA, "z", z)

    def path_str(self) -> str:
        return "/".join(self.scope.path) if self.scope is not None else "attention"

    # ------------------------------------------------------------------ softmax attention
    def _softmax(self, q, k, v, positions):
        cfg = self.cfg
        # Context of an "fn" edit at hook_attn_scores: the rotated q, k it scores (repeated to every
        # head) and the projections before rope, [batch, seq, heads, d_head] (keys: kv_heads; this
        # call's tokens only, so not when a cache adds earlier keys).
        raw = {"q_proj": jnp.swapaxes(q, 1, 2), "k_proj": jnp.swapaxes(k, 1, 2)}
        if cfg.positions == "rope":
            q, k = (apply_rope(a, positions, cfg.rope_base, cfg.rope_style) for a in (q, k))
        k_pos = positions
        decoding = _advancing(self, CACHE)
        if decoding:
            k, v, k_pos, overflow = self._update_cache(k, v, positions)
        approx = self.get_variable(ICLCA, "approx") if self.has_variable(ICLCA, "approx") else None
        if approx is not None and approx.sink_k is not None:  # prompt tokens kept exact
            B = q.shape[0]
            k = jnp.concatenate([jnp.broadcast_to(approx.sink_k, (B,) + approx.sink_k.shape[1:]).astype(k.dtype), k], 2)
            v = jnp.concatenate([jnp.broadcast_to(approx.sink_v, (B,) + approx.sink_v.shape[1:]).astype(v.dtype), v], 2)
            k_pos = jnp.concatenate([approx.sink_pos.astype(k_pos.dtype), k_pos])
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        logits = site(self, "hook_attn_scores", attention_logits(q, k), pos_axis=2, head_axis=1,
                      context={"q": q, "k": k, "q_pos": positions, "k_pos": k_pos,
                               **({} if decoding or approx is not None else raw)})
        # Causal: a key is visible from queries at or after its position. Non-causal: every filled
        # key (an unfilled cache slot is never visible).
        visible = (causal_mask(positions, k_pos) if cfg.causal
                   else jnp.broadcast_to(k_pos[None, :] != _EMPTY_SLOT, (positions.shape[0], k_pos.shape[0])))
        logits = jnp.where(visible, logits, -jnp.inf)
        if approx is None:
            pattern = site(self, "hook_pattern", jax.nn.softmax(logits, axis=-1), pos_axis=2, head_axis=1)
            o = jnp.einsum("bhts,bhsd->bhtd", pattern, v.astype(pattern.dtype))
        else:
            o = self._with_prompt(approx, q, logits, v)
        o = o.astype(v.dtype)
        if decoding:
            # Under jit a full cache cannot raise; make the overflow visible instead of wrong.
            o = jnp.where(overflow, jnp.nan, o)
        return o

    def _with_prompt(self, approx, q, logits, v):
        """Softmax attention over the visible keys plus a kernel-approximated prompt (``iclca``
        collection, ``approx``: see ``linicl.iclca.convert_approx``). ``hook_pattern`` then holds the
        weights of the real keys; 1 minus its row sum is the prompt's share."""
        B = q.shape[0]
        phi_q = prompt_kernels.features(approx.kernel, q, approx.W)
        N, Z = prompt_kernels.prompt_terms(phi_q.astype(logits.dtype),
                                           jnp.broadcast_to(approx.B, (B,) + approx.B.shape[1:]).astype(logits.dtype),
                                           jnp.broadcast_to(approx.b, (B,) + approx.b.shape[1:]).astype(logits.dtype))
        if approx.lam is None:  # one normaliser shared by the prompt and the input
            weights, c = prompt_kernels.shared_softmax(logits, Z)
            pattern = site(self, "hook_pattern", weights, pos_axis=2, head_axis=1)
            return jnp.einsum("bhts,bhsd->bhtd", pattern, v.astype(pattern.dtype)) + c[..., None] * N
        # The lambda-mix: lam * softmax over the input + (1 - lam) * the prompt's kernel attention.
        pattern = site(self, "hook_pattern", approx.lam * jax.nn.softmax(logits, axis=-1), pos_axis=2,
                       head_axis=1)
        return (jnp.einsum("bhts,bhsd->bhtd", pattern, v.astype(pattern.dtype))
                + (1 - approx.lam) * N / Z[..., None])

    def _update_cache(self, k, v, positions):
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        B, H, T, dh = k.shape  # H = kv_heads: the cache stores the un-repeated keys and values
        shape = (B, H, cfg.max_len, dh)
        ck = self.variable(CACHE, "cached_k", jnp.zeros, shape, dt)
        cv = self.variable(CACHE, "cached_v", jnp.zeros, shape, dt)
        cpos = self.variable(CACHE, "k_pos", lambda: jnp.full((cfg.max_len,), _EMPTY_SLOT, jnp.int32))
        idx = self.variable(CACHE, "index", lambda: jnp.zeros((), jnp.int32))
        if ck.value.shape[0] != B:
            raise LiniclError(f"the decode cache holds batch {ck.value.shape[0]}, tokens have batch {B}")
        start = idx.value
        zero = jnp.zeros((), jnp.int32)
        overflow = start + T > cfg.max_len
        ck.value = jax.lax.dynamic_update_slice(ck.value, k.astype(dt), (zero, zero, start, zero))
        cv.value = jax.lax.dynamic_update_slice(cv.value, v.astype(dt), (zero, zero, start, zero))
        cpos.value = jax.lax.dynamic_update_slice(cpos.value, positions.astype(jnp.int32), (start,))
        idx.value = start + T
        return ck.value, cv.value, cpos.value, overflow
