"""Bounded caches (`cached`, `Cache`), and `clear_caches` to forget all of them."""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .errors import MeshkitError

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")

# Weak: a cache made by a test, or held by an object that goes, leaves the registry with it.
_registry: weakref.WeakSet[Any] = weakref.WeakSet()


def cached(maxsize: int) -> Callable[[Callable[..., R]], functools._lru_cache_wrapper[R]]:
    """Memoize a pure function of hashable arguments, keeping ``maxsize`` results at most."""
    _check_size(maxsize)

    def decorate(fn: Callable[..., R]) -> functools._lru_cache_wrapper[R]:
        wrapper = functools.lru_cache(maxsize=maxsize)(fn)
        _registry.add(wrapper)
        return wrapper

    return decorate


class Cache(Generic[K, V]):
    """A mapping that keeps ``maxsize`` entries at most, dropping one not used lately when full."""

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

    def _evict_one(self) -> None:  # under the lock, the cache full
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

    def __len__(self) -> int:
        return len(self._data)


def clear_caches() -> None:
    """Empty every cache made with `cached` or `Cache` (tests, or after changing JAX's config)."""
    for cache in list(_registry):
        cache.cache_clear()


def _check_size(maxsize: int) -> None:
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
        raise MeshkitError(f"a bounded cache needs maxsize >= 1 (an int); got {maxsize!r}.")
