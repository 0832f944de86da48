"""Stage 1 of linearization: attention transfer (linearization.md section 4).

The LM stays frozen. For a batch of text the teacher runs once and gives, for every block l that has
maps (``trained_layers``: every block, or a model's global layers when it has local ones, which the
student keeps exact), the residual entering it, ``X_l = blocks.l.hook_resid_pre``, and its attention output
``A_l = blocks.l.hook_attn_out``. The student's block l (the zoo's own ``Block`` with the student's
config: same norms, projections, rope) is then run on the *teacher's* X_l, and its attention output
is matched to A_l:

    L = sum_l mean((A_l^student - A_l)^2) / mean(A_l^2)

Given the teacher's inputs the layers are independent (each term depends only on its own maps), so
one teacher pass trains all of them, and no student error compounds during training. Only the maps
and gates train (``linicl.linearize.student.split``); Adam.

The batch is sharded over the visible devices (``linicl.parallel``; on one device nothing moves), so
the same code runs on a CPU, a GPU or a TPU host. With ``checkpoint=`` the trained parameters, the
optimiser state, the step and the loss history are saved every ``checkpoint_every`` steps
(``linicl.checkpoint``); a run started again with the same settings resumes from there and ends with
the same parameters as an uninterrupted one (batches are a function of the seed and the step).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from linicl import checkpoint as ckpt
from linicl import compiled
from linicl.errors import LiniclError
from linicl.interventions import capture
from linicl.linearize.student import merge, split, trained_layers
from linicl.names import INTERMEDIATES, PARAMS, block_site, layer_scope
from linicl.nn.block import Block
from linicl.precision import in_compute_dtype
from linicl.parallel import data_size, device_mesh, place, place_like, shard_batch, step_shardings


class History(NamedTuple):
    """Per logged step: the step, the total relative loss and the relative losses of the trained layers
    (``trained_layers``, in order)."""

    step: list
    loss: list
    layers: list


def _teacher_fn(teacher):
    layers = trained_layers(teacher.cfg)
    names = [block_site(l, h) for l in layers for h in ("hook_resid_pre", "hook_attn_out")]

    def run(variables, tokens):
        _, acts = capture(teacher, variables, tokens, names=names, hidden=True)
        X = jnp.stack([acts[names[2 * i]] for i in range(len(layers))])
        A = jnp.stack([acts[names[2 * i + 1]] for i in range(len(layers))])
        return X, A
    return compiled.get(("linearize.teacher", teacher), lambda: jax.jit(run))


def teacher_targets(teacher, variables, tokens):
    """``(X, A)``, each ``f[len(trained_layers), batch, T, d_model]``: the residual entering each trained
    block and the block's attention output, from one teacher pass over ``tokens: int32[batch, T]``."""
    return _teacher_fn(teacher)(variables, jnp.asarray(tokens, jnp.int32))


def _attn_out(cfg, block_params, x, positions):
    """The student block's attention output on the teacher's block input ``x: f[b, T, d]``."""
    _, state = Block(cfg).apply({PARAMS: block_params}, x, positions, mutable=[INTERMEDIATES])
    return state[INTERMEDIATES]["hook_attn_out"][-1]


def layer_losses(cfg, params, X, A):
    """``f[len(trained_layers)]``: mean((A_student - A)^2) / mean(A^2) per trained block (``X``, ``A``
    from ``teacher_targets``)."""
    positions = jnp.arange(X.shape[2], dtype=jnp.int32)
    out = []
    for i, l in enumerate(trained_layers(cfg)):
        s = _attn_out(cfg.layer_config(l), params[layer_scope(l)], X[i], positions).astype(jnp.float32)
        t = A[i].astype(jnp.float32)
        out.append(jnp.mean((s - t) ** 2) / jnp.mean(t ** 2))
    return jnp.stack(out)


def _step_fn(student, tx, out_shardings=None, compute_dtype=None):
    model, cast = in_compute_dtype(student, compute_dtype)
    cfg = model.cfg

    def loss(trained, frozen, X, A):  # the teacher's X enters in the compute dtype, A stays as it is
        per_layer = layer_losses(cfg, cast(merge(trained, frozen)), X.astype(cfg.jnp_dtype), A)
        return jnp.sum(per_layer), per_layer

    def step(trained, frozen, opt, X, A):
        (total, per_layer), grads = jax.value_and_grad(loss, has_aux=True)(trained, frozen, X, A)
        updates, opt = tx.update(grads, opt, trained)
        return optax.apply_updates(trained, updates), opt, total, per_layer
    return jax.jit(step, out_shardings=out_shardings)


