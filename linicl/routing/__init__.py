"""In-Context Routing (ICR, arXiv 2509.22854): principal ICL directions and a trained router.

Few-shot prompts change where attention goes. ICR reproduces that zero-shot with a low-rank,
input-conditioned bias on the attention logits of the last third of the layers (routing.md):

    Z_q = Q U_q,  Z_k = K U_k                      (Q, K: the layer's q/k projections, concatenated
    B   = Z_q diag(alpha(x)) Z_k^T                  over heads, before rope; U: the PIDs)
    scores[h] = q_h.k_h / sqrt(d) + gamma_h(x) B    -> causal mask -> softmax

Modules, one concept each:

* ``pids``: ``extract_pids``, PCA (rank r = 8, centred by default) of the last-token q and k of
  class-balanced few-shot prompts, per routed layer (= ``fit_pids(pid_activations(...))``, to collect
  in parts); ``PIDs.save`` / ``PIDs.load``;
  ``random_basis``, the paper's control; ``on_logit_scale``, the bias centred, whitened and scaled so
  that one direction at |alpha| = 1 moves a layer's logits by one std of the model's own (an option
  beside the paper's unscaled bias, ``PIDs.bias``): PIDs and a random basis at the same bias size.
* ``router``: ``Router``, a Flax module mapping a frozen representation of the zero-shot query to
  alpha = tanh(.) per layer and direction and gamma = sigmoid(.) per layer and head. The default
  representation is the LM's own hidden state entering the first routed layer, mean-pooled over the
  query's tokens but the first (the attention sink; ``router_input``); the forward pass computes it
  anyway, so no sentence encoder is needed. The paper's input, a frozen all-MiniLM-L6-v2 embedding of
  the query (``linicl.lm.minilm``), is the other option: ``prepare(e=...)`` stores one per query, the
  router takes its width (``make_router(d_in=)``, ``input_width``) and ``icr_forward(embedded=True)``
  reads it from the evaluation's ``extras``; ``icr_forward(cached=True)`` reads the residual entering the
  first routed layer from them too (``entry_residuals``: one pass below for every router). The last layer of the alpha branch starts at zero, so an
  untrained router is exactly the base model. ``bias_size``: the bias's spread at the last query per
  layer. ``routing_edits``: the bias as ``linicl.interventions``
  edits (an ``fn`` edit at each routed layer's ``hook_attn_scores``: added before the causal mask, so
  it never lets a query see a later key). ``icr_forward``: the ``forward`` hook of
  ``linicl.evaluate`` that applies a trained router. ``save_router``/``load_router``.
* ``training``: ``prepare``/``train_router``, the paper's objective (cross-entropy + confidence +
  depth-weighted sparsity + gate terms, alpha scaled by a cosine 1.0 -> 0.8 and read at 0.8 after
  training, AdamW, gradient clipping), with CE over the vocabulary (the paper) or the label words. The residual stream entering the first routed layer does not depend on the router, so it
  is computed once per query and training runs only the routed blocks
  (``Transformer(first_layer=...)``). ``checkpoint=`` saves the training state as it goes
  (``linicl.checkpoint``) and resumes from it.
* ``baselines``: ``task_vector``/``task_vector_edits``, the task-vector baseline (few-shot minus
  zero-shot mean last-token residual at one layer, added at the query's last token).
* ``function_vector``: the function-vector baseline (Todd et al.): the heads whose mean output most
  restores the gold answer on prompts with wrong demo labels (``head_effects``, by activation patching
  or its first-order estimate), their mean outputs projected by ``o`` and summed (``function_vector``),
  added like a task vector.

The protocol of the paper's experiment (routing.md section 5; ``experiments/routing.py``), a module a step:

* ``arms``: ``ARMS``, name -> ``Arm`` (basis, bias scale, CE target, router input) of each router
  compared, and ``RANDOM_CONTROLS``, each PID arm's random-basis control.
* ``prompts``: the protocol's seeded prompts: ``zero_shot_prompts``, ``few_shot_prompts`` (the PIDs'),
  ``balanced_prompts`` (the in-domain few-shot baseline), ``multi_task_prompts`` (the paper's
  out-of-domain one), ``wrong_label_prompts`` (the function vector's), ``calibration_prompts``.
* ``preparation``: over a suite of in-domain tasks, each part kept in a folder as it is made:
  ``gather_pid_activations``, ``gather_training_data`` (with the sentence embeddings), ``fit_bases``
  (PIDs and the random basis, paper's bias and logit scale).
* ``evaluation``: ``evaluate_task``, one task's row per seed over zero-shot, few-shot, task vector,
  function vector (``function_vectors``, ``task_function_vector``) and each router (``RoutedMethod``,
  ``routed_methods``).
* ``summary``: ``merge_row``, ``pool_seeds``, ``aligned``, ``compare``, ``pooled_difference``,
  ``summarise`` (group averages, paired comparisons with zero-shot, collapses, the targets).
* ``report``: ``results_table``, ``bias_lines``, ``results_figure`` and the formatters they use.
"""

