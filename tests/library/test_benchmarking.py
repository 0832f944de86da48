"""linicl.benchmarking: the side-by-side measurements, with a stand-in for the PyTorch side (no torch
here), the worker file's independence from jax and linicl, the random GPT-2 checkpoint, and the
compile-time rows and ratios. No timing is asserted, only the structure and the arithmetic."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import linicl
from linicl import benchmarking as B
from linicl.benchmarking import torch_reference
from linicl.timing import CompileMeter, forward_flops

from helpers import FIXTURES

TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def _tiny(name="tiny-llama", **kw):
    cfg = linicl.preset(name, dtype="float32", max_len=32, **kw)
    model = linicl.Transformer(cfg)
    return model, model.init(jax.random.PRNGKey(0), np.zeros((1, 2), np.int32))


class FakeSide:
    """Stands in for ``TorchSide``: canned timings, logits from the linicl model itself, and a variant
    (``threads=99``) whose timing fails as a broken ``torch.compile`` would."""

    def __init__(self, model=None, variables=None):
        self.model, self.variables, self.calls = model, variables, []

    def call(self, method, *args, **kwargs):
        self.calls.append((method, args, kwargs))
        if method == "time_forward":
            if kwargs.get("threads") == 99:
                raise RuntimeError("no C++ compiler")
            return dict(seconds=0.5, first_call_s=1.0, samples=[0.5])
        if method == "time_decode":
            return dict(prefill_s=0.2, step_s=0.25, steps=[0.3, 0.25])
        if method == "compile":
            return dict(backend="inductor")
        if method == "logits":
            tokens = np.load(args[1])
            np.save(args[2], np.asarray(self.model.apply(self.variables, tokens), np.float32))
            return args[2]
        raise AssertionError(method)


def test_random_tokens_are_the_same_ids_on_both_sides():
    a = B.random_tokens(3, 2, 5, 11)
    assert a.dtype == np.int32 and a.shape == (2, 5) and 0 <= a.min() and a.max() < 11
    assert np.array_equal(a, B.random_tokens(3, 2, 5, 11)) and not np.array_equal(a, B.random_tokens(4, 2, 5, 11))
    with pytest.raises(ValueError, match="vocab must be a positive int"):
        B.random_tokens(0, 1, 1, 0)


def test_the_worker_file_imports_neither_jax_nor_linicl():
    code = ("import runpy, sys; sys.modules['jax'] = sys.modules['linicl'] = None; "
            f"ns = runpy.run_path({str(Path(torch_reference.__file__))!r}, run_name='worker_check'); "
            "print(ns['random_tokens'](0, 1, 3, 7).tolist())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(B.random_tokens(0, 1, 3, 7).tolist())


def test_open_torch_says_why_there_is_no_side():
    assert B.open_torch(None, disabled=True) == (None, "skipped: --no-torch")
    if TORCH:
        pytest.skip("torch is importable here: open_torch makes an in-process side")
    side, how = B.open_torch(None)
    assert side is None and how.startswith("skipped: PyTorch is not importable here")
    side, how = B.open_torch(sys.executable)  # the worker starts, then fails without torch
    assert side is None and how.startswith(f"skipped: the PyTorch worker {sys.executable} failed")


_FAKE_TORCH = """
__version__ = "0-fake"
float32 = "float32"
_threads = [1]


def set_num_threads(n):
    _threads[0] = n


def get_num_threads():
    return _threads[0]


def get_num_interop_threads():
    return 1


class backends:
    class mkldnn:
        is_available = staticmethod(lambda: False)
"""
_FAKE_TRANSFORMERS = """
__version__ = "0-fake"


class logging:
    disable_progress_bar = staticmethod(lambda: None)
