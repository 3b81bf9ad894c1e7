"""Bounded caches: one way to keep what meshkit worked out, and one call to forget all of it.

Two shapes, both bounded, both dropping an entry not used lately when full (never all of them
at once: layouts that churn do not evict the one that repeats), both registered with
`clear_caches`:

- `cached` memoizes a pure function of hashable arguments (`functools.lru_cache` underneath);
- `Cache` is a mapping for values made elsewhere and found again by a computed key (the
  template of a layout, made from the first call's data, is not a function of its key).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .errors import MeshkitError

__all__ = ["Cache", "cached", "clear_caches"]

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")

# Weak: a cache made by a test, or held by an object that goes, leaves the registry with it.
_registry: weakref.WeakSet[Any] = weakref.WeakSet()


def cached(maxsize: int) -> Callable[[Callable[..., R]], functools._lru_cache_wrapper[R]]:
    """Memoize a pure function of hashable arguments, keeping ``maxsize`` results at most.

    Args:
        maxsize: the most results kept; the least recently used goes first.

    Returns:
        A decorator; the function it returns is a `functools.lru_cache` wrapper, registered
        with `clear_caches`.

    Example:
        >>> @cached(maxsize=2)
        ... def square(x):
        ...     return x * x
        >>> square(3), square.cache_info().currsize
        (9, 1)
    """
    _check_size(maxsize)

    def decorate(fn: Callable[..., R]) -> functools._lru_cache_wrapper[R]:
        wrapper = functools.lru_cache(maxsize=maxsize)(fn)
        _registry.add(wrapper)
        return wrapper

    return decorate


class Cache(Generic[K, V]):
    """A mapping that keeps ``maxsize`` entries at most, dropping one not used lately when full.

    The eviction is LRU's clock approximation (second chance): a look-up only marks its entry
    used, without a lock or a reordering (it runs on every call of a hot path: a layout seen
    before); a full cache passes over its entries from the oldest, gives each marked one a
    second chance (unmarked, moved to the end) and drops the first unmarked one. A layout that
    repeats therefore survives any churn of one-off layouts, and a look-up costs a dict look-up.

    Safe to share between threads (`meshkit.global_batches` assembles in a helper thread while
    the caller assembles in its own): changes are made under a lock, and a look-up reads with
    single dict operations, which never see an entry half made. Registered with
    `clear_caches`.

    Args:
        maxsize: the most entries kept.

    Example:
        >>> seen = Cache(maxsize=2)
        >>> seen.put("a", 1); seen.put("b", 2); seen.get("a")
        1
        >>> seen.put("c", 3)  # "a" was used since it was put, "b" was not
        >>> sorted(seen.keys())
        ['a', 'c']
    """

    def __init__(self, maxsize: int) -> None:
        _check_size(maxsize)
        self.maxsize = maxsize
        # key -> [value, used since the last eviction pass]: a look-up sets the flag in place.
        self._data: OrderedDict[K, list[Any]] = OrderedDict()
        self._lock = threading.Lock()
        _registry.add(self)

    def get(self, key: K) -> V | None:
        """The value under ``key`` (marked used), or None."""
        entry = self._data.get(key)
        if entry is None:
            return None
        entry[1] = True
        return entry[0]

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key``; when full, drop the oldest entry not used lately."""
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                entry[0], entry[1] = value, True
                return
            if len(self._data) >= self.maxsize:
                self._evict_one()
            self._data[key] = [value, False]

    def _evict_one(self) -> None:
        """Drop the oldest entry not used since the last pass (under the lock, the cache full).

        Ends within one turn around the cache: every entry it passes over is unmarked.
        """
        while True:
            oldest, entry = next(iter(self._data.items()))
            if not entry[1]:
                del self._data[oldest]
                return
            entry[1] = False  # a second chance, at the end of the line
            self._data.move_to_end(oldest)

    def cache_clear(self) -> None:
        """Forget every entry (the name `functools.lru_cache` gives it)."""
        with self._lock:
            self._data.clear()

    def keys(self) -> list[K]:
        """The keys, oldest first (as the next eviction pass will see them)."""
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)


def clear_caches() -> None:
    """Empty every cache made with `cached` or `Cache` (tests, or after changing JAX's config).

    meshkit's caches are keyed by everything their values depend on, so clearing them never
    changes a result, only the time the next calls take.
    """
    for cache in list(_registry):
        cache.cache_clear()


def _check_size(maxsize: int) -> None:
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
        raise MeshkitError(f"a bounded cache needs maxsize >= 1 (an int); got {maxsize!r}.")
