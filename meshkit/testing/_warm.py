"""A warm cluster: processes launched and joined once, then many test bodies run in them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue
import secrets
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from .._src.core.errors import LaunchError
from .._src.launch.launcher import LaunchResult, launch
from ._forks import starter
from ._multiprocess import function_location
from ._wire import Call, Hello, Reply, receive, send

__all__ = ["RankReply", "WarmCluster"]

_HOST = "127.0.0.1"  # workers and the test process talk over this machine's loopback only
_STOP_WAIT_S = 30.0  # after the workers were told to stop, before they are killed


@dataclasses.dataclass(frozen=True)
class RankReply:
    """What one call of a test body did on one rank of a `WarmCluster`.

    Attributes:
        rank: the process id of the rank.
        value: what the body returned (None when it raised or did not finish).
        stdout: what the body printed to ``sys.stdout``.
        error: the traceback of the exception the body raised, or why it has no answer (it
            did not finish in time, or its process died); None when it returned.
    """

    rank: int
    value: Any
    stdout: str
    error: str | None


@dataclasses.dataclass
class _Workers:
    """One launch of the cluster: the launcher's thread and a connection to each rank."""

    server: socket.socket
    directory: tempfile.TemporaryDirectory[str]
    thread: threading.Thread
    outcome: list[LaunchResult]  # the launcher's result, once it has returned
    connections: dict[int, socket.socket] = dataclasses.field(default_factory=dict)
    pids: dict[int, int] = dataclasses.field(default_factory=dict)
    inboxes: dict[int, queue.SimpleQueue[object | None]] = dataclasses.field(default_factory=dict)


def _pump(sock: socket.socket, inbox: queue.SimpleQueue[object | None]) -> None:
    """Move a worker's messages into its inbox; None once the worker has gone."""
    with contextlib.suppress(OSError):
        while (message := receive(sock)) is not None:
            inbox.put(message)
    inbox.put(None)


