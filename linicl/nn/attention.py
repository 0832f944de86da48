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
  ``gate: [heads]`` (g_h = sigmoid(gate), initialised to 0: g_h = 1/2); with ``gate="scalar"`` or
  ``"vector"``, ``gate_proj`` (DenseGeneral, kernel ``[d_model, heads]`` or ``[d_model, heads, d_phi]``,
  always with a bias: ``gate_bias_init``), the log-decay log alpha_t = log_sigmoid(x_t W + b) of every
  head (and key feature) and token; with ``update="delta"``, ``beta_proj`` (kernel
  ``[d_model, heads]``, bias initialised to 0), the write strength beta_t = sigmoid(x_t W + b) in
  (0, 1); with ``cfg.short_conv`` = K, ``conv_q: [K, heads, d_head]``, ``conv_k``, ``conv_v`` (kv_heads), the
  taps of the short causal convolution of the projections (no bias; initialised to the identity, tap
  K - 1 = 1). Gates and write strengths are per query head (with grouped-query heads the linear state
  S, z and the key features are kept per query head, from the repeated keys and values; the exact part
  of a hybrid, its window's, sinks' and cache's keys and values, per key/value head). x is the
  attention's input.
* ``prompt_state`` (linear attention): ``S: [batch or 1, heads, d_phi, d_head]``, ``z: [batch or 1,
  heads, d_phi]``, the state a prompt left behind, read as the initial state (with a window or
  sinks, every field of ``HybridState``, whose keys and values ``win_k``, ``win_v``, ``sink_k``,
  ``sink_v`` have kv_heads; with a cache too, of ``sparse_cache.SparseState``, whose ``cache_pos`` has
  a batch axis and whose cache keys, values, positions and scores have kv_heads; with
  ``update="delta"`` only ``S``, the delta rule's ``DeltaState``); with a short convolution also
  ``conv_q: [batch or 1, K - 1, heads, d_head]``, ``conv_k``, ``conv_v`` (kv_heads), the convolution's
  last K - 1 inputs (``names.SHORT_CONV_STATE``).
  When the collection is mutable the final state is written
  back (re-based for rope on the features when nothing depends on absolute positions): that is
  ``iclca.convert``.
* ``decode``: the running state of a decode. Linear attention keeps its ``S``, ``z`` (and any other
  field of its state, ``conv_*`` included) there (started from ``prompt_state``, which it then
  supersedes); softmax attention its keys, values (``kv_heads`` of
  them), their positions and the fill index.
* ``prompt_approx`` (softmax attention): ``approx``, a kernel-approximated prompt
  (``linicl.iclca.PromptApprox``, read through its attributes only: the type belongs to the method).

Sites (``linicl.nn.hooks``): ``hook_q``, ``hook_k``, ``hook_v`` (projections before the short
convolution, if any, and rope),
``hook_z`` (per-head output before ``o``), all ``[batch, seq, heads, d_head]``; softmax attention also
has ``hook_attn_scores`` (scaled logits before the causal mask) and ``hook_pattern``, both
``[batch, heads, q_seq, k_seq]``.

The delta rule (``update="delta"``) reads and writes with L2-normalised features: phi(k) and phi(q)
are divided by sqrt(|phi|^2 + attn_eps) per head and token (after phi, before rope on the features,
which keeps norms). Keys must be: each write I - beta k k^T is then a contraction and the state stays
bounded (``linicl.kernels.delta_rule``). Queries are too, as in DeltaNet and Gated DeltaNet: the
read-out phi(q)^T S is then bounded by the state's norm, and a query equal to a key written with
beta = 1 reads back exactly its value.

The short convolution (``cfg.short_conv``, ``linicl.kernels.short_conv``) filters q, k, v right after
their projections (and sites), per head and coordinate, before the q/k norms, rope, the feature map and
the delta rule's L2 norms (the order of fla's GLA and DeltaNet layers). The hybrids' exact window and
cache then hold convolved keys and values; the convolution keeps its own state (the last K - 1 inputs),
read and written beside the attention's, from the same collection (``decode`` when it holds this
layer's ``S``, else ``prompt_state``), never re-based (it holds no positions).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.errors import LiniclError
from linicl.kernels import feature_maps, prompt_kernels, sparse_cache
from linicl.kernels.delta_rule import DeltaState, delta_rule
from linicl.kernels.gated_attention import gated_attention
from linicl.kernels.hybrid_attention import empty_state, hybrid_attention
from linicl.kernels.linear_attention import LinearState, linear_attention
from linicl.kernels.positions import apply_rope
from linicl.kernels.short_conv import short_conv, zero_state as conv_zero_state
from linicl.kernels.softmax_attention import attention_logits, causal_mask, repeat_kv
from linicl.names import DECODE, PROMPT_APPROX, PROMPT_STATE, SHORT_CONV_STATE
from linicl.nn.hooks import site
from linicl.nn.norms import make_norm

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


def gate_bias_init(key, shape, dtype) -> jax.Array:
    """The gate's initial bias, ``f[heads]`` or ``f[heads, d_phi]``: head h gets b_h = log(2^s_h - 1)
    with s_h spread evenly over [3, 9] (6 for one head), the same for each of its features.

    With x W small, alpha = sigmoid(b) = 1 - 2^-s: each head starts as a decayed linear attention that
    remembers about 2^s tokens, from 8 to 512 (RetNet's per-head spread, 1 - 2^(-5-h)). A gate near
    1/2, the zero bias, would erase the state within a few tokens: the untrained model could not see a
    prompt, and the gradients that should teach it to remember would vanish with it."""
    del key  # deterministic, as RetNet's decays
    H = shape[0]
    s = jnp.full((H,), 6.0) if H == 1 else jnp.linspace(3.0, 9.0, H)
    b = jnp.log(jnp.exp2(s) - 1.0)
    return jnp.broadcast_to(b.reshape((H,) + (1,) * (len(shape) - 1)), shape).astype(dtype)


def l2_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(|x|^2 + eps) along the last axis: the delta rule's unit keys (and queries)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def identity_taps(key, shape, dtype) -> jax.Array:
    """The short convolution's initial taps ``f[K, heads, d_head]``: tap K - 1 (the current input) is
    1, the others 0, so that a new model's convolution passes its input through."""
    del key
    return jnp.zeros(shape, dtype).at[-1].set(1)


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
        # [batch, seq, heads, d_head] (the sites' layout)
        projected = [site(self, f"hook_{n}", dense(sizes[n], name=n)(x), head_axis=2) for n in ("q", "k", "v")]
        # as at hook_q/hook_k: what an "fn" edit of the scores is given as q_proj/k_proj
        proj = tuple(jnp.swapaxes(a, 1, 2) for a in projected[:2])
        if cfg.short_conv:
            projected = self._short_conv(projected)
        q, k, v = (jnp.swapaxes(a, 1, 2) for a in projected)  # -> [batch, heads, seq, d_head]
        if cfg.qk_norm:  # Gemma 3: per head over d_head, one norm shared by the heads, before rope
            q, k = make_norm(cfg, "q_norm")(q), make_norm(cfg, "k_norm")(k)
        if cfg.query_pre_attn_scalar is not None:  # q.k / sqrt(d_head) becomes q.k / sqrt(s)
            q = q * jnp.asarray(cfg.query_scale, dt)
        if cfg.attention == "linear":  # k, v: kv_heads (repeated to the query heads where needed)
            o = self._linear(x, q, k, v, positions)
        else:
            o = self._softmax(q, k, v, positions, proj)
        z = site(self, "hook_z", jnp.swapaxes(o, 1, 2), head_axis=2)
        return dense(cfg.d_model, axis=(-2, -1), name="o")(z)

    # ------------------------------------------------------------------ linear attention
    def _short_conv(self, projected: list) -> list:
        """q, k, v ``f[batch, seq, heads, d_head]`` through the short causal convolution, each from
        the stored state (``conv_q``, ``conv_k``, ``conv_v``) when this layer has one, else from
        zeros; the final states are written back with the attention's."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        K, batch = cfg.short_conv, projected[0].shape[0]
        stored = DECODE if self.has_variable(DECODE, "S") else PROMPT_STATE  # as _initial_state
        reading = self.has_variable(stored, "S")
        out, finals = [], {}
        for x, name in zip(projected, SHORT_CONV_STATE):
            channels = x.shape[2:]
            w = self.param(name, identity_taps, (K,) + channels, dt)
            state = None
            if reading:
                state = self._read_stored(stored, name, conv_zero_state(1, K, channels, dt), batch)
            y, finals[name] = short_conv(x, w, state, cfg.short_conv_activation)
            out.append(y)
        for collection in (PROMPT_STATE, DECODE):
            if advancing(self, collection):
                for name, a in finals.items():
                    self.put_variable(collection, name, a)
        return out

    def _linear(self, x, q, k, v, positions):
        """q: ``f[batch, heads, seq, d_head]``; k, v: ``f[batch, kv_heads, seq, d_head]``."""
        cfg = self.cfg
        rotate = functools.partial(apply_rope, positions=positions, base=cfg.rope_base, style=cfg.rope_style)
        rope = cfg.positions == "rope"
        if rope and cfg.rope_on == "inputs":  # LoLCATs: phi of the rotated q, k (absolute positions)
            q, k = rotate(q), rotate(k)
        # The key map is per query head: it reads the repeated keys (rope commutes with the repeat).
        fq, fk = self._features(q, repeat_kv(k, cfg.n_heads))
        if cfg.update == "delta":  # unit features: see the module docstring
            fq, fk = l2_normalize(fq, cfg.attn_eps), l2_normalize(fk, cfg.attn_eps)
        q_den = k_den = None
        if rope and cfg.rope_on == "features":
            # Rotate the numerator features only; the normaliser keeps the unrotated (positive) ones.
            q_den, k_den = fq, fk
            fq, fk = rotate(fq), rotate(fk)
        if cfg.hybrid:
            # The exact part scores the rotated q, k whichever features the linear part rotates; its
            # keys and values stay at kv_heads (the kernels store them once per key/value head).
            q_exact, k_exact = (rotate(q), rotate(k)) if rope and cfg.rope_on == "features" else (q, k)
            return self._hybrid(q_exact, k_exact, fq, fk, v, positions, q_den, k_den)
        v = repeat_kv(v, cfg.n_heads)  # the state S is per query head
        state, bias = self._initial_state(q.shape[0])
        log_alpha = self._log_alpha(x)
        if cfg.update == "delta":  # no normaliser: q_den, k_den are not read
            o, final = delta_rule(fq, fk, v, state, beta=self._beta(x), log_alpha=log_alpha,
                                  form=cfg.form, chunk_size=cfg.chunk_size)
        elif log_alpha is not None:
            o, final = gated_attention(fq, fk, v, state, log_alpha=log_alpha, q_den=q_den, k_den=k_den,
                                       normalize=cfg.normalize, eps=cfg.attn_eps, form=cfg.form,
                                       chunk_size=cfg.chunk_size)
        else:
            o, final = linear_attention(fq, fk, v, state, q_den=q_den, k_den=k_den,
                                        log_gamma=self._log_gamma(), normalize=cfg.normalize,
                                        eps=cfg.attn_eps, form=cfg.form, chunk_size=cfg.chunk_size)
        self._store_all(final, bias, q.shape[2])
        return o

    def _log_alpha(self, x):
        """log alpha_t = log_sigmoid(x_t W + b) <= 0: ``f[batch, heads, seq]`` (scalar gate) or
        ``f[batch, heads, seq, d_phi]`` (vector gate); None without a gate. Log space keeps a strong
        gate exact: alpha = e^-50 is an exponent, never a product of tiny numbers."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        if cfg.gate == "none":
            return None
        shape = (cfg.n_heads,) if cfg.gate == "scalar" else (cfg.n_heads, cfg.feature_dim)
        logits = nn.DenseGeneral(shape, use_bias=True, bias_init=gate_bias_init, dtype=dt, param_dtype=dt,
                                 name="gate_proj")(x)                  # [batch, seq, heads(, d_phi)]
        return jnp.moveaxis(jax.nn.log_sigmoid(logits), 1, 2)

    def _beta(self, x):
        """beta_t = sigmoid(x_t W + b) in (0, 1), ``f[batch, heads, seq]``: the delta rule's write
        strength (its learning rate; bias 0, so beta starts near 1/2)."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        logits = nn.DenseGeneral((cfg.n_heads,), use_bias=True, dtype=dt, param_dtype=dt,
                                 name="beta_proj")(x)
        return jnp.swapaxes(jax.nn.sigmoid(logits), 1, 2)

    def _hybrid(self, q, k, fq, fk, v, positions, q_den, k_den):
        """The hybrid (or sparse-cache) kernel: q, features ``f[batch, heads, seq, .]``; k, v
        ``f[batch, kv_heads, seq, d_head]``, stored as such in the window, sinks and cache."""
        cfg = self.cfg
        gate = self.param("gate", nn.initializers.zeros, (cfg.n_heads,), cfg.jnp_dtype)
        state, bias = self._initial_state(q.shape[0])
        kw = dict(gate=gate, window=cfg.window, sinks=cfg.sinks, fq_den=q_den, fk_den=k_den,
                  log_gamma=self._log_gamma(), eps=cfg.attn_eps, form=cfg.form)
        if cfg.cache:  # the hybrid plus LoLA's sparse cache (recurrent only)
            o, final = sparse_cache.sparse_cache(q, k, fq, fk, v, positions, state, cache=cfg.cache,
                                                 rule=cfg.cache_rule, **kw)
        else:
            o, final = hybrid_attention(q, k, fq, fk, v, positions, state, chunk_size=cfg.chunk_size, **kw)
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
        """The zero state of this layer: ``LinearState``, (window/sinks) ``HybridState``, (with a
        cache) ``SparseState`` or (the delta rule) ``DeltaState``."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        F, H, G, dv = cfg.feature_dim, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        if cfg.cache:
            return sparse_cache.empty_state(batch, H, dv, F, dv, cfg.window, cfg.sinks, cfg.cache, dt,
                                            cfg.cache_rule, kv_heads=G)
        if cfg.hybrid:
            return empty_state(batch, H, dv, F, dv, cfg.window, cfg.sinks, dt, kv_heads=G)
        if cfg.update == "delta":
            return DeltaState(jnp.zeros((batch, H, F, dv), dt))
        return LinearState(jnp.zeros((batch, H, F, dv), dt), jnp.zeros((batch, H, F), dt))

    def _initial_state(self, batch: int):
        """The initial state broadcast to the batch: the trainable bias (if any) plus the stored state
        (the running decode state when there is one, else the converted prompt's). The window's and
        the sinks' positions (``sparse_cache.SHARED_POSITIONS``) carry no batch axis; the cache's do."""
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
            self._check_stored_names(stored)
            for name, zero in empty._asdict().items():
                fields[name] = self._read_stored(stored, name, zero, batch)
            for name in ("S", "z"):  # the (zero or bias) initial state; the delta rule has no z
                if name in fields:
                    fields[name] = fields[name] + getattr(empty, name)
        shared = sparse_cache.SHARED_POSITIONS
        return type(empty)(**{n: a if n in shared else jnp.broadcast_to(a, (batch,) + a.shape[1:])
                              for n, a in fields.items()}), bias

    def _state_names(self) -> tuple:
        """The names of this layer's stored state: its attention state's fields and, with a short
        convolution, ``SHORT_CONV_STATE``."""
        return self._empty_state(1)._fields + (SHORT_CONV_STATE if self.cfg.short_conv else ())

    def _model_state(self) -> str:
        cfg = self.cfg
        cache = f"cache={cfg.cache}, cache_rule={cfg.cache_rule!r}, " if cfg.cache else ""
        conv = f", short_conv={cfg.short_conv}" if cfg.short_conv else ""
        return (f"(window={cfg.window}, sinks={cfg.sinks}, {cache}update={cfg.update!r}{conv}) keeps "
                f"{list(self._state_names())}")

    def _check_stored_names(self, stored: str) -> None:
        """A stored state with fields this model does not keep came from another model (e.g. an
        additive model's z in a delta-rule model): refused, never silently dropped."""
        extra = sorted(set(self.variables.get(stored, {})) - set(self._state_names()))
        if extra:
            raise LiniclError(f"variables['{stored}'] of {self.path_str()} holds {extra}, but this "
                              f"model {self._model_state()}; it was stored by a different model")

    def _read_stored(self, stored: str, name: str, zero, batch: int):
        """One stored field, checked against this model's shapes."""
        if not self.has_variable(stored, name):
            raise LiniclError(f"variables['{stored}'] of {self.path_str()} has no {name!r}; this model "
                              f"{self._model_state()}")
        a = self.get_variable(stored, name)
        if name in sparse_cache.SHARED_POSITIONS:
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
                f"expects {name}[batch, {', '.join(map(str, zero.shape[1:]))}] (it {self._model_state()})")
        return a if name.endswith("_pos") else a.astype(self.cfg.jnp_dtype)

    def _store_all(self, final, bias, n_tokens: int):
        for collection in (PROMPT_STATE, DECODE):
            if advancing(self, collection):
                self._store(collection, final, bias, n_tokens)

    def _store(self, collection: str, final, bias, n_tokens: int):
        fields = final._asdict()
        if self.cfg.rebases_state:
            # Rows of S only: z holds the unrotated features (the delta rule rotates its unit keys,
            # and R(-n) (I - b k k^T) R(n) = I - b (R(-n) k)(R(-n) k)^T keeps it exact).
            fields["S"] = rebase_state(fields["S"], n_tokens, self.cfg.rope_base, self.cfg.rope_style)
        if bias is not None:  # the bias is added again on every call: store only the rest
            for name, b in bias._asdict().items():
                fields[name] = fields[name] - b
        for name, a in fields.items():
            self.put_variable(collection, name, a)

    def path_str(self) -> str:
        return "/".join(self.scope.path) if self.scope is not None else "attention"

    # ------------------------------------------------------------------ softmax attention
    def _softmax(self, q, k, v, positions, proj):
        cfg = self.cfg
        # Context of an "fn" edit at hook_attn_scores: the rotated q, k it scores (repeated to every
        # head) and the projections as at hook_q/hook_k (before q/k-norm, query scale and rope),
        # [batch, seq, heads, d_head] (keys: kv_heads; this call's tokens only, so not when a cache or
        # a stored prompt adds earlier keys).
        raw = {"q_proj": jnp.swapaxes(proj[0], 1, 2), "k_proj": jnp.swapaxes(proj[1], 1, 2)}
        if cfg.positions == "rope":
            q, k = (apply_rope(a, positions, cfg.rope_base, cfg.rope_style) for a in (q, k))
        k_pos, overflow = positions, None
        decoding = advancing(self, DECODE)
        if decoding:
            # A cache made by this call (a prefill) holds only this call's keys: attend to them
            # alone, not to max_len slots of which all but T are empty (the same weights).
            fresh = not self.has_variable(DECODE, "cached_k")
            cached = self._update_cache(k, v, positions)
            overflow = cached[3]
            if not fresh:
                k, v, k_pos = cached[:3]
        approx = self.get_variable(PROMPT_APPROX, "approx") if self.has_variable(PROMPT_APPROX, "approx") else None
        slots = None
        if approx is not None and approx.sink_k is not None:  # prompt tokens kept exact
            k, v, k_pos, slots = self._with_sinks(approx, k, v, k_pos)
        k, v = repeat_kv(k, cfg.n_heads), repeat_kv(v, cfg.n_heads)
        logits = site(self, "hook_attn_scores", attention_logits(q, k), pos_axis=2, head_axis=1,
                      context={"q": q, "k": k, "q_pos": positions, "k_pos": k_pos,
                               **({} if decoding or approx is not None else raw)})
        logits = jnp.where(self._visible(positions, k_pos), logits, -jnp.inf)
        if slots is not None:  # a selection: each KV head's own kept tokens, padded per head
            logits = jnp.where(repeat_kv(slots[:, :, None, :], cfg.n_heads), logits, -jnp.inf)
        if approx is None or approx.B is None:  # no kernel terms: softmax over the exact keys alone
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
        """Prepend the prompt tokens an approximate conversion kept exact (its sinks, window or
        selection). Returns ``(k, v, k_pos, slots)``; ``slots: bool[1, kv_heads, keys]`` marks the
        keys each KV head holds when a selection gives heads their own positions
        (``sink_pos: int32[1, kv_heads, s]``, -1 for padding), else None. A selection's keys all
        precede the query, so one position per slot (the heads' largest) serves the causal mask."""
        B = k.shape[0]
        pos, slots = approx.sink_pos, None
        if pos.ndim == 3:
            n_new = k.shape[2]
            slots = jnp.concatenate([pos >= 0, jnp.ones(pos.shape[:2] + (n_new,), bool)], axis=2)
            pos = jnp.max(pos, axis=(0, 1))
        k = jnp.concatenate([_batched(approx.sink_k, B, k.dtype), k], 2)
        v = jnp.concatenate([_batched(approx.sink_v, B, v.dtype), v], 2)
        return k, v, jnp.concatenate([pos.astype(k_pos.dtype), k_pos]), slots

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
