"""`meshkit launch` on several machines, tried on simulated hosts (`tests/hosts.py`).

Each host is a network namespace with its own address (198.18.0.0/15), hostname and
/etc/hosts; one launcher runs on each, as a person runs one per machine. The runs are 2 hosts x
2 processes x 2 CPU devices. Needs root; CI sets ``MESHKIT_REQUIRE_HOSTS=1``, which turns the
skip into a failure.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from host_runs import (
    LIMIT_S,
    PORT,
    finish,
    launcher,
    left,
    start,
    wait_for,
)
from hosts import Hosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits, pytest.mark.hosts]


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


def test_a_psum_over_eight_devices_on_two_hosts(program, tmp_path):
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "2", str(program)]
        outs = finish(start(hosts, tmp_path, [launcher(0, run), launcher(1, run)]), tmp_path)
        assert left(hosts) == []
    for i, (code, out, err) in enumerate(outs):
        assert code == 0, err
        for me in (2 * i, 2 * i + 1):
            assert f"[rank{me}] host-{i} process {me} of 4: 8 devices, sum 20.0" in out, out


def test_a_failed_process_stops_every_host_and_each_reports_it(program, tmp_path):
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "2", str(program), "fail"]
        outs = finish(start(hosts, tmp_path, [launcher(0, run), launcher(1, run)]), tmp_path)
        assert left(hosts) == []
    for code, _, err in outs:
        assert code == 1, err
        # Rank 3 fails; the others, told at once, may exit before it: the report then names
        # rank 3 as the root cause.
        assert re.search(r"rank 3 failed first \(exit code 1\)|--- root cause: rank 3 ---", err), (
            err
        )
        assert re.search(r"[Rr]ank 3 ran on machine 1 \(host-1\)", err), err
        assert "process 3 fails on purpose" in err, err


def _two_waiting(hosts: Hosts, program: Path, tmp: Path) -> list[subprocess.Popen]:
    run = ["-n", "2", "-d", "2", str(program), "wait", str(tmp)]
    procs = start(hosts, tmp, [launcher(0, run), launcher(1, run)])
    wait_for([tmp / f"ready{r}" for r in range(4)])
    return procs


def test_a_host_killed_is_named_by_the_other(program, tmp_path):
    with Hosts(2) as hosts:
        procs = _two_waiting(hosts, program, tmp_path)
        killed_at = time.monotonic()
        assert hosts.kill(1)
        procs[0].wait(timeout=LIMIT_S)
        took = time.monotonic() - killed_at
        code, _, err = finish(procs, tmp_path)[0]
        assert left(hosts) == []
    assert code == 1, err
    assert "machine 1 (host-1, 198.18.0.2) was lost after" in err, err
    assert "s: its launcher's connection closed. Ranks 2-3 ran there;" in err, err
    assert took < 15, took


def test_a_host_unplugged_is_named_by_both(program, tmp_path):
    with Hosts(2) as hosts:
        procs = _two_waiting(hosts, program, tmp_path)
        hosts.unplug(1)
        (code0, _, err0), (code1, _, err1) = finish(procs, tmp_path)
        assert left(hosts) == []
    assert code0 == 1, err0
    assert "s: its launcher said nothing for 10 s. Ranks 2-3 ran there;" in err0, err0
    assert code1 == 1, err1
    assert "machine 0, which serves the coordinator, was lost" in err1, err1


def test_the_forming_line_names_the_host_whose_ranks_are_late(tmp_path):
    """Host-1's processes start only once machine 0 has said it waits for them (a file the test
    creates then), however slowly the machine runs: the line is always there to read."""
    go = tmp_path / "go"
    (tmp_path / "late.py").write_text(
        "import os, socket, sys, time\n"
        "if socket.gethostname() == 'host-1':  # slow to start (a slow disk, a big import)\n"
        "    deadline = time.monotonic() + 60\n"
        f"    while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.1)\n"
        "import meshkit\n"
        "meshkit.init()\n"
    )
    said = "ranks 0-1 joining; machine 1 (host-1): ranks 2-3 starting"
    with Hosts(2) as hosts:
        run = ["-n", "2", "-d", "1", str(tmp_path / "late.py")]
        procs = start(hosts, tmp_path, [launcher(0, run), launcher(1, run)])
        deadline = time.monotonic() + 60
        while said not in (tmp_path / "launcher0.err").read_text():
            if time.monotonic() > deadline:
                go.touch()  # let the run end; the assertion below says what was printed
                break
            time.sleep(0.1)
        go.touch()
        outs = finish(procs, tmp_path)
        assert left(hosts) == []
    (code0, _, err0), (code1, _, err1) = outs
    assert (code0, code1) == (0, 0), (err0, err1)
    waiting = [x for x in err0.splitlines() if "waiting for the cluster to form" in x]
    assert any(x.endswith(said) for x in waiting), err0
    assert "meshkit launch: the cluster formed after " in err0, err0


def test_a_program_that_never_joins_fails_on_every_host_unless_allowed(tmp_path):
    (tmp_path / "alone.py").write_text("print('alone')\n")
    for extra, expected in (([], 1), (["--allow-unjoined"], 0)):
        with Hosts(2) as hosts:
            run = [*extra, "-n", "2", str(tmp_path / "alone.py")]
            outs = finish(start(hosts, tmp_path, [launcher(0, run), launcher(1, run)]),
                           tmp_path)  # fmt: skip
            assert left(hosts) == []
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
        outs = finish(start(hosts, tmp, runs), tmp)
        assert left(hosts) == []
    for code, out, err in outs:
        assert code == 2, (code, out, err)
        assert "never runs" not in out
    return [err for _, _, err in outs]


def test_node_rank_outside_the_machines_is_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    out = subprocess.run(
        launcher(2, ["-n", "1", str(tmp_path / "p.py")]),
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
        [launcher(0, ["-n", "2", str(tmp_path / "p.py")]),
         launcher(1, ["-n", "1", str(tmp_path / "p.py")])],
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
        [launcher(0, ["-n", "1", str(tmp_path / "p.py")]),
         launcher(1, ["-n", "1", str(tmp_path / "q.py")])],
    )  # fmt: skip
    for err in errs:
        assert "the machines differ in program" in err, err


def test_two_machines_with_one_node_rank_are_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    run = ["-n", "1", str(tmp_path / "p.py")]
    errs = _join_fails(tmp_path, [launcher(0, run, 3), launcher(1, run, 3), launcher(1, run, 3)])
    for err in errs:  # in the order they joined
        assert "both say --node-rank 1." in err, err
        assert "machine 1 (host-1, 198.18.0.2)" in err, err
        assert "machine 1 (host-2, 198.18.0.3)" in err, err


def test_a_machine_that_never_joins_is_named_after_the_join_timeout(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    run = ["--join-timeout", "4", "-n", "1", str(tmp_path / "p.py")]
    errs = _join_fails(tmp_path, [launcher(0, run, 3), launcher(1, run, 3)])
    for err in errs:
        assert "machine 2 did not join within 4 s. Joined: machine 0 (host-0" in err, err


def test_a_coordinator_address_no_machine_owns_is_named(tmp_path):
    (tmp_path / "p.py").write_text(NOJAX)
    run = ["--join-timeout", "4", "-n", "1", str(tmp_path / "p.py")]
    wrong = f"198.18.0.9:{PORT}"
    errs = _join_fails(
        tmp_path, [launcher(0, run, coordinator=wrong), launcher(1, run, coordinator=wrong)]
    )
    assert "the coordinator '198.18.0.9' is not an address of machine 0 (host-0)" in errs[0]
    assert f"machine 1 could not reach the coordinator 198.18.0.9:{PORT} within 4 s" in errs[1]
