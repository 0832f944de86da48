"""Data parallelism (linicl.parallel) on 4 host devices: sharded evaluation and activation collection equal
the single-device run, the inputs really are split across the devices, and batches that do not divide
by 4 work. XLA_FLAGS must be set before jax is imported, so the 4-device checks run in a subprocess; the
one-device no-op is checked here."""

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

from linicl.batching import pad_rows, round_up, run_sharded
from linicl.parallel import device_mesh, replicate, shard_batch
from helpers import REPO, host_devices_env

ROOT = REPO

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_disable_most_optimizations", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    import linicl.lm
    from linicl.data import Example, Task, batch_prompts, build_eval_set
    from linicl.activations import collect_activations
    from linicl.batching import last_token_logits, pad_rows, run_sharded
    from linicl.evaluate import evaluate, label_logprobs
    from linicl.metrics import rel_err
    from linicl.parallel import device_mesh, replicate, shard_batch

    out = dict(device_count=jax.device_count())
    model, variables, tok = linicl.lm.from_pretrained(sys.argv[1], dtype="float64")
    pairs = [("hot", "cold"), ("big", "small"), ("up", "down"), ("dog", "cat"), ("sat", "on"), ("the", "a"),
             ("fo", "ow"), ("qu", "ee")]
    task = Task("fx", tuple(Example(a, b) for a, b in pairs), tuple(Example(b, a) for a, b in pairs), None)
    prompts = build_eval_set(task, tok, k=1, seed=0, n_eval=7)          # 7 prompts: not a multiple of 4
    four, one = device_mesh(), device_mesh(jax.devices()[:1])
    out["mesh_sizes"] = [four.size, one.size]

    # Evaluation: 7 queries in batches of 6 -> rounded up to 8 rows, 2 per device.
    seen = []
    def inspecting_forward(v, tokens, lengths):
        jax.debug.inspect_array_sharding(tokens, callback=lambda s: seen.append(s))
        return last_token_logits(model)(v, tokens, lengths)
    # first_content_token: one forward per batch, and gold log-probabilities to compare.
    a = evaluate(model, variables, tok, task, k=1, n_eval=7, batch_size=6, forward=inspecting_forward,
                 progress=False, open_metric="first_content_token")
    b = evaluate(model, variables, tok, task, k=1, n_eval=7, batch_size=6, mesh=one, progress=False,
                 open_metric="first_content_token")
    out["eval_n"] = [a.n, b.n]
    out["eval_same_predictions"] = a.predictions == b.predictions and bool(np.all(a.correct == b.correct))
    out["eval_rel_err"] = rel_err(a.gold_logprob, b.gold_logprob)
    out["traced_sharding"] = [str(s) for s in seen]
    out["traced_sharding_ok"] = bool(seen) and all(
        s.num_devices == 4 and len(s.devices_indices_map((8, 32))) == 4
        and len({str(i) for i in s.devices_indices_map((8, 32)).values()}) == 4 for s in seen)

    # label_logprobs on a 7-row batch in one call (rounded to 8 rows) and in batches of 3 (rounded to 4)
    batch = batch_prompts(prompts)
    ref = label_logprobs(model, variables, batch, mesh=one)
    out["logprobs_rel_err"] = max(rel_err(label_logprobs(model, variables, batch), ref),
                                  rel_err(label_logprobs(model, variables, batch, batch_size=3), ref))
    out["logprobs_shape"] = list(label_logprobs(model, variables, batch).shape)

    # Activation collection (last token) for residuals, queries and keys
    names = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_q", "blocks.1.attn.hook_k"]
    acts4 = collect_activations(model, variables, prompts, names, batch_size=5)
    acts1 = collect_activations(model, variables, prompts, names, batch_size=5, mesh=one)
    out["acts_rel_err"] = max(rel_err(acts4[n], acts1[n]) for n in names)
    out["acts_shapes"] = [list(acts4[n].shape) for n in names]

    # Where the inputs live: rows split 2 per device; parameters whole on every device.
    tokens = shard_batch(pad_rows(batch.tokens, 8))
    out["tokens_spec"] = list(tokens.sharding.spec)
    out["tokens_is_named"] = isinstance(tokens.sharding, NamedSharding)
    out["tokens_shards"] = sorted([(s.device.id, s.data.shape[0], s.index[0].start) for s in tokens.addressable_shards])
    params = replicate(variables)
    leaf = params["params"]["embed"]
    out["params_shards"] = sorted([(s.device.id, list(s.data.shape)) for s in leaf.addressable_shards])
    out["params_spec"] = list(leaf.sharding.spec)
    try:
        shard_batch(batch.tokens)                                       # 7 rows do not split over 4
        out["indivisible_refused"] = False
    except Exception as e:
        out["indivisible_refused"] = "pad_rows" in str(e)

    # run_sharded drops the padding rows; an un-jitted fn sees sharded inputs
    shapes = []
    def fn(rep, x):
        shapes.append((len(x.addressable_shards), x.shape))
        return x * rep
    res = run_sharded(fn, jnp.asarray(2.0), [np.arange(7.0)])
    out["run_sharded"] = dict(result=res.tolist(), seen=shapes)
    print("RESULT " + json.dumps(out))
