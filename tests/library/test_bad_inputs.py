"""Bad inputs that used to give a silently wrong answer or a raw traceback (issue 14): edits at sites
that do not exist, ``at_last`` lengths outside the sequence, out-of-range tokens for
``collect_activations``, PCA of data without variance, and nonsense command-line numbers."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl import cli, reporting, verify
from linicl import interventions as I
from linicl.activations import collect_activations
from linicl.errors import DegenerateInputError, LiniclError
from linicl.routing import pca
from helpers import BASELINE_MIN, REPO, init, rel_err, tokens


@pytest.fixture(scope="module")
def tiny():
    return init(linicl.preset("tiny-linear", dtype="float64"), 0)


# ------------------------------------------------------------------------------ interventions
def test_with_edits_needs_cfg_and_names_a_misspelt_site(tiny):
    model, variables = tiny
    misspelt = [I.add("blocks.1.hook_resid_pots", 1.0)]
    # Without cfg nothing can tell a misspelt site from a real one: refused, not silently ignored.
    with pytest.raises(LiniclError, match="with_edits needs cfg"):
        I.with_edits(variables, misspelt)
    with pytest.raises(LiniclError, match="with_edits needs cfg"):
        I.add_edits(variables, misspelt)
    with pytest.raises(LiniclError, match="with_edits: cfg must be a ModelConfig"):
        I.with_edits(variables, misspelt, model)
    # With cfg: the missing site is named, with the near misses and the valid names.
    with pytest.raises(LiniclError) as e:
        I.with_edits(variables, misspelt, model.cfg)
    message = str(e.value)
    assert "blocks.1.hook_resid_pots" in message
    assert "did you mean 'blocks.1.hook_resid_post'" in message
    assert "blocks.{0..1}.hook_resid_post" in message and "hook_embed" in message
    with pytest.raises(LiniclError, match=r"no site \['blocks.7.hook_resid_pre'\].*2 layers"):
        I.with_edits(variables, [I.add("blocks.7.hook_resid_pre", 1.0)], model.cfg)
    with pytest.raises(LiniclError, match="edits must be \\(name, Edit\\) pairs"):
        I.with_edits(variables, ["blocks.0.hook_resid_pre"], model.cfg)
    # A generator of edits is read once, and a real site is edited (the check has no false alarm).
    toks = tokens(0, 2, 5, model.cfg.vocab_size)
    steer = jnp.asarray(np.random.default_rng(0).normal(size=model.cfg.d_model))  # not a constant: a norm follows
    edited = I.with_edits(variables, (e for e in [I.add("blocks.1.hook_resid_post", steer)]), model.cfg)
    assert rel_err(model.apply(edited, toks), model.apply(variables, toks)) >= BASELINE_MIN


def test_at_last_refuses_lengths_outside_the_sequence_eagerly():
    np.testing.assert_array_equal(I.at_last([1, 4], 4), [[True, False, False, False],
                                                         [False, False, False, True]])
    for lengths in ([0, 3], [5, 3], [-1, 2]):
        with pytest.raises(LiniclError, match=r"at_last: lengths must be in \[1, seq_len=4\]"):
            I.at_last(lengths, 4)
    with pytest.raises(LiniclError, match="lengths must be int\\[batch\\]"):
        I.at_last([[1, 2]], 4)
    with pytest.raises(LiniclError, match="lengths must be int\\[batch\\]"):
        I.at_last([1.0, 2.0], 4)
    with pytest.raises(LiniclError, match="seq_len must be an int >= 1"):
        I.at_last([1], 0)


def test_at_last_under_jit_fails_visibly_when_it_runs(tiny):
    """Traced lengths are checked when the computation runs (a jax.debug.callback): the jitted call
    fails with the same message instead of leaving a row unedited."""
    model, variables = tiny
    T = 6
    toks = tokens(1, 2, T, model.cfg.vocab_size)

    @jax.jit
    def steered(lengths):
        edits = [I.add("blocks.0.hook_resid_post", 3.0, positions=I.at_last(lengths, T))]
        return I.run_with_edits(model, variables, toks, edits)

    good = jnp.array([T, 3])
    eager = I.run_with_edits(model, variables, toks,
                             [I.add("blocks.0.hook_resid_post", 3.0, positions=I.at_last(np.array([T, 3]), T))])
    assert rel_err(steered(good), eager) <= 1e-12
    for bad in ([0, 3], [T + 1, 3]):
        with pytest.raises(Exception, match=r"at_last: lengths must be in \[1, seq_len=6\]"):
            jax.block_until_ready(steered(jnp.array(bad)))


# ------------------------------------------------------------------------------ activations, PCA
def test_collect_activations_refuses_tokens_outside_the_vocabulary(tiny):
    model, variables = tiny
    V = model.cfg.vocab_size
    ok = np.array([1, 2, 3], np.int32)
    for bad in (np.array([1, V], np.int32), np.array([-1, 2], np.int32)):
        with pytest.raises(LiniclError, match=rf"prompts\[1\] holds token ids .* outside the model's vocabulary "
                                              rf"\[0, {V}\)"):
            collect_activations(model, variables, [ok, bad], ["blocks.0.attn.hook_q"])
    acts = collect_activations(model, variables, [ok, np.array([0, V - 1], np.int32)], ["blocks.0.attn.hook_q"])
    assert np.all(np.isfinite(acts["blocks.0.attn.hook_q"]))


def test_pca_refuses_data_without_variance_and_non_finite_data():
    rng = np.random.default_rng(0)
    for X, center in ((np.full((6, 4), 0.1), True),             # rounding of the mean only
                      (np.zeros((6, 4)), True), (np.zeros((6, 4)), False),
                      (np.tile(rng.normal(size=4), (50, 1)), True)):
        with pytest.raises(DegenerateInputError, match="pca: X has no variance"):
            pca(X, 2, center)
    X = rng.normal(size=(6, 4))
    X[3, 1] = np.nan
    with pytest.raises(LiniclError, match=r"pca: acts has non-finite values \(NaN/inf\) in rows \[3\]"):
        pca(X, 2, name="acts")
    # Small but real variance around a large mean is kept, and the ratios are finite.
    Y = 1e3 + 1e-6 * rng.normal(size=(20, 4))
    U, _, ratio = pca(Y, 2)
    assert np.all(np.isfinite(ratio)) and 0 < ratio.sum() <= 1 + 1e-12
    np.testing.assert_allclose(U.T @ U, np.eye(2), atol=1e-12)
    # Constant rows uncentred have one direction (their own), all of the second moment.
    _, _, ratio = pca(np.full((6, 4), 0.1), 1, center=False)
    np.testing.assert_allclose(ratio, [1.0], rtol=1e-12)


# ------------------------------------------------------------------------------ command lines
@pytest.mark.parametrize("argv", [["--prompt-len", "0"], ["--batch", "0"], ["--query-len", "0"],
                                  ["--batch", "-2"], ["--prompt-len", "x"]])
def test_verify_refuses_nonpositive_sizes_at_the_argument_level(argv, capsys, monkeypatch):
    monkeypatch.setattr(verify, "run", _must_not_run)
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "--quick", *argv])
    assert e.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


def _must_not_run(**kwargs):
    raise AssertionError("the run started before the arguments were checked")


def test_verify_checks_the_results_folder_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(verify, "run", _must_not_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "--quick", "--out", str(blocker / "results")])
    assert e.value.code == 2 and "argument --out: cannot write results" in capsys.readouterr().err
    with pytest.raises(LiniclError, match="verify: cannot write results to out="):
        verify.main(out=str(blocker / "results"))
    if os.geteuid() != 0:  # root writes through permissions
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(SystemExit):
                cli.main(["verify", "--out", str(locked)])
        finally:
            locked.chmod(0o700)
    assert reporting.writable_dir(str(tmp_path / "new" / "folder")) and not os.listdir(tmp_path / "new" / "folder")


def test_verify_run_refuses_nonpositive_sizes():
    for name in ("prompt_len", "query_len", "batch", "workers"):
        with pytest.raises(LiniclError, match=f"{name} must be an int >= 1"):
            verify.run(**{name: 0})


def test_argument_types():
    assert reporting.positive_int("3") == 3 and reporting.nonnegative_int("0") == 0
    assert reporting.positive_int_list("5,10") == [5, 10] and reporting.nonnegative_int_list("0,2") == [0, 2]
    assert reporting.positive_float("1e-3") == 1e-3 and reporting.nonnegative_float("0") == 0.0
    for fn, text in ((reporting.positive_int, "0"), (reporting.nonnegative_int, "-1"), (reporting.positive_float, "0"),
                     (reporting.positive_float, "nan"), (reporting.positive_float, "inf"), (reporting.nonnegative_float, "-0.5"),
                     (reporting.positive_int_list, "5,0")):
        with pytest.raises(Exception, match="must be"):
            fn(text)
    with pytest.raises(ValueError):
        reporting.positive_int("1.5")


def _experiment(name: str):
    spec = importlib.util.spec_from_file_location(f"bad_inputs_{name}", REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, entry, argv, what", [
    ("implicit_dherin", "parse", ["--steps", "-1"], "--steps"),
    ("implicit_dherin", "parse", ["--ft-lr", "-0.1"], "--ft-lr"),
    ("implicit_dherin", "parse", ["--ft-lengths", "5,x"], "--ft-lengths"),
    ("implicit_dherin", "parse", ["--ft-lengths", "500"], "--ft-lengths"),
    ("implicit_regression", "parse", ["--steps", "-1"], "--steps"),
    ("implicit_regression", "parse", ["--align-steps", "0,-4"], "--align-steps"),
    ("implicit_regression", "parse", ["--layers", "0"], "--layers"),
    ("routing", "parse_args", ["--epochs", "0"], "--epochs"),
    ("routing", "parse_args", ["--rank", "-8"], "--rank"),
    ("icl_baselines", "main", ["--k", "-1"], "--k"),
    ("icl_baselines", "main", ["--bucket", "0"], "--bucket"),
    ("icl_baselines", "main", ["--batch-size", "0"], "--batch-size"),
    ("bias_training", "main", ["--steps", "-1"], "--steps"),
    ("bias_training", "main", ["--warmup", "-5"], "--warmup"),
    ("bias_training", "main", ["--lr", "0"], "--lr"),
])
def test_experiments_refuse_nonsense_numbers(name, entry, argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        getattr(_experiment(name), entry)(argv)
    assert e.value.code == 2 and f"argument {what}" in capsys.readouterr().err


def test_experiment_parsers_keep_their_defaults():
    dherin = _experiment("implicit_dherin").parse([])
    assert dherin.ft_lengths == [5, 10, 25, 50, 100] and dherin.steps == 2000
    assert _experiment("implicit_dherin").parse(["--n-context", "30"]).ft_lengths == [5, 10, 25]
    regression = _experiment("implicit_regression").parse([])
    assert regression.msd_steps == [1, 50, 100] and regression.align_steps == [0, 50, 90]
    assert _experiment("implicit_regression").parse(["--quick"]).msd_steps == [1, 4]
