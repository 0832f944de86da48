"""Sharded parameters (linicl.parallel) on 8 host devices, meshes 8x1, 4x2, 2x4 and 1x8 ("data" x "model"):
every parameter laid out as ``param_spec`` says and actually split, per-device parameter bytes about the
total over the devices, and forward passes, evaluation and training steps (attention transfer, stage-2
LoRA, the ICR router) equal to one device. XLA_FLAGS must be set before jax is imported, so the 8-device
checks run in a subprocess; the rules themselves are checked here on abstract meshes."""

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from linicl import parallel
from linicl.errors import LiniclError
from helpers import REPO, host_devices_env

# One worker runs this module: its 8-device subprocess (``eight``, ~70 s) is then made once, not once per
# xdist worker (``make test`` distributes with --dist loadgroup; pytest 9.2 broke the groups, which
# tests/library/test_xdist_groups.py now guards).
pytestmark = pytest.mark.xdist_group("sharding")

MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))

SCRIPT = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_disable_most_optimizations", True)
    import jax.numpy as jnp
    import numpy as np
    import linicl
    from linicl import linearize as LZ, parallel, routing as R
    from linicl.data import Example, Task
    from linicl.evaluate import evaluate
    from linicl.metrics import rel_err

    MESHES = %s
    out = dict(devices=jax.device_count(), meshes={})
    # heads, kv heads, d_ff and vocabulary divisible by every model-axis size (up to 8)
    cfg = linicl.preset("tiny-llama", d_model=64, n_heads=8, n_kv_heads=8, d_ff=128, vocab_size=256, max_len=64,
                        dtype="float64")
    teacher = linicl.Transformer(cfg)
    tv = teacher.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 12)))
    ref = teacher.apply(tv, toks)
    one = parallel.make_mesh(1, jax.devices()[:1])
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(t)])
    err = lambda a, b: rel_err(flat(a), flat(b))

    student = linicl.Transformer(LZ.student_config(cfg, window=4, sinks=1))
    sv = LZ.student_variables(student, tv)
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (16, 20), 0, cfg.vocab_size))
    common = dict(steps=2, batch_size=8, progress=False, lr=1e-2)
    s1, _ = LZ.train_maps(teacher, tv, student, sv, seqs, mesh=one, **common)
    _, c1, _ = LZ.train_lora(teacher, tv, student, s1, seqs, mesh=one, rank=2, **common)

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, rng.integers(5, 12)).astype(np.int32) for _ in range(16)]
    pids = R.extract_pids(teacher, tv, prompts, r=2)
    data = R.prepare(teacher, tv, prompts, rng.integers(0, cfg.vocab_size, 16).astype(np.int32), pids)
    rkw = dict(epochs=1, batch_size=8, lr=1e-2, progress=False, seed=0)
    _, r1, _ = R.train_router(teacher, tv, pids, data, mesh=one, **rkw)

    words = [("hot", "cold"), ("big", "small"), ("up", "down"), ("dog", "cat"), ("sat", "on"), ("the", "a")]
    class Tok:  # a character tokenizer inside the vocabulary
        adds_bos = False
        def encode(self, text): return [ord(c) %% 200 + 1 for c in text]
        def decode(self, ids): return "".join(chr(i - 1) for i in ids)
    task = Task("fx", tuple(Example(a, b) for a, b in words), tuple(Example(b, a) for a, b in words), None)
    e1 = evaluate(teacher, tv, Tok(), task, k=1, n_eval=6, batch_size=4, mesh=one, progress=False,
                  open_metric="first_content_token")

    for shape in MESHES:
        mesh = parallel.make_mesh(shape[1])
        placed = parallel.place(tv, mesh)
        specs, split, total = {}, {}, 0
        for path, x in jax.tree_util.tree_leaves_with_path(placed):
            name = parallel._path(path)
            specs[name] = [list(x.sharding.spec), list(parallel.param_spec(name, x.shape, mesh))]
            split[name] = len({str(i) for i in x.sharding.devices_indices_map(x.shape).values()})
            total += x.nbytes
        per_device = parallel.device_bytes(placed)
        fwd = jax.jit(teacher.apply)(placed, parallel.shard_batch(toks, mesh))
        s, _ = LZ.train_maps(teacher, tv, student, sv, seqs, mesh=mesh, **common)
        trained = LZ.split(s["params"])[0]
        _, c, _ = LZ.train_lora(teacher, tv, student, s1, seqs, mesh=mesh, rank=2, **common)
        _, r, _ = R.train_router(teacher, tv, pids, data, mesh=mesh, **rkw)
        e = evaluate(teacher, tv, Tok(), task, k=1, n_eval=6, batch_size=4, mesh=mesh, progress=False,
                     open_metric="first_content_token")
        state = parallel.place({"prompt_state": {"layers_0": {"attn": {"S": jnp.zeros((1, 8, 16, 16))}}}}, mesh)
        out["meshes"]["x".join(map(str, shape))] = dict(
            mesh=dict(mesh.shape), specs=specs, split=split, total_bytes=total, per_device=per_device,
            forward_err=rel_err(fwd, ref), maps_err=err(s["params"], s1["params"]), lora_err=err(c, c1),
            router_err=err(r, r1), eval_err=rel_err(e.gold_logprob, e1.gold_logprob),
            maps_spec=[[list(x.sharding.spec), list(parallel.param_spec("params/" + parallel._path(p), x.shape, mesh))]
                       for p, x in jax.tree_util.tree_leaves_with_path(trained)],
            state_spec=list(jax.tree_util.tree_leaves(state)[0].sharding.spec))
    out["maps_moved"] = err(LZ.split(s1["params"])[0], LZ.split(sv["params"])[0])
    out["router_moved"] = err(r1, R.make_router(teacher, pids, seed=0)[1])
    print("RESULT " + json.dumps(out))
