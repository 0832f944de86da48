"""Linearizing a pretrained softmax LM by attention transfer (Hedgehog arXiv 2402.04347, LoLCATs
arXiv 2410.10254; linearization.md), so that ``linicl.iclca.convert`` is exact on a model that knows
language.

* ``student``: the linear-attention student of a softmax teacher (hedgehog feature maps, an exact
  softmax window and sinks; ``student_config``), its variables (the teacher's weights plus the new
  maps, ``student_variables``), and which parameters train (``split``/``merge``).
* ``text``: training text that stays offline and away from evaluation queries (few-shot prompts
  built from the data sets' training splits, rendered as one stream cut into sequences; or text
  sampled from the teacher itself).
* ``transfer``: stage 1, attention transfer: every layer's attention output matched to the
  teacher's on the teacher's own inputs (one teacher pass per batch, all layers in one step),
  resumable, data parallel over the visible devices.
* ``lora`` and ``distill``: stage 2 (optional), a low-rank correction of the attention projections
  trained so that the whole student's next-token distribution matches the teacher's (KL), merged
  into the kernels: the student stays a finite-state zoo model.
* ``stages``: each stage as one call that also writes the maps file and returns the stage's record.
* ``quality``: next-token loss by position bucket, to compare the student with its teacher (and with
  itself read with other windows and sinks, ``window_variants``).
* ``icl``: in-context learning of the teacher, the student and the student with its demonstrations
  converted into weights, per (task, k) cell; the share of the teacher's few-shot gain each keeps.
* ``cost``: a converted query's time and state size against the prompted one's, by prompt length.
* ``baselines``: the window baselines at the student's state size (``student_budget``,
  ``equal_window``) and the methods of a long-prompt comparison (``compared_methods``).
* ``long_prompts``: each method scored on long prompts (passkey, key-value, many-shot), the converted =
  prompted check, the key-line oracle and paired differences against the equal-state window.
* ``maps``: save and load the trained maps (one safetensors file plus its settings); ``smollm2()``,
  ``gemma3()``: linearized SmolLM2-135M-Instruct and Gemma 3 270M with the maps shipped in the package.
"""

from linicl.linearize import lora
from linicl.linearize.baselines import (compared_methods, equal_cached_window, equal_window, student_budget,
                                       window_floats)
from linicl.linearize.distill import DistillHistory, kl_to_teacher, train_lora
from linicl.linearize.maps import GEMMA3_MAPS, SMOLLM2_MAPS, gemma3, load_maps, save_maps, smollm2
from linicl.linearize.cost import conversion_cost
from linicl.linearize.long_prompts import (converted_check, oracle_window, score_method, scored_row,
                                          versus_equal_window)
from linicl.linearize.icl import check_scorable, gains, icl_cell, icl_table, pooled_gain
from linicl.linearize.quality import held_out_losses, next_token_loss, window_variants
from linicl.linearize.stages import checkpoint_stage, distill_stage, transfer_stage
from linicl.linearize.student import merge, split, student_config, student_variables, trained_layers, window_config
from linicl.linearize.text import bos_for, retrieval_sequences, sampled_sequences, training_sequences, training_text
from linicl.linearize.transfer import History, maps_from_checkpoint, teacher_targets, train_maps

__all__ = ["student_config", "window_config", "student_variables", "trained_layers", "split", "merge", "training_sequences",
           "retrieval_sequences", "sampled_sequences", "training_text", "bos_for", "transfer_stage", "checkpoint_stage",
           "distill_stage", "held_out_losses", "window_variants", "check_scorable", "icl_cell", "icl_table", "gains",
           "pooled_gain", "conversion_cost",
           "window_floats", "student_budget", "equal_window", "equal_cached_window", "compared_methods",
           "converted_check", "scored_row", "score_method", "oracle_window", "versus_equal_window",
           "teacher_targets", "train_maps", "maps_from_checkpoint", "History", "lora", "train_lora", "kl_to_teacher",
           "DistillHistory", "next_token_loss", "save_maps", "load_maps", "smollm2", "SMOLLM2_MAPS", "gemma3", "GEMMA3_MAPS"]
