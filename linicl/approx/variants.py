"""Named variants of the approximate conversion ``linicl.iclca.convert_approx``, and the converters
that apply them.

A variant is a ``spec``: ``convert_approx``'s keyword arguments (``kernel`` and any of ``form``,
``lam``, ``sinks``), plus ``fit: True`` for a least-squares fit of (B, b) on sample inputs
(``fit_inputs``). ``variant_specs`` names them as the approximate-conversion experiment does:

* ``<kernel>``: the kernel's sums over the prompt (``taylor2``, ``prf``, ``elu+1``; shared normaliser);
* ``lsq-<kernel>``: (B, b) fitted by least squares on other queries of the task;
* ``<kernel>+sinks<s>``: the first s prompt tokens kept as exact keys;
* ``<kernel>-mix<lam>``: the lambda-mix normaliser.

``selection_specs`` names selections of the prompt's exact keys and values (``convert_approx(keep=...)``,
``linicl.selection``) as ``approx.selected.method_name`` does: ``reconstruction@0.25`` keeps, besides
the sinks and the last tokens, what KVzip's score chooses, in a quarter of the prompt's KV floats;
``recent@0.25`` is the sliding window (with sinks) of the same floats. A selection converts one prompt
at a time (its kept sets have data-dependent sizes).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from linicl import iclca
from linicl.approx.selected import method_name
from linicl.errors import LiniclError

__all__ = ["variant_specs", "selection_specs", "convert_variant", "converters"]


def variant_specs(kernels: Sequence[str] = ("taylor2", "prf", "elu+1"), lsq_kernels: Sequence[str] = ("prf",), *,
                  extra_kernel: str = "taylor2", sinks: int = 4, mix: Optional[float] = 0.5) -> dict:
    """``{name: spec}`` (module docstring): one plain variant per kernel of ``kernels``, one
    least-squares one per kernel of ``lsq_kernels``, and with ``extra_kernel`` a sinks variant (none
    when ``sinks`` <= 0) and a mix variant of ``lam = mix`` (none when ``mix`` is None). The settings
    themselves are checked by ``convert_approx`` when a variant is applied."""
    specs = {}
    for kernel in kernels:
        specs[kernel] = dict(kernel=kernel)
    for kernel in lsq_kernels:
        specs[f"lsq-{kernel}"] = dict(kernel=kernel, fit=True)
    if sinks > 0:
        specs[f"{extra_kernel}+sinks{sinks}"] = dict(kernel=extra_kernel, sinks=sinks)
    if mix is not None:
        specs[f"{extra_kernel}-mix{mix:g}"] = dict(kernel=extra_kernel, form="mix", lam=mix)
    return specs


def selection_specs(scores: Sequence[str], keeps: Sequence, *, sinks: int, window: int,
                    instruction: Optional[Sequence[int]] = None) -> dict:
    """``{"<score>@<keep>": spec}`` for every score of ``scores`` (``names.SELECTION_SCORES``) at every
    budget of ``keeps`` (shares of the prompt's KV floats, or ints: tokens per KV head), each with its
    default allocation, the ``sinks`` first and ``window`` last prompt tokens always kept, and what is
    not kept dropped (``kernel="none"``). ``instruction``: "reconstruction"'s re-read instruction
    (token ids, e.g. of ``selection.REPEAT_INSTRUCTION``). ``convert_approx`` checks the settings when a
    spec is applied."""
    if not scores or not keeps:
        raise LiniclError(f"selection_specs needs at least one score and one budget, got scores={list(scores)}, "
                          f"keeps={list(keeps)}")
    specs = {}
    for score in scores:
        for keep in keeps:
            spec = dict(kernel="none", keep=keep, score=score, sinks=sinks, window=window)
            if score == "reconstruction" and instruction is not None:
                spec["instruction"] = [int(i) for i in instruction]
            specs[method_name(score, keep)] = spec
    return specs


def convert_variant(model, variables, prompt, spec: Mapping, *, n_features: int = 256, ridge: float = 1e-6,
                    seed: int = 0, fit_inputs=None) -> dict:
    """``iclca.convert_approx`` of ``prompt`` (``int[n]``, or a batch of prompts ``int[b, n]``, row i
    serving the query row i) with the variant ``spec``'s settings; the converted variables.

    ``n_features``, ``ridge`` and ``seed`` go to ``convert_approx`` (random features, the fit's ridge).
    A sinks variant keeps at most the prompt's n tokens. A least-squares variant (``spec["fit"]``)
    needs ``fit_inputs: int[m, t]``, queries other than the test ones.
    """
    prompt = np.asarray(prompt)
    if prompt.ndim not in (1, 2):
        raise LiniclError(f"prompt must be int[n] or int[batch, n], got shape {prompt.shape}")
    prompt = prompt if prompt.ndim == 2 else prompt[None]
    kw = {k: v for k, v in spec.items() if k != "fit"}
    if "sinks" in kw and "keep" not in kw:  # a selection's sinks are checked, not cut
        kw["sinks"] = min(kw["sinks"], prompt.shape[1])
    if spec.get("fit"):
        if fit_inputs is None:
            raise LiniclError("no fit inputs: a least-squares variant needs fit_inputs (int[m, t])")
        kw["fit_inputs"] = jnp.asarray(fit_inputs, jnp.int32)
    return iclca.convert_approx(model, variables, jnp.asarray(prompt, jnp.int32), n_features=n_features,
                                seed=seed, ridge=ridge, **kw)


def converters(model, variables, specs: Mapping[str, Mapping], *, n_features: int = 256, ridge: float = 1e-6,
               seed: int = 0) -> dict:
    """``{name: (convert, fit)}`` for every variant of ``specs``: ``convert(prompt, fit_inputs) ->
    variables`` (``convert_variant`` with these settings) and whether it fits (then it needs
    ``fit_inputs``, one prompt at a time). The form ``linicl.fidelity.copy_test`` and
    ``linicl.approx.evaluation.evaluate_task`` take."""
    def one(spec):
        return lambda prompt, fit_inputs: convert_variant(model, variables, prompt, spec, n_features=n_features,
                                                          ridge=ridge, seed=seed, fit_inputs=fit_inputs)
    return {name: (one(spec), bool(spec.get("fit")) or spec.get("keep") is not None)
            for name, spec in specs.items()}
