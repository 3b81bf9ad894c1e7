"""Joining the cluster: ``meshkit.init()`` and what it found.

Sources in order: arguments; ``meshkit launch``'s environment; another engine's
(`meshkit._src.core.env`); JAX's cluster detection; else one process. The coordinator is
checked before JAX is asked, since JAX aborts the process when it cannot reach it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import time
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax

from ..coord import agree as _agree
from ..coord import failures as _failures
from ..coord import gather as _gather
from ..core import compat as _compat
from ..core import env as _env
from ..core import events as _events
from ..core import ports as _ports
from ..core.errors import MeshkitError
from ..core.events import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_SHUTDOWN_TIMEOUT,
    Goodput,
)
from ..core.frames import adopt_program_thread, public
from ..debug import divergence as _divergence
from ..debug import mode as _debug_mode
from ..lifecycle import exit as _exit
from ..lifecycle import failfast as _failfast
from ..lifecycle import preemption as _preemption
from ..lifecycle import profiles as _profiles
from ..lifecycle import stall as _stall
from ..lifecycle import stragglers as _stragglers
from . import compile_cache as _compile_cache
from . import hosts as _hosts
from . import programs as _programs
from .hosts import Hosts

_WHERE = "meshkit.init()"
_DEFAULT_INIT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    """How this process joined the program, as decided by `meshkit.init`.

    Attributes:
        source: ``"arguments"``, ``"meshkit launch"``, an engine (``"JAX_* variables"``,
            ``"SkyPilot"``, ``"JobSet"``, ``"Indexed Job"``), ``"cluster"`` (JAX's detection),
            ``"jax.distributed"`` (joined before meshkit) or ``"single process"``.
        reason: one sentence saying what led to ``source``.
        num_processes: processes in the program.
        process_id: this process's index.
        coordinator_address: ``host:port`` of the coordination service; None for one process.
        cluster: the name of JAX's cluster detector, when ``source == "cluster"``.
        cpu_devices: CPU devices requested; None when JAX's default was kept.
        local_device_ids: accelerator ids this process was given; None when JAX chose all.
        cpu_collectives: the CPU collectives set for multi-process CPU runs.
        hosts: which processes run on which host (`meshkit.Hosts`).
        attempt: which start of the group this is (0, then 1 after the first restart).
    """

    source: str
    reason: str
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    cluster: str | None = None
    cpu_devices: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: str | None = None
    hosts: Hosts | None = None
    attempt: int = 0

    def __str__(self) -> str:
        ids, hosts = self.local_device_ids, self.hosts
        ids_text = "JAX default (all visible)" if ids is None else ",".join(map(str, ids))
        hosts_text = "-" if hosts is None else f"{len(hosts)} ({hosts})"
        if hosts is not None and len(hosts) > 4:
            hosts_text = f"{len(hosts)} (this process on {hosts.host_of(self.process_id)})"
        rows = [
            ("source", self.source),
            ("reason", self.reason),
            ("process", f"{self.process_id} of {self.num_processes}"),
            ("coordinator", self.coordinator_address or "-"),
            ("cluster", self.cluster or "-"),
            ("cpu devices", "JAX default" if self.cpu_devices is None else str(self.cpu_devices)),
            ("local devices", ids_text),
            ("cpu collectives", self.cpu_collectives or "-"),
            ("hosts", hosts_text),
            ("attempt", str(self.attempt)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def goodput(self) -> Goodput:
        """Where this process's time went since `meshkit.init` was called (this attempt).

        A method, as the process's attempt is what this record describes. From this process's
        own figures: joining (until `meshkit.init` joined), compiling (as JAX reports its
        compiles), the steps of `meshkit.global_batches` (from the first batch's arrival to
        the last's, less the compiles and checkpoints between), `meshkit.checkpoint` saves
        and restores. ``restarts`` and ``redone`` stay 0: they are known only across attempts,
        to the launcher (`meshkit.LaunchResult.goodput`).

        Examples:
            >>> import meshkit
            >>> g = meshkit.init().goodput()
            >>> g.wall >= g.joining and g.redone == 0
            True
        """
        called, joined = _JOINED or (time.perf_counter(),) * 2
        wall, steps = time.perf_counter() - called, _stragglers.steps_s()
        return Goodput.of(wall, joining=joined - called, steps=steps, **_stragglers.spent())


_INFO: RuntimeInfo | None = None
_JOINED: tuple[float, float] | None = None  # when init was called and when it joined
_BACKENDS_STARTED = """\
meshkit.init() was called after JAX had already started its backends, so it can no longer {what}.
JAX fixes the device count and the cluster membership when it first touches a device (any
jax.devices(), jnp array, or jit call does).
Consider calling meshkit.init() first thing in your program, before any other JAX call."""


@public
def runtime_info() -> RuntimeInfo | None:
    """What `meshkit.init` decided, or None if it has not run in this process.

    Examples:
        >>> import meshkit
        >>> meshkit.runtime_info() is None or meshkit.runtime_info().num_processes >= 1
        True
    """
    return _INFO


def _whole(name: str, value: int | None, least: int = 1) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
        rule = "a positive int" if least else "an int >= 0"
        raise MeshkitError(f"meshkit.init(): {name} must be {rule}; got {value!r}.")
    return value


def _detected_cluster() -> str | None:
    """The name of JAX's cluster detector that finds its environment, if any."""
    for env in _compat.cluster_envs():
        if getattr(env, "opt_in_only_method", False):
            continue
        with contextlib.suppress(Exception):  # a detector that cannot run has not detected
            if env.is_env_present():
                return env.__name__
    return None


def _launched() -> tuple[int | None, int | None]:
    """``(num_processes, process_id)`` that `meshkit launch` set."""
    return _env.integer(ENV_NUM_PROCESSES, where=_WHERE), _env.integer(ENV_PROCESS_ID, where=_WHERE)


def _plan(address: str | None, num_processes: int | None, process_id: int | None) -> RuntimeInfo:
    """Decide how to join, without changing any state."""
    if address is not None or num_processes is not None or process_id is not None:
        n, pid = num_processes or 1, process_id or 0  # both checked: None or in range
        started, rank = _launched() if os.environ.get(ENV_COORDINATOR) else (None, None)
        if started is not None and (n, pid) != (started, rank):
            raise MeshkitError(
                f"meshkit.init(num_processes={n}, process_id={pid}): this process was started by "
                f"meshkit launch as process {rank} of {started} ({ENV_NUM_PROCESSES}={started}, "
                f"{ENV_PROCESS_ID}={rank}); the processes would wait for ones that never come.\n"
                "Consider meshkit.init() without arguments under meshkit launch (it reads the "
                f"launcher's settings), or meshkit launch -n {n}."
            )
        if n > 1:
            if address is None:
                raise MeshkitError(
                    f"meshkit.init(num_processes={n}) needs coordinator_address='host:port' "
                    "(the address of process 0)."
                )
            _ports.split_address(address)
        reason = "coordinator/processes passed to meshkit.init()"
        return RuntimeInfo("arguments", reason, n, pid, address if n > 1 else None)
    _env.check_agreement(os.environ)
    address = os.environ.get(ENV_COORDINATOR)
    if address:
        n, pid = _launched()
        if n is None or pid is None:
            raise MeshkitError(
                f"meshkit.init(): {ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES} or "
                f"{ENV_PROCESS_ID} is not; these three are set together by `meshkit launch`."
            )
        _ports.split_address(address)
        return RuntimeInfo("meshkit launch", f"{ENV_COORDINATOR}={address} is set", n, pid, address)
    name = _detected_cluster()
    engine = _env.read_engine(os.environ, jax_detects=name)
    if engine is not None:
        reason = f"{engine.engine} found: {engine.found}"
        n, pid, address = engine.num_processes, engine.process_id, engine.coordinator_address
        return RuntimeInfo(engine.engine, reason, n, pid, address)
    if name is None or name == "SlurmCluster":
        _env.check_step(os.environ)  # a batch script without srun looks like no cluster to JAX
    if name is not None:
        return RuntimeInfo("cluster", f"JAX's {name} detector found its environment", cluster=name)
    for variable in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        raw = os.environ.get(variable, "")
        if raw.isdigit() and int(raw) > 1:  # a launcher JAX does not detect
            warnings.warn(
                f"meshkit.init(): {variable}={raw} says this program runs as {raw} processes, but "
                "no cluster JAX can join was detected, so this process runs alone (process 0 "
                "of 1) and computes the whole program by itself.\n"
                "Consider a launcher JAX detects (Open MPI's mpirun, SLURM's srun with "
                "SLURM_JOB_ID and SLURM_STEP_NODELIST, meshkit launch), or pass "
                "coordinator_address=, num_processes= and process_id= to meshkit.init().",
                RuntimeWarning,
                stacklevel=3,
            )
            break
    return RuntimeInfo("single process", "no meshkit launch environment and no cluster detected")


def check_joined(what: str) -> None:
    """Raise if `meshkit launch` started this process as one of several, and it never joined."""
    n, pid = os.environ.get(ENV_NUM_PROCESSES, "?"), os.environ.get(ENV_PROCESS_ID, "?")
    if not os.environ.get(ENV_COORDINATOR) or n == "1" or _INFO is not None:
        return
    if _compat.distributed_state()[0] is not None:  # joined through jax.distributed itself
        return
    raise MeshkitError(
        f"{what}: this process was started by meshkit launch as process {pid} of {n} "
        f"({ENV_COORDINATOR} is set), but meshkit.init() was not called, so it would run alone "
        "on its own devices and compute the whole program by itself.\n"
        "Consider calling meshkit.init() first in the program, before any other JAX or meshkit "
        "call."
    )


def _check_again(previous: RuntimeInfo, plan: RuntimeInfo, cpu_devices: int | None) -> None:
    keys = ("source", "num_processes", "process_id", "coordinator_address")
    # A join adopted from JAX (or detected) is taken as it is, now as at the first call.
    adopted = plan.source == "cluster" or previous.source == "jax.distributed"
    same = adopted or all(getattr(plan, k) == getattr(previous, k) for k in keys)
    if not same or (cpu_devices is not None and cpu_devices != previous.cpu_devices):
        raise MeshkitError(
            "meshkit.init() was already called in this process and joined as:\n"
            f"{previous}\n"
            f"Now it was asked to join as process {plan.process_id} of {plan.num_processes} "
            f"(source: {plan.source}, cpu_devices={cpu_devices}).\n"
            "A process joins one program once. Consider calling meshkit.init() once, at start."
        )


@public
def init(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    timeout: float | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int | None = None,
    compilation_cache: str | os.PathLike[str] | None = None,
) -> RuntimeInfo:
    """Join this process to its multi-process JAX program (or note that it runs alone).

    Call it first, before any other JAX call. It is idempotent: later calls return the first
    call's `RuntimeInfo`. With more than one process on CPU it selects gloo collectives.

    Args:
        coordinator_address: ``host:port`` of process 0's coordination service. Overrides the
            environment; give it with ``num_processes`` and ``process_id``.
        num_processes: processes in the program.
        process_id: this process's index.
        local_device_ids: accelerators this process owns (default
            ``MESHKIT_LOCAL_DEVICE_IDS``, else JAX's choice).
        cpu_devices: CPU devices for this process (default ``MESHKIT_CPU_DEVICES``, else JAX's).
        timeout: seconds to wait for the coordinator and the others (default
            ``MESHKIT_INIT_TIMEOUT``, else 300).
        heartbeat_timeout: JAX's ``heartbeat_timeout_seconds`` (default
            ``MESHKIT_HEARTBEAT_TIMEOUT``, else JAX's).
        shutdown_timeout: JAX's ``shutdown_timeout_seconds`` (default
            ``MESHKIT_SHUTDOWN_TIMEOUT``, else JAX's).
        compilation_cache: a directory for JAX's persistent compilation cache (default
            ``MESHKIT_COMPILATION_CACHE``, else none); read at the first call only.

    Returns:
        What was detected and why; ``str()`` of it is a readable table.

    Raises:
        DivergenceError: the processes differ in versions, devices or compiled `jax.config`
            settings (the preflight; ``MESHKIT_PREFLIGHT=0`` turns it off).
        MeshkitError: invalid or contradictory arguments or environment (another engine's
            variables in part, SLURM tasks outside a job step), JAX's backends already started,
            the coordinator unreachable within ``timeout``, or an unusable
            ``compilation_cache``; each message names the source and the fix.

    Examples:
        >>> import meshkit
        >>> info = meshkit.init()  # alone: no launcher environment, no cluster
        >>> info.num_processes
        1
    """
    global _INFO, _JOINED
    called = time.perf_counter()
    fail_fast, grace = _failfast.settings(), _preemption.grace()  # bad ones raise before joining
    stalls, window = _stall.settings(), _stragglers.window_s()
    profile = _profiles.from_environment(where=_WHERE)
    cpu_devices = _whole("cpu_devices", cpu_devices)
    if cpu_devices is None:
        cpu_devices = _whole(ENV_CPU_DEVICES, _env.integer(ENV_CPU_DEVICES, where=_WHERE))
    if timeout is None:
        timeout = _env.number(ENV_INIT_TIMEOUT, where=_WHERE)
        timeout = _DEFAULT_INIT_TIMEOUT_S if timeout is None else timeout
    number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if not (number and math.isfinite(timeout) and timeout > 0):
        raise MeshkitError(
            f"meshkit.init(): timeout must be a finite number > 0 seconds; got {timeout!r}"
            f" (from the argument, else {ENV_INIT_TIMEOUT})."
        )
    options = distributed_options(
        heartbeat_timeout=heartbeat_timeout, shutdown_timeout=shutdown_timeout
    )
    num_processes = _whole("num_processes", num_processes)
    process_id = _whole("process_id", process_id, least=0)
    if process_id is not None and process_id >= (num_processes or 1):
        raise MeshkitError(
            f"meshkit.init(): process_id={process_id} is not one of the "
            f"{num_processes or 1} processes (ids 0 to {(num_processes or 1) - 1}).\n"
            "Consider process ids from 0 to num_processes - 1, one per process."
        )
    ids = None if local_device_ids is None else tuple(int(i) for i in local_device_ids)
    if ids is None:
        ids = _env.ids(ENV_LOCAL_DEVICE_IDS, where=_WHERE)
    plan = _plan(coordinator_address, num_processes, process_id)
    plan = dataclasses.replace(plan, local_device_ids=ids)
    if _INFO is not None:
        _check_again(_INFO, plan, cpu_devices)
        return _INFO

    adopt_program_thread()  # the program's thread, wherever it runs (Ray Train: a worker's)
    _compile_cache.enable(compilation_cache)  # before anything compiles
    if fail_fast is not None and _compat.distributed_state()[0] is None:
        # A notice while joining is one too (not if the program joined itself).
        _preemption.install(None, seconds=grace, tell=None, sync=None)
    info = _INFO = _join(plan, cpu_devices, float(timeout), options)
    _guard(info, fail_fast, grace)
    if stalls is not None and info.num_processes > 1:
        board = _failures.board(_failures.STALL)
        if board is not None:
            _stall.install(info.process_id, info.num_processes, board, _steps, stalls)
    if window is not None:
        _stragglers.install(info.process_id, _failures.board(_failures.STEPS), window)
    _JOINED = (called, time.perf_counter())
    _events.emit(_events.JOINED)
    _compile_cache.watch()  # compile times, for goodput (and the launcher's report)
    _programs.preflight(info.process_id, info.num_processes, _env.check_timeout())
    hosts = _hosts.table(_env.check_timeout(), _WHERE)
    info = _INFO = dataclasses.replace(info, hosts=hosts, attempt=_env.attempt(where=_WHERE))
    _programs.install(info.num_processes)
    if profile is not None:  # MESHKIT_PROFILE_STEPS, read before joining
        _profiles.take(*profile)
    _debug_mode.enable_from_environment()  # MESHKIT_DEBUG=1: debug mode from here on
    return info


def _join(
    plan: RuntimeInfo, cpu_devices: int | None, timeout: float, options: dict[str, Any]
) -> RuntimeInfo:
    """Join as ``plan`` says, or adopt a join made before; who joined is read back from JAX."""
    started = _compat.backends_are_initialized()
    if _compat.distributed_state()[0] is not None:  # joined elsewhere (the program, Ray, an engine)
        if options:
            warnings.warn(
                f"meshkit.init(): {', '.join(sorted(options))} not applied: the processes joined "
                "before meshkit.init(), and JAX takes it only when joining; pass it to that "
                "jax.distributed.initialize() call.",
                stacklevel=4,
            )
        reason = "jax.distributed.initialize() was called before meshkit.init()"
        plan = dataclasses.replace(plan, source="jax.distributed", reason=reason)
    else:
        joins = plan.source != "single process" and (
            plan.num_processes > 1 or plan.source == "cluster"
        )
        if started and joins:
            what = f"join a multi-process program ({plan.reason})"
            raise MeshkitError(_BACKENDS_STARTED.format(what=what))
        if started and cpu_devices is not None and _local_cpu_count() != cpu_devices:
            raise MeshkitError(_BACKENDS_STARTED.format(what=f"set {cpu_devices} CPU devices"))
        if cpu_devices is not None and not started:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if not joins:
            return dataclasses.replace(plan, cpu_devices=cpu_devices)
        plan = _initialize(plan, timeout, options)
    _, pid, n = _compat.distributed_state()
    collectives = (_collectives() if started else _select_gloo()) if n > 1 else None
    return dataclasses.replace(
        plan, num_processes=n, process_id=pid, cpu_devices=cpu_devices, cpu_collectives=collectives
    )


def _initialize(plan: RuntimeInfo, timeout: float, options: dict[str, Any]) -> RuntimeInfo:
    """``jax.distributed.initialize`` as ``plan`` says, its coordinator checked first."""
    _select_gloo()
    _events.mark("joining", plan.process_id)  # for `meshkit launch`, which shows who waits
    init_timeout = max(1, math.ceil(timeout))
    ids = list(plan.local_device_ids) if plan.local_device_ids is not None else None
    address, n, pid, shown = plan.coordinator_address, plan.num_processes, plan.process_id, ids
    cluster, reason = plan.source == "cluster", plan.reason
    if cluster:
        address, n, pid, shown = _compat.cluster_params(ids, init_timeout)
        if ids is None and shown is not None and len(shown) == 1:
            # JAX would take the local rank as the one device id; not if GPUs were bound.
            bound = _env.bound_device_ids(os.environ, int(shown[0]))
            if bound is not None:
                ids = shown = list(bound[0])
                reason = f"{reason}; devices {','.join(map(str, ids))}: {bound[1]}"
    if address is not None and n is not None and pid is not None:
        _ports.check_coordinator(address, pid, n, timeout, plan.reason if cluster else plan.source)
    # JAX detects a cluster again inside initialize (keeping its TPU and slice handling its own).
    given = (None, None, None) if cluster else (address, n, pid)
    jax.distributed.initialize(
        *given, local_device_ids=ids, initialization_timeout=init_timeout, **options
    )
    _events.mark("joined", _compat.distributed_state()[1])
    shown = None if shown is None else tuple(shown)
    return dataclasses.replace(
        plan, reason=reason, coordinator_address=address, local_device_ids=shown
    )


def _guard(info: RuntimeInfo, fail_fast: float | None, grace: float) -> None:
    """Wire the count of ends, fail-fast (its grace; None: off) and preemption to coordination."""
    me, n = info.process_id, info.num_processes
    if n > 1:  # process 0, which hosts the coordination service, ends after the others
        _exit.count_ends(_failures.count_ended, me, n)
    if fail_fast is None:
        return
    if n == 1:
        _preemption.install(me, seconds=grace, tell=None, sync=_preemption.alone)
        return
    _failfast.install(
        fail_fast, me, n, post=partial(_failures.post_failure, me),
        poll=partial(_failures.poll_posts, me), wait=partial(_failures.wait_alarm, me),
        nudge=partial(_failures.nudge, me),
    )  # fmt: skip
    # The failure watch relays the others' notices.
    _preemption.install(me, seconds=grace, tell=_failures.tell, sync=partial(_gather.sync_step, me))


def _steps() -> str:
    """What meshkit counted in this process, for stalls: a change is progress, a stall names it.

    ``step 5 of global_batches; step 5 of should_save; its 6th call of meshkit.spmd(step)``.
    """
    counted = [f"step {k} of global_batches" for k in _agree.counts().values()]
    asked = _preemption.asked_step()
    if asked is not None:
        counted.append(f"step {asked} of should_save")
    return "; ".join([*counted, _divergence.latest_call()] if _divergence.latest else counted)


# jax.distributed.initialize's parameter -> (meshkit's name, environment variable).
DISTRIBUTED_OPTIONS = {
    "heartbeat_timeout_seconds": ("heartbeat_timeout", ENV_HEARTBEAT_TIMEOUT),
    "shutdown_timeout_seconds": ("shutdown_timeout", ENV_SHUTDOWN_TIMEOUT),
}
INITIALIZATION = "initialization_timeout"
_BAD_VALUE = """\
meshkit.init(): {name} must be a whole number of seconds >= 1; got {value!r}{origin}.
JAX's jax.distributed.initialize takes it as {parameter}, in whole seconds.
Consider {name}=SECONDS, e.g. {name}=120."""

_UNSUPPORTED = """\
meshkit.init({name}=...): the running JAX {version} has no {parameter} parameter in
jax.distributed.initialize, so it cannot be passed{origin}.
JAX 0.10.2 and 0.12 have it.
Consider installing one of those JAX versions, or leaving {name} unset (JAX then keeps its own
default)."""


def _origin(variable: str | None) -> str:
    return f" (from the environment variable {variable})" if variable else ""


def distributed_options(**given: Any) -> dict[str, Any]:
    """``jax.distributed.initialize``'s timeouts to pass, ``{parameter: seconds}``.

    Refused where the running JAX's ``jax.distributed.initialize`` lacks one of them.
    """
    options, origins = {}, {}
    for parameter, (name, variable) in DISTRIBUTED_OPTIONS.items():
        value, origin = given.get(name), None
        if value is None:
            value, origin = _env.integer(variable, where=_WHERE), variable
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = {"name": name, "value": value, "origin": _origin(origin), "parameter": parameter}
            raise MeshkitError(_BAD_VALUE.format(**what))
        options[parameter], origins[parameter] = value, origin
    try:
        accepted = inspect.signature(jax.distributed.initialize).parameters
    except (TypeError, ValueError):  # no signature to read: let JAX itself judge the call
        return options
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return options  # a wrapper (a test's spy, a framework's) that passes keywords on
    for parameter in [INITIALIZATION, *options]:
        if parameter not in accepted:
            name = DISTRIBUTED_OPTIONS.get(parameter, ("timeout",))[0]
            what = {"name": name, "parameter": parameter, "origin": _origin(origins.get(parameter))}
            raise MeshkitError(_UNSUPPORTED.format(version=jax.__version__, **what))
    return options


def _local_cpu_count() -> int | None:
    """This process's CPU devices, or None where JAX has no CPU backend."""
    try:
        return len(jax.local_devices(backend="cpu"))
    except RuntimeError:
        return None


def _collectives() -> str | None:
    """The CPU collectives implementation JAX is set to use (None: none chosen)."""
    value = jax.config.values.get("jax_cpu_collectives_implementation")
    return None if value in (None, "", "none") else str(value)


def _select_gloo() -> str | None:
    """Multi-process CPU collectives need an implementation; gloo ships with jaxlib."""
    if _collectives() is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    return _collectives()
