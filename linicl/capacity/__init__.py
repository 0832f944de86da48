"""Recall capacity of the zoo's mixers: one small model per token mixer, trained and evaluated on
multi-query associative recall (Zoology's MQAR) and on in-context linear regression, prompted and
with the prompt converted into weights (``linicl.iclca.convert``).

Modules, one concept each:

* ``mixers``: the seven mixers at matched state sizes (``MIXERS``, ``mixer_config``), the spread of
  fixed decays that also starts the gates (``decays``, ``with_gate_bias``), what a prompt costs
  (``prompt_floats``) and the float64 evaluation copy of a trained model (``eval_model``).
* ``mqar``: MQAR's curriculum (``curriculum``, ``widen``), its training loss (``loss_fn``) and the
  evaluation of prompted against converted predictions (``evaluate``, ``compare``).
* ``regression``: the read-in and read-out around a model (``init``, ``regress``), the training loss,
  the evaluation of prompted against converted predictions and the classical baselines (least
  squares, averaging, zero).

* ``study``: one model per mixer and task: the run's options (``options``, ``FULL``, ``QUICK``), the
  configs and stages they give, training (``train``), the checkpoint of each trained model reused
  under the same settings (``settings``, ``trained``) and the float64 evaluation of every mixer
  (``run``; the tasks in ``TASKS``).
* ``report``: the study's tables and figures.

The training loop itself is ``linicl.training``. ``experiments/recall_capacity.py`` runs them all.
"""
