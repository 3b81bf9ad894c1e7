"""`meshkit launch` on several machines, tried on simulated hosts (`tests/hosts.py`).

Each host is a network namespace with its own address (198.18.0.0/15), hostname and
/etc/hosts; one launcher runs on each, as a person runs one per machine. The runs are 2 hosts x
2 processes x 2 CPU devices. Needs root; CI sets ``MESHKIT_REQUIRE_HOSTS=1``, which turns the
skip into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import require
from hosts import Hosts, unavailable

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]


@pytest.fixture(autouse=True)
def _simulated_hosts_can_be_made() -> None:
    why = unavailable()
    if why is not None:
        if os.environ.get("MESHKIT_REQUIRE_HOSTS") == "1":
            pytest.fail(f"{why}, but MESHKIT_REQUIRE_HOSTS=1 (CI runs as root)")
        pytest.skip(why)


PORT = 29500  # each host has its own ports: a second copy of the suite uses other namespaces
COORDINATOR = f"198.18.0.1:{PORT}"
LIMIT_S = 90  # no launcher of these tests may run longer

PROGRAM = """\
import socket, sys, time
import jax, numpy as np
import meshkit

meshkit.init()
mesh = meshkit.make_mesh({"x": -1})
me = jax.process_index()
x = meshkit.global_array_from_local(np.full((2, 1), me + 1, np.float32), mesh, "x")
total = float(jax.jit(lambda a: a.sum())(x))
print(f"{socket.gethostname()} process {me} of {jax.process_count()}: "
      f"{jax.device_count()} devices, sum {total}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "fail" and me == 3:
    raise SystemExit("process 3 fails on purpose")
if mode == "wait":
    open(f"{sys.argv[2]}/ready{me}", "w").close()
    time.sleep(600)
"""


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return path


def _launcher(
    node: int, args: Sequence[str], nnodes: int = 2, coordinator: str = COORDINATOR
) -> list[str]:
    return [
        sys.executable, "-m", "meshkit", "launch", "--nnodes", str(nnodes), "--node-rank",
        str(node), "--coordinator", coordinator, "--timeout", str(LIMIT_S), *args,
    ]  # fmt: skip


def _start(hosts: Hosts, tmp: Path, runs: Sequence[Sequence[str]]) -> list[subprocess.Popen]:
    """One launcher per host, ``runs[i]`` its command; output to files in ``tmp``."""
    procs = []
    for i, argv in enumerate(runs):
        with open(tmp / f"launcher{i}.out", "w") as out, open(tmp / f"launcher{i}.err", "w") as err:
            procs.append(hosts.popen(i, argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
    return procs


def _finish(procs: Sequence[subprocess.Popen], tmp: Path) -> list[tuple[int, str, str]]:
    """Each launcher's exit status, stdout and stderr; a launcher over `LIMIT_S` fails the test."""
    deadline = time.monotonic() + LIMIT_S + 30
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait(timeout=10)
            pytest.fail(f"a launcher ran past {LIMIT_S + 30} s")
    return [
        (
            p.returncode,
            (tmp / f"launcher{i}.out").read_text(),
            (tmp / f"launcher{i}.err").read_text(),
        )
        for i, p in enumerate(procs)
    ]


def _wait_for(paths: Sequence[Path], limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not all of {paths} appeared within {limit} s"
        time.sleep(0.1)


def _left(hosts: Hosts) -> list[int]:
    return [pid for i in range(hosts.n) for pid in hosts.pids(i)]


def test_a_psum_over_eight_devices_on_two_hosts(program, tmp_path):
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "2", str(program)]
        outs = _finish(_start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)]), tmp_path)
        assert _left(hosts) == []
    for i, (code, out, err) in enumerate(outs):
        assert code == 0, err
        for me in (2 * i, 2 * i + 1):
            assert f"[rank{me}] host-{i} process {me} of 4: 8 devices, sum 20.0" in out, out


def test_a_failed_process_stops_every_host_and_each_reports_it(program, tmp_path):
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "2", str(program), "fail"]
        outs = _finish(_start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)]), tmp_path)
        assert _left(hosts) == []
    for code, _, err in outs:
        assert code == 1, err
        assert "meshkit launch: rank 3 failed first (exit code 1)" in err, err
        assert "Rank 3 ran on machine 1 (host-1)." in err, err
        assert "process 3 fails on purpose" in err, err


def _two_waiting(hosts: Hosts, program: Path, tmp: Path) -> list[subprocess.Popen]:
    run = ["-n", "2", "-d", "2", str(program), "wait", str(tmp)]
    procs = _start(hosts, tmp, [_launcher(0, run), _launcher(1, run)])
    _wait_for([tmp / f"ready{r}" for r in range(4)])
    return procs


