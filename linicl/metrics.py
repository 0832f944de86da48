"""Error measures: to certify identities (tests, ``linicl verify``, notebooks) and to compare a method's
outputs with a reference model's (``log_normalize``, ``kl_rows``, ``layer_rel_errors``)."""

from __future__ import annotations

import numpy as np

from linicl.errors import LiniclError


def rel_err(a, b) -> float:
    """Normwise relative error max|a - b| / max|b| (infinity norm over every element), in float64.

    ``b`` is the reference; an identically zero reference makes the measure undefined and is refused.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    if not scale > 0:
        raise LiniclError("rel_err: the reference b is identically zero (or NaN); the relative error "
                          "is undefined")
    return float(np.max(np.abs(a - b)) / scale)


def log_normalize(x) -> np.ndarray:
    """``x - logsumexp(x)`` over the last axis: log-probabilities from logits (or log-probabilities
    renormalised over a column subset), ``f[..., n]`` -> ``f[..., n]``."""
    x = np.asarray(x)
    m = np.max(x, axis=-1, keepdims=True)
    return x - (m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)))


def kl_rows(lp_p, lp_q) -> np.ndarray:
    """KL(p || q) per row, ``f[rows]``, from log-probabilities ``lp_p``, ``lp_q``: ``f[rows, n]``, each
    renormalised over its n columns first (so a column subset, e.g. the label words, gives the KL of
    the distributions restricted to it)."""
    lp_p, lp_q = np.asarray(lp_p), np.asarray(lp_q)
    if lp_p.shape != lp_q.shape or lp_p.ndim < 1:
        raise LiniclError(f"kl_rows: lp_p and lp_q must have one shape [rows, n], got {lp_p.shape} and "
                          f"{lp_q.shape}")
    lp_p, lp_q = log_normalize(lp_p), log_normalize(lp_q)
    return np.sum(np.exp(lp_p) * (lp_p - lp_q), axis=-1)


def layer_rel_errors(z, z_ref, lengths) -> tuple[list, list]:
    """Per layer, the relative error of ``z`` against ``z_ref`` (``f[layers, rows, width, features]``,
    e.g. attention outputs at a row's tokens), each row over its first ``lengths[row]`` positions
    (``int[rows]``, >= 1; what lies past them, padding, may hold anything, even NaN):
    ``(every, last)``, two lists of ``layers`` floats: the mean over rows of ||z - z_ref|| / ||z_ref||
    over the row's positions, and at its last position only."""
    z, z_ref, lengths = np.asarray(z), np.asarray(z_ref), np.asarray(lengths)
    if z.shape != z_ref.shape or z.ndim != 4:
        raise LiniclError(f"layer_rel_errors: z and z_ref must have one shape [layers, rows, width, "
                          f"features], got {z.shape} and {z_ref.shape}")
    W = z.shape[2]
    if lengths.shape != (z.shape[1],) or lengths.min(initial=1) < 1 or lengths.max(initial=1) > W:
        raise LiniclError(f"layer_rel_errors: lengths must be {z.shape[1]} ints in [1, {W}], got {lengths}")
    mask = np.arange(W)[None, :] < lengths[:, None]  # [N, W]
    d2 = np.where(mask, np.sum((z.astype(np.float64) - z_ref) ** 2, axis=-1), 0.0)  # [L, N, W]
    r2 = np.where(mask, np.sum(z_ref.astype(np.float64) ** 2, axis=-1), 0.0)
    every = np.sqrt(np.sum(d2, -1) / np.maximum(np.sum(r2, -1), 1e-30))  # [L, N]
    idx = np.arange(len(lengths))
    last = np.sqrt(d2[:, idx, lengths - 1] / np.maximum(r2[:, idx, lengths - 1], 1e-30))
    return every.mean(1).tolist(), last.mean(1).tolist()
