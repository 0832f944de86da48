"""The PyTorch reference of a speed benchmark: HF ``transformers`` causal LMs run under
``torch.inference_mode()``, in this process or in a worker process of another interpreter.

This file imports neither jax nor linicl (nor torch until a ``TorchSide`` is made), so that an
interpreter that has only torch, transformers and NumPy can run it as a script
(``python .../torch_reference.py``): it then serves ``TorchSide`` calls, one JSON request and one
JSON reply per line on stdin/stdout (``serve``). ``open_torch`` picks the side a benchmark talks to.

Every ``TorchSide`` method takes and returns plain JSON values (arrays travel as ``.npy`` files), so
that the same calls work in process and through ``TorchWorker``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

import numpy as np


def random_tokens(seed: int, batch: int, seq: int, vocab: int) -> np.ndarray:
    """``int32[batch, seq]`` token ids uniform in [0, vocab), drawn by NumPy's generator (not a
    framework's), so that both sides of a comparison read the same ids."""
    for name, value in (("batch", batch), ("seq", seq), ("vocab", vocab)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"random_tokens: {name} must be a positive int, got {value!r}")
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int64).astype(np.int32)


class TorchSide:
    """The PyTorch half of a benchmark: HF transformers models by name, run under ``inference_mode``
    with ``torch.set_num_threads(cores)``. Raises ImportError when torch or transformers is missing."""

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
        """``self.method(*args, **kwargs)``: the interface ``TorchWorker`` shares."""
        return getattr(self, method)(*args, **kwargs)

    def close(self):
        """Forget every model (frees their memory before the next part of a benchmark)."""
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
        """A float32 causal LM from an HF directory (e.g. the weights ``linicl.lm.save_pretrained`` wrote)."""
        t0 = time.perf_counter()
        model = self.transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=self.torch.float32).eval()
        self.models[name] = model
        return dict(load_s=time.perf_counter() - t0, n_params=sum(p.numel() for p in model.parameters()),
                    attn_implementation=model.config._attn_implementation, model_class=type(model).__name__)

    def logits(self, name: str, tokens_path: str, out_path: str) -> str:
        """The model's ``f32[batch, seq, vocab]`` logits on the ids saved at ``tokens_path``, saved to
        ``out_path`` (returned)."""
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
        """Median seconds of a forward pass on ``random_tokens(seed, batch, seq, vocab)``, after one
        warm-up call (timed separately: for ``torch.compile`` it includes the compilation).
        ``threads`` > 0 overrides the intra-op thread count for this measurement."""
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
        """Greedy decoding with transformers' KV cache (``DynamicCache``): the prefill of
        ``random_tokens(seed, batch, prompt, vocab)``, then ``new`` single-token steps, each timed;
        ``step_s`` is the median step (the first excluded)."""
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
    """``TorchSide`` in a worker process of another interpreter ``python`` (this file run as a
    script): the same ``call`` / ``close`` interface. A failed call raises RuntimeError."""

    def __init__(self, python: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__)], env=env,
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


def serve() -> int:
    """Serve ``TorchSide`` calls on stdin/stdout until ``quit``. Library output is sent to stderr,
    so that stdout carries only the replies; an exception is replied, not raised."""
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


def open_torch(python: Optional[str] = None, disabled: bool = False) -> tuple:
    """``(side, how)``: a ``TorchSide`` in this process when torch and transformers import here, else a
    ``TorchWorker`` running ``python``, else ``side`` None; ``how`` says which (or why none)."""
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


if __name__ == "__main__":  # the worker of ``TorchWorker``, in an interpreter that may lack jax and linicl
    sys.exit(serve())
