"""experiments/linearize.py on label tasks (issue 25, item 7): a label task (cb, sst2, ...) is scored
by label-restricted argmax over its label words, as linicl.evaluate scores it, never as an open-ended
task (where the few-shot "gain" is the model learning to answer with a label word at all); a label
task the tokenizer cannot score is refused before any training, by name."""

import subprocess
import sys

import pytest
from helpers import REPO

import linicl
from linicl import data
from linicl import linearize as LZ
from linicl.evaluate import evaluate

SCRIPT = REPO / "experiments" / "linearize.py"
FIXTURE = REPO / "tests" / "fixtures" / "hf" / "llama-tiny.gguf"
needs_data = pytest.mark.usefixtures("data_env")  # the full data sets, else the committed sample (conftest.py)


@needs_data
def test_a_label_task_is_scored_by_its_labels():
    """cb with one-character label words (the fixture's tokenizer spells "true" in several tokens):
    every method predicts a label word, and the softmax model's cell is linicl.evaluate's."""
    loaded = linicl.lm.load(FIXTURE, max_len=2048, require_tokenizer=True)
    teacher, tv, tok = loaded.model, loaded.variables, loaded.tokenizer
    student = linicl.Transformer(LZ.student_config(teacher.cfg, window=4, sinks=1))
    sv = LZ.student_variables(student, tv)
    task = data.load_task("cb").relabel(("a", "b", "c"))
    row = LZ.icl_cell(teacher, tv, student, sv, tok, task, 1, seed=0, n_eval=4, add_bos=None, approx=False)
    for method in ("softmax", "student", "student converted"):
        assert row[method]["metric"] == "label", method
        assert set(row[method]["predictions"]) <= {"a", "b", "c"}, method
    assert row["converted_same_answers"]
    ref = evaluate(teacher, tv, tok, task, k=1, seed=0, n_eval=4, same_demos=True, add_bos=None, progress=False)
    assert row["softmax"]["correct"] == ref.correct.astype(int).tolist()
    assert row["softmax"]["predictions"] == list(ref.predictions)


@needs_data
def test_a_label_task_the_tokenizer_cannot_score_is_refused_before_training(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-progress", "--tasks", "antonym", "cb",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert "--tasks cb: a label task is scored by its label words" in run.stderr
    assert "' true'" in run.stderr  # the offending word, as check_label_words names it
    assert not (tmp_path / "stage1.safetensors").exists()  # nothing trained