"""


@pytest.mark.skipif(TORCH, reason="torch is importable here: open_torch would not start a worker")
def test_the_worker_process_serves_calls_and_replies_errors(tmp_path, monkeypatch):
    """The worker protocol end to end, with stand-ins for torch and transformers on the worker's path."""
    (tmp_path / "torch.py").write_text(_FAKE_TORCH)
    (tmp_path / "transformers.py").write_text(_FAKE_TRANSFORMERS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    side, how = B.open_torch(sys.executable)
    assert how == f"worker process: {sys.executable}" and isinstance(side, B.TorchWorker)
    try:
        info = side.call("info")
        assert info["torch"] == info["transformers"] == "0-fake" and info["pid"] != os.getpid()
        with pytest.raises(RuntimeError, match="PyTorch worker: AttributeError: .* 'no_such_method'"):
            side.call("no_such_method", 1, key=2)
        assert side.call("close") is None  # the worker goes on after a failed call
    finally:
        side.close()
    assert side.proc.poll() == 0


def test_torch_variants_by_threads_and_compile():
    assert B.torch_variants(None, "m", [2]) == {}
    v = B.torch_variants(FakeSide(), "m", [4, 1], compile=True)
    assert v == {"eager": dict(compiled=False, threads=4), "eager_t1": dict(compiled=False, threads=1),
                 "compiled": dict(compiled=True, threads=4)}
    assert B.variant_status({"eager": dict(threads=4), "compiled": "failed: x"}) == {
        "eager": dict(threads=4, status="ok"), "compiled": "failed: x"}
    with pytest.raises(ValueError, match="threads must be positive"):
        B.torch_variants(FakeSide(), "m", [0])


def test_timed_rounds_without_a_torch_side():
    model, variables = _tiny()
    rows = B.timed_rounds(model, variables, [(1, 4), (2, 3)], rounds=2, repeats=1, progress=False)
    assert [(r["batch"], r["seq"], r["tokens"]) for r in rows] == [(1, 4, 4), (2, 3, 6)]
    for r in rows:
        assert r["matmul_flops"] == forward_flops(model.cfg, r["batch"], r["seq"]) and len(r["rounds"]) == 2
        assert all(r[k] > 0 for k in ("jax_s", "jax_last_s", "matmul_s", "jax_tokens_per_s", "jax_over_matmul",
                                      "last_over_full"))
        assert not any(k.startswith("torch_") for k in r)
    with pytest.raises(ValueError, match="positive"):
        B.timed_rounds(model, variables, [(1, 0)])


def test_timed_rounds_alternates_with_each_variant_and_drops_a_failed_one():
    model, variables = _tiny()
    side = FakeSide()
    variants = B.torch_variants(side, "m", [2, 99])
    (row,) = B.timed_rounds(model, variables, [(1, 4)], seed=5, rounds=2, repeats=1, side=side, name="m",
                            variants=variants, progress=False)
    assert variants["eager_t99"] == "failed: no C++ compiler" and variants["eager"]["threads"] == 2
    timed = [c for c in side.calls if c[0] == "time_forward"]
    assert timed[0] == ("time_forward", ("m", 1, 4, model.cfg.vocab_size, 5, 1), dict(compiled=False, threads=2))
    assert len([c for c in timed if c[2]["threads"] == 2]) == 2  # one call per round
    assert row["torch_eager_s"] == 0.5 and row["torch_eager_tokens_per_s"] == 8.0
    assert row["jax_over_torch_eager"] == pytest.approx(row["jax_tokens_per_s"] / 8.0)
    assert B.variant_columns([row]) == ["eager"] and "torch_eager_t99_s" not in row


def test_summarise_rounds_takes_medians_and_paired_ratios():
    rounds = [dict(jax_s=1.0, jax_last_s=0.5, matmul_s=0.5, torch_eager_s=2.0),
              dict(jax_s=2.0, jax_last_s=1.0, matmul_s=1.0, torch_eager_s=3.0),
              dict(jax_s=4.0, jax_last_s=1.0, matmul_s=3.0)]
    row = dict(tokens=8, matmul_flops=4e9, rounds=rounds)
    B.summarise_rounds(row, ["eager"])
    assert (row["jax_s"], row["jax_last_s"], row["matmul_s"]) == (2.0, 1.0, 1.0)
    assert row["jax_tokens_per_s"] == 4.0 and row["matmul_gflops"] == 4.0
    assert row["jax_over_matmul"] == 0.5 and row["last_over_full"] == 2.0
    assert row["torch_eager_s"] == 2.5 and row["torch_eager_tokens_per_s"] == 8 / 2.5
    assert row["jax_over_torch_eager"] == pytest.approx(4.0 / (8 / 2.5))
    assert row["jax_over_torch_eager_paired"] == 1.75  # median of 2/1 and 3/2
    with pytest.raises(ValueError, match="no rounds"):
        B.summarise_rounds(dict(tokens=1, rounds=[]))


def test_variant_columns_order_and_the_table_and_figure(tmp_path):
    rows = [dict(batch=1, seq=4, jax_tokens_per_s=100.0, jax_over_matmul=0.5, matmul_gflops=1.0, last_over_full=2.0,
                 **{f"torch_{v}_tokens_per_s": 50.0 for v in ("compiled", "eager_t1", "eager")},
                 **{f"jax_over_torch_{v}": 2.0 for v in ("compiled", "eager_t1", "eager")})]
    assert B.variant_columns(rows) == ["eager", "eager_t1", "compiled"]
    table = B.format_rounds("m", rows)
    assert table.splitlines()[0].split()[:4] == ["m", "b", "x", "T"] and "2.00x" in table
    assert "forward at 50 % of its matmul peer's rate" in table
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    B.plot_rounds(ax, rows, "m", decode=dict(batch=1, step_tokens_per_s=10.0))
    assert len(ax.patches) == 4 * 2 and ax.get_title() == "m"  # 4 series x (1 shape + the decode step)
    plt.close(fig)


def test_compare_logits_and_the_torch_twin(tmp_path):
    model, variables = _tiny()
    side = FakeSide(model, variables)
    check = B.random_tokens(0, 2, 5, model.cfg.vocab_size)
    c = B.compare_logits(side, "m", model, variables, check, tmp_path)
    assert c["shape"] == [2, 5] and c["max_rel_err"] < 1e-5 and c["argmax_agreement"] == 1.0  # jit or not

    class Loads(FakeSide):
        def call(self, method, *args, **kwargs):
            if method == "load":
                assert (Path(args[1]) / "config.json").is_file()  # save_pretrained wrote the checkpoint
                return dict(model_class="LlamaForCausalLM", load_s=0.1)
            return super().call(method, *args, **kwargs)
    variants, fields = B.torch_twin(Loads(model, variables), "m", model, variables, check, tmp_path, [2])
    assert variants == {"eager": dict(compiled=False, threads=2)}
    assert fields["torch_checkpoint"]["model_class"] == "LlamaForCausalLM"
    assert fields["logits_check"]["max_rel_err"] < 1e-5

    class Fails(FakeSide):
        def call(self, method, *args, **kwargs):
            raise RuntimeError("no such class")
    assert B.torch_twin(Fails(), "m", model, variables, check, tmp_path, [2]) == (
        {}, dict(torch_checkpoint="failed: no such class"))


def test_decode_speed_and_its_torch_peer():
    model, variables = _tiny()
    out = B.decode_speed(model, variables, batch=2, prompt=3, new=2, repeats=1, generate=False)
    assert (out["batch"], out["prompt"], out["new"], out["max_len"]) == (2, 3, 2, 32)
    assert out["step_tokens_per_s"] == pytest.approx(2 / out["step_s"]) and "generate_s" not in out
    out = B.decode_speed(model, variables, batch=1, prompt=3, new=2, repeats=1)
    assert out["generate_tokens_per_s"] == pytest.approx(2 / out["generate_s"])
    side = FakeSide()
    variants = {"eager": dict(compiled=False, threads=2), "compiled": dict(compiled=True, threads=2), "x": "failed"}
    t = B.torch_decode_speed(side, "m", variants, batch=2, prompt=3, new=2, vocab=7, seed=1, jax_step_s=0.5)
    assert t == {"torch_eager_prefill_s": 0.2, "torch_eager_step_s": 0.25, "torch_eager_steps": [0.3, 0.25],
                 "torch_eager_step_tokens_per_s": 8.0, "jax_over_torch_eager_step": 0.5}
    assert side.calls == [("time_decode", ("m", 2, 3, 2, 7, 1), dict(threads=2))]


def test_fresh_process_load_times(monkeypatch):
    with pytest.raises(ValueError, match="loader must be one of"):
        B.fresh_process_load_times("gpt5")
    monkeypatch.setenv("LINICL_SMOLLM2_GGUF", str(FIXTURES / "llama-tiny.gguf"))
    out = B.fresh_process_load_times("smollm2", n=1, max_len=16)
    assert len(out["runs"]) == 1 and out["load_s_median"] == out["runs"][0]["load_s"] > 0
    assert out["process_s_median"] > out["import_s_median"] > 0


def test_write_random_gpt2_loads_in_linicl(tmp_path):
    info = B.write_random_gpt2(tmp_path / "g", B.GPT2_TINY, seed=1)
    model, variables, _ = linicl.lm.from_pretrained(tmp_path / "g", dtype="float32")
    n = sum(np.size(a) for a in jax.tree_util.tree_leaves(variables["params"]))
    assert info == dict(n_params=n, source="numpy (no PyTorch)")
    assert model.cfg.n_layers == 2 and model.cfg.d_model == 64 and model.cfg.vocab_size == 1000
    logits = model.apply(variables, B.random_tokens(0, 1, 6, 1000))
    assert logits.shape == (1, 6, 1000) and bool(np.all(np.isfinite(logits)))
    with pytest.raises(ValueError, match="n_head"):
        B.write_random_gpt2(tmp_path / "bad", dict(B.GPT2_TINY, n_head=0))


def test_compile_times_rows():
    model, variables = B.tiny_softmax_lm()
    assert model.cfg.attention == "softmax" and model.cfg.max_len == 256
    assert B.counting_prompt(4).tolist() == [[1, 8, 15, 22]]
    meter = CompileMeter()
    rows = B.forward_compile_times(meter, model, variables, [3, 5])
    assert [r["prompt_len"] for r in rows] == [3, 5] and all(r["compile_s"] > 0 for r in rows)
    (row,) = B.generate_compile_times(meter, model, variables, [4], new=2)
    assert row["prompt_len"] == 4 and row["new"] == 2 and row["first_call_s"] >= row["compile_s"]
    with pytest.raises(ValueError, match="lengths"):
        B.forward_compile_times(meter, model, variables, [])
    with pytest.raises(ValueError, match="new must be"):
        B.generate_compile_times(meter, model, variables, [3], new=0)


def test_warm_over_cold():
    end_to_end = B.warm_over_cold(dict(total_s=10.0, compile_s=8.0), dict(total_s=4.0, compile_s=2.0))
    assert end_to_end == dict(total=0.4, compile=0.25)
    call = lambda first, compile_s: dict(prompt_len=7, first_call_s=first, compile_s=compile_s)  # noqa: E731
    r = B.warm_over_cold(dict(process_wall_s=8.0, calls=[call(2.0, 0.0)]),
                         dict(process_wall_s=4.0, calls=[call(1.0, 0.0)]))
    assert r["process"] == 0.5 and r["calls"][0]["first_call"] == 0.5 and math.isnan(r["calls"][0]["compile"])
    with pytest.raises(ValueError, match="cold calls"):
        B.warm_over_cold(dict(process_wall_s=1.0, calls=[]), dict(process_wall_s=1.0, calls=[call(1.0, 1.0)]))
