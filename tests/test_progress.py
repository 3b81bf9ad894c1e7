"""meshkit launch says which rank is where while the cluster forms (core/events.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit._src.core import events
from meshkit._src.core.errors import ranges
from meshkit._src.core.events import mark
from meshkit._src.launch.supervise import Board, summary


def test_ranges_folds_consecutive_ranks():
    assert ranges([]) == ""
    assert ranges([3]) == "3"
    assert ranges([4, 0, 1, 2, 7, 8]) == "0-2, 4, 7-8"


@given(st.sets(st.integers(0, 200), max_size=40))
def test_ranges_names_every_rank_once(ranks):
    named = set()
    for part in ranges(list(ranks)).split(", ") if ranks else []:
        lo, _, hi = part.partition("-")
        span = range(int(lo), int(hi or lo) + 1)
        assert not named & set(span)
        named |= set(span)
    assert named == ranks


def test_summary_groups_by_stage_in_order():
    stages = {0: "running", 1: "joined", 2: "joining", 3: "joining", 4: "starting", 5: "exited"}
    assert summary(stages) == (
        "rank 1 joined; rank 0 running; ranks 2-3 joining; rank 4 starting; rank 5 exited"
    )


def test_stages_read_the_status_files(tmp_path, monkeypatch):
    monkeypatch.setenv(events.ENV_STATUS, str(tmp_path))
    mark("joining", 0)
    monkeypatch.setenv("MESHKIT_PROCESS_ID", "2")
    mark("running")
    (tmp_path / "rank3").write_text("garbage")
    board = Board(tmp_path, 5)
    assert board.stages({4: 1}) == {
        0: "joining", 1: "starting", 2: "running", 3: "starting", 4: "exited"
    }  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank2", "rank3"]


def test_mark_outside_a_launch_run_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(events.ENV_STATUS, raising=False)
    monkeypatch.chdir(tmp_path)
    mark("joining", 0)
    monkeypatch.setenv(events.ENV_STATUS, str(tmp_path / "gone"))
    mark("joining", 0)  # a directory that went away: quieter, never an error
    assert list(tmp_path.iterdir()) == []


def test_board_is_quiet_when_the_cluster_forms_quickly(tmp_path):
    board = Board(tmp_path, 3)
    assert board.line({0: "starting", 1: "starting", 2: "starting"}, 0.5) is None
    assert board.line({0: "joining", 1: "starting", 2: "joining"}, 1.0) is None
    assert board.line({0: "joining", 1: "joining", 2: "joining"}, 2.9) is None
    assert board.line({0: "joined", 1: "running", 2: "joined"}, 3.0) is None
    assert board.line({0: "joining", 1: "starting", 2: "joining"}, 9.0) is None  # done


def test_board_says_who_waits_then_when_it_formed(tmp_path):
    board = Board(tmp_path, 4)  # says after 2 s, repeats a line every 5 s
    waiting = {0: "joining", 1: "joining", 2: "joining", 3: "starting"}
    assert board.line(waiting, 1.0) is None  # first join; nothing yet
    assert board.line(waiting, 3.0) == (
        "meshkit launch: waiting for the cluster to form (3.0 s): ranks 0-2 joining; "
        "rank 3 starting"
    )
    assert board.line(waiting, 4.0) is None  # nothing changed, not due
    assert board.line(waiting, 8.0) is not None  # due again after `every`
    changed = {**waiting, 3: "joining"}
    assert board.line(changed, 8.5) == (
        "meshkit launch: waiting for the cluster to form (8.5 s): ranks 0-3 joining"
    )
    formed = {0: "running", 1: "joined", 2: "joined", 3: "joined"}
    assert (
        board.line(formed, 9.0) == "meshkit launch: the cluster formed after 9.0 s: 4 ranks joined"
    )
    assert board.line(waiting, 20.0) is None


def test_board_names_ranks_that_exited_before_joining(tmp_path):
    board = Board(tmp_path, 3)
    assert board.line({0: "joining", 1: "joining", 2: "starting"}, 0.0) is None
    assert board.line({0: "joining", 1: "joining", 2: "exited"}, 2.5) == (
        "meshkit launch: waiting for the cluster to form (2.5 s): ranks 0-1 joining; rank 2 exited"
    )
    assert board.line({0: "exited", 1: "exited", 2: "exited"}, 3.0) == (
        "meshkit launch: every rank exited before the cluster formed (3.0 s)"
    )


def _launch_two(tmp_path, name: str, marker: str) -> subprocess.CompletedProcess[str]:
    """``meshkit launch -n 2 -d 1 name`` in ``tmp_path``, its output captured."""
    exe = shutil.which("meshkit")
    command = [exe] if exe else [sys.executable, "-m", "meshkit"]
    return subprocess.run(
        [*command, "launch", "-n", "2", "-d", "1", "--timeout", "120", name],
        cwd=tmp_path,
        env={**os.environ, "MESHKIT_TEST_MARKER": marker},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.multiprocess
def test_launch_shows_a_rank_that_is_slow_to_join(tmp_path, marker):
    # Rank 1 spends 4 s "loading data" before meshkit.init(); rank 0 waits in init meanwhile.
    (tmp_path / "slow.py").write_text(
        textwrap.dedent(
            """
            import os, time
            import jax  # paid before the sleep: `import meshkit` alone no longer imports JAX
            import meshkit
            if os.environ["MESHKIT_PROCESS_ID"] == "1":
                time.sleep(4)
            meshkit.init()
            mesh = meshkit.make_mesh({"data": -1})
            print("mesh", dict(mesh.shape))
            """
        )
    )
    out = _launch_two(tmp_path, "slow.py", marker)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank1] mesh {'data': 2}" in out.stdout
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshkit launch:")]
    assert lines, out.stderr
    assert re.fullmatch(
        r"meshkit launch: waiting for the cluster to form \(\d+\.\d s\): "
        r"rank 0 joining; rank 1 starting",
        lines[0],
    ), lines
    assert re.fullmatch(
        r"meshkit launch: the cluster formed after \d+\.\d s: 2 ranks joined", lines[-1]
    ), lines
    assert not out.stdout.count("meshkit launch:"), out.stdout  # the launcher's lines: stderr


@pytest.mark.multiprocess
def test_launch_says_nothing_when_the_cluster_forms_quickly(tmp_path, marker):
    # Both ranks meet at a file barrier first, so that imports slowed by a busy machine cannot
    # make one of them wait in init for more than the board's two seconds.
    (tmp_path / "quick.py").write_text(
        textwrap.dedent(
            """
            import os, pathlib, time
            import jax  # before the barrier: `import meshkit` alone no longer imports JAX
            import meshkit
            here = pathlib.Path(".")
            (here / f"ready{os.environ['MESHKIT_PROCESS_ID']}").touch()
            deadline = time.monotonic() + 60
            while not all((here / f"ready{r}").exists() for r in (0, 1)):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            meshkit.init()
            print("ok")
            """
        )
    )
    out = _launch_two(tmp_path, "quick.py", marker)
    assert out.returncode == 0, out.stdout + out.stderr
    # Silent, unless JAX's own join outlasted the board's two seconds on a loaded machine: then
    # both ranks are named as joining and neither is blamed for not having started.
    waits = [line for line in out.stderr.splitlines() if "waiting for the cluster" in line]
    assert all(line.endswith("): ranks 0-1 joining") for line in waits), out.stderr


class _FakeProc:
    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class _FakeRank:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc = _FakeProc()
        self.both: list[str] = []


def test_ranks_that_join_and_end_between_two_looks_still_formed_a_cluster(tmp_path, monkeypatch):
    # The launch-progress bug: the ranks joined and ended within one look at the status files,
    # and the launcher stopped watching before the board said that the cluster formed.
    from meshkit._src.launch.supervise import Supervisor

    monkeypatch.setenv(events.ENV_STATUS, str(tmp_path))
    ranks = [_FakeRank(0), _FakeRank(1)]
    said: list[str] = []
    now = [0.0]
    supervisor = Supervisor(
        ranks,  # type: ignore[arg-type]
        [],
        timeout=None,
        board=Board(tmp_path, 2),
        note=said.append,
        clock=lambda: now[0],
        start=0.0,
    )
    mark("joining", 0)  # rank 1 is still loading its data
    for t in (0.0, 1.0, 2.5):
        now[0] = t
        assert not supervisor.look()
    assert said == [
        "meshkit launch: waiting for the cluster to form (2.5 s): rank 0 joining; rank 1 starting"
    ]
    # Between this look and the next: both join, run and end.
    mark("joined", 0)
    mark("running", 1)
    ranks[0].proc.returncode = ranks[1].proc.returncode = 0
    now[0] = 2.6  # sooner than the board's next look would be due
    assert supervisor.look()
    assert said[1:] == ["meshkit launch: the cluster formed after 2.6 s: 2 ranks joined"]
    assert supervisor.outcome.first_failure is None
    assert not supervisor.outcome.timed_out


def test_a_rank_that_fails_before_joining_ends_the_board_too(tmp_path, monkeypatch):
    from meshkit._src.launch.supervise import Supervisor

    monkeypatch.setenv(events.ENV_STATUS, str(tmp_path))
    ranks = [_FakeRank(0), _FakeRank(1)]
    said: list[str] = []
    now = [0.0]
    board = Board(tmp_path, 2)
    supervisor = Supervisor(
        ranks,  # type: ignore[arg-type]
        [],
        timeout=None,
        board=board,
        note=said.append,
        clock=lambda: now[0],
        start=0.0,
    )
    mark("joining", 0)
    for t in (0.0, 3.0):
        now[0] = t
        assert not supervisor.look()
    ranks[1].proc.returncode = 2
    now[0] = 3.1
    assert supervisor.look()
    assert supervisor.outcome.first_failure == 1
    assert supervisor.outcome.failed_after == pytest.approx(3.1)
    assert said[-1] == (
        "meshkit launch: waiting for the cluster to form (3.1 s): rank 0 joining; rank 1 exited"
    )


def _supervised(ranks: list[_FakeRank]):
    from meshkit._src.launch.supervise import Supervisor

    return Supervisor(
        ranks,  # type: ignore[arg-type]
        [],
        timeout=None,
        board=None,
        note=lambda line: None,
        clock=lambda: 1.0,
        start=0.0,
    )


def test_a_rank_aborted_in_the_same_look_as_a_killed_one_is_not_named_first():
    # Rank 1 is killed (SIGKILL); rank 0, in a collective with it, is ended by Gloo's abort
    # within the 20 ms between two looks: the launcher named rank 0 (the lower rank).
    ranks = [_FakeRank(0), _FakeRank(1)]
    ranks[0].proc.returncode, ranks[1].proc.returncode = -signal.SIGABRT, -signal.SIGKILL
    supervisor = _supervised(ranks)
    assert supervisor.look()
    assert supervisor.outcome.first_failure == 1


_EXITS = st.sampled_from([0, 1, 2, 134, -signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV])


@given(codes=st.lists(_EXITS, min_size=1, max_size=8))
def test_the_first_failure_of_one_look_is_the_lowest_rank_not_aborted_else_the_lowest(codes):
    ranks = [_FakeRank(r) for r in range(len(codes))]
    for rank, code in zip(ranks, codes, strict=True):
        rank.proc.returncode = code
    supervisor = _supervised(ranks)
    assert supervisor.look()  # every rank has ended
    failed = [r for r, code in enumerate(codes) if code != 0]
    aborted = [r for r in failed if codes[r] in (134, -signal.SIGABRT)]
    others = [r for r in failed if r not in aborted]
    expected = (others or aborted or [None])[0]
    assert supervisor.outcome.first_failure == expected


def test_the_waiting_line_names_the_other_machines_still_forming(tmp_path):
    board = Board(tmp_path, [0, 1])
    others = {"machine 1 (host-1)": "ranks 2-3 starting"}
    assert board.line({0: "joining", 1: "joining"}, 0.5, others) is None  # too early
    assert board.line({0: "joining", 1: "joining"}, 2.6, others) == (
        "meshkit launch: waiting for the cluster to form (2.6 s): ranks 0-1 joining; "
        "machine 1 (host-1): ranks 2-3 starting"
    )
    # What another machine does is news too: a line at once.
    assert board.line(
        {0: "joining", 1: "joining"}, 2.7, {"machine 1 (host-1)": "ranks 2-3 joining"}
    )
    assert board.line({0: "joined", 1: "joined"}, 3.0, {}) == (
        "meshkit launch: the cluster formed after 3.0 s: 2 ranks joined"
    )
