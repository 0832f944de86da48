"""What linearization's files refuse (issue 25, items 2 and 5): a resumed run of either stage refuses
other training text of the same shape and token sum, another teacher of the same architecture and a
checkpoint holding NaN; save_maps refuses a model without maps and NaN maps, load_maps a file of NaN
maps, each where it happens and by name. The checks do not depend on the family: one (Llama) is used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import linicl
from linicl import linearize as LZ
from linicl.errors import DataError, LiniclError

COMMON = dict(steps=2, batch_size=8, progress=False)


@pytest.fixture(scope="module")
def setup():
    """A float64 teacher, a second teacher of the same architecture (another seed), the student and
    training text whose entries are all in 1..vocab-2 (so that +-1 stays a valid token)."""
    cfg = linicl.preset("tiny-llama", max_len=64, dtype="float64")
    teacher = linicl.Transformer(cfg)
    tv = teacher.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    other_tv = teacher.init(jax.random.PRNGKey(7), jnp.zeros((1, 4), jnp.int32))
    student = linicl.Transformer(LZ.student_config(cfg, window=4, sinks=1))
    sv = LZ.student_variables(student, tv)
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (16, 20), 1, cfg.vocab_size - 1), np.int32)
    return teacher, tv, other_tv, student, sv, seqs


def same_shape_and_sum(seqs):
    """Text the old fingerprint (shape and token sum) took for ``seqs``: its rows reversed, and two
    tokens moved by +1 and -1."""
    moved = seqs.copy()
    moved[0, 3] += 1
    moved[5, 7] -= 1
    return [seqs[::-1].copy(), moved]


def poison(path):
    """Rewrite a checkpoint with one NaN in its first float array (header and settings kept)."""
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = sorted(k for k, a in arrays.items() if a.dtype.kind == "f")[0]
    arrays[name] = arrays[name].copy()
    arrays[name].reshape(-1)[0] = np.nan
    safetensors.numpy.save_file(arrays, str(path), metadata=metadata)


def trained_once(setup, stage, tmp_path):
    """``(train, path)``: the stage's training function and the checkpoint of a finished run, which
    the same inputs resume (to the same parameters: nothing is left to train)."""
    teacher, tv, _, student, sv, seqs = setup
    train = LZ.train_maps if stage == "maps" else LZ.train_lora
    path = tmp_path / f"{stage}.safetensors"
    first = train(teacher, tv, student, sv, seqs, checkpoint=path, **COMMON)
    again = train(teacher, tv, student, sv, seqs, checkpoint=path, **COMMON)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)),
                                                         first[0]["params"], again[0]["params"]))
    return train, path


STAGES = pytest.mark.parametrize("stage", ["maps", "lora"])


@STAGES
def test_resuming_refuses_other_text_of_the_same_shape_and_sum(setup, stage, tmp_path):
    teacher, tv, _, student, sv, seqs = setup
    train, path = trained_once(setup, stage, tmp_path)
    for text in same_shape_and_sum(seqs):
        assert text.shape == seqs.shape and text.sum() == seqs.sum()
        with pytest.raises(DataError, match="data_sha256"):
            train(teacher, tv, student, sv, text, checkpoint=path, **COMMON)


@STAGES
def test_resuming_refuses_another_teacher_of_the_same_architecture(setup, stage, tmp_path):
    teacher, tv, other_tv, student, sv, seqs = setup
    train, path = trained_once(setup, stage, tmp_path)
    with pytest.raises(DataError, match="teacher_sha256"):
        train(teacher, other_tv, student, sv, seqs, checkpoint=path, **COMMON)
    with pytest.raises(DataError, match="student_sha256"):  # a student built on the other teacher's weights
        train(teacher, tv, student, LZ.student_variables(student, other_tv), seqs, checkpoint=path, **COMMON)


@STAGES
def test_resuming_refuses_a_checkpoint_holding_nan(setup, stage, tmp_path):
    teacher, tv, _, student, sv, seqs = setup
    train, path = trained_once(setup, stage, tmp_path)
    poison(path)
    with pytest.raises(DataError, match="NaN or infinity"):
        train(teacher, tv, student, sv, seqs, checkpoint=path, **COMMON)


def test_stage1_maps_of_an_unfinished_run_refuse_nan(setup, tmp_path):
    teacher, tv, _, student, sv, seqs = setup
    path = tmp_path / "stage1.safetensors"
    LZ.train_maps(teacher, tv, student, sv, seqs, checkpoint=path, **COMMON)
    poison(path)
    with pytest.raises(DataError, match=r"stage1\.safetensors holds NaN or infinity"):
        LZ.maps_from_checkpoint(path, student, sv)


def test_save_maps_refuses_a_model_without_maps(setup, tmp_path):
    teacher, tv, _, student, _, _ = setup
    with pytest.raises(LiniclError, match="save_maps needs a linearized student.*'softmax'.*no maps"):
        LZ.save_maps(tmp_path / "teacher.safetensors", teacher, tv)
    with pytest.raises(LiniclError, match="save_maps needs a linearized student.*no maps"):
        LZ.save_maps(tmp_path / "mixed.safetensors", student, tv)  # the student with the teacher's variables
    assert not any(tmp_path.iterdir())  # nothing written


def test_save_maps_refuses_nan_maps(setup, tmp_path):
    _, _, _, student, sv, _ = setup
    attn = sv["params"]["layers_1"]["attn"]
    broken = {"params": {**sv["params"], "layers_1": {**sv["params"]["layers_1"],
                                                      "attn": {**attn, "phi_k_b": attn["phi_k_b"] * np.nan}}}}
    with pytest.raises(LiniclError, match=r"NaN or infinity in 1 array\(s\).*layers_1.*phi_k_b"):
        LZ.save_maps(tmp_path / "nan.safetensors", student, broken)
    assert not any(tmp_path.iterdir())  # nothing written


def test_load_maps_refuses_a_file_of_nan_maps(setup, tmp_path):
    teacher, tv, _, student, sv, _ = setup
    path = LZ.save_maps(tmp_path / "maps.safetensors", student, sv)
    LZ.load_maps(path, teacher, tv)  # the file as written loads
    poison(path)
    with pytest.raises(DataError, match=r"maps\.safetensors holds NaN or infinity in 1 array"):
        LZ.load_maps(path, teacher, tv)
