"""Multi-head causal attention as a Linen module: linear (with a state) or softmax (with a KV cache).

Variable collections (their names and contents: ``linicl.names``):
* ``params``: ``q`` (DenseGeneral, kernel ``[d_model, heads, d_head]``), ``k``, ``v`` (kernel
  ``[d_model, kv_heads, d_head]``; grouped-query attention shares each key/value head among
  ``heads // kv_heads`` query heads), ``o`` (kernel ``[heads, d_head, d_model]``); with
  ``cfg.trainable_bias``, ``S_bias: [heads, d_phi, d_head]`` and ``z_bias: [heads, d_phi]``, zero-initialised;
  with ``feature_map="hedgehog"``, ``phi_q_W``, ``phi_k_W: [heads, d_head, m]`` and ``phi_q_b``,
  ``phi_k_b: [heads, m]`` (queries and keys have separate maps; with grouped-query heads the key map
  is per query head, applied after the keys are repeated), initialised to W = identity (tiled or
  folded when m != d_head: ``feature_maps.hedgehog_init_weight``), b = 0; with a window or sinks,
  ``gate: [heads]`` (g_h = sigmoid(gate), initialised to 0: g_h = 1/2).
* ``prompt_state`` (linear attention): ``S: [batch or 1, heads, d_phi, d_head]``, ``z: [batch or 1,
  heads, d_phi]``, the state a prompt left behind, read as the initial state (with a window or
  sinks, every field of ``HybridState``). When the collection is mutable the final state is written
  back (re-based for rope on the features when nothing depends on absolute positions): that is
  ``iclca.convert``.
* ``decode``: the running state of a decode. Linear attention keeps its ``S``, ``z`` there (started
  from ``prompt_state``, which it then supersedes); softmax attention its keys, values (``kv_heads`` of
  them), their positions and the fill index.
* ``prompt_approx`` (softmax attention): ``approx``, a kernel-approximated prompt
  (``linicl.iclca.PromptApprox``, read through its attributes only: the type belongs to the method).

Sites (``linicl.nn.hooks``): ``hook_q``, ``hook_k``, ``hook_v`` (projections before rope),
``hook_z`` (per-head output before ``o``), all ``[batch, seq, heads, d_head]``; softmax attention also
has ``hook_attn_scores`` (scaled logits before the causal mask) and ``hook_pattern``, both
``[batch, heads, q_seq, k_seq]``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.kernels import feature_maps, prompt_kernels
from linicl.kernels.hybrid_attention import empty_state, hybrid_attention
from linicl.kernels.linear_attention import LinearState, linear_attention
from linicl.kernels.positions import apply_rope
from linicl.kernels.softmax_attention import attention_logits, causal_mask, repeat_kv
from linicl.names import DECODE, PROMPT_APPROX, PROMPT_STATE
from linicl.nn.hooks import site

_EMPTY_SLOT = jnp.iinfo(jnp.int32).max  # key position of an unfilled cache slot: later than any query


def rebase_state(S: jax.Array, shift: int, base: float, style: str = "interleaved") -> jax.Array:
    """Rotate the feature axis of ``S: [..., d_phi, d_v]`` by position ``-shift``.

    A rope state holds features rotated to absolute positions; after ``shift`` tokens this moves it to
    the frame in which the next token sits at position 0 (iclca.md, section 4).
    """
    return jnp.swapaxes(apply_rope(jnp.swapaxes(S, -1, -2), -shift, base, style), -1, -2)


def advancing(module: nn.Module, collection: str) -> bool:
    """True when this call should write its state back: the collection is mutable and this is not
    ``init`` (which makes every collection mutable but must not store the init tokens)."""
    return module.is_mutable_collection(collection) and not module.is_initializing()


def _batched(a: jax.Array, batch: int, dtype) -> jax.Array:
    """A stored ``[batch or 1, ...]`` array broadcast to ``batch`` rows."""
    return jnp.broadcast_to(a, (batch,) + a.shape[1:]).astype(dtype)


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
            o = self._linear(q, repeat_kv(k, cfg.n_heads), repeat_kv(v, cfg.n_heads), positions)
        else:
            o = self._softmax(q, k, v, positions)
        z = site(self, "hook_z", jnp.swapaxes(o, 1, 2), head_axis=2)
        return dense(cfg.d_model, axis=(-2, -1), name="o")(z)

    # ------------------------------------------------------------------ linear attention
    def _linear(self, q, k, v, positions):
        cfg = self.cfg
        rotate = functools.partial(apply_rope, positions=positions, base=cfg.rope_base, style=cfg.rope_style)
        rope = cfg.positions == "rope"
        if rope and cfg.rope_on == "inputs":  # LoLCATs: phi of the rotated q, k (absolute positions)
            q, k = rotate(q), rotate(k)
        fq, fk = self._features(q, k)
        q_den = k_den = None
        if rope and cfg.rope_on == "features":
            # Rotate the numerator features only; the normaliser keeps the unrotated (positive) ones.
            q_den, k_den = fq, fk
            fq, fk = rotate(fq), rotate(fk)
        if cfg.hybrid:
            # The exact part scores the rotated q, k whichever features the linear part rotates.
            q_exact, k_exact = (rotate(q), rotate(k)) if rope and cfg.rope_on == "features" else (q, k)
            return self._hybrid(q_exact, k_exact, fq, fk, v, positions, q_den, k_den)
        state, bias = self._initial_state(q.shape[0])
        o, final = linear_attention(fq, fk, v, state, q_den=q_den, k_den=k_den,
                                    log_gamma=self._log_gamma(), normalize=cfg.normalize,
                                    eps=cfg.attn_eps, form=cfg.form, chunk_size=cfg.chunk_size)
        self._store_all(final, bias, q.shape[2])
        return o

    def _hybrid(self, q, k, fq, fk, v, positions, q_den, k_den):
        cfg = self.cfg
        gate = self.param("gate", nn.initializers.zeros, (cfg.n_heads,), cfg.jnp_dtype)
        state, bias = self._initial_state(q.shape[0])
        o, final = hybrid_attention(q, k, fq, fk, v, positions, state, gate=gate, window=cfg.window,
                                    sinks=cfg.sinks, fq_den=q_den, fk_den=k_den,
                                    log_gamma=self._log_gamma(), eps=cfg.attn_eps, form=cfg.form,
                                    chunk_size=cfg.chunk_size)
        self._store_all(final, bias, q.shape[2])
        return o

    def _features(self, q, k):
        """(phi_q(q), phi_k(k)), ``f[batch, heads, seq, d_phi]``; hedgehog reads its parameters."""
        cfg = self.cfg
        if cfg.feature_map != "hedgehog":
            phi = feature_maps.get(cfg.feature_map)
            return phi(q), phi(k)
        H, d, m, dt = cfg.n_heads, cfg.head_dim, cfg.hedgehog_size, cfg.jnp_dtype
        W0 = lambda key, shape, dtype: jnp.broadcast_to(  # noqa: E731
            feature_maps.hedgehog_init_weight(d, m, dtype), shape)
        out = []
        for name, x in (("q", q), ("k", k)):
            W = self.param(f"phi_{name}_W", W0, (H, d, m), dt)
            b = self.param(f"phi_{name}_b", nn.initializers.zeros, (H, m), dt)
            out.append(feature_maps.hedgehog(x, W, b))
        return tuple(out)

    def _log_gamma(self):
        gammas = self.cfg.decay_per_head()
        if gammas is None:
            return None
        return jnp.log(jnp.asarray(gammas, self.cfg.jnp_dtype))

    def _empty_state(self, batch: int):
        """The zero state of this layer, ``LinearState`` or (window/sinks) ``HybridState``."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        F, H, dv = cfg.feature_dim, cfg.n_heads, cfg.head_dim
        if cfg.hybrid:
            return empty_state(batch, H, dv, F, dv, cfg.window, cfg.sinks, dt)
        return LinearState(jnp.zeros((batch, H, F, dv), dt), jnp.zeros((batch, H, F), dt))

    def _initial_state(self, batch: int):
        """The initial state broadcast to the batch: the trainable bias (if any) plus the stored state
        (the running decode state when there is one, else the converted prompt's). Position fields
        (``*_pos``, int32) carry no batch axis."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        F, H, dv = cfg.feature_dim, cfg.n_heads, cfg.head_dim
        empty = self._empty_state(1)
        bias = None
        if cfg.trainable_bias:
            bias = LinearState(self.param("S_bias", nn.initializers.zeros, (H, F, dv), dt),
                               self.param("z_bias", nn.initializers.zeros, (H, F), dt))
            empty = empty._replace(S=empty.S + bias.S, z=empty.z + bias.z)
        stored = DECODE if self.has_variable(DECODE, "S") else PROMPT_STATE
        fields = dict(empty._asdict())
        if self.has_variable(stored, "S"):
            for name, zero in empty._asdict().items():
                fields[name] = self._read_stored(stored, name, zero, batch)
            fields["S"], fields["z"] = fields["S"] + empty.S, fields["z"] + empty.z
        return type(empty)(**{n: a if n.endswith("_pos") else jnp.broadcast_to(a, (batch,) + a.shape[1:])
                              for n, a in fields.items()}), bias

    def _read_stored(self, stored: str, name: str, zero, batch: int):
        """One stored field, checked against this model's shapes."""
        if not self.has_variable(stored, name):
            raise LiniclError(f"variables['{stored}'] of {self.path_str()} has no {name!r}; this model "
                              f"(window={self.cfg.window}, sinks={self.cfg.sinks}) keeps "
                              f"{list(self._empty_state(1)._fields)}")
        a = self.get_variable(stored, name)
        if name.endswith("_pos"):
            ok = a.shape == zero.shape
        else:
            ok = a.ndim == zero.ndim and a.shape[1:] == zero.shape[1:]
            if ok and a.shape[0] not in (1, batch):
                raise LiniclError(
                    f"variables['{stored}'] holds a state for batch {a.shape[0]} but the tokens "
                    f"have batch {batch}; convert with a batch-1 prompt to serve any query batch")
        if not ok:
            raise LiniclError(
                f"variables['{stored}'] of {self.path_str()} has {name}{tuple(a.shape)}; this model "
                f"expects {name}[batch, {', '.join(map(str, zero.shape[1:]))}]")
        return a if name.endswith("_pos") else a.astype(self.cfg.jnp_dtype)

    def _store_all(self, final, bias, n_tokens: int):
        for collection in (PROMPT_STATE, DECODE):
            if advancing(self, collection):
                self._store(collection, final, bias, n_tokens)

    def _store(self, collection: str, final, bias, n_tokens: int):
        S, z = final.S, final.z
        if self.cfg.rebases_state:
            S = rebase_state(S, n_tokens, self.cfg.rope_base, self.cfg.rope_style)
        if bias is not None:  # the bias is added again on every call: store only the rest
            S, z = S - bias.S, z - bias.z
        for name, a in final._replace(S=S, z=z)._asdict().items():
            self.put_variable(collection, name, a)

    def path_str(self) -> str:
        return "/".join(self.scope.path) if self.scope is not None else "attention"

    # ------------------------------------------------------------------ softmax attention
    def _softmax(self, q, k, v, positions):
        cfg = self.cfg
        # Context of an "fn" edit at hook_attn_scores: the rotated q, k it scores (repeated to every
        # head) and the projections before rope, [batch, seq, heads, d_head] (keys: kv_heads; this
        # call's tokens only, so not when a cache or a stored prompt adds earlier keys).
        raw = {"q_proj": jnp.swapaxes(q, 1, 2), "k_proj": jnp.swapaxes(k, 1, 2)}
        if cfg.positions == "rope":
            q, k = (apply_rope(a, positions, cfg.rope_base, cfg.rope_style) for a in (q, k))
        k_pos, overflow = positions, None
        decoding = advancing(self, DECODE)
        if decoding:
            k, v, k_pos, overflow = self._update_cache(k, v, positions)
        approx = self.get_variable(PROMPT_APPROX, "approx") if self.has_variable(PROMPT_APPROX, "approx") else None
        if approx is not None and approx.sink_k is not None:  # prompt tokens kept exact
            k, v, k_pos = self._with_sinks(approx, k, v, k_pos)
        k, v = repeat_kv(k, cfg.n_heads), repeat_kv(v, cfg.n_heads)
        logits = site(self, "hook_attn_scores", attention_logits(q, k), pos_axis=2, head_axis=1,
                      context={"q": q, "k": k, "q_pos": positions, "k_pos": k_pos,
                               **({} if decoding or approx is not None else raw)})
        logits = jnp.where(self._visible(positions, k_pos), logits, -jnp.inf)
        if approx is None:
            pattern = site(self, "hook_pattern", jax.nn.softmax(logits, axis=-1), pos_axis=2, head_axis=1)
            o = jnp.einsum("bhts,bhsd->bhtd", pattern, v.astype(pattern.dtype))
        else:
            o = self._with_prompt(approx, q, logits, v)
        o = o.astype(v.dtype)
        if overflow is not None:
            # Under jit a full cache cannot raise; make the overflow visible instead of wrong.
            o = jnp.where(overflow, jnp.nan, o)
        return o

    def _visible(self, q_pos, k_pos) -> jax.Array:
        """``bool[q_seq, k_seq]``. Causal: a key is visible from queries at or after its position.
        Non-causal: every filled key (an unfilled cache slot is never visible)."""
        if self.cfg.causal:
            return causal_mask(q_pos, k_pos)
        return jnp.broadcast_to(k_pos[None, :] != _EMPTY_SLOT, (q_pos.shape[0], k_pos.shape[0]))

    @staticmethod
    def _with_sinks(approx, k, v, k_pos):
        """Prepend the prompt tokens an approximate conversion kept exact (its sinks)."""
        B = k.shape[0]
        k = jnp.concatenate([_batched(approx.sink_k, B, k.dtype), k], 2)
        v = jnp.concatenate([_batched(approx.sink_v, B, v.dtype), v], 2)
        return k, v, jnp.concatenate([approx.sink_pos.astype(k_pos.dtype), k_pos])

    def _with_prompt(self, approx, q, logits, v):
        """Softmax attention over the visible keys plus a kernel-approximated prompt
        (``prompt_approx``: see ``linicl.iclca.convert_approx``). ``hook_pattern`` then holds the
        weights of the real keys; 1 minus its row sum is the prompt's share."""
        B, dt = q.shape[0], logits.dtype
        if approx.g is None:
            phi_q = prompt_kernels.features(approx.kernel, q, approx.W)
        else:  # the learned kernel: the student's query map, read from the stored prompt
            phi_q = prompt_kernels.features(approx.kernel, q, approx.phi_W, approx.phi_b)
        N, Z = prompt_kernels.prompt_terms(phi_q.astype(dt), _batched(approx.B, B, dt), _batched(approx.b, B, dt))
        if approx.g is not None:  # the student's hybrid: g_h e^{s - c_t} next to phi_q(q).phi_k(k)
            weights, c = prompt_kernels.hybrid_weights(logits, approx.g, Z)
            pattern = site(self, "hook_pattern", weights, pos_axis=2, head_axis=1)
            return jnp.einsum("bhts,bhsd->bhtd", pattern, v.astype(pattern.dtype)) + c[..., None] * N
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
        ck = self.variable(DECODE, "cached_k", jnp.zeros, shape, dt)
        cv = self.variable(DECODE, "cached_v", jnp.zeros, shape, dt)
        cpos = self.variable(DECODE, "k_pos", lambda: jnp.full((cfg.max_len,), _EMPTY_SLOT, jnp.int32))
        idx = self.variable(DECODE, "index", lambda: jnp.zeros((), jnp.int32))
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
