"""Error measures used to certify identities (tests, ``linicl verify``, notebooks)."""

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
