"""Recall capacity of the zoo's mixers on multi-query associative recall (Zoology's MQAR), and the same
recall read from the prompt converted into weights.

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

Data (``linicl.data.synthetic.mqar_batch``): ``k_1 v_1 ... k_n v_n`` then queried keys, each followed
by its value; keys are distinct tokens of the lower half of the vocabulary, values uniform tokens of
the upper half. Loss and accuracy at the query keys only.

Training (the same for every mixer; float32, Adam with global-norm clipping at 1, linear warm-up then
cosine decay to lr / 10 over all steps): a curriculum, because the recall circuit (a token shift in
the first layer, a content match in the second) forms in a few hundred steps on a small vocabulary
and not within a thousand on the full one:

1. ``circuit``: ``--circuit-steps`` steps of 2 pairs and 1 query, keys and values from a 16-token
   sub-vocabulary (8 keys, 8 values), batch ``--circuit-batch``;
2. ``vocab <V'>``: ``--vocab-steps`` steps each with the sub-vocabulary doubled until it is the
   whole vocabulary (2 pairs, 1 query);
3. ``pairs``: ``--steps`` steps on the whole vocabulary, every step one batch per size of
   ``--train-pairs`` (n pairs, max(1, n / 2) queries, ``--queries`` / queries sequences).

Evaluation (float64: the trained float32 weights cast, so that prompted and converted logits agree to
~1e-12 and no rounding can flip an argmax; linear models in the recurrent form, see ``evaluate``):
for each number of pairs of ``--pairs``, ``--eval-batch`` held-out sequences (the same for every
mixer) with ``--eval-queries`` queries right after the pairs; the accuracy over all queries with its
95 % Wilson interval (queries of one sequence share a prompt, so the interval is somewhat
optimistic). For each finite-state mixer, the pairs (the prompt) are converted (``iclca.convert``)
and the converted model reads only the queries: its predictions must be identical to the prompted
model's, and the script asserts it. Delta-rule against additive mixers
(delta - linear, gated_delta - gated) are compared on the same queries with a paired bootstrap
interval (``linicl.stats``). The optional in-context regression part of issue 16 is not run here.

The default budget (about 30 minutes on 2 busy CPU cores for all seven mixers) leaves every model
far from trained at 8 pairs and more (RESULTS.md); ``--steps`` (the pairs stage) is the knob for a
longer run. The numbers compare mixers under one small, equal budget, not their capacity at
convergence.

Each trained model is checkpointed in ``OUT/checkpoints/<mixer>.ckpt`` (``linicl.checkpoint``) with a
fingerprint of everything that shapes its training; a later run with the same settings loads it
instead of training (changing only the evaluation options never retrains).

Writes ``OUT/recall_capacity.json`` (settings, every accuracy, count, interval, training curve and
timing) and ``OUT/recall_capacity.png`` (accuracy against pairs, one line per mixer, converted as
markers; training loss); the table is printed first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linicl import checkpoint, iclca, reporting, stats
from linicl.compiled import enable_persistent_cache
from linicl.config import ModelConfig
from linicl.data.synthetic import TokenBatch, mqar_batch
from linicl.errors import LiniclError
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

# Sized for about 30 CPU-minutes (2 cores) for all seven mixers.
FULL = dict(vocab=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, lr=3e-3, circuit_steps=1200,
            circuit_batch=256, vocab_steps=300, steps=1000, train_pairs=[2, 4, 8, 16, 32], queries=128,
            chunk=50, pairs=[4, 8, 16, 32], eval_queries=4, eval_batch=256)
# Quick: one compiled training chunk serves both stages (the same sizes, vocabulary and length).
QUICK = dict(vocab=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, lr=3e-3, circuit_steps=2,
             circuit_batch=8, vocab_steps=2, steps=2, train_pairs=[2], queries=8, chunk=2,
             pairs=[2, 4], eval_queries=2, eval_batch=8)


class Stage(NamedTuple):
    """One phase of the curriculum: ``steps`` steps, tokens from a ``sub_vocab``-token part of the
    vocabulary, one batch per ``(n_pairs, n_queries, batch)`` of ``sizes`` in every step."""

    name: str
    steps: int
    sub_vocab: int
    sizes: tuple


# ---------------------------------------------------------------------------------------- setup
def options(quick: bool = False, **changes) -> dict:
    """The run's options: ``FULL`` (or ``QUICK``) with ``changes`` applied."""
    opts = dict(QUICK if quick else FULL, mixers=list(MIXERS), seed=0, quick=quick)
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


