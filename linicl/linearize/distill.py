"""Stage 2 of linearization: a low-rank correction of the student's attention projections
(``linicl.linearize.lora``) trained to make the whole student predict like its teacher
(linearization.md section 4; LoLCATs arXiv 2410.10254).

Stage 1 matches every layer on the *teacher's* inputs; run end to end, the student's errors compound
through the layers. Stage 2 trains on the student's own forward pass: for a batch of text the teacher
runs once and gives its logits, and the correction minimises the mean over positions of

    KL(p_teacher || p_student) = sum_v p_teacher(v) (log p_teacher(v) - log p_student(v)).

Everything else stays frozen (the teacher's weights and the stage-1 maps). The student is run with the
correction merged into its kernels (``lora.apply``), so it stays an ordinary finite-state zoo model.
Seeds, checkpoints and data parallelism work as in stage 1 (``linicl.linearize.transfer``): the same
settings resume bit-identically, and a checkpoint of other settings (or of other text, teacher
weights or maps) is refused.

Mixed precision (``compute_dtype="bfloat16"``): the correction, its Adam state and the frozen weights
stay in their own dtype (the master copy, float32 as loaded); each step casts the corrected weights to
``compute_dtype`` and runs the student in it (a copy of its config with that dtype), and the KL is taken
in float32. Gradients reach the float32 correction through the cast. The teacher's targets stay in the
teacher's own dtype. ``remat``: pass ``student.clone(remat=True)`` (``linicl.nn.transformer``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from linicl import checkpoint as ckpt
from linicl import compiled
from linicl.linearize import lora as L
from linicl.linearize.transfer import check_training, input_checksums, step_batch
from linicl.names import PARAMS
from linicl.parallel import place, place_like, shard_batch, step_shardings
from linicl.precision import in_compute_dtype

TRAINER = "linicl.linearize.train_lora"


class DistillHistory(NamedTuple):
    """Per logged step: the step and the batch's mean KL(teacher || student) in nats."""

    step: list
    kl: list


def _teacher_logits_fn(teacher):
    def run(variables, tokens):
        return teacher.apply(variables, tokens).astype(jnp.float32)
    return compiled.get(("linearize.teacher_logits", teacher), lambda: jax.jit(run))


def kl_to_teacher(student_logits, teacher_logits):
    """``f[]``: mean over positions of KL(teacher || student), logits ``f[batch, T, vocab]``."""
    lp_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    lp_s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(lp_t) * (lp_t - lp_s), axis=-1))


def _step_fn(student, tx, out_shardings=None, compute_dtype=None):
    model, cast = in_compute_dtype(student, compute_dtype)

    def loss(correction, params, tokens, target):
        return kl_to_teacher(model.apply({PARAMS: cast(L.apply(params, correction))}, tokens), target)

    def step(correction, opt, params, tokens, target):
        kl, grads = jax.value_and_grad(loss)(correction, params, tokens, target)
        updates, opt = tx.update(grads, opt, correction)
        return optax.apply_updates(correction, updates), opt, kl
    return jax.jit(step, out_shardings=out_shardings)


def _settings(student, sequences, rank, targets, steps, batch_size, lr, seed, compute_dtype) -> dict:
    extra = {} if compute_dtype is None else {"compute_dtype": compute_dtype}  # older checkpoints stay valid
    return dict(trainer=TRAINER, student=student.cfg.describe(), rank=rank, targets=list(targets), steps=steps,
                batch_size=batch_size, lr=lr, seed=seed, sequences=list(sequences.shape), **extra)


def train_lora(teacher, teacher_variables, student, student_variables, sequences, *, rank: int = 8,
               targets: Sequence[str] = L.TARGETS, steps: int = 100, batch_size: int = 4, lr: float = 1e-3,
               seed: int = 0, log_every: int = 10, checkpoint=None, checkpoint_every: int = 25,
               progress: bool = True, mesh=None, compute_dtype: Optional[str] = None):
    """Stage 2: train a rank-``rank`` correction of the student's ``targets`` projections so that the
    student's next-token distribution matches the teacher's on ``sequences: int32[n, T]``.
    ``compute_dtype``: run the student in this dtype (e.g. ``"bfloat16"``) with the correction kept in
    the weights' own (module docstring).

    Returns ``(student_variables, correction, DistillHistory)``: the variables with the correction
    merged into the kernels (an ordinary student), and the correction itself (``lora.init``'s tree;
    ``save_maps(..., lora=correction)`` stores it with the maps)."""
    sequences, mesh = check_training("train_lora", teacher, student, sequences, steps, batch_size, mesh)
    in_compute_dtype(student, compute_dtype)  # refuses a bad dtype before any work
    params = student_variables[PARAMS]
    correction = L.init(params, rank=rank, seed=seed, targets=targets)
    tx = optax.adam(lr)
    opt = tx.init(correction)
    history, start = DistillHistory([], []), 0
    settings = _settings(student, sequences, rank, tuple(targets), steps, batch_size, lr, seed, compute_dtype)
    if checkpoint is not None:  # the stage-1 maps are in the student's params: other maps are refused
        settings.update(input_checksums(teacher_variables, params, sequences))
    if checkpoint is not None and ckpt.exists(checkpoint):
        state, meta = ckpt.load(checkpoint, {"lora": correction, "opt": opt}, settings=settings)
        correction, opt = jax.tree_util.tree_map(jnp.asarray, (state["lora"], state["opt"]))
        start, history = int(meta["step"]), DistillHistory(*meta["history"])
    # parameters and optimiser state replicated, or sharded on a mesh with a "model" axis (linicl.parallel)
    params_r, teacher_variables = place(params, mesh, PARAMS), place(teacher_variables, mesh)
    correction, opt = place(correction, mesh, PARAMS), place_like(opt, correction, mesh)
    step_fn = _step_fn(student, tx, step_shardings(mesh, correction, opt, n_logs=1), compute_dtype)
    teacher_fn = _teacher_logits_fn(teacher)
    bar = tqdm(total=steps, initial=start, desc="stage 2 (LoRA)", disable=not progress)
    for t in range(start, steps):
        tokens = shard_batch(step_batch(sequences, t, batch_size, seed + 1), mesh)
        target = teacher_fn(teacher_variables, tokens)
        correction, opt, kl = step_fn(correction, opt, params_r, tokens, target)
        if t % log_every == 0 or t == steps - 1:
            history.step.append(t)
            history.kl.append(float(kl))
            bar.set_postfix(kl=f"{float(kl):.4f}")
        bar.update(1)
        if checkpoint is not None and ((t + 1) % checkpoint_every == 0 or t == steps - 1):
            ckpt.save(checkpoint, {"lora": correction, "opt": opt}, settings=settings,
                      meta={"step": t + 1, "history": list(history)})
    bar.close()
    correction = jax.tree_util.tree_map(jnp.asarray, correction)
    return {**student_variables, PARAMS: L.apply(params, correction)}, correction, history


__all__ = ["DistillHistory", "kl_to_teacher", "train_lora"]