def test_a_host_killed_is_named_by_the_other(program, tmp_path):
    with Hosts(2) as hosts:
        procs = _two_waiting(hosts, program, tmp_path)
        killed_at = time.monotonic()
        assert hosts.kill(1)
        procs[0].wait(timeout=LIMIT_S)
        took = time.monotonic() - killed_at
        code, _, err = _finish(procs, tmp_path)[0]
        assert _left(hosts) == []
    assert code == 1, err
    assert "machine 1 (host-1, 198.18.0.2) was lost after" in err, err
    assert "s: its launcher's connection closed. Ranks 2-3 ran there;" in err, err
    assert took < 15, took


def test_a_host_unplugged_is_named_by_both(program, tmp_path):
    with Hosts(2) as hosts:
        procs = _two_waiting(hosts, program, tmp_path)
        hosts.unplug(1)
        (code0, _, err0), (code1, _, err1) = _finish(procs, tmp_path)
        assert _left(hosts) == []
    assert code0 == 1, err0
    assert "s: its launcher said nothing for 10 s. Ranks 2-3 ran there;" in err0, err0
    assert code1 == 1, err1
    assert "machine 0, which serves the coordinator, was lost" in err1, err1


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
        outs = _finish(_start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)]), tmp_path)
        assert _left(hosts) == []
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
        outs = _finish(procs, tmp_path)
        assert _left(hosts) == []
    # by rank alone the rows would be [[0, 0, 1, 1], [2, 2, 3, 3]], each across both hosts
    _check_meshes(outs, [0, 1, 0, 1], [[0, 0, 2, 2], [1, 1, 3, 3]], "0,2; host-1: processes 1,3")


# ---- restarts: a process killed, a host killed; the run ends as an uninterrupted one --------

TRAINING = Path(__file__).parent / "ranks" / "training.py"


def _finals(outs: Sequence[str]) -> list[str]:
    return [x.split("] ", 1)[1] for out in outs for x in out.splitlines() if "] FINAL " in x]


@pytest.fixture(scope="module")
def uninterrupted_final(tmp_path_factory) -> str:
    """The training loop's end, uninterrupted: 4 processes x 2 devices on this machine."""
    require("orbax.checkpoint", "orbax")
    root = tmp_path_factory.mktemp("whole")
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "launch", "-n", "4", "-d", "2", "--timeout",
         str(LIMIT_S), str(TRAINING), str(root)],
        capture_output=True, text=True, timeout=LIMIT_S + 30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (final,) = _finals([out.stdout])
    return final


def test_a_process_killed_on_one_host_restarts_every_host(tmp_path, uninterrupted_final):
    with Hosts(2) as hosts:
        run = ["--max-restarts", "2", "-n", "2", "-d", "2", str(TRAINING), str(tmp_path / "ck"),
               "--kill-at", "7", "--victim", "3"]  # fmt: skip
        outs = _finish(_start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)]), tmp_path)
        assert _left(hosts) == []
    for code, _, err in outs:
        assert code == 0, err
        assert "meshkit launch: restarting every process (restart 1 of at most 2): rank 3 " in err
        assert "meshkit launch: 1 restart (at most 2):" in err, err
        assert "; restored step 6 in " in err, err
    assert _finals([out for _, out, _ in outs]) == [uninterrupted_final]


def test_a_host_killed_restarts_the_group_when_its_launcher_comes_back(
    tmp_path, uninterrupted_final
):
    ready = tmp_path / "ready"
    ready.mkdir()
    with Hosts(2) as hosts:
        run = ["--max-restarts", "1", "-n", "2", "-d", "2", str(TRAINING), str(tmp_path / "ck"),
               "--pause-at", "7", str(ready)]  # fmt: skip
        procs = _start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)])
        _wait_for([ready / f"ready{p}" for p in range(4)])
        killed_at = time.monotonic()
        assert hosts.kill(1)  # the machine dies: its launcher and its ranks
        procs[1].wait(timeout=10)
        err0 = tmp_path / "launcher0.err"
        deadline = time.monotonic() + 30
        while "restarting every process" not in err0.read_text():
            assert time.monotonic() < deadline, err0.read_text()
            time.sleep(0.1)
        named_after = time.monotonic() - killed_at
        # The machine comes back (a replaced VM, a restarted pod): its launcher, as before.
        with open(tmp_path / "again.out", "w") as out, open(tmp_path / "again.err", "w") as err:
            again = hosts.popen(1, _launcher(1, run), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        ((code0, out0, err0_text),) = _finish(procs[:1], tmp_path)
        again.wait(timeout=LIMIT_S)
        assert _left(hosts) == []
    assert named_after < 15, named_after
    assert code0 == 0, err0_text
    assert again.returncode == 0, (tmp_path / "again.err").read_text()
    assert "machine 1 (host-1, 198.18.0.2) was lost" in err0_text, err0_text
    assert "meshkit launch: 1 restart (at most 1):" in err0_text, err0_text
    assert "; restored step 6 in " in err0_text, err0_text
    finals = _finals([out0, (tmp_path / "again.out").read_text()])
    assert finals == [uninterrupted_final]


def test_the_forming_line_names_the_host_whose_ranks_are_late(tmp_path):
    (tmp_path / "late.py").write_text(
        "import socket, time\n"
        "if socket.gethostname() == 'host-1':\n"
        "    time.sleep(6)  # its ranks are slow to start (a slow disk, a big import)\n"
        "import meshkit\n"
        "meshkit.init()\n"
    )
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "1", str(tmp_path / "late.py")]
        outs = _finish(_start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)]), tmp_path)
        assert _left(hosts) == []
    (code0, _, err0), (code1, _, err1) = outs
    assert (code0, code1) == (0, 0), (err0, err1)
    waiting = [x for x in err0.splitlines() if "waiting for the cluster to form" in x]
    assert any(x.endswith("ranks 0-1 joining; machine 1 (host-1): ranks 2-3 starting")
               for x in waiting), err0  # fmt: skip
    assert "meshkit launch: the cluster formed after " in err0, err0


