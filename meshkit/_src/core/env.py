"""What the environment says: meshkit's settings, and how other engines start each process.

Settings are read when needed, never at import: unset or blank is None (the caller applies its
default); a value that is set but not accepted is a `MeshkitError` naming the variable and the
call. `read_engine` reads the variables of engines other than `meshkit launch`: ``JAX_*``
(Kubeflow Trainer), SkyPilot, JobSet and Indexed Jobs, in that order (``docs/multi-host.md``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from .errors import MeshkitError
from .events import ENV_ATTEMPT, ENV_NUM_PROCESSES, ENV_PROCESS_ID

ENV_CHECK_TIMEOUT = "MESHKIT_CHECK_TIMEOUT"
T = TypeVar("T")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def raw(name: str) -> str | None:
    """The variable's value, stripped; None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(where: str, name: str, value: str, rule: str) -> MeshkitError:
    prefix = f"{where}: environment variable " if where else ""
    return MeshkitError(f"{prefix}{name}={value!r} {rule}.")


def _parse(name: str, where: str, convert: Callable[[str], T], rule: str) -> T | None:
    value = raw(name)
    if value is None:
        return None
    try:
        return convert(value)
    except ValueError:
        raise _bad(where, name, value, rule) from None


def integer(name: str, *, where: str = "") -> int | None:
    return _parse(name, where, int, "is not an integer")


def number(name: str, *, where: str = "") -> float | None:
    """A number of seconds as given (None when unset); the caller checks its range."""
    return _parse(name, where, float, "is not a number of seconds")


def seconds(
    name: str,
    *,
    where: str = "",
    zero: str | None = None,
    positive: bool = True,
    default: float | None = None,
) -> float | None:
    """A duration in seconds (``default`` when unset): finite, and > 0 unless told otherwise."""
    value = number(name, where=where)
    if value is None:
        return default
    if not positive:
        rule, ok = "must be a finite number of seconds >= 0", value >= 0
    else:
        rule = "must be a finite number of seconds > 0" + (f" (0: {zero})" if zero else "")
        ok = value > 0 or (value == 0 and zero is not None)
    if not (math.isfinite(value) and ok):
        raise _bad(where, name, raw(name) or "", rule)
    return value


def flag(
    name: str, *, where: str = "", on: str = "on", off: str = "off", blank: bool | None = None
) -> bool | None:
    """A yes/no setting: True, False, or ``blank`` when unset or empty."""
    value = raw(name)
    if value is None:
        return blank
    if value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    empty = "empty, " if blank is False else ""
    rule = f"is not one of {', '.join(TRUE)} ({on}) or {empty}{', '.join(FALSE)} ({off})"
    raise _bad(where, name, value, rule)


def ids(name: str, *, where: str = "") -> tuple[int, ...] | None:
    """A comma-separated list of integers (device ids), None when unset."""
    rule = "is not a comma-separated list of device ids, e.g. '0,1'"
    return _parse(name, where, lambda v: tuple(int(x) for x in v.split(",")), rule)


STEPS_RULE = (
    "is not a range of steps A:B: the first and last step of meshkit.global_batches to profile, "
    "whole numbers with 1 <= A <= B (e.g. 10:12)"
)


def step_range(text: str) -> tuple[int, int] | None:
    """``"A:B"`` as ``(A, B)`` with ``1 <= A <= B``; None when it is not one (`STEPS_RULE`)."""
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text, re.ASCII)
    if found is None:
        return None
    first, last = int(found[1]), int(found[2])
    return (first, last) if 1 <= first <= last else None


def steps(name: str, *, where: str = "") -> tuple[int, int] | None:
    """A range of steps ``A:B`` (None when unset), refused when not one."""
    value = raw(name)
    if value is None:
        return None
    found = step_range(value)
    if found is None:
        raise _bad(where, name, value, STEPS_RULE)
    return found


