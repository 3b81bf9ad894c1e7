"""Start N processes of one program on this machine, and never leave one behind.

This is the engine of ``meshkit launch`` and of `meshkit.testing`'s multi-process harness, in
four steps, one module each: start the ranks (`spawn`), watch them (`supervise`), stop them
(`stop`: SIGTERM, then SIGKILL after a grace period, since JAX's preemption handler catches
SIGTERM), and say what happened (`report`, from the events the ranks recorded in the run's
status directory). When one rank exits non-zero, the others are stopped. On Linux the processes
the ranks started outside their groups are found and ended too (`reaper`), also by a guardian
process when the launcher is killed; what the ranks print is read by `rank_output`.

Nothing here imports JAX: ``meshkit launch`` starts its ranks without paying for it.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..core import events as _events
from ..core.errors import LaunchError
from ..core.events import (
    DEFAULT_PREEMPT_GRACE_S,
    ENV_ATTEMPT,
    ENV_PREEMPT_GRACE,
    ENV_PROCESS_ID,
    ENV_STATUS,
)
from . import reaper as _reaper
from . import restarts as _restarts
from . import timeline as _timeline
from .link import Link, Over
from .machines import placement, run_on_machines
from .ports import port_in_use, reserve_port
from .rank_events import read
from .rank_output import Sink, join_pumps
from .reaper import Guardian, Reaper
from .report import (
    LaunchResult,
    RankResult,
    Told,
    describe_exit,
    preempted_report,
    root_cause,
    signal_name,
    stall_summary,
    straggler_summary,
    tail_block,
)
from .spawn import Platform, Rank, Starter, count_gpus, rank_environments, start_fresh
from .stop import stop
from .supervise import Board, Outcome, Supervisor, joined, signals_recorded, unjoined_report


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
    nnodes: int = 1,
    node_rank: int | None = None,
    coordinator: str | None = None,
    join_timeout: float = 300.0,
    allow_unjoined: bool = False,
    starter: Starter | None = None,
    max_restarts: int = 0,
) -> LaunchResult:
    """Run ``python <command>`` as ``num_processes`` ranks of one JAX program on this machine.

    With ``nnodes > 1`` this machine is one of several, each running this launcher with its
    own ``node_rank`` and the same ``coordinator``; together they run ``nnodes *
    num_processes`` ranks of one program (see `meshkit._src.launch.nodes`).

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
        grace: seconds between SIGTERM and SIGKILL when stopping ranks; after a preemption
            notice, the ranks get their ``MESHKIT_PREEMPT_GRACE`` and this before SIGKILL.
        handle_signals: catch SIGINT, SIGTERM and SIGHUP for the duration of the run (also
            when they were inherited as ignored). SIGTERM is a preemption notice (what
            schedulers send before they stop a job): it is forwarded to every rank, which save
            and end by themselves (`meshkit._src.lifecycle.preemption`), and the run ends with
            status 143 and a report of where they stopped; a second SIGTERM changes nothing.
            SIGINT and SIGHUP stop every rank and are reported (``returncode`` 128 + the
            signal's number); a second signal then skips the rest of the grace period. Needs
            the main thread; ``meshkit launch`` sets it. Without it, only a KeyboardInterrupt
            is caught, reported as SIGINT.
        subreaper: (Linux) make this process a child subreaper for the run, so that a rank's
            descendant orphaned by its parent's death comes to it, and end every such child it
            did not start itself, even one that cleared its environment and left its session.
            Only for a process that starts no other subprocesses during the run, as
            ``meshkit launch``, which sets it. Without it, the run's processes are still found
            by the run's token and the ranks' sessions.
        nnodes: machines in the run.
        node_rank: this machine's place among them, 0..nnodes-1 (machine 0 serves the
            coordinator); needed when ``nnodes > 1``. Process ids are node-major: this
            machine's ranks are ``node_rank * num_processes`` onwards.
        coordinator: ``HOST:PORT``, an address of machine 0 every machine reaches: its launcher
            serves the machines' meeting point at ``PORT``, and process 0 JAX's coordinator at
            ``PORT + 1``. Needed when ``nnodes > 1``.
        join_timeout: seconds for every machine's launcher to join.
        allow_unjoined: accept a run of several processes that never joined one program
            (none called ``meshkit.init``): each then ran alone, as a program of one process.
            Without it such a run fails (exit status 1), on one machine.
        starter: how each rank's process starts: None for a fresh ``python`` (what
            ``meshkit launch`` does). `meshkit.testing` passes its fork server, which forks
            ranks from a process that imported JAX once.
        max_restarts: when a rank fails, stop every process and start the whole group again,
            with a fresh coordination session, up to this many times
            (`meshkit._src.launch.restarts`); the processes see which start it is in
            ``meshkit.runtime_info().attempt``. A failure that repeats the same way, a
            timeout or an interrupt is not restarted. The result lists every attempt.

    Returns:
        The outcome of the run, as a `LaunchResult`: a failed run is reported there, not raised.
        On several machines, its ``ranks`` are this machine's (each ``rank`` its process id),
        and its ``returncode`` and ``report`` the run's, the same on every machine.

    Raises:
        LaunchError: bad arguments (before anything starts), a join that failed on several
            machines (naming the machines and the values), or ``handle_signals`` outside the
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
    # The port is held for the whole run (`reserve_port`): a port picked and let go could be
    # picked by a second launcher before rank 0 serves it, and the two runs' ranks would mix.
    if port is not None and not 0 < port < 65536:
        raise LaunchError(f"meshkit launch: --port must be in 1..65535; got {port}.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchError(
            f"meshkit launch: --max-restarts must be an int >= 0; got {max_restarts!r}."
        )
    logs = Path(log_dir) if log_dir is not None else None

    def run(
        envs: list[dict[str, str]], received: list[int], link: Link | None, attempt: int = 0
    ) -> LaunchResult:
        ids = [int(e[ENV_PROCESS_ID]) for e in envs]
        return _run(
            command,
            [{**e, ENV_ATTEMPT: str(attempt)} for e in envs],
            attempt=attempt,
            extra_env=env or {},
            cwd=str(cwd) if cwd else None,
            timeout=timeout,
            grace=grace,
            received=received,
            sink=Sink(stream, logs, ids, attempt),
            keep_output=keep_output,
            subreaper=subreaper,
            link=link,
            starter=starter or start_fresh,
            allow_unjoined=allow_unjoined or nnodes * num_processes == 1,
        )

    if nnodes != 1 or coordinator is not None:
        place = placement(nnodes, node_rank, coordinator, port, join_timeout)
        with signals_recorded(handle_signals) as received:
            return run_on_machines(
                command,
                place,
                num_processes=num_processes,
                devices_per_process=devices_per_process,
                platform=platform,
                received=received,
                run=lambda envs, link, attempt: run(envs, received, link, attempt),
                max_restarts=max_restarts,
                allow_unjoined=allow_unjoined,
                cwd=str(cwd) if cwd else None,
                stream=stream,
            )
    gpus = count_gpus() if platform != "cpu" else 0

    def one(attempt: int, received: list[int]) -> LaunchResult:
        with _hold(port, again=attempt > 0) as held:  # a fresh coordination session each time
            envs = rank_environments(
                num_processes,
                int(held.getsockname()[1]),
                devices_per_process=devices_per_process,
                platform=platform,
                gpus=gpus,
            )
            return run(envs, received, None, attempt)

    with signals_recorded(handle_signals) as received:
        return _restarts.run_attempts(
            lambda attempt: one(attempt, received), max_restarts, Sink(stream, None, []).note
        )


