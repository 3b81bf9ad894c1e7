"""Find and end every process that a launch's ranks started, children in new sessions included.

Linux only: it reads ``/proc``. A process belongs to a run when

- its environment carries the run's token in ``MESHKIT_LAUNCH_RUN`` (each rank gets it and
  every child inherits it, even one started in a new session, unless it replaces its
  environment);
- it is in a rank's session (each rank leads one), which catches children that cleared their
  environment but did not leave the session;
- it descends from a rank or from such a process;
- with ``adopt``, it is a child of this process other than the ones it knows: the launcher is
  then a child subreaper, so a descendant orphaned when its parent died comes to it, even one
  that cleared its environment and left the session;
- it was found by one of the rules above in an earlier look (`Reaper.watch`, about once a
  second during the run) and is still the same process (same pid and start time): this keeps a
  child that cleared its environment and left the session after its parent is gone, when the
  launcher died with it (SIGKILL) and no subreaper is left.

Only processes of this user are looked at. A `Reaper` is used by the launcher; the same code runs
on its own, stdlib only, as the run's guardian (``python -I -S reaper.py TOKEN GRACE STATUS``),
which sweeps the token when the launcher dies without doing it (SIGKILL), then removes the run's
status directory: the launcher holds the write end of the guardian's stdin, so the guardian reads
end-of-file however the launcher ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

ENV_RUN = "MESHKIT_LAUNCH_RUN"
_ENV_RUN_BYTES = ENV_RUN.encode() + b"="
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_POLL_S = 0.05


def supported() -> bool:
    """Whether runs can be swept here (Linux with ``/proc``)."""
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/environ")


def new_token() -> str:
    """A fresh token naming one run."""
    return secrets.token_hex(8)


def tagged(environ: Mapping[str, str], token: str) -> str:
    """The value of ``MESHKIT_LAUNCH_RUN`` for a rank of run ``token`` started with ``environ``.

    A launch inside a rank of another launch adds its token to the outer one, so that the outer
    run's sweep still finds the inner run's processes.
    """
    outer = environ.get(ENV_RUN, "")
    return f"{outer}:{token}" if outer else token


def set_subreaper(on: bool) -> bool | None:
    """Make this process a child subreaper (Linux ``prctl``), or stop being one.

    Returns:
        Whether it was one before, or None where this is not available.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
            return None
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return bool(was.value)


