"""Bounded caches: one way to keep what meshkit worked out, and one call to forget all of it.

Two shapes, both bounded, both least-recently-used (a full cache drops its oldest entry, never
all of them at once: a layout that churns does not evict the one that repeats), both registered
with `clear_caches`:

- `cached` memoizes a pure function of hashable arguments (`functools.lru_cache` underneath);
- `Cache` is a mapping for values made elsewhere and found again by a computed key (the
  template of a layout, made from the first call's data, is not a function of its key).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
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
    """A mapping that keeps ``maxsize`` entries at most, dropping the least recently used.

    Safe to share between threads (`meshkit.global_batches` assembles in a helper thread while
    the caller assembles in its own). Registered with `clear_caches`.

    Args:
        maxsize: the most entries kept.

    Example:
        >>> seen = Cache(maxsize=2)
        >>> seen.put("a", 1); seen.put("b", 2); seen.get("a")
        1
        >>> seen.put("c", 3)  # "b" is the least recently used now
        >>> sorted(seen.keys())
        ['a', 'c']
    """

    def __init__(self, maxsize: int) -> None:
        _check_size(maxsize)
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()
        # A look-up moves the entry to the end; an eviction meanwhile must not remove it
        # between the two steps.
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
        """Keep ``value`` under ``key``, dropping the least recently used entry when full."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def cache_clear(self) -> None:
        """Forget every entry (the name `functools.lru_cache` gives it)."""
        with self._lock:
            self._data.clear()

    def keys(self) -> list[K]:
        """The keys, least recently used first."""
        with self._lock:
            return list(self._data)

    def values(self) -> list[V]:
        """The values, least recently used first."""
        with self._lock:
            return list(self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys())


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