""")


def test_four_devices_shard_and_match_one_device(tmp_path):
    script = tmp_path / "multidevice.py"
    script.write_text(SCRIPT)
    env = host_devices_env(4)
    run = subprocess.run([sys.executable, str(script), str(ROOT / "tests" / "fixtures" / "hf" / "gpt2-tiny")],
                         capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["device_count"] == 4 and out["mesh_sizes"] == [4, 1]
    # Same numbers. Not bit-identical: each device multiplies a 2-row block instead of an 8-row one, and
    # XLA may order the sums inside a row's matmuls differently for another shape. In float64 each of the
    # few hundred roundings per output is <= 1.1e-16 relative, so 1e-12 (helpers.EXACT_RTOL) bounds them;
    # a row mixed up with another or a padding row read as real would be off by O(1).
    assert out["eval_n"] == [7, 7] and out["eval_same_predictions"]
    assert out["eval_rel_err"] <= 1e-12
    assert out["logprobs_rel_err"] <= 1e-12 and out["logprobs_shape"] == [7, 97]
    assert out["acts_rel_err"] <= 1e-12
    assert out["acts_shapes"] == [[7, 64], [7, 4, 16], [7, 4, 16]]
    # Inside the jitted forward the token batch is split over the 4 devices (seen at compile time).
    assert out["traced_sharding_ok"], out["traced_sharding"]
    assert out["tokens_is_named"] and out["tokens_spec"] == ["data"]
    assert [(d, n) for d, n, _ in out["tokens_shards"]] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    assert sorted(start for _, _, start in out["tokens_shards"]) == [0, 2, 4, 6]
    assert out["params_shards"] == [[d, [97, 64]] for d in range(4)] and out["params_spec"] == []
    assert out["indivisible_refused"]
    assert out["run_sharded"]["result"] == [2.0 * i for i in range(7)]
    assert out["run_sharded"]["seen"] == [[4, [8]]]


def test_one_device_is_a_no_op():
    mesh = device_mesh()
    if mesh.size != 1:  # the suite itself runs on one device; nothing to check otherwise
        return
    x = jnp.arange(6.0).reshape(3, 2)
    tree = {"a": x}
    assert shard_batch(x) is x and replicate(tree) is tree
    seen = []
    out = run_sharded(lambda rep, b: seen.append(b.shape) or b + rep, 1.0, [x])
    assert seen == [(3, 2)] and np.array_equal(out, np.asarray(x) + 1)   # no padding rows on one device


def test_pad_rows_and_round_up():
    x = np.asarray([[1, 2], [3, 4], [5, 6]])
    assert round_up(7, 4) == 8 and round_up(8, 4) == 8 and round_up(1, 1) == 1
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2) and np.array_equal(padded[3:], [[1, 2], [1, 2]])
    assert pad_rows(x, 3) is x