class WarmCluster:
    """N processes launched once through meshkit's launcher, joined, then reused by many tests.

    Starting processes that import JAX and join a cluster takes seconds; a test body that uses
    them often takes milliseconds. A warm cluster pays the start once (per test module, with
    the ``warm_cluster`` fixture of `meshkit.testing.pytest_plugin`) and runs each test's
    body in the same processes, as JAX's own multi-process tests do. Each worker calls
    `meshkit.init` (CPU devices, ``devices_per_process`` each), then waits for bodies.

    A body is a module-level function; each worker imports its module from its file (once:
    bodies of one module share its module state) and calls it with the given arguments. A
    body that raises fails its own call only: the workers go on with the next one (a body
    that caught a divergence that left the processes out of step does not make the next
    body's meshkit calls raise, since every rank returned from it; but a computation that a
    process dispatched past that divergence may still be pending on its devices, so bodies
    that leave processes out of step belong in a fresh launch). A body
    that does not finish within ``timeout`` seconds on every rank ends the cluster: its
    processes are killed, and the next call starts a fresh one. Workers talk to the test
    process over sockets on 127.0.0.1 only, after a random token. Nothing starts before the
    first call (or `start`).

    Bodies share the processes, so a body must leave them usable: one that crashes its
    process, exits, or changes process-global state for good (signal handlers, JAX's
    configuration) belongs in fresh processes (`run_in_processes`).

    Args:
        num_processes: processes to start.
        devices_per_process: CPU devices per process.
        env: extra environment variables for every process, set when it starts.
        timeout: default seconds a call may take on every rank before the cluster is ended.
        start_timeout: seconds the processes may take to start and join.
        fork: fork each process from one that imported JAX once (see
            `launch_in_processes`); None: when ``MESHKIT_TESTING_FORK=1``.
        preload: when forking, modules to import once before the processes are forked (see
            `launch_in_processes`).

    Examples:
        ```python
        import pytest
        from meshkit.testing import WarmCluster

        def body(scale):
            import jax
            return jax.process_index() * scale, jax.device_count()

        @pytest.fixture(scope="module")
        def cluster():
            with WarmCluster(num_processes=2) as c:
                yield c

        def test_two_processes(cluster):
            assert cluster.run(body, 10) == [(0, 8), (10, 8)]
        ```
    """

    def __init__(
        self,
        num_processes: int = 2,
        *,
        devices_per_process: int = 4,
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        start_timeout: float = 120.0,
        fork: bool | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        self.num_processes = num_processes
        self.fork = fork
        self.preload = tuple(preload)
        self.devices_per_process = devices_per_process
        self.env = dict(env or {})
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.starts = 0  # how many times processes were launched (a restart adds one)
        self._workers: _Workers | None = None

    def __enter__(self) -> WarmCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """Whether the processes are up (started and not ended since)."""
        return self._workers is not None

    def start(self) -> None:
        """Launch the processes and wait until each has joined; nothing if they are up.

        Raises:
            LaunchError: a process failed to start or join within ``start_timeout``; the
                message holds the launcher's report and each rank's output.
        """
        if self._workers is not None:
            return
        server = socket.create_server((_HOST, 0))
        server.settimeout(0.2)
        token = secrets.token_hex(16)
        directory = tempfile.TemporaryDirectory(prefix="meshkit-warm-")
        outcome: list[LaunchResult] = []
        command = ["-m", "meshkit.testing._warm_worker", _HOST, str(server.getsockname()[1]), token]
        env = {"MESHKIT_INIT_TIMEOUT": str(max(5, int(self.start_timeout))), **self.env}

        start_with = starter(self.fork, "meshkit.testing.WarmCluster", self.preload)

        def run_launcher() -> None:
            outcome.append(
                launch(
                    command,
                    num_processes=self.num_processes,
                    devices_per_process=self.devices_per_process,
                    platform="cpu",
                    env=env,
                    cwd=directory.name,  # not the source tree: import the installed meshkit
                    stream=False,
                    grace=1.0,
                    starter=start_with,
                )
            )

        thread = threading.Thread(target=run_launcher, name="meshkit-warm-launch", daemon=True)
        workers = _Workers(server, directory, thread, outcome)
        self._workers = workers
        self.starts += 1
        thread.start()
        deadline = time.monotonic() + self.start_timeout
        while len(workers.connections) < self.num_processes and thread.is_alive():
            if time.monotonic() > deadline:
                break
            with contextlib.suppress(TimeoutError):
                self._accept(workers, token)
        joined = [
            r for r, inbox in workers.inboxes.items() if self._next(inbox, deadline) is not None
        ]
        if len(joined) < self.num_processes:
            self._end(kill=True)
            raise LaunchError(
                f"meshkit.testing.WarmCluster: {self.num_processes - len(joined)} of "
                f"{self.num_processes} processes did not start and join within "
                f"{self.start_timeout:g} s.\n{self._outputs(outcome)}"
            )

    def _accept(self, workers: _Workers, token: str) -> None:
        sock, _ = workers.server.accept()
        sock.settimeout(None)
        hello = receive(sock)
        if not isinstance(hello, Hello) or not secrets.compare_digest(hello.token, token):
            sock.close()  # not one of ours
            return
        workers.connections[hello.rank] = sock
        workers.pids[hello.rank] = hello.pid
        inbox: queue.SimpleQueue[object | None] = queue.SimpleQueue()
        workers.inboxes[hello.rank] = inbox
        name = f"meshkit-warm-rank{hello.rank}"
        threading.Thread(target=_pump, args=(sock, inbox), name=name, daemon=True).start()

    @staticmethod
    def _next(inbox: queue.SimpleQueue[object | None], deadline: float) -> object | None:
        """The worker's next message, or None if it went away or the deadline passed."""
        with contextlib.suppress(queue.Empty):
            return inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        return None

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[RankReply]:
        """Run ``fn(*args)`` on every rank; return each rank's `RankReply`, failures included.

        Args:
            fn: a function defined at the top level of an importable file.
            *args: its arguments (they must pickle).
            timeout: seconds the call may take on every rank (default: the cluster's).
            env: environment variables set in each process for this call only.

        Returns:
            One reply per rank, in rank order.

        Raises:
            LaunchError: ``fn`` cannot be imported by other processes, or the cluster could
                not start.
        """
        file, qualname = function_location(fn)
        self.start()
        workers = self._workers
        assert workers is not None
        message = Call(file, qualname, tuple(args), dict(env or {}))
        for sock in workers.connections.values():
            with contextlib.suppress(OSError):  # a worker that died answers None below
                send(sock, message)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        answers = {r: self._next(inbox, deadline) for r, inbox in workers.inboxes.items()}
        if all(isinstance(a, Reply) for a in answers.values()):
            return [self._reply(r, answers[r]) for r in range(self.num_processes)]
        # Some rank is stuck or gone: these processes cannot be trusted with the next body.
        self._end(kill=True)
        outputs = self._outputs(workers.outcome)
        missing = (
            f"did not finish within {limit:g} s, or its process died; the cluster was "
            f"ended and starts afresh for the next call.\n{outputs}"
        )
        return [
            self._reply(r, answers[r]) if isinstance(answers[r], Reply)
            else RankReply(r, None, "", f"{qualname} {missing}")
            for r in range(self.num_processes)
        ]  # fmt: skip

    @staticmethod
    def _reply(rank: int, answer: object) -> RankReply:
        assert isinstance(answer, Reply)
        value = None if answer.value is None else pickle.loads(answer.value)
        return RankReply(rank, value, answer.stdout, answer.error)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return what each returned, in rank order.

        Args:
            fn: a function defined at the top level of an importable file.
            *args: its arguments (they must pickle).
            timeout: seconds the call may take on every rank (default: the cluster's).
            env: environment variables set in each process for this call only.

        Returns:
            ``[value of rank 0, value of rank 1, ...]``.

        Raises:
            LaunchError: the body raised or did not finish on some rank; the message holds
                each such rank's traceback (and its output, after a timeout).
        """
        replies = self.call(fn, *args, timeout=timeout, env=env)
        failed = [r for r in replies if r.error is not None]
        if failed:
            ranks = ", ".join(str(r.rank) for r in failed)
            details = "\n".join(f"--- rank {r.rank} ---\n{r.stdout}{r.error}" for r in failed)
            raise LaunchError(
                f"meshkit.testing.WarmCluster: {fn.__qualname__} failed on rank(s) {ranks}.\n"
                f"{details}"
            )
        return [r.value for r in replies]

    def close(self) -> None:
        """Tell the processes to stop and wait for them (killing any that do not end)."""
        if self._workers is not None:
            self._end(kill=False)

    def _end(self, *, kill: bool) -> None:
        workers = self._workers
        assert workers is not None
        self._workers = None
        if not kill:
            for sock in workers.connections.values():
                with contextlib.suppress(OSError):
                    send(sock, "stop")
            workers.thread.join(_STOP_WAIT_S)
        if workers.thread.is_alive():
            for pid in workers.pids.values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # each rank leads its own process group
        # The launcher ends the other ranks once one is killed, and the ones that never said
        # hello once `MESHKIT_INIT_TIMEOUT` has passed.
        workers.thread.join()
        for sock in workers.connections.values():
            sock.close()
        workers.server.close()
        workers.directory.cleanup()

    @staticmethod
    def _outputs(outcome: list[LaunchResult]) -> str:
        if not outcome:
            return ""
        result = outcome[0]
        ranks = "\n".join(f"--- rank {r.rank} ({r.returncode}) ---\n{r.tail}" for r in result.ranks)
        return f"{result.report}\n{ranks}".strip()
