"""The ICR protocol on a toy task (linicl.routing.prompts, .preparation, .evaluation): the prompts are
seeded, class-balanced and never show a query its own answer; what a run keeps in a folder is read back
instead of made again; an untrained router scores exactly as zero-shot, and the baselines score the
items they should."""

import os

import numpy as np
import pytest

import linicl
from linicl import routing as R
from linicl.data import Example, Task
from linicl.errors import LiniclError
from helpers import init

LABELS = ("yes", "no")


class WordTokenizer:
    """Characters are their code points (< 128); " yes" and " no" are one token each (128, 129)."""
    bos_id = None
    WORDS = (" yes", " no")

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            hit = [w for w in self.WORDS if text.startswith(w, i)]
            ids.append(128 + self.WORDS.index(hit[0]) if hit else ord(text[i]) % 128)
            i += len(hit[0]) if hit else 1
        return ids

    def decode(self, ids):
        return "".join(self.WORDS[i - 128] if i >= 128 else chr(i) for i in ids)


TOK = WordTokenizer()


def toy_task(name="toy", n_train=12, n_test=6, seed=0, template="qa") -> Task:
    rng = np.random.default_rng(seed)

    def example(i):
        return Example("".join(rng.choice(list("abcdef"), size=3)), LABELS[i % 2])
    return Task(name, tuple(example(i) for i in range(n_train)), tuple(example(i) for i in range(n_test)), LABELS,
                template=template)


def test_prompts_are_seeded_balanced_and_never_show_the_query():
    task = toy_task()
    a = R.few_shot_prompts(task, TOK, 5, 2, seed=3)
    b = R.few_shot_prompts(task, TOK, 5, 2, seed=3)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in R.few_shot_prompts(task, TOK, 5, 2, seed=4)]
    for p in a:
        # 5 class-balanced demos (3 + 2), the query dropped if among them, the first 4 kept
        assert len(p.demos) == 4 and {d.output for d in p.demos} == set(LABELS)
        assert p.query not in p.demos and p.query in task.train
    zs, template = R.zero_shot_prompts(task, TOK, 50, seed=3)
    assert len(zs) == len(task.train) and all(not p.demos for p in zs)  # all of a smaller split
    assert template.label_prefix == " "
    queries = list(task.test[:3])
    ids = R.balanced_prompts(queries, task, 1, TOK, seed=0)
    assert [p.query for p in ids] == queries and all(sorted(d.output for d in p.demos) == ["no", "yes"] for p in ids)
    assert all(d in task.train for p in ids for d in p.demos)


def test_multi_task_prompts_take_demos_of_every_in_domain_task():
    ood, id_a, id_b = toy_task("ood", seed=1), toy_task("a", seed=2), toy_task("b", seed=3)
    prompts = R.multi_task_prompts(list(ood.test[:2]), ood, [id_a, id_b], 1, TOK, seed=0)
    for p, q in zip(prompts, ood.test):
        assert p.query == q and len(p.demos) == 2
        assert {d in id_a.train for d in p.demos} | {d in id_b.train for d in p.demos} == {True, False}
    with pytest.raises(LiniclError, match="id_tasks"):
        R.multi_task_prompts(list(ood.test), ood, [], 1, TOK, seed=0)


def test_wrong_label_prompts_change_every_demo_label_and_nothing_else():
    task = toy_task()
    clean, bad = R.wrong_label_prompts(task, TOK, 4, seed=1)
    assert [p.query for p in clean] == [p.query for p in bad]
    # the clean prompts are few_shot_prompts(per_class=1) of the same seed
    assert [p.text for p in clean] == [p.text for p in R.few_shot_prompts(task, TOK, 4, 1, seed=1)]
    for c, w in zip(clean, bad):
        assert [d.input for d in c.demos] == [d.input for d in w.demos]
        assert all(d.output != e.output for d, e in zip(c.demos, w.demos))
    calib = R.calibration_prompts([toy_task("a", seed=2), toy_task("b", seed=3)], TOK, 5, seed=0)
    assert len(calib) == 6 and all(not p.demos for p in calib)  # ceil(5 / 2) per task


@pytest.mark.parametrize("call, match", [
    (lambda t: R.zero_shot_prompts(t, TOK, 0, 0), "n must be"),
    (lambda t: R.few_shot_prompts(t, TOK, 2, 0, 0), "per_class"),
    (lambda t: R.few_shot_prompts(Task("open", t.train, t.test, None), TOK, 2, 1, 0), "classification"),
    (lambda t: R.calibration_prompts([], TOK, 4, 0), "tasks"),
])
def test_prompt_builders_refuse_bad_input(call, match):
    with pytest.raises(LiniclError, match=match):
        call(toy_task())


@pytest.fixture(scope="module")
def model():
    cfg = linicl.preset("tiny-llama", n_layers=3, vocab_size=130, dtype="float64")
    return init(cfg, 0)


