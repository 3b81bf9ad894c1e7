"""The owner of process exit (`meshkit._src.lifecycle.exit`) and the events a rank writes.

Handlers, their order and once-only installation run on a fresh registry in this process; what
ends the interpreter (`end` and its grace period) runs in a subprocess.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from meshkit._src.launch import rank_events
from meshkit._src.lifecycle import exit as _exit
from meshkit._src.lifecycle import failfast as _failfast
from meshkit._src.lifecycle.progress import ServiceBoard


@pytest.fixture
def registry(monkeypatch):
    """A fresh registry, whose `atexit` entry is recorded instead of installed."""
    installed = []
    fresh = _exit._Registry()
    monkeypatch.setattr(_exit, "_registry", fresh)
    monkeypatch.setattr(_exit.atexit, "register", lambda f, *a, **k: installed.append(f))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    fresh.installed = installed  # type: ignore[attr-defined]
    return fresh


def test_exit_handlers_run_by_order_then_registration_each_once(registry):
    ran = []
    _exit.on_exit("flushed late", lambda: ran.append("flush"), order=_exit.FLUSH + 1)
    _exit.on_exit("report", lambda: ran.append("report"), order=_exit.FLUSH - 1)
    _exit.on_exit("stop a", lambda: ran.append("stop a"), order=_exit.STOP)
    _exit.on_exit("stop b", lambda: ran.append("stop b"), order=_exit.STOP)
    _exit.on_exit("drain", lambda: ran.append("drain"), order=_exit.DRAIN)
    _exit.on_exit("stop a", lambda: ran.append("stop a again"), order=_exit.STOP)  # replaces
    assert registry.installed == [_exit.run_exit_handlers]  # one atexit entry, whoever asks
    _exit.run_exit_handlers()
    _exit.run_exit_handlers()  # `end` runs them, then Python's atexit may again: once each
    assert ran == ["stop a again", "stop b", "drain", "report", "flush"]


def test_a_handler_that_raises_is_reported_and_the_next_runs(registry, caplog):
    ran = []

    def broken():
        raise RuntimeError("disk gone")

    _exit.on_exit("write the log", broken, order=_exit.STOP)
    _exit.on_exit("report", lambda: ran.append("report"), order=_exit.DRAIN)
    _exit.run_exit_handlers()
    assert ran == ["report"]
    [record] = [r for r in caplog.records if r.name == "meshkit.guards"]
    assert record.levelno == logging.ERROR
    assert "meshkit: the exit handler 'write the log' failed: RuntimeError: disk gone" in (
        record.getMessage()
    )


def test_the_exception_hook_is_installed_once_claims_the_end_then_runs_after_the_traceback(
    registry,
):
    seen = []
    previous = sys.excepthook
    sys.excepthook = lambda kind, value, tb: seen.append(("traceback", _exit.ending()))
    _exit.on_exception("first", lambda k, v, tb: seen.append(("first", str(v))))
    hook = sys.excepthook
    _exit.on_exception("after", lambda k, v, tb: seen.append(("after", str(v))))  # replaces
    assert sys.excepthook is hook is _exit._excepthook
    sys.excepthook(ValueError, ValueError("bad"), None)
    assert seen == [("traceback", True), ("after", "bad")]  # the end claimed before it
    sys.excepthook = previous


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    clean.update({"JAX_PLATFORMS": "cpu", **(env or {})})
    from conftest import run_python

    with tempfile.TemporaryDirectory(prefix="meshkit-exit-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(textwrap.dedent(code))
        return run_python([str(script)], clean, tmp, timeout=120)


def test_end_runs_the_handlers_then_its_final_step_and_exits_with_the_status():
    out = _run("""
        import atexit, sys
        from meshkit._src.lifecycle import exit as _exit
        _exit.on_exit("ours", lambda: print("ours", flush=True), order=_exit.DRAIN)
        # registered after meshkit's (as after meshkit.init): Python runs it first
        atexit.register(lambda: print("user handler", flush=True))
        _exit.end(7, grace=30, announce="ending\\n", final=lambda: print("final", flush=True))
        print("not reached")
    """)
    assert out.returncode == 7, out.stderr
    assert out.stdout.splitlines() == ["user handler", "ours", "final"]
    assert out.stderr == "ending\n"


def test_end_gives_the_handlers_at_most_the_grace_period():
    start = time.monotonic()
    out = _run("""
        import time
        from meshkit._src.lifecycle import exit as _exit
        _exit.on_exit("slow", lambda: time.sleep(600), order=_exit.STOP)
        _exit.end(3, grace=1, late="still running\\n", final=lambda: print("final", flush=True))
    """)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "final\n"
    assert out.stderr == "still running\n"
    assert time.monotonic() - start < 60


def test_end_reached_while_python_runs_its_exit_handlers_exits_at_once():
    # A SIGTERM that arrives while the program's own end runs the exit handlers (the drain of
    # the agreements waits there): no thread may start then (Python 3.12 refuses one), and the
    # handlers are running already. `end` exits with its status.
    out = _run("""
        from meshkit._src.lifecycle import exit as _exit
        def drain():
            print("draining", flush=True)
            _exit.end(5, grace=30, announce="terminated\\n", final=lambda: print("final", flush=True))
            print("not reached", flush=True)
        _exit.on_exit("drain", drain, order=_exit.DRAIN)
        _exit.on_exit("flush", lambda: print("not reached either", flush=True), order=_exit.FLUSH)
        print("the program ends", flush=True)
    """)
    assert out.returncode == 5, out.stderr
    assert out.stdout.splitlines() == ["the program ends", "draining", "final"]
    assert out.stderr == "terminated\n"


def test_importing_meshkit_installs_nothing():
    out = _run("""
        import atexit, signal, sys, threading
        from meshkit._src.runtime import dispatch
        before = (sys.excepthook, atexit._ncallbacks(), threading.enumerate(),
                  list(dispatch.observers), signal.getsignal(signal.SIGTERM),
                  signal.set_wakeup_fd(-1))
        import meshkit, meshkit.debug, meshkit.checkpoint, meshkit.loaders
        from meshkit._src.coord import agree
        after = (sys.excepthook, atexit._ncallbacks(), threading.enumerate(),
                 list(dispatch.observers), signal.getsignal(signal.SIGTERM),
                 signal.set_wakeup_fd(-1))
        print(before == after, before[1], after[1])
    """)
    assert out.stdout.split()[0] == "True", out.stdout + out.stderr


# ---- events -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_end(monkeypatch):
    """Each test ends its "process" afresh: a path that claims the end here keeps no lock."""
    monkeypatch.setattr(_exit, "_ending", threading.Lock())
    monkeypatch.setattr(_exit, "_claimant", None)
    monkeypatch.setattr(_exit, "stopping", threading.Event())


@pytest.fixture
def status(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHKIT_LAUNCH_STATUS", str(tmp_path))
    monkeypatch.setenv("MESHKIT_PROCESS_ID", "3")
    return tmp_path


def _events_of(directory):
    return [(e.kind, e.fields) for e in rank_events.read(directory, 4)]


def test_an_uncaught_exception_writes_failed_with_its_cause(status, monkeypatch):
    monkeypatch.setattr(_failfast, "_end", lambda *a, **k: None)
    monkeypatch.setattr(_exit, "claim", lambda: True)  # each call may end this process
    _failfast._on_exception(ValueError, ValueError("bad batch"), None)
    text = "Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out"
    _failfast._on_exception(RuntimeError, RuntimeError(text), None)
    _failfast._on_exception(RuntimeError, RuntimeError("UNAVAILABLE: Socket closed"), None)
    assert _events_of(status) == [
        ("failed", {"cause": "exception", "error": "ValueError", "where": ""}),  # never raised
        (
            "failed",
            {"cause": "timeout", "error": "RuntimeError", "system": "gloo", "process": None},
        ),
        (
            "failed",
            {
                "cause": "peer",
                "error": "RuntimeError",
                "system": "the coordination service",
                "process": None,
            },
        ),
    ]


def test_a_peers_failure_and_a_lost_service_write_failed(status, monkeypatch):
    monkeypatch.setattr(_failfast, "_end", lambda *a, **k: None)
    monkeypatch.setattr(_exit, "claim", lambda: True)
    monkeypatch.setattr(_exit, "now", lambda *a, **k: None)
    watch = _failfast._Watch(3, 4, poll=list, wait=None)
    watch.failed(1, "RuntimeError: planted")
    watch._lost("UNAVAILABLE")
    assert _events_of(status) == [
        ("failed", {"cause": "peer", "process": 1, "system": "meshkit", "error": "RuntimeError"}),
        ("failed", {"cause": "peer", "process": 0, "system": "the coordination service"}),
    ]


def test_the_path_that_claims_the_end_first_leaves_the_only_failed_event(status, monkeypatch):
    # The failure watch ends this process for a peer's failure while the main thread, whose
    # collective lost that peer, raises: the watch claimed the end first, so its record (the
    # peer's failure) is the one the launcher reads, not the main thread's own.
    monkeypatch.setattr(_exit, "now", lambda *a, **k: None)
    monkeypatch.setattr(_failfast, "_end", lambda *a, **k: None)
    waited = []
    monkeypatch.setattr(_exit, "await_end", lambda: waited.append(True))
    watch = _failfast._Watch(3, 4, poll=list, wait=None)
    service = threading.Thread(target=watch.failed, args=(1, "RuntimeError: planted"))
    service.start()
    service.join()
    gone = "Gloo all-reduce failed: pair.cc:547] Connection closed by peer [127.0.0.1]:42626"
    monkeypatch.setattr(_exit._registry, "previous_hook", lambda *a: None)  # no traceback
    monkeypatch.setattr(_exit._registry, "exception", None)
    _exit._excepthook(RuntimeError, RuntimeError(gone), None)  # claims before the traceback
    _failfast._on_exception(RuntimeError, RuntimeError(gone), None)
    _failfast._on_exception(ValueError, ValueError("bad batch"), None)
    assert _events_of(status) == [
        ("failed", {"cause": "peer", "process": 1, "system": "meshkit", "error": "RuntimeError"}),
    ]
    assert waited == [True, True, True]  # the main thread waits for the watch's exit


def test_the_thread_that_claimed_the_end_may_claim_it_again_no_other_may():
    # The main thread claims before its traceback is printed; the steps that follow (a peer's
    # post read, `end`) claim again and go on. The watch, in its own thread, cannot.
    assert _exit.claim()
    assert _exit.claim()
    other = []
    thread = threading.Thread(target=lambda: other.append(_exit.claim()))
    thread.start()
    thread.join()
    assert other == [False]
    assert _exit.ending()


def test_jaxs_error_after_a_known_failure_names_that_failure(status, monkeypatch, caplog):
    # JAX's words at a collective whose peer is gone ("connection closed") follow a failure
    # found first: another process's post.
    ended = []
    monkeypatch.setattr(_failfast, "_end", lambda failure, why: ended.append((failure, why)))
    monkeypatch.setattr(_exit, "claim", lambda: True)
    monkeypatch.setattr(_exit, "now", lambda status, text="", **k: ended.append((text, status)))
    posts = _failfast.PeerPosts(failures=[(2, "RuntimeError: planted"), (1, "ValueError: x")],
                                notices=[])  # fmt: skip
    watch = _failfast._Watch(3, 4, poll=lambda: posts, wait=None)
    monkeypatch.setattr(_failfast, "_watch", watch)
    gone = "Gloo all-reduce failed: pair.cc:547] Connection closed by peer [127.0.0.1]:42626"
    with caplog.at_level(logging.ERROR, logger="meshkit"):
        _failfast._on_exception(RuntimeError, RuntimeError(gone), None)  # process 1's post
        _failfast._on_exception(ValueError, ValueError("bad batch"), None)  # its own
    said = caplog.text
    assert "meshkit: the error above follows another process's failure." in said
    assert "another process of the program" not in said  # gloo's explanation gave way
    assert ended[0][0].startswith("meshkit: process 1 failed: ValueError: x\nProcess 3 stops too")
    assert ended[0][1] == 1
    assert ended[1] == ("ValueError: bad batch", "uncaught exception in a multi-process run")
    assert [fields.get("cause") for _, fields in _events_of(status)] == ["peer", "exception"]


def test_process_0_ends_after_every_other_process_has_counted_its_end(registry, monkeypatch):
    # 4 processes: process 0, ended by meshkit, waits until the 3 others counted their ends.
    counts, asked = iter([0, 1, 2, 3]), []

    def count(amount):
        asked.append(amount)
        return next(counts)

    monkeypatch.setattr(_exit, "_MARGIN_S", 0.0)
    _exit.count_ends(count, 0, 4)
    _exit.run_exit_handlers()  # a normal end: JAX's shutdown barrier waits, not meshkit
    assert asked == []
    _exit._count_end()
    assert asked == [0, 0, 0, 0]
    # Nobody counts: it gives up after _OUTLIVE_S.
    monkeypatch.setattr(_exit, "_OUTLIVE_S", 0.3)
    _exit.count_ends(lambda amount: 0, 0, 4)
    start = time.monotonic()
    _exit._count_end()
    assert 0.3 <= time.monotonic() - start < 2.0


def test_every_other_process_counts_its_end_once(registry):
    counted = []
    _exit.count_ends(lambda amount: counted.append(amount) or 0, 3, 4)
    _exit.run_exit_handlers()  # a normal end counts it, last of the handlers
    _exit._count_end()  # then `now` from a later path: counted already
    assert counted == [1]
    _exit.count_ends(lambda amount: counted.append(amount) or 0, 3, 4)
    _exit.count_ends(None)  # the failure watch lost the service: nothing to count
    _exit._count_end()
    assert counted == [1]


def test_stop_waits_for_the_turn_in_flight_and_no_turn_talks_to_the_others_after_it(
    registry, monkeypatch
):
    # A normal end of process 1 of 2: the service thread is inside the coordination service
    # (the failure watch) when the exit handlers run. `stop` ends that wait and returns only
    # once the turn has left; no look, `tend` or talking task starts after it, and only then is
    # the end counted (before JAX's shutdown, after which the service may be gone).
    service = _exit._Service()
    monkeypatch.setattr(_exit, "_service", service)
    inside, nudged, said = threading.Event(), threading.Event(), []

    def look(timeout):
        said.append("look")
        inside.set()
        nudged.wait(10)
        time.sleep(0.2)  # still talking a moment after the nudge
        said.append("left")
        return True

    service.look, service.nudge = look, nudged.set
    service.tend = lambda: said.append("tend")
    service.start()
    try:
        assert inside.wait(10)
        _exit.count_ends(lambda amount: said.append("counted") or 0, 1, 2)
        _exit.run_exit_handlers()
        assert said[-2:] == ["left", "counted"]
        time.sleep(0.3)
        _exit.wake()
        time.sleep(0.3)
        assert said[-2:] == ["left", "counted"]  # woken, and nothing talked
    finally:
        service.look = service.tend = None  # the thread idles once the test restores `stopping`


def test_the_end_note_writes_ended_from_the_service_thread(status, monkeypatch):
    monkeypatch.setattr(_failfast, "_ENDED_AFTER_S", 0.0)
    _failfast._at_exit(3)  # as at a normal end: the service thread says it
    deadline = time.monotonic() + 10
    while not _events_of(status) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _events_of(status) == [("ended", {})]


def test_a_stall_report_writes_stalled_with_where_it_waits(status, monkeypatch):
    from meshkit._src.lifecycle import stall as _stall

    posted: dict[str, str] = {}
    board = ServiceBoard(post=posted.__setitem__, read=lambda: dict(posted), drop=posted.pop)
    detector = _stall.Detector(0, 1, board, str, _stall.Settings(1.0, None))
    monkeypatch.setattr(_stall, "say", lambda *a: None)
    # From another thread, as the service thread runs it: the main thread waits in join.
    thread = threading.Thread(target=detector._compare, args=(12.34, ""))
    thread.start()
    thread.join()
    ((kind, fields),) = _events_of(status)
    assert kind == "stalled"
    assert (fields["inside"], fields["state"], fields["idle"]) == (False, "python", 12.3)
    assert re.fullmatch(r"(tests/)?test_exit\.py:\d+ in test_\w+", fields["frame"]), fields
    assert fields["holding"] == []  # the one process is stuck in its own code: nobody to blame


def test_init_writes_joined(status):
    out = _run(
        "import meshkit; meshkit.init()",
        {"MESHKIT_LAUNCH_STATUS": str(status), "MESHKIT_PROCESS_ID": "3"},
    )
    assert out.returncode == 0, out.stderr
    assert _events_of(status) == [("joined", {})]


_FAILING_RUN = """
import os, sys, time
# The launcher removes its status directory when the run ends: keep the events in the test's.
os.environ["MESHKIT_LAUNCH_STATUS"] = sys.argv[1]
import meshkit
meshkit.init()
if meshkit.runtime_info().process_id == 1:
    raise ValueError("planted")