def _hold(port: int | None, again: bool = False) -> socket.socket:
    """Hold the coordinator port for the run (a free one when ``port`` is None).

    ``again``: a restart, on the port the last attempt used; its closed connections may still
    be in TIME_WAIT there, which a plain bind (`port_in_use`) counts as taken.
    """
    if port is None:
        return reserve_port()
    taken = not again and port_in_use(port)
    if not taken:
        try:
            return reserve_port(port)
        except OSError as e:  # held by another process since the check, or not ours to bind
            if e.errno != errno.EADDRINUSE:
                raise LaunchError(
                    f"meshkit launch: cannot hold --port {port} for the coordinator: {e.strerror}."
                ) from None
    raise LaunchError(
        f"meshkit launch: port {port} is already in use on this machine, so rank 0 cannot "
        "serve the coordinator there.\nConsider another --port, or leave it out to let "
        "meshkit pick a free one."
    )


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
    link: Link | None = None,
    starter: Starter = start_fresh,
    allow_unjoined: bool = True,
    attempt: int = 0,
) -> LaunchResult:
    """Start the ranks, watch them, stop them, and say what happened (`launch` checked inputs).

    With a ``link``, this machine is one of several: a stop from another machine ends the run
    here, the end of the run here is told to the others, and the report is the one over all
    machines.
    """
    ranks: list[Rank] = []
    start = time.monotonic()
    started_at = time.time()
    seen: float | None = None  # when the watch ended (a failure, a timeout, the end)
    reaper: Reaper | None = None
    guardian: Guardian | None = None
    was_subreaper: bool | None = None
    left: list[int] = []
    alone: list[int] = []
    status = tempfile.TemporaryDirectory(prefix="meshkit-launch-")
    ids = [int(e[ENV_PROCESS_ID]) for e in envs]
    board = Board(Path(status.name), ids) if sink.stream else None
    extra_env = {**extra_env, ENV_STATUS: status.name}
    told = Told()
    supervisor: Supervisor | None = None
    keyboard = False
    try:
        if _reaper.supported():
            token = _reaper.new_token()
            if subreaper:
                was_subreaper = _reaper.set_subreaper(True)
            reaper = Reaper(token, adopt=subreaper and was_subreaper is not None)
            with contextlib.suppress(OSError):  # without it, only a launcher SIGKILL leaks
                guardian = Guardian(token, grace, status.name)
                reaper.keep.add(guardian.pid)
            extra_env = {**extra_env, _reaper.ENV_RUN: _reaper.tagged(os.environ, token)}
        supervisor = Supervisor(
            ranks,
            received,
            timeout=timeout,
            board=board,
            note=sink.note,
            reaper=reaper,
            guardian=guardian,
            start=start,
            remote=link.stop_requested if link is not None else None,
            share=link.share_stages if link is not None else None,
            preempted=lambda r: any(e.kind == _events.PREEMPTED for e in read(status.name, [r])),
            notice_wait=_notice_wait({**os.environ, **extra_env}) + grace,
        )
        for r, rank_env in zip(ids, envs, strict=True):
            if received:
                break
            full_env = {**os.environ, **extra_env, **rank_env}
            ranks.append(Rank(r, command, full_env, cwd, sink, keep_output, starter))
            if reaper is not None:
                reaper.add_rank(ranks[-1].proc.pid, keep=True)
            if guardian is not None:
                guardian.add_rank(ranks[-1].proc.pid)
        supervisor.watch()
        seen = time.monotonic()
        if link is not None:
            _tell(link, supervisor.outcome, ranks)
    except KeyboardInterrupt:
        keyboard = True
        if link is not None:
            link.tell("interrupted", 128 + signal.SIGINT, text="SIGINT stopped its launcher")
    finally:
        signals = len(received)  # one more (a second Ctrl-C) skips the grace period
        left = stop(ranks, grace, reaper, hurry=lambda: len(received) > signals)
        stopped = time.monotonic()
        # Every line in the logs before they close, however slowly our stdout is read; a pipe
        # still open now is held by a process that escaped the sweep, and is not waited for.
        join_pumps([p for rk in ranks for p in rk.pumps], sink)
        sink.close()
        if guardian is not None:
            guardian.release()
        if was_subreaper is False:
            _reaper.set_subreaper(False)
        # Read once every rank has ended: nothing can still write, and the directory goes next.
        records = read(status.name, ids)
        told = Told.of(records)
        if sink.log_dir is not None:  # the picture of the run so far, every attempt's lanes
            _timeline.record(sink.log_dir, attempt, records, ids)
        alone = sorted(set(ids) - joined(Path(status.name), ids))
        status.cleanup()
    outcome = supervisor.outcome if supervisor is not None else Outcome()
    if keyboard:
        outcome.interrupted = signal.SIGINT
    results = [rk.result(reached_end=rk.rank in told.ended) for rk in ranks]
    preempted = _preempted(outcome, told)
    returncode = _returncode(outcome, results, preempted)
    report = _report(outcome, results, told, timeout, left, preempted)
    unjoined = returncode == 0 and bool(alone) and not allow_unjoined and link is None
    if unjoined:
        returncode, report = 1, unjoined_report(alone, len(ids))
    failed = outcome.first_failure is not None
    stopped_s = stopped - seen if failed and seen is not None else None
    over = None
    if link is not None:
        over = _over(link, outcome, results, records, returncode, report, stopped_s, alone)
        returncode, report = over.returncode, over.report
    elapsed = time.monotonic() - start
    result = LaunchResult(
        returncode,
        results,
        outcome.first_failure,
        outcome.timed_out,
        outcome.alive_at_timeout,
        elapsed,
        report,
        interrupted_by=signal.Signals(outcome.interrupted)
        if outcome.interrupted is not None
        else None,
        preempted=preempted,
        steps=told.steps,
    )
    if over is not None and over.attempts:  # machine 0 counted the starts, over all machines
        result.attempts = over.attempts
        return result
    # Alone, or the hub is gone: this machine's own account (a lost machine 0 may come back).
    lost_hub = over is not None and isinstance(outcome.stopped_by, str)
    result.attempts = [
        _restarts.attempt_of(
            attempt,
            result,
            records,
            ranks=ids,
            started_at=started_at,
            stopped_s=stopped_s,
            restartable=(failed or lost_hub)
            and not (outcome.timed_out or outcome.interrupted or unjoined),
        )
    ]
    return result


