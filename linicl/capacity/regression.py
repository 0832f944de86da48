"""In-context linear regression (Garg et al. arXiv 2208.01066) on the zoo's mixers: a model between a
read-in and a read-out, its training loss, the evaluation of prompted against converted predictions,
and the classical estimators as baselines.

Data (``linicl.data.synthetic.regression_batch`` and ``regression_embeds``): per sequence w ~ N(0,
I) and pairs x_i ~ N(0, I), y_i = w . x_i, read as the continuous tokens x_1, y_1, x_2, y_2, ...
(``[x, 0]`` and ``[0, ..., 0, y]``). The model (``mixers.init_params(..., embeds=True)``) reads
``embeds`` and returns its final hidden state; ``read_in: d_x + 1 -> d_model`` and ``read_out: d_model
-> 1`` (both with bias) surround it; the prediction of y_i is the read-out at the x_i token
(``regress``). Errors are (prediction - y)^2 / d_x: E[y^2] = d_x, so 1 is the zero predictor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linicl import iclca, stats
from linicl.capacity.mixers import init_params, prompt_floats
from linicl.config import ModelConfig
from linicl.data.synthetic import RegressionBatch, regression_batch, regression_embeds
from linicl.errors import LiniclError
from linicl.training import Stage

__all__ = ["REL_TOL", "BASELINES", "init", "dense", "regress", "stage", "loss_fn", "held_out", "error_interval",
           "evaluate", "converted_predictions", "baselines"]

REL_TOL = 1e-10  # converted against prompted predictions, float64

# estimator name -> w from one task's k pairs (x: [k, d_x], y: [k])
BASELINES = {
    "least squares": lambda x, y: np.linalg.lstsq(x, y, rcond=None)[0],  # minimum-norm when k < d_x
    "averaging": lambda x, y: (y[:, None] * x).mean(0),                  # one GD step from 0, up to scale
    "zero": lambda x, y: np.zeros(x.shape[1]),
}


def _dense_init(key, n_in: int, n_out: int) -> dict:
    kernel = jax.random.normal(key, (n_in, n_out), jnp.float32) * n_in ** -0.5  # a Python float: stays f32
    return dict(kernel=kernel, bias=jnp.zeros((n_out,), jnp.float32))


def init(cfg: ModelConfig, d_x: int, key) -> dict:
    """Initial params ``{"model", "read_in", "read_out"}``: the model reading ``embeds`` (gates as
    ``mixers.init_params``'s), the read-in ``{kernel f32[d_x + 1, d_model], bias f32[d_model]}`` and the
    read-out ``{kernel f32[d_model, 1], bias f32[1]}`` (lecun-normal kernels, zero biases)."""
    if not isinstance(d_x, int) or d_x < 1:
        raise LiniclError(f"d_x must be an int >= 1, got {d_x!r}")
    k_model, k_in, k_out = jax.random.split(key, 3)
    return dict(model=init_params(cfg, k_model, embeds=True), read_in=_dense_init(k_in, d_x + 1, cfg.d_model),
                read_out=_dense_init(k_out, cfg.d_model, 1))


def dense(p: dict, x):
    """``x @ kernel + bias`` (NumPy or JAX): ``x: f[..., n_in]`` -> ``f[..., n_out]``."""
    return x @ p["kernel"] + p["bias"]


def regress(model, variables: dict, io: dict, embeds):
    """Predictions ``f[batch, seq]`` at every token of ``embeds: f[batch, seq, d_x + 1]`` (those at the
    x-tokens, ``[:, 0::2]``, are the y's): read-in, the model's final hidden state, read-out.
    ``variables``: the model's, possibly converted; ``io``: params holding ``read_in`` and ``read_out``."""
    hidden = model.apply(variables, embeds=dense(io["read_in"], embeds), hidden=True)
    return dense(io["read_out"], hidden)[..., 0]


def stage(n_examples: int, d_x: int, batch: int, steps: int) -> Stage:
    """The one training stage (no curriculum: Garg et al. grow d_x and the length; these models are
    small and the sequences short): ``steps`` steps of ``batch`` fresh tasks of ``n_examples`` pairs."""
    return Stage("regression", steps, 0, ((n_examples, d_x, batch),))


def loss_fn(model, stage: Stage) -> Callable:
    """``loss_fn(params, key) -> (loss, ())``: the squared error at every x-token over d_x (the
    evaluation's scale) on a fresh batch of tasks drawn from ``key``; ``params`` as ``init``'s."""
    ((n, d_x, batch),) = stage.sizes

    def fn(params, key):
        data = regression_batch(key, batch, n, d_x)
        pred = regress(model, {"params": params["model"]}, params, regression_embeds(data.xs, data.ys))
        return jnp.mean((pred[:, 0::2] - data.ys) ** 2) / d_x, ()

    return fn


def held_out(seed: int, batch: int, n_examples: int, d_x: int) -> RegressionBatch:
    """Held-out tasks (NumPy float64) from ``fold_in(PRNGKey(seed), 3)``: apart from training data
    drawn from ``fold_in(PRNGKey(seed), 1)``, the same for every model and baseline."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 3)
    return RegressionBatch(*(np.asarray(a, np.float64) for a in regression_batch(key, batch, n_examples, d_x)))


def error_interval(pred, y, d_x: int) -> dict:
    """``{"mean", "low", "high"}``: the normalised squared error (pred - y)^2 / d_x over the tasks
    (``pred``, ``y``: ``f[tasks]``), its mean with a 95 % percentile bootstrap interval over the tasks
    (``stats.paired_bootstrap`` against 0: the bootstrap of the mean)."""
    pred, y = np.asarray(pred, np.float64), np.asarray(y, np.float64)
    if pred.shape != y.shape or pred.ndim != 1:
        raise LiniclError(f"pred and y must be f[tasks] of one shape, got {pred.shape} and {y.shape}")
    err = (pred - y) ** 2 / d_x
    iv = stats.paired_bootstrap(err, np.zeros_like(err))
    return dict(mean=iv.value, low=iv.low, high=iv.high)


def converted_predictions(model, apply: Callable, variables: dict, params: dict, embeds, k: int):
    """``f[tasks]``: the predictions at the (k+1)-th x-token of ``embeds: f[tasks, seq, d_x + 1]`` by
    the model holding its first k pairs converted, reading that token alone. ``apply`` is ``regress``
    with ``model`` bound. The read-in acts token by token: converting its output converts the prompt."""
    converted = iclca.convert(model, variables, embeds=np.asarray(dense(params["read_in"], embeds[:, :2 * k])))
    return np.asarray(apply(converted, params, embeds[:, 2 * k:2 * k + 1]))[:, 0]


def evaluate(model, apply: Callable, params: dict, data: RegressionBatch, ks: Sequence[int]) -> list:
    """One row per k of ``ks``: the error (``error_interval``) of the prediction at the (k+1)-th
    x-token after k pairs of ``data`` (NumPy, ``max(ks) + 1`` pairs or more), prompted (one pass over
    every pair: the model is causal) and, for a finite-state model, from the converted prompt of the k
    pairs. ``apply``: ``regress`` with ``model`` bound (jitted by the caller, once per model).

    Returns ``dict(k, prompt_floats, prompted)`` per k and, when converted, ``converted`` (the mean
    error), ``identical`` (max relative difference <= ``REL_TOL``) and ``max_rel_diff``.

    Raises:
      LiniclError: a k with no (k+1)-th x in ``data``.
      AssertionError: the converted predictions differ from the prompted ones.
    """
    if max(ks) >= data.xs.shape[1]:
        raise LiniclError(f"ks: k = {max(ks)} needs {max(ks) + 1} pairs, data hold {data.xs.shape[1]}")
    embeds = np.asarray(regression_embeds(data.xs, data.ys))           # [tasks, 2 n, d_x + 1]
    variables = {"params": params["model"]}
    pred = np.asarray(apply(variables, params, embeds))[:, 0::2]       # [tasks, n]
    rows, d_x = [], data.xs.shape[-1]
    for k in ks:
        y = data.ys[:, k]
        row = dict(k=k, prompt_floats=prompt_floats(model.cfg, 2 * k), prompted=error_interval(pred[:, k], y, d_x))
        if model.cfg.attention == "linear":
            pred_c = converted_predictions(model, apply, variables, params, embeds, k)
            diff = float(np.abs(pred_c - pred[:, k]).max() / max(np.abs(pred[:, k]).max(), 1e-300))
            row.update(converted=error_interval(pred_c, y, d_x)["mean"], identical=diff <= REL_TOL,
                       max_rel_diff=diff)
            if not row["identical"]:
                raise AssertionError(f"{model.cfg.describe()}, {k} pairs: the converted model's regression "
                                     f"predictions differ from the prompted model's (max relative difference "
                                     f"{diff:.3g})")
        rows.append(row)
    return rows


def baselines(data: RegressionBatch, ks: Sequence[int]) -> dict:
    """``{estimator: [dict(k, error) per k]}``: the error (``error_interval``) at the (k+1)-th x of each
    estimator of ``BASELINES`` fitted to the first k pairs of every task of ``data`` (NumPy)."""
    out = {name: [] for name in BASELINES}
    d_x = data.xs.shape[-1]
    for k in ks:
        for name, fit in BASELINES.items():
            w = np.stack([fit(x, y) for x, y in zip(data.xs[:, :k], data.ys[:, :k])])
            pred = np.einsum("bd,bd->b", w, data.xs[:, k])
            out[name].append(dict(k=k, error=error_interval(pred, data.ys[:, k], d_x)))
    return out
