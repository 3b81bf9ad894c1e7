"""Start ranks by forking a process that imported JAX once, instead of a fresh ``python``.

A fresh rank spends most of its start importing JAX (about 0.9 s of CPU; a two-process test
body often takes milliseconds). `meshkit.testing` starts its ranks through a fork server
(`meshkit.testing._zygote`): one process per test process that imported JAX, numpy and meshkit
and started nothing, from which each rank is forked and then made what ``python ARGV`` would
have been (its own session, stdio, environment, working directory, ``sys.argv``). The launcher
treats a forked rank as any other (`meshkit._src.launch.spawn.Process`): it signals its group,
reads its pipes, and learns its exit status from the server.

A rank is forked only when the fork gives what a fresh process would (`forkable`); otherwise it
starts fresh. The environment variables read while Python, JAX and numpy import
(`import_environment`) must be the rank's: each distinct set gets its own server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .._src.core import env as _env
from .._src.core.errors import LaunchError
from .._src.launch.spawn import Process, Starter, start_fresh

__all__ = [
    "ENV_FORK",
    "FORKS",
    "PRELOAD",
    "ForkServer",
    "Forked",
    "Forks",
    "forkable",
    "import_environment",
    "starter",
]

# Fork the ranks of `meshkit.testing` when its calls do not say (meshkit's own suite sets it).
ENV_FORK = "MESHKIT_TESTING_FORK"

# Read from the environment while Python, JAX, jaxlib, numpy and the C library load (the
# server's preload), so fixed in a forked rank: JAX's configuration defaults, XLA and TF
# logging, BLAS threads, Python's own settings, the loader.
IMPORT_PREFIXES = (
    "PYTHON",
    "JAX_",
    "XLA_",
    "TF_",
    "TPU_",
    "CUDA",
    "NVIDIA_",
    "NPY_",
    "NUMPY_",
    "OPENBLAS_",
    "GOTO",
    "OMP_",
    "MKL_",
    "LD_",
    "MALLOC_",
    "GLIBC_",
)
# What nearly every rank of meshkit's tests imports; importing it once in the fork
# server is the point of it. Not the modules ranks run with ``-m`` (runpy warns of a
# ``__main__`` imported before).
PRELOAD = (
    "jax",
    "jax.numpy",
    "numpy",
    "meshkit",
    "meshkit._src.runtime.init",
    "meshkit._src.debug.multihost",
    "meshkit._src.spmd.spmd",
    "meshkit._src.arrays.assembly",
    "meshkit._src.pmap.pmap",
)
# The server's module, loaded by its path: importing ``meshkit.testing`` would import JAX.
_SERVER_FILE = str(Path(__file__).with_name("_zygote.py"))
_SERVE = (
    "import importlib.util as u; "
    f"s = u.spec_from_file_location('meshkit_fork_server', {_SERVER_FILE!r}); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()"
)
_READY_S = 120.0  # for the server to import JAX, on a loaded machine
_REPLY_S = 30.0  # for the server to fork one rank
_MAX_SERVERS = 4  # distinct import environments kept at once in one test process
_MAX_PACKET = 1 << 20


def import_environment(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` that Python and the preloaded libraries read while importing."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_PREFIXES)))


def forkable(command: list[str]) -> bool:
    """Whether ``python <command>`` can be forked: ``-m module ...`` or ``script.py ...``.

    Only on Linux (the server's children die with it through ``PR_SET_PDEATHSIG``).
    """
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds") or not command:
        return False
    if command[0] == "-m":
        return len(command) >= 2
    return not command[0].startswith("-")


class Forked:
    """A rank forked by a `ForkServer`: what the launcher uses of a `subprocess.Popen`.

    Attributes:
        pid: the rank's process id (it leads its own session and process group).
        stdout: the read end of its stdout.
        stderr: the read end of its stderr.
        returncode: None while it runs; then its exit code, or minus the signal that ended it.
    """

    def __init__(self, server: ForkServer, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.server = server
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code if it has ended, else None."""
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; its exit code.

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        code = self.server.exit_code(self.pid, wait=timeout if timeout is not None else -1.0)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        self.returncode = code
        return code


class ForkServer:
    """One fork server process and the test process's end of its socket.

    Args:
        environment: the server's environment; `import_environment` of it is what its ranks
            see of the variables read while importing.
        preload: the modules it imports before it forks any rank.

    Raises:
        LaunchError: the server did not start (its output says why).
    """

    def __init__(self, environment: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._ready = False
        self._gone = False
        self._pids: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._started: set[int] = set()
        self._next_id = 0
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(theirs.fileno()), *preload],
                env=dict(environment),
                pass_fds=[theirs.fileno()],
                cwd="/",  # not the source tree: import the installed meshkit
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        self._reader = threading.Thread(target=self._read, name="meshkit-fork-server", daemon=True)
        self._reader.start()
        with self._changed:
            self._changed.wait_for(lambda: self._ready or self._gone, timeout=_READY_S)
        if not self._ready:
            said = self._output()  # before `close`, which closes the pipe it reads
            self.close()
            raise LaunchError(
                "meshkit.testing: the fork server that starts ranks did not start:\n" + said
            )

    @property
    def alive(self) -> bool:
        """Whether the server is up and answering."""
        return self._ready and not self._gone

    def _output(self) -> str:
        assert self.proc.stderr is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        return self.proc.stderr.read().decode(errors="replace") if self.proc.returncode else ""

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_PACKET)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._gone = True
                    self._changed.notify_all()
                    return
                message: dict[str, Any] = json.loads(data)
                if "ready" in message:
                    self._ready = True
                elif "exit" in message:
                    self._codes[message["exit"]] = message["code"]
                else:
                    # A pid the system gave again: the exit of its earlier owner came first.
                    self._codes.pop(message["pid"], None)
                    self._started.discard(message["pid"])
                    self._pids[message["id"]] = message["pid"]
                self._changed.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a rank it started is still running."""
        with self._changed:
            return not self._gone and any(pid not in self._codes for pid in self._started)

    def exit_code(self, pid: int, wait: float = 0.0) -> int | None:
        """The exit code of rank ``pid``, waiting up to ``wait`` seconds (< 0: no limit).

        A rank whose server is gone died with it (``PR_SET_PDEATHSIG``): -9.
        """
        deadline = None if wait < 0 else time.monotonic() + wait
        with self._changed:
            while pid not in self._codes and not self._gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return self._codes.get(pid, -9)

    def start(self, command: list[str], env: Mapping[str, str], cwd: str | None) -> Forked:
        """Fork ``python <command>`` with ``env`` in ``cwd``.

        Raises:
            LaunchError: the server is gone or did not answer.
        """
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self._lock:
                request = self._next_id
                self._next_id += 1
                message = {"id": request, "argv": command, "env": dict(env), "cwd": cwd}
                try:
                    socket.send_fds(self._sock, [json.dumps(message).encode()], [out_w, err_w])
                except OSError as e:
                    raise LaunchError(f"meshkit.testing: the fork server is gone ({e}).") from None
                with self._changed:
                    self._changed.wait_for(
                        lambda: request in self._pids or self._gone, timeout=_REPLY_S
                    )
                    pid = self._pids.pop(request, None)
                    if pid is not None:
                        self._started.add(pid)
        finally:
            os.close(out_w)
            os.close(err_w)
        if pid is None:
            os.close(out_r)
            os.close(err_r)
            raise LaunchError(
                "meshkit.testing: the fork server did not start a rank within "
                f"{_REPLY_S:g} s:\n{self._output()}"
            )
        return Forked(self, pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def close(self) -> None:
        """End the server (a rank still running dies with it) and reap it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        with self._changed:  # gone now, not when the reader thread next runs
            self._gone = True
            self._changed.notify_all()