def init_params(opts: dict, mixer: str, key) -> dict:
    """Initial params; a gated model's gate bias is set so that alpha_h starts at the decayed model's
    gamma_h (see the module docstring)."""
    cfg = model_config(opts, mixer)
    params = jax.jit(Transformer(cfg).init)(key, jnp.zeros((1, 2), jnp.int32))["params"]
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
    for mixer in opts["mixers"]:
        if mixer not in MIXERS:
            raise LiniclError(f"--mixers: unknown mixer {mixer!r}; known: {', '.join(MIXERS)}")
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


def make_chunk(model: Transformer, opt, stage: Stage, vocab: int, length: int, quick: bool):
    """jit ``(params, opt_state, key, start) -> (params, opt_state, loss[length], acc[length, sizes])``:
    ``length`` steps of ``stage``; step s draws its batches from ``fold_in(key, s)``."""

    def loss_fn(params, key):
        losses, accs = [], []
        for i, (n, m, b) in enumerate(stage.sizes):
            drawn = mqar_batch(jax.random.fold_in(key, i), b, n, m, stage.sub_vocab)
            batch = widen(drawn, stage.sub_vocab, vocab)
            loss, acc = masked_metrics(model.apply({"params": params}, batch.inputs), batch)
            losses.append(loss)
            accs.append(acc)
        return jnp.mean(jnp.stack(losses)), jnp.stack(accs)

    def step(carry, s):
        params, opt_state, key = carry
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, jax.random.fold_in(key, s))
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), (loss, acc)

    def chunk(params, opt_state, key, start):
        steps = start + jnp.arange(length)
        (params, opt_state, _), (loss, acc) = jax.lax.scan(step, (params, opt_state, key), steps)
        return params, opt_state, loss, acc

    return jax.jit(chunk, compiler_options=FAST_COMPILE if quick else QUICK_COMPILE)


def train(opts: dict, mixer: str, bar=None) -> tuple:
    """Train one mixer through the curriculum; ``(params, history)``. ``history``: per chunk the
    stage, the last step, the mean loss, the mean accuracy per training size and the seconds since
    the start (compilation included)."""
    cfg = model_config(opts, mixer)
    model = Transformer(cfg)
    plan = stages(opts)
    opt = make_optimizer(opts, sum(s.steps for s in plan))
    root = jax.random.PRNGKey(opts["seed"])
    params = init_params(opts, mixer, jax.random.fold_in(root, 0))
    opt_state = opt.init(params)
    history, done, fns, t0 = [], 0, {}, time.perf_counter()
    for index, stage in enumerate(plan):
        key = jax.random.fold_in(jax.random.fold_in(root, 1), index)
        for start in range(0, stage.steps, opts["chunk"]):
            length = min(opts["chunk"], stage.steps - start)
            shape = (stage.sub_vocab, stage.sizes, length)  # stages of the same data share a compilation
            if shape not in fns:
                fns[shape] = make_chunk(model, opt, stage, opts["vocab"], length, opts["quick"])
            params, opt_state, loss, acc = fns[shape](params, opt_state, key, jnp.int32(start))
            done += length
            acc = np.asarray(acc).mean(0)
            history.append(dict(stage=stage.name, step=done, loss=float(np.mean(loss)),
                                acc={str(n): float(a) for (n, _, _), a in zip(stage.sizes, acc)},
                                seconds=time.perf_counter() - t0))
            if bar is not None:
                bar.update(length)
                bar.set_postfix_str(f"{mixer} {stage.name} loss {history[-1]['loss']:.3f}")
    return params, history