time.sleep(60)  # process 0: the failure watch ends it
"""


@pytest.mark.multiprocess
def test_a_failing_two_process_run_leaves_its_events(tmp_path):
    from meshkit.testing import launch_in_processes

    script = tmp_path / "fails.py"
    script.write_text(_FAILING_RUN)
    result = launch_in_processes(str(script), num_processes=2, devices_per_process=1,
                                 timeout=90, args=[str(tmp_path)])  # fmt: skip
    assert result.ranks[1].returncode == 1, result.report
    assert result.ranks[0].returncode != 0, result.report
    events = {r: [(e.kind, e.fields) for e in rank_events.read(tmp_path, 2) if e.rank == r]
              for r in (0, 1)}  # fmt: skip
    line = _FAILING_RUN.splitlines().index('    raise ValueError("planted")') + 1
    raised_at = f"{script}:{line}"
    assert events[1] == [
        ("joined", {}),
        ("failed", {"cause": "exception", "error": "ValueError", "where": raised_at}),
    ]
    # Process 0 learns it from its failure watch, or from the launcher stopping it first.
    assert events[0][0] == ("joined", {}), events
    assert events[0][1] in (
        ("failed", {"cause": "peer", "process": 1, "system": "meshkit", "error": "ValueError"}),
    ), events


def test_the_service_waits_long_until_the_program_steps_and_short_while_it_does(monkeypatch):
    # A program that has just joined is idle: its failure watch renews its wait in the
    # coordination service every `_SLICE_S`; a step (should_save, global_batches) makes that
    # `_ACTIVE_SLICE_S` for `_ACTIVE_S`, so that a SIGTERM is told soon while it steps.
    service = _exit._Service()
    monkeypatch.setattr(_exit, "_running", lambda: service)
    step = [None]
    _exit.tend(lambda: None, lambda: step[0])
    clock = [1000.0]
    monkeypatch.setattr(_exit.time, "monotonic", lambda: clock[0])
    assert service._slice() == _exit._SLICE_S
    step[0] = 1
    assert service._slice() == _exit._ACTIVE_SLICE_S
    clock[0] += _exit._ACTIVE_S - 1
    assert service._slice() == _exit._ACTIVE_SLICE_S
    clock[0] += 2
    assert service._slice() == _exit._SLICE_S
