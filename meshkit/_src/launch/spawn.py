"""Start the ranks: their environment (the launcher -> rank contract) and their processes.

Each rank runs in its own session (so a whole rank, children included, is killed as a group)
and, on Linux, dies with the launcher even if the launcher is killed outright (`rank_argv`'s
trampoline). What a rank prints is read by `meshkit._src.launch.rank_output`'s pumps, kept
(the last lines, or everything) and echoed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import IO, Literal, Protocol

from ..core.env import visible_devices
from ..core.errors import LaunchError
from ..core.events import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from .rank_output import Pump, Sink, is_chatter
from .report import TAIL_LINES, RankResult

Platform = Literal["auto", "cpu", "gpu"]


def count_gpus() -> int:
    """NVIDIA GPUs on this machine per ``nvidia-smi -L`` (0 without it); never imports JAX."""
    visible = visible_devices(os.environ)  # the GPUs this machine's ranks may see
    if visible is not None:
        return visible[1]
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
    coordinator: str | None = None,
    first: int = 0,
    total: int | None = None,
) -> list[dict[str, str]]:
    """The environment variables each rank gets (the launcher -> ``meshkit.init`` contract).

    Args:
        num_processes: ranks to start on this machine.
        port: the coordinator's port on 127.0.0.1 (rank 0 serves it), unless ``coordinator``.
        coordinator: ``HOST:PORT`` of JAX's coordinator, in a run on several machines.
        first: the process id of this machine's first rank (node-major ids).
        total: processes on every machine together (default ``num_processes``).
        devices_per_process: CPU devices (cpu) or GPUs (gpu) per rank; None for the default
            (JAX's CPU default, or the GPUs split evenly).
        platform: ``"cpu"``, ``"gpu"``, or ``"auto"`` (gpu when ``gpus > 0``).
        gpus: GPUs on this machine.

    Returns:
        One dict per rank.
    """
    use_gpu = platform == "gpu" or (platform == "auto" and gpus > 0)
    base = {
        ENV_COORDINATOR: coordinator or f"127.0.0.1:{port}",
        ENV_NUM_PROCESSES: str(total or num_processes),
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
            envs.append({**base, ENV_PROCESS_ID: str(first + r), ENV_LOCAL_DEVICE_IDS: ids})
        return envs
    for r in range(num_processes):
        env = {**base, ENV_PROCESS_ID: str(first + r), "JAX_PLATFORMS": "cpu"}
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


def rank_argv(command: list[str]) -> list[str]:
    """How a rank is started: ``python <command>``, behind the trampoline on Linux."""
    argv = [sys.executable, *command]
    if sys.platform.startswith("linux"):
        return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]
    return argv


class Process(Protocol):
    """What the launcher uses of a rank's process (a `subprocess.Popen` has it all).

    ``pid`` leads the rank's own session and process group; ``stdout`` and ``stderr`` are the
    read ends of its output pipes; ``returncode`` is None while it runs, then its exit code, or
    minus the signal that ended it.
    """

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# How a rank's process starts: ``python <command>`` with this environment in this directory.
Starter = Callable[[list[str], Mapping[str, str], "str | None"], Process]


def start_fresh(command: list[str], env: Mapping[str, str], cwd: str | None) -> Process:
    """Start ``python <command>`` as a new interpreter, in its own session (`rank_argv`)."""
    return subprocess.Popen(
        rank_argv(command),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killed as a whole
    )


class Rank:
    """One running rank: its process, its output pumps and what it printed.

    Args:
        rank: its process id.
        command: what follows ``python``.
        env: its whole environment.
        cwd: its working directory (None: ours).
        sink: where its lines go.
        keep_all: keep every line (else the last `TAIL_LINES`).
        start: starts its process (default: a fresh interpreter, `start_fresh`).
    """

    def __init__(
        self,
        rank: int,
        command: list[str],
        env: dict[str, str],
        cwd: str | None,
        sink: Sink,
        keep_all: bool,
        start: Starter = start_fresh,
    ) -> None:
        self.rank = rank
        self.stopped = False
        self.sink = sink
        maxlen = None if keep_all else TAIL_LINES
        self.out: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.err: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.both: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = start(command, env, cwd)
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
        if not is_chatter(line):
            self.both.append(line)
        self.sink.write(self.rank, line, is_err)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def result(self, *, reached_end: bool) -> RankResult:
        """What it did, once it ended; ``reached_end`` as its events say."""
        return RankResult(
            self.rank,
            self.proc.returncode,
            "\n".join(self.out),
            "\n".join(self.err),
            self.stopped,
            "\n".join(self.both),
            self.proc.pid,
            reached_end,
        )
