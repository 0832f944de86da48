"""The context term of unnormalised linear attention in closed form, from a stored prompt state.

For unnormalised linear attention A(C, x) = A(x) + ΔA with ΔA = W_O (γ ⊙ Sᵀ φ(q)): the context
enters only through the state S it leaves (``iclca.convert``). Feeding A(x) + ΔA to the block on x
alone reproduces the block with context, so ΔA determines the implicit update too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linicl.config import ModelConfig
from linicl.errors import NotExactError
from linicl.implicit.blocks import alone
from linicl.kernels import feature_maps


def context_term(cfg: ModelConfig, block_params, S, x) -> jax.Array:
    """ΔA = A(C, x) - A(x) in closed form from a stored linear-attention state (``iclca.convert``):
    W_O (γ ⊙ Sᵀ φ(q)) for unnormalised linear attention, with S ``f[heads, d_phi, d_head]`` the
    block's state after the context and q the query projection of x alone. ``x: f[d]`` -> ``f[d]``."""
    if cfg.attention != "linear" or cfg.normalize:
        raise NotExactError("context_term needs unnormalised linear attention (attention='linear', "
                            "normalize=False): otherwise A(C, x) is not linear in the state")
    # The state is re-based so that the query sits at position 0, where rope is the identity.
    qh = alone(cfg, block_params, x)["hook_q"]                      # [heads, d_head], before rope
    phi = feature_maps.get(cfg.feature_map)(qh)
    z = jnp.einsum("hf,hfd->hd", phi, S)
    gammas = cfg.decay_per_head()
    if gammas is not None:
        z = z * jnp.asarray(gammas, z.dtype)[:, None]
    return jnp.einsum("hd,hde->e", z, block_params["attn"]["o"]["kernel"])
