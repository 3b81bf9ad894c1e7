"""A one-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd.

`start` writes a configuration into a fresh directory (a munge key, slurm.conf, state, spool
and log directories), starts the three daemons in the foreground as children of the test
process, and waits until the node is idle. `LocalSlurm.stop` cancels what still runs, stops
the daemons by pid, and returns the processes that outlived them (found by the
``MESHKIT_TEST_MARKER`` every daemon and client carries in its environment). The daemons also
get SIGTERM from the kernel if the test process dies first (``setpriv --pdeathsig``).

Made for a container: no cgroups (``proctrack/linuxproc``, ``task/none``), no accounting, no
systemd; the node is ``hostname -s`` at 127.0.0.1 with the CPUs ``slurmd -C`` reports (at least
2: one per task of the tests' 2-task steps, with ``config_overrides`` where fewer exist). Ports
are picked free for each cluster, and the first job id is drawn so that JAX's coordinator ports
for the first jobs (61440 + job id mod 4096) are free too: two clusters on one machine do not
collide. The daemons run as root (slurmd starts tasks as the submitting user).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from conftest import processes_with_marker

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "scancel", "squeue", "scontrol")
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
# JAX's SLURM detector serves the coordinator at 61440 + job id mod 4096.
_JAX_PORT_BASE, _JAX_PORTS = 61440, 4096
_JOBS_WITH_FREE_PORTS = 32


def which(program: str) -> str | None:
    return shutil.which(program, path=_SEARCH)


def unavailable() -> str | None:
    """Why no local cluster can start here, or None."""
    missing = [p for p in (*DAEMONS, *CLIENTS) if which(p) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} not found; Debian: apt-get install "
            "slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons as root (slurmd starts tasks as users)"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def _first_job_id() -> int:
    """A first job id whose next jobs' JAX coordinator ports are free now."""
    for _ in range(100):
        first = random.randrange(1000, 1_000_000)
        ports = [_JAX_PORT_BASE + (first + k) % _JAX_PORTS for k in range(_JOBS_WITH_FREE_PORTS)]
        if all(_port_free(p) for p in ports):
            return first
    raise RuntimeError("no run of free ports in 61440-65535 for JAX's SLURM coordinators")


