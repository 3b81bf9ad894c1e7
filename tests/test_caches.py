"""meshkit's one cache helper: bounded, least recently used first, all cleared by one call."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import meshkit
from meshkit._src.arrays import blocks
from meshkit._src.core import caches
from meshkit._src.core.errors import MeshkitError
from meshkit._src.sharding import layout, specs


def test_a_cached_function_computes_once_per_argument_and_keeps_at_most_maxsize():
    calls = []

    @caches.cached(maxsize=2)
    def square(x):
        calls.append(x)
        return x * x

    assert [square(2), square(2), square(3)] == [4, 4, 9]
    assert calls == [2, 3]
    square(4)  # full: 2, the least recently used, goes
    assert square.cache_info().currsize == 2
    square(3)
    square(2)
    assert calls == [2, 3, 4, 2]


def test_a_full_cache_drops_the_least_recently_used_entry_not_all_of_them():
    cache: caches.Cache[str, int] = caches.Cache(maxsize=3)
    for i, key in enumerate("abc"):
        cache.put(key, i)
    assert cache.get("a") == 0  # "a" is now the most recently used
    cache.put("d", 3)
    assert list(cache._data) == ["c", "a", "d"]  # least recently used first
    assert cache.get("b") is None
    assert len(cache) == 3
    cache.put("c", 5)  # a new value for a key kept: no eviction, now the most recently used
    assert list(cache._data) == ["a", "d", "c"]
    cache.put("e", 4)  # "a" (not used since) goes
    assert list(cache._data) == ["d", "c", "e"]
    assert [cache.get(k) for k in "dce"] == [3, 5, 4]


def test_an_entry_in_use_survives_any_churn_of_others():
    cache: caches.Cache[int, str] = caches.Cache(maxsize=4)
    cache.put(-1, "steady")
    for i in range(100):
        assert cache.get(-1) == "steady"  # the layout that repeats
        cache.put(i, "once")  # layouts seen once
        assert len(cache) <= 4
    assert cache.get(-1) == "steady"


def test_clear_caches_empties_every_registered_cache():
    cache: caches.Cache[int, int] = caches.Cache(maxsize=4)
    cache.put(1, 1)

    @caches.cached(maxsize=4)
    def double(x):
        return 2 * x

    double(1)
    caches.clear_caches()
    assert len(cache) == 0
    assert double.cache_info().currsize == 0


def test_caches_that_are_gone_leave_the_registry():
    before = len(caches._registry)
    cache: caches.Cache[int, int] | None = caches.Cache(maxsize=1)
    assert len(caches._registry) == before + 1
    del cache
    assert len(caches._registry) == before


@pytest.mark.parametrize("maxsize", [0, -1, 1.5, True, None])
def test_a_cache_needs_a_positive_int_size(maxsize):
    with pytest.raises(MeshkitError, match=r"needs maxsize >= 1 \(an int\); got"):
        caches.Cache(maxsize=maxsize)
    with pytest.raises(MeshkitError, match=r"needs maxsize >= 1 \(an int\); got"):
        caches.cached(maxsize=maxsize)


def test_a_cache_shared_by_threads_stays_within_its_size_and_consistent():
    cache: caches.Cache[int, int] = caches.Cache(maxsize=8)
    errors = []

    def work(offset):
        try:
            for i in range(2000):
                key = (i + offset) % 13
                cache.put(key, key)
                value = cache.get(key)
                assert value is None or value == key
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) <= 8


def test_clear_caches_reaches_meshkits_own_caches():
    mesh = meshkit.make_mesh({"data": 8})
    meshkit.global_array_from_local(np.ones((8, 2), np.float32), mesh, "data")
    sizes = [
        len(blocks._templates),
        layout.plan.cache_info().currsize,
        specs.parse_spec.cache_info().currsize,
    ]
    assert all(sizes), sizes
    caches.clear_caches()
    sizes = [
        len(blocks._templates),
        layout.plan.cache_info().currsize,
        specs.parse_spec.cache_info().currsize,
    ]
    assert sizes == [0, 0, 0]