def settings(opts: dict, mixer: str) -> dict:
    """What shapes a trained model: the mixer, its config and the training options (not the
    evaluation's), with their fingerprint."""
    cfg = model_config(opts, mixer)
    kept = dict(trainer="experiments/recall_capacity.py", mixer=mixer,
                model={k: v for k, v in cfg.__dict__.items()},
                training={k: opts[k] for k in TRAINING}, stages=[s._asdict() for s in stages(opts)])
    kept = json.loads(json.dumps(kept))  # as the checkpoint stores it: tuples become lists
    return dict(kept, fingerprint=reporting.fingerprint(kept))


def trained(opts: dict, mixer: str, out: str, bar=None) -> tuple:
    """``(params, meta, reused)``: the checkpoint of the same settings, or a newly trained model
    (saved). A checkpoint made under other settings is trained again and replaced."""
    path = os.path.join(out, "checkpoints", f"{mixer}.ckpt")
    want = settings(opts, mixer)
    template = jax.eval_shape(lambda: init_params(opts, mixer, jax.random.PRNGKey(0)))
    if checkpoint.exists(path):
        if checkpoint.header(path).settings == want:
            tree, meta = checkpoint.load(path, {"params": template}, settings=want)
            if bar is not None:
                bar.update(sum(s.steps for s in stages(opts)))
            return jax.tree.map(jnp.asarray, tree["params"]), meta, True
        print(f"{path} was trained under other settings; training {mixer} again", file=sys.stderr)
    t0 = time.perf_counter()
    params, history = train(opts, mixer, bar)
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
    return 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * (2 * n_pairs)


def evaluate(opts: dict, mixer: str, params) -> list:
    """One row per number of pairs: counts, accuracies with intervals, prompted and converted; the
    per-query correctness is kept for the paired comparisons."""
    cfg = model_config(opts, mixer).replace(dtype="float64")
    if cfg.attention == "linear":
        # Every form computes the same model. The recurrent one here because with the parallel form
        # (also the chunked form's short tail) XLA CPU's YNNPACK reduce fusions returned an all-NaN
        # state in float64 at batch 256 for about 1 compilation in 5 (README, known issues).
        cfg = cfg.replace(form="recurrent")
    model = Transformer(cfg)
    # numpy for everything around the model: eager jnp calls would each compile
    variables = {"params": jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)}
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


# ---------------------------------------------------------------------------------------- report
def _fmt(iv: dict) -> str:
    return stats.Interval(iv["acc"], iv["low"], iv["high"]).fmt()


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


