"""Recall capacity of the zoo's mixers on multi-query associative recall (Zoology's MQAR) and on
in-context linear regression, and the same predictions read from the prompt converted into weights.

``--tasks`` (default both): ``mqar`` and ``regression``, each with one model per mixer.

Mixers (``--mixers``), one small model each (``--d-model`` 64, 2 layers, 4 heads, MLP 128, no
positions except softmax's rope). The finite-state ones store the same number of floats per prompt,
``iclca.state_floats``: L * H * (d_phi * d_head + d_phi) with d_phi = d_head (the delta rule keeps no
z: L * H * d_phi * d_head, d_head floats fewer per head):

* ``softmax``: softmax attention with rope; its prompt is a KV cache of 2 * L * H * d_head floats per
  prompt token (reported against the number of pairs), not a finite state: not convertible;
* ``linear``: linear attention, phi = elu+1, normalised (Katharopoulos et al.);
* ``decayed``: the same with a fixed per-head decay gamma_h = 1 - 2^-s_h, s_h evenly over [0.4,
  6.6] (0.24, 0.82, 0.96, 0.99 for 4 heads: RetNet-style, one head almost a token shift);
* ``gated``, ``gated_vector``: data-dependent decays, one per head and token (``gate="scalar"``,
  Mamba-2 style) or per head, token and key feature (``gate="vector"``, GLA);
* ``delta``: the delta rule (DeltaNet; phi = identity, L2-normalised q and k, ``normalize=False``);
* ``gated_delta``: the delta rule with a scalar gate (Gated DeltaNet).

The gated models' gate biases start at the decayed model's gammas (alpha_h = gamma_h at x W = 0):
a gate is then the fixed decay plus what the tokens make of it. The zoo's own initial gates remember
8 to 512 tokens (``linicl.nn.attention.gate_bias_init``); our models have no short convolution (which
Zoology's, GLA's and DeltaNet's models all have) and must make the token shift that binds a key to
its value from a short memory, which the zoo's gates only reach after more steps than this
experiment trains.

MQAR data (``linicl.data.synthetic.mqar_batch``): ``k_1 v_1 ... k_n v_n`` then queried keys, each
followed by its value; keys are distinct tokens of the lower half of the vocabulary, values uniform
tokens of the upper half. Loss and accuracy at the query keys only.

MQAR training (the same for every mixer; float32, Adam with global-norm clipping at 1, linear warm-up
then cosine decay to lr / 10 over all steps): a curriculum, because the recall circuit (a token shift
in the first layer, a content match in the second) forms in a few hundred steps on a small
vocabulary and not within a thousand on the full one:

1. ``circuit``: ``--circuit-steps`` steps of 2 pairs and 1 query, keys and values from a 16-token
   sub-vocabulary (8 keys, 8 values), batch ``--circuit-batch``;
2. ``vocab <V'>``: ``--vocab-steps`` steps each with the sub-vocabulary doubled until it is the
   whole vocabulary (2 pairs, 1 query);
3. ``pairs``: ``--steps`` steps on the whole vocabulary, every step one batch per size of
   ``--train-pairs`` (n pairs, max(1, n / 2) queries, ``--queries`` / queries sequences).

MQAR evaluation (float64: the trained float32 weights cast, so that prompted and converted logits agree
to ~1e-12 and no rounding can flip an argmax; linear models in the recurrent form, see ``evaluate``):
for each number of pairs of ``--pairs``, ``--eval-batch`` held-out sequences (the same for every
mixer) with ``--eval-queries`` queries right after the pairs; the accuracy over all queries with its
95 % Wilson interval (queries of one sequence share a prompt, so the interval is somewhat
optimistic). For each finite-state mixer, the pairs (the prompt) are converted (``iclca.convert``)
and the converted model reads only the queries: its predictions must be identical to the prompted
model's, and the script asserts it. Delta-rule against additive mixers
(delta - linear, gated_delta - gated) are compared on the same queries with a paired bootstrap
interval (``linicl.stats``).

MQAR's default budget (about 30 minutes on 2 busy CPU cores for all seven mixers) leaves every model
far from trained at 8 pairs and more (RESULTS.md); ``--steps`` (the pairs stage) is the knob for a
longer run. The numbers compare mixers under one small, equal budget, not their capacity at
convergence.

In-context linear regression (``regression``; Garg et al. arXiv 2208.01066; data
``linicl.data.synthetic.regression_batch`` and ``regression_embeds``): per sequence w ~ N(0, I) and
pairs x_i ~ N(0, I), y_i = w . x_i (no noise), read as the continuous tokens x_1, y_1, x_2, y_2, ...
(``[x, 0]`` and ``[0, ..., 0, y]``). The same seven mixers with the same sizes (``model_config``; the
vocabulary is unused: the model reads ``embeds`` and returns its final hidden state) between an
experiment-owned read-in ``W_in: d_x + 1 -> d_model`` and read-out ``w_out: d_model -> 1`` (both
with bias); the prediction of y_i is the read-out at the x_i token.

* training: ``--reg-steps`` Adam steps (the schedule and clipping of MQAR, ``--lr``), each on
  ``--reg-batch`` fresh tasks of ``--reg-examples`` pairs (d_x ``--reg-dx``); the loss is the squared
  error at every x-token over d_x (1: the zero predictor), float32. No curriculum (Garg et al. grow
  d_x and the number of pairs during training). The default 1000 steps take about 12 minutes for all
  seven mixers on 2 busy CPU cores (measured per mixer at 50 to 1000 steps: 60 to 150 s each, the
  vector-gated and delta-rule ones the slowest); softmax and gated models come down from the zero
  predictor's 1.0 to a mean training loss of ~0.4 over the positions, far from trained.
* evaluation (float64, as MQAR's): ``--reg-eval-batch`` held-out tasks, the same for every mixer and
  baseline; for each k of ``--reg-k`` the error (prediction - y)^2 / d_x at the (k+1)-th x-token after
  k pairs, its mean with a 95 % bootstrap interval over the tasks (k = 32 is one pair past the
  training length). Finite-state mixers: the k pairs, read in, are converted (``iclca.convert(...,
  embeds=...)``) and the converted model reads only the (k+1)-th x-token; its predictions must equal
  the prompted ones (max relative difference <= 1e-10, asserted).
* baselines on the same tasks: least squares (minimum-norm; exact from k = d_x on), the averaging
  estimator w = mean_i y_i x_i (one gradient step from 0, up to its scale), the zero predictor.

Each trained model is checkpointed in ``OUT/checkpoints/<mixer>.ckpt`` (MQAR) or
``regression_<mixer>.ckpt`` (``linicl.checkpoint``) with a fingerprint of everything that shapes its
training; a later run with the same settings loads it instead of training (changing only the
evaluation options never retrains a regression model; MQAR's ``max_len`` follows ``--pairs``).

Writes ``OUT/recall_capacity.json`` (settings, every accuracy, count, interval, training curve and
timing; the regression under ``"regression"``), ``OUT/recall_capacity.png`` (accuracy against pairs,
one line per mixer, converted as markers; training loss) and ``OUT/recall_capacity_regression.png``
(error against k, converted as hollow markers, baselines dashed; training loss); the tables are
printed first, MQAR's then the regression's.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linicl import checkpoint, iclca, reporting, stats
from linicl.compiled import enable_persistent_cache
from linicl.config import ModelConfig
from linicl.data.synthetic import RegressionBatch, TokenBatch, mqar_batch, regression_batch, regression_embeds
from linicl.errors import LiniclError
from linicl.memory import kv_cache_floats
from linicl.nn import Transformer
from linicl.reporting import positive_float, positive_int, positive_int_list
from linicl.timing import FAST_COMPILE, QUICK_COMPILE

# mixer -> its ModelConfig fields (decays are filled in per model: they depend on n_heads)
MIXERS = {
    "softmax": dict(attention="softmax", positions="rope"),
    "linear": dict(feature_map="elu+1"),
    "decayed": dict(feature_map="elu+1", decay="spread"),
    "gated": dict(feature_map="elu+1", gate="scalar"),
    "gated_vector": dict(feature_map="elu+1", gate="vector"),
    "delta": dict(feature_map="identity", normalize=False, update="delta"),
    "gated_delta": dict(feature_map="identity", normalize=False, update="delta", gate="scalar"),
}
# delta-rule mixer -> the additive mixer it differs from only by the update rule
PAIRED = {"delta": "linear", "gated_delta": "gated"}
CIRCUIT_VOCAB = 16  # the first stage's sub-vocabulary: 8 keys, 8 values
TRAINING = ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "lr", "circuit_steps", "circuit_batch",
            "vocab_steps", "steps", "train_pairs", "queries", "chunk", "seed")
# The regression's: the same model sizes (its vocabulary is unused), its own data and steps.
REG_TRAINING = ("d_model", "n_layers", "n_heads", "d_ff", "lr", "reg_dx", "reg_examples", "reg_steps",
                "reg_batch", "chunk", "seed")
REL_TOL = 1e-10  # converted against prompted regression predictions, float64

# Sized for about 30 CPU-minutes (2 cores) for all seven mixers on MQAR, and about 12 more on the
# regression (module docstring).
FULL = dict(vocab=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, lr=3e-3, circuit_steps=1200,
            circuit_batch=256, vocab_steps=300, steps=1000, train_pairs=[2, 4, 8, 16, 32], queries=128,
            chunk=50, pairs=[4, 8, 16, 32], eval_queries=4, eval_batch=256,
            reg_dx=8, reg_examples=32, reg_steps=1000, reg_batch=64, reg_k=[1, 2, 4, 8, 16, 32],
            reg_eval_batch=256)
# Quick: one compiled training chunk serves both stages (the same sizes, vocabulary and length). The
# regression's held-out tasks are more than the full run's: cheap at these sizes, and enough to see
# the zero predictor's error near its expected 1 (the test checks it).
QUICK = dict(vocab=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, lr=3e-3, circuit_steps=2,
             circuit_batch=8, vocab_steps=2, steps=2, train_pairs=[2], queries=8, chunk=2,
             pairs=[2, 4], eval_queries=2, eval_batch=8,
             reg_dx=2, reg_examples=4, reg_steps=2, reg_batch=8, reg_k=[1, 2, 4], reg_eval_batch=512)


class Stage(NamedTuple):
    """One phase of training: ``steps`` steps. MQAR: tokens from a ``sub_vocab``-token part of the
    vocabulary, one batch per ``(n_pairs, n_queries, batch)`` of ``sizes`` in every step; regression:
    ``sub_vocab`` 0 and ``sizes`` the one ``(n_examples, d_x, batch)``."""

    name: str
    steps: int
    sub_vocab: int
    sizes: tuple


# ---------------------------------------------------------------------------------------- setup
def options(quick: bool = False, **changes) -> dict:
    """The run's options: ``FULL`` (or ``QUICK``) with ``changes`` applied."""
    opts = dict(QUICK if quick else FULL, mixers=list(MIXERS), tasks=list(TASKS), seed=0, quick=quick)
    opts.update({k: v for k, v in changes.items() if v is not None})
    return opts


