"""Stage 2 of linearization (linicl.linearize.lora, .distill): the correction is W + A B and starts at
zero, distillation lowers the student's KL to its teacher, training resumes bit-identically, the
corrected student still converts prompts exactly, and the correction round-trips through the maps file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BASELINE_MIN, EXACT_RTOL, interrupt_at, rel_err

import linicl
from linicl import linearize as LZ
from linicl.errors import DataError, LiniclError
from linicl.linearize import distill
from linicl.linearize import lora as L
from linicl.linearize.transfer import layer_losses


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def pair(request):
    """A float64 teacher of either family and its stage-1 student (window 4, one sink; a few steps)."""
    cfg = linicl.preset(request.param, max_len=64, dtype="float64")
    teacher = linicl.Transformer(cfg)
    tv = teacher.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    student = linicl.Transformer(LZ.student_config(cfg, window=4, sinks=1))
    sv = LZ.student_variables(student, tv)
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (16, 20), 0, cfg.vocab_size))
    sv, _ = LZ.train_maps(teacher, tv, student, sv, seqs, steps=3, batch_size=8, progress=False)
    return teacher, tv, student, sv, seqs


def test_the_correction_is_W_plus_AB_and_starts_at_zero(pair):
    _, _, student, sv, _ = pair
    params = sv["params"]
    fresh = L.init(params, rank=3, seed=1)
    same = L.apply(params, fresh)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), same, params))
    # A non-zero B: each corrected kernel is W + A B read as [d_in, d_out]; nothing else changes.
    moved = jax.tree_util.tree_map(lambda x: x + 0.1, fresh)
    out = L.apply(params, moved)
    for t, n_in in (("q", 1), ("o", 2)):
        W, f = params["layers_1"]["attn"][t]["kernel"], moved["layers_1"]["attn"][t]
        mat = W.reshape(int(np.prod(W.shape[:n_in])), -1) + f["A"] @ f["B"]
        assert np.array_equal(out["layers_1"]["attn"][t]["kernel"], mat.reshape(W.shape))
    assert np.array_equal(out["embed"], params["embed"])
    assert np.array_equal(out["layers_0"]["attn"]["phi_q_W"], params["layers_0"]["attn"]["phi_q_W"])
    assert L.rank_of(moved) == 3 and set(L.init(params, targets=("v",))["layers_0"]["attn"]) == {"v"}


@pytest.mark.parametrize("kw, match", [(dict(rank=0), "rank"), (dict(rank=2.5), "rank"),
                                       (dict(targets=("q", "mlp")), "targets"), (dict(targets=()), "targets")])
def test_bad_corrections_are_refused_by_name(pair, kw, match):
    with pytest.raises(LiniclError, match=match):
        L.init(pair[3]["params"], **kw)


def test_distillation_lowers_the_kl_to_the_teacher(pair):
    teacher, tv, student, sv, seqs = pair
    x = jnp.asarray(seqs[:8])

    def kl(v):
        return float(LZ.kl_to_teacher(student.apply(v, x), teacher.apply(tv, x)))
    before = kl(sv)
    trained, correction, hist = LZ.train_lora(teacher, tv, student, sv, seqs, rank=4, steps=15, batch_size=8,
                                              lr=1e-2, progress=False, log_every=1)
    after = kl(trained)
    assert before > 1e-4 and after < 0.9 * before, (before, after)  # the stage-1 student is not yet the teacher
    assert hist.step == list(range(15)) and len(hist.kl) == 15
    # The correction is merged into the kernels; every other parameter (maps included) is unchanged.
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), trained["params"],
                                                         L.apply(sv["params"], correction)))
    moved = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(correction)[0]]
    assert len(moved) == 2 * 4 * student.cfg.n_layers  # A and B of q, k, v, o in every block
    with pytest.raises(LiniclError, match="softmax teacher"):
        LZ.train_lora(student, sv, student, sv, seqs, steps=1, batch_size=8, progress=False)


def test_the_corrected_student_converts_prompts_exactly(pair):
    teacher, tv, student, sv, seqs = pair
    # Any correction keeps the state finite (here a random A and B = 0.05): no training needed.
    correction = jax.tree_util.tree_map(lambda a: a + 0.05, L.init(sv["params"], rank=4, seed=2))
    trained = {**sv, "params": L.apply(sv["params"], correction)}
    prompt, query = jnp.asarray(seqs[:2, :12]), jnp.asarray(seqs[:2, 12:19])
    converted = linicl.iclca.convert(student, trained, prompt)
    ref = student.apply(trained, jnp.concatenate([prompt, query], 1))[:, 12:]
    assert rel_err(student.apply(converted, query), ref) <= EXACT_RTOL
    assert rel_err(student.apply(trained, query), ref) >= BASELINE_MIN  # the prompt matters


def test_stage2_resumes_bit_identically(pair, tmp_path, monkeypatch):
    teacher, tv, student, sv, seqs = pair
    common = dict(rank=2, steps=5, batch_size=8, lr=1e-2, progress=False, checkpoint_every=2)
    whole, _, _ = LZ.train_lora(teacher, tv, student, sv, seqs, **common)
    path = tmp_path / "stage2.safetensors"
    real = interrupt_at(monkeypatch, distill, "step_batch", 3)
    with pytest.raises(KeyboardInterrupt):
        LZ.train_lora(teacher, tv, student, sv, seqs, checkpoint=path, **common)
    monkeypatch.setattr(distill, "step_batch", real)
    resumed, _, hist = LZ.train_lora(teacher, tv, student, sv, seqs, checkpoint=path, **common)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)),
                                                         whole["params"], resumed["params"]))
    assert hist.step[-1] == 4
    with pytest.raises(DataError, match="rank"):  # a checkpoint of another run is refused by name
        LZ.train_lora(teacher, tv, student, sv, seqs, checkpoint=path, **dict(common, rank=3))
    other_maps = {**sv, "params": jax.tree_util.tree_map(lambda a: a, sv["params"])}
    other_maps["params"]["layers_0"] = {**other_maps["params"]["layers_0"]}
    other_maps["params"]["layers_0"]["attn"] = {**sv["params"]["layers_0"]["attn"],
                                                "phi_q_b": sv["params"]["layers_0"]["attn"]["phi_q_b"] + 1.0}
    with pytest.raises(DataError, match="student_sha256"):  # nor one that started from other maps
        LZ.train_lora(teacher, tv, student, other_maps, seqs, checkpoint=path, **common)


def test_the_correction_round_trips_with_the_maps(pair, tmp_path):
    teacher, tv, student, sv, seqs = pair
    trained, correction, _ = LZ.train_lora(teacher, tv, student, sv, seqs, rank=2, steps=2, batch_size=8,
                                           lr=1e-2, targets=("q", "v", "o"), progress=False)
    path = LZ.save_maps(tmp_path / "maps.safetensors", student, trained, meta={"stage2_steps": 2},
                        lora=correction)
    again, sv2, meta = LZ.load_maps(path, teacher, tv)
    assert again.cfg == student.cfg and meta == {"stage2_steps": 2}
    x = jnp.asarray(seqs[:2])
    assert rel_err(again.apply(sv2, x), student.apply(trained, x)) < 1e-6  # float32 storage
    # Without the correction the reloaded student would be the stage-1 one: far off.
    plain = LZ.save_maps(tmp_path / "plain.safetensors", student, trained)
    _, sv3, _ = LZ.load_maps(plain, teacher, tv)
    assert rel_err(again.apply(sv3, x), student.apply(trained, x)) > 1e-4


def test_sampled_text_is_the_teachers_own_samples(pair):
    """linearize.sampled_sequences: the start tokens continued by the teacher's samples (the same as
    linicl.generate with the batch's key), seeded, every id in the vocabulary; bad input named."""
    teacher, tv, _, _, seqs = pair
    starts = seqs[:5, :3]
    a = LZ.sampled_sequences(teacher, tv, starts, 12, seed=4, batch_size=2)
    assert a.shape == (5, 12) and a.dtype == np.int32 and np.array_equal(a[:, :3], starts)
    assert np.all((a >= 0) & (a < teacher.cfg.vocab_size))
    assert np.array_equal(a, LZ.sampled_sequences(teacher, tv, starts, 12, seed=4, batch_size=2))
    assert not np.array_equal(a, LZ.sampled_sequences(teacher, tv, starts, 12, seed=5, batch_size=2))
    first = linicl.generate(teacher, tv, jnp.asarray(starts[:2]), 9, key=jax.random.PRNGKey(np.uint32(4 * 1_000_003)))
    assert np.array_equal(a[:2, 3:], np.asarray(first))
    with pytest.raises(LiniclError, match="length"):
        LZ.sampled_sequences(teacher, tv, starts, 3)
    with pytest.raises(LiniclError, match="starts"):
        LZ.sampled_sequences(teacher, tv, starts[0], 12)


