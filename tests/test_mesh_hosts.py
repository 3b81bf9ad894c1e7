"""Host-aware device order: inner axes inside a host whatever the ranks, and the hosts exchange.

The order is checked against a reference written from the documented rule (`docs/meshes.md`),
on fake devices of any host, process and device count, with ranks node-major, interleaved or
shuffled; the exchange (`coord.gather`) runs on the in-process fake coordination service.
"""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_mesh_order import factorizations, fake_devices

import meshkit
from meshkit import MeshkitError
from meshkit._src.coord.gather import gather
from meshkit._src.runtime.hosts import Hosts
from meshkit._src.sharding.mesh import domains, order_devices
from meshkit.testing._fake_service import FakeCluster


@st.composite
def clusters(draw):
    """(host of each process, devices per process, mesh sizes, axes across hosts or None)."""
    hosts = draw(st.integers(1, 4))
    per_host = draw(st.integers(1, 3))
    per_process = draw(st.integers(1, 4))
    order = draw(st.permutations(range(hosts * per_host)))  # process -> slot; slot // per_host
    host_of = [order[p] // per_host for p in range(hosts * per_host)]
    sizes = tuple(draw(factorizations(hosts * per_host * per_process)))
    across = draw(st.none() | st.sets(st.integers(0, len(sizes) - 1), min_size=1))
    return host_of, per_process, sizes, across


def _split(sizes, count, among=None):
    factors, rest = [], count
    for i, s in enumerate(sizes):
        f = math.gcd(s, rest) if among is None or i in among else 1
        factors.append(f)
        rest //= f
    return factors, rest


def reference(host_of, per_process, sizes, across):
    """Coordinate -> (process, local index), from the rule: hosts ordered by lowest process,
    processes ascending inside a host, factors host / process / device taken outermost first.
    None when the axes across hosts cannot span them."""
    hosts = sorted(set(host_of), key=host_of.index)
    members = [[p for p in range(len(host_of)) if host_of[p] == h] for h in hosts]
    h, rest = _split(sizes, len(hosts), across)
    if rest != 1:
        return None
    inner = [s // f for s, f in zip(sizes, h, strict=True)]
    q, _ = _split(inner, len(members[0]))
    local = [s // f for s, f in zip(inner, q, strict=True)]
    out = {}
    for coord in np.ndindex(*sizes):
        hi = qi = li = 0
        for c, hf, qf, lf in zip(coord, h, q, local, strict=True):
            hi = hi * hf + c // (qf * lf)
            qi = qi * qf + (c // lf) % qf
            li = li * lf + c % lf
        out[coord] = (members[hi][qi], li)
    return out


@given(clusters())
def test_order_matches_the_reference(cluster):
    host_of, per_process, sizes, across = cluster
    devs = fake_devices(len(host_of), per_process, shuffle_seed=len(sizes))
    ref = reference(host_of, per_process, sizes, across)
    if ref is None:
        with pytest.raises(MeshkitError, match=r"the axes across hosts, of sizes \[.*cannot span"):
            order_devices(devs, sizes, host_of=host_of, across=across)
        return
    grid = order_devices(devs, sizes, host_of=host_of, across=across)
    assert grid.shape == sizes
    assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devs)
    given_order, seen = {}, {}  # inside a process, devices keep the order given (shuffled)
    for d in devs:
        given_order[d.id] = seen.get(d.process_index, 0)
        seen[d.process_index] = given_order[d.id] + 1
    for coord, (proc, local) in ref.items():
        d = grid[coord]
        assert (d.process_index, given_order[d.id]) == (proc, local), coord


@given(clusters())
def test_inner_axes_stay_inside_a_host_and_a_process(cluster):
    """The longest suffix of axes that fits in a host's devices lies inside one host, whatever
    the ranks; the one that fits in a process's devices, inside one process."""
    host_of, per_process, sizes, _ = cluster
    grid = order_devices(fake_devices(len(host_of), per_process), sizes, host_of=host_of)
    per_host = host_of.count(host_of[0]) * per_process
    procs = np.vectorize(lambda d: d.process_index)(grid)
    hosts = np.vectorize(lambda d: host_of[d.process_index])(grid)
    for owners, fits in ((hosts, per_host), (procs, per_process)):
        j = next(j for j in range(len(sizes) + 1) if fits % math.prod(sizes[j:]) == 0)
        for outer in np.ndindex(*sizes[:j]):
            assert np.all(owners[outer] == owners[outer].flat[0]), (outer, owners[outer])


@given(clusters())
def test_each_host_and_each_process_holds_one_block(cluster):
    """What a host (a process) holds is a box: a contiguous range along every axis."""
    host_of, per_process, sizes, across = cluster
    if reference(host_of, per_process, sizes, across) is None:
        return
    grid = order_devices(
        fake_devices(len(host_of), per_process), sizes, host_of=host_of, across=across
    )
    procs = np.vectorize(lambda d: d.process_index)(grid)
    hosts = np.vectorize(lambda d: host_of[d.process_index])(grid)
    for owners in (procs, hosts):
        for who in np.unique(owners):
            where = np.argwhere(owners == who)
            lo, hi = where.min(0), where.max(0)
            assert len(where) == math.prod(hi - lo + 1), (who, where)


@given(clusters())
def test_axes_not_across_hosts_stay_inside_a_host(cluster):
    host_of, per_process, sizes, across = cluster
    if across is None or reference(host_of, per_process, sizes, across) is None:
        return
    grid = order_devices(
        fake_devices(len(host_of), per_process), sizes, host_of=host_of, across=across
    )
    hosts = np.vectorize(lambda d: host_of[d.process_index])(grid)
    for axis in set(range(len(sizes))) - across:
        assert (np.diff(hosts, axis=axis) == 0).all(), axis


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_node_major_ranks_give_the_order_without_hosts(hosts, per_host, per_process):
    host_of = [p // per_host for p in range(hosts * per_host)]
    devs = fake_devices(hosts * per_host, per_process)
    sizes = (hosts, per_host * per_process)
    by_host = order_devices(devs, sizes, host_of=host_of)
    assert (by_host == order_devices(devs, sizes)).all()


def test_interleaved_ranks_keep_the_model_axis_inside_a_host():
    # mpirun --map-by node / srun --distribution=cyclic: ranks 0, 2 on node a; 1, 3 on node b.
    devs = fake_devices(4, 2)
    grid = order_devices(devs, (2, 4), host_of=["a", "b", "a", "b"])
    assert [[d.process_index for d in row] for row in grid] == [[0, 0, 2, 2], [1, 1, 3, 3]]
    # Without hosts, the model axis would span both nodes.
    plain = order_devices(devs, (2, 4))
    assert [[d.process_index for d in row] for row in plain] == [[0, 0, 1, 1], [2, 2, 3, 3]]


def test_hosts_with_unequal_process_counts_order_by_process():
    devs = fake_devices(3, 2)
    grid = order_devices(devs, (6,), host_of=["a", "a", "b"])
    assert (grid == order_devices(devs, (6,))).all()


def test_across_hosts_that_cannot_span_them_is_named():
    devs = fake_devices(4, 2)
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.make_mesh: the axes across hosts, of sizes \[2\], cannot span the 4 "
        r"hosts: their product must be a multiple of 4",
    ):
        order_devices(devs, (2, 4), host_of=[0, 1, 2, 3], across={0})


def test_a_hybrid_mesh_puts_the_slow_axis_across_hosts():
    # 2 hosts x 2 processes x 2 devices, {"data": 4, "replica": 2} with replica across hosts:
    # replica runs across the hosts though it is the inner axis, data stays inside each.
    host_of = [0, 0, 1, 1]
    devs = fake_devices(4, 2)
    grid = order_devices(devs, (4, 2), host_of=host_of, across={1})
    hosts = [[host_of[d.process_index] for d in row] for row in grid]
    assert hosts == [[0, 1]] * 4


def test_multi_slice_tpus_keep_inner_axes_inside_a_slice():
    # 2 slices x 2 hosts (one process each) x 2 devices: the slice, not the host, is the unit.
    devs = [
        SimpleNamespace(id=i, process_index=i // 2, slice_index=i // 4, platform="tpu")
        for i in range(8)
    ]
    hosts = Hosts(("h0", "h1", "h2", "h3"), (0, 1, 2, 3))
    assert domains(devs, hosts) == {0: ("slice", 0), 1: ("slice", 0), 2: ("slice", 1),
                                    3: ("slice", 1)}  # fmt: skip
    grid = order_devices(devs, (4, 2), host_of=domains(devs, hosts), across={1})
    assert [[d.slice_index for d in row] for row in grid] == [[0, 1]] * 4
    one_slice = [SimpleNamespace(id=i, process_index=i // 2, slice_index=0) for i in range(8)]
    assert domains(one_slice, hosts) == {p: ("host", p) for p in range(4)}
    assert domains(one_slice, None) is None


def test_make_mesh_rejects_across_hosts_that_names_no_axis():
    with pytest.raises(
        MeshkitError,
        match=r"^meshkit.make_mesh: across_hosts='replica' names 'replica', not an axis of the "
        r"mesh \['data', 'model'\].\nConsider the name of the outer axis that runs across "
        r"hosts, e.g. across_hosts='data'.",
    ):
        meshkit.make_mesh({"data": -1, "model": 2}, across_hosts="replica")
    with pytest.raises(MeshkitError, match=r"across_hosts must be an axis name or a sequence"):
        meshkit.make_mesh({"data": -1}, across_hosts=3)  # type: ignore[arg-type]


def test_across_hosts_on_one_host_changes_nothing():
    one = meshkit.make_mesh({"replica": 2, "data": -1}, across_hosts="replica")
    assert (one.devices == meshkit.make_mesh({"replica": 2, "data": -1}).devices).all()


# ---- the table and its exchange --------------------------------------------------------------


@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=40))
def test_table_round_trips_and_orders_hosts_by_lowest_process(names):
    hosts = Hosts.of([f"{n}\0boot" for n in names])
    assert Hosts.from_json(hosts.to_json()) == hosts
    assert [hosts.host_of(p) for p in range(len(names))] == names
    assert list(hosts.names) == list(dict.fromkeys(names))


def test_node_major_table_is_small():
    hosts = Hosts.of([f"node{p // 8}\0x" for p in range(8192)])
    assert len(hosts) == 1024
    assert len(hosts.to_json()) < 30_000  # 1,024 hosts: one run each, never one entry per rank


def test_machines_that_share_a_hostname_stay_apart():
    hosts = Hosts.of(["box\0boot-1", "box\0boot-2", "box\0boot-1"])
    assert hosts.names == ("box", "box#2")
    assert hosts.of_process == (0, 1, 0)
    assert str(hosts) == "box: processes 0,2; box#2: process 1"


def _gather_all(n: int, missing: set[int] = frozenset(), timeout: float = 5.0):
    cluster = FakeCluster(n)
    results: dict[int, object] = {}

    def run(p: int) -> None:
        results[p] = gather(
            cluster.service(p), p, n, "t", f"v{p}", lambda vs: "|".join(vs.values()),
            timeout=timeout,
        )  # fmt: skip

    threads = [threading.Thread(target=run, args=(p,)) for p in range(n) if p not in missing]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return results, cluster


@pytest.mark.parametrize("n", [1, 2, 5])
def test_gather_gives_every_process_the_combined_answer(n):
    results, cluster = _gather_all(n)
    expected = "|".join(f"v{p}" for p in range(n))
    assert {p: r.answer for p, r in results.items()} == dict.fromkeys(range(n), expected)
    assert [k for k in cluster.store if "/v/" in k] == []  # the last to arrive deleted the values


def test_gather_names_a_process_that_never_comes():
    results, _ = _gather_all(3, missing={2}, timeout=0.5)
    assert {p: r.missing for p, r in results.items()} == {0: (2,), 1: (2,)}
    assert all(r.answer is None for r in results.values())


def test_describe_on_several_hosts_names_them(monkeypatch):
    from meshkit._src.runtime import hosts as _hosts

    devs = [SimpleNamespace(id=i, process_index=i // 2, platform="cpu") for i in range(8)]
    grid = order_devices(devs, (2, 4), host_of=[0, 1, 0, 1])
    auto = jax.sharding.AxisType.Auto
    mesh = SimpleNamespace(devices=grid, axis_names=("data", "model"), axis_types=(auto, auto))
    monkeypatch.setattr(_hosts, "known", lambda: Hosts(("a", "b"), (0, 1, 0, 1)))
    lines = meshkit.describe(mesh).splitlines()  # type: ignore[arg-type]
    assert lines[0] == "Mesh {'data': 2, 'model': 4}: 8 devices on 4 processes on 2 hosts"
    assert lines[-6:] == [
        "host a: processes 0,2; devices 0-1,4-5; data=0, model=0-3",
        "host b: processes 1,3; devices 2-3,6-7; data=1, model=0-3",
        "process 0 on a: devices 0-1; data=0, model=0-1",
        "process 1 on b: devices 2-3; data=1, model=0-1",
        "process 2 on a: devices 4-5; data=0, model=2-3",
        "process 3 on b: devices 6-7; data=1, model=2-3",
    ]


# ---- 4 processes x 2 CPU devices, two "hosts" named by MESHKIT_HOST, ranks interleaved -------


def _on_interleaved_hosts(joined_by_meshkit: bool):
    import os

    import jax
    from jax.sharding import PartitionSpec as P

    me = int(os.environ["MESHKIT_PROCESS_ID"])
    os.environ["MESHKIT_HOST"] = f"node-{'ab'[me % 2]}"  # mpirun --map-by node: 0, 2 | 1, 3
    if joined_by_meshkit:
        meshkit.init()
    else:  # a program that joins through JAX itself: make_mesh makes the exchange
        jax.config.update("jax_num_cpu_devices", int(os.environ["MESHKIT_CPU_DEVICES"]))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            os.environ["MESHKIT_COORDINATOR"], int(os.environ["MESHKIT_NUM_PROCESSES"]), me
        )
    mesh = meshkit.make_mesh({"data": -1, "model": 4})
    spec = P(("data", "model"))
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    part = meshkit.process_slice(mesh, spec, rows.shape)
    x = meshkit.global_array_from_local(part.take(rows), mesh, spec)
    per_host = jax.jit(
        jax.shard_map(
            lambda b: jax.lax.psum(b, "model"), mesh=mesh, in_specs=spec, out_specs=P("data")
        )
    )(x)
    info = meshkit.runtime_info()
    return {
        "procs": [[d.process_index for d in row] for row in mesh.devices],
        "ranges": part.ranges[0],
        "per_host": meshkit.gather(per_host, to="all"),
        "hosts": None if info is None or info.hosts is None else str(info.hosts),
        "describe": meshkit.describe(mesh),
    }


def _joined_by_meshkit():
    return _on_interleaved_hosts(True)


def _joined_by_jax():
    return _on_interleaved_hosts(False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("body", [_joined_by_meshkit, _joined_by_jax])
def test_interleaved_ranks_keep_the_inner_axis_inside_each_host(body):
    from meshkit.testing import run_in_processes

    results = run_in_processes(body, num_processes=4, devices_per_process=2, init=False)
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    for me, r in enumerate(results):
        assert r["procs"] == [[0, 0, 2, 2], [1, 1, 3, 3]]  # model: inside node-a, node-b
        # process p holds model positions 2*(p//2).. of its host's row: rows of the global array
        start = 4 * (me % 2) + 2 * (me // 2)
        assert r["ranges"] == ((start, start + 2),)
        np.testing.assert_array_equal(r["per_host"], np.stack([rows[:4].sum(0), rows[4:].sum(0)]))
        if body is _joined_by_meshkit:
            assert r["hosts"] == "node-a: processes 0,2; node-b: processes 1,3"
        assert r["describe"] == results[0]["describe"]
    lines = results[0]["describe"].splitlines()
    assert lines[0] == "Mesh {'data': 2, 'model': 4}: 8 devices on 4 processes on 2 hosts"
    assert lines[-6].startswith("host node-a: processes 0,2; devices ")
    assert lines[-6].endswith("; data=0, model=0-3")
    assert lines[-3].startswith("process 1 on node-b: devices ")


def test_the_docs_picture_is_drawn_from_the_code():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "docs" / "images" / "mesh_hosts.py"
    spec = importlib.util.spec_from_file_location("mesh_hosts_picture", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUT.read_text() == module.svg(), "redraw: python docs/images/mesh_hosts.py"
    assert "p2/d4096" in module.svg()