def step_batch(sequences: np.ndarray, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The sequences of one step: epoch-wise permutations drawn from the seed (resumable)."""
    n = len(sequences)
    per_epoch = max(1, n // batch_size)
    epoch, j = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return sequences[order[j * batch_size:(j + 1) * batch_size]]


def check_training(who: str, teacher, student, sequences, steps, batch_size, mesh):
    """``(sequences as int32[n, T], mesh)`` after checking a training loop's arguments (both stages)."""
    if student.cfg.attention != "linear" or teacher.cfg.attention != "softmax":
        raise LiniclError(f"{who} needs a softmax teacher and its linear student (student_config)")
    if not isinstance(steps, int) or steps < 1 or not isinstance(batch_size, int) or batch_size < 1:
        raise LiniclError(f"steps and batch_size must be positive ints, got {steps!r}, {batch_size!r}")
    sequences = np.asarray(sequences, np.int32)
    if sequences.ndim != 2 or len(sequences) < batch_size:
        raise LiniclError(f"sequences must be int32[n >= batch_size, T], got shape {sequences.shape}")
    mesh = device_mesh() if mesh is None else mesh
    if batch_size % data_size(mesh):
        raise LiniclError(f"batch_size ({batch_size}) must divide by the mesh's {data_size(mesh)} data shards")
    return sequences, mesh


def input_checksums(teacher_variables, student_params, sequences) -> dict:
    """What a resumed run must start from again (both stages), as checkpoint settings: content hashes
    (``linicl.checkpoint.checksum``) of the training text ``int32[n, T]``, of the teacher's variables
    and of the student's parameters at the start (its frozen weights and its starting maps). Shapes or
    sums would pass text with its rows reordered, or another teacher of the same architecture."""
    return dict(data_sha256=ckpt.checksum(sequences), teacher_sha256=ckpt.checksum(teacher_variables),
                student_sha256=ckpt.checksum(student_params))


def _settings(student, sequences, steps, batch_size, lr, seed, compute_dtype=None) -> dict:
    extra = {} if compute_dtype is None else {"compute_dtype": compute_dtype}  # older checkpoints stay valid
    return dict(trainer="linicl.linearize.train_maps", student=student.cfg.describe(),
                window=student.cfg.window, sinks=student.cfg.sinks, feature_size=student.cfg.feature_size,
                rope_on=student.cfg.rope_on, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                sequences=list(sequences.shape), **extra)


def train_maps(teacher, teacher_variables, student, student_variables, sequences, *, steps: int = 200,
               batch_size: int = 16, lr: float = 1e-2, seed: int = 0, log_every: int = 10,
               checkpoint=None, checkpoint_every: int = 25, progress: bool = True, mesh=None,
               compute_dtype=None):
    """Attention transfer: train the student's maps (and gates) so that every block's attention output
    matches the teacher's on the teacher's inputs. ``sequences: int32[n, T]`` (``training_sequences``).
    ``compute_dtype`` (e.g. ``"bfloat16"``): the student's blocks run in it, the maps and Adam's state
    stay in the weights' own dtype (mixed precision, as ``train_lora``'s).

    Returns ``(student_variables, History)``. ``checkpoint``: a file path to save to and resume from
    (a file of other settings, text, teacher weights or starting maps is refused, naming the
    difference; so is one holding NaN)."""
    sequences, mesh = check_training("train_maps", teacher, student, sequences, steps, batch_size, mesh)
    in_compute_dtype(student, compute_dtype)  # refuses a bad dtype before any work
    trained, frozen = split(student_variables[PARAMS])
    tx = optax.adam(lr)
    opt = tx.init(trained)
    history = History([], [], [])
    start = 0
    settings = _settings(student, sequences, steps, batch_size, lr, seed, compute_dtype)
    if checkpoint is not None:
        settings.update(input_checksums(teacher_variables, student_variables[PARAMS], sequences))
    if checkpoint is not None and ckpt.exists(checkpoint):
        state, meta = ckpt.load(checkpoint, {"trained": trained, "opt": opt}, settings=settings)
        trained, opt = jax.tree_util.tree_map(jnp.asarray, (state["trained"], state["opt"]))
        start, history = int(meta["step"]), History(*meta["history"])
    # parameters and optimiser state replicated, or sharded on a mesh with a "model" axis (linicl.parallel)
    frozen, teacher_variables = place(frozen, mesh, PARAMS), place(teacher_variables, mesh)
    trained, opt = place(trained, mesh, PARAMS), place_like(opt, trained, mesh)
    step_fn = _step_fn(student, tx, step_shardings(mesh, trained, opt, n_logs=2), compute_dtype)
    bar = tqdm(total=steps, initial=start, desc="attention transfer", disable=not progress)
    for t in range(start, steps):
        tokens = shard_batch(step_batch(sequences, t, batch_size, seed), mesh)
        X, A = teacher_targets(teacher, teacher_variables, tokens)
        trained, opt, total, per_layer = step_fn(trained, frozen, opt, X, A)
        if t % log_every == 0 or t == steps - 1:
            history.step.append(t)
            history.loss.append(float(total))
            history.layers.append([float(x) for x in per_layer])
            bar.set_postfix(loss=f"{float(total) / len(per_layer):.4f}/layer")
        bar.update(1)
        if checkpoint is not None and ((t + 1) % checkpoint_every == 0 or t == steps - 1):
            ckpt.save(checkpoint, {"trained": trained, "opt": opt}, settings=settings,
                      meta={"step": t + 1, "history": list(history)})
    bar.close()
    params = merge(jax.tree_util.tree_map(jnp.asarray, trained), student_variables[PARAMS])
    return {**student_variables, PARAMS: params}, history


def maps_from_checkpoint(path, student, student_variables):
    """The maps a stage-1 checkpoint holds, finished or not: ``(student_variables, info)`` with
    ``info = {"step", "settings", "history"}`` (the step it reached, the run's settings and its loss
    history), to evaluate a run that is still going or was stopped."""
    head = ckpt.header(path)
    if head.settings.get("trainer") != "linicl.linearize.train_maps":
        raise LiniclError(f"{path} is not a stage-1 checkpoint of linicl.linearize.train_maps")
    trained, _ = split(student_variables[PARAMS])
    template = {"trained": trained, "opt": optax.adam(head.settings["lr"]).init(trained)}
    state, meta = ckpt.load(path, template, settings=head.settings)
    params = merge(jax.tree_util.tree_map(jnp.asarray, state["trained"]), student_variables[PARAMS])
    info = dict(step=int(meta["step"]), settings=head.settings, history=History(*meta["history"])._asdict())
    return {**student_variables, PARAMS: params}, info


__all__ = ["History", "teacher_targets", "layer_losses", "step_batch", "check_training", "input_checksums", "train_maps", "maps_from_checkpoint"]