from linicl.routing.baselines import task_vector, task_vector_edits
from linicl.routing.function_vector import (function_vector, function_vector_heads, head_effects, mean_head_outputs,
                                            top_heads)
from linicl.routing.pids import (PIDs, extract_pids, fit_pids, on_logit_scale, pca, pid_activations, random_basis,
                                 routed_layers)
from linicl.routing.router import (Router, bias_size, entry_residuals, icr_forward, input_width, load_router,
                                   make_router, routed_logits, router_input, routing_edits, save_router)
from linicl.routing.training import LossWeights, TrainingData, alpha_schedule, icr_loss, prepare, train_router
from linicl.routing.arms import ARMS, RANDOM_CONTROLS, Arm
from linicl.routing.prompts import (balanced_prompts, calibration_prompts, few_shot_prompts, multi_task_prompts,
                                    wrong_label_prompts, zero_shot_prompts)
from linicl.routing.preparation import fit_bases, gather_pid_activations, gather_training_data
from linicl.routing.evaluation import (RoutedMethod, evaluate_task, function_vectors, routed_methods,
                                       task_function_vector)
from linicl.routing.summary import (ROW_FIELDS, aligned, compare, merge_row, method_names, pool_seeds,
                                    pooled_difference, summarise)
from linicl.routing.report import (CONSTANT_MARK, bias_lines, fmt_accuracy, fmt_comparison, fmt_interval,
                                   results_figure, results_table)

__all__ = ["routed_layers", "pca", "PIDs", "extract_pids", "pid_activations", "fit_pids", "random_basis", "on_logit_scale", "Router", "bias_size", "make_router", "routing_edits",
           "input_width", "entry_residuals",
           "router_input", "routed_logits", "icr_forward", "save_router", "load_router", "TrainingData",
           "prepare", "LossWeights", "icr_loss", "alpha_schedule", "train_router", "task_vector",
           "task_vector_edits", "mean_head_outputs", "head_effects", "top_heads", "function_vector",
           "function_vector_heads",
           # the protocol of the paper's experiment
           "Arm", "ARMS", "RANDOM_CONTROLS", "zero_shot_prompts", "few_shot_prompts", "balanced_prompts",
           "multi_task_prompts", "wrong_label_prompts", "calibration_prompts", "gather_pid_activations",
           "gather_training_data", "fit_bases", "RoutedMethod", "routed_methods", "evaluate_task",
           "function_vectors", "task_function_vector", "ROW_FIELDS", "merge_row", "method_names", "pool_seeds",
           "aligned", "compare", "pooled_difference", "summarise", "CONSTANT_MARK", "fmt_accuracy", "fmt_interval",
           "fmt_comparison", "results_table", "bias_lines", "results_figure"]
