"""The environments that engines other than `meshkit launch` give each process.

A pure reading: `read_engine` takes an environment mapping and returns how the process joins
(`EngineJoin`), or None where no engine of this module set its variables; `meshkit.init` acts on
the answer. The engines, in the order they are read: ``JAX_*`` variables (Kubeflow Trainer's
``jax-distributed`` runtime; JAX 0.10.2 and 0.12 read only ``JAX_COORDINATOR_ADDRESS``, as the
address of a cluster JAX detects, so without one each process would run alone), SkyPilot (one
process per node), JobSet and Indexed Jobs (Kubernetes). Each engine's variables, and how index
0's host is found, are in ``docs/multi-host.md`` ("Kubeflow", "JobSet and Indexed Jobs",
"SkyPilot").

Two variables that give the process count (or this process's id) and disagree are an error,
whichever engine is then used (`check_agreement`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .contract import ENV_NUM_PROCESSES, ENV_PROCESS_ID
from .errors import MeshkitError

__all__ = [
    "DEFAULT_PORT",
    "ENV_K8S_COORDINATOR_HOST",
    "ENV_K8S_SUBDOMAIN",
    "ENV_PORT",
    "JAX_VARS",
    "SKYPILOT_VARS",
    "STEP_VARS",
    "EngineJoin",
    "check_agreement",
    "read_engine",
]

JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
SKYPILOT_VARS = ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS")
# The coordinator's port where an engine gives only a host: JAX's own variable (its cluster
# detection honours it too, and Kubeflow Trainer sets it), else the port JAX's K8s detector uses.
ENV_PORT = "JAX_COORDINATOR_PORT"
DEFAULT_PORT = 55527
ENV_K8S_SUBDOMAIN = "MESHKIT_K8S_SUBDOMAIN"
ENV_K8S_COORDINATOR_HOST = "MESHKIT_K8S_COORDINATOR_HOST"
# What JAX's SlurmCluster.is_env_present requires (the same in JAX 0.10 and 0.12): srun sets
# them for each task of a job step.
STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")

JAX_ENGINE = "JAX_* variables"
SKYPILOT = "SkyPilot"
JOBSET = "JobSet"
INDEXED_JOB = "Indexed Job"


@dataclasses.dataclass(frozen=True)
class EngineJoin:
    """How an engine's environment says this process joins.

    Attributes:
        engine: which environment was found (``"JAX_* variables"``, ``"SkyPilot"``,
            ``"JobSet"``, ``"Indexed Job"``).
        num_processes: processes in the program.
        process_id: this process's index.
        coordinator_address: ``host:port`` of process 0; None for one process.
        found: the variables read, ``NAME=value`` joined by commas, for messages and reports.
    """

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


def _bad(engine: str, found: str, what: str, rule: str, fix: str) -> MeshkitError:
    return MeshkitError(_BAD.format(what=what, engine=engine, found=found, rule=rule, fix=fix))


def _count_and_id(
    engine: str, found: str, environ: Mapping[str, str], count: str, index: str
) -> tuple[int, int]:
    """The process count (>= 1) in the variable ``count`` and the id below it in ``index``."""
    n, pid = _int(environ[count]), _int(environ[index])
    if n is None or n < 1:
        raise _bad(
            engine,
            found,
            f"{count}={environ[count]!r} is not a process count >= 1",
            f"{count} is the number of processes in the program.",
            f"a whole number >= 1 in {count}.",
        )
    if pid is None or pid >= n:
        raise _bad(
            engine,
            found,
            f"{index}={environ[index]!r} is not a process id below {count}={n}",
            f"Process ids run from 0 to {n - 1}, one per process.",
            f"giving each process its own id from 0 to {n - 1}, and {count} the "
            "number of processes.",
        )
    return n, pid


def _address(engine: str, found: str, name: str, address: str) -> str:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise _bad(
            engine,
            found,
            f"{name}={address!r} is not of the form 'host:port'",
            "It is process 0's host and the port its coordination service serves.",
            f"{name}=HOST:PORT, the same in every process.",
        )
    return address.strip()


def _port(environ: Mapping[str, str], engine: str, found: str) -> int:
    raw = environ.get(ENV_PORT, "").strip()
    if not raw:
        return DEFAULT_PORT
    port = _int(raw)
    if port is None or not 0 < port < 65536:
        raise _bad(
            engine,
            f"{found}, {ENV_PORT}={raw!r}",
            f"{ENV_PORT}={raw!r} is not a port",
            "The coordinator's port is a number from 1 to 65535.",
            f"{ENV_PORT}=PORT, the same in every process, or unset for {DEFAULT_PORT}.",
        )
    return port


def _all_of(
    environ: Mapping[str, str], present: list[str], names: tuple[str, ...], engine: str
) -> str:
    """``present``, all of ``names``, as `_found` lists them; some but not all is an error."""
    found = _found(environ, tuple(present))
    if len(present) < len(names):
        raise MeshkitError(
            _PARTIAL.format(
                found=found,
                missing=" and ".join(n for n in names if n not in present),
                engine=engine,
                all=", ".join(names),
                found_names=", ".join(present),
            )
        )
    return found


def _jax_vars(environ: Mapping[str, str], jax_detects: str | None) -> EngineJoin | None:
    present = [n for n in JAX_VARS if environ.get(n, "").strip()]
    if not present or (present == ["JAX_COORDINATOR_ADDRESS"] and jax_detects is not None):
        return None  # nothing set, or JAX's own override of a cluster it detects
    found = _all_of(environ, present, JAX_VARS, "Kubeflow Trainer's JAX runtime")
    n, pid = _count_and_id(JAX_ENGINE, found, environ, "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    address = _address(
        JAX_ENGINE, found, "JAX_COORDINATOR_ADDRESS", environ["JAX_COORDINATOR_ADDRESS"]
    )
    return EngineJoin(JAX_ENGINE, n, pid, address if n > 1 else None, found)


def _skypilot(environ: Mapping[str, str]) -> EngineJoin | None:
    present = [n for n in SKYPILOT_VARS if n in environ]
    if not present:
        return None
    found = _all_of(environ, present, SKYPILOT_VARS, "SkyPilot")
    n, pid = _count_and_id(SKYPILOT, found, environ, "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK")
    ips = [line.strip() for line in environ["SKYPILOT_NODE_IPS"].splitlines() if line.strip()]
    if len(ips) != n:
        raise _bad(
            SKYPILOT,
            found,
            f"SKYPILOT_NODE_IPS lists {len(ips)} IPs for SKYPILOT_NUM_NODES={n} nodes",
            "SkyPilot lists one IP a line, one per node, the head node first.",
            "running the program from the task's run commands, "
            "where SkyPilot sets these variables.",
        )
    if n == 1:
        return EngineJoin(SKYPILOT, 1, 0, None, found)
    host = f"[{ips[0]}]" if ":" in ips[0] else ips[0]
    return EngineJoin(SKYPILOT, n, pid, f"{host}:{_port(environ, SKYPILOT, found)}", found)


def _indexed_job(environ: Mapping[str, str], jax_detects: str | None) -> EngineJoin | None:
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    jobset = environ.get("JOBSET_NAME", "").strip()
    engine = JOBSET if jobset else INDEXED_JOB
    names = (
        "JOB_COMPLETION_INDEX",
        "JOBSET_NAME",
        "REPLICATED_JOB_NAME",
        "JOB_INDEX",
        ENV_NUM_PROCESSES,
        ENV_K8S_SUBDOMAIN,
        ENV_K8S_COORDINATOR_HOST,
    )
    found = _found(environ, names)
    if not environ.get(ENV_NUM_PROCESSES, "").strip():
        if jax_detects == "K8sCluster" or not jobset:
            return None  # JAX asks Kubernetes' API; a plain Indexed Job may run independent tasks
        index = environ["JOB_COMPLETION_INDEX"]
        raise MeshkitError(
            _NO_COUNT.format(index=index, engine=engine, found=found, count=ENV_NUM_PROCESSES)
        )
    n, pid = _count_and_id(engine, found, environ, ENV_NUM_PROCESSES, "JOB_COMPLETION_INDEX")
    if (_int(environ.get("JOB_INDEX")) or 0) > 0:
        raise _bad(
            engine,
            found,
            f"JOB_INDEX={environ['JOB_INDEX']!r}: this pod belongs to "
            "a JobSet's second or later Job",
            "meshkit joins the pods of one Job: process ids come from JOB_COMPLETION_INDEX alone.",
            "one replicated Job "
            "(replicas: 1) with completions and parallelism = the process count, or "
            "passing coordinator_address=, num_processes= and process_id= to "
            "meshkit.init().",
        )
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
            raise _bad(
                JOBSET,
                found,
                "JOBSET_NAME is set but REPLICATED_JOB_NAME is not",
                "Index 0's host is <JOBSET_NAME>-<REPLICATED_JOB_NAME>-0-0.<subdomain>.",
                "REPLICATED_JOB_NAME from the pod's annotation "
                "jobset.sigs.k8s.io/replicatedjob-name (the downward API).",
            )
        return f"{jobset}-{rjob}-0-0.{subdomain or jobset}"
    index, hostname = environ["JOB_COMPLETION_INDEX"].strip(), environ.get("HOSTNAME", "")
    job = hostname.removesuffix(f"-{index}") if hostname.endswith(f"-{index}") else ""
    if not job or not subdomain:
        raise _bad(
            INDEXED_JOB,
            f"{found}, HOSTNAME={hostname!r}",
            "index 0's host is unknown: "
            f"{ENV_K8S_SUBDOMAIN} is not set or HOSTNAME is not <job>-<index>",
            "Index 0's host is <job>-0.<subdomain>, the subdomain being the Job's "
            "headless service.",
            f"{ENV_K8S_SUBDOMAIN}=<the service's name>, or "
            f"{ENV_K8S_COORDINATOR_HOST}=<index 0's host>.",
        )
    return f"{job}-0.{subdomain}"


def read_engine(environ: Mapping[str, str], *, jax_detects: str | None = None) -> EngineJoin | None:
    """How this process joins according to an engine's variables; None where none set them.

    Engines are read in this order: JAX_* variables, SkyPilot, JobSet / Indexed Job. `meshkit
    launch`'s variables and arguments to `meshkit.init` are read before this, JAX's own cluster
    detection after.

    Args:
        environ: the environment (normally ``os.environ``).
        jax_detects: the name of JAX's cluster detector that found its environment, if any
            (``"SlurmCluster"``, ``"K8sCluster"``): it decides for ``JAX_COORDINATOR_ADDRESS``
            alone, and for an Indexed Job without a count.

    Raises:
        MeshkitError: an engine's variables in part, or with values that do not fit
            (a count below 1, an id not below the count, an address without a port).

    Example:
        >>> read_engine({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2",
        ...              "JAX_PROCESS_ID": "1"}).process_id
        1
        >>> read_engine({}) is None
        True
    """
    check_agreement(environ)
    return (
        _jax_vars(environ, jax_detects) or _skypilot(environ) or _indexed_job(environ, jax_detects)
    )


def _claims(environ: Mapping[str, str]) -> list[tuple[str, str, str, str]]:
    """(count variable, value, id variable, value) of each source that sets a process count."""
    sources = [
        ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
        (ENV_NUM_PROCESSES, ENV_PROCESS_ID),
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ]
    if all(environ.get(n) for n in STEP_VARS):  # a task of a SLURM job step
        sources.append(("SLURM_NTASKS", "SLURM_PROCID"))
    return [
        (c, environ[c].strip(), i, environ.get(i, "").strip())
        for c, i in sources
        if environ.get(c, "").strip()
    ]


def check_agreement(environ: Mapping[str, str]) -> None:
    """Raise if two variables give different process counts, or ids, for this process.

    ``JAX_NUM_PROCESSES`` is compared with each other source (``MESHKIT_NUM_PROCESSES``,
    ``OMPI_COMM_WORLD_SIZE``, ``SLURM_NTASKS`` of a job step), and ``JAX_PROCESS_ID`` with its
    id. `meshkit launch` inside a SLURM step or an Open MPI job is not compared: there the step's
    tasks are launchers, each starting several processes.

    Example:
        >>> check_agreement({"JAX_NUM_PROCESSES": "2", "MESHKIT_NUM_PROCESSES": "2"})
    """
    claims = _claims(environ)
    if not claims or claims[0][0] != "JAX_NUM_PROCESSES":
        return
    count, n, ident, pid = claims[0]
    for other_count, other_n, other_ident, other_pid in claims[1:]:
        if _int(n) != _int(other_n):
            raise MeshkitError(
                _DISAGREE.format(
                    what="process counts", first=f"{count}={n}", second=f"{other_count}={other_n}"
                )
            )
        if pid and other_pid and _int(pid) != _int(other_pid):
            raise MeshkitError(
                _DISAGREE.format(
                    what="process ids", first=f"{ident}={pid}", second=f"{other_ident}={other_pid}"
                )
            )
