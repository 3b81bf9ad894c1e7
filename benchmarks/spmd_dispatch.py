"""Per-call cost of meshkit.spmd against hand-written jax.jit(jax.shard_map(...)), same function.

Inputs are placed per in_specs before timing, so both sides take JAX's fast path; what remains
is meshkit's own per-call work: comparing the arguments' shardings with the last placed call's
(a tree of arrays flattened first), so that host data never reaches jit as a global value, and
its call counter.
Three tables: the whole call, the dispatch alone (wall), and the dispatching thread's CPU per
call, the steadiest of the three on a small shared machine. A fourth adds meshkit's own work,
timed alone (`own_work`), to JAX's dispatch CPU from the third: the ratio is the part of a call's
CPU that is meshkit's, without the noise of the loop (which moves the other tables by several
percent between runs). Needs 8 devices in this process (run.py sets 8 CPU devices before any
backend use).
"""

from __future__ import annotations

import time
import timeit
from typing import Any

import jax
import numpy as np
from _timing import bench_rounds, interleaved_medians, table
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit

SPEC = P("data")
LEAF_SHAPE = (8 * 128,)  # 128 float32 per device: small, so the call overhead dominates


def per_device(xs: Any) -> Any:
    """The same per-device function on both sides: elementwise, on one array or a list."""
    return jax.tree.map(lambda x: x * 2.0 + 1.0, xs)


def _cases() -> list[tuple[str, Any, Any, Any]]:
    """(case, baseline, meshkit, inputs) for 1 and 50 leaves on an Auto and an Explicit mesh."""
    cases = []
    for kind in ("auto", "explicit"):
        mesh = meshkit.make_mesh({"data": 8}, axis_types=kind)
        for leaves in (1, 50):
            sharding = NamedSharding(mesh, SPEC)
            arrays = [
                jax.device_put(np.full(LEAF_SHAPE, i, np.float32), sharding) for i in range(leaves)
            ]
            arg = arrays[0] if leaves == 1 else arrays
            base = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
            ours = meshkit.spmd(per_device, mesh=mesh, in_specs=SPEC, out_specs=SPEC)
            name = f"{leaves} leaf" if leaves == 1 else f"{leaves} leaves (a list, one spec)"
            cases.append((f"{name}, {kind.capitalize()} mesh", base, ours, arg))
    return cases


OWN_CALLS = 20_000  # per timing of `own_work`; the best of 7


def own_work(ours: meshkit.SpmdFunction, arg: Any) -> float:
    """Seconds per call meshkit spends on a placed call besides JAX's: ``ours(arg)`` with its
    jitted function replaced by one that does nothing, less a direct call of that function."""
    ours(arg)  # placed: the steady state
    last = ours._last
    assert last is not None, "a placed call leaves the steady state"

    def nothing(*args: Any) -> None:
        return None

    ours._last = (*last[:2], nothing, *last[3:])
    try:
        best = {}
        for name, call in (("meshkit", lambda: ours(arg)), ("nothing", lambda: nothing(arg))):
            best[name] = min(timeit.repeat(call, number=OWN_CALLS, repeat=7)) / OWN_CALLS
    finally:
        ours._last = last
    return best["meshkit"] - best["nothing"]


def bench_spmd_dispatch() -> str:
    full, dispatch, cpu, own = [], [], [], []
    rounds = bench_rounds(61)
    for case, base, ours, arg in _cases():
        np.testing.assert_array_equal(
            np.asarray(jax.tree.leaves(base(arg))[-1]), np.asarray(jax.tree.leaves(ours(arg))[-1])
        )
        calls = [lambda f=base, a=arg: f(a), lambda f=ours, a=arg: f(a)]
        wait = jax.block_until_ready
        full.append((case, *interleaved_medians(calls, wait=wait, rounds=rounds)))
        only = interleaved_medians(calls, wait=wait, rounds=rounds, dispatch_only=True)
        dispatch.append((case, *only))
        used = interleaved_medians(
            calls, wait=wait, rounds=rounds, dispatch_only=True, clock=time.thread_time
        )
        cpu.append((case, *used))
        own.append((case, used[0], used[0] + own_work(ours, arg)))
    title = f"spmd dispatch, 1 process x 8 CPU devices, inputs already placed, {rounds} rounds"
    heads = ("jit(shard_map)", "meshkit.spmd")
    return "\n\n".join(
        [
            table(f"{title}: full call (50 calls, then wait)", full, *heads),
            table(f"{title}: dispatch only (until the calls return)", dispatch, *heads),
            table(f"{title}: the calling thread's CPU per dispatch", cpu, *heads),
            table(
                "JAX's dispatch CPU (the table above), and it plus meshkit's own work per call "
                f"(timed alone, best of 7 x {OWN_CALLS:,} calls)",
                own,
                "jit(shard_map)",
                "+ meshkit's",
            ),
        ]
    )