def test_mixed_precision_keeps_a_full_precision_correction_and_still_distils(pair):
    """``compute_dtype="bfloat16"``: the student runs in bfloat16, the correction and its updates stay in
    the weights' own dtype; the KL falls as in full precision, the correction is near the full-precision
    one (bfloat16 keeps ~3 digits) and not equal to it (the compute really was bfloat16)."""
    teacher, tv, student, sv, seqs = pair
    x = jnp.asarray(seqs[:8])
    common = dict(rank=4, steps=15, batch_size=8, lr=1e-2, progress=False)
    full, c_full, _ = LZ.train_lora(teacher, tv, student, sv, seqs, **common)
    mixed, c_mixed, hist = LZ.train_lora(teacher, tv, student, sv, seqs, compute_dtype="bfloat16", **common)
    assert all(a.dtype == jnp.float64 for a in jax.tree_util.tree_leaves((c_mixed, mixed["params"])))

    def kl(v):
        return float(LZ.kl_to_teacher(student.apply(v, x), teacher.apply(tv, x)))
    assert kl(mixed) < 0.9 * kl(sv), (kl(sv), kl(mixed))
    flat = lambda c: jnp.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(c)])  # noqa: E731
    assert 1e-6 < rel_err(flat(c_mixed), flat(c_full)) < 0.2
    with pytest.raises(LiniclError, match="compute_dtype"):
        LZ.train_lora(teacher, tv, student, sv, seqs, compute_dtype="float16", **common)