def test_a_program_that_never_joins_fails_on_every_host_unless_allowed(tmp_path):
    (tmp_path / "alone.py").write_text("print('alone')\n")
    for extra, expected in (([], 1), (["--allow-unjoined"], 0)):
        with Hosts(2) as hosts:
            run = [*extra, "-n", "2", str(tmp_path / "alone.py")]
            outs = _finish(_start(hosts, tmp_path, [_launcher(0, run), _launcher(1, run)]),
                           tmp_path)  # fmt: skip
            assert _left(hosts) == []
        for code, out, err in outs:
            assert code == expected, err
            assert out.count("alone") == 2, out
            if expected:
                assert "but none joined the program (none called meshkit.init())" in err, err


# ---- bad settings: named on every machine that started, within the join timeout -------------

NOJAX = "print('never runs')\n"


def _join_fails(tmp: Path, runs: Sequence[Sequence[str]], n: int | None = None) -> list[str]:
    """Start the launchers on hosts 0.., expect each to fail the join (status 2); their errors."""
    with Hosts(n or len(runs)) as hosts:
        outs = _finish(_start(hosts, tmp, runs), tmp)
        assert _left(hosts) == []
    for code, out, err in outs:
        assert code == 2, (code, out, err)
        assert "never runs" not in out
    return [err for _, _, err in outs]


def test_node_rank_outside_the_machines_is_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    out = subprocess.run(
        _launcher(2, ["-n", "1", str(tmp_path / "p.py")]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--node-rank 2 is outside 0..1 (--nnodes 2)" in out.stderr, out.stderr


def test_machines_with_different_process_counts_are_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    errs = _join_fails(
        tmp_path,
        [_launcher(0, ["-n", "2", str(tmp_path / "p.py")]),
         _launcher(1, ["-n", "1", str(tmp_path / "p.py")])],
    )  # fmt: skip
    for err in errs:
        assert (
            "the machines differ in -n: machine 0 (host-0, 198.18.0.1) has 2, "
            "machine 1 (host-1, 198.18.0.2) has 1." in err
        ), err


def test_machines_running_different_programs_are_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    (tmp_path / "q.py").write_text(NOJAX + "# another\n")
    errs = _join_fails(
        tmp_path,
        [_launcher(0, ["-n", "1", str(tmp_path / "p.py")]),
         _launcher(1, ["-n", "1", str(tmp_path / "q.py")])],
    )  # fmt: skip
    for err in errs:
        assert "the machines differ in program" in err, err


def test_two_machines_with_one_node_rank_are_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    run = ["-n", "1", str(tmp_path / "p.py")]
    errs = _join_fails(tmp_path, [_launcher(0, run, 3), _launcher(1, run, 3), _launcher(1, run, 3)])
    for err in errs:  # in the order they joined
        assert "both say --node-rank 1." in err, err
        assert "machine 1 (host-1, 198.18.0.2)" in err, err
        assert "machine 1 (host-2, 198.18.0.3)" in err, err


def test_a_machine_that_never_joins_is_named_after_the_join_timeout(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    run = ["--join-timeout", "4", "-n", "1", str(tmp_path / "p.py")]
    errs = _join_fails(tmp_path, [_launcher(0, run, 3), _launcher(1, run, 3)])
    for err in errs:
        assert "machine 2 did not join within 4 s. Joined: machine 0 (host-0" in err, err


def test_a_coordinator_address_no_machine_owns_is_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    run = ["--join-timeout", "4", "-n", "1", str(tmp_path / "p.py")]
    wrong = f"198.18.0.9:{PORT}"
    errs = _join_fails(
        tmp_path, [_launcher(0, run, coordinator=wrong), _launcher(1, run, coordinator=wrong)]
    )
    assert "the coordinator '198.18.0.9' is not an address of machine 0 (host-0)" in errs[0]
    assert f"machine 1 could not reach the coordinator 198.18.0.9:{PORT} within 4 s" in errs[1]