def decays(n_heads: int) -> tuple:
    """gamma_h = 1 - 2^-s_h with s_h evenly over [0.4, 6.6]: from an almost-shift head (0.24) to a
    memory of ~100 tokens (0.99)."""
    s = np.linspace(0.4, 6.6, n_heads) if n_heads > 1 else np.array([3.0])
    return tuple(float(g) for g in 1.0 - np.exp2(-s))


def model_config(opts: dict, mixer: str) -> ModelConfig:
    """The mixer's ModelConfig; every mixer has the same sizes. Linear-family models run the chunked
    form with chunks of 16 (the fastest on a CPU at these lengths; every form computes the same)."""
    fields = dict(MIXERS[mixer])
    if fields.get("decay") == "spread":
        fields["decay"] = decays(opts["n_heads"])
    if fields.get("attention", "linear") == "linear":
        fields.update(form="chunked", chunk_size=16)
    longest = 4 * max(opts["pairs"] + opts["train_pairs"])  # 2n + 2m - 1 tokens with m <= n
    return ModelConfig(vocab_size=opts["vocab"], d_model=opts["d_model"], n_layers=opts["n_layers"],
                       n_heads=opts["n_heads"], d_ff=opts["d_ff"], max_len=longest, **fields)


def regression_config(opts: dict, mixer: str) -> ModelConfig:
    """The mixer's config for in-context regression: the MQAR model's sizes; one (unused) token, as
    the model reads ``embeds`` and returns its hidden state; ``max_len`` the training sequences' (no
    mixer has learned positions: longer evaluation sequences are fine, and ``--reg-k`` never retrains)."""
    return model_config(opts, mixer).replace(vocab_size=1, max_len=2 * opts["reg_examples"])


