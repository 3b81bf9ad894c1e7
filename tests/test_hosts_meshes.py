"""Meshes on simulated hosts, 2 hosts x 2 processes x 2 CPU devices: the inner axis stays inside
each host, with ranks numbered host by host (one launcher per host) and interleaved (processes
started by hand, 0 and 2 on host-0). Needs root (see `host_runs`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest
from host_runs import (
    COORDINATOR,
    finish,
    launcher,
    left,
    start,
)
from hosts import Hosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits, pytest.mark.hosts]


# ---- meshes: the inner axis stays inside each host, whatever the ranks -----------------------

MESH_PROGRAM = """\
import json, socket, sys
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import meshkit

if len(sys.argv) > 1:  # started by hand, as bare JAX programs are: coordinator, count, id
    meshkit.init(coordinator_address=sys.argv[1], num_processes=int(sys.argv[2]),
                 process_id=int(sys.argv[3]), cpu_devices=2, timeout=60)
else:
    meshkit.init()
mesh = meshkit.make_mesh({"data": -1, "model": 4})
rows = np.arange(8, dtype=np.float32)
spec = P(("data", "model"))
x = meshkit.global_array_from_local(meshkit.process_slice(mesh, spec, (8,)).take(rows), mesh, spec)
sums = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "model"), mesh=mesh, in_specs=spec,
                             out_specs=P("data")))(x)
print("MESH " + json.dumps({
    "host": socket.gethostname(), "process": jax.process_index(),
    "rows": [[d.process_index for d in row] for row in mesh.devices],
    "hosts": str(meshkit.runtime_info().hosts),
    "sums": meshkit.gather(sums, to="all").tolist(),
}), flush=True)
"""


def _meshes(outs: Sequence[str]) -> list[dict]:
    import json

    found = [
        json.loads(line.split("MESH ", 1)[1]) for out in outs for line in out.splitlines()
        if "MESH " in line
    ]  # fmt: skip
    return sorted(found, key=lambda m: m["process"])


def _check_meshes(
    outs: Sequence[tuple[int, str, str]], host_of: list[int], rows: list[list[int]], table: str
) -> None:
    """Every process ran, on its host, the mesh ``rows`` (processes), whose rows sum per host."""
    for code, _, err in outs:
        assert code == 0, err
    meshes = _meshes([out for _, out, _ in outs])
    assert [m["process"] for m in meshes] == [0, 1, 2, 3]
    for m in meshes:
        assert m["host"] == f"host-{host_of[m['process']]}"
        assert m["rows"] == rows
        assert m["hosts"] == f"host-0: processes {table}"
        assert m["sums"] == [6.0, 22.0]  # rows 0-3 on host-0, 4-7 on host-1


def test_the_inner_axis_stays_inside_each_host_with_node_major_ranks(tmp_path):
    (tmp_path / "mesh.py").write_text(MESH_PROGRAM)
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "2", str(tmp_path / "mesh.py")]
        outs = finish(start(hosts, tmp_path, [launcher(0, run), launcher(1, run)]), tmp_path)
        assert left(hosts) == []
    # each row (the model axis) inside one host
    _check_meshes(outs, [0, 0, 1, 1], [[0, 0, 1, 1], [2, 2, 3, 3]], "0-1; host-1: processes 2-3")


def test_the_inner_axis_stays_inside_each_host_with_interleaved_ranks(tmp_path):
    """Processes 0, 2 on host-0 and 1, 3 on host-1, started by hand (as mpirun --map-by node)."""
    (tmp_path / "mesh.py").write_text(MESH_PROGRAM)
    with Hosts(2) as hosts:
        procs = []
        for p in range(4):
            argv = [sys.executable, str(tmp_path / "mesh.py"), COORDINATOR, "4", str(p)]
            with (
                open(tmp_path / f"launcher{p}.out", "w") as out,
                open(tmp_path / f"launcher{p}.err", "w") as err,
            ):
                procs.append(hosts.popen(p % 2, argv, stdout=out, stderr=err))
        outs = finish(procs, tmp_path)
        assert left(hosts) == []
    # by rank alone the rows would be [[0, 0, 1, 1], [2, 2, 3, 3]], each across both hosts
    _check_meshes(outs, [0, 1, 0, 1], [[0, 0, 2, 2], [1, 1, 3, 3]], "0,2; host-1: processes 1,3")
