"""Intervals and significance for accuracies: what a table of ICL results needs to be read honestly.

* ``wilson(k, n)``: the 95 % Wilson score interval of an accuracy k/n. Unlike the normal
  approximation it stays inside [0, 1] and is sensible at 0/n and n/n, where small ICL evaluations
  often sit.
* ``paired_bootstrap(a, b)``: the difference of two methods' accuracies on the *same* queries, with a
  95 % percentile interval from resampling queries (the pairing removes the variation between
  queries that both methods share, so it is much tighter than two separate intervals).
* ``paired_t(a, b)``: the mean difference of a few paired runs (seeds) with a Student-t 95 % interval:
  for comparisons over 3-10 seeds, where resampling the seeds says little.
* ``gain``, ``recovered``, ``collapsed``: the few-shot gain and the share of it a method keeps,
  reported only where the gain itself is significant (its interval excludes 0); a method has
  collapsed when it is significantly below zero-shot. Without that guard a ratio of two noisy,
  near-zero differences can say anything (a constant predictor "recovered 300 %").
* ``spread(xs)``: mean, sample standard deviation, minimum and maximum of a few runs (seeds).

All functions but ``spread`` take per-query correctness as bool/0-1 arrays of equal length, in the same
query order.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from linicl.errors import LiniclError

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
N_BOOT = 2000


class Interval(NamedTuple):
    """An estimate with its 95 % interval."""

    value: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def fmt(self, scale: float = 100.0, digits: int = 1) -> str:
        """``"62.5 [45.1, 77.3]"`` (percent by default)."""
        v, lo, hi = (x * scale for x in self)
        return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def wilson(k: int, n: int, z: float = Z95) -> Interval:
    """Accuracy k/n with its Wilson score interval."""
    if isinstance(n, bool) or int(n) != n or n < 1 or not 0 <= k <= n:
        raise LiniclError(f"wilson needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At k = 0 (k = n) the interval's lower (upper) end is exactly 0 (1); rounding can leave 1e-17.
    return Interval(p, 0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half))


def _paired(a, b) -> tuple:
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    if a.shape != b.shape or a.size == 0:
        raise LiniclError(f"paired statistics need two non-empty per-query arrays of one length, got "
                          f"{a.size} and {b.size}")
    return a, b


def paired_bootstrap(a, b, *, n_boot: int = N_BOOT, seed: int = 0) -> Interval:
    """mean(a) - mean(b) over the same queries, with a 95 % percentile bootstrap interval (queries
    resampled with replacement, ``n_boot`` times, deterministic in ``seed``)."""
    a, b = _paired(a, b)
    d = a - b
    idx = np.random.default_rng(seed).integers(0, d.size, size=(n_boot, d.size))
    means = d[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return Interval(float(d.mean()), float(lo), float(hi))


# Student-t 97.5 % quantiles for 1..30 degrees of freedom (beyond, the Cornish-Fisher expansion below
# is within 1e-4 of the exact quantile).
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
         2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
         2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (two-sided 95 %)."""
    if isinstance(df, bool) or int(df) != df or df < 1:
        raise LiniclError(f"t975 needs a positive integer number of degrees of freedom, got {df!r}")
    if df <= len(_T975):
        return _T975[int(df) - 1]
    z = Z95
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def paired_t(a, b) -> Interval:
    """mean(a - b) over paired runs (e.g. the same seeds) with the Student-t 95 % interval
    mean +- t975(n - 1) * sd / sqrt(n). Needs n >= 2 pairs (one pair has no spread to judge by); equal
    differences give an interval of zero width, which is what the data say."""
    a, b = _paired(a, b)
    if a.size < 2:
        raise LiniclError(f"paired_t needs at least 2 pairs, got {a.size}")
    if not np.all(np.isfinite(a - b)):
        raise LiniclError("paired_t: the values must be finite (censor runs that never got there first)")
    d = a - b
    half = t975(d.size - 1) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return Interval(float(d.mean()), float(d.mean() - half), float(d.mean() + half))


def gain(few, zero, **kw) -> Interval:
    """The few-shot gain: accuracy with the prompt minus zero-shot, on the same queries."""
    return paired_bootstrap(few, zero, **kw)


def recovered(method, few, zero, *, n_boot: int = N_BOOT, seed: int = 0) -> Optional[Interval]:
    """The share of the few-shot gain a method keeps, (acc_method - acc_zero) / (acc_few - acc_zero),
    with a 95 % bootstrap interval (ratio of the resampled means; resamples with no gain are dropped).
    ``None`` unless the gain is significantly positive: a share of a gain that may be zero is
    undefined, and the share of a loss (few-shot significantly below zero-shot, a collapse) would read
    as "recovered" for a method that also loses; report that case with ``collapsed``."""
    m, f = _paired(method, few)
    _, z = _paired(few, zero)
    if not gain(f, z, n_boot=n_boot, seed=seed).low > 0:
        return None
    idx = np.random.default_rng(seed).integers(0, f.size, size=(n_boot, f.size))
    num, den = (m[idx] - z[idx]).mean(1), (f[idx] - z[idx]).mean(1)
    ok = den != 0
    ratios = num[ok] / den[ok]
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return Interval(float((m.mean() - z.mean()) / (f.mean() - z.mean())), float(lo), float(hi))


def collapsed(method, zero, **kw) -> bool:
    """True when the method is significantly worse than zero-shot (the paired interval of
    acc_method - acc_zero lies below 0)."""
    return paired_bootstrap(method, zero, **kw).high < 0


def spread(xs) -> dict:
    """``dict(mean, std, min, max)`` of the values ``xs`` (e.g. one final metric per seed), as Python
    floats; ``std`` is the sample standard deviation (ddof 1), 0 for a single value."""
    xs = np.asarray(xs, np.float64)
    if xs.size == 0:
        raise LiniclError("spread: xs is empty; give at least one value")
    return dict(mean=float(xs.mean()), std=float(xs.std(ddof=1)) if xs.size > 1 else 0.0,
                min=float(xs.min()), max=float(xs.max()))


__all__ = ["Interval", "wilson", "paired_bootstrap", "paired_t", "t975", "gain", "recovered", "collapsed", "spread", "Z95", "N_BOOT"]
