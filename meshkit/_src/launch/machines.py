"""This machine's part in a run on several machines: the settings, the join, the ranks' ids.

`placement` checks ``--nnodes``, ``--node-rank`` and ``--coordinator`` before anything starts;
`run_on_machines` serves the machines' meeting point on machine 0 (`meshkit._src.launch.nodes`),
joins it, and starts this machine's ranks with their node-major process ids.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import cast

from ..core.errors import LaunchError
from ..core.version import __version__
from .hub import Hub
from .link import Link, reach
from .nodes import Go, Hello, hostname, parse_address, program_digest, serve
from .ports import ephemeral_range, reserve_port
from .report import LaunchAttempt, LaunchResult, signal_name
from .restarts import restarting, should_restart
from .spawn import Platform, count_gpus, rank_environments


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this launcher stands in a run on several machines."""

    nnodes: int
    node_rank: int
    host: str
    port: int
    join_timeout: float


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def placement(
    nnodes: int,
    node_rank: int | None,
    coordinator: str | None,
    port: int | None,
    join_timeout: float,
) -> Placement:
    """The checked settings of a run on several machines.

    Raises:
        LaunchError: naming the setting, its value and what is accepted.
    """
    if not _count(nnodes) or nnodes < 1:
        raise LaunchError(f"meshkit launch: --nnodes must be an int >= 1; got {nnodes!r}.")
    if node_rank is None and nnodes == 1:
        node_rank = 0
    if node_rank is None:
        raise LaunchError(
            f"meshkit launch: --nnodes {nnodes} needs this machine's --node-rank R in "
            f"0..{nnodes - 1} (or MESHKIT_NODE_RANK, or a Kubernetes Indexed Job's "
            "JOB_COMPLETION_INDEX)."
        )
    if not _count(node_rank) or not 0 <= node_rank < nnodes:
        raise LaunchError(
            f"meshkit launch: --node-rank {node_rank!r} is outside 0..{nnodes - 1} "
            f"(--nnodes {nnodes}).\nConsider numbering the machines 0, 1, ... {nnodes - 1}, "
            "one number each; machine 0 serves the coordinator."
        )
    if coordinator is None:
        raise LaunchError(
            f"meshkit launch: --nnodes {nnodes} needs --coordinator HOST:PORT, an address of "
            "machine 0 (--node-rank 0) that every machine reaches."
        )
    if port is not None:
        raise LaunchError(
            "meshkit launch: --port is for a run on one machine; with --coordinator HOST:PORT "
            "machine 0 serves PORT and PORT+1."
        )
    if not (math.isfinite(join_timeout) and join_timeout > 0):
        raise LaunchError(
            f"meshkit launch: --join-timeout must be a finite number > 0; got {join_timeout!r}."
        )
    host, at = parse_address(coordinator)
    return Placement(nnodes, node_rank, host, at, join_timeout)


def _note(stream: bool) -> Callable[[str], None]:
    def note(line: str) -> None:
        if stream:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return note


def run_on_machines(
    command: Sequence[str],
    place: Placement,
    *,
    num_processes: int,
    devices_per_process: int | None,
    platform: Platform,
    received: list[int],
    run: Callable[[list[dict[str, str]], Link, int], LaunchResult],
    cwd: str | None,
    stream: bool,
    max_restarts: int = 0,
    allow_unjoined: bool = False,
) -> LaunchResult:
    """Join the other machines, then ``run`` this machine's ranks; the run's result.

    Machine 0 serves the meeting point at the coordinator's port, and holds ``PORT + 1`` for
    process 0's JAX coordinator until the run ends. With ``max_restarts``, every launcher
    joins again and starts its ranks again after a failure, as the attempts machine 0 counted
    decide (`meshkit._src.launch.restarts.should_restart`, the same on every machine).

    Raises:
        LaunchError: the join failed (a bad setting on some machine, a machine that never
            came, a coordinator not reached), naming the machines and the values.
    """
    hello = Hello(
        node=place.node_rank,
        nnodes=place.nnodes,
        hostname=hostname(),
        processes=num_processes,
        devices=devices_per_process,
        platform=platform,
        program=program_digest(command, cwd),
        version=__version__,
        max_restarts=max_restarts,
        allow_unjoined=allow_unjoined,
    )
    history: list[LaunchAttempt] = []
    while True:
        result = _session(place, hello, received=received, run=run, stream=stream,
                          history=history)  # fmt: skip
        # Machine 0's count, every start from 0, when the hub sent it; else (the hub was lost)
        # this machine's own account of this start, after the ones it knew.
        whole = [a.number for a in result.attempts] == list(range(len(result.attempts)))
        history = result.attempts if whole else [*history, *result.attempts]
        result.attempts = history
        if received or not should_restart(history, max_restarts):
            return result
        _note(stream)(restarting(history, max_restarts))


def _session(
    place: Placement,
    hello: Hello,
    *,
    received: list[int],
    run: Callable[[list[dict[str, str]], Link, int], LaunchResult],
    stream: bool,
    history: list[LaunchAttempt],
) -> LaunchResult:
    """One start of the group on this machine: join, run, report (`run_on_machines`)."""
    start = time.monotonic()
    hub: Hub | None = None
    held = None
    try:
        if place.node_rank == 0:
            listener = serve(place.host, place.port)
            try:  # beside a closed run's connections in TIME_WAIT, as JAX's coordinator binds
                held = reserve_port(place.port + 1)
            except OSError as e:
                listener.close()
                raise LaunchError(
                    f"meshkit launch: machine 0 cannot hold port {place.port + 1} (the "
                    f"coordinator's PORT+1, for JAX's coordinator): {e.strerror}.\nConsider "
                    "another PORT in --coordinator, below this machine's ephemeral ports (from "
                    f"{ephemeral_range()[0]}), which any outgoing connection may take."
                ) from None
            hub = Hub(
                listener,
                nnodes=place.nnodes,
                host=place.host,
                jax_port=place.port + 1,
                join_timeout=place.join_timeout,
                history=history,
                max_restarts=hello.max_restarts,
            )

        def interrupted() -> bool:
            return bool(received)

        sock = reach(place.host, place.port, place.node_rank, place.join_timeout, interrupted)
        if sock is None:
            return _interrupted(None, received[0], time.monotonic() - start)
        link = Link(sock, hello)
        try:
            go = link.join(_note(stream), interrupted, start)
            if go is None:
                return _interrupted(link, received[0], time.monotonic() - start)
            envs = _environments(go, place, hello)
            return run(envs, link, go.attempt)
        finally:
            link.close()
    finally:
        if hub is not None:
            hub.close()
        if held is not None:
            held.close()


def _environments(go: Go, place: Placement, hello: Hello) -> list[dict[str, str]]:
    platform = cast(Platform, hello.platform)  # this launcher's own setting, as it said it
    return rank_environments(
        hello.processes,
        place.port + 1,
        devices_per_process=hello.devices,
        platform=platform,
        gpus=count_gpus() if platform != "cpu" else 0,
        coordinator=go.coordinator,
        first=place.node_rank * hello.processes,
        total=go.num_processes,
    )


def _interrupted(link: Link | None, signum: int, elapsed: float) -> LaunchResult:
    """A signal before the machines had all joined: nothing started here; the others are told."""
    name = signal_name(signum)
    if link is not None:
        link.tell("interrupted", 128 + signum, text=f"{name} stopped its launcher")
    return LaunchResult(
        128 + signum,
        [],
        None,
        False,
        [],
        elapsed,
        f"meshkit launch: interrupted by {name} before every machine joined; no rank started.\n",
        interrupted_by=signal.Signals(signum),
    )