@dataclasses.dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    sid: int
    starttime: int  # clock ticks after boot: with the pid, names one process for good
    zombie: bool
    tokens: frozenset[str]


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session, starttime) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may itself hold spaces and parentheses.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _table() -> dict[int, _Proc]:
    """This user's processes, read from ``/proc``."""
    uid = os.geteuid()
    table: dict[int, _Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid:
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        stat = _stat(pid)
        if stat is None:
            continue
        tokens: frozenset[str] = frozenset()
        if _ENV_RUN_BYTES in environ:
            for item in environ.split(b"\0"):
                if item.startswith(_ENV_RUN_BYTES):
                    value = item[len(_ENV_RUN_BYTES) :].decode(errors="replace")
                    tokens = frozenset(value.split(":"))
        state, ppid, sid, starttime = stat
        table[pid] = _Proc(pid, ppid, sid, starttime, state in ("Z", "X"), tokens)
    return table


def _send(proc: _Proc, sig: int) -> None:
    """Send ``sig`` to ``proc``, and not to a process that took its pid after it died."""
    pidfd_open = getattr(os, "pidfd_open", None)
    fd = -1
    if pidfd_open is not None:
        try:
            fd = pidfd_open(proc.pid)
        except ProcessLookupError:
            return
        except OSError:
            fd = -1  # no pidfds here (old kernel, seccomp): plain kill below
    try:
        # Through the pidfd the signal reaches the process that the pidfd was opened on; the
        # start time says it is still the one that was read.
        stat = _stat(proc.pid)
        if stat is None or stat[3] != proc.starttime:
            return
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if fd >= 0:
            os.close(fd)


class Reaper:
    """The processes of one run, other than the ranks themselves: find them, end them.

    Args:
        token: the run's token (in each rank's ``MESHKIT_LAUNCH_RUN``).
        adopt: also claim every child of this process that is not in ``keep`` (only where this
            process is a subreaper that starts nothing else meanwhile, as ``meshkit launch``).
        keep: pids never signalled or reaped here (the ranks, whose `subprocess.Popen` waits
            for them, and the guardian); this process is always kept.
    """

    def __init__(self, token: str, *, adopt: bool = False, keep: Iterable[int] = ()) -> None:
        self.token = token
        self.adopt = adopt
        self.sessions: set[int] = set()
        self.keep = {os.getpid(), *keep}
        self.known: dict[int, int] = {}  # pid -> start time of every stray seen so far
        self._last: dict[int, _Proc] = {}
        self._next_watch = 0.0

    def add_rank(self, pid: int, *, keep: bool) -> None:
        """Count ``pid`` as a rank: its session and its descendants belong to the run."""
        self.sessions.add(pid)
        if keep:
            self.keep.add(pid)

    def strays(self) -> list[int]:
        """The live processes of the run, besides ``keep``; zombies among our children reaped."""
        table = _table()
        me = os.getpid()
        roots = set(self.sessions)
        children: dict[int, list[int]] = {}
        for p in table.values():
            children.setdefault(p.ppid, []).append(p.pid)
            if (
                self.token in p.tokens
                or p.sid in self.sessions
                or (self.adopt and p.ppid == me)
                or self.known.get(p.pid) == p.starttime
            ):
                roots.add(p.pid)
        found: set[int] = set()
        todo = list(roots)
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo.extend(children.get(pid, ()))
        live = []
        for pid in sorted(found - self.keep):
            p = table.get(pid)
            if p is None:
                continue
            if not p.zombie:
                live.append(pid)
            elif p.ppid == me:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)  # an orphan that came to us, the subreaper
        self._last = {pid: table[pid] for pid in live}
        for pid in live:
            self.known[pid] = table[pid].starttime
        return live

    def watch(self) -> list[tuple[int, int]]:
        """Look for the run's processes if it is time to; the (pid, start time) newly seen.

        Looks are spaced so that they cost about 2% of one core (at least 0.5 s apart). The
        cost is the look's CPU time, not its wall time: on a loaded machine a look waits for a
        CPU, and spacing looks by that wait (5 s and more) let a short-lived rank's children in
        new sessions escape unseen.
        """
        now = time.monotonic()
        if now < self._next_watch:
            return []
        before = dict(self.known)
        cpu = time.thread_time()
        self.strays()
        took = time.thread_time() - cpu
        self._next_watch = now + max(0.5, 50 * took)
        return [(pid, t) for pid, t in self.known.items() if before.get(pid) != t]

    def signal(self, sig: int) -> int:
        """Send ``sig`` to every stray; how many there were."""
        live = self.strays()
        for pid in live:
            _send(self._last[pid], sig)
        return len(live)

    def sweep(self, timeout: float = 5.0) -> list[int]:
        """SIGKILL the strays until none is left (or ``timeout`` passes); the pids still there.

        Repeated because a stray may fork while it is being killed.
        """
        deadline = time.monotonic() + timeout
        while self.signal(signal.SIGKILL) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.strays()

    def stop(self, grace: float) -> None:
        """SIGTERM the strays, wait up to ``grace`` seconds for them to end, then `sweep`."""
        if self.signal(signal.SIGTERM):
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.strays():
                time.sleep(_POLL_S)
        self.sweep()


class Guardian:
    """The run's guardian process: it sweeps the run if the launcher dies without doing it.

    Args:
        token: the run's token.
        grace: seconds between SIGTERM and SIGKILL for the strays.
        status: the run's status directory, removed after such a sweep (the launcher removes it
            itself otherwise).
    """

    def __init__(self, token: str, grace: float, status: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).resolve()), token, repr(grace), status],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # holds none of the caller's pipes open after we die
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of signals meant for the launcher's group
        )

    @property
    def pid(self) -> int:
        """The guardian's pid."""
        return self.proc.pid

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError, ValueError):  # it died: the launcher sweeps anyway
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()

    def add_rank(self, pid: int) -> None:
        """Tell the guardian about a rank, whose session then belongs to the run."""
        self._say(f"rank {pid}")

    def add_known(self, procs: list[tuple[int, int]]) -> None:
        """Tell the guardian about processes of the run (pid, start time) seen so far."""
        if procs:
            self._say("\n".join(f"known {pid} {t}" for pid, t in procs))

    def release(self) -> None:
        """The launcher swept the run itself: let the guardian go, and reap it."""
        self._say("done")
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _guard(token: str, grace: float, status: str) -> None:
    """Wait for the launcher to go; unless it said "done" first, stop what is left of the run.

    Then remove the status directory: nothing of the run is left to write to it.
    """
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    reaper = Reaper(token)
    for line in sys.stdin.buffer:
        if line == b"done\n":
            return
        words = line.split()
        if words[:1] == [b"rank"]:
            reaper.add_rank(int(words[1]), keep=False)
        elif words[:1] == [b"known"]:
            reaper.known[int(words[1])] = int(words[2])
    reaper.stop(grace)
    shutil.rmtree(status, ignore_errors=True)


if __name__ == "__main__":
    _guard(sys.argv[1], float(sys.argv[2]), sys.argv[3])