def _tell(link: Link, outcome: Outcome, ranks: list[Rank]) -> None:
    """Tell the other machines why this one's run ended early (nothing when it just ended)."""
    if outcome.interrupted is not None:
        name = signal_name(outcome.interrupted)
        link.tell("interrupted", 128 + outcome.interrupted, text=f"{name} stopped its launcher")
    elif outcome.first_failure is not None:
        code = next(rk.proc.returncode for rk in ranks if rk.rank == outcome.first_failure)
        text = f"rank {outcome.first_failure} failed ({describe_exit(code)})"
        code = code if code and code > 0 else 1
        link.tell("failed", code, outcome.first_failure, text, outcome.failed_after)
    elif outcome.timed_out:
        link.tell("timed out", 124, text="its --timeout struck")


def _over(
    link: Link,
    outcome: Outcome,
    results: list[RankResult],
    records: list[_events.Event],
    returncode: int,
    report: str,
    stopped_s: float | None,
    alone: list[int],
) -> Over:
    """The run's exit status and report over every machine (this machine's, if the hub is gone)."""
    verdict = link.end(results, records, stopped_s, alone)
    if verdict is not None:
        return verdict
    why = outcome.stopped_by
    text = why if isinstance(why, str) else "machine 0's launcher did not send the report"
    return Over(
        returncode or 1, f"meshkit launch: {text} This machine's ranks were stopped.\n{report}", []
    )