def figure(plt, report: dict):
    """Accuracy against pairs (lines: prompted, markers: converted), and the training loss."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (mixer, r) in enumerate(report["results"].items()):
        c = colors[i % len(colors)]
        n = [e["pairs"] for e in r["eval"]]
        acc = np.array([e["prompted"]["acc"] for e in r["eval"]])
        lo = acc - np.array([e["prompted"]["low"] for e in r["eval"]])
        hi = np.array([e["prompted"]["high"] for e in r["eval"]]) - acc
        a.errorbar(n, acc, yerr=[lo, hi], color=c, marker=".", capsize=3, label=f"{mixer} ({r['state']})")
        if all("converted" in e for e in r["eval"]):
            a.plot(n, [e["converted"]["acc"] for e in r["eval"]], "o", mfc="none", ms=11, color=c)
        h = r["history"]
        b.plot([x["step"] for x in h], [x["loss"] for x in h], color=c, label=mixer)
    a.plot([], [], "o", mfc="none", color="k", ms=11, label="converted prompt (same)")
    a.set_xscale("log", base=2)
    a.set(xlabel="key-value pairs in the prompt", ylabel="recall accuracy (95 % Wilson)", ylim=(-0.02, 1.02),
          title="MQAR recall")
    a.set_xticks(report["config"]["pairs"], [str(p) for p in report["config"]["pairs"]])
    a.minorticks_off()
    a.legend(fontsize=7)
    b.set(yscale="log", xlabel="training step", ylabel="training loss (query keys)", title="curriculum")
    for stage_end in np.cumsum([s["steps"] for s in report["config"]["stages"]])[:-1]:
        b.axvline(stage_end, color="grey", lw=0.6, ls=":")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def state_label(cfg: ModelConfig) -> str:
    return f"state {iclca.state_floats(cfg)}" if cfg.attention == "linear" else "KV cache"


def run(opts: dict, out: str, progress: bool = True) -> dict:
    """Train (or load) and evaluate every mixer; the report."""
    from tqdm.auto import tqdm

    total = len(opts["mixers"]) * sum(s.steps for s in stages(opts))
    results = {}
    with tqdm(total=total, desc="train", disable=not progress) as bar:
        for mixer in opts["mixers"]:
            params, meta, reused = trained(opts, mixer, out, bar)
            t0 = time.perf_counter()
            rows = evaluate(opts, mixer, params)
            cfg = model_config(opts, mixer)
            results[mixer] = dict(model=cfg.describe(), state=state_label(cfg), reused_checkpoint=reused,
                                  train_s=meta["train_s"], eval_s=time.perf_counter() - t0,
                                  history=meta["history"], eval=rows)
    return results


def print_summary(report: dict) -> None:
    cfg = report["config"]
    print(f"\nMQAR, vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
          f"{cfg['n_heads']} heads; {cfg['eval_batch']} sequences x {cfg['eval_queries']} queries per point")
    print(report["table"])
    for mixer, r in report["results"].items():
        how = "checkpoint reused" if r["reused_checkpoint"] else "trained"
        print(f"{mixer}: {r['model']}; {how} ({r['train_s']:.0f} s), evaluated in {r['eval_s']:.1f} s")


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/recall_capacity", seed="initialisation, data, evaluation",
                              quick="tiny models, a few steps of each stage (CI, under a minute)")
    parser.add_argument("--mixers", nargs="+", choices=list(MIXERS), default=None, help="default: all")
    listed = lambda xs: ",".join(map(str, xs))  # noqa: E731
    parser.add_argument("--pairs", type=positive_int_list, default=None,
                        help=f"evaluated numbers of pairs, comma-separated (default {listed(FULL['pairs'])})")
    parser.add_argument("--train-pairs", type=positive_int_list, default=None,
                        help=f"pair counts of the pairs stage (default {listed(FULL['train_pairs'])})")
    for name, kind in (("steps", positive_int), ("circuit_steps", positive_int), ("vocab_steps", positive_int),
                       ("vocab", positive_int), ("d_model", positive_int), ("n_layers", positive_int),
                       ("n_heads", positive_int), ("d_ff", positive_int), ("lr", positive_float),
                       ("circuit_batch", positive_int), ("queries", positive_int), ("chunk", positive_int),
                       ("eval_queries", positive_int), ("eval_batch", positive_int)):
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"default {FULL[name]} ({QUICK[name]} with --quick)")
    args = parser.parse_args(argv)
    changes = {k: getattr(args, k) for k in list(FULL) + ["mixers"] if getattr(args, k, None) is not None}
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
    results = run(opts, args.out, progress=args.progress)
    report = dict(config=dict(opts, stages=[s._asdict() for s in stages(opts)],
                              decays=list(decays(opts["n_heads"]))),
                  machine=reporting.machine_info(), results=results, comparisons=comparisons(results),
                  table=table(results), wall_s=time.perf_counter() - t0)
    report["table"] += ("\n\n" + comparison_table(report["comparisons"])) if report["comparisons"] else ""
    reporting.write_json(os.path.join(args.out, "recall_capacity.json"), report, indent=None)
    print_summary(report)
    png = reporting.plot(os.path.join(args.out, "recall_capacity.png"), figure, report)
    print(f"\nwrote {args.out}/recall_capacity.json" + (" and recall_capacity.png" if png else "")
          + f" ({report['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