def _node_line(node: str) -> tuple[str, bool]:
    """The node's slurm.conf line from ``slurmd -C`` (its hardware); True if CPUs were raised."""
    slurmd = which("slurmd")
    assert slurmd is not None
    out = subprocess.run(
        [slurmd, "-C"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    fields = dict(f.split("=", 1) for f in out.splitlines()[0].split())
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    hw = {k: fields[k] for k in keep if k in fields}
    if int(hw.get("CPUs", "1")) >= 2:
        return f"NodeName={node} NodeAddr=127.0.0.1 " + " ".join(
            f"{k}={v}" for k, v in hw.items()
        ), False
    return f"NodeName={node} NodeAddr=127.0.0.1 CPUs=2", True


# Job states after which nothing of the job runs any more (COMPLETING still cleans up).
_ENDED = frozenset(
    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
     "BOOT_FAIL", "DEADLINE")
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class BatchJob:
    """A batch job that ended: its id, final state, and exit status (and signal) of its script."""

    id: int
    state: str
    status: int
    signal: int


@dataclasses.dataclass
class LocalSlurm:
    """A running local cluster (see the module docstring)."""

    root: Path
    node: str
    conf: Path
    marker: str
    first_job_id: int
    daemons: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        """An environment for SLURM's clients: this cluster's SLURM_CONF, no outer job's variables.

        srun and sbatch pass it on to the tasks (their default ``--export=ALL``).
        """
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "MESHKIT_"))
        }
        env["SLURM_CONF"] = str(self.conf)
        env["MESHKIT_TEST_MARKER"] = self.marker
        env.update(extra)
        return env

    def run(
        self, args: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd=None
    ) -> subprocess.CompletedProcess[str]:
        """Run a client (srun, sbatch ...) within ``timeout`` s; its jobs are cancelled after it.

        Raises:
            subprocess.TimeoutExpired: with what it printed, after killing it and its jobs.
        """
        proc = subprocess.Popen(
            args,
            env=env or self.env(),
            cwd=cwd or self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            self.cancel_all()
            raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err) from None
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    def sbatch(
        self, args: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd=None
    ) -> BatchJob:
        """Submit a batch job and wait (bounded) until it ends.

        ``sbatch --wait`` would do, but it polls after 2, 10 and 42 s (measured: a 16 s job
        returned after 42 s); this asks ``scontrol`` every 0.25 s.

        Raises:
            RuntimeError: sbatch refused the job.
            TimeoutError: the job did not end within ``timeout`` s (it is cancelled first).
        """
        return self.wait(self.submit(args, env=env, cwd=cwd), timeout=timeout)

    def submit(self, args: list[str], *, env: dict[str, str] | None = None, cwd=None) -> int:
        """Submit a batch job; its id (`wait` waits for its end).

        Raises:
            RuntimeError: sbatch refused the job.
        """
        submitted = self.run(
            [self.client("sbatch"), "--parsable", *args], timeout=60, env=env, cwd=cwd
        )
        if submitted.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {submitted.stderr}")
        return int(submitted.stdout.strip().split(";")[0])

    def wait(self, job: int, *, timeout: float) -> BatchJob:
        """Wait (bounded) until batch job ``job`` ends, asking ``scontrol`` every 0.25 s.

        Raises:
            TimeoutError: the job did not end within ``timeout`` s (it is cancelled first).
        """
        deadline = time.monotonic() + timeout
        while True:
            fields = self._job_fields(job)
            state = fields.get("JobState", "")
            if state in _ENDED:
                status, _, signum = fields.get("ExitCode", "-1:0").partition(":")
                return BatchJob(job, state, int(status), int(signum or 0))
            if time.monotonic() > deadline:
                self.cancel_all()
                raise TimeoutError(f"batch job {job} still {state} after {timeout:g} s")
            time.sleep(0.25)

    def _job_fields(self, job: int) -> dict[str, str]:
        try:
            out = subprocess.run(
                [self.client("scontrol"), "show", "job", "-o", str(job)],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            ).stdout
        except subprocess.TimeoutExpired:
            return {}
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def client(self, name: str) -> str:
        path = which(name)
        assert path is not None, name
        return path

    def cancel_all(self) -> None:
        """Cancel every job of this cluster, and wait (bounded) until none is left."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(
                [self.client("scancel"), "--user", str(os.geteuid()), "--full"],
                env=self.env(),
                capture_output=True,
                timeout=30,
                check=False,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                jobs = subprocess.run(
                    [self.client("squeue"), "-h", "-o", "%i %T"],
                    env=self.env(),
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                ).stdout.strip()
            except subprocess.SubprocessError:
                jobs = "squeue timed out"
            if not jobs:
                return
            time.sleep(0.5)

    def logs(self, lines: int = 30) -> str:
        """The last lines of each daemon's log, for a failure message."""
        parts = []
        for name in DAEMONS:
            path = self.root / "log" / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            parts.append(
                f"--- {path} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])
            )
        return "\n".join(parts)

    def stop(self) -> list[str]:
        """Stop everything this cluster started; describe the processes that outlived it."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.cancel_all()
        for name in reversed(DAEMONS):  # slurmd, slurmctld, then munged that both use
            proc = self.daemons.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        left = []
        for pid in processes_with_marker(self.marker):
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                left.append(f"{pid}: {cmd.strip()}")
                os.kill(pid, signal.SIGKILL)
        if not left:
            shutil.rmtree(self.root, ignore_errors=True)
        return left


def _daemon(cluster: LocalSlurm, name: str, args: list[str]) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "MESHKIT_TEST_MARKER": cluster.marker,
        "SLURM_CONF": str(cluster.conf),
    }
    # SIGTERM when the test process dies, even by SIGKILL (util-linux's setpriv, on Linux).
    setpriv = which("setpriv")
    die_with_parent = [setpriv, "--pdeathsig", "TERM"] if setpriv else []
    with open(cluster.root / "log" / f"{name}.log", "wb") as log:
        cluster.daemons[name] = subprocess.Popen(
            [*die_with_parent, cluster.client(name), *args],
            env=env,
            cwd=cluster.root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def start(timeout: float = 90) -> LocalSlurm:
    """Start a one-node cluster; it is idle and ready for srun and sbatch when this returns.

    Raises:
        RuntimeError: a daemon exited, or the node was not idle within ``timeout`` s (with the
            daemons' logs); what started is stopped first.
    """
    # A directory of its own under /tmp: munged wants its socket's directory (and those above
    # it) searchable by all, and a unix socket's path short; pytest's tmp_path is neither.
    root = Path(tempfile.mkdtemp(prefix="meshkit-slurm-"))
    root.chmod(0o755)
    for sub, mode in (("munge", 0o700), ("run", 0o755), ("state", 0o755), ("spool", 0o755),
                      ("log", 0o755), ("jobs", 0o755)):  # fmt: skip
        (root / sub).mkdir(mode=mode)
        (root / sub).chmod(mode)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)

    node = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(node)
    except OSError as e:
        raise RuntimeError(
            f"this host's name {node!r} does not resolve ({e}); JAX's SLURM coordinator address "
            "is the node's name"
        ) from None
    node_line, raised = _node_line(node)
    cluster = LocalSlurm(
        root=root,
        node=node,
        conf=root / "slurm.conf",
        marker=uuid.uuid4().hex,
        first_job_id=_first_job_id(),
    )
    socket_path = root / "run" / "munge.socket"
    user = "root"
    cluster.conf.write_text(
        "\n".join(
            [
                "# Written by tests/slurm_cluster.py: one node on localhost, in a container.",
                "ClusterName=meshkit-test",
                f"SlurmctldHost={node}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                f"SlurmUser={user}",
                f"SlurmdUser={user}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
                # No cgroups in a container: track a job's processes through /proc, bind nothing.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SwitchType=switch/none",
                "MpiDefault=none",
                "MailProg=/bin/true",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "ReturnToService=2",
                "KillWait=5",  # seconds from SIGTERM to SIGKILL when a job ends or is cancelled
                f"FirstJobId={cluster.first_job_id}",
                *(["SlurmdParameters=config_overrides"] if raised else []),
                node_line + " State=UNKNOWN",
                f"PartitionName=test Nodes={node} Default=YES MaxTime=10 State=UP",
                "",
            ]
        )
    )
    try:
        _daemon(
            cluster,
            "munged",
            [
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={root / 'run' / 'munged.pid'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
                "--num-threads=4",
            ],
        )
        _wait_for(cluster, socket_path.exists, "munged's socket", timeout)
        _daemon(cluster, "slurmctld", ["-D", "-c", "-i", "-f", str(cluster.conf)])
        _daemon(cluster, "slurmd", ["-D", "-N", node, "-f", str(cluster.conf)])
        _wait_for(cluster, lambda: _node_state(cluster) == "idle", "an idle node", timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _node_state(cluster: LocalSlurm) -> str:
    try:
        out = subprocess.run(
            [cluster.client("sinfo"), "-h", "-n", cluster.node, "-o", "%t"],
            env=cluster.env(),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    return out.stdout.strip()


def _wait_for(cluster: LocalSlurm, ready, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        ended = {n: p.returncode for n, p in cluster.daemons.items() if p.poll() is not None}
        if ended or time.monotonic() > deadline:
            why = f"daemons exited: {ended}" if ended else f"not within {timeout:g} s"
            raise RuntimeError(f"local SLURM cluster: waiting for {what}: {why}\n{cluster.logs()}")
        time.sleep(0.2)