class Forks:
    """The fork servers of one test process, one per import environment, started on first use.

    Call it as a `meshkit._src.launch.spawn.Starter`: a rank that `forkable` accepts is forked
    from the server for its `import_environment`, any other starts fresh.

    Args:
        max_servers: idle servers kept at most (least recently used ones end first).
        preload: what each server imports before it forks (default `PRELOAD`).
    """

    def __init__(self, max_servers: int = _MAX_SERVERS, preload: Sequence[str] = PRELOAD) -> None:
        self.max_servers = max_servers
        self.preload = tuple(preload)
        self._servers: OrderedDict[tuple[tuple[str, str], ...], ForkServer] = OrderedDict()
        self._lock = threading.Lock()

    def server(self, env: Mapping[str, str]) -> ForkServer:
        """The live server for ``env``'s import environment, started if needed."""
        key = import_environment(env)
        with self._lock:
            server = self._servers.get(key)
            if server is not None and server.alive:
                self._servers.move_to_end(key)
                return server
            if server is not None:
                server.close()
            # Its own environment: the test process's, without any run's settings (a server
            # carrying a run's token would be that run's to sweep), with the rank's values of
            # what is read while importing.
            dropped = ("MESHKIT_", *IMPORT_PREFIXES)  # MESHKIT_LAUNCH_RUN among them
            base = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
            server = ForkServer({**base, **dict(key)}, self.preload)
            self._servers[key] = server
            idle = [k for k, s in self._servers.items() if k != key and not s.busy]
            for old in idle[: max(0, len(self._servers) - self.max_servers)]:
                self._servers.pop(old).close()  # least recently used first; none with ranks
            return server

    def __call__(self, command: list[str], env: Mapping[str, str], cwd: str | None) -> Process:
        if not forkable(command):
            return start_fresh(command, env, cwd)
        return self.server(env).start(command, env, cwd)

    def close(self) -> None:
        """End every server."""
        with self._lock:
            while self._servers:
                _, server = self._servers.popitem()
                server.close()


# The test process's servers (they end with it: each sees its socket close).
FORKS = Forks()
# Servers that import more than `PRELOAD` first, by what they add (`starter`'s ``preload``).
_MORE: dict[tuple[str, ...], Forks] = {}
_MORE_LOCK = threading.Lock()


def starter(fork: bool | None, where: str, preload: Sequence[str] = ()) -> Starter:
    """How `meshkit.testing` starts ranks: forked (`FORKS`) or fresh (`start_fresh`).

    Args:
        fork: the caller's choice; None reads ``MESHKIT_TESTING_FORK`` (unset: fresh).
        where: the call that asks, for the message about a bad value.
        preload: modules the ranks import, for a server to import before it forks them (beside
            `PRELOAD`): ranks of flax, orbax or grain programs then skip those imports (about
            0.5 CPU-s each for orbax or grain). Such servers are kept apart from `FORKS`; a
            module whose package is not installed is left out.
    """
    if fork is None:
        fork = _env.flag(ENV_FORK, where=where, on="fork", off="fresh, the default", blank=False)
    if not fork:
        return start_fresh
    # Those installed only (found without importing them): the ranks of a program that needs
    # one that is missing fail as fresh ones would, not the server.
    more = tuple(
        m
        for m in dict.fromkeys(preload)
        if m not in PRELOAD and importlib.util.find_spec(m.partition(".")[0]) is not None
    )
    if not more:
        return FORKS
    with _MORE_LOCK:
        forks = _MORE.get(more)
        if forks is None:
            forks = _MORE[more] = Forks(preload=(*PRELOAD, *more))
        return forks
