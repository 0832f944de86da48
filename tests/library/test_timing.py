"""linicl.timing: the matmul peer does the forward's products (the same FLOP count, as XLA counts it),
and the compile meter splits a first call from a second one that compiles nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import linicl
from linicl.timing import CompileMeter, first_and_second_call, forward_flops, matmul_peer


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_matmul_peer_does_the_forwards_products(name):
    kv = None if name == "tiny-gpt2" else 2  # grouped keys and values on the gated (Llama) MLP
    cfg = linicl.preset(name, d_model=64, n_heads=4, n_kv_heads=kv, d_ff=128, vocab_size=96, n_layers=2)
    fn, weights, x, flops = matmul_peer(cfg, 2, 8, seed=0)
    assert flops == forward_flops(cfg, 2, 8)
    assert x.shape == (16, 64) and x.dtype == jnp.float32
    out = fn(weights, x)
    assert out.shape == (16, 96) and bool(jnp.all(jnp.isfinite(out)))
    cost = fn.lower(weights, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert 1.0 <= cost["flops"] / flops <= 1.03  # the scores' scaling is the only other arithmetic


def test_matmul_peer_is_drawn_from_its_seed():
    cfg = linicl.preset("tiny-llama")
    _, w0, x0, _ = matmul_peer(cfg, 1, 4, seed=3)
    _, w1, x1, _ = matmul_peer(cfg, 1, 4, seed=3)
    assert bool(jnp.array_equal(x0, x1)) and bool(jnp.array_equal(w0["unembed"], w1["unembed"]))


@pytest.mark.parametrize("bad", [dict(batch=0), dict(seq=-1), dict(batch=2.0)])
def test_matmul_peer_refuses_bad_shapes(bad):
    with pytest.raises(ValueError, match="must be a positive int"):
        matmul_peer(linicl.preset("tiny-llama"), **{**dict(batch=1, seq=4), **bad})


def test_the_compile_meter_splits_the_first_call_from_the_second():
    meter = CompileMeter()
    fn = jax.jit(lambda a: jnp.sin(a) * 3.0 + a @ a.T)  # a new function: its first call compiles
    x = jnp.ones((5, 5))
    row = first_and_second_call(meter, lambda: fn(x))
    assert set(row) == {"first_call_s", "trace_s", "lower_s", "backend_s", "compile_s", "programs", "cache_hits",
                        "cache_misses", "run_s"}
    assert row["programs"] == 1
    assert row["trace_s"] > 0 and row["compile_s"] == pytest.approx(row["trace_s"] + row["lower_s"] + row["backend_s"])
    assert row["first_call_s"] >= row["compile_s"] and row["run_s"] >= 0
    meter.start()
    jax.block_until_ready(fn(x))  # compiled already: nothing is counted
    assert meter.read()["compile_s"] == 0 and meter.read()["cache_misses"] == 0 and meter.read()["programs"] == 0
    assert meter.programs_by_name() == {} and meter.backend_s_by_name() == {}


def test_the_compile_meter_names_the_programs_it_counts():
    """A jitted function's program carries its name; an eager operation builds one per primitive and
    shape (what makes an eager forward over many shapes slow to start)."""
    jax.clear_caches()  # eager operations this process ran before would not compile again
    meter = CompileMeter()

    def twice_sin(a):
        return 2.0 * jnp.sin(a)
    jax.block_until_ready(jax.jit(twice_sin)(jnp.ones(7)))
    jax.block_until_ready(jnp.cos(jnp.ones(9)) + jnp.ones(9))  # eager: cos and add, once each
    jax.block_until_ready(jnp.cos(jnp.ones(9)) + jnp.ones(9))  # the same shapes: nothing new
    names = meter.programs_by_name()
    assert names.get("jit(twice_sin)") == 1 and names.get("jit(cos)") == 1 and names.get("jit(add)") == 1
    assert sum(names.values()) == meter.read()["programs"]
    seconds = meter.backend_s_by_name()
    assert set(seconds) == set(names) and sum(seconds.values()) == pytest.approx(meter.read()["backend_s"])


def test_first_and_second_call_refuses_a_non_callable():
    with pytest.raises(ValueError, match="fn must be a callable"):
        first_and_second_call(CompileMeter(), 3)
