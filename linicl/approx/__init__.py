"""Approximate conversion of a softmax model's demonstration prompt (``linicl.iclca.convert_approx``)
evaluated against the prompted model: how much of the prompt survives as kernel-approximated bias
terms.

Modules, one concept each:

* ``variants``: the named variants of ``convert_approx`` (``variant_specs``: plain kernels,
  least-squares fits, attention sinks, the lambda-mix normaliser; ``selection_specs``: selections of
  the prompt's exact keys and values at budgets), one application
  (``convert_variant``) and the converters of a model (``converters``), in the form
  ``linicl.fidelity.copy_test`` takes.
* ``evaluation``: one k-shot prompt per (task, k) stored by every converter and the test queries read
  alone, scored against the prompted model (``evaluate_task``: accuracy, agreement, KL, per-layer
  hook_z error; ``query_window``, ``task_targets``), and the summaries over cells (``correctness``
  for ``linicl.recovery.recovery``, ``layer_error_summary``).
* ``report``: the tables and figures of the experiment's report.
* ``selected``: selections of a long prompt's exact keys and values (``convert_approx(keep=...)``)
  on the long-prompt probes (``select_prompt``, ``selected_rows``, ``selection_table``).

``experiments/approx_conversion.py`` runs them on SmolLM2 or Gemma 3.
"""

from linicl.approx.evaluation import (BASE, TaskTargets, correctness, evaluate_task, layer_error_summary,
                                      query_window, task_targets)
from linicl.approx.variants import convert_variant, converters, selection_specs, variant_specs

__all__ = ["variant_specs", "selection_specs", "convert_variant", "converters", "BASE", "query_window", "TaskTargets",
           "task_targets", "evaluate_task", "correctness", "layer_error_summary"]