def test_stage1_in_mixed_precision_keeps_full_precision_maps(pair):
    """``train_maps(compute_dtype="bfloat16")``: the maps stay in the weights' dtype; the bfloat16 blocks
    measure the same loss as full precision to bfloat16's ~3 digits (not exactly: they really ran in
    bfloat16), and the maps they train lower the full-precision loss as much as full-precision training
    does, within 10 %. (The maps themselves may differ by as much as they move: Adam's steps follow
    the signs of small gradients, which bfloat16 rounding flips.)"""
    teacher, tv, student, sv, seqs = pair
    common = dict(steps=6, batch_size=8, lr=3e-3, progress=False, log_every=1)
    full, h_full = LZ.train_maps(teacher, tv, student, sv, seqs, **common)
    mixed, h_mixed = LZ.train_maps(teacher, tv, student, sv, seqs, compute_dtype="bfloat16", **common)
    assert all(a.dtype == jnp.float64 for a in jax.tree_util.tree_leaves(LZ.split(mixed["params"])[0]))
    assert 1e-6 < abs(h_mixed.loss[0] - h_full.loss[0]) < 0.02 * h_full.loss[0]
    X, A = LZ.teacher_targets(teacher, tv, jnp.asarray(seqs))
    loss = lambda v: float(jnp.sum(layer_losses(student.cfg, v["params"], X, A)))  # noqa: E731
    start, gain_full, gain_mixed = loss(sv), loss(sv) - loss(full), loss(sv) - loss(mixed)
    assert gain_full > 0.01 * start and abs(gain_mixed - gain_full) < 0.1 * gain_full, (start, gain_full, gain_mixed)
    with pytest.raises(LiniclError, match="compute_dtype"):
        LZ.train_maps(teacher, tv, student, sv, seqs, compute_dtype="half", **common)
