"""Start N processes of one program on this machine, and never leave one behind.

This is the engine of ``meshkit launch`` and of `meshkit.testing`'s multi-process harness.
Each rank runs in its own session (so a whole rank, children included, is killed as a group)
and, on Linux, dies with the launcher even if the launcher is killed outright. When one rank
exits non-zero, the others are stopped: SIGTERM, then SIGKILL after a short grace period
(JAX's preemption handler catches SIGTERM, so the grace period is not optional). On Linux the
processes the ranks started outside their groups are found and ended too (`_reaper`), also
by a guardian process when the launcher is killed; what the ranks print is read by
`_rank_output`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from ..core.contract import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_STATUS,
    INSIDE,
    OUTSIDE,
    WATCHDOG_MARK,
)
from ..core.errors import LaunchError
from ..lifecycle import diagnose as _diagnose
from ..lifecycle import progress as _progress
from . import reaper as _reaper
from .rank_output import Pump, Sink, join_pumps
from .reaper import Guardian, Reaper

__all__ = ["LaunchResult", "RankResult", "free_port", "launch"]

Platform = Literal["auto", "cpu", "gpu"]
_POLL_S = 0.02
_STATUS_S = 0.25  # how often the ranks' stages are read while the cluster forms
_SCAN_S = 0.05  # a look through /proc costs more than a poll of our own children
_TAIL_LINES = 40
# What ends a launcher from outside: Ctrl-C, a CI job cancelled or a scheduler, a terminal closed.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclasses.dataclass
class RankResult:
    """What one rank did.

    Attributes:
        rank: the process id.
        returncode: its exit status (negative: killed by that signal); None if it never ended.
        stdout: what it printed (the last lines only, unless the launch kept everything).
        stderr: what it printed to stderr (same rule).
        stopped_by_launcher: True when the launcher ended it (fail-fast, timeout, interrupt).
        tail: its last lines, stdout and stderr interleaved as they came.
        pid: its process id while it ran (its process group id too).
        reached_end: it said it reached the end of its program while other ranks still ran
            (it waited at JAX's shutdown barrier for them).
    """

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    stopped_by_launcher: bool = False
    tail: str = ""
    pid: int = 0
    reached_end: bool = False


@dataclasses.dataclass
class LaunchResult:
    """The outcome of `launch`.

    Attributes:
        returncode: 0 when every rank exited 0; the first failing rank's code (1 for a signal)
            after a failure; 124 after a timeout; 128 + the signal's number after an interrupt
            (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
        ranks: per-rank results, indexed by rank.
        first_failure: the rank that failed first, if any.
        timed_out: True when ``timeout`` ended the run.
        alive_at_timeout: ranks still running when the timeout struck.
        elapsed: seconds from start to the last rank's end.
        report: the launcher's own closing message (root cause, timeout summary), or "".
        interrupted_by: the signal that stopped the run (``signal.SIGINT`` for a
            KeyboardInterrupt), or None.
        values: for `meshkit.testing` function targets, what each rank returned (None for a
            rank that failed); empty otherwise.
    """

    returncode: int
    ranks: list[RankResult]
    first_failure: int | None
    timed_out: bool
    alive_at_timeout: list[int]
    elapsed: float
    report: str
    values: list[Any] = dataclasses.field(default_factory=list)
    interrupted_by: signal.Signals | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def count_gpus() -> int:
    """NVIDIA GPUs on this machine per ``nvidia-smi -L`` (0 without it); never imports JAX."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def rank_environments(
    num_processes: int,
    port: int,
    *,
    devices_per_process: int | None,
    platform: Platform,
    gpus: int,
) -> list[dict[str, str]]:
    """The environment variables each rank gets (the launcher -> ``meshkit.init`` contract).

    Args:
        num_processes: ranks to start.
        port: the coordinator's port on 127.0.0.1 (rank 0 serves it).
        devices_per_process: CPU devices (cpu) or GPUs (gpu) per rank; None for the default
            (JAX's CPU default, or the GPUs split evenly).
        platform: ``"cpu"``, ``"gpu"``, or ``"auto"`` (gpu when ``gpus > 0``).
        gpus: GPUs on this machine.

    Returns:
        One dict per rank.
    """
    use_gpu = platform == "gpu" or (platform == "auto" and gpus > 0)
    base = {
        ENV_COORDINATOR: f"127.0.0.1:{port}",
        ENV_NUM_PROCESSES: str(num_processes),
        "PYTHONUNBUFFERED": "1",
    }
    envs = []
    if use_gpu:
        per = devices_per_process if devices_per_process is not None else gpus // num_processes
        if per < 1 or per * num_processes > gpus:
            raise LaunchError(
                f"meshkit launch: {num_processes} processes x {per} GPUs each needs "
                f"{num_processes * max(per, 1)} GPUs, but this machine has {gpus}.\n"
                "Consider fewer processes, --devices-per-process, or --platform cpu."
            )
        for r in range(num_processes):
            ids = ",".join(str(i) for i in range(r * per, (r + 1) * per))
            envs.append({**base, ENV_PROCESS_ID: str(r), ENV_LOCAL_DEVICE_IDS: ids})
        return envs
    for r in range(num_processes):
        env = {**base, ENV_PROCESS_ID: str(r), "JAX_PLATFORMS": "cpu"}
        if devices_per_process is not None:
            env[ENV_CPU_DEVICES] = str(devices_per_process)
        envs.append(env)
    return envs


# Runs in each rank before its program: die with the launcher even if the launcher is killed
# outright (SIGKILL leaves no chance to clean up). It is a separate interpreter that then execs
# the real one, because code between fork and exec in a multithreaded parent (JAX is one) can
# deadlock; subprocess's own start_new_session needs no such code.
_TRAMPOLINE = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the launcher is already gone
os.execv(sys.argv[2], sys.argv[2:])
"""


def _rank_argv(command: list[str]) -> list[str]:
    argv = [sys.executable, *command]
    if sys.platform.startswith("linux"):
        return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]
    return argv


class _Rank:
    """One running rank: its process, its output pumps and what it printed."""

    def __init__(
        self,
        rank: int,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        sink: Sink,
        keep_all: bool,
    ) -> None:
        self.rank = rank
        self.stopped = False
        self.sink = sink
        maxlen = None if keep_all else _TAIL_LINES
        self.out: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.err: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.both: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.watchdog: list[str] = []  # the stall watchdog's reports, newest last
        self.reached_end = False  # it said it waits for the others at the end of its program
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as a whole
        )
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self.pumps = [
            Pump(self.proc.stdout, self._stdout_line, f"meshkit-launch-rank{rank}-out"),
            Pump(self.proc.stderr, self._stderr_line, f"meshkit-launch-rank{rank}-err"),
        ]

    def _stdout_line(self, line: str) -> None:
        self._line(line, self.out, False)

    def _stderr_line(self, line: str) -> None:
        self._line(line, self.err, True)

    def _line(self, line: str, keep: collections.deque[str], is_err: bool) -> None:
        keep.append(line)
        self.both.append(line)
        if line.startswith(WATCHDOG_MARK):
            self.watchdog.append(line)
        elif line.startswith("meshkit: process") and _diagnose.ENDED_MARK in line:
            self.reached_end = True
        self.sink.write(self.rank, line, is_err)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def result(self) -> RankResult:
        return RankResult(
            self.rank,
            self.proc.returncode,
            "\n".join(self.out),
            "\n".join(self.err),
            self.stopped,
            "\n".join(self.both),
            self.proc.pid,
            self.reached_end,
        )


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {_signal_name(-code)}"
    return f"exit code {code}"


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    timeout: float | None = None,
    port: int | None = None,
    platform: Platform = "auto",
    log_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stream: bool = True,
    keep_output: bool = False,
    grace: float = 3.0,
    handle_signals: bool = False,
    subreaper: bool = False,
) -> LaunchResult:
    """Run ``python <command>`` as ``num_processes`` ranks of one JAX program on this machine.

    Args:
        command: what follows ``python``: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        num_processes: ranks to start (>= 1).
        devices_per_process: CPU devices (or GPUs) per rank.
        timeout: seconds before every rank is killed and the run fails (None: no limit).
        port: the coordinator port (default: a free one).
        platform: ``"auto"`` (GPUs if ``nvidia-smi`` lists any, else CPU), ``"cpu"``, ``"gpu"``.
        log_dir: also write each rank's output to ``log_dir/rank<r>.log``.
        env: extra environment variables for every rank.
        cwd: working directory of the ranks.
        stream: print each rank's output live, prefixed ``[rank<r>]``.
        keep_output: keep all output in the result (default: the last lines of each rank).
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        handle_signals: catch SIGINT, SIGTERM and SIGHUP for the duration of the run (also
            when they were inherited as ignored), stop every rank on the first one and report
            it (``returncode`` 128 + its number); a second one skips the rest of the grace
            period. Needs the main thread; ``meshkit launch`` sets it. Without it, only a
            KeyboardInterrupt is caught, reported as SIGINT.
        subreaper: (Linux) make this process a child subreaper for the run, so that a rank's
            descendant orphaned by its parent's death comes to it, and end every such child it
            did not start itself, even one that cleared its environment and left its session.
            Only for a process that starts no other subprocesses during the run, as
            ``meshkit launch``, which sets it. Without it, the run's processes are still found
            by the run's token and the ranks' sessions.

    Returns:
        The outcome of the run, as a `LaunchResult`: a failed run is reported there, not raised.

    Raises:
        LaunchError: bad arguments (before anything starts), or ``handle_signals`` outside the
            main thread.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise LaunchError(
            f"meshkit launch: the number of processes (-n) must be an int >= 1; "
            f"got {num_processes!r}."
        )
    if devices_per_process is not None and (
        isinstance(devices_per_process, bool)
        or not isinstance(devices_per_process, int)
        or devices_per_process < 1
    ):
        raise LaunchError(
            "meshkit launch: --devices-per-process must be an int >= 1; "
            f"got {devices_per_process!r}."
        )
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise LaunchError(
            f"meshkit launch: --timeout must be a finite number > 0 seconds; got {timeout!r}.\n"
            "Consider leaving it out for no limit."
        )
    if not (math.isfinite(grace) and grace >= 0):
        raise LaunchError(f"meshkit launch: --grace must be a finite number >= 0; got {grace!r}.")
    if handle_signals and threading.current_thread() is not threading.main_thread():
        raise LaunchError(
            "meshkit.launch: handle_signals=True was given outside the main thread; Python runs "
            "signal handlers only in the main thread.\nConsider calling launch from the main "
            "thread, or handle_signals=False."
        )
    if log_dir is not None and Path(log_dir).exists() and not Path(log_dir).is_dir():
        raise LaunchError(
            f"meshkit launch: --log-dir {str(log_dir)!r} is a file, not a directory.\n"
            "Consider a directory path (it is created if missing): each rank writes "
            "DIR/rank<r>.log there."
        )
    command = list(command)
    if not command:
        raise LaunchError("meshkit launch: no program given; expected a script path or -m module.")
    if command[0] == "-m":
        if len(command) < 2:
            raise LaunchError("meshkit launch: -m needs a module name.")
    elif not command[0].startswith("-"):
        script = Path(cwd or ".") / command[0]
        if not script.is_file():
            raise LaunchError(
                f"meshkit launch: script {command[0]!r} does not exist"
                + (f" (looked in {Path(cwd).resolve()})" if cwd else "")
                + ".\nConsider checking the path, or use -m module.name to run a module."
            )
    if port is None:
        port = free_port()
    elif not 0 < port < 65536:
        raise LaunchError(f"meshkit launch: --port must be in 1..65535; got {port}.")
    elif _port_in_use(port):
        raise LaunchError(
            f"meshkit launch: port {port} is already in use on this machine, so rank 0 cannot "
            "serve the coordinator there.\nConsider another --port, or leave it out to let "
            "meshkit pick a free one."
        )
    envs = rank_environments(
        num_processes,
        port,
        devices_per_process=devices_per_process,
        platform=platform,
        gpus=count_gpus() if platform != "cpu" else 0,
    )
    with _signals_recorded(handle_signals) as received:
        return _run(
            command,
            envs,
            extra_env=env or {},
            cwd=str(cwd) if cwd else None,
            timeout=timeout,
            grace=grace,
            received=received,
            sink=Sink(stream, Path(log_dir) if log_dir is not None else None, num_processes),
            keep_output=keep_output,
            subreaper=subreaper,
        )


@contextlib.contextmanager
def _signals_recorded(enabled: bool) -> Iterator[list[int]]:
    """While inside, `STOP_SIGNALS` are appended to the yielded list instead of acting.

    The run loop polls the list, so no signal ever raises in the middle of stopping the ranks.
    An inherited SIG_IGN is replaced too: a background job of a non-interactive shell starts
    with SIGINT ignored, and a launcher that cannot be stopped leaves its ranks running.
    """
    received: list[int] = []
    if not enabled:
        yield received
        return

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _run(
    command: list[str],
    envs: list[dict[str, str]],
    *,
    extra_env: Mapping[str, str],
    cwd: str | None,
    timeout: float | None,
    grace: float,
    received: list[int],
    sink: Sink,
    keep_output: bool,
    subreaper: bool,
) -> LaunchResult:
    """Start the ranks, watch them, stop them, and say what happened (`launch` checked inputs)."""
    ranks: list[_Rank] = []
    start = time.monotonic()
    first_failure: int | None = None
    timed_out = False
    interrupted: int | None = None
    alive_at_timeout: list[int] = []
    tails_at_timeout: dict[int, str] = {}
    failed_after = 0.0
    reaper: Reaper | None = None
    guardian: Guardian | None = None
    was_subreaper: bool | None = None
    left: list[int] = []
    status = tempfile.TemporaryDirectory(prefix="meshkit-launch-")
    board = _progress.Board(Path(status.name), len(envs)) if sink.stream else None
    extra_env = {**extra_env, ENV_STATUS: status.name}
    next_look = 0.0
    try:
        if _reaper.supported():
            token = _reaper.new_token()
            if subreaper:
                was_subreaper = _reaper.set_subreaper(True)
            reaper = Reaper(token, adopt=subreaper and was_subreaper is not None)
            with contextlib.suppress(OSError):  # without it, only a launcher SIGKILL leaks
                guardian = Guardian(token, grace)
                reaper.keep.add(guardian.pid)
            extra_env = {**extra_env, _reaper.ENV_RUN: _reaper.tagged(os.environ, token)}
        for r, rank_env in enumerate(envs):
            if received:
                break
            full_env = {**os.environ, **extra_env, **rank_env}
            ranks.append(_Rank(r, _rank_argv(command), full_env, cwd, sink, keep_output))
            if reaper is not None:
                reaper.add_rank(ranks[-1].proc.pid, keep=True)
            if guardian is not None:
                guardian.add_rank(ranks[-1].proc.pid)
        while True:
            if received:
                interrupted = received[0]
                break
            running = [rk for rk in ranks if rk.proc.poll() is None]
            failed = [rk for rk in ranks if rk.proc.returncode not in (None, 0)]
            if failed and first_failure is None:
                first_failure = failed[0].rank
                failed_after = time.monotonic() - start
                break
            if not running:
                break
            now = time.monotonic() - start
            if board is not None and not board.done and now >= next_look:
                next_look = now + _STATUS_S
                exits = {rk.rank: rk.proc.returncode for rk in ranks}
                said = board.line(board.stages(exits), now)
                if said is not None:
                    sink.note(said)
            if reaper is not None:
                seen_now = reaper.watch()
                if guardian is not None:
                    guardian.add_known(seen_now)
            if timeout is not None and time.monotonic() - start > timeout:
                timed_out = True
                alive_at_timeout = [rk.rank for rk in running]
                # What they printed while hung, before stopping them adds signal-handler noise.
                tails_at_timeout = {rk.rank: "\n".join(rk.both) for rk in running}
                break
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        interrupted = signal.SIGINT
    finally:
        seen = len(received)  # one more (a second Ctrl-C) skips the grace period
        left = _stop(ranks, grace, reaper, hurry=lambda: len(received) > seen)
        # Every line in the logs before they close, however slowly our stdout is read; a pipe
        # still open now is held by a process that escaped the sweep, and is not waited for.
        join_pumps([p for rk in ranks for p in rk.pumps], sink)
        sink.close()
        if guardian is not None:
            guardian.release()
        if was_subreaper is False:
            _reaper.set_subreaper(False)
        status.cleanup()
    elapsed = time.monotonic() - start
    results = [rk.result() for rk in ranks]
    report = ""
    if interrupted is not None:
        returncode = 128 + interrupted
        report = (
            f"meshkit launch: interrupted by {_signal_name(interrupted)}; every rank was stopped."
        )
    elif first_failure is not None:
        bad = results[first_failure]
        code = bad.returncode if bad.returncode is not None else 1
        returncode = code if code > 0 else 1
        stalls = {rk.rank: _where(rk.watchdog) for rk in ranks if rk.watchdog}
        report = _root_cause(bad, results, failed_after, stalls)
    elif timed_out:
        returncode = 124
        report = (
            f"meshkit launch: timed out after {timeout:g} s; ranks still running then: "
            f"{', '.join(map(str, alive_at_timeout))}. All were killed.\n"
            + "".join(
                _tail_block("last output of", r, tails_at_timeout[r]) for r in alive_at_timeout
            )
        )
    else:
        returncode = 0
    if report:
        report += _watchdog_summary(ranks)
    if left:
        report += (
            f"meshkit launch: could not end {len(left)} process(es) the ranks started "
            f"(pids {', '.join(map(str, left))}); they may be stuck in the kernel or run as "
            "another user.\n"
        )
    return LaunchResult(
        returncode,
        results,
        first_failure,
        timed_out,
        alive_at_timeout,
        elapsed,
        report,
        interrupted_by=signal.Signals(interrupted) if interrupted is not None else None,
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _stop(
    ranks: list[_Rank], grace: float, reaper: Reaper | None, hurry: Callable[[], bool]
) -> list[int]:
    """End the ranks and every process they started; the pids that would not end.

    SIGTERM to every live rank's group and to the run's other processes (`Reaper`), SIGKILL
    to what is left after ``grace`` seconds, or as soon as ``hurry()`` is true (a second signal
    to the launcher).
    """
    live = [rk for rk in ranks if rk.proc.poll() is None]
    for rk in live:
        rk.stopped = True
    for rk in ranks:
        # Also the group of a rank that has exited: its own children may still be there.
        rk.signal(signal.SIGTERM)
    strays = reaper.signal(signal.SIGTERM) if reaper is not None else 0
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        if any(rk.proc.poll() is None for rk in live):
            time.sleep(_POLL_S)
        elif strays and reaper is not None and reaper.strays():
            time.sleep(_SCAN_S)
        else:
            break
    for rk in ranks:
        rk.signal(signal.SIGKILL)
    left = reaper.sweep() if reaper is not None else []
    for rk in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rk.proc.wait(timeout=10)
    return left


def _watchdog_summary(ranks: list[_Rank]) -> str:
    """Where each rank was when its stall watchdog fired (``meshkit.debug``), or ""."""
    # Where a rank was (its last dump), rather than the line saying it then exited.
    reports = [(rk.rank, _where(rk.watchdog)) for rk in ranks if rk.watchdog]
    if not reports:
        return ""
    lines = [f"  rank {r}: {line}" for r, line in reports]
    quiet = [str(rk.rank) for rk in ranks if not rk.watchdog]
    if quiet:
        lines.append(f"  (no watchdog report from rank {', '.join(quiet)})")
    return "Stall watchdog, where each rank was:\n" + "\n".join(lines) + "\n"


def _where(lines: list[str]) -> str:
    dumps = [line for line in lines if " made no progress for " in line]
    return dumps[-1] if dumps else lines[-1]


def _tail_block(title: str, rank: int, text: str) -> str:
    lines = (text.strip() or "(no output)").splitlines()[-_TAIL_LINES:]
    body = "\n".join(f"  | {line}" for line in lines)
    return f"--- {title} rank {rank} ---\n{body}\n"


def _root_cause(
    bad: RankResult,
    results: list[RankResult],
    elapsed: float,
    stalls: Mapping[int, str] | None = None,
) -> str:
    others = [r for r in results if r.rank != bad.rank]
    stopped = [str(r.rank) for r in others if r.stopped_by_launcher]
    also = [
        f"{r.rank} ({_describe_exit(r.returncode)})"
        for r in others
        if not r.stopped_by_launcher and r.returncode not in (0, None)
    ]
    lines = [
        f"meshkit launch: rank {bad.rank} failed first ({_describe_exit(bad.returncode)}) "
        f"after {elapsed:.1f} s."
    ]
    cause, evidence = _suspect(bad, results, stalls or {})
    lines.extend(evidence)
    if stopped:
        lines.append(f"Stopped the other ranks: {', '.join(stopped)}.")
    if also:
        lines.append(f"Also failed on their own: {', '.join(also)}.")
    blocks = _tail_block("root cause:", cause.rank, _error_text(cause))
    if cause is not bad:
        blocks += _tail_block("first to fail:", bad.rank, _error_text(bad))
    return "\n".join(lines) + "\n" + blocks


def _error_text(result: RankResult) -> str:
    # A traceback goes to stderr; a rank that wrote nothing there is shown by its stdout.
    return result.stderr.strip() or result.stdout


def _suspect(
    bad: RankResult, results: list[RankResult], stalls: Mapping[int, str]
) -> tuple[RankResult, list[str]]:
    """The rank the evidence points to, and the lines that say why (none: ``bad`` itself).

    The first rank to exit is not always the cause: a rank that waited for another in JAX's
    cross-process machinery (a gloo or NCCL timeout) or lost it (the coordination service
    gone) fails because of another. Evidence, in order: the rank meshkit's failure watch names
    (it posted its failure for the others); a rank that failed with an error of its own; a
    rank that timed out waiting (it was in a computation the others never joined); and, as
    context, the ranks that reached the end of their program meanwhile.
    """
    found = {r.rank: _diagnose.diagnose(_error_text(r)) for r in results}
    if found[bad.rank] is None:
        return _stalled_elsewhere(bad, results, stalls)
    failed = [r for r in results if r.returncode not in (0, None) and not r.stopped_by_launcher]
    own = [r for r in failed if found[r.rank] is None]
    waited = [r for r in failed if (d := found[r.rank]) is not None and d.kind == "timeout"]
    ended = [r.rank for r in results if r.reached_end or r.returncode == 0]
    # The ranks meshkit's messages name: one that posted its failure, one a check waited for.
    naming = [d for r in results if (d := found[r.rank]) is not None and d.process is not None]
    named = [r for r in results if naming and r.rank == naming[0].process]
    cause = named[0] if named else own[0] if own else waited[0] if waited else bad
    lines: list[str] = []
    first = found[bad.rank]
    assert first is not None
    if cause is not bad:
        lines.append(f"Its error is {_kind_text(first)}; it failed because of another rank.")
    diagnosis = found[cause.rank]
    if named and naming[0].kind == "lost":
        lines.append(
            f"The evidence points to rank {cause.rank}: it failed first, and told the others "
            "(meshkit's failure watch)."
        )
    elif named:
        lines.append(
            f"The evidence points to rank {cause.rank}: a meshkit check of the others waited "
            "for it in vain."
        )
    elif diagnosis is None:
        lines.append(f"The evidence points to rank {cause.rank}: it failed with its own error.")
    elif diagnosis.kind == "timeout":
        lines.append(
            f"The evidence points to rank {cause.rank}: it waited for other ranks in "
            f"{diagnosis.system} until a timeout, in a computation or collective they never "
            "joined."
        )
    else:
        lines.append(f"Its error is {_kind_text(diagnosis)}; no rank left an error of its own.")
    away = [r for r in ended if r != cause.rank]
    if away:
        lines.append(
            f"Rank{'s' if len(away) > 1 else ''} {', '.join(map(str, away))} reached the end "
            "of the program meanwhile."
        )
    if named or (diagnosis is None and own):
        return cause, lines  # an error of its own: its output says the rest
    lines.append(
        "Usual causes: a computation or collective run by only some ranks (a branch on "
        "jax.process_index()), or a rank that exited, crashed or stalled first. Consider running "
        "again with MESHKIT_DEBUG=1: it names the first meshkit call where ranks differ, and "
        "where each rank waits."
    )
    return cause, lines


def _stalled_elsewhere(
    bad: RankResult, results: list[RankResult], stalls: Mapping[int, str]
) -> tuple[RankResult, list[str]]:
    """``bad``, unless the stall watchdog found it inside a meshkit call and another outside.

    A rank that waits at a meshkit call for another that stalled in its own code (a sleep, a
    raw collective) is a victim, even when its own watchdog ends it first.
    """
    if INSIDE not in stalls.get(bad.rank, ""):
        return bad, []
    outside = [r for r in results if OUTSIDE in stalls.get(r.rank, "")]
    if not outside:
        return bad, []
    cause = outside[0]
    where = stalls[cause.rank].split("main thread now ", 1)[-1].split(", " + OUTSIDE)[0]
    return cause, [
        f"The evidence points to rank {cause.rank}: the stall watchdog found it outside "
        f"meshkit (in {where.removeprefix('in ')}) while rank {bad.rank} waited inside a "
        "meshkit call."
    ]


def _kind_text(diagnosis: _diagnose.Diagnosis) -> str:
    if diagnosis.system == "meshkit" and diagnosis.kind == "lost":
        return f"meshkit's notice that rank {diagnosis.process} failed"
    if diagnosis.system == "meshkit":
        return f"a meshkit check that waited for rank {diagnosis.process} in vain"
    if diagnosis.kind == "timeout":
        return f"a timeout of {diagnosis.system} (it waited for another rank)"
    return f"a lost connection reported by {diagnosis.system} (another rank is gone)"
