"""The one cache of compiled functions: bounded, explicit and clearable.

linicl's methods build a jitted closure per model (and per static option) the first time it is
needed, e.g. ``iclca.convert``'s absorbing pass. Building it again on every call would re-trace and,
for a new closure object, re-compile, so the closures are kept here: one least-recently-used table
keyed by ``(what, model, options...)``, with at most ``maxsize`` entries. Results of an abstract
trace that are as costly to rebuild (a model's site names) are kept here too. Nothing else in linicl
keeps compiled functions (no module-level ``lru_cache``), and nothing is compiled at import time
(``tests/test_architecture.py`` checks both).

    linicl.compiled.get(("iclca.absorb", model), lambda: jax.jit(...))   # build once, then reuse
    linicl.compiled.clear()        # drop every closure (XLA's own executables go with them)
    linicl.compiled.CACHE.maxsize = 16

The entries hold the model objects in their keys; clearing the cache releases them. Tests that build
many models clear it between modules to keep memory bounded.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable


class FunctionCache:
    """A thread-safe LRU table ``key -> function``; ``get(key, build)`` calls ``build()`` on a miss."""

    def __init__(self, maxsize: int = 256):
        self._table: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"maxsize must be an int >= 1, got {value!r}")
        self._maxsize = value
        self._evict()

    def _evict(self) -> None:
        while len(self._table) > self._maxsize:
            self._table.popitem(last=False)

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        with self._lock:
            if key in self._table:
                self._table.move_to_end(key)
                self.hits += 1
                return self._table[key]
        fn = build()  # outside the lock: building may itself look up other entries
        with self._lock:
            self.misses += 1
            fn = self._table.setdefault(key, fn)
            self._table.move_to_end(key)
            self._evict()
        return fn

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key) -> bool:
        return key in self._table


CACHE = FunctionCache()


def get(key: Hashable, build: Callable[[], Callable]) -> Callable:
    """The function cached under ``key``, built by ``build()`` on first use."""
    return CACHE.get(key, build)


def clear() -> None:
    """Forget every cached function."""
    CACHE.clear()