def init_params(opts: dict, mixer: str, key) -> dict:
    """Initial params; a gated model's gate bias is set so that alpha_h starts at the decayed model's
    gamma_h (see the module docstring)."""
    cfg = model_config(opts, mixer)
    return with_gate_bias(jax.jit(Transformer(cfg).init)(key, jnp.zeros((1, 2), jnp.int32))["params"], cfg)


def regression_init(opts: dict, mixer: str, key) -> dict:
    """Initial params ``{"model", "read_in", "read_out"}``: the transformer's (gates as
    ``init_params``'s), the read-in ``[d_x + 1, d_model]`` and the read-out ``[d_model, 1]`` (lecun
    normal kernels, zero biases)."""
    cfg = regression_config(opts, mixer)
    k_model, k_in, k_out = jax.random.split(key, 3)
    init = jax.jit(functools.partial(Transformer(cfg).init, hidden=True))
    params = init(k_model, embeds=jnp.zeros((1, 2, cfg.d_model), jnp.float32))["params"]
    return dict(model=with_gate_bias(params, cfg), read_in=_dense_init(k_in, opts["reg_dx"] + 1, cfg.d_model),
                read_out=_dense_init(k_out, cfg.d_model, 1))


def _dense_init(key, n_in: int, n_out: int) -> dict:
    kernel = jax.random.normal(key, (n_in, n_out), jnp.float32) * n_in ** -0.5  # a Python float: stays f32
    return dict(kernel=kernel, bias=jnp.zeros((n_out,), jnp.float32))


def dense(p: dict, x):
    """``x @ kernel + bias`` (NumPy or JAX)."""
    return x @ p["kernel"] + p["bias"]


def with_gate_bias(params: dict, cfg: ModelConfig) -> dict:
    """``params`` with every gate bias at logit(gamma_h) (alpha_h = gamma_h at x W = 0); changed in
    place."""
    if cfg.gate == "none":
        return params
    gamma = np.asarray(decays(cfg.n_heads))
    logit = np.log(gamma) - np.log1p(-gamma)                          # sigmoid(logit) = gamma
    for layer in range(cfg.n_layers):
        gate = params[f"layers_{layer}"]["attn"]["gate_proj"]
        shape = gate["bias"].shape                                    # [heads] or [heads, d_phi]
        bias = np.broadcast_to(logit.reshape((-1,) + (1,) * (len(shape) - 1)), shape)
        gate["bias"] = jnp.asarray(bias.astype(cfg.jnp_dtype))       # numpy: no eager compilation
    return params


