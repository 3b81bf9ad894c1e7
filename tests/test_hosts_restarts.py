"""Whole-group restarts on simulated hosts, 2 hosts x 2 processes x 2 CPU devices: a process
killed on one host, and a whole host killed, at step 7 of 12 (a checkpoint every 2 steps); each
run ends with the uninterrupted run's final loss and parameters. And a preemption: SIGTERM to
one host's launcher reaches every process of both. Needs root (see `host_runs`).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import require
from host_runs import (
    LIMIT_S,
    finish,
    launcher,
    left,
    start,
    wait_for,
)
from hosts import Hosts
from ranks.preloads import ECOSYSTEM

import meshkit
from meshkit.testing._forks import starter

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits, pytest.mark.hosts]


# ---- restarts: a process killed, a host killed; the run ends as an uninterrupted one --------

TRAINING = Path(__file__).parent / "ranks" / "training.py"


def _finals(outs: Sequence[str]) -> list[str]:
    return [x.split("] ", 1)[1] for out in outs for x in out.splitlines() if "] FINAL " in x]


@pytest.fixture(scope="module")
def uninterrupted_final(tmp_path_factory) -> str:
    """The training loop's end, uninterrupted: 4 processes x 2 devices on this machine (forked
    from the fork server under nox, as `meshkit.testing` starts its ranks)."""
    require("orbax.checkpoint", "orbax")
    result = meshkit.launch(
        [str(TRAINING), str(tmp_path_factory.mktemp("whole"))],
        num_processes=4, devices_per_process=2, platform="cpu", timeout=LIMIT_S,
        stream=False, keep_output=True, starter=starter(None, "tests/test_hosts_restarts.py", ECOSYSTEM),
    )  # fmt: skip
    assert result.returncode == 0, result.report
    (final,) = [x for x in result.ranks[0].stdout.splitlines() if x.startswith("FINAL ")]
    return final


def test_a_process_killed_on_one_host_restarts_every_host(tmp_path, uninterrupted_final):
    with Hosts(2) as hosts:
        run = ["--max-restarts", "2", "-n", "2", "-d", "2", str(TRAINING), str(tmp_path / "ck"),
               "--kill-at", "7", "--victim", "3"]  # fmt: skip
        outs = finish(start(hosts, tmp_path, [launcher(0, run), launcher(1, run)]), tmp_path)
        assert left(hosts) == []
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
        procs = start(hosts, tmp_path, [launcher(0, run), launcher(1, run)])
        wait_for([ready / f"ready{p}" for p in range(4)])
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
            again = hosts.popen(1, launcher(1, run), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        ((code0, out0, err0_text),) = finish(procs[:1], tmp_path)
        again.wait(timeout=LIMIT_S)
        assert left(hosts) == []
    assert named_after < 15, named_after
    assert code0 == 0, err0_text
    assert again.returncode == 0, (tmp_path / "again.err").read_text()
    assert "machine 1 (host-1, 198.18.0.2) was lost" in err0_text, err0_text
    assert "meshkit launch: 1 restart (at most 1):" in err0_text, err0_text
    assert "; restored step 6 in " in err0_text, err0_text
    finals = _finals([out0, (tmp_path / "again.out").read_text()])
    assert finals == [uninterrupted_final]


# ---- a preemption notice to one host's launcher ---------------------------------------------

PREEMPTED = Path(__file__).parent / "ranks" / "preempted.py"


def test_sigterm_to_one_hosts_launcher_preempts_every_host(tmp_path):
    # Host 1's launcher forwards the notice to its ranks, which tell host 0's through the
    # coordination service: all four save at one step, end with 143, and both launchers report
    # the same and exit with 143 (not restarted: the launcher itself is being stopped).
    require("orbax.checkpoint", "orbax")
    ready = tmp_path / "ready"
    ready.mkdir()
    with Hosts(2) as hosts:
        run = ["--max-restarts", "1", "-n", "2", "-d", "2", str(PREEMPTED), str(tmp_path / "ck"),
               "should", "--victim", "9", "--ready", str(ready)]  # fmt: skip
        procs = start(hosts, tmp_path, [launcher(0, run), launcher(1, run)])
        wait_for([ready / f"ready{p}" for p in range(4)])
        procs[1].send_signal(signal.SIGTERM)
        outs = finish(procs, tmp_path)
        assert left(hosts) == []
    assert [code for code, _, _ in outs] == [143, 143], outs
    assert "SIGTERM: a preemption notice, forwarded to every rank" in outs[1][2]
    reports = [err[err.index("meshkit launch: preempted: ") :] for _, _, err in outs]
    assert reports[0] == reports[1]
    found = re.search(r"Every rank saved step (\d+) after it and exited \(status 143\)", reports[0])
    assert found, reports[0]
    saving = re.findall(r"\[rank(\d)\] SAVING (\d+)", outs[0][1] + outs[1][1])
    assert sorted(saving) == [(str(p), found.group(1)) for p in range(4)], saving
