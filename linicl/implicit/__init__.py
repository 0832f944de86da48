"""Implicit weight updates: context as a rank-1 change of the first MLP matrix plus an MLP-bias shift.

Dherin et al. (arXiv 2507.16003) and Innocenti & Achour (arXiv 2512.11255): a block run with context
equals the same block run on one token alone with its first MLP matrix W changed by a rank-1 ΔW and
its last MLP bias b' shifted by Δb'. For block ℓ, with the inputs ``Z`` it receives in the
full-context forward pass, and for every position i::

    g_i = MLP input at position i with context         (site hook_mlp_in)
    q_i = residual the MLP output is added to, at i    (site hook_resid_mid; 0 for the plain block)
    f, p = the same two values for the reference token run through the block *alone*
    ΔW_i  = W (g_i - f) fᵀ / ‖f‖²        (rank 1; W is h×d, the paper's orientation)
    Δb'_i = q_i - p

    block_{W + ΔW_i, b' + Δb'_i}(reference alone) == block_W(Z)[i]

because (W + ΔW_i) f = W g_i, after which the MLP sees what it saw with context, and the residual
gets q_i. This holds for every block form of the zoo (``plain`` = norm none / skip none, Dherin's skip,
residual, pre-LN, post-LN, LayerNorm or RMSNorm) and for gated MLPs, whose two first matrices
``fc_in`` and ``fc_gate`` both read f and get one rank-1 update each (with the same right factor, so
the stacked [W_in; W_gate] change is rank 1 too). Only the MLP changes, so any mixer whose output
for a token run alone is a function of that token qualifies: softmax and linear attention, and the
gated and delta-rule recurrences (``ModelConfig.gate``, ``update``), whose gates and write strengths
are computed from the token itself.

References (``linicl.names.REFERENCES``, "who is run alone"):

* ``"query"`` (the papers'): the block's last input x = Z[-1], one f for all positions. All ΔW_i then
  share the right factor f/‖f‖², so the stacked [ΔW_1; ...; ΔW_N] has rank 1.
* ``"own"``: each position's own input z_i, one f_i per position (the natural one for chaining).

A token alone is placed at ``position`` (default 0). A block run on one token does not depend on the
position: rope rotates its query and key alike, decay never acts, and learned positions are added
before the first block (``convert`` places the query where ``model.apply`` does).

Shapes: ``Z, g, q: f[..., T, d]``; with the ``"query"`` reference ``f, p: f[..., 1, d]`` (broadcast over
positions), with ``"own"`` ``f[..., T, d]``. Updates are kept factored: ``u[name]: f[..., T, h]`` =
W(g - f) and ``v: f[..., 1 or T, d]`` = f/‖f‖², so ΔW_i = u_i v_iᵀ; ``dense`` builds the
``[..., T, h, d]`` matrices only when asked.

Indices and positions (``order``, ``position``, ``positions``, ``Y``, ``i``) must be ints in range:
an eager call raises a ``LiniclError`` naming the argument rather than letting jnp indexing clamp,
wrap or truncate them; under ``jit`` an out-of-range index gives NaN.

No epsilon anywhere: when ‖f‖ is too small for the division (``degenerate``) an eager call raises
``DegenerateInputError``; under ``jit``/``vmap`` the affected updates are NaN (never a finite wrong
answer) and ``jax.experimental.checkify.checkify`` reports the message.

Modules, one concept each:

* ``blocks``: one block run with context and alone (``block_sites``, ``alone``, ``Pieces``, ``pieces``);
* ``operators``: the update of one block (``update``, ``Update``, ``factors``, ``dense``, ``patch``,
  ``implied``); ``metrics``: ``frobenius``, ``alignment``, ``msd``;
* ``model``: every block of a model from one forward pass (``updates``, ``implied_all``);
* ``conversion``: a prompt as weights (``convert``) or as MLP edits (``convert_edits``);
* ``gd``: Dherin's implicit gradient descent (``trajectory``, ``gradient``, ``subcontext``);
* ``linear``: the closed-form context term of unnormalised linear attention (``context_term``), gated
  and delta-rule mixers included;
* ``regression``: Innocenti & Achour's experiment, a transformer trained on in-context linear
  regression (``fig1_config``) with its updates probed at every step (``train_with_probes``,
  ``step_metrics``, ``exactness``).
"""

from linicl.implicit.blocks import Pieces, alone, block_sites, pieces
from linicl.implicit.conversion import convert, convert_edits
from linicl.implicit.gd import Trajectory, gd_loss, gradient, subcontext, trajectory
from linicl.implicit.linear import context_term
from linicl.implicit.metrics import alignment, frobenius, msd
from linicl.implicit.model import ModelUpdates, capture_blocks, implied_all, stack_blocks, updates
from linicl.implicit.operators import (Update, degenerate, delta_b, dense, factors, first_matrices,
                                       has_bias_shift, implied, patch, update)
from linicl.implicit.regression import (exactness, fig1_config, last_block_prediction, patched_network_prediction,
                                        step_metrics, train_with_probes)
from linicl.names import REFERENCES

__all__ = ["Pieces", "Update", "ModelUpdates", "Trajectory", "REFERENCES", "block_sites", "alone", "pieces",
           "first_matrices", "degenerate", "factors", "delta_b", "update", "dense", "patch", "implied",
           "frobenius", "alignment", "msd", "stack_blocks", "capture_blocks", "updates", "implied_all",
           "convert", "convert_edits", "subcontext", "trajectory", "gradient", "gd_loss", "context_term",
           "has_bias_shift", "fig1_config", "last_block_prediction", "patched_network_prediction", "step_metrics",
           "exactness", "train_with_probes"]
