"""Both stages of linearization as one call each, the way a run keeps them: train (or take the maps a
stage-1 checkpoint holds), write the maps file, and return the stage's record.

A record is a JSON-ready dict: the loss history (``History._asdict()`` or ``DistillHistory._asdict()``),
the tokens the stage trained on (steps x batch size x sequence length), and the wall time of a stage
that trained. The maps file (``save_maps``) carries in its meta what rebuilds that count (``tokens``,
``steps``, ``seq_len``, ``teacher``; stage 2 adds ``stage2_tokens``, ``stage2_steps``, ``lora_rank``) and,
after stage 2, the correction beside the maps.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from linicl.errors import LiniclError
from linicl.linearize.distill import train_lora
from linicl.linearize.maps import save_maps
from linicl.linearize.transfer import maps_from_checkpoint, train_maps


def _rows(sequences) -> np.ndarray:
    sequences = np.asarray(sequences, np.int32)
    if sequences.ndim != 2:
        raise LiniclError(f"sequences must be int32[n, T] (training_text), got shape {sequences.shape}")
    return sequences


def transfer_stage(teacher, teacher_variables, student, student_variables, sequences, *, maps_path,
                   steps: int, batch_size: int, lr: float, seed: int = 0, progress: bool = True,
                   checkpoint=None, teacher_name: str = "SmolLM2"):
    """Stage 1 (``train_maps`` on ``sequences: int32[n, T]``, resumable from ``checkpoint``), then the
    maps written to ``maps_path``. Returns ``(student_variables, record)`` with the record's
    ``history``, ``wall_s`` (training, compiles included), ``tokens_seen`` (steps x batch_size x T) and
    ``train_sequences`` ([n, T])."""
    sequences = _rows(sequences)
    t0 = time.perf_counter()
    variables, hist = train_maps(teacher, teacher_variables, student, student_variables, sequences, steps=steps,
                                 batch_size=batch_size, lr=lr, seed=seed, progress=progress, checkpoint=checkpoint)
    wall = time.perf_counter() - t0
    tokens = steps * batch_size * sequences.shape[1]
    save_maps(maps_path, student, variables,
              meta=dict(tokens=tokens, steps=steps, seq_len=sequences.shape[1], teacher=teacher_name))
    return variables, dict(history=hist._asdict(), wall_s=wall, tokens_seen=tokens,
                           train_sequences=list(sequences.shape))


def checkpoint_stage(checkpoint, student, student_variables, *, maps_path, teacher_name: str = "SmolLM2"):
    """Stage 1 as far as a checkpoint of ``train_maps`` got (an unfinished or stopped run): its maps
    written to ``maps_path``. Returns ``(student_variables, record)`` with the record's ``history``,
    ``tokens_seen``, ``steps_reached``, ``of_steps`` (the run's planned steps) and ``checkpoint``."""
    variables, info = maps_from_checkpoint(checkpoint, student, student_variables)
    settings = info["settings"]
    tokens = info["step"] * settings["batch_size"] * settings["sequences"][1]
    save_maps(maps_path, student, variables, meta=dict(tokens=tokens, steps=info["step"], teacher=teacher_name))
    return variables, dict(history=info["history"], tokens_seen=tokens, steps_reached=info["step"],
                           of_steps=settings["steps"], checkpoint=checkpoint)


def distill_stage(teacher, teacher_variables, student, student_variables, sequences, *, maps_path, rank: int,
                  steps: int, batch_size: int, lr: float, seed: int = 0, progress: bool = True, checkpoint=None,
                  stage1_tokens: Optional[int] = None, teacher_name: str = "SmolLM2"):
    """Stage 2 (``train_lora`` of the stage-1 student on ``sequences: int32[n, T]``, resumable from
    ``checkpoint``), then the maps and the correction written together to ``maps_path``
    (``stage1_tokens``: stage 1's count, kept in the file's meta as ``tokens``). Returns the corrected
    ``(student_variables, record)`` with the record's ``history`` (the KL), ``wall_s``, ``tokens_seen``,
    ``rank`` and ``lr``."""
    sequences = _rows(sequences)
    t0 = time.perf_counter()
    variables, correction, hist = train_lora(
        teacher, teacher_variables, student, student_variables, sequences, rank=rank, steps=steps,
        batch_size=batch_size, lr=lr, seed=seed, progress=progress, checkpoint=checkpoint)
    tokens = steps * batch_size * sequences.shape[1]
    meta = dict(tokens=stage1_tokens, stage2_tokens=tokens, stage2_steps=steps, lora_rank=rank,
                seq_len=sequences.shape[1], teacher=teacher_name)
    save_maps(maps_path, student, variables, meta=meta, lora=correction)
    return variables, dict(history=hist._asdict(), wall_s=time.perf_counter() - t0, tokens_seen=tokens,
                           rank=rank, lr=lr)


__all__ = ["transfer_stage", "checkpoint_stage", "distill_stage"]
