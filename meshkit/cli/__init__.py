"""The ``meshkit`` command: ``meshkit launch``, ``meshkit info`` and ``meshkit migrate``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from .._src.core.errors import LaunchError, MeshkitError
from .._src.core.version import __version__
from .._src.migrate.command import EPILOG as MIGRATE_EPILOG
from .._src.migrate.command import add_arguments as add_migrate_arguments

__all__ = ["main"]

_LAUNCH_EPILOG = """\
examples:
  meshkit launch -n 2 --devices-per-process 4 examples/hello_mesh.py
  meshkit launch -n 4 --timeout 600 --log-dir logs train.py --config base.yaml
  meshkit launch -n 2 -m meshkit info
  # on each of 2 machines (R = 0 on the machine whose address is given, 1 on the other):
  meshkit launch --nnodes 2 --node-rank R --coordinator node0:29500 -n 8 train.py
  meshkit launch -n 8 --max-restarts 3 train.py   # restart the group after a failure
  meshkit launch -n 8 --profile-steps 10:12 train.py   # a trace of steps 10-12 on every rank

Each rank gets MESHKIT_COORDINATOR, MESHKIT_NUM_PROCESSES, MESHKIT_PROCESS_ID and
MESHKIT_CPU_DEVICES (or MESHKIT_LOCAL_DEVICE_IDS on GPUs); meshkit.init() reads them.
When a rank fails, the others are stopped and its error is shown; the exit status is its own.
SIGTERM to the launcher is a preemption notice: it goes to every rank, which save (see
meshkit.checkpoint.should_save) and end within MESHKIT_PREEMPT_GRACE seconds (25), then status 143.
SIGINT or SIGHUP stop every rank; the exit status is 128 + the signal.
With --max-restarts K, a failure stops every rank and the whole group starts again (a fresh
coordinator; MESHKIT_ATTEMPT tells which start), up to K times, not for the same failure twice.
On several machines, one launcher each: process ids are node-major (machine R runs R*N..R*N+N-1);
a failure, a signal or a lost machine stops every machine, and each prints the same report.
--nnodes, --node-rank and --coordinator may come from MESHKIT_NNODES, MESHKIT_NODE_RANK (or a
Kubernetes Indexed Job's JOB_COMPLETION_INDEX) and MESHKIT_LAUNCH_COORDINATOR, so that every
machine runs the same command."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshkit", description="Multi-host JAX made simple, fast and safe."
    )
    parser.add_argument("--version", action="version", version=f"meshkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launch = sub.add_parser(
        "launch",
        help="run N processes of a JAX program on this machine (or on each of several)",
        description="Run N processes of one JAX program on this machine, or on each of "
        "several machines with one launcher each.",
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument(
        "-n",
        "--num-processes",
        type=int,
        default=2,
        metavar="N",
        help="processes to start on this machine (default 2)",
    )
    launch.add_argument(
        "--nnodes",
        type=int,
        default=None,
        metavar="M",
        help="machines in the run, each running this launcher (default 1, or $MESHKIT_NNODES)",
    )
    launch.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this machine's place, 0..M-1 (or $MESHKIT_NODE_RANK, $JOB_COMPLETION_INDEX)",
    )
    launch.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="machine 0's address, the same on every machine: its launcher serves PORT, "
        "process 0 JAX's coordinator PORT+1 (or $MESHKIT_LAUNCH_COORDINATOR)",
    )
    launch.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds for every machine to join (default 300)",
    )
    launch.add_argument(
        "--devices-per-process",
        "-d",
        type=int,
        default=None,
        metavar="K",
        help="CPU devices per process, or GPUs per process on a GPU machine",
    )
    launch.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="kill every process after S seconds and fail",
    )
    launch.add_argument(
        "--port", type=int, default=None, help="coordinator port (default: a free one)"
    )
    launch.add_argument(
        "--init-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds each process waits in meshkit.init for the coordinator and the others "
        "(sets MESHKIT_INIT_TIMEOUT; default 300)",
    )
    launch.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help="whole seconds without heartbeats after which JAX takes a process for dead (sets "
        "MESHKIT_HEARTBEAT_TIMEOUT; default JAX's, 100)",
    )
    launch.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        metavar="S",
        help="whole seconds a process that ends waits at JAX's exit barrier for the others "
        "(sets MESHKIT_SHUTDOWN_TIMEOUT; default JAX's, 300)",
    )
    launch.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache directory, shared by every rank and restart "
        "(sets MESHKIT_COMPILATION_CACHE; on several machines, a shared file system)",
    )
    launch.add_argument(
        "--platform",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="auto: GPUs when nvidia-smi lists any, else CPU",
    )
    launch.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="also write each rank's output to DIR/rank<r>.log",
    )
    launch.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="take a jax.profiler trace of steps A to B of meshkit.global_batches on every rank, "
        "into one run directory that TensorBoard's profile plugin and xprof show together (sets "
        "MESHKIT_PROFILE_STEPS)",
    )
    launch.add_argument(
        "--profile-dir",
        default=None,
        metavar="DIR",
        help="where --profile-steps writes (default DIR/profile under --log-dir, else "
        "./meshkit-profile; sets MESHKIT_PROFILE_DIR)",
    )
    launch.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (after a preemption "
        "notice: MESHKIT_PREEMPT_GRACE and this)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="K",
        help="when a process fails, stop every process and start the whole group again, up to "
        "K times (default 0, or $MESHKIT_MAX_RESTARTS); the program resumes from its latest "
        "checkpoint",
    )
    launch.add_argument(
        "--allow-unjoined",
        action="store_true",
        help="accept processes that never call meshkit.init() (each then runs alone, as a "
        "program of one process); without it such a run fails",
    )
    launch.add_argument(
        "-m",
        dest="module",
        default=None,
        metavar="MODULE",
        help="run a module (like python -m) instead of a script",
    )
    launch.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        help="script.py [args...] (or the module's args after -m)",
    )
    sub.add_parser(
        "info",
        help="join the cluster (meshkit.init) and print what was detected, the devices, and "
        "the versions and jax.config settings the processes compare",
    )
    migrate = sub.add_parser(
        "migrate",
        help="report legacy pmap code (jax.pmap, flax.jax_utils, ...) and rewrite the mechanical",
        description="Report legacy pmap patterns with file:line, what breaks or costs in modern "
        "JAX and the meshkit replacement; --fix rewrites the mechanical cases.",
        epilog=MIGRATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_migrate_arguments(migrate)
    return parser


def _launch(args: argparse.Namespace) -> int:
    from .._src.launch.launcher import launch

    command = ["-m", args.module, *args.program] if args.module else list(args.program)
    try:  # settings from the environment are arguments too: a bad one is a usage error (2)
        machines, max_restarts = _machines(args), _max_restarts(args)
        join_options = {**_join_options(args), **_profile_options(args)}
    except MeshkitError as e:
        raise LaunchError(str(e)) from None
    # handle_signals: SIGTERM (a scheduler's notice) goes to the ranks, which save and end; a
    # launcher stopped by SIGINT or SIGHUP (its terminal closed) stops its ranks too.
    result = launch(
        command,
        num_processes=args.num_processes,
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
        port=args.port,
        platform=args.platform,
        log_dir=args.log_dir,
        grace=args.grace,
        allow_unjoined=args.allow_unjoined,
        max_restarts=max_restarts,
        env=join_options,
        handle_signals=True,
        subreaper=True,  # this process starts nothing else: every orphan that comes is a rank's
        **machines,
    )
    if result.report:
        # After SIGHUP the terminal may be gone; the exit status still tells what happened.
        with contextlib.suppress(OSError):
            sys.stderr.write(result.report.rstrip("\n") + "\n")
            sys.stderr.flush()
    return result.returncode


def _join_options(args: argparse.Namespace) -> dict[str, str]:
    """--init-timeout, --heartbeat-timeout, --shutdown-timeout and --compilation-cache as set.

    As the ranks read them; the cache directory is checked here, before any rank starts.
    """
    from .._src.core.events import (
        ENV_COMPILATION_CACHE,
        ENV_HEARTBEAT_TIMEOUT,
        ENV_INIT_TIMEOUT,
        ENV_SHUTDOWN_TIMEOUT,
    )
    from .._src.runtime.compile_cache import writable

    given = {
        ENV_INIT_TIMEOUT: args.init_timeout,
        ENV_HEARTBEAT_TIMEOUT: args.heartbeat_timeout,
        ENV_SHUTDOWN_TIMEOUT: args.shutdown_timeout,
    }
    if args.compilation_cache is not None:
        given[ENV_COMPILATION_CACHE] = writable(
            args.compilation_cache,
            called="meshkit launch",
            source="from the flag --compilation-cache",
        )
    return {name: str(value) for name, value in given.items() if value is not None}


def _profile_options(args: argparse.Namespace) -> dict[str, str]:
    """--profile-steps and --profile-dir, checked before any rank starts, as the ranks read them."""
    import os

    from .._src.core import env
    from .._src.core.events import DEFAULT_PROFILE_DIR, ENV_PROFILE_DIR, ENV_PROFILE_STEPS

    if args.profile_steps is None:
        if args.profile_dir is not None:
            raise LaunchError(
                f"meshkit launch: --profile-dir {args.profile_dir!r} was given without "
                "--profile-steps, which says which steps to trace.\nConsider adding "
                "--profile-steps A:B, e.g. --profile-steps 10:12."
            )
        return {}
    found = env.step_range(args.profile_steps)
    if found is None:
        raise LaunchError(
            f"meshkit launch: --profile-steps {args.profile_steps!r} {env.STEPS_RULE}.\n"
            "Consider e.g. --profile-steps 10:12: a few steps after the first, which compiles."
        )
    directory = args.profile_dir
    if directory is None:
        directory = os.path.join(args.log_dir, "profile") if args.log_dir else DEFAULT_PROFILE_DIR
    return {
        ENV_PROFILE_STEPS: f"{found[0]}:{found[1]}",
        ENV_PROFILE_DIR: os.path.abspath(directory),
    }


def _max_restarts(args: argparse.Namespace) -> int:
    """--max-restarts, else ``MESHKIT_MAX_RESTARTS``, else 0."""
    from .._src.core import env
    from .._src.launch.restarts import ENV_MAX_RESTARTS

    if args.max_restarts is not None:
        return args.max_restarts
    value = env.integer(ENV_MAX_RESTARTS, where="meshkit launch")
    return 0 if value is None else value


def _machines(args: argparse.Namespace) -> dict[str, Any]:
    """--nnodes, --node-rank and --coordinator, each from its flag or else the environment."""
    from .._src.core import env

    where = "meshkit launch"
    nnodes = args.nnodes if args.nnodes is not None else env.integer("MESHKIT_NNODES", where=where)
    node_rank = args.node_rank
    if node_rank is None:
        node_rank = env.integer("MESHKIT_NODE_RANK", where=where)
    if node_rank is None:
        node_rank = env.integer("JOB_COMPLETION_INDEX", where=where)
    coordinator = args.coordinator or env.raw("MESHKIT_LAUNCH_COORDINATOR")
    if nnodes is None and coordinator is None:
        return {}
    return {
        "nnodes": 1 if nnodes is None else nnodes,
        "node_rank": node_rank,
        "coordinator": coordinator,
        "join_timeout": args.join_timeout,
    }


def _info() -> int:
    import jax

    from .._src.runtime import programs
    from .._src.runtime.init import init

    info = init()
    print(info)
    print()
    rows = [("process", "device ids", "platform", "kind")]
    by_process: dict[int, list[Any]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    for p, devs in sorted(by_process.items()):
        ids = ",".join(str(d.id) for d in devs)
        mark = " (this)" if p == jax.process_index() else ""
        rows.append((f"{p}{mark}", ids, devs[0].platform, devs[0].device_kind))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print()
    mine = programs.facts()
    print(_compared(mine))
    program = f"sha256 {mine.program[:16]}..." if mine.program else "none"
    print(
        f"  a warning only where they differ: XLA_FLAGS={mine.XLA_FLAGS or '(unset)'}, "
        f"the main program file ({program})"
    )
    return 0


def _compared(mine: Any) -> str:
    """What the preflight compares (a `Facts`), as ``meshkit info`` shows it."""
    settings = "  ".join(f"{name}={value}" for name, value in mine.settings.items())
    indent = {"initial_indent": "    ", "subsequent_indent": "    ", "break_on_hyphens": False}
    return (
        "compared by the processes at meshkit.init (the preflight):\n"
        f"  python {mine.python}, jax {mine.jax}, jaxlib {mine.jaxlib}, meshkit {mine.meshkit}\n"
        f"  {mine.platform}: {mine.local_devices} x {mine.device_kind} per process\n"
        f"  {len(mine.settings)} jax.config settings:\n" + textwrap.fill(settings, 100, **indent)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshkit`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "migrate":
            from .._src.migrate.command import run

            return run(args)
        return _info()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MeshkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
