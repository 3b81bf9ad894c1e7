"""meshkit launch: real processes, fail-fast, timeouts, bad inputs, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES, processes_with_marker

import meshkit
from meshkit import LaunchError
from meshkit._src.launch import reaper as _reaper
from meshkit._src.launch.ports import port_in_use, reserve_port
from meshkit._src.launch.rank_output import Pump, Sink
from meshkit._src.launch.spawn import rank_environments
from meshkit._src.launch.supervise import unjoined_report

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]


def cli(*args: str, env: dict[str, str] | None = None, cwd=None, timeout: float = 120):
    exe = shutil.which("meshkit")
    command = [exe] if exe else [sys.executable, "-m", "meshkit"]
    return subprocess.run(
        [*command, *args],
        env={**os.environ, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def script(tmp_path, body: str, name: str = "prog.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_demo_prints_from_both_ranks_and_exits_0(tmp_path, marker):
    out = cli(
        "launch", "-n", "2", "--devices-per-process", "4", "--log-dir", str(tmp_path / "logs"),
        str(EXAMPLES / "hello_mesh.py"),
        env={"MESHKIT_TEST_MARKER": marker},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[rank0] Mesh {'data': 2, 'model': 4}: 8 devices on 2 processes" in out.stdout
    assert "[rank0] process 0: devices 0-3; data=0, model=0-3" in out.stdout
    for r in (0, 1):
        assert f"[rank{r}] process {r}/2: psum over 8 devices = 28 (expected 28)" in out.stdout
        log = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert f"process {r}/2: psum over 8 devices = 28" in log


def test_failing_rank_stops_the_others_fast(tmp_path, marker):
    prog = script(
        tmp_path,
        """
        import time, meshkit
        info = meshkit.init()
        mesh = meshkit.make_mesh({"data": -1})
        if info.process_id == 1:
            raise RuntimeError("planted failure in rank 1")
        time.sleep(300)  # rank 0 would wait for ever
        """,
    )
    start = time.monotonic()
    out = cli("launch", "-n", "2", "-d", "4", str(prog), env={"MESHKIT_TEST_MARKER": marker})
    elapsed = time.monotonic() - start
    assert out.returncode == 1
    assert elapsed < 30, elapsed
    first = re.search(r"rank (\d) failed first \(exit code 1\) after [\d.]+ s", out.stderr)
    assert first, out.stderr[-3000:]
    if first.group(1) == "1":  # rank 0 is stopped by the launcher, or ends itself, told at once
        assert "Stopped the other ranks: 0." in out.stderr or (
            "[rank0] Process 0 stops too (status 1)" in out.stderr
        ), out.stderr[-3000:]
    else:  # rank 0's fail-fast may end it before a look finds rank 1 ended
        assert "The evidence points to rank 1" in out.stderr
    cause = out.stderr.split("--- root cause: rank 1 ---", 1)[1]
    assert "RuntimeError: planted failure in rank 1" in cause
    assert 'File "' in cause  # the traceback itself
    assert "line 6" in cause


def test_failure_api_result(tmp_path, marker):
    prog = script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["MESHKIT_PROCESS_ID"] == "2":
            sys.exit(3)
        time.sleep(300)
        """,
    )
    res = meshkit.launch(
        [str(prog)], num_processes=3, stream=False, grace=1, env={"MESHKIT_TEST_MARKER": marker}
    )
    assert res.returncode == 3  # the failing rank's own exit code
    assert res.first_failure == 2
    assert [r.stopped_by_launcher for r in res.ranks] == [True, True, False]
    assert res.ranks[2].returncode == 3
    assert all(r.pid > 0 for r in res.ranks)
    assert res.report.startswith("meshkit launch: rank 2 failed first (exit code 3)")