def n_queries(n_pairs: int) -> int:
    """Queries per training sequence of ``n_pairs`` pairs: half of the pairs (more queries per
    sequence train faster; querying every pair would let the last answers be found by elimination)."""
    return max(1, n_pairs // 2)


def stages(opts: dict) -> list:
    """The curriculum (module docstring): circuit, vocabulary doublings, pairs."""
    V = opts["vocab"]
    two = ((2, 1, opts["circuit_batch"]),)
    subs = [min(CIRCUIT_VOCAB, V)]
    while subs[-1] < V:
        subs.append(min(2 * subs[-1], V))
    out = [Stage("circuit", opts["circuit_steps"], subs[0], two)]
    out += [Stage(f"vocab {sub}", opts["vocab_steps"], sub, two) for sub in subs[1:]]
    sizes = tuple((n, n_queries(n), max(1, opts["queries"] // n_queries(n))) for n in opts["train_pairs"])
    out.append(Stage("pairs", opts["steps"], V, sizes))
    return [s for s in out if s.steps > 0]


def regression_stages(opts: dict) -> list:
    """One stage, no curriculum (Garg et al. grow d_x and the length; our models are small and the
    sequences short): ``--reg-steps`` steps of ``--reg-batch`` fresh tasks of ``--reg-examples`` pairs."""
    sizes = ((opts["reg_examples"], opts["reg_dx"], opts["reg_batch"]),)
    return [Stage("regression", opts["reg_steps"], 0, sizes)]


def widen(batch: TokenBatch, sub_vocab: int, vocab: int) -> TokenBatch:
    """An MQAR batch drawn over ``sub_vocab`` tokens, moved into the model's vocabulary: keys stay
    ``[0, sub_vocab / 2)``, values go to ``[vocab / 2, vocab / 2 + sub_vocab / 2)``."""
    shift = vocab // 2 - sub_vocab // 2
    move = lambda x: jnp.where(x < sub_vocab // 2, x, x + shift)  # noqa: E731
    return TokenBatch(move(batch.inputs), move(batch.targets), batch.mask)


def check_options(opts: dict) -> None:
    """Raise LiniclError naming the option when a size cannot work (before any training)."""
    V, half = opts["vocab"], opts["vocab"] // 2
    if V < 4 or V % 2:
        raise LiniclError(f"--vocab must be even and >= 4 (keys and values are its halves), got {V}")
    for name in ("pairs", "train_pairs"):
        if max(opts[name]) > half:
            raise LiniclError(f"--{name.replace('_', '-')} {max(opts[name])} distinct keys do not fit in "
                              f"the {half} keys of --vocab {V}")
    if opts["eval_queries"] > min(opts["pairs"]):
        raise LiniclError(f"--eval-queries {opts['eval_queries']} must be <= the smallest --pairs "
                          f"({min(opts['pairs'])}): each pair is queried at most once")
    for name, known in (("mixers", MIXERS), ("tasks", TASKS)):
        for x in opts[name]:
            if x not in known:
                raise LiniclError(f"--{name}: unknown {name[:-1]} {x!r}; known: {', '.join(known)}")
    for mixer in opts["mixers"]:
        model_config(opts, mixer)  # a ConfigError names the field


# ---------------------------------------------------------------------------------------- training
def masked_metrics(logits, batch: TokenBatch):
    """Mean cross-entropy and accuracy at the query keys (``batch.mask``)."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
    m = batch.mask.astype(jnp.float32)
    hit = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
    return (nll * m).sum() / m.sum(), (hit * m).sum() / m.sum()


def make_optimizer(opts: dict, total_steps: int) -> optax.GradientTransformation:
    warmup = max(1, min(100, total_steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, opts["lr"], warmup, max(total_steps, warmup + 1),
                                                  end_value=opts["lr"] / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def mqar_loss(opts: dict, model: Transformer, stage: Stage) -> Callable:
    """``loss_fn(params, key) -> (loss, acc[sizes])``: the mean cross-entropy over ``stage``'s batches
    (one per size) and each batch's accuracy."""

    def loss_fn(params, key):
        losses, accs = [], []
        for i, (n, m, b) in enumerate(stage.sizes):
            drawn = mqar_batch(jax.random.fold_in(key, i), b, n, m, stage.sub_vocab)
            batch = widen(drawn, stage.sub_vocab, opts["vocab"])
            loss, acc = masked_metrics(model.apply({"params": params}, batch.inputs), batch)
            losses.append(loss)
            accs.append(acc)
        return jnp.mean(jnp.stack(losses)), jnp.stack(accs)

    return loss_fn


def mqar_record(stage: Stage, acc) -> dict:
    """A chunk's history entry, MQAR's part: the mean accuracy per training size."""
    acc = np.asarray(acc).mean(0)
    return dict(acc={str(n): float(a) for (n, _, _), a in zip(stage.sizes, acc)})


def regress(model: Transformer, variables: dict, io: dict, embeds):
    """Predictions ``f[batch, seq]`` at every token of ``embeds: f[batch, seq, d_x + 1]`` (those at the
    x-tokens, ``[:, 0::2]``, are the y's): read-in, the model's final hidden state, read-out.
    ``variables``: the model's, possibly converted; ``io``: params holding ``read_in`` and ``read_out``."""
    hidden = model.apply(variables, embeds=dense(io["read_in"], embeds), hidden=True)
    return dense(io["read_out"], hidden)[..., 0]


def regression_loss(opts: dict, model: Transformer, stage: Stage) -> Callable:
    """``loss_fn(params, key) -> (loss, ())``: the squared error at every x-token over d_x (the
    evaluation's scale: 1 is the zero predictor), on a fresh batch of tasks."""
    ((n, d_x, batch),) = stage.sizes

    def loss_fn(params, key):
        data = regression_batch(key, batch, n, d_x)
        pred = regress(model, {"params": params["model"]}, params, regression_embeds(data.xs, data.ys))
        return jnp.mean((pred[:, 0::2] - data.ys) ** 2) / d_x, ()

    return loss_fn


def make_chunk(loss_fn: Callable, opt, length: int, quick: bool):
    """jit ``(params, opt_state, key, start) -> (params, opt_state, loss[length], aux[length, ...])``:
    ``length`` optimiser steps on ``loss_fn(params, key) -> (loss, aux)``; step s draws its data from
    ``fold_in(key, s)``."""

    def step(carry, s):
        params, opt_state, key = carry
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, jax.random.fold_in(key, s))
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), (loss, aux)

    def chunk(params, opt_state, key, start):
        steps = start + jnp.arange(length)
        (params, opt_state, _), (loss, aux) = jax.lax.scan(step, (params, opt_state, key), steps)
        return params, opt_state, loss, aux

    return jax.jit(chunk, compiler_options=FAST_COMPILE if quick else QUICK_COMPILE)


def train(opts: dict, mixer: str, bar=None, task: str = "mqar") -> tuple:
    """Train one mixer on ``task`` through its stages; ``(params, history)``. ``history``: per chunk
    the stage, the last step, the mean loss, the task's own record (MQAR: the mean accuracy per
    training size) and the seconds since the start (compilation included)."""
    t = TASKS[task]
    model = Transformer(t.config(opts, mixer))
    plan = t.plan(opts)
    opt = make_optimizer(opts, sum(s.steps for s in plan))
    root = jax.random.PRNGKey(opts["seed"])
    params = t.init(opts, mixer, jax.random.fold_in(root, 0))
    opt_state = opt.init(params)
    history, done, fns, t0 = [], 0, {}, time.perf_counter()
    for index, stage in enumerate(plan):
        key = jax.random.fold_in(jax.random.fold_in(root, 1), index)
        for start in range(0, stage.steps, opts["chunk"]):
            length = min(opts["chunk"], stage.steps - start)
            shape = (stage.sub_vocab, stage.sizes, length)  # stages of the same data share a compilation
            if shape not in fns:
                fns[shape] = make_chunk(t.loss(opts, model, stage), opt, length, opts["quick"])
            params, opt_state, loss, aux = fns[shape](params, opt_state, key, jnp.int32(start))
            done += length
            history.append(dict(stage=stage.name, step=done, loss=float(np.mean(loss)), **t.record(stage, aux),
                                seconds=time.perf_counter() - t0))
            if bar is not None:
                bar.update(length)
                bar.set_postfix_str(f"{mixer} {stage.name} loss {history[-1]['loss']:.3f}")
    return params, history


def settings(opts: dict, mixer: str, task: str = "mqar") -> dict:
    """What shapes a trained model: the mixer, its config and the task's training options (not the
    evaluation's), with their fingerprint."""
    t = TASKS[task]
    kept = dict(trainer="experiments/recall_capacity.py", mixer=mixer,
                model={k: v for k, v in t.config(opts, mixer).__dict__.items()},
                training={k: opts[k] for k in t.training}, stages=[s._asdict() for s in t.plan(opts)])
    if task != "mqar":  # MQAR's settings predate the tasks: unchanged, its checkpoints stay valid
        kept["task"] = task
    kept = json.loads(json.dumps(kept))  # as the checkpoint stores it: tuples become lists
    return dict(kept, fingerprint=reporting.fingerprint(kept))


def trained(opts: dict, mixer: str, out: str, bar=None, task: str = "mqar") -> tuple:
    """``(params, meta, reused)``: the checkpoint of the same settings (``OUT/checkpoints/<mixer>.ckpt``,
    ``regression_<mixer>.ckpt``), or a newly trained model (saved). A checkpoint made under other
    settings is trained again and replaced."""
    t = TASKS[task]
    path = os.path.join(out, "checkpoints", f"{t.prefix}{mixer}.ckpt")
    want = settings(opts, mixer, task)
    template = jax.eval_shape(lambda: t.init(opts, mixer, jax.random.PRNGKey(0)))
    if checkpoint.exists(path):
        if checkpoint.header(path).settings == want:
            tree, meta = checkpoint.load(path, {"params": template}, settings=want)
            if bar is not None:
                bar.update(sum(s.steps for s in t.plan(opts)))
            return jax.tree.map(jnp.asarray, tree["params"]), meta, True
        print(f"{path} was trained under other settings; training {mixer} ({task}) again", file=sys.stderr)
    t0 = time.perf_counter()
    params, history = train(opts, mixer, bar, task)
    meta = dict(history=history, train_s=time.perf_counter() - t0)
    checkpoint.save(path, {"params": params}, settings=want, meta=meta)
    return params, meta, False


# ---------------------------------------------------------------------------------------- evaluation
def eval_batch(opts: dict, n_pairs: int) -> TokenBatch:
    """The held-out sequences of ``n_pairs`` pairs: the same for every mixer (and apart from the
    training keys, which fold in 1)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(opts["seed"]), 2), n_pairs)
    return mqar_batch(key, opts["eval_batch"], n_pairs, opts["eval_queries"], opts["vocab"])


def prompt_floats(cfg: ModelConfig, n_pairs: int) -> int:
    """Floats a prompt of ``n_pairs`` pairs leaves: the finite state, or softmax's KV cache."""
    if cfg.attention == "linear":
        return iclca.state_floats(cfg)
    return kv_cache_floats(cfg, 2 * n_pairs)


def eval_model(cfg: ModelConfig, params) -> tuple:
    """``(model, params)`` of the float64 evaluation: ``cfg`` in float64 and the trained weights cast."""
    cfg = cfg.replace(dtype="float64")
    if cfg.attention == "linear":
        # Every form computes the same model. The recurrent one here because with the parallel form
        # (also the chunked form's short tail) XLA CPU's YNNPACK reduce fusions returned an all-NaN
        # state in float64 at batch 256 for about 1 compilation in 5 (README, known issues).
        cfg = cfg.replace(form="recurrent")
    return Transformer(cfg), jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)


def evaluate(opts: dict, mixer: str, params) -> list:
    """One row per number of pairs: counts, accuracies with intervals, prompted and converted; the
    per-query correctness is kept for the paired comparisons."""
    model, params = eval_model(model_config(opts, mixer), params)
    cfg = model.cfg
    # numpy for everything around the model: eager jnp calls would each compile
    variables = {"params": params}
    apply = jax.jit(model.apply, compiler_options=FAST_COMPILE)
    rows = []
    for n in opts["pairs"]:
        batch = jax.tree.map(np.asarray, eval_batch(opts, n))
        cut = 2 * n                                              # the prompt: the pairs
        logits = np.asarray(apply(variables, batch.inputs))[:, cut:]
        mask, targets = batch.mask[:, cut:], batch.targets[:, cut:]
        pred = logits.argmax(-1)
        hit = (pred == targets)[mask]
        row = dict(pairs=n, queries=int(hit.size), correct=int(hit.sum()), prompt_floats=prompt_floats(cfg, n),
                   prompted=_interval(hit), hits=hit.astype(int).tolist())
        if cfg.attention == "linear":
            converted = iclca.convert(model, variables, batch.inputs[:, :cut])
            logits_c = np.asarray(apply(converted, batch.inputs[:, cut:]))
            pred_c = logits_c.argmax(-1)
            hit_c = (pred_c == targets)[mask]
            scale = float(np.abs(logits).max())
            row.update(converted=_interval(hit_c), correct_converted=int(hit_c.sum()),
                       identical=bool(np.array_equal(pred_c[mask], pred[mask])),
                       max_rel_logit_diff=float(np.abs(logits_c - logits).max()) / max(scale, 1e-300))
            if not row["identical"]:
                raise AssertionError(f"{mixer}, {n} pairs: the converted model's predictions differ from "
                                     f"the prompted model's (max relative logit difference "
                                     f"{row['max_rel_logit_diff']:.3g})")
        rows.append(row)
    return rows


def _interval(hit) -> dict:
    iv = stats.wilson(int(np.sum(hit)), int(np.size(hit)))
    return dict(acc=iv.value, low=iv.low, high=iv.high)


def regression_tasks(opts: dict) -> RegressionBatch:
    """The held-out tasks (NumPy float64), ``max(--reg-k) + 1`` pairs each: the same for every mixer
    and baseline (and apart from the training's keys)."""
    key = jax.random.fold_in(jax.random.PRNGKey(opts["seed"]), 3)
    drawn = regression_batch(key, opts["reg_eval_batch"], max(opts["reg_k"]) + 1, opts["reg_dx"])
    return RegressionBatch(*(np.asarray(a, np.float64) for a in drawn))


def error_interval(pred, y, d_x: int) -> dict:
    """The normalised squared error (pred - y)^2 / d_x over the tasks (``pred``, ``y``: ``[tasks]``;
    d_x = E[y^2]: 1 is the zero predictor): its mean with a 95 % percentile bootstrap interval over
    the tasks (``stats.paired_bootstrap`` against 0: the bootstrap of the mean)."""
    err = (np.asarray(pred, np.float64) - y) ** 2 / d_x
    iv = stats.paired_bootstrap(err, np.zeros_like(err))
    return dict(mean=iv.value, low=iv.low, high=iv.high)


def evaluate_regression(opts: dict, mixer: str, params) -> list:
    """One row per k of ``--reg-k``: the error of the prediction at the (k+1)-th x-token after k pairs,
    prompted (one pass over every pair: the model is causal) and, for a finite-state mixer, from the
    converted prompt of the k pairs, which must give the same predictions (asserted)."""
    model, params = eval_model(regression_config(opts, mixer), params)
    data = regression_tasks(opts)
    embeds = np.asarray(regression_embeds(data.xs, data.ys))           # [tasks, 2 (max k + 1), d_x + 1]
    apply = jax.jit(functools.partial(regress, model), compiler_options=FAST_COMPILE)
    variables = {"params": params["model"]}
    pred = np.asarray(apply(variables, params, embeds))[:, 0::2]       # [tasks, max k + 1]
    rows, d_x = [], opts["reg_dx"]
    for k in opts["reg_k"]:
        y = data.ys[:, k]
        row = dict(k=k, prompt_floats=prompt_floats(model.cfg, k), prompted=error_interval(pred[:, k], y, d_x))
        if model.cfg.attention == "linear":
            pred_c = converted_predictions(model, apply, variables, params, embeds, k)
            diff = float(np.abs(pred_c - pred[:, k]).max() / max(np.abs(pred[:, k]).max(), 1e-300))
            row.update(converted=error_interval(pred_c, y, d_x)["mean"], identical=diff <= REL_TOL,
                       max_rel_diff=diff)
            if not row["identical"]:
                raise AssertionError(f"{mixer}, {k} pairs: the converted model's regression predictions differ "
                                     f"from the prompted model's (max relative difference {diff:.3g})")
        rows.append(row)
    return rows


def converted_predictions(model: Transformer, apply: Callable, variables: dict, params: dict, embeds, k: int):
    """``f[tasks]``: the predictions at the (k+1)-th x-token of ``embeds`` by the model holding its first
    k pairs converted, reading that token alone. The read-in acts token by token: converting its
    output converts the prompt."""
    converted = iclca.convert(model, variables, embeds=np.asarray(dense(params["read_in"], embeds[:, :2 * k])))
    return np.asarray(apply(converted, params, embeds[:, 2 * k:2 * k + 1]))[:, 0]


# estimator name -> w from one task's k pairs (x: [k, d_x], y: [k])
BASELINES = {
    "least squares": lambda x, y: np.linalg.lstsq(x, y, rcond=None)[0],  # minimum-norm when k < d_x
    "averaging": lambda x, y: (y[:, None] * x).mean(0),                  # one GD step from 0, up to scale
    "zero": lambda x, y: np.zeros(x.shape[1]),
}


def regression_baselines(opts: dict) -> dict:
    """``{estimator: [row per k]}``: the error of each estimator of ``BASELINES`` on the held-out tasks."""
    data = regression_tasks(opts)
    out = {name: [] for name in BASELINES}
    for k in opts["reg_k"]:
        for name, fit in BASELINES.items():
            w = np.stack([fit(x, y) for x, y in zip(data.xs[:, :k], data.ys[:, :k])])
            pred = np.einsum("bd,bd->b", w, data.xs[:, k])
            out[name].append(dict(k=k, error=error_interval(pred, data.ys[:, k], opts["reg_dx"])))
    return out


def comparisons(results: dict) -> list:
    """Delta-rule minus additive accuracy on the same queries, with a paired bootstrap interval."""
    out = []
    for delta, additive in PAIRED.items():
        if delta not in results or additive not in results:
            continue
        for a, b in zip(results[delta]["eval"], results[additive]["eval"]):
            iv = stats.paired_bootstrap(a["hits"], b["hits"])
            out.append(dict(delta=delta, additive=additive, pairs=a["pairs"], diff=iv.value, low=iv.low,
                            high=iv.high, significant=iv.excludes_zero()))
    return out


# ---------------------------------------------------------------------------------------- tasks
class Task(NamedTuple):
    """What trains and evaluates one model per mixer on a task of ``--tasks``."""

    prefix: str         # of its checkpoints' file names
    config: Callable    # (opts, mixer) -> ModelConfig
    init: Callable      # (opts, mixer, key) -> initial params
    plan: Callable      # opts -> [Stage]
    loss: Callable      # (opts, model, stage) -> loss_fn(params, key) -> (loss, aux)
    record: Callable    # (stage, aux[steps, ...]) -> a chunk's history entry, the task's own part
    training: tuple     # the options that shape the trained model (in its fingerprint)
    evaluate: Callable  # (opts, mixer, params) -> one row per evaluated prompt size


TASKS = {
    "mqar": Task("", model_config, init_params, stages, mqar_loss, mqar_record, TRAINING, evaluate),
    "regression": Task("regression_", regression_config, regression_init, regression_stages, regression_loss,
                       lambda stage, aux: {}, REG_TRAINING, evaluate_regression),
}


# ---------------------------------------------------------------------------------------- report
def _fmt(iv: dict) -> str:
    return stats.Interval(iv["acc"], iv["low"], iv["high"]).fmt()


def _fmt_error(iv: dict) -> str:
    return stats.Interval(iv["mean"], iv["low"], iv["high"]).fmt(scale=1, digits=3)


def table(results: dict) -> str:
    """One row per mixer and number of pairs: prompt floats, prompted and converted accuracy."""
    rows = []
    for mixer, r in results.items():
        for e in r["eval"]:
            conv = (_fmt(e["converted"]), "yes" if e["identical"] else "NO") if "converted" in e \
                else ("not convertible (KV cache)", "")
            rows.append([mixer, e["pairs"], e["prompt_floats"], _fmt(e["prompted"]), *conv])
    return reporting.markdown_table(["mixer", "pairs", "prompt floats", "prompted acc % [95 % CI]",
                                     "converted acc % [95 % CI]", "same predictions"], rows)


def comparison_table(comps: list) -> str:
    rows = [[f"{c['delta']} - {c['additive']}", c["pairs"],
             stats.Interval(c["diff"], c["low"], c["high"]).fmt() + ("" if c["significant"] else " (n.s.)")]
            for c in comps]
    header = ["delta rule - additive", "pairs", "accuracy difference, points [95 % CI]"]
    return reporting.markdown_table(header, rows)


def mqar_tables(report: dict) -> str:
    """The MQAR table, then the delta-rule comparisons (when both of a pair ran)."""
    comps = report["comparisons"]
    return table(report["results"]) + (("\n\n" + comparison_table(comps)) if comps else "")


def regression_table(reg: dict) -> str:
    """One row per mixer and k: prompt floats, prompted and converted error; then the baselines, one
    row per k."""
    rows = []
    for mixer, r in reg["results"].items():
        for e in r["eval"]:
            conv = (f"{e['converted']:.3f}", f"yes ({e['max_rel_diff']:.0e})" if e["identical"] else "NO") \
                if "converted" in e else ("not convertible (KV cache)", "")
            rows.append([mixer, e["k"], e["prompt_floats"], _fmt_error(e["prompted"]), *conv])
    mixers = reporting.markdown_table(["mixer", "pairs k", "prompt floats", "prompted error [95 % CI]",
                                       "converted error", "same predictions (max rel. diff.)"], rows)
    base = [[k] + [_fmt_error(rows[i]["error"]) for rows in reg["baselines"].values()]
            for i, k in enumerate(reg["config"]["reg_k"])]
    header = ["pairs k"] + [f"{name} error" for name in reg["baselines"]]
    return mixers + "\n\n" + reporting.markdown_table(header, base)


def regression_heading(cfg: dict) -> str:
    return (f"In-context linear regression, d_x {cfg['reg_dx']}, d_model {cfg['d_model']}, {cfg['n_layers']} "
            f"layers, {cfg['n_heads']} heads, trained on {cfg['reg_examples']} pairs ({cfg['reg_steps']} steps "
            f"x {cfg['reg_batch']} tasks); error at the (k+1)-th x: (prediction - y)^2 / d_x (1: the zero "
            f"predictor), mean over {cfg['reg_eval_batch']} held-out tasks [95 % bootstrap CI]")


def headline(report: dict) -> str:
    """The tables of the tasks that ran (RESULTS.md's section)."""
    parts = [mqar_tables(report)] if "results" in report else []
    if "regression" in report:
        parts += [regression_heading(report["regression"]["config"]), report["regression"]["table"]]
    return "\n\n".join(parts)


def _mixer_lines(ax, x, results: dict, colors: list, value: str, converted: Callable) -> None:
    """Per mixer its prompted ``value`` against ``x`` with the interval as error bars and, where every
    point has one, ``converted(row)`` as hollow markers; log2 x axis."""
    for c, (mixer, r) in zip(colors, results.items()):
        ivs = [e["prompted"] for e in r["eval"]]
        v = np.array([iv[value] for iv in ivs])
        low, high = (np.array([iv[end] for iv in ivs]) for end in ("low", "high"))
        err = [np.maximum(v - low, 0), np.maximum(high - v, 0)]  # a bootstrap interval may miss its mean
        ax.errorbar(x, v, yerr=err, color=c, marker=".", capsize=3, label=f"{mixer} ({r['state']})")
        if all("converted" in e for e in r["eval"]):
            ax.plot(x, [converted(e) for e in r["eval"]], "o", mfc="none", ms=11, color=c)
    ax.plot([], [], "o", mfc="none", color="k", ms=11, label="converted prompt (same)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(p) for p in x])
    ax.minorticks_off()


def _loss_curves(ax, results: dict, colors: list, ylabel: str, title: str, stage_steps=()) -> None:
    """Every mixer's training loss against the step, the stage boundaries dotted."""
    for c, (mixer, r) in zip(colors, results.items()):
        ax.plot([x["step"] for x in r["history"]], [x["loss"] for x in r["history"]], color=c, label=mixer)
    ax.set(yscale="log", xlabel="training step", ylabel=ylabel, title=title)
    for stage_end in np.cumsum(stage_steps)[:-1]:
        ax.axvline(stage_end, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=7)


def _colors(plt, n: int) -> list:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


def figure(plt, report: dict):
    """Accuracy against pairs (lines: prompted, markers: converted), and the training loss."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = _colors(plt, len(report["results"]))
    pairs = report["config"]["pairs"]
    _mixer_lines(a, pairs, report["results"], colors, "acc", lambda e: e["converted"]["acc"])
    a.set(xlabel="key-value pairs in the prompt", ylabel="recall accuracy (95 % Wilson)", ylim=(-0.02, 1.02),
          title="MQAR recall")
    a.legend(fontsize=7)
    _loss_curves(b, report["results"], colors, "training loss (query keys)", "curriculum",
                 [s["steps"] for s in report["config"]["stages"]])
    fig.tight_layout()
    return fig


def regression_figure(plt, report: dict):
    """Error against k (lines: prompted, hollow markers: converted, dashed: the baselines), and the
    training loss."""
    reg = report["regression"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = _colors(plt, len(reg["results"]))
    ks = reg["config"]["reg_k"]
    _mixer_lines(a, ks, reg["results"], colors, "mean", lambda e: e["converted"])
    for grey, (name, rows) in zip(("0.1", "0.4", "0.65"), reg["baselines"].items()):
        a.plot(ks, [e["error"]["mean"] for e in rows], ls="--", marker="x", color=grey, label=name)
    # least squares is exact (~1e-30) from k = d_x on: the axis stops below the models' errors
    lows = [e["prompted"]["low"] for r in reg["results"].values() for e in r["eval"]]
    a.set_yscale("log")
    a.set_ylim(bottom=max(1e-6, min([0.1] + [0.5 * x for x in lows if x > 0])))
    a.set(xlabel="(x, y) pairs in the prompt, k", ylabel="squared error / d_x at the next x (95 % bootstrap)",
          title=f"in-context linear regression, d_x = {reg['config']['reg_dx']}")
    a.legend(fontsize=7)
    _loss_curves(b, reg["results"], colors, "training loss (squared error / d_x)", "regression training")
    fig.tight_layout()
    return fig


# (the report's part, the file, the figure)
FIGURES = (("results", "recall_capacity.png", figure),
           ("regression", "recall_capacity_regression.png", regression_figure))


def state_label(cfg: ModelConfig) -> str:
    return f"state {iclca.state_floats(cfg)}" if cfg.attention == "linear" else "KV cache"


def run(opts: dict, out: str, progress: bool = True, task: str = "mqar") -> dict:
    """Train (or load) and evaluate every mixer on ``task``; ``{mixer: its results}``."""
    from tqdm.auto import tqdm

    t = TASKS[task]
    total = len(opts["mixers"]) * sum(s.steps for s in t.plan(opts))
    results = {}
    with tqdm(total=total, desc=f"train {task}", disable=not progress) as bar:
        for mixer in opts["mixers"]:
            params, meta, reused = trained(opts, mixer, out, bar, task)
            t0 = time.perf_counter()
            rows = t.evaluate(opts, mixer, params)
            cfg = t.config(opts, mixer)
            results[mixer] = dict(model=cfg.describe(), state=state_label(cfg), reused_checkpoint=reused,
                                  train_s=meta["train_s"], eval_s=time.perf_counter() - t0,
                                  history=meta["history"], eval=rows)
    return results


def regression_report(opts: dict, out: str, progress: bool) -> dict:
    """The regression part of the report: its settings, every mixer's results, the baselines, the
    table and the wall time."""
    t0 = time.perf_counter()
    results = run(opts, out, progress, task="regression")
    config = dict({k: opts[k] for k in REG_TRAINING + ("reg_k", "reg_eval_batch")},
                  stages=[s._asdict() for s in regression_stages(opts)])
    reg = dict(config=config, results=results, baselines=regression_baselines(opts))
    return dict(reg, table=regression_table(reg), wall_s=time.perf_counter() - t0)


def print_models(results: dict) -> None:
    for mixer, r in results.items():
        how = "checkpoint reused" if r["reused_checkpoint"] else "trained"
        print(f"{mixer}: {r['model']}; {how} ({r['train_s']:.0f} s), evaluated in {r['eval_s']:.1f} s")


def print_summary(report: dict) -> None:
    cfg = report["config"]
    if "results" in report:
        print(f"\nMQAR, vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
              f"{cfg['n_heads']} heads; {cfg['eval_batch']} sequences x {cfg['eval_queries']} queries per point")
        print(mqar_tables(report))
        print_models(report["results"])
    if "regression" in report:
        print("\n" + regression_heading(report["regression"]["config"]))
        print(report["regression"]["table"])
        print_models(report["regression"]["results"])


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/recall_capacity", seed="initialisation, data, evaluation",
                              quick="tiny models, a few steps of each stage and task (CI, about a minute)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None,
                        help="default: both (mqar: recall; regression: in-context linear regression)")
    parser.add_argument("--mixers", nargs="+", choices=list(MIXERS), default=None, help="default: all")
    listed = lambda xs: ",".join(map(str, xs))  # noqa: E731
    parser.add_argument("--pairs", type=positive_int_list, default=None,
                        help=f"evaluated numbers of pairs, comma-separated (default {listed(FULL['pairs'])})")
    parser.add_argument("--train-pairs", type=positive_int_list, default=None,
                        help=f"pair counts of the pairs stage (default {listed(FULL['train_pairs'])})")
    for name, kind, what in (
            ("steps", positive_int, ""), ("circuit_steps", positive_int, ""), ("vocab_steps", positive_int, ""),
            ("vocab", positive_int, ""), ("d_model", positive_int, ""), ("n_layers", positive_int, ""),
            ("n_heads", positive_int, ""), ("d_ff", positive_int, ""), ("lr", positive_float, ""),
            ("circuit_batch", positive_int, ""), ("queries", positive_int, ""), ("chunk", positive_int, ""),
            ("eval_queries", positive_int, ""), ("eval_batch", positive_int, ""),
            ("reg_steps", positive_int, "regression training steps; "),
            ("reg_dx", positive_int, "regression input dimension d_x; "),
            ("reg_examples", positive_int, "(x, y) pairs per regression training sequence; "),
            ("reg_batch", positive_int, "regression tasks per training step; "),
            ("reg_k", positive_int_list, "evaluated numbers of regression pairs k, comma-separated; "),
            ("reg_eval_batch", positive_int, "held-out regression tasks; ")):
        shown = listed if isinstance(FULL[name], list) else str
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"{what}default {shown(FULL[name])} ({shown(QUICK[name])} with --quick)")
    args = parser.parse_args(argv)
    given = list(FULL) + ["mixers", "tasks"]
    changes = {k: getattr(args, k) for k in given if getattr(args, k, None) is not None}
    opts = options(args.quick, seed=args.seed, **changes)
    try:
        check_options(opts)
    except LiniclError as e:  # ConfigError too
        parser.error(str(e))
    if args.quick:  # a smoke test: compile time dominates, and XLA's optimisations do not pay off
        jax.config.update("jax_disable_most_optimizations", True)
    jax.config.update("jax_enable_x64", True)  # the evaluation's float64; training stays float32
    reporting.writable_dir(args.out)

    t0 = time.perf_counter()
    config = dict(opts, stages=[s._asdict() for s in stages(opts)], decays=list(decays(opts["n_heads"])))
    report = dict(config=config, machine=reporting.machine_info())
    if "mqar" in opts["tasks"]:
        results = run(opts, args.out, progress=args.progress)
        report.update(results=results, comparisons=comparisons(results))
    if "regression" in opts["tasks"]:
        report["regression"] = regression_report(opts, args.out, args.progress)
    report.update(table=headline(report), wall_s=time.perf_counter() - t0)
    reporting.write_json(os.path.join(args.out, "recall_capacity.json"), report, indent=None)
    print_summary(report)
    pngs = [reporting.plot(os.path.join(args.out, name), draw, report) for part, name, draw in FIGURES
            if part in report]
    written = [p.name for p in pngs if p is not None]
    print(f"\nwrote {args.out}/recall_capacity.json" + (" and " + ", ".join(written) if written else "")
          + f" ({report['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
