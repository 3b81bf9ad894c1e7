"""The owner of process exit (`meshkit._src.lifecycle.exit`), in one process.

Handlers, their order and once-only installation run on a fresh registry in this process; what
ends the interpreter (`end` and its grace period) runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from meshkit._src.lifecycle import exit as _exit


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
    _exit.on_exit("leave", lambda: ran.append("leave"), order=_exit.LEAVE)
    _exit.on_exit("stop a", lambda: ran.append("stop a"), order=_exit.STOP)
    _exit.on_exit("stop b", lambda: ran.append("stop b"), order=_exit.STOP)
    _exit.on_exit("drain", lambda: ran.append("drain"), order=_exit.DRAIN)
    _exit.on_exit("stop a", lambda: ran.append("stop a again"), order=_exit.STOP)  # replaces
    assert registry.installed == [_exit.run_exit_handlers]  # one atexit entry, whoever asks
    _exit.run_exit_handlers()
    _exit.run_exit_handlers()  # `end` runs them, then Python's atexit may again: once each
    assert ran == ["stop a again", "stop b", "leave", "drain", "flush"]


def test_a_handler_that_raises_is_reported_and_the_next_runs(registry, capsys):
    ran = []

    def broken():
        raise RuntimeError("disk gone")

    _exit.on_exit("write the log", broken, order=_exit.STOP)
    _exit.on_exit("leave", lambda: ran.append("leave"), order=_exit.LEAVE)
    _exit.run_exit_handlers()
    assert ran == ["leave"]
    err = capsys.readouterr().err
    assert "meshkit: the exit handler 'write the log' failed: RuntimeError: disk gone" in err


def test_the_exception_hook_is_installed_once_and_runs_around_the_traceback(registry):
    seen = []
    previous = sys.excepthook
    sys.excepthook = lambda kind, value, tb: seen.append(("traceback", str(value)))
    _exit.on_exception("after", lambda k, v, tb: seen.append(("after", str(v))),
                       order=_exit.REPORT)  # fmt: skip
    hook = sys.excepthook
    _exit.on_exception("before", lambda k, v, tb: seen.append(("before", str(v))),
                       order=_exit.LEAVE)  # fmt: skip
    assert sys.excepthook is hook is _exit._excepthook
    sys.excepthook(ValueError, ValueError("bad"), None)
    assert seen == [("before", "bad"), ("traceback", "bad"), ("after", "bad")]
    sys.excepthook = previous


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    clean.update({"JAX_PLATFORMS": "cpu", **(env or {})})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_end_runs_the_handlers_then_its_final_step_and_exits_with_the_status():
    out = _run("""
        import atexit, sys
        from meshkit._src.lifecycle import exit as _exit
        _exit.on_exit("ours", lambda: print("ours", flush=True), order=_exit.LEAVE)
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


def test_importing_meshkit_installs_nothing():
    out = _run("""
        import atexit, signal, sys, threading
        from meshkit._src.runtime import dispatch
        before = (sys.excepthook, atexit._ncallbacks(), threading.enumerate(),
                  list(dispatch._observers), signal.getsignal(signal.SIGTERM),
                  signal.set_wakeup_fd(-1))
        import meshkit, meshkit.debug, meshkit.checkpoint, meshkit.loaders
        from meshkit._src.coord import agree
        # coord/agree.py registers its drain at import until its rewrite registers it with
        # the owner of exit (issue 24, point 3): the one entry not ours to remove here.
        atexit.unregister(agree._drain_at_exit)
        after = (sys.excepthook, atexit._ncallbacks(), threading.enumerate(),
                 list(dispatch._observers), signal.getsignal(signal.SIGTERM),
                 signal.set_wakeup_fd(-1))
        print(before == after, before[1], after[1])
    """)
    assert out.stdout.split()[0] == "True", out.stdout + out.stderr
