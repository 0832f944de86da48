"""Attention transfer and stage 2 data parallel on 4 host devices (linicl.parallel): the batch really is
split, and the trained maps and correction equal a one-device run's. XLA_FLAGS must be set before jax
is imported, so the 4-device run is a subprocess."""

import json
import subprocess
import sys
import textwrap

from helpers import REPO, host_devices_env

SCRIPT = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import linicl
    from linicl import linearize as LZ
    from linicl.metrics import rel_err
    from linicl.parallel import device_mesh

    cfg = linicl.preset("tiny-llama", max_len=64, dtype="float64")
    teacher = linicl.Transformer(cfg)
    tv = teacher.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    student = linicl.Transformer(LZ.student_config(cfg, window=4, sinks=1))
    sv = LZ.student_variables(student, tv)
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (16, 20), 0, cfg.vocab_size))
    four, one = device_mesh(), device_mesh(jax.devices()[:1])
    common = dict(steps=3, batch_size=8, progress=False)
    s4, _ = LZ.train_maps(teacher, tv, student, sv, seqs, mesh=four, lr=1e-2, **common)
    s1, _ = LZ.train_maps(teacher, tv, student, sv, seqs, mesh=one, lr=1e-2, **common)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
    err = lambda a, b: rel_err(flat(a), flat(b))  # over all leaves at once (some start at zero)
    moved = err(LZ.split(s1["params"])[0], LZ.split(sv["params"])[0])
    l4, c4, _ = LZ.train_lora(teacher, tv, student, s1, seqs, mesh=four, rank=2, lr=1e-2, **common)
    l1, c1, _ = LZ.train_lora(teacher, tv, student, s1, seqs, mesh=one, rank=2, lr=1e-2, **common)
    B_moved = max(float(np.abs(np.asarray(x)).max()) for p, x in jax.tree_util.tree_flatten_with_path(c1)[0]
                  if p[-1].key == "B")
    print("RESULT " + json.dumps(dict(devices=jax.device_count(), maps_err=err(s4["params"], s1["params"]),
                                      maps_moved=moved, lora_err=err(c4, c1), B_moved=B_moved)))
""")


def test_training_on_four_devices_equals_one_device(tmp_path):
    script = tmp_path / "train4.py"
    script.write_text(SCRIPT)
    env = host_devices_env(4)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=str(REPO),
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["devices"] == 4
    # Power: training moved the maps and the correction by O(lr) relative.
    assert out["maps_moved"] > 1e-3 and out["B_moved"] > 1e-4
    # Each device sums its own rows of the loss, so the float64 gradient sums are ordered differently
    # than on one device (~1e-16 relative per sum, more where a gradient entry is a cancellation of
    # larger per-row terms), and Adam divides every entry by its own magnitude, so small entries carry
    # that difference into full-size updates: measured 1.7e-8 (maps) and 5.5e-8 (correction) relative
    # after three steps. 1e-6 bounds that; a batch split wrongly (rows lost, repeated or mixed) changes
    # each step by O(1) of its size, i.e. ~1e-2 here (maps_moved).
    assert out["maps_err"] <= 1e-6 and out["lora_err"] <= 1e-6, out