def _rank(results: list[RankResult], rank: int) -> RankResult:
    """The result of process ``rank`` (on several machines, this one's ranks do not start at 0)."""
    return next(r for r in results if r.rank == rank)


def _notice_wait(environ: Mapping[str, str]) -> float:
    """The ranks' grace after a preemption notice (``MESHKIT_PREEMPT_GRACE``), in seconds.

    After forwarding a notice, the launcher waits that long and its own ``grace`` (as a
    scheduler waits between SIGTERM and SIGKILL) for the ranks to end. A value the ranks refuse
    makes them fail at ``meshkit.init``; the launcher then waits as for the default.
    """
    try:
        value = float(environ.get(ENV_PREEMPT_GRACE, "").strip() or DEFAULT_PREEMPT_GRACE_S)
    except ValueError:
        value = DEFAULT_PREEMPT_GRACE_S
    return value if math.isfinite(value) and value >= 0 else DEFAULT_PREEMPT_GRACE_S


def _preempted(outcome: Outcome, told: Told) -> bool:
    """Whether the run ended for a preemption notice (and not for a failure, a stop, a timeout)."""
    if outcome.interrupted is not None or outcome.first_failure is not None or outcome.timed_out:
        return False
    return outcome.preempted is not None or bool(told.preempted)


def _returncode(outcome: Outcome, results: list[RankResult], preempted: bool = False) -> int:
    if outcome.interrupted is not None:
        return 128 + outcome.interrupted
    if outcome.first_failure is not None:
        code = _rank(results, outcome.first_failure).returncode
        return code if code is not None and code > 0 else 1
    if preempted:
        return 128 + signal.SIGTERM
    return 124 if outcome.timed_out else 0


def _report(
    outcome: Outcome,
    results: list[RankResult],
    told: Told,
    timeout: float | None,
    left: list[int],
    preempted: bool = False,
) -> str:
    """The launcher's closing message: why the run ended badly, then where ranks stalled."""
    report = ""
    if preempted:
        notice = outcome.preempted
        source = notice.source if notice is not None and notice.source == "the launcher" else None
        overdue = notice is not None and notice.overdue
        report = preempted_report(results, told, source, overdue)
    elif outcome.interrupted is not None:
        report = (
            f"meshkit launch: interrupted by {signal_name(outcome.interrupted)}; every rank was "
            "stopped."
        )
    elif outcome.first_failure is not None:
        bad = _rank(results, outcome.first_failure)
        report = root_cause(bad, results, outcome.failed_after, told)
    elif outcome.timed_out:
        alive = outcome.alive_at_timeout
        report = (
            f"meshkit launch: timed out after {timeout:g} s; ranks still running then: "
            f"{', '.join(map(str, alive))}. All were killed.\n"
            + "".join(tail_block("last output of", r, outcome.tails_at_timeout[r]) for r in alive)
        )
    if report:
        report += stall_summary((r.rank for r in results), told)
    report += straggler_summary(told)
    if left:
        report += (
            f"meshkit launch: could not end {len(left)} process(es) the ranks started "
            f"(pids {', '.join(map(str, left))}); they may be stuck in the kernel or run as "
            "another user.\n"
        )
    return report