def attempt(*, where: str = "") -> int:
    """Which start of the group this is: ``MESHKIT_ATTEMPT``, else ``SLURM_RESTART_COUNT``, or 0."""
    for name in (ENV_ATTEMPT, "SLURM_RESTART_COUNT"):
        value = integer(name, where=where)
        if value is not None:
            return max(0, value)
    return 0


def check_timeout() -> float:
    """Seconds an agreement between processes waits for the others (``MESHKIT_CHECK_TIMEOUT``)."""
    return seconds(ENV_CHECK_TIMEOUT, where="meshkit", default=120.0) or 120.0  # never 0


def visible_devices(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """The variable that lists this process's visible accelerators, and how many it lists."""
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if name in environ:
            entries = [e.strip() for e in environ[name].split(",") if e.strip()]
            return name, 0 if entries[:1] == ["-1"] else len(entries)  # "-1": none
    return None


JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
SKYPILOT_VARS = ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS")
# The coordinator's port where an engine gives only a host; else JAX's K8s detector's port.
ENV_PORT = "JAX_COORDINATOR_PORT"
DEFAULT_PORT = 55527
ENV_K8S_SUBDOMAIN = "MESHKIT_K8S_SUBDOMAIN"
ENV_K8S_COORDINATOR_HOST = "MESHKIT_K8S_COORDINATOR_HOST"
# What JAX's SlurmCluster.is_env_present requires (JAX 0.10 and 0.12); srun sets them.
STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")

_INDEXED_VARS = ("JOB_COMPLETION_INDEX", "JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX",
                 ENV_NUM_PROCESSES, ENV_K8S_SUBDOMAIN, ENV_K8S_COORDINATOR_HOST)  # fmt: skip

JAX_ENGINE = "JAX_* variables"
SKYPILOT = "SkyPilot"
JOBSET = "JobSet"
INDEXED_JOB = "Indexed Job"


@dataclasses.dataclass(frozen=True)
class EngineJoin:
    """How an engine's environment says this process joins."""

    engine: str
    num_processes: int
    process_id: int
    coordinator_address: str | None
    found: str


_PARTIAL = """\
meshkit.init(): the environment sets {found} but not {missing}; {engine} sets {all} together.
Without all of them this process cannot join the others, and would run alone as process 0 of 1.
Consider setting {missing} too, or unsetting {found_names} to run one process."""

_BAD = """\
meshkit.init(): {what} ({engine}: {found}).
{rule}
Consider {fix}"""

_DISAGREE = """\
meshkit.init(): the environment gives this process two different {what}: {first} but {second}.
Processes that do not agree on the program would wait for ones that never come.
Consider setting one of them only, or the same value in both; under meshkit launch inside
another engine's job, unset the engine's JAX_* variables in the launcher's environment."""

_NO_COUNT = """\
meshkit.init(): this process is index {index} of a {engine} ({found}), but no variable gives the
number of processes: Kubernetes does not put the Job's completions in the environment.
Without it this process would run alone as process 0 of 1.
Consider setting {count}=<completions> in the pod template (env: - name: {count}, value:
"<completions>"), or passing num_processes= to meshkit.init()."""


def _found(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={environ[n]!r}" for n in names if n in environ)


def _int(value: str | None) -> int | None:
    text = (value or "").strip()
    return int(text) if text.isdigit() else None


def _engine_error(engine: str, found: str, what: str, rule: str, fix: str) -> MeshkitError:
    return MeshkitError(_BAD.format(what=what, engine=engine, found=found, rule=rule, fix=fix))


def _count_and_id(
    engine: str, found: str, environ: Mapping[str, str], count: str, index: str
) -> tuple[int, int]:
    """The process count (>= 1) in the variable ``count`` and the id below it in ``index``."""
    n, pid = _int(environ[count]), _int(environ[index])
    if n is None or n < 1:
        what = f"{count}={environ[count]!r} is not a process count >= 1"
        rule = f"{count} is the number of processes in the program."
        raise _engine_error(engine, found, what, rule, f"a whole number >= 1 in {count}.")
    if pid is None or pid >= n:
        what = f"{index}={environ[index]!r} is not a process id below {count}={n}"
        rule = f"Process ids run from 0 to {n - 1}, one per process."
        fix = f"giving each process its own id from 0 to {n - 1}, and {count} the number of "
        raise _engine_error(engine, found, what, rule, fix + "processes.")
    return n, pid


def _port(environ: Mapping[str, str], engine: str, found: str) -> int:
    raw = environ.get(ENV_PORT, "").strip()
    port = _int(raw) if raw else DEFAULT_PORT
    if port is None or not 0 < port < 65536:
        what = f"{ENV_PORT}={raw!r} is not a port"
        rule = "The coordinator's port is a number from 1 to 65535."
        fix = f"{ENV_PORT}=PORT, the same in every process, or unset for {DEFAULT_PORT}."
        raise _engine_error(engine, f"{found}, {ENV_PORT}={raw!r}", what, rule, fix)
    return port


def _all_of(environ: Mapping[str, str], names: tuple[str, ...], engine: str, blank: bool) -> str:
    """Those of ``names`` set (``blank``: even if blank), as `_found` lists them; not all: raise."""
    present = [n for n in names if (n in environ if blank else environ.get(n, "").strip())]
    found = _found(environ, tuple(present))
    if present and len(present) < len(names):
        missing = " and ".join(n for n in names if n not in present)
        all_, found_names = ", ".join(names), ", ".join(present)
        fill = dict(found=found, missing=missing, engine=engine, all=all_, found_names=found_names)
        raise MeshkitError(_PARTIAL.format(**fill))
    return found


def _jax_vars(environ: Mapping[str, str], jax_detects: str | None) -> EngineJoin | None:
    address = environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
    only_address = not any(environ.get(n, "").strip() for n in JAX_VARS[1:])
    if jax_detects is not None and address and only_address:
        return None  # JAX's own override of a cluster it detects
    found = _all_of(environ, JAX_VARS, "Kubeflow Trainer's JAX runtime", blank=False)
    if not found:
        return None
    n, pid = _count_and_id(JAX_ENGINE, found, environ, "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        what = f"{_found(environ, JAX_VARS[:1])} is not of the form 'host:port'"
        rule = "It is process 0's host and the port its coordination service serves."
        fix = "JAX_COORDINATOR_ADDRESS=HOST:PORT, the same in every process."
        raise _engine_error(JAX_ENGINE, found, what, rule, fix)
    return EngineJoin(JAX_ENGINE, n, pid, address if n > 1 else None, found)


def _skypilot(environ: Mapping[str, str]) -> EngineJoin | None:
    found = _all_of(environ, SKYPILOT_VARS, "SkyPilot", blank=True)
    if not found:
        return None
    n, pid = _count_and_id(SKYPILOT, found, environ, "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK")
    ips = [line.strip() for line in environ["SKYPILOT_NODE_IPS"].splitlines() if line.strip()]
    if len(ips) != n:
        what = f"SKYPILOT_NODE_IPS lists {len(ips)} IPs for SKYPILOT_NUM_NODES={n} nodes"
        rule = "SkyPilot lists one IP a line, one per node, the head node first."
        fix = "running the program from the task's run commands, where SkyPilot sets these "
        raise _engine_error(SKYPILOT, found, what, rule, fix + "variables.")
    if n == 1:
        return EngineJoin(SKYPILOT, 1, 0, None, found)
    host = f"[{ips[0]}]" if ":" in ips[0] else ips[0]
    return EngineJoin(SKYPILOT, n, pid, f"{host}:{_port(environ, SKYPILOT, found)}", found)


def _indexed_job(environ: Mapping[str, str], jax_detects: str | None) -> EngineJoin | None:
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    jobset = environ.get("JOBSET_NAME", "").strip()
    engine = JOBSET if jobset else INDEXED_JOB
    found = _found(environ, _INDEXED_VARS)
    if not environ.get(ENV_NUM_PROCESSES, "").strip():
        if jax_detects == "K8sCluster" or not jobset:
            return None  # JAX asks Kubernetes' API; a plain Indexed Job may run independent tasks
        index = environ["JOB_COMPLETION_INDEX"]
        fill = dict(index=index, engine=engine, found=found, count=ENV_NUM_PROCESSES)
        raise MeshkitError(_NO_COUNT.format(**fill))
    n, pid = _count_and_id(engine, found, environ, ENV_NUM_PROCESSES, "JOB_COMPLETION_INDEX")
    if (_int(environ.get("JOB_INDEX")) or 0) > 0:
        what = f"JOB_INDEX={environ['JOB_INDEX']!r}: this pod belongs to a JobSet's second or "
        rule = "meshkit joins the pods of one Job: process ids come from JOB_COMPLETION_INDEX "
        fix = ("one replicated Job (replicas: 1) with completions and parallelism = the process "
               "count, or passing coordinator_address=, num_processes= and process_id= to "
               "meshkit.init().")  # fmt: skip
        raise _engine_error(engine, found, what + "later Job", rule + "alone.", fix)
    if n == 1:
        return EngineJoin(engine, 1, 0, None, found)
    host = environ.get(ENV_K8S_COORDINATOR_HOST, "").strip() or _index0_host(environ, found)
    return EngineJoin(engine, n, pid, f"{host}:{_port(environ, engine, found)}", found)


def _index0_host(environ: Mapping[str, str], found: str) -> str:
    subdomain = environ.get(ENV_K8S_SUBDOMAIN, "").strip()
    jobset = environ.get("JOBSET_NAME", "").strip()
    if jobset:
        rjob = environ.get("REPLICATED_JOB_NAME", "").strip()
        if not rjob:
            rule = "Index 0's host is <JOBSET_NAME>-<REPLICATED_JOB_NAME>-0-0.<subdomain>."
            fix = "REPLICATED_JOB_NAME from the pod's annotation jobset.sigs.k8s.io/replicatedjob-"
            fix += "name (the downward API)."
            what = "JOBSET_NAME is set but REPLICATED_JOB_NAME is not"
            raise _engine_error(JOBSET, found, what, rule, fix)
        return f"{jobset}-{rjob}-0-0.{subdomain or jobset}"
    index, hostname = environ["JOB_COMPLETION_INDEX"].strip(), environ.get("HOSTNAME", "")
    job = hostname.removesuffix(f"-{index}") if hostname.endswith(f"-{index}") else ""
    if not job or not subdomain:
        what = f"index 0's host is unknown: {ENV_K8S_SUBDOMAIN} is not set or HOSTNAME is not "
        rule = "Index 0's host is <job>-0.<subdomain>, the subdomain being the Job's headless "
        fix = f"{ENV_K8S_SUBDOMAIN}=<the service's name>, or {ENV_K8S_COORDINATOR_HOST}=<index 0's "
        found = f"{found}, HOSTNAME={hostname!r}"
        raise _engine_error(
            INDEXED_JOB, found, what + "<job>-<index>", rule + "service.", fix + "host>."
        )
    return f"{job}-0.{subdomain}"


def read_engine(environ: Mapping[str, str], *, jax_detects: str | None = None) -> EngineJoin | None:
    """How an engine's variables say this process joins (None: none); after `check_agreement`."""
    return (
        _jax_vars(environ, jax_detects) or _skypilot(environ) or _indexed_job(environ, jax_detects)
    )


def check_agreement(environ: Mapping[str, str]) -> None:
    """Raise if ``JAX_*`` and another variable give different process counts, or ids."""
    n, pid = environ.get("JAX_NUM_PROCESSES", "").strip(), environ.get("JAX_PROCESS_ID", "").strip()
    if not n:
        return
    others = [(ENV_NUM_PROCESSES, ENV_PROCESS_ID), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")]
    if all(environ.get(name) for name in STEP_VARS):  # a task of a SLURM job step
        others.append(("SLURM_NTASKS", "SLURM_PROCID"))
    for count, ident in others:
        other_n, other_pid = environ.get(count, "").strip(), environ.get(ident, "").strip()
        if not other_n:
            continue
        if _int(n) != _int(other_n):
            first, second, what = f"JAX_NUM_PROCESSES={n}", f"{count}={other_n}", "process counts"
        elif pid and other_pid and _int(pid) != _int(other_pid):
            first, second, what = f"JAX_PROCESS_ID={pid}", f"{ident}={other_pid}", "process ids"
        else:
            continue
        raise MeshkitError(_DISAGREE.format(what=what, first=first, second=second))


_NOT_A_STEP = """\
meshkit.init(): SLURM_NTASKS={n} says this SLURM job runs {n} tasks, but this process is not a
task of a job step, so there are no other processes to join: it would run alone and compute the
whole program by itself.
Found: {found}.
Missing: {missing}.
srun sets these five for each task it starts, and JAX's SLURM detection needs them all; the
commands of a batch script itself, and those typed in an salloc shell, run once, outside any job
step.
Consider starting the program with srun in the job script (`srun python program.py` starts the
{n} tasks), or, to run one process on purpose, `srun --ntasks=1 python program.py` or
meshkit.init(num_processes=1)."""

_BAD_VALUE = """\
meshkit.init(): {what} (SLURM's variables {found}).
srun sets these for each task of a job step: SLURM_NTASKS is the step's task count (>= 1),
SLURM_PROCID this task's index below it, SLURM_LOCALID its index on this node (>= 0).
Consider running the program under srun, and not setting SLURM_* variables by hand."""


def check_step(environ: Mapping[str, str]) -> None:
    """Raise if SLURM's variables ask for several tasks but this process is not one of a step."""
    found = [name for name in STEP_VARS if name in environ]
    if not found:
        return
    listed = ", ".join(f"{name}={environ[name]}" for name in found)
    n, pid, local = (_int(environ.get(v)) for v in STEP_VARS[2:])  # tasks, task id, on node
    if "SLURM_NTASKS" in environ and (n is None or n < 1):
        what = f"SLURM_NTASKS={environ['SLURM_NTASKS']!r} is not a task count >= 1"
        raise MeshkitError(_BAD_VALUE.format(what=what, found=listed))
    if len(found) < len(STEP_VARS):
        if n is not None and n > 1:
            missing = ", ".join(name for name in STEP_VARS if name not in environ)
            raise MeshkitError(_NOT_A_STEP.format(n=n, found=listed, missing=missing))
        return  # one task, or no task count: a single process, as JAX also sees it
    assert n is not None
    bad = "SLURM_PROCID" if pid is None or pid >= n else "SLURM_LOCALID" if local is None else ""
    if bad:
        rule = f"below SLURM_NTASKS={n}" if bad == "SLURM_PROCID" else ">= 0"
        what = f"{bad}={environ[bad]!r} is not a task index {rule}"
        raise MeshkitError(_BAD_VALUE.format(what=what, found=listed))


def bound_device_ids(
    environ: Mapping[str, str], local_rank: int | None
) -> tuple[tuple[int, ...], str] | None:
    """The devices a scheduler bound to this task and why; None when JAX's choice is right."""
    name, count = visible_devices(environ) or ("", 0)
    if count == 0 or local_rank is None:
        return None
    listed = f"{name}={environ[name]}"
    per_task = _int(environ.get("SLURM_GPUS_PER_TASK", "").rsplit(":", 1)[-1])  # [type:]count
    if per_task == count:
        given = environ["SLURM_GPUS_PER_TASK"]
        why = f"SLURM_GPUS_PER_TASK={given} and {listed}: the task's own GPUs"
    elif local_rank >= count:
        why = f"local rank {local_rank} with {listed}: the scheduler bound these to the task"
    else:
        return None
    return tuple(range(count)), why
