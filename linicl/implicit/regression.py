"""A transformer trained on in-context linear regression with its implicit updates probed as it trains
(Innocenti & Achour, arXiv 2512.11255: Fig. 1, A.1, A.2, A.3).

The model (``fig1_config``) reads N tokens [x_j; y_j] (the query's label 0, ``linicl.data.regression``)
as continuous inputs and predicts y_q in the label coordinate of its last output token. Adam trains it
on fresh tasks every step. At every step a fresh test batch measures (``step_metrics``):

* the test loss of the model and of the paper's implicit model: block L patched with its last-token
  update ΔW_N, Δb'_N and run on its contextualised query x_L alone (``last_block_prediction``);
* per block, ‖ΔW_N‖_F (= spectral norm: rank 1), the mean over tasks.

At chosen steps a heavier probe (``exactness``) adds, per block, the mean squared difference (Eq. 35)
between the block with context and its patched version on the query alone, over every task, position
and coordinate, the largest absolute difference, rank(Σ_i ΔW_i), the smallest ‖f‖ and the largest
‖g‖/‖f‖; the loss of the whole network with every block patched, run on the raw query alone
(``patched_network_prediction``); and the alignment maps DA(ΔW_i, ΔW_j) between the positions of every
block (Fig. A.1) and between the blocks' last-token updates (Fig. A.2) for the first tasks.

Everything is computed on the fly (``train_with_probes``): no array of every update over training is
kept. Shapes: L blocks, B tasks, N tokens, d = d_x + 1.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from linicl.config import ModelConfig
from linicl.data import regression
from linicl.errors import LiniclError
from linicl.implicit.blocks import alone
from linicl.implicit.metrics import alignment, frobenius
from linicl.implicit.model import ModelUpdates, implied_all, updates
from linicl.implicit.operators import Update, dense, patch
from linicl.names import PARAMS, layer_scope
from linicl.nn.transformer import config_of
from linicl.timing import FAST_COMPILE

CURVES = ("train_loss", "model", "implicit_last_block", "dW_fro_last_token")  # train_with_probes' curves


def fig1_config(*, d_x: int = 2, n_layers: int = 5, n_heads: int = 3, n_tokens: int = 51, norm: str = "none",
                dtype: str = "float32") -> ModelConfig:
    """The paper's model: causal softmax blocks (d_model = d_x + 1, GELU MLP d -> 4d -> 4d -> d with
    biases, no attention biases, no positions, no final norm; ``norm="pre"``: the pre-LN Fig. A.3)."""
    for name, value in (("d_x", d_x), ("n_layers", n_layers), ("n_heads", n_heads), ("n_tokens", n_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LiniclError(f"{name} must be a positive int, got {value!r}")
    return ModelConfig(vocab_size=1, d_model=d_x + 1, n_layers=n_layers, n_heads=n_heads, d_ff=4 * (d_x + 1),
                       mlp_depth=3, max_len=max(n_tokens, 2), attention="softmax", positions="none", norm=norm,
                       skip="residual", final_norm=False, activation="gelu_tanh", attn_bias=False, mlp_bias=True,
                       causal=True, ln_eps=1e-5, dtype=dtype)


def _hidden(model, variables, x):
    return model.apply(variables, embeds=x, hidden=True)


def last_block_prediction(model, variables, mu: ModelUpdates, d_x: int) -> jax.Array:
    """``f[B]``: the paper's implicit model, block L patched with its last-token update and run on its
    own input x_L (the query's, in the full-context pass) alone; read in the label coordinate."""
    cfg = config_of(model)
    L = cfg.n_layers
    bp = variables[PARAMS][layer_scope(L - 1)]
    one = jax.tree.map(lambda a: a[L - 1], mu.update)

    def task(u, v, db, xb):
        return alone(cfg, patch(cfg, bp, Update(u, v, db).at(-1)), xb)["hook_resid_post"]
    return jax.vmap(task)(one.u, one.v, one.delta_b, mu.pieces.x[L - 1][:, -1])[:, d_x]


def patched_network_prediction(model, variables, mu: ModelUpdates, query, d_x: int) -> jax.Array:
    """``f[B]``: the whole network with every block patched with its last-token update, run on the raw
    query ``f[B, d]`` alone. Without positions the query's own block-1 input is the last token's, so
    these are the patches ``implicit.convert`` builds."""
    cfg = config_of(model)

    def network(upd, q):
        params = dict(variables[PARAMS])
        for l in range(cfg.n_layers):
            params[layer_scope(l)] = patch(cfg, params[layer_scope(l)], jax.tree.map(lambda a: a[l], upd).at(-1))
        return _hidden(model, {PARAMS: params}, q[None, None])[0, -1, d_x]
    return jax.vmap(network, in_axes=(1, 0))(mu.update, query)


def step_metrics(model, variables, batch: regression.Tasks, d_x: int) -> dict:
    """The per-step metrics of a test batch: ``model`` and ``implicit_last_block`` (losses, ``f[]``) and
    ``dW_fro_last_token`` (``f[L]``: ‖ΔW_N‖_F per block, mean over tasks). Pure: jit it."""
    L = config_of(model).n_layers
    mu = updates(model, variables, embeds=batch.tokens)
    model_pred = mu.pieces.out[L - 1][:, -1, d_x]
    implicit_pred = last_block_prediction(model, variables, mu, d_x)
    fro = frobenius(mu.update)[:, :, -1]                                      # [L, B]
    return dict(model=regression.loss(model_pred, batch.target),
                implicit_last_block=regression.loss(implicit_pred, batch.target), dW_fro_last_token=fro.mean(axis=1))


def _sum_rank(mu: ModelUpdates, dtype) -> jax.Array:
    """``int[L, B]``: rank of Σ_i ΔW_i = (Σ_i u_i) vᵀ of ``fc_in`` (the query reference: one v)."""
    summed = {k: u.sum(axis=2) for k, u in mu.update.u.items()}
    dense_sum = dense(Update(summed, mu.update.v[:, :, 0], mu.update.delta_b[:, :, 0]))
    s = jnp.linalg.svd(dense_sum["fc_in"], compute_uv=False)                 # [L, B, min(h, d)]
    return jnp.sum(s > s[..., :1] * 10 * jnp.finfo(dtype).eps * max(s.shape[-1], 4), axis=-1)


def exactness(model, variables, batch: regression.Tasks, d_x: int, align_tasks: int = 3) -> dict:
    """The heavier probe of a test batch (module docstring), per block ``f[L]`` unless said:
    ``msd``, ``max_abs_err``, ``out_scale`` (max |block output|), ``rank_sum_max``/``rank_sum_min``,
    ``min_f_norm``, ``max_g_over_f``; the losses ``loss_model`` and ``loss_implicit_network`` and
    ``network_max_abs_err`` (``f[]``); ``align_tokens: f[L, align_tasks, N, N]`` and
    ``align_blocks: f[align_tasks, L, L]``. Pure: jit it."""
    cfg = config_of(model)
    L = cfg.n_layers
    mu = updates(model, variables, embeds=batch.tokens)
    diff = implied_all(model, variables, mu) - mu.pieces.out                 # [L, B, N, d]
    rank = _sum_rank(mu, cfg.jnp_dtype)
    f_norm = jnp.linalg.norm(mu.pieces.f[..., 0, :], axis=-1)                # [L, B]
    g_over_f = jnp.max(jnp.linalg.norm(mu.pieces.g, axis=-1), axis=-1) / f_norm
    net_pred = patched_network_prediction(model, variables, mu, batch.tokens[:, -1], d_x)
    model_pred = mu.pieces.out[L - 1][:, -1, d_x]
    first = jax.tree.map(lambda a: a[:, :align_tasks], mu.update)
    last = Update({k: jnp.swapaxes(u[:, :, -1], 0, 1) for k, u in first.u.items()},
                  jnp.swapaxes(first.v[:, :, 0], 0, 1), first.delta_b[0, :, :1])
    return dict(align_tokens=alignment(first), align_blocks=alignment(last),
                loss_model=regression.loss(model_pred, batch.target),
                loss_implicit_network=regression.loss(net_pred, batch.target),
                network_max_abs_err=jnp.max(jnp.abs(net_pred - model_pred)),
                msd=jnp.mean(jnp.square(diff), axis=(1, 2, 3)), max_abs_err=jnp.max(jnp.abs(diff), axis=(1, 2, 3)),
                out_scale=jnp.max(jnp.abs(mu.pieces.out), axis=(1, 2, 3)),
                rank_sum_max=jnp.max(rank, axis=1), rank_sum_min=jnp.min(rank, axis=1),
                min_f_norm=jnp.min(f_norm, axis=1), max_g_over_f=jnp.max(g_over_f, axis=1))


def _check_steps(name: str, values, steps: int) -> list:
    values = list(values)
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t <= steps for t in values):
        raise LiniclError(f"{name} must be ints in 0..steps ({steps}), got {values!r}")
    return values