""" % (MESHES,))


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    script = tmp_path_factory.mktemp("sharding") / "shard8.py"
    script.write_text(SCRIPT)
    env = host_devices_env(8)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=str(REPO),
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_every_parameter_is_laid_out_by_the_rules_and_split(eight):
    assert eight["devices"] == 8
    for name, m in eight["meshes"].items():
        for path, (actual, wanted) in m["specs"].items():
            pad = lambda s: s + [None] * (4 - len(s))  # noqa: E731  (trailing None is the same layout)
            assert pad(actual) == pad(wanted), (name, path)
        # the large parameters are really split: kernels over both axes where they divide
        assert m["split"]["params/layers_0/attn/q/kernel"] == 8, name
        assert m["split"]["params/layers_0/mlp/fc_out/kernel"] == 8, name
        assert m["split"]["params/layers_0/ln1/scale"] == 1, name  # small: whole on every device
        assert m["state_spec"][:2] == [None, "model" if m["mesh"]["model"] > 1 else None], name
    assert eight["meshes"]["4x2"]["specs"]["params/layers_0/attn/q/kernel"][1] == ["data", "model"]
    assert eight["meshes"]["4x2"]["specs"]["params/layers_0/attn/o/kernel"][1] == ["model", None, "data"]


def test_per_device_parameter_bytes_are_the_total_over_the_devices(eight):
    """FSDP (8x1) and every mixed mesh: each device holds about 1/8 of the parameters (the norm scales,
    under MIN_SHARDED_SIZE, are whole on each: 2 % of this model's bytes)."""
    for name, m in eight["meshes"].items():
        per = list(m["per_device"].values())
        assert len(per) == 8 and max(per) <= 1.2 * m["total_bytes"] / 8, (name, max(per), m["total_bytes"])


def test_sharded_runs_equal_one_device(eight):
    """Forward and evaluation: the same float64 numbers up to the order of sums (measured <= 2e-15).
    Training: Adam divides each gradient entry by its own size, so sums reordered by the layout (split
    batches, and on a "model" axis split contractions) become relative differences in small entries:
    measured 4e-16 to 2e-8 (maps) and 6e-8 to 1.1e-6 (LoRA, whose B starts at zero) after two steps;
    1e-5 bounds that, where a step applied wrongly would differ by its whole size (maps_moved ~1e-2).
    The router computes in float32 (``router_input`` casts): 1.6e-6 to 3.2e-5 measured; 1e-4 bounds it,
    against router_moved ~1e-2."""
    assert eight["maps_moved"] > 1e-3 and eight["router_moved"] > 1e-3
    for name, m in eight["meshes"].items():
        assert m["forward_err"] <= 1e-12 and m["eval_err"] <= 1e-12, name
        assert m["maps_err"] <= 1e-5 and m["lora_err"] <= 1e-5 and m["router_err"] <= 1e-4, (name, m)
        for actual, wanted in m["maps_spec"]:  # the trained maps keep their layout through the steps
            assert actual + [None] * (len(wanted) - len(actual)) == wanted + [None] * (len(actual) - len(wanted))


def _abstract_mesh(data, model):
    devices = np.asarray(jax.devices() * (data * model), dtype=object)[:data * model].reshape(data, model)
    return jax.sharding.Mesh(devices, ("data", "model"))


def test_the_rules_split_heads_columns_and_vocabulary():
    mesh = _abstract_mesh(2, 4)
    spec = parallel.param_spec
    assert spec("params/layers_3/attn/q/kernel", (576, 8, 64), mesh) == P("data", "model")
    assert spec("params/layers_3/attn/k/kernel", (576, 3, 64), mesh) == P("data")  # 3 kv heads: not over 4
    assert spec("params/layers_3/attn/o/kernel", (8, 64, 576), mesh) == P("model", None, "data")
    assert spec("params/layers_3/mlp/fc_in/kernel", (576, 1536), mesh) == P("data", "model")
    assert spec("params/layers_3/mlp/fc_out/kernel", (1536, 576), mesh) == P("model", "data")
    assert spec("params/embed", (49152, 576), mesh) == P("model", "data")
    assert spec("0/params/embed", (49152, 576), mesh) == P("model", "data")  # inside a tuple of trees
    assert spec("params/pos_embed", (2048, 576), mesh) == P("data")  # no rule: FSDP alone
    assert spec("params/layers_3/ln1/scale", (576,), mesh) == P()  # small
    assert spec("prompt_state/layers_0/attn/S", (1, 8, 64, 64), mesh) == P(None, "model", "data")
    # the short convolution's taps [K, heads, d_head] and its state [batch, K - 1, heads, d_head]: by head
    assert spec("params/layers_3/attn/conv_q", (4, 8, 64), mesh) == P(None, "model", "data")
    assert spec("prompt_state/layers_0/attn/conv_q", (1, 3, 8, 64), mesh) == P(None, None, "model", "data")
    data_only = jax.sharding.Mesh(np.asarray(jax.devices()[:1], dtype=object), ("data",))
    assert spec("params/embed", (49152, 576), data_only) == P()  # data parallel: replicated
    with pytest.raises(LiniclError, match="model must be an int >= 1 dividing"):
        parallel.make_mesh(model=3, devices=jax.devices() * 4)
