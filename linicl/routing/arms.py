"""The arms of the ICR comparison (routing.md; ``experiments/routing.py``): one trained router each,
differing in one thing at a time from ``ICR``, the method as the paper specifies it.

An ``Arm`` names which basis the router routes (``ICR_BASES``: the PIDs, or the paper's random-basis
control), at which bias size (``BIAS_SCALES``: the paper's bias as written, or on the logit scale,
where a PID and a random direction move the logits alike), with which cross-entropy (``ICR_TARGETS``:
over the vocabulary, or over the label words) and what it reads (``ICR_INPUTS``: the LM's own
mean-pooled residual entering the first routed layer, or the paper's frozen all-MiniLM-L6-v2 embedding
of the zero-shot prompt's text).
"""

from __future__ import annotations

from typing import NamedTuple


class Arm(NamedTuple):
    """One router of the comparison: ``basis`` (``linicl.names.ICR_BASES``), bias ``scale``
    (``BIAS_SCALES``), CE ``target`` (``ICR_TARGETS``), router input ``reads`` (``ICR_INPUTS``)."""
    basis: str
    scale: str
    target: str
    reads: str


ARMS = {"ICR": Arm("pids", "paper", "vocab", "lm"),
        "ICR-random": Arm("random", "paper", "vocab", "lm"),
        "ICR-logit": Arm("pids", "logit", "vocab", "lm"),
        "ICR-logit-random": Arm("random", "logit", "vocab", "lm"),  # the fair control of ICR-logit
        "ICR-logit-labels": Arm("pids", "logit", "labels", "lm"),
        "ICR-minilm": Arm("pids", "paper", "vocab", "minilm"),
        "ICR-logit-minilm": Arm("pids", "logit", "vocab", "minilm")}
# a PID arm -> its random-basis control (the same arm but the basis): ``summarise`` compares them on OOD
RANDOM_CONTROLS = {"ICR-logit": "ICR-logit-random", "ICR": "ICR-random"}