def train_with_probes(model, variables, *, steps: int, batch: int, n_tokens: int, d_x: int, lr: float, seed: int = 0,
                      msd_steps: Sequence[int] = (), align_steps: Sequence[int] = (), align_tasks: int = 3,
                      compiler_options: Optional[dict] = None, progress: bool = False, desc: str = "train") -> dict:
    """Train ``model`` from ``variables`` with Adam(``lr``) for ``steps`` steps of ``batch`` fresh tasks of
    ``n_tokens`` tokens each (loss on the last token's label coordinate), probing it as it goes.

    Step t (t = 0..steps; t = 0: the initialisation) is the parameters after t updates on a fresh test
    batch (test key t); training batch t + 1 draws from the other half of ``PRNGKey(seed)``. One
    compiled call per step (``compiler_options``: its XLA options, e.g. ``timing.QUICK_COMPILE``)
    gives ``step_metrics`` and the next update; ``exactness`` runs at ``msd_steps`` and ``align_steps``.

    Returns ``{"steps": [0..steps], "curves": {name: list}`` (``CURVES``: ``train_loss`` per update,
    the others per step), ``"msd_steps": {t: exactness without the maps}``, ``"alignment_steps": {t:
    {"tokens", "blocks"}}``, ``"seconds": {"step", "probes"}}`` (compiles included)."""
    for name, value in (("steps", steps), ("batch", batch), ("n_tokens", n_tokens), ("d_x", d_x),
                        ("align_tasks", align_tasks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "steps" else 1):
            raise LiniclError(f"{name} must be a {'nonnegative' if name == 'steps' else 'positive'} int, got {value!r}")
    if align_tasks > batch:
        raise LiniclError(f"align_tasks ({align_tasks}) must be at most batch ({batch})")
    msd_steps, align_steps = _check_steps("msd_steps", msd_steps, steps), _check_steps("align_steps", align_steps, steps)
    cfg = config_of(model)
    opt = optax.adam(lr)

    def tasks(key):
        return regression.sample(key, batch, n_tokens, d_x, d_model=cfg.d_model, dtype=cfg.jnp_dtype)

    def train_step(params, opt_state, key):
        def loss(p, b):
            return regression.loss(regression.readout(_hidden(model, {PARAMS: p}, b.tokens), d_x), b.target)
        value, grads = jax.value_and_grad(loss)(params, tasks(key))
        upd, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, value

    def step(params, opt_state, train_key, test_key):  # the test metrics of params, then one update
        metrics = step_metrics(model, {PARAMS: params}, tasks(test_key), d_x)
        return (*train_step(params, opt_state, train_key), metrics)
    step = jax.jit(step, compiler_options=compiler_options)
    probe = jax.jit(lambda v, key: exactness(model, v, tasks(key), d_x, align_tasks), compiler_options=FAST_COMPILE)

    k_train, k_test = jax.random.split(jax.random.PRNGKey(seed))
    params = variables[PARAMS]
    opt_state = opt.init(params)
    tolist = lambda tree: jax.tree.map(lambda a: np.asarray(a).tolist(), tree)  # noqa: E731
    curves = {k: [] for k in CURVES}
    msd, align = {}, {}
    seconds = dict(step=0.0, probes=0.0)

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*a))
        seconds[name] += time.perf_counter() - t0
        return out

    for t in tqdm(range(steps + 1), desc=desc, disable=not progress):
        test_key = jax.random.fold_in(k_test, t)
        if t in msd_steps or t in align_steps:
            row = tolist(timed("probes", probe, {PARAMS: params}, test_key))
            maps = {k: row.pop(k) for k in ("align_tokens", "align_blocks")}
            if t in msd_steps:
                msd[t] = row
            if t in align_steps:
                align[t] = dict(tokens=maps["align_tokens"], blocks=maps["align_blocks"])
        new_params, new_state, value, metrics = timed("step", step, params, opt_state,
                                                      jax.random.fold_in(k_train, t + 1), test_key)
        for k, val in metrics.items():
            curves[k].append(np.asarray(val).tolist())
        if t < steps:  # the last call only evaluates
            params, opt_state = new_params, new_state
            curves["train_loss"].append(float(value))
    return dict(steps=list(range(steps + 1)), curves=curves, msd_steps=msd, alignment_steps=align, seconds=seconds)


__all__ = ["CURVES", "fig1_config", "last_block_prediction", "patched_network_prediction", "step_metrics",
           "exactness", "train_with_probes"]
