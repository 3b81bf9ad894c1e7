"""Per-call cost of meshkit.pmap_compat against jax.jit(jax.shard_map(...)) and jax.pmap.

The same per-device function on all three; inputs are each side's own earlier outputs (already
on the devices), so every side takes its fast path and what remains is per-call overhead.
The issue's goal: pmap_compat <= 1.1x the hand-written jit(shard_map), and below jax.pmap.
Needs 8 devices in this process (run.py sets 8 CPU devices before any backend use).
"""

from __future__ import annotations

import statistics
from typing import Any

import jax
import numpy as np
from _timing import interleaved_samples
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit._src.pmap.pmap import device_mesh

AXIS = "batch"
PER_DEVICE = (128,)  # 128 float32 per device: small, so the call overhead dominates


def per_device(xs: Any) -> Any:
    """Elementwise only: a collective would cost more than the dispatch being measured."""
    return jax.tree.map(lambda x: x * 2.0 + 1.0, xs)


def _cases() -> list[tuple[str, list[Any], list[Any]]]:
    """(case, [jit(shard_map), pmap_compat, jax.pmap], [their inputs]) for 1 and 50 leaves."""
    mesh = device_mesh(axis_name=AXIS)
    spec = P(AXIS)
    cases = []
    for leaves in (1, 50):
        host = [np.full((8, *PER_DEVICE), i, np.float32) for i in range(leaves)]
        host_arg: Any = host[0] if leaves == 1 else host

        def squeezed(xs: Any) -> Any:
            return jax.tree.map(lambda x: x[None], per_device(jax.tree.map(lambda x: x[0], xs)))

        base = jax.jit(
            jax.shard_map(squeezed, mesh=mesh, in_specs=spec, out_specs=spec),
            in_shardings=NamedSharding(mesh, spec),
        )
        ours = meshkit.pmap_compat(per_device, AXIS)
        theirs = jax.pmap(per_device, AXIS)
        fns = [base, ours, theirs]
        inputs = [fn(host_arg) for fn in fns]  # each side's own output layout
        # The noise floor: the baseline again, timed as a fourth function.
        fns.append(base)
        inputs.append(inputs[0])
        for out in inputs[1:]:
            np.testing.assert_allclose(
                np.asarray(jax.tree.leaves(out)[-1]), np.asarray(jax.tree.leaves(inputs[0])[-1])
            )
        name = "1 leaf" if leaves == 1 else f"{leaves} leaves (a list)"
        cases.append((name, fns, inputs))
    return cases


def bench_pmap_dispatch() -> str:
    head = (
        f"{'case':<36} {'jit(shard_map)':>15} {'pmap_compat':>12} {'jax.pmap':>10} "
        f"{'compat/jit':>11} {'compat/pmap':>12} {'jit/jit':>8}"
    )
    lines = [
        "pmap_compat per-call time, 1 process x 8 CPU devices, inputs already on the devices "
        "(times: medians of interleaved rounds of 50 calls; ratios: medians of the ratios of "
        "adjacent rounds, which cancel the machine's drift)",
        "goal: compat/jit <= 1.1x and compat/pmap < 1x; jit/jit: the same jit timed twice (noise)",
        head,
        "-" * len(head),
    ]
    for name, fns, inputs in _cases():
        calls = [lambda f=f, a=a: f(a) for f, a in zip(fns, inputs, strict=True)]
        for mode, only in (("full call", False), ("dispatch only", True)):
            s = interleaved_samples(calls, wait=jax.block_until_ready, dispatch_only=only)
            t = [statistics.median(x) for x in s]

            def paired(a: int, b: int, s: list[list[float]] = s) -> float:
                return statistics.median(y / x for x, y in zip(s[a], s[b], strict=True))

            lines.append(
                f"{name + ', ' + mode:<36} {t[0] * 1e6:>12.1f} us {t[1] * 1e6:>9.1f} us "
                f"{t[2] * 1e6:>7.1f} us {paired(0, 1):>10.2f}x {paired(2, 1):>11.2f}x "
                f"{paired(0, 3):>7.2f}x"
            )
    return "\n".join(lines)
