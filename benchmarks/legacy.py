"""The legacy helpers: unreplicate against ``x[0]``, and replicate's peak host memory.

unreplicate. The issue's case: a `jax.pmap` output of 8 MiB float32 on 8 CPU devices. ``x[0]``
gathers the whole array before slicing; `meshkit.unreplicate` reads the first device's shard
(1 MiB) and copies its first entry on that device, one dispatch. The copy is real work:
numpy's own memcpy of one shard is printed as the floor any copying unreplicate has.

replicate. Peak resident memory (VmHWM, reset through /proc/self/clear_refs) of a fresh process
while it replicates one 64 MiB numpy array to 8 CPU devices, minus its resident memory before:
meshkit.replicate against stacking 8 copies on the host then one device_put, and against
broadcasting on one device then resharding. CPU "device memory" is host memory, so this counts
both. Each row is the median of 3 fresh processes. When the numpy array is 64-byte aligned,
XLA's CPU client uses it in place (as jax.device_put does) and the 8 devices share it.

Needs 8 devices in this process (run.py sets 8 CPU devices before any backend use); the memory
rows start their own processes.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from _timing import interleaved_samples, median_uncertainty

import meshkit
from meshkit._src.pmap import legacy as _legacy

MIB = 1 << 20
DEVICES = 8
REPLICATE_MIB = 64
METHODS = ("meshkit.replicate", "np.stack + device_put", "broadcast on device 0 + reshard")


def _unreplicate_rows() -> list[str]:
    unreplicate = getattr(meshkit, "unreplicate", _legacy.unreplicate)
    lines = []
    for total in (8 * MIB, 8 * 1024):
        per_device = total // 4 // DEVICES
        x = jax.pmap(lambda a: a * 2)(np.ones((DEVICES, per_device), np.float32))
        x.block_until_ready()
        np.testing.assert_array_equal(np.asarray(unreplicate(x)), np.asarray(x[0]))
        calls = [lambda x=x: x[0], lambda x=x: unreplicate(x)]
        for mode, only in (("full call", False), ("dispatch only", True)):
            # x[0] runs a gather across the 8 devices: a few in flight at most (JAX 0.10.2 on
            # CPU deadlocks with hundreds of queued collective calls).
            samples = interleaved_samples(
                calls, wait=jax.block_until_ready, number=20, max_in_flight=5, dispatch_only=only
            )
            base, ours = (statistics.median(s) for s in samples)
            notch = max(median_uncertainty(s) for s in samples)
            case = f"{_size(total)}, {mode}"
            lines.append(
                f"{case:<28} {base * 1e6:>10.1f} us {ours * 1e6:>13.1f} us "
                f"{base / ours:>9.1f}x  (+-{notch * 100:.0f}%)"
            )
    shard = np.ones(MIB // 4, np.float32)
    target = np.empty_like(shard)
    start = time.perf_counter()
    for _ in range(200):
        np.copyto(target, shard)
    memcpy = (time.perf_counter() - start) / 200
    lines.append(f"(numpy memcpy of one 1 MiB shard on this machine: {memcpy * 1e6:.1f} us)")
    return lines


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def bench_unreplicate() -> str:
    head = f"{'case':<28} {'x[0]':>13} {'unreplicate':>16} {'speed-up':>10}"
    return "\n".join(
        [
            "unreplicate vs x[0] on a jax.pmap output, 1 process x 8 CPU devices (medians of "
            "interleaved rounds of 20 calls; goal: >= 100x at 8 MiB)",
            head,
            "-" * len(head),
            *_unreplicate_rows(),
        ]
    )


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(method: str, aligned: bool) -> dict[str, float]:
    """In a fresh process: peak and held resident memory of one replicate, over the start."""
    jax.config.update("jax_num_cpu_devices", DEVICES)
    from jax.sharding import NamedSharding, PartitionSpec

    from meshkit._src.pmap.pmap import device_mesh

    count = REPLICATE_MIB * MIB // 4
    raw = np.empty(count + 64, np.float32)
    skip = (-raw.ctypes.data % 64) // 4 if aligned else (-raw.ctypes.data % 64) // 4 + 1
    x = raw[skip : skip + count]
    x[:] = 1.0
    mesh = device_mesh()
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    warm = _legacy.replicate(np.ones(4, np.float32))  # backends, jit caches, thread pools
    jax.device_put(np.stack([np.ones(4, np.float32)] * DEVICES), sharding).block_until_ready()
    broadcast = jax.jit(lambda a: jax.numpy.broadcast_to(a, (DEVICES, *a.shape)))
    broadcast(jax.device_put(np.ones(4, np.float32), jax.devices()[0])).block_until_ready()
    del warm
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    if method == METHODS[0]:
        out = _legacy.replicate(x)
    elif method == METHODS[1]:
        out = jax.device_put(np.stack([x] * DEVICES), sharding)
    else:
        on_one = broadcast(jax.device_put(x, jax.devices()[0]))
        out = jax.device_put(on_one, sharding)
        out.block_until_ready()
        del on_one
    out.block_until_ready()
    assert out.shape == (DEVICES, count)
    gc.collect()
    return {"peak": (_status("VmHWM") - before) / MIB, "held": (_status("VmRSS") - before) / MIB}


def bench_replicate_memory() -> str:
    if not Path("/proc/self/clear_refs").exists():
        return "replicate peak memory: skipped (needs Linux /proc/self/clear_refs)"
    head = f"{'method':<34} {'source':<10} {'peak':>10} {'held after':>12} {'copies (peak)':>14}"
    lines = [
        f"replicate peak host memory: one {REPLICATE_MIB} MiB float32 numpy array to "
        f"{DEVICES} CPU devices (VmHWM - VmRSS before, median of 3 fresh processes; CPU device "
        "memory is host memory)",
        head,
        "-" * len(head),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    for aligned in (False, True):
        for method in METHODS:
            runs = []
            for _ in range(3):
                done = subprocess.run(
                    [sys.executable, __file__, "--memory", method, str(int(aligned))],
                    capture_output=True, text=True, timeout=300, env=env, check=True,
                )  # fmt: skip
                line = next(x for x in done.stdout.splitlines() if x.startswith("MEMORY "))
                runs.append(json.loads(line.removeprefix("MEMORY ")))
            peak = statistics.median(r["peak"] for r in runs)
            held = statistics.median(r["held"] for r in runs)
            source = "aligned" if aligned else "unaligned"
            lines.append(
                f"{method:<34} {source:<10} {peak:>6.0f} MiB {held:>8.0f} MiB "
                f"{peak / REPLICATE_MIB:>13.1f}x"
            )
    return "\n".join(lines)


def bench_legacy() -> str:
    return bench_unreplicate() + "\n\n" + bench_replicate_memory()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--memory":
        print("MEMORY " + json.dumps(_measure(sys.argv[2], sys.argv[3] == "1")))
    else:
        from _timing import keep_freed_memory

        malloc = keep_freed_memory()
        jax.config.update("jax_num_cpu_devices", DEVICES)
        print(f"jax {jax.__version__}; {malloc}\n")
        print(bench_legacy())
