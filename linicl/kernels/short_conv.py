"""A short depthwise causal convolution with a state (Mamba, GLA, DeltaNet, Gated DeltaNet).

Every channel c (for q, k, v of attention: every head and coordinate) is filtered on its own by a
kernel of K taps, over the last K inputs of that channel:

    y_t[c] = act( sum_{j=0}^{K-1} w[j, c] x_{t-K+1+j}[c] ),    t = 0, ..., T - 1

where the inputs before the sequence start, x_{-K+1}, ..., x_{-1}, are the state s (zeros for a fresh
sequence): tap K - 1 weighs the current input, tap 0 the oldest. No bias. ``act`` is ``"none"`` (the
identity) or ``"silu"`` (``linicl.names.SHORT_CONV_ACTIVATIONS``), applied per output.

The state after the call is the last K - 1 inputs of [s; x]: for T < K - 1 the older entries of s
shift along, so that running a sequence in pieces, each from the state the previous piece left, gives
exactly the outputs and the final state of one call over the whole (the conversion of a prompt into
it is exact, and composable).

Shapes: x: ``f[batch, seq, *channels]``; w: ``f[K, *channels]``; state: ``f[batch, K - 1, *channels]``
(or None: zeros). Returns ``(y f[batch, seq, *channels], final state f[batch, K - 1, *channels])``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from linicl.names import SHORT_CONV_ACTIVATIONS


def zero_state(batch: int, kernel_size: int, channels: tuple, dtype) -> jax.Array:
    """The state of a fresh sequence: ``f[batch, K - 1, *channels]`` zeros."""
    return jnp.zeros((batch, kernel_size - 1) + tuple(channels), dtype)


def short_conv(x: jax.Array, w: jax.Array, state: Optional[jax.Array] = None,
               activation: str = "none") -> tuple[jax.Array, jax.Array]:
    """The causal depthwise convolution of the module docstring: ``(y, final_state)``."""
    if activation not in SHORT_CONV_ACTIVATIONS:
        raise ValueError(f"short_conv activation must be one of {SHORT_CONV_ACTIVATIONS}, got {activation!r}")
    K, T = w.shape[0], x.shape[1]
    if K < 2:
        raise ValueError(f"short_conv needs a kernel of at least 2 taps, got {K}")
    if w.shape[1:] != x.shape[2:]:
        raise ValueError(f"short_conv kernel {tuple(w.shape)} does not match the channels of x {tuple(x.shape)}")
    if state is None:
        state = zero_state(x.shape[0], K, x.shape[2:], x.dtype)
    state = jnp.broadcast_to(state, (x.shape[0],) + state.shape[1:]).astype(x.dtype)
    xs = jnp.concatenate([state, x], axis=1)                # [batch, K - 1 + T, *channels]
    # K shifted views (no FFT, no lax.conv): T * K multiply-adds per channel, the same order of sums
    # in every call, whatever the split of the sequence.
    y = w[0] * xs[:, 0:T]
    for j in range(1, K):
        y = y + w[j] * xs[:, j:j + T]
    if activation == "silu":
        y = jax.nn.silu(y)
    return y, xs[:, T:]
