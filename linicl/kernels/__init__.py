"""Numerical kernels: plain jax.numpy functions, no Flax."""

from linicl.kernels import feature_maps, hybrid_attention, positions, short_conv, sparse_cache
from linicl.kernels.hybrid_attention import HybridState
from linicl.kernels.sparse_cache import SparseState
from linicl.kernels.linear_attention import (LinearState, chunked, choose_form, linear_attention,
                                             parallel, recurrent, zero_state)
from linicl.kernels.positions import apply_rope
from linicl.kernels.softmax_attention import repeat_kv, softmax_attention

__all__ = ["feature_maps", "hybrid_attention", "HybridState", "short_conv", "sparse_cache", "SparseState", "positions",
           "LinearState", "chunked", "choose_form", "linear_attention", "parallel", "recurrent", "zero_state", "apply_rope", "repeat_kv", "softmax_attention"]
