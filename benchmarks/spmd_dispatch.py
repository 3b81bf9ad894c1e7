"""Per-call cost of meshkit.spmd against hand-written jax.jit(jax.shard_map(...)), same function.

Inputs are placed per in_specs before timing, so both sides take JAX's fast path; what remains
is meshkit's own per-call work: flattening the arguments and comparing their shardings with the
last placed call's (so that host data never reaches jit as a global value), and its call counter.
Three tables: the whole call, the dispatch alone (wall), and the dispatching thread's CPU per
call, the steadiest of the three on a small shared machine. Needs 8 devices in this process
(run.py sets 8 CPU devices before any backend use).
"""

from __future__ import annotations

import time
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


def bench_spmd_dispatch() -> str:
    full, dispatch, cpu = [], [], []
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
    title = f"spmd dispatch, 1 process x 8 CPU devices, inputs already placed, {rounds} rounds"
    heads = ("jit(shard_map)", "meshkit.spmd")
    return "\n\n".join(
        [
            table(f"{title}: full call (50 calls, then wait)", full, *heads),
            table(f"{title}: dispatch only (until the calls return)", dispatch, *heads),
            table(f"{title}: the calling thread's CPU per dispatch", cpu, *heads),
        ]
    )
