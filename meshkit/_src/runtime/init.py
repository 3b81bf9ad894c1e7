"""Joining the cluster: ``meshkit.init()`` and what it found.

``init`` decides how this process joins a multi-process JAX program, in this order:

1. explicit arguments (``coordinator_address=``, ``num_processes=``, ``process_id=``);
2. the environment written by ``meshkit launch`` (``MESHKIT_COORDINATOR`` and friends);
3. another engine's environment: Kubeflow Trainer's ``JAX_*`` variables, SkyPilot's, a JobSet
   or Indexed Job's (`meshkit._src.core.engines`; in part, or disagreeing with another source
   on the process count, it is an error);
4. JAX's own cluster detection (Open MPI, SLURM, Cloud TPU, Kubernetes); SLURM variables that
   ask for several tasks outside a job step (a batch script without srun) are an error
   (`meshkit._src.runtime.slurm`);
5. otherwise a single process, which needs no coordinator.

The coordinator's address is checked before JAX is asked (`meshkit._src.runtime.coordinator`):
JAX aborts the whole process when it cannot reach it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Sequence

import jax

from ..core import compat as _compat
from ..core import engines as _engines
from ..core import env as _env
from ..core import events as _events
from ..core import program_thread as _program_thread
from ..core import rank_stages as _progress
from ..core.contract import (
    ENV_ATTEMPT,
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_INIT_TIMEOUT,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_STATUS,
)
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..debug import mode as _debug_mode
from ..lifecycle import failfast as _failfast
from ..lifecycle import preemption as _preemption
from . import compile_cache as _compile_cache
from . import cpu_backend as _cpu
from . import distributed_options as _options
from . import gpus as _gpus
from . import hosts as _hosts
from . import install_guards as _install_guards
from . import preflight as _preflight
from . import programs as _programs
from . import slurm as _slurm
from .coordinator import check_coordinator, split_address
from .hosts import Hosts

__all__ = [
    "RuntimeInfo",
    "init",
    "runtime_info",
]

_WHERE = "meshkit.init()"
_DEFAULT_INIT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    """How this process joined the program, as decided by `meshkit.init`.

    Attributes:
        source: ``"arguments"``, ``"meshkit launch"``, another engine's environment
            (``"JAX_* variables"``, as Kubeflow Trainer's JAX runtime sets them; ``"SkyPilot"``;
            ``"JobSet"``; ``"Indexed Job"``), ``"cluster"`` (JAX's detection),
            ``"jax.distributed"`` (initialised before meshkit), or ``"single process"``.
        reason: one sentence saying what was found that led to ``source``.
        num_processes: processes in the program.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        coordinator_address: ``host:port`` of the coordination service, None for one process.
        cluster: the name of JAX's cluster detector that matched, when ``source == "cluster"``.
        cpu_devices: CPU devices requested for this process, None when JAX's default was kept.
        local_device_ids: accelerator ids this process was given; None when JAX chose (all
            visible devices). Under Open MPI or SLURM, JAX itself gives each process only its
            local rank's accelerator unless ids are passed; this field then shows that choice,
            or, where the scheduler bound GPUs to the task (``srun --gpus-per-task``,
            ``--gpu-bind``: the task sees only its own, renumbered from 0), the task's own
            devices (`meshkit._src.runtime.gpus`; ``reason`` says why).
        cpu_collectives: the CPU collectives implementation set for multi-process CPU runs.
        hosts: which processes run on which host (`meshkit.Hosts`), learned in one exchange once
            the processes joined; `meshkit.make_mesh` keeps inner axes inside a host.
        attempt: which start of the whole group of processes this is: 0 for the first, 1 after
            the first restart (``meshkit launch --max-restarts``; under SLURM,
            ``SLURM_RESTART_COUNT`` of a requeued job).
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
        rows = [
            ("source", self.source),
            ("reason", self.reason),
            ("process", f"{self.process_id} of {self.num_processes}"),
            ("coordinator", self.coordinator_address or "-"),
            ("cluster", self.cluster or "-"),
            ("cpu devices", "JAX default" if self.cpu_devices is None else str(self.cpu_devices)),
            (
                "local devices",
                "JAX default (all visible)"
                if self.local_device_ids is None
                else ",".join(map(str, self.local_device_ids)),
            ),
            ("cpu collectives", self.cpu_collectives or "-"),
            ("hosts", "-" if self.hosts is None else _shown_hosts(self.hosts)),
            ("attempt", str(self.attempt)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _shown_hosts(hosts: Hosts) -> str:
    if len(hosts) <= 4:
        return f"{len(hosts)} ({hosts})"
    return f"{len(hosts)} (this process on {hosts.host_of(_compat.distributed_state()[1])})"


_INFO: RuntimeInfo | None = None
_BACKENDS_STARTED = """\
meshkit.init() was called after JAX had already started its backends, so it can no longer {what}.
JAX fixes the device count and the cluster membership when it first touches a device (any
jax.devices(), jnp array, or jit call does).
Consider calling meshkit.init() first thing in your program, before any other JAX call."""


@public
def runtime_info() -> RuntimeInfo | None:
    """What `meshkit.init` decided, or None if it has not run in this process."""
    return _INFO


def _positive(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshkitError(f"meshkit.init(): {name} must be a positive int; got {value!r}.")
    return value


def _detect_cluster() -> type | None:
    for env in _compat.cluster_envs():
        if getattr(env, "opt_in_only_method", False):
            continue
        with contextlib.suppress(Exception):  # a detector that cannot run has not detected
            if env.is_env_present():
                return env
    return None


def _plan(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: tuple[int, ...] | None,
) -> RuntimeInfo:
    """Decide how to join, without changing any state."""
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        n = num_processes if num_processes is not None else 1
        pid = process_id if process_id is not None else 0
        _check_against_launcher(n, pid)
        if n > 1:
            if coordinator_address is None:
                raise MeshkitError(
                    f"meshkit.init(num_processes={n}) needs coordinator_address='host:port' "
                    "(the address of process 0)."
                )
            split_address(coordinator_address)  # refused before any state is read
        return RuntimeInfo(
            "arguments", "coordinator/processes passed to meshkit.init()", n, pid,
            coordinator_address if n > 1 else None, local_device_ids=local_device_ids,
        )  # fmt: skip
    _engines.check_agreement(os.environ)
    launch_address = os.environ.get(ENV_COORDINATOR)
    if launch_address:
        n, pid = (
            _env.integer(ENV_NUM_PROCESSES, where=_WHERE),
            _env.integer(ENV_PROCESS_ID, where=_WHERE),
        )
        if n is None or pid is None:
            raise MeshkitError(
                f"meshkit.init(): {ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES} or "
                f"{ENV_PROCESS_ID} is not; these three are set together by `meshkit launch`."
            )
        split_address(launch_address)
        return RuntimeInfo(
            "meshkit launch", f"{ENV_COORDINATOR}={launch_address} is set", n, pid,
            launch_address, local_device_ids=local_device_ids,
        )  # fmt: skip
    cluster = _detect_cluster()
    engine = _engines.read_engine(os.environ, jax_detects=cluster and cluster.__name__)
    if engine is not None:
        return RuntimeInfo(
            engine.engine, f"{engine.engine} found: {engine.found}", engine.num_processes,
            engine.process_id, engine.coordinator_address, local_device_ids=local_device_ids,
        )  # fmt: skip
    if cluster is None or cluster.__name__ == "SlurmCluster":
        # A batch script asking for several tasks looks like no cluster to JAX: say so now.
        _slurm.check_step(os.environ)
    if cluster is not None:
        name = cluster.__name__
        return RuntimeInfo(
            "cluster", f"JAX's {name} detector found its environment",
            cluster=name, local_device_ids=local_device_ids,
        )  # fmt: skip
    _warn_if_launcher_unrecognised()
    return RuntimeInfo(
        "single process",
        "no meshkit launch environment and no cluster detected",
        local_device_ids=local_device_ids,
    )


def check_joined(what: str) -> None:
    """Raise if `meshkit launch` started this process as one of several, and it never joined.

    Without `init` each rank would run alone on its own devices, compute the whole program by
    itself and print numbers that look right (issue: a silent wrong sum). Called at this
    process's first SPMD call (`meshkit._src.runtime.dispatch`); reads the environment, starts
    nothing.
    """
    if not os.environ.get(ENV_COORDINATOR) or _INFO is not None:
        return
    if _compat.distributed_state()[0] is not None:  # joined through jax.distributed itself
        return
    n, pid = os.environ.get(ENV_NUM_PROCESSES, "?"), os.environ.get(ENV_PROCESS_ID, "?")
    if n == "1":
        return
    raise MeshkitError(
        f"{what}: this process was started by meshkit launch as process {pid} of {n} "
        f"({ENV_COORDINATOR} is set), but meshkit.init() was not called, so it would run alone "
        "on its own devices and compute the whole program by itself.\n"
        "Consider calling meshkit.init() first in the program, before any other JAX or meshkit "
        "call."
    )


def _check_against_launcher(n: int, pid: int) -> None:
    """Arguments that contradict the `meshkit launch` environment would hang until a timeout."""
    if not os.environ.get(ENV_COORDINATOR):
        return
    started, rank = (
        _env.integer(ENV_NUM_PROCESSES, where=_WHERE),
        _env.integer(ENV_PROCESS_ID, where=_WHERE),
    )
    if started is not None and (n, pid) != (started, rank):
        raise MeshkitError(
            f"meshkit.init(num_processes={n}, process_id={pid}): this process was started by "
            f"meshkit launch as process {rank} of {started} ({ENV_NUM_PROCESSES}={started}, "
            f"{ENV_PROCESS_ID}={rank}); the processes would wait for ones that never come.\n"
            "Consider meshkit.init() without arguments under meshkit launch (it reads the "
            f"launcher's settings), or meshkit launch -n {n}."
        )


# Variables by which launchers JAX may not recognise announce a world of several processes
# (SLURM_NTASKS is `_slurm.check_step`'s: an error, since SLURM's own variables say what is wrong).
_WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def _warn_if_launcher_unrecognised() -> None:
    for name in _WORLD_SIZE_VARS:
        raw = os.environ.get(name, "")
        if raw.isdigit() and int(raw) > 1:
            warnings.warn(
                f"meshkit.init(): {name}={raw} says this program runs as {raw} processes, but "
                "no cluster JAX can join was detected, so this process runs alone (process 0 "
                "of 1) and computes the whole program by itself.\n"
                "Consider a launcher JAX detects (Open MPI's mpirun, SLURM's srun with "
                "SLURM_JOB_ID and SLURM_STEP_NODELIST, meshkit launch), or pass "
                "coordinator_address=, num_processes= and process_id= to meshkit.init().",
                RuntimeWarning,
                stacklevel=4,
            )
            return


def _check_again(previous: RuntimeInfo, plan: RuntimeInfo, cpu_devices: int | None) -> None:
    same = (
        plan.source == previous.source
        and plan.num_processes == previous.num_processes
        and plan.process_id == previous.process_id
        and plan.coordinator_address == previous.coordinator_address
    ) or plan.source == "cluster"
    if cpu_devices is not None and cpu_devices != previous.cpu_devices:
        same = False
    if not same:
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
        local_device_ids: accelerators this process owns (default: ``MESHKIT_LOCAL_DEVICE_IDS``
            if set, else JAX's choice: all visible ones, or under Open MPI or SLURM the one of
            this process's local rank).
        cpu_devices: CPU devices for this process (default: ``MESHKIT_CPU_DEVICES``, else JAX's).
        timeout: seconds to wait for the coordinator and the other processes (default
            ``MESHKIT_INIT_TIMEOUT``, else 300); JAX's ``initialization_timeout``.
        heartbeat_timeout: whole seconds without heartbeats after which JAX's coordination
            service takes a process for dead (default ``MESHKIT_HEARTBEAT_TIMEOUT``, else JAX's,
            100); JAX's ``heartbeat_timeout_seconds``.
        shutdown_timeout: whole seconds a process that ends waits at JAX's exit barrier for the
            others (default ``MESHKIT_SHUTDOWN_TIMEOUT``, else JAX's, 300); JAX's
            ``shutdown_timeout_seconds``.
        compilation_cache: a directory for JAX's persistent compilation cache, shared by
            restarts and hosts (default ``MESHKIT_COMPILATION_CACHE``, which ``meshkit launch
            --compilation-cache`` sets, else none); set before anything compiles. Read at the
            first call only.

    Returns:
        What was detected and why; ``str()`` of it is a readable table.

    Raises:
        DivergenceError: the processes run different versions of JAX, jaxlib, meshkit or
            Python, on different platforms, kinds or numbers of local devices, or with different
            `jax.config` settings that reach compiled programs (the preflight; see
            ``MESHKIT_PREFLIGHT``).
        MeshkitError: JAX's backends already started and joining would need to change them; the
            coordinator cannot be reached within ``timeout``; process 0's port is taken; a
            ``timeout`` that is not a finite number > 0, a ``num_processes`` below 1, a
            ``process_id`` outside ``0 .. num_processes - 1``, arguments that contradict the
            ``meshkit launch`` environment, or other inconsistent arguments; a
            ``heartbeat_timeout`` or ``shutdown_timeout`` that is not a whole number >= 1, or
            that the running JAX's ``jax.distributed.initialize`` does not take (the message
            names the JAX versions that do); another engine's variables in part (Kubeflow's
            ``JAX_COORDINATOR_ADDRESS`` without ``JAX_NUM_PROCESSES``), with a process id not
            below its count, or two variables that give different process counts
            (``JAX_NUM_PROCESSES`` and ``MESHKIT_NUM_PROCESSES``, say); SLURM variables
            that ask for several tasks where this process is not a task of a job step (a batch
            script that runs the program without ``srun``); a ``compilation_cache`` directory
            that cannot be created or written (the message names it and its source).

    Examples:
        >>> import meshkit
        >>> info = meshkit.init()  # alone: no launcher environment, no cluster
        >>> info.num_processes
        1
    """
    global _INFO
    first = _INFO is None
    fail_fast = _failfast.settings()  # a bad setting is an error before anything is joined
    preempt_grace = _preemption.grace()
    if first:
        _program_thread.adopt()  # the program's thread, wherever it runs (Ray Train: a worker's)
        _compile_cache.enable(compilation_cache)  # before anything compiles
        _install_guards.before_joining(
            fail_fast, preempt_grace
        )  # a notice while joining is one too
    info = _init(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        cpu_devices=cpu_devices,
        timeout=timeout,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_timeout=shutdown_timeout,
        fail_fast=fail_fast,
        preempt_grace=preempt_grace,
    )
    if first:
        _events.emit(_events.JOINED)  # for `meshkit launch` (nothing outside its runs)
        if os.environ.get(ENV_STATUS):
            _compile_cache.watch()  # each attempt's compile time, for the launcher's report
        # Before anything runs: the processes run the same software with the same settings.
        _preflight.check(info.process_id, info.num_processes, _env.check_timeout())
        hosts = _hosts.exchange(info.process_id, info.num_processes, _env.check_timeout())
        _hosts.remember(hosts)
        info = _INFO = dataclasses.replace(info, hosts=hosts, attempt=_attempt())
        # From now on, every computation across processes is compared before it first runs.
        _programs.install(info.num_processes)
        _debug_mode.from_environment()  # MESHKIT_DEBUG=1: debug mode from here on
    return info


def _init(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    timeout: float | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int | None = None,
    fail_fast: float | None = None,
    preempt_grace: float = 0.0,
) -> RuntimeInfo:
    global _INFO
    cpu_devices = _positive("cpu_devices", cpu_devices)
    if cpu_devices is None:
        cpu_devices = _positive(ENV_CPU_DEVICES, _env.integer(ENV_CPU_DEVICES, where=_WHERE))
    if timeout is None:
        timeout = _env.number(ENV_INIT_TIMEOUT, where=_WHERE)
    timeout = _DEFAULT_INIT_TIMEOUT_S if timeout is None else timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise MeshkitError(
            f"meshkit.init(): timeout must be a finite number > 0 seconds; got {timeout!r}"
            f" (from the argument, else {ENV_INIT_TIMEOUT})."
        )
    timeout = float(timeout)
    options = _options.chosen(
        heartbeat_timeout=heartbeat_timeout, shutdown_timeout=shutdown_timeout
    )
    _options.check_supported(options)
    num_processes = _positive("num_processes", num_processes)
    if process_id is not None and (
        isinstance(process_id, bool) or not isinstance(process_id, int) or process_id < 0
    ):
        raise MeshkitError(f"meshkit.init(): process_id must be an int >= 0; got {process_id!r}.")
    if process_id is not None and process_id >= (num_processes or 1):
        raise MeshkitError(
            f"meshkit.init(): process_id={process_id} is not one of the "
            f"{num_processes or 1} processes (ids 0 to {(num_processes or 1) - 1}).\n"
            "Consider process ids from 0 to num_processes - 1, one per process."
        )
    ids = None if local_device_ids is None else tuple(int(i) for i in local_device_ids)
    if ids is None:
        ids = _env.ids(ENV_LOCAL_DEVICE_IDS, where=_WHERE)
    plan = _plan(coordinator_address, num_processes, process_id, ids)

    if _INFO is not None:
        _check_again(_INFO, plan, cpu_devices)
        return _INFO

    client, joined_pid, joined_n = _compat.distributed_state()
    if client is not None:
        # Joined elsewhere (the program, Ray, an engine's runtime): adopt the join and guard it
        # as a join of meshkit's own.
        if joined_n > 1 and not _compat.backends_are_initialized():
            _cpu.select_gloo()
        _INFO = dataclasses.replace(
            plan,
            source="jax.distributed",
            reason="jax.distributed.initialize() was called before meshkit.init()",
            num_processes=joined_n,
            process_id=joined_pid,
            cpu_devices=cpu_devices,
            cpu_collectives=_cpu.collectives() if joined_n > 1 else None,
        )
        if options:
            warnings.warn(
                f"meshkit.init(): {', '.join(sorted(options))} not applied: the processes joined "
                "before meshkit.init(), and JAX takes it only when joining; pass it to that "
                "jax.distributed.initialize() call.",
                stacklevel=4,
            )
        if joined_n > 1:
            _install_guards.joined(fail_fast, preempt_grace, joined_pid, joined_n)
        else:
            _install_guards.alone(fail_fast, preempt_grace, joined_pid)
        return _INFO

    started = _compat.backends_are_initialized()
    joins = plan.source != "single process" and (plan.num_processes > 1 or plan.source == "cluster")
    if started and joins:
        what = f"join a multi-process program ({plan.reason})"
        raise MeshkitError(_BACKENDS_STARTED.format(what=what))
    if started and cpu_devices is not None and _cpu.local_cpu_count() != cpu_devices:
        raise MeshkitError(_BACKENDS_STARTED.format(what=f"set {cpu_devices} CPU devices"))

    if cpu_devices is not None and not started:
        jax.config.update("jax_num_cpu_devices", cpu_devices)

    if not joins:
        _INFO = dataclasses.replace(plan, cpu_devices=cpu_devices)
        _install_guards.alone(fail_fast, preempt_grace, plan.process_id)
        return _INFO

    collectives = _cpu.select_gloo()
    _progress.mark("joining", plan.process_id)  # for `meshkit launch`, which shows who waits
    init_timeout = max(1, math.ceil(timeout))
    ids_arg = list(plan.local_device_ids) if plan.local_device_ids is not None else None
    if plan.source == "cluster":
        address, n, pid, detected_ids = _compat.cluster_params(ids_arg, init_timeout)
        reason = plan.reason
        if ids_arg is None and detected_ids is not None and len(detected_ids) == 1:
            # JAX would take the local rank as the one device id; not if GPUs were bound.
            binding = _gpus.bound_device_ids(os.environ, int(detected_ids[0]))
            if binding is not None:
                ids_arg = detected_ids = list(binding.ids)
                reason = f"{reason}; devices {','.join(map(str, binding.ids))}: {binding.reason}"
        if address is not None and n is not None and pid is not None:
            check_coordinator(address, pid, n, timeout, source=plan.reason)
        # JAX detects again inside initialize (keeping its TPU and slice handling its own).
        jax.distributed.initialize(
            local_device_ids=ids_arg, initialization_timeout=init_timeout, **options
        )
        _, pid, n = _compat.distributed_state()
        plan = dataclasses.replace(
            plan,
            reason=reason,
            num_processes=n,
            process_id=pid,
            coordinator_address=address,
            local_device_ids=None if detected_ids is None else tuple(detected_ids),
        )
    else:
        assert plan.coordinator_address is not None
        check_coordinator(
            plan.coordinator_address, plan.process_id, plan.num_processes, timeout, plan.source
        )
        jax.distributed.initialize(
            plan.coordinator_address,
            plan.num_processes,
            plan.process_id,
            local_device_ids=ids_arg,
            initialization_timeout=init_timeout,
            **options,
        )
    _INFO = dataclasses.replace(plan, cpu_devices=cpu_devices, cpu_collectives=collectives)
    _progress.mark("joined", _INFO.process_id)
    _install_guards.joined(fail_fast, preempt_grace, _INFO.process_id, _INFO.num_processes)
    return _INFO


def _attempt() -> int:
    """Which start of the group this is: ``MESHKIT_ATTEMPT``, else ``SLURM_RESTART_COUNT``."""
    for name in (ENV_ATTEMPT, "SLURM_RESTART_COUNT"):
        value = _env.integer(name, where=_WHERE)
        if value is not None:
            return max(0, value)
    return 0