def test_rank_killed_by_signal(tmp_path, marker):
    prog = script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["MESHKIT_PROCESS_ID"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
        """,
    )
    res = meshkit.launch(
        [str(prog)], num_processes=2, stream=False, grace=1, env={"MESHKIT_TEST_MARKER": marker}
    )
    assert res.returncode == 1
    assert res.first_failure == 1
    assert "rank 1 failed first (killed by SIGKILL)" in res.report
    assert res.ranks[0].stopped_by_launcher
    assert res.elapsed < 30


def test_timeout_kills_a_hung_rank(tmp_path, marker):
    # No JAX here: the run's timing must not depend on how fast JAX starts on a loaded machine.
    prog = script(
        tmp_path,
        """
        import os, signal, time
        rank = os.environ["MESHKIT_PROCESS_ID"]
        print("rank", rank, "started", flush=True)
        if rank == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX's preemption handler does
            time.sleep(300)
        """,
    )
    start = time.monotonic()
    out = cli(
        "launch", "-n", "2", "--timeout", "4", "--grace", "1", str(prog),
        env={"MESHKIT_TEST_MARKER": marker},
    )  # fmt: skip
    assert out.returncode == 124
    assert time.monotonic() - start < 30
    assert "timed out after 4 s; ranks still running then: 0. All were killed." in out.stderr
    assert "--- last output of rank 0 ---\n  | rank 0 started" in out.stderr
    assert "[rank1] rank 1 started" in out.stdout


# Starts the rest of its command line with one signal ignored (an ignored signal stays ignored
# across exec), as a background job of a non-interactive shell starts with SIGINT ignored and
# nohup with SIGHUP ignored; no fork hook needed.
_START_IGNORING = (
    "import os, signal, sys; signal.signal(int(sys.argv[1]), signal.SIG_IGN); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)

# Rank 0 ends on SIGTERM, saying so; rank 1 ignores it, as JAX's preemption handler does, so
# only the SIGKILL after the grace period ends it.
_WAITS_FOR_A_SIGNAL = """\
import os, signal, sys, time
rank = os.environ["MESHKIT_PROCESS_ID"]
if rank == "0":
    signal.signal(signal.SIGTERM, lambda *_: (print("rank 0 got SIGTERM", flush=True), sys.exit(0)))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", rank, flush=True)
open(os.path.join(sys.argv[1], "up" + rank), "w").close()  # its handler is in place
time.sleep(300)
"""


def _signalled_launcher(tmp_path, marker, signals, *, start_ignored=None, grace="1", env=None):
    """Run `_WAITS_FOR_A_SIGNAL` under the launcher, send ``signals`` (1 s apart) once both
    ranks are up; ``(returncode, stdout, stderr, seconds after the first signal, rank pids)``."""
    prog = script(tmp_path, _WAITS_FOR_A_SIGNAL)
    exe = shutil.which("meshkit")
    command = [exe] if exe else [sys.executable, "-m", "meshkit"]
    if start_ignored is not None:
        command = [sys.executable, "-c", _START_IGNORING, str(int(start_ignored)), *command]
    proc = subprocess.Popen(
        [*command, "launch", "-n", "2", "--grace", grace, str(prog), str(tmp_path)],
        env={**os.environ, "MESHKIT_TEST_MARKER": marker, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        up = [tmp_path / "up0", tmp_path / "up1"]
        while not all(p.exists() for p in up) and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [p for p in processes_with_marker(marker) if _is_rank(p)]
        assert len(ranks) == 2, ranks  # and each has its own signal handler in place
        sent = time.monotonic()
        for i, sig in enumerate(signals):
            if i:
                time.sleep(1)
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait(timeout=10)
    left = set(processes_with_marker(marker)) & set(ranks)
    assert not left, f"ranks still running after the launcher returned: {left}"
    return proc.returncode, out, err, took, ranks


@pytest.mark.parametrize("start_ignored", [False, True], ids=["", "started-ignored"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_launcher_signal_stops_every_rank(tmp_path, marker, sig, start_ignored):
    # SIGINT is what Ctrl-C sends, SIGHUP what a closed terminal sends.
    code, out, err, took, _ = _signalled_launcher(
        tmp_path, marker, [sig], start_ignored=sig if start_ignored else None
    )
    assert code == 128 + sig, (code, err)
    assert f"meshkit launch: interrupted by {sig.name}; every rank was stopped.\n" in err, err
    assert "[rank0] rank 0 got SIGTERM" in out, out  # stopped by SIGTERM first ...
    assert took < 20, took  # ... and rank 1, which ignores it, by SIGKILL after --grace 1


@pytest.mark.parametrize("start_ignored", [False, True], ids=["", "started-ignored"])
def test_launcher_sigterm_is_a_preemption_notice_for_every_rank(tmp_path, marker, start_ignored):
    # A scheduler's SIGTERM goes to each rank, which ends by itself (rank 0, whose program takes
    # SIGTERM and exits); one that does not end within MESHKIT_PREEMPT_GRACE and --grace (rank
    # 1 ignores SIGTERM) is stopped. A second SIGTERM changes nothing.
    code, out, err, took, _ = _signalled_launcher(
        tmp_path, marker, [signal.SIGTERM, signal.SIGTERM],
        start_ignored=signal.SIGTERM if start_ignored else None,
        env={"MESHKIT_PREEMPT_GRACE": "2"},
    )  # fmt: skip
    assert code == 128 + signal.SIGTERM, (code, err)
    assert "meshkit launch: SIGTERM: a preemption notice, forwarded to every rank" in err, err
    assert err.count("forwarded to every rank") == 1, err
    assert "[rank0] rank 0 got SIGTERM" in out, out
    assert "meshkit launch: preempted: the notice (SIGTERM to the launcher) reached" in err, err
    assert "Ranks 1 had not ended when the launcher's wait after the notice ran out" in err, err
    assert 2 <= took < 20, took


_LAUNCH = [sys.executable, "-m", "meshkit", "launch"]


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_second_signal_skips_the_grace_period(tmp_path, marker, first):
    # Rank 1 ignores SIGTERM and would hold the launcher for --grace 60 s; after a SIGTERM (a
    # notice), the SIGINT that follows stops the run, and a third signal hurries that stop.
    signals = [first, signal.SIGINT] + ([signal.SIGHUP] if first == signal.SIGTERM else [])
    code, _, err, took, _ = _signalled_launcher(tmp_path, marker, signals, grace="60")
    assert code == 128 + signal.SIGINT, err  # the signal that stopped the run
    assert "interrupted by SIGINT; every rank was stopped." in err
    assert took < 20, took


def _is_rank(pid: int) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(e.startswith(b"MESHKIT_PROCESS_ID=") for e in environ)


# Each rank starts two children in new sessions, out of its process group: one keeps the
# environment (MESHKIT_TEST_MARKER and the run's token), one gets an empty one (found only by
# the launcher's subreaper or its earlier looks). Their pids go to files the test reads.
_STARTS_CHILDREN = """\
import os, subprocess, sys, time
rank = os.environ["MESHKIT_PROCESS_ID"]
kept = subprocess.Popen(["sleep", "60"], start_new_session=True)
bare = subprocess.Popen(["sleep", "61"], start_new_session=True, env={})
with open(f"status{rank}", "w") as f:
    f.write(os.environ["MESHKIT_LAUNCH_STATUS"])
with open(f"children{rank}.tmp", "w") as f:
    f.write(f"{kept.pid} {bare.pid}")
os.rename(f"children{rank}.tmp", f"children{rank}")
print("started", kept.pid, bare.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""


def _children(tmp_path, ranks: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [tmp_path / f"children{r}" for r in range(ranks)]
        if all(f.exists() for f in files):
            return [int(pid) for f in files for pid in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the ranks did not start their children in time")


def _running(pid: int) -> bool:
    """Whether pid is a live (not zombie) sleep: the one a rank started, or a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z" and cmdline.startswith(b"sleep\0")


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


_NO_SWEEP = pytest.mark.skipif(
    not _reaper.supported(),
    reason="no /proc here: the launcher cannot find the ranks' children outside their groups",
)


@_NO_SWEEP
def test_children_in_new_sessions_end_with_the_run(tmp_path, marker):
    # Before: they survived, and a 1 s program took 21.9 s to return (the output pumps waited
    # for the pipes those children held).
    prog = script(tmp_path, _STARTS_CHILDREN)
    bystander = subprocess.Popen(["sleep", "60"])  # not the run's: must survive it
    children: list[int] = []
    try:
        start = time.monotonic()
        out = cli("launch", "-n", "2", "--grace", "1", "--allow-unjoined", str(prog), "1", cwd=tmp_path,
                  env={"MESHKIT_TEST_MARKER": marker})  # fmt: skip
        took = time.monotonic() - start
        children = _children(tmp_path, 2, timeout=1)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("started") == 2, out.stdout
        assert took < 15, took  # 1 s of program and the launcher's start-up on a busy machine
        assert [pid for pid in children if _running(pid)] == []
        assert bystander.poll() is None
    finally:
        _kill_all(children)
        bystander.kill()
        bystander.wait(timeout=10)


@_NO_SWEEP
def test_children_in_new_sessions_end_with_a_run_from_python(tmp_path, marker):
    # No subreaper here (the caller may start processes of its own): the run's token and the
    # launcher's looks during the run find the children; the bystander must survive.
    prog = script(tmp_path, _STARTS_CHILDREN)
    bystander = subprocess.Popen(["sleep", "60"])
    children: list[int] = []
    try:
        res = meshkit.launch([str(prog), "3"], num_processes=2, stream=False, grace=1,
                             allow_unjoined=True,
                             cwd=tmp_path, env={"MESHKIT_TEST_MARKER": marker})  # fmt: skip
        children = _children(tmp_path, 2, timeout=1)
        assert res.returncode == 0, res.report
        assert res.elapsed < 12, res.elapsed
        assert [pid for pid in children if _running(pid)] == []
        assert bystander.poll() is None
    finally:
        _kill_all(children)
        bystander.kill()
        bystander.wait(timeout=10)


def test_looks_for_the_runs_processes_are_spaced_by_their_cpu_time_not_their_wait(monkeypatch):
    # On a loaded machine a look at /proc waits for a CPU; spaced by that wall time, looks came
    # 5 s and more apart, and the children a 3 s rank started in new sessions escaped unseen.
    from meshkit._src.launch import reaper as _reaper

    def slow_table():
        time.sleep(0.2)  # waiting, not working
        return {}

    monkeypatch.setattr(_reaper, "_table", slow_table)
    reaper = _reaper.Reaper("t0ken")
    start = time.monotonic()
    reaper.watch()
    assert reaper._next_watch - start < 1.0, reaper._next_watch - start
    assert reaper.watch() == []  # too soon: no look


@_NO_SWEEP
def test_everything_dies_with_a_killed_launcher(tmp_path, marker):
    """SIGKILL gives the launcher no chance to clean up; its ranks and their children must go."""
    prog = script(tmp_path, _STARTS_CHILDREN)
    children: list[int] = []
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshkit", "launch", "-n", "2", "--grace", "1", str(prog), "300"],
        env={**os.environ, "MESHKIT_TEST_MARKER": marker},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        children = _children(tmp_path, 2)
        # launcher, its guardian, 2 ranks and their 2 children that kept the environment
        assert len(processes_with_marker(marker)) == 6, processes_with_marker(marker)
        # The launcher looks about every 0.5 s; on a loaded machine (a CI run beside other
        # work measured load 12 on 2 cores) a look can take seconds: give it several.
        time.sleep(5)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            processes_with_marker(marker) or any(_running(pid) for pid in children)
        ):
            time.sleep(0.1)
        assert processes_with_marker(marker) == []
        assert [pid for pid in children if _running(pid)] == []
        status = Path((tmp_path / "status0").read_text())
        assert status.name.startswith("meshkit-launch-")
        assert not status.exists()  # the guardian removed the run's status directory too
    finally:
        proc.kill()
        proc.wait(timeout=10)
        _kill_all(children)


def test_pump_stops_waiting_on_a_pipe_held_open(tmp_path):
    # A child that escaped every sweep keeps the write end: the pump reads what is there,
    # then ends, instead of waiting for an end-of-file that never comes.
    r, w = os.pipe()
    lines: list[str] = []
    pump = Pump(os.fdopen(r, "rb", buffering=0), lines.append, "test-pump")
    try:
        os.write(w, b"one\ntwo\nno newline")
        time.sleep(0.3)
        assert lines == ["one", "two"]
        start = time.monotonic()
        pump.finish(0.2)
        os.write(w, b" yet\nthree\n")  # written after finish: still read, without waiting
        pump.thread.join(timeout=10)
        assert not pump.thread.is_alive()
        assert time.monotonic() - start < 5
        assert lines == ["one", "two", "no newline yet", "three"]
    finally:
        os.close(w)


def test_run_token_nests():
    assert _reaper.tagged({}, "b") == "b"
    assert _reaper.tagged({"MESHKIT_LAUNCH_RUN": "a"}, "b") == "a:b"


def _read_slowly(pipe, into: list[bytes]) -> None:
    # A reader that lags behind: the launcher's writes to its stdout block most of the time.
    while chunk := pipe.read(512):
        into.append(chunk)
        time.sleep(0.002)


def test_log_dir_keeps_every_line_when_stdout_is_read_slowly(tmp_path, marker):
    # Rank 1 raises only once rank 0 is done, so neither is stopped early: every line they
    # wrote, and rank 1's traceback, must be in the logs (before: 2,361 / 2,727 of 3,000 lines,
    # no traceback, and "I/O operation on closed file").
    prog = script(
        tmp_path,
        """
        import os, time
        from pathlib import Path
        rank = os.environ["MESHKIT_PROCESS_ID"]
        for i in range(3000):
            print(f"rank {rank} line {i:04d}")
        if rank == "0":
            Path("rank0.done").touch()
        else:
            deadline = time.monotonic() + 60
            while not Path("rank0.done").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("planted after 3000 lines")
        """,
    )
    exe = shutil.which("meshkit")
    command = [exe] if exe else [sys.executable, "-m", "meshkit"]
    chunks: list[bytes] = []
    with subprocess.Popen(
        [*command, "launch", "-n", "2", "--grace", "1", "--log-dir", "logs", str(prog)],
        env={**os.environ, "MESHKIT_TEST_MARKER": marker},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        reader = threading.Thread(target=_read_slowly, args=(proc.stdout, chunks), daemon=True)
        reader.start()
        try:
            err = proc.stderr.read().decode()
            proc.wait(timeout=180)
            reader.join(timeout=60)
        finally:
            proc.kill()
    out = b"".join(chunks).decode()
    assert proc.returncode == 1, err
    # Rank 1 fails; rank 0, told at once, may exit first: then rank 1 is the root cause.
    assert re.search(r"rank 1 failed first \(exit code 1\)|--- root cause: rank 1 ---", err), err
    for r in (0, 1):
        log = (tmp_path / "logs" / f"rank{r}.log").read_text()
        lines = [line for line in log.splitlines() if line.startswith(f"rank {r} line ")]
        assert lines == [f"rank {r} line {i:04d}" for i in range(3000)], (r, len(lines))
        assert "closed file" not in log
    # stderr has its own pipe, so stdout's lines may come before, after and amid the traceback.
    log1 = "\n".join(
        line
        for line in (tmp_path / "logs" / "rank1.log").read_text().splitlines()
        if not line.startswith("rank 1 line ")
    )
    assert re.search(
        r"^Traceback \(most recent call last\):\n  File .*prog\.py\", line 13, in <module>\n"
        r".*\nRuntimeError: planted after 3000 lines$",
        log1,
        re.MULTILINE,
    ), log1
    assert out.count("[rank0] rank 0 line ") == 3000
    assert out.count("[rank1] rank 1 line ") == 3000
    assert "closed file" not in out + err


def test_sink_never_raises(tmp_path, monkeypatch):
    class GoneTerminal:
        def write(self, text):
            raise OSError(5, "Input/output error")  # what a hung-up terminal answers

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", GoneTerminal())
    sink = Sink(True, tmp_path / "logs", 1)
    sink.write(0, "first", False)  # the echo fails and stops; the log still gets the line
    assert not sink.stream
    sink.write(0, "second", False)
    sink.close()
    sink.write(0, "after close", False)  # dropped, no "I/O operation on closed file"
    assert (tmp_path / "logs" / "rank0.log").read_text() == "first\nsecond\n"


# ---- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-n", "0", "x.py"], "the number of processes (-n) must be an int >= 1; got 0"),
        (["-n", "2", "-d", "0", "x.py"], "--devices-per-process must be an int >= 1; got 0"),
        (["-n", "2", "missing.py"], "script 'missing.py' does not exist"),
        (["-n", "2", "--timeout", "0", "x.py"], "--timeout must be a finite number > 0 seconds"),
        (
            ["-n", "2", "--timeout", "nan", "x.py"],
            "--timeout must be a finite number > 0 seconds; "
            "got nan.\nConsider leaving it out for no limit.",
        ),
        (["-n", "2", "--grace", "-1", "x.py"], "--grace must be a finite number >= 0; got -1.0"),
        (["-n", "2", "--log-dir", "x.py", "x.py"], "--log-dir 'x.py' is a file, not a directory"),
        (["-n", "2"], "no program given; expected a script path or -m module"),
    ],
)
def test_bad_arguments(tmp_path, args, expected):
    (tmp_path / "x.py").write_text("")
    out = cli("launch", *args, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("error: meshkit launch: ")
    assert expected in out.stderr


def test_a_rank_that_never_calls_init_is_named(tmp_path):
    # Without meshkit.init() each rank would run alone and print a plausible wrong answer.
    (tmp_path / "noinit.py").write_text(
        "import meshkit\nmesh = meshkit.make_mesh({'data': -1})\nprint('ran alone')\n"
    )
    out = cli("launch", "-n", "2", "-d", "2", "--timeout", "120", "noinit.py", cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "ran alone" not in text, text
    # Whichever rank gets there first fails the run; the other may be stopped before it says so.
    assert re.search(
        r"meshkit\.make_mesh: this process was started by meshkit launch as process [01] of 2 "
        r"\(MESHKIT_COORDINATOR is set\), but meshkit\.init\(\) was not called",
        text,
    ), text
    assert "Consider calling meshkit.init() first in the program" in text, text
    # One rank is a program of one process: nothing to join.
    out = cli("launch", "-n", "1", "-d", "2", "--timeout", "120", "noinit.py", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ran alone" in out.stdout, out.stdout


@pytest.mark.parametrize("holder", ["listener", "launcher"])
def test_port_in_use(tmp_path, holder):
    (tmp_path / "x.py").write_text("")
    with contextlib.ExitStack() as stack:
        if holder == "listener":
            held = stack.enter_context(socket.socket())
            held.bind(("", 0))
            held.listen()
        else:  # another run's launcher holds its port, not yet served by its rank 0
            held = stack.enter_context(reserve_port())
        port = held.getsockname()[1]
        out = cli("launch", "-n", "2", "--port", str(port), "x.py", cwd=tmp_path)
    assert out.returncode == 2
    assert f"port {port} is already in use on this machine" in out.stderr
    assert "Consider another --port" in out.stderr


def test_the_coordinator_port_is_held_from_start_to_end(tmp_path):
    # Before rank 0 serves it, no other bind may get the port (a second launcher picking it
    # would mix two runs' ranks), and rank 0's check does not take the hold for a server.
    script(
        tmp_path,
        """
        import os
        from meshkit._src.core.ports import coordinator_port_taken
        from meshkit._src.launch.ports import port_in_use
        port = int(os.environ["MESHKIT_COORDINATOR"].rpartition(":")[2])
        print(f"port {port}: held {port_in_use(port)}, taken {coordinator_port_taken(port)}")
        """,
    )
    out = cli("launch", "-n", "2", "--timeout", "60", "--allow-unjoined", "prog.py", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = re.findall(r"\[rank(\d)\] port (\d+): held True, taken False", out.stdout)
    assert sorted(r for r, _ in lines) == ["0", "1"], out.stdout
    assert not port_in_use(int(lines[0][1]))  # let go when the run ended


def test_api_validates_before_starting_anything():
    with pytest.raises(LaunchError, match=r"must be an int >= 1; got True"):
        meshkit.launch(["x.py"], num_processes=True)


def test_module_mode_runs_meshkit_info(tmp_path, marker):
    out = cli(
        "launch", "-n", "2", "-d", "2", "-m", "meshkit", "info",
        cwd=tmp_path, env={"MESHKIT_TEST_MARKER": marker},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for r in (0, 1):
        assert f"[rank{r}] source           meshkit launch" in out.stdout
        assert f"[rank{r}] process          {r} of 2" in out.stdout
        assert re.search(rf"\[rank{r}\] {r} \(this\)\s+\S+\s+cpu", out.stdout)
        assert f"[rank{r}]   cpu: 2 x cpu per process" in out.stdout
        assert re.search(rf"\[rank{r}\]   \d+ jax.config settings:", out.stdout)


def test_gpu_split_environment():
    envs = rank_environments(2, 1234, devices_per_process=None, platform="auto", gpus=8)
    assert [e["MESHKIT_LOCAL_DEVICE_IDS"] for e in envs] == ["0,1,2,3", "4,5,6,7"]
    assert all("JAX_PLATFORMS" not in e for e in envs)
    envs = rank_environments(3, 1234, devices_per_process=2, platform="gpu", gpus=8)
    assert [e["MESHKIT_LOCAL_DEVICE_IDS"] for e in envs] == ["0,1", "2,3", "4,5"]
    with pytest.raises(
        LaunchError, match=r"3 processes x 3 GPUs each needs 9 GPUs, but this machine has 8"
    ):
        rank_environments(3, 1234, devices_per_process=3, platform="gpu", gpus=8)
    cpu = rank_environments(2, 99, devices_per_process=4, platform="auto", gpus=0)
    assert cpu[1] == {
        "MESHKIT_COORDINATOR": "127.0.0.1:99",
        "MESHKIT_NUM_PROCESSES": "2",
        "MESHKIT_PROCESS_ID": "1",
        "MESHKIT_CPU_DEVICES": "4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    }


# ---- what a person reads -------------------------------------------------------------------------

GLOO_CHATTER = (
    "[Gloo] Rank {} is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
)


def test_gloo_chatter_reaches_the_log_not_the_terminal(tmp_path, capsys):
    sink = Sink(True, tmp_path / "logs", 1)
    for r in range(4):
        sink.write(0, GLOO_CHATTER.format(r), True)
    short = (
        "[Gloo] Rank 2 is connected to 1 peer ranks. Expected number of connected peer ranks is : 3"
    )
    sink.write(0, short, True)  # a rank short of peers is worth reading
    # Two of the rank's threads writing the note at once, cut into each other.
    cut = [
        "[Gloo] Rank " + GLOO_CHATTER.format(1),
        GLOO_CHATTER.format(0).removeprefix("[Gloo] Rank "),
    ]
    for line in cut:
        sink.write(0, line, True)
    sink.write(0, "step 1", False)
    sink.close()
    out, err = capsys.readouterr()
    assert out == "[rank0] step 1\n"
    assert err == f"[rank0] {short}\n"
    log = (tmp_path / "logs" / "rank0.log").read_text().splitlines()
    assert log[:4] == [GLOO_CHATTER.format(r) for r in range(4)]
    assert log[4:] == [short, *cut, "step 1"]


def test_launch_folds_the_ranks_gloo_chatter(tmp_path, marker):
    # What gloo prints for every device of every rank once connected (here without JAX).
    script(
        tmp_path,
        f"""
        import os, sys
        for d in range(4):
            print({GLOO_CHATTER!r}.format(d), file=sys.stderr, flush=True)
        print("done", os.environ["MESHKIT_PROCESS_ID"])
        """,
    )
    out = cli("launch", "-n", "2", "--log-dir", "logs", "--allow-unjoined", "prog.py", cwd=tmp_path,
              env={"MESHKIT_TEST_MARKER": marker})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Gloo" not in out.stdout + out.stderr, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0] done 0", "[rank1] done 1"]
    assert (tmp_path / "logs" / "rank1.log").read_text().count("[Gloo] Rank") == 4


# ---- the report reads events, not sentences -------------------------------------------------------

# One run as the ranks tell it: rank 1 stalls in its own code and fails; rank 0 waits inside a
# meshkit call, hears of rank 1's failure and ends first; rank 2 reached the end of its program.
# Each rank records that (`events.emit`) and prints meshkit's sentences for people, built from
# meshkit's message constants, which REWORD=1 replaces first; NO_EVENTS=1 records nothing.
_TOLD = """
import os, pathlib, sys, time
from meshkit._src.core import events
from meshkit._src.launch import report

W = "meshkit stall report:"
if os.environ.get("REWORD") == "1":
    W = "stall guard says"
    report.INSIDE, report.OUTSIDE = "waiting on the library", "busy in user code"
    events.ENDED_MARK = "is finished"
INSIDE, OUTSIDE = report.INSIDE, report.OUTSIDE
recorded = os.environ.get("NO_EVENTS") != "1"
emit = events.emit if recorded else lambda *a, **k: None
rank = int(os.environ["MESHKIT_PROCESS_ID"])
here = pathlib.Path(".")


def stalled(inside, frame):
    emit("stalled", inside=inside, state="meshkit" if inside else "python", frame=frame, idle=3.0)
    where = INSIDE if inside else OUTSIDE
    print(f"{W} process {rank} made no progress for 3 s; main thread now {frame}, {where}",
          file=sys.stderr, flush=True)


if rank == 0:
    stalled(True, "threading.py:331 in wait")
    while not all((here / f"told{r}").exists() for r in (1, 2)):
        time.sleep(0.01)
    emit("failed", cause="peer", process=1, system="meshkit", error="KeyError")
    print("meshkit: process 1 failed: KeyError: 'shard-17'", file=sys.stderr, flush=True)
    sys.exit(1)
if rank == 1:
    stalled(False, "data.py:31 in load")
    emit("failed", cause="exception", error="KeyError")
    print("KeyError: 'shard-17'", file=sys.stderr, flush=True)
else:
    emit("ended")
    print(f"meshkit: process 2 {events.ENDED_MARK} 5 s ago", file=sys.stderr, flush=True)
(here / f"told{rank}").touch()
time.sleep(60)
"""


def _told_run(tmp_path, marker, **env):
    run = tmp_path / "_".join(f"{k}{v}" for k, v in env.items()) if env else tmp_path / "plain"
    run.mkdir()
    (run / "told.py").write_text(_TOLD)
    res = meshkit.launch(
        ["told.py"], num_processes=3, platform="cpu", cwd=run, stream=False, timeout=60,
        env={"MESHKIT_TEST_MARKER": marker, **env},
    )  # fmt: skip
    assert res.returncode == 1, res.report
    # The verdicts: every line of the report but the first (its seconds) and the ranks' output.
    verdicts = [line for line in res.report.splitlines()[1:] if not line.startswith("  | ")]
    return res, verdicts


def test_the_report_reads_the_ranks_events(tmp_path, marker):
    res, verdicts = _told_run(tmp_path, marker)
    assert res.report.startswith("meshkit launch: rank 0 failed first (exit code 1) after ")
    assert verdicts == [
        "Its error is meshkit's notice that rank 1 failed; it failed because of another rank.",
        "The evidence points to rank 1: it failed first, and told the others (meshkit's failure "
        "watch).",
        "Rank 2 reached the end of the program meanwhile.",
        "Stopped the other ranks: 1, 2.",
        "--- root cause: rank 1 ---",
        "--- first to fail: rank 0 ---",
        "Where each rank was when the run stalled:",
        "  rank 0: no progress for 3 s; main thread at threading.py:331 in wait, inside a "
        "meshkit call",
        "  rank 1: no progress for 3 s; main thread at data.py:31 in load, in Python",
        "  (no stall report from rank 2)",
    ], res.report
    assert [r.reached_end for r in res.ranks] == [False, False, True]


def test_rewording_every_message_changes_no_verdict(tmp_path, marker):
    _, verdicts = _told_run(tmp_path, marker)
    reworded, reworded_verdicts = _told_run(tmp_path, marker, REWORD="1")
    assert "stall guard says process 1" in reworded.ranks[1].stderr  # the rewording took
    assert "is finished" in reworded.ranks[2].stderr
    assert reworded_verdicts == verdicts, reworded.report
    assert reworded.ranks[2].reached_end


def test_meshkits_sentences_alone_make_no_verdict(tmp_path, marker):
    # The same sentences without the events: the launcher no longer reads them.
    res, verdicts = _told_run(tmp_path, marker, NO_EVENTS="1")
    assert "meshkit stall report: process 1 made no progress" in res.ranks[1].stderr
    assert verdicts == ["Stopped the other ranks: 1, 2.", "--- root cause: rank 0 ---"], res.report
    assert "when the run stalled" not in res.report, res.report
    assert "reached the end" not in res.report, res.report
    assert not any(r.reached_end for r in res.ranks)


def test_a_program_whose_ranks_never_join_fails_unless_allowed(tmp_path):
    """Raw JAX code without meshkit.init() (nor any meshkit call): each rank runs alone to the
    end and exits 0; the launcher says so afterwards and fails the run."""
    (tmp_path / "alone.py").write_text("print('ran alone')\n")
    out = cli("launch", "-n", "2", "--timeout", "60", "alone.py", cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("ran alone") == 2, out.stdout
    assert out.stderr.rstrip().endswith(
        "meshkit launch: every rank exited 0, but none joined the program (none called "
        "meshkit.init()): each ran alone, as a program of one process on its own devices, and "
        "what it printed is what one process computes, not the answer of one 2-process "
        "program.\nConsider calling meshkit.init() first in the program, or --allow-unjoined "
        "(launch(allow_unjoined=True)) to run independent processes on purpose."
    ), out.stderr
    allowed = cli("launch", "-n", "2", "--allow-unjoined", "alone.py", cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr
    single = cli("launch", "-n", "1", "alone.py", cwd=tmp_path)  # one process: nothing to join
    assert single.returncode == 0, single.stderr


def test_the_ranks_that_never_joined_are_named():
    assert unjoined_report([2, 3], 4).startswith(
        "meshkit launch: every rank exited 0, but ranks 2-3 never joined the program (no "
        "meshkit.init() call): each of those ran alone, as a program of one process"
    )
