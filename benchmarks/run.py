"""meshkit benchmarks: each table compares a baseline and meshkit side by side in one run.

Absolute CPU times are only indicative (2-core CI machines); read the ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _timing import keep_freed_memory, launched_result, median_seconds, table  # noqa: E402

MALLOC = keep_freed_memory()  # before JAX starts its threads

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from compile_cache import bench_compile_cache  # noqa: E402
from coordination import bench_coordination  # noqa: E402
from data_position import bench_data_position  # noqa: E402
from debug_overhead import bench_debug  # noqa: E402
from global_assembly import (  # noqa: E402
    bench_check_changes,
    bench_global_gpu,
    bench_global_single_process,
    bench_global_two_processes,
)
from hosts_exchange import bench_hosts  # noqa: E402
from legacy import bench_legacy  # noqa: E402
from pmap_dispatch import bench_pmap_dispatch  # noqa: E402
from preemption import bench_preemption  # noqa: E402
from progress_records import bench_progress_records  # noqa: E402
from spmd_dispatch import bench_spmd_dispatch  # noqa: E402
from testing_starts import bench_testing_starts  # noqa: E402

import meshkit  # noqa: E402


def bench_make_mesh_single_process() -> str:
    rows = []
    cases = [((8,), ("data",)), ((2, 4), ("data", "model")), ((2, 2, 2), ("a", "b", "c"))]
    for shape, names in cases:
        axes = dict(zip(names, shape, strict=True))
        base = median_seconds(lambda s=shape, n=names: jax.make_mesh(s, n))
        ours = median_seconds(lambda a=axes: meshkit.make_mesh(a))
        rows.append((f"make_mesh {axes}", base, ours))
    return table("make_mesh, 1 process x 8 CPU devices", rows, "jax.make_mesh", "meshkit")


def bench_programs_two_processes() -> str:
    data = launched_result(HERE / "programs_multiprocess.py")
    return table(
        "programs compared at compilation, 2 processes x 4 CPU devices (comparison off vs on)",
        [
            ("compile a jitted step (lower().compile())", data["compile_off"], data["compile_on"]),
            ("call of the compiled step (cached)", data["call_off"], data["call_on"]),
        ],
        "off",
        "on",
    ) + (
        f"\nthe comparison itself (fingerprint + agreement, with any wait for the other process): "
        f"{data['compare'] * 1e3:.2f} ms per "
        f"compilation, measured over {data['compared']} compilations"
    )


def bench_make_mesh_two_processes() -> str:
    data = launched_result(HERE / "mesh_multiprocess.py")
    return table(
        "make_mesh with the cross-process agreement check, 2 processes x 4 CPU devices",
        [("make_mesh {'data': -1, 'model': 4}", data["jax"], data["meshkit"])],
        "jax.make_mesh",
        "meshkit",
    )


if __name__ == "__main__":
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices; {MALLOC}\n")
    print(bench_make_mesh_single_process(), end="\n\n")
    print(bench_spmd_dispatch(), end="\n\n")
    print(bench_pmap_dispatch(), end="\n\n")
    print(bench_legacy(), end="\n\n")
    print(bench_make_mesh_two_processes(), end="\n\n")
    print(bench_programs_two_processes(), end="\n\n")
    print(bench_debug(), end="\n\n")
    print(bench_global_single_process(MALLOC), end="\n\n")
    print(bench_global_two_processes(), end="\n\n")
    print(bench_check_changes(), end="\n\n")
    print(bench_global_gpu(), end="\n\n")
    print(bench_coordination(), end="\n\n")
    print(bench_hosts(), end="\n\n")
    print(bench_data_position(), end="\n\n")
    print(bench_preemption(), end="\n\n")
    print(bench_progress_records(), end="\n\n")
    print(bench_compile_cache(), end="\n\n")
    print(bench_testing_starts())
