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
    """A mapping that keeps ``maxsize`` entries at most, dropping the least recently used."""

    def __init__(self, maxsize: int) -> None:
        _check_size(maxsize)
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        _registry.add(self)

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key``; when full, drop the least recently used entry."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.maxsize:
                self._data.popitem(last=False)

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