def test_kept_parts_are_read_back_instead_of_made_again(tmp_path, model):
    model, variables = model
    tasks = [toy_task("a", seed=2), toy_task("b", seed=3)]
    kw = dict(n_prompts=3, per_class=1, seed=0, folder=str(tmp_path / "acts"))
    acts = R.gather_pid_activations(model, variables, TOK, tasks, **kw)
    assert acts["layers"] == R.routed_layers(model.cfg) and all(type(l) is int for l in acts["layers"])
    assert acts["q"].shape[:2] == (len(acts["layers"]), 6) and sorted(os.listdir(tmp_path / "acts")) == ["a.npz",
                                                                                                        "b.npz"]
    np.savez(tmp_path / "acts" / "a.npz", layers=np.asarray(acts["layers"]), q=acts["q"][:, :3] + 1.0,
             k=acts["k"][:, :3])
    again = R.gather_pid_activations(model, variables, TOK, tasks, **kw)  # the file, not a new forward
    np.testing.assert_array_equal(again["q"][:, :3], acts["q"][:, :3] + 1.0)
    np.testing.assert_array_equal(again["q"][:, 3:], acts["q"][:, 3:])
    fresh = R.gather_pid_activations(model, variables, TOK, tasks, **dict(kw, folder=None))
    np.testing.assert_array_equal(fresh["k"], acts["k"])

    pids = R.fit_pids(acts, r=2)
    found = R.fit_bases(model, variables, pids, {("pids", "paper"), ("random", "paper")}, seed=0,
                        folder=str(tmp_path))
    assert found["pids", "paper"] is pids and (tmp_path / "pids_random_paper.npz").exists()
    np.testing.assert_array_equal(found["random", "paper"].U_q, R.random_basis(pids, 0).U_q)
    assert not np.allclose(found["random", "paper"].U_q, pids.U_q)
    with pytest.raises(LiniclError, match="basis in"):
        R.fit_bases(model, variables, pids, {("pca", "paper")}, seed=0)
    with pytest.raises(LiniclError, match="calibration"):
        R.fit_bases(model, variables, pids, {("pids", "logit")}, seed=0)

    data = R.gather_training_data(model, variables, TOK, tasks, pids, n=4, seed=0, folder=str(tmp_path / "cache"))
    assert data.h0.shape[:2] == (8, max(data.lengths)) and data.e is None
    assert set(data.y.tolist()) <= {128, 129} and data.candidates.tolist() == [[128, 129]] * 8


def test_an_untrained_router_scores_as_zero_shot_and_the_baselines_their_items(tmp_path, model):
    """An untrained router's bias is exactly zero (its alpha branch ends at zero): its per-item
    correctness equals zero-shot's. Few-shot scores the first ``n_eval_fewshot`` items; a method in
    ``done`` is not run."""
    model, variables = model
    id_task, ood = toy_task("a", seed=2), toy_task("ood", seed=5)
    pids = R.fit_pids(R.gather_pid_activations(model, variables, TOK, [id_task], n_prompts=6, per_class=1, seed=0),
                      r=2)
    router, params = R.make_router(model, pids, seed=0)
    methods = R.routed_methods(model, {"ICR": (pids, router, params, False), "ICR-2": (pids, router, params, False)})
    assert methods["ICR"].forward is methods["ICR-2"].forward  # one compiled forward for both
    fvs = R.function_vectors(model, variables, TOK, [id_task], folder=str(tmp_path), n_prompts=3, n_heads=2,
                             screen=3, seed=0)
    layer, vector = fvs["a"]
    assert layer == model.cfg.n_layers // 3 and vector.shape == (model.cfg.d_model,)
    with np.load(tmp_path / "a.npz") as f:
        assert f["heads"].shape == (2, 2) and np.sum(~np.isnan(f["effects"])) == 3
    kw = dict(seed=0, n_eval=5, n_eval_fewshot=3, shots=1, ood_shots=1, tv_prompts=3, tv_seed=1)
    row = R.evaluate_task(model, variables, TOK, id_task, [id_task], methods, fv=fvs["a"], **kw)
    assert R.method_names({"a": row}) == ["zero-shot", "few-shot", "task-vector", "function-vector", "ICR", "ICR-2"]
    assert row["n"] == 5 and row["metric"] == "label"
    assert row["detail"]["ICR"]["correct"] == row["detail"]["zero-shot"]["correct"]
    assert row["detail"]["few-shot"]["items"] == [0, 1, 2] and len(row["detail"]["ICR"]["items"]) == 5
    rest = R.evaluate_task(model, variables, TOK, ood, [id_task], methods, done=["zero-shot", "ICR", "ICR-2"], **kw)
    assert R.method_names({"ood": rest}) == ["few-shot", "task-vector"]  # no function vector off the ID tasks
    embedded = {"ICR-minilm": R.RoutedMethod(pids, params, methods["ICR"].forward, True)}
    with pytest.raises(LiniclError, match="encoder"):
        R.evaluate_task(model, variables, TOK, ood, [id_task], embedded, **kw)


def test_the_arms_name_known_settings_and_each_control_differs_from_its_arm_only_in_the_basis():
    from linicl.names import BIAS_SCALES, ICR_BASES, ICR_INPUTS, ICR_TARGETS
    for arm in R.ARMS.values():
        assert all(v in names for v, names in zip(arm, (ICR_BASES, BIAS_SCALES, ICR_TARGETS, ICR_INPUTS))), arm
    assert R.ARMS["ICR"] == ("pids", "paper", "vocab", "lm")  # the method as the paper specifies it
    for pid_arm, control in R.RANDOM_CONTROLS.items():
        assert R.ARMS[pid_arm]._replace(basis="random") == R.ARMS[control] and R.ARMS[pid_arm].basis == "pids"
