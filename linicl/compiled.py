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

Across processes, XLA's executables can be kept on disk by JAX's persistent compilation cache:
``enable_persistent_cache()`` turns it on. Library code never calls it (it sets process-wide JAX
options); the entry points do: the ``linicl`` CLI, the experiment and benchmark scripts, and the test
session. ``$LINICL_COMPILATION_CACHE`` moves the folder (default ``~/.cache/linicl/jax``, under
``$XDG_CACHE_HOME`` when set) or, set to ``off``, turns it off.

    linicl.compiled.enable_persistent_cache()            # a script's main(), before compiling anything
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Callable, Hashable, Optional

CACHE_ENV = "LINICL_COMPILATION_CACHE"
_OFF = ("off", "0", "none", "false", "no")


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


def geometric_bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (16 * 2^i and 24 * 2^i) that holds ``n`` tokens: a
    padded length with at most 50 % padding and two shapes per doubling of the length, so a function
    called at many lengths compiles a handful of times (``batching.bucket_length``, ``generate``)."""
    size = 16
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def persistent_cache_dir(directory=None) -> Optional[Path]:
    """Where ``enable_persistent_cache(directory)`` keeps executables: ``directory``, else
    ``$LINICL_COMPILATION_CACHE``, else ``~/.cache/linicl/jax`` (``$XDG_CACHE_HOME/linicl/jax``). None
    when the setting is ``off`` (also ``0``, ``none``, ``false``, ``no``, or empty)."""
    value = os.fspath(directory) if directory is not None else os.environ.get(CACHE_ENV)
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "linicl" / "jax"
    if value.strip().lower() in _OFF or not value.strip():
        return None
    return Path(value).expanduser()


def enable_persistent_cache(directory=None, *, min_compile_s: float = 0.5) -> Optional[Path]:
    """Turn on JAX's persistent compilation cache (process-wide) in ``persistent_cache_dir(directory)``;
    returns the folder, or None when the setting says off (the cache is then left as it was).

    min_compile_s: only executables that took at least this long to compile are written (the small
        ones load no faster than they compile). A folder that cannot be created leaves the cache off
        with a warning: a read-only home must not stop an experiment."""
    import warnings

    import jax  # here: a process that never enables the cache does not need jax configured early

    path = persistent_cache_dir(directory)
    if path is None:
        return None
    if isinstance(min_compile_s, bool) or not isinstance(min_compile_s, (int, float)) or not min_compile_s >= 0:
        raise ValueError(f"min_compile_s must be a number >= 0, got {min_compile_s!r}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"persistent compilation cache off: cannot create {path} ({e}); set {CACHE_ENV} "
                      f"to a writable folder or to 'off'", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
