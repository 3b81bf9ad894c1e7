"""meshkit.init: each case in a fresh subprocess, since init changes global JAX state.

The exception: arguments and settings that init refuses are refused before it reads or changes
any state, so those cases run in this test process, after its JAX backends have started (a
refusal that came after init's state checks would read "already started" here, and fail).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import textwrap
import threading
import time
import uuid

import jax
import pytest
from conftest import run_python

import meshkit
from meshkit._src.launch.ports import free_ports, reserve_port
from meshkit._src.runtime import init as _init_module
from meshkit.testing._forks import starter


def run_py(code: str, tmp_path, env: dict[str, str] | None = None, timeout: float = 180):
    """Run code as a script in a clean interpreter (no MESHKIT_* variables unless given).

    Started by conftest's `run_python` (forked under nox, else fresh). The time limit only
    keeps a hung child from holding the suite: importing JAX alone took 50 s and more with two
    copies of the suite and a third test run beside them.
    """
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("MESHKIT_", "SLURM_", "OMPI_"))
    }
    base["JAX_PLATFORMS"] = "cpu"
    base.update(env or {})
    script = tmp_path / f"run_py_{uuid.uuid4().hex[:8]}.py"
    script.write_text(textwrap.dedent(code))
    return run_python([str(script)], base, tmp_path, timeout)


def _refused(monkeypatch, call, env: dict[str, str] | None = None) -> str:
    """The message of ``call``'s refusal in this process, with only ``env`` of meshkit's settings.

    A refusal must leave init's state as it was: nothing joined, nothing recorded.
    """
    for name in list(os.environ):
        if name.startswith(("MESHKIT_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    jax.devices()  # started: a refusal that came after init's state checks would say so instead
    before = _init_module._INFO
    with pytest.raises(meshkit.MeshkitError) as refusal:
        call()
    assert _init_module._INFO is before
    return str(refusal.value)


def test_single_process_is_a_noop_and_idempotent(tmp_path):
    out = run_py(
        """
        import meshkit
        assert meshkit.runtime_info() is None
        info = meshkit.init(cpu_devices=4)
        assert meshkit.init() is info and meshkit.runtime_info() is info
        import jax
        print(info.source, info.num_processes, info.process_id, jax.local_device_count())
        print(info)
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    first, *table = out.stdout.splitlines()
    assert first == "single process 1 0 4"
    assert "reason           no meshkit launch environment and no cluster detected" in table
    assert "cpu devices      4" in table


def test_the_table_names_few_hosts_and_this_processs_host_among_many():
    few = meshkit.Hosts(names=("a", "b"), of_process=(0, 1))
    many = meshkit.Hosts(names=tuple("abcde"), of_process=(0, 1, 2, 3, 4, 4))
    info = _init_module.RuntimeInfo("arguments", "test", 6, 5, "h:1", hosts=few)
    assert "hosts            2 (a: process 0; b: process 1)" in str(info).splitlines()
    info = _init_module.RuntimeInfo("arguments", "test", 6, 5, "h:1", hosts=many)
    assert "hosts            5 (this process on e)" in str(info).splitlines()


def test_cpu_devices_from_environment(tmp_path):
    out = run_py(
        "import meshkit; meshkit.init(); import jax; print(jax.local_device_count())",
        tmp_path,
        env={"MESHKIT_CPU_DEVICES": "3"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_after_backends_started_cannot_change_devices(tmp_path):
    out = run_py(
        """
        import jax.numpy as jnp, meshkit
        jnp.zeros(1)
        meshkit.init()  # nothing to change: fine
        try:
            meshkit.init(cpu_devices=4)
        except meshkit.MeshkitError as e:
            print(e)
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "meshkit.init() was already called" in out.stdout


def test_after_backends_started_is_an_error(tmp_path):
    out = run_py(
        """
        import jax.numpy as jnp, meshkit
        jnp.zeros(1)
        try:
            meshkit.init(cpu_devices=4)
        except meshkit.MeshkitError as e:
            print(e)
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "called after JAX had already started its backends" in out.stdout
    assert "can no longer set 4 CPU devices" in out.stdout
    assert "Consider calling meshkit.init() first thing in your program" in out.stdout


def test_after_backends_started_cannot_join(tmp_path):
    port = free_ports(1)
    env = {"MESHKIT_COORDINATOR": f"127.0.0.1:{port}", "MESHKIT_NUM_PROCESSES": "2",
           "MESHKIT_PROCESS_ID": "1"}  # fmt: skip
    out = run_py(
        """
        import jax, meshkit
        jax.devices()
        try:
            meshkit.init()
        except meshkit.MeshkitError as e:
            print(e)
        """,
        tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "can no longer join a multi-process program "
        f"(MESHKIT_COORDINATOR=127.0.0.1:{port} is set)" in out.stdout
    )


def test_unreachable_coordinator_is_named_in_bounded_time(tmp_path):
    port = free_ports(1)  # nothing listens there
    out = run_py(
        f"""
        import time
        import jax  # imported before the clock starts: meshkit.init would import it
        import meshkit
        start = time.monotonic()
        try:
            meshkit.init(coordinator_address="127.0.0.1:{port}", num_processes=2, process_id=1,
                         timeout=2)
        except meshkit.MeshkitError as e:
            print(e)
        print(f"init took {{time.monotonic() - start:.1f}} s")
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr  # a Python error, not JAX's abort (SIGABRT)
    assert f"could not reach the coordinator at 127.0.0.1:{port}\nwithin 2 s" in out.stdout
    assert "process 1 of 2" in out.stdout
    assert "MESHKIT_INIT_TIMEOUT" in out.stdout
    # Bounded by the 2 s asked for (JAX's own default waits 5 minutes), measured from the call,
    # with JAX imported before it: starting Python and importing JAX took up to 30 s beside a
    # second copy of the suite, and meshkit.init imports JAX (meshkit's face is lazy).
    took = float(re.search(r"init took ([\d.]+) s", out.stdout).group(1))
    assert took < 15, out.stdout


def test_unreachable_coordinator_timeout_from_environment(tmp_path):
    port = free_ports(1)
    env = {"MESHKIT_COORDINATOR": f"127.0.0.1:{port}", "MESHKIT_NUM_PROCESSES": "2",
           "MESHKIT_PROCESS_ID": "1", "MESHKIT_INIT_TIMEOUT": "1.5"}  # fmt: skip
    out = run_py(
        "import meshkit\ntry:\n meshkit.init()\nexcept meshkit.MeshkitError as e:\n print(e)",
        tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert f"127.0.0.1:{port}\nwithin 1.5 s (source: meshkit launch)" in out.stdout


def test_coordinator_port_in_use(tmp_path):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run_py(
            f"""
            import meshkit
            try:
                meshkit.init(coordinator_address="127.0.0.1:{port}", num_processes=2,
                             process_id=0, timeout=2)
            except meshkit.MeshkitError as e:
                print(e)
            """,
            tmp_path,
        )
    assert out.returncode == 0, out.stderr
    assert f"port {port} is already in" in out.stdout
    assert "process 0 must serve the coordinator" in out.stdout


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"MESHKIT_COORDINATOR": "127.0.0.1:1"},
            "MESHKIT_NUM_PROCESSES or MESHKIT_PROCESS_ID is not",
        ),
        ({"MESHKIT_CPU_DEVICES": "four"}, "MESHKIT_CPU_DEVICES='four' is not an integer"),
        ({"MESHKIT_CPU_DEVICES": "0"}, "MESHKIT_CPU_DEVICES must be a positive int; got 0"),
        ({"MESHKIT_INIT_TIMEOUT": "soon"}, "MESHKIT_INIT_TIMEOUT='soon' is not a number"),
        (
            {"MESHKIT_INIT_TIMEOUT": "nan"},
            "timeout must be a finite number > 0 seconds; got nan (from the argument, else "
            "MESHKIT_INIT_TIMEOUT)",
        ),
        (
            {"MESHKIT_FAIL_FAST": "later"},
            "MESHKIT_FAIL_FAST='later' is not one of 1, true, yes, on (on, the default) or 0, "
            "false, no, off (off).",
        ),
        (
            {"MESHKIT_FAIL_FAST_GRACE": "-1"},
            "MESHKIT_FAIL_FAST_GRACE='-1' must be a finite number of seconds >= 0.",
        ),
        (
            {
                "MESHKIT_COORDINATOR": "nohost",
                "MESHKIT_NUM_PROCESSES": "2",
                "MESHKIT_PROCESS_ID": "1",
            },
            "coordinator address 'nohost' is not of the form 'host:port'",
        ),
        (
            {"MESHKIT_LOCAL_DEVICE_IDS": "0;1"},
            "MESHKIT_LOCAL_DEVICE_IDS='0;1' is not a comma-separated",
        ),
    ],
)
def test_bad_environment(monkeypatch, env, expected):
    assert expected in _refused(monkeypatch, meshkit.init, env)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_processes": 2}, "needs coordinator_address='host:port'"),
        ({"coordinator_address": "nohost", "num_processes": 2, "process_id": 1},
         "coordinator address 'nohost' is not of the form 'host:port'"),
        ({"cpu_devices": -1}, "cpu_devices must be a positive int; got -1"),
        ({"timeout": 0}, "timeout must be a finite number > 0 seconds; got 0"),
        ({"timeout": float("nan")}, "timeout must be a finite number > 0 seconds; got nan"),
        ({"timeout": float("inf")}, "timeout must be a finite number > 0 seconds; got inf"),
        ({"timeout": "10"}, "timeout must be a finite number > 0 seconds; got '10'"),
        ({"num_processes": 0}, "num_processes must be a positive int; got 0"),
        ({"process_id": -1}, "process_id must be an int >= 0; got -1"),
        ({"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 2},
         "process_id=2 is not one of the 2 processes (ids 0 to 1).\nConsider process ids from 0"),
    ],
    ids=lambda v: ", ".join(f"{k}={x!r}" for k, x in v.items()) if isinstance(v, dict) else v,
)  # fmt: skip
def test_bad_arguments(monkeypatch, kwargs, expected):
    assert expected in _refused(monkeypatch, lambda: meshkit.init(**kwargs))


def test_arguments_that_contradict_the_launcher_are_named(tmp_path):
    out = run_py(
        "import meshkit\ntry:\n meshkit.init(coordinator_address='127.0.0.1:1', "
        "num_processes=3, process_id=0)\nexcept meshkit.MeshkitError as e:\n print(e)",
        tmp_path,
        env={
            "MESHKIT_COORDINATOR": "127.0.0.1:1",
            "MESHKIT_NUM_PROCESSES": "2",
            "MESHKIT_PROCESS_ID": "0",
        },
    )
    assert out.returncode == 0, out.stderr
    assert (
        "meshkit.init(num_processes=3, process_id=0): this process was started by meshkit launch "
        "as process 0 of 2 (MESHKIT_NUM_PROCESSES=2, MESHKIT_PROCESS_ID=0)" in out.stdout
    ), out.stdout
    assert "or meshkit launch -n 3." in out.stdout, out.stdout


def test_jax_cluster_detection_is_used(tmp_path):
    """A SLURM-like environment (one task) goes through JAX's SlurmCluster detector."""
    with reserve_port() as held:  # held as meshkit launch holds it: no other run may pick it
        port = held.getsockname()[1]
        env = {
            "JAX_COORDINATOR_PORT": str(port),  # honoured, as JAX itself does
            "SLURM_JOB_ID": str(1000 + port % 900),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "1",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
        }
        out = run_py(
            """
            import meshkit
            info = meshkit.init(timeout=20)
            print(info.source, info.cluster, info.num_processes, info.process_id)
            print(info.coordinator_address)
            """,
            tmp_path,
            env=env,
        )
    assert out.returncode == 0, out.stderr
    first, address = out.stdout.splitlines()[:2]
    assert first == "cluster SlurmCluster 1 0"
    assert address == f"localhost:{port}"


def test_warns_when_a_launcher_says_several_processes_but_none_is_detected(tmp_path):
    out = run_py(
        "import meshkit; info = meshkit.init(); print(info.num_processes)",
        tmp_path,
        env={"OMPI_COMM_WORLD_SIZE": "4"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert (
        "RuntimeWarning: meshkit.init(): OMPI_COMM_WORLD_SIZE=4 says this program runs as 4"
        in out.stderr
    )
    assert "so this process runs alone (process 0 of 1)" in out.stderr


# ---- fail-fast: an uncaught exception ends its process, after its exit handlers ----------------

_FAILS_WITH_HANDLER = """
import atexit, sys, time
import jax
import meshkit

meshkit.init()
me = jax.process_index()


@atexit.register
def handler():
    print(f"exit handler of rank {me} ran", flush=True)
    if sys.argv[1] == "slow":
        time.sleep(600)


if me == 1:
    raise RuntimeError("planted")
time.sleep(120)  # rank 0 waits: only the launcher's fail-fast ends it
"""


@pytest.mark.multiprocess
@pytest.mark.waits  # the slow case waits out its 3 s grace
@pytest.mark.parametrize(
    ("handler", "env", "within"),
    [("quick", {}, 25), ("slow", {"MESHKIT_FAIL_FAST_GRACE": "3"}, 30)],
)
def test_an_uncaught_exception_runs_exit_handlers_then_exits(tmp_path, handler, env, within):
    import meshkit

    script = tmp_path / "fails.py"
    script.write_text(_FAILS_WITH_HANDLER)
    start = time.monotonic()
    result = meshkit.launch(
        [str(script), handler],
        num_processes=2,
        devices_per_process=1,
        platform="cpu",
        timeout=100,
        stream=False,
        env={"MESHKIT_INIT_TIMEOUT": "60", **env},
        starter=starter(None, "tests/test_runtime.py"),
    )
    took = time.monotonic() - start
    rank1 = result.ranks[1]
    assert "--- root cause: rank 1 ---" in result.report, result.report
    assert rank1.returncode == 1, result.report
    assert "RuntimeError: planted" in rank1.stderr
    assert "running exit handlers (at most" in rank1.stderr
    assert "exit handler of rank 1 ran" in rank1.stdout
    if handler == "slow":
        assert "meshkit: exit handlers still running after 3 s; exiting now" in rank1.stderr
    assert took < within, (took, result.report)


# Two processes x 4 CPU devices, a global array and a jitted step whose sum is a collective.
_STEP = """
import os, sys, time
import jax, numpy as np
import meshkit
from jax.sharding import NamedSharding, PartitionSpec as P

meshkit.init()
mesh = meshkit.make_mesh({"data": -1})
x = jax.make_array_from_callback(
    (8, 4), NamedSharding(mesh, P("data")), lambda idx: np.ones((8, 4))[idx]
)
step = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
float(step(x))
"""

_COORDINATOR_FAILS = (
    _STEP
    + """
if jax.process_index() == 0:
    time.sleep(1)
    raise RuntimeError("planted in the coordinator")
float(step(x))  # process 1 waits in a raw collective that process 0 never joins
"""
)

_TERMINATED = (
    _STEP
    + """
if jax.process_index() == 0:
    time.sleep(120)  # process 1 waits for it in the collective below
open(sys.argv[1], "w").write(str(os.getpid()))
float(step(x))  # SIGTERM arrives while this process waits here, in C
"""
)


def _launch_script(tmp_path, text, args, extra_env=None):
    import meshkit

    script = tmp_path / "prog.py"
    script.write_text(text)
    return meshkit.launch(
        [str(script), *args], num_processes=2, devices_per_process=4, platform="cpu",
        timeout=100, stream=False, env={"MESHKIT_INIT_TIMEOUT": "60", **(extra_env or {})},
        starter=starter(None, "tests/test_runtime.py"),
    )  # fmt: skip


@pytest.mark.multiprocess
def test_the_coordinators_failure_reaches_the_others_as_meshkits_error(tmp_path):
    start = time.monotonic()
    result = _launch_script(tmp_path, _COORDINATOR_FAILS, [])
    assert time.monotonic() - start < 40, result.report
    rank1 = result.ranks[1]
    # Not gRPC's "Stream removed" nor the coordination service's abort: meshkit's words.
    assert rank1.stderr.startswith(
        "meshkit: process 0 failed: RuntimeError: planted in the coordinator\n"
        "Process 1 stops too (status 1)"
    ), rank1.stderr
    assert rank1.returncode == 1
    assert "--- root cause: rank 0 ---" in result.report, result.report
    assert "The evidence points to rank 0: it failed first, and told the others" in result.report


@pytest.mark.multiprocess
def test_sigterm_to_a_rank_waiting_in_a_collective_preempts_every_rank_at_the_deadline(tmp_path):
    # SIGTERM is a preemption notice, not a failure: rank 1, waiting in C, takes it from its
    # wake-up byte and tells rank 0 (which never checks for one); both end at the deadline.
    import os

    pid_file = tmp_path / "rank1.pid"
    results = []
    launcher = threading.Thread(
        target=lambda: results.append(
            _launch_script(tmp_path, _TERMINATED, [str(pid_file)], {"MESHKIT_PREEMPT_GRACE": "2"})
        )
    )
    start = time.monotonic()
    launcher.start()
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() - start < 60, "rank 1 never got to its collective"
        time.sleep(0.1)
    time.sleep(1.0)  # inside the collective by now
    os.kill(int(pid_file.read_text()), signal.SIGTERM)
    sent = time.monotonic()
    launcher.join(60)
    assert not launcher.is_alive()
    (result,) = results
    assert 2 <= time.monotonic() - sent < 30, result.report
    assert [r.returncode for r in result.ranks] == [143, 143], result.report
    assert result.returncode == 143, result.report
    assert result.preempted
    assert result.first_failure is None, result.report
    assert result.report.startswith(
        "meshkit launch: preempted: the notice (SIGTERM to rank 1) reached every rank.\n"
        "  rank 0: the grace after the notice ran out\n"
        "  rank 1: the grace after the notice ran out\n"
    ), result.report
    # The deadline is 2 s after the notice; the message says when it was written (2.0-2.2 s).
    assert re.search(
        r"meshkit: preempted \(SIGTERM 2\.\d s ago\): the program did not save",
        result.ranks[1].stderr,
    ), result.ranks[1].stderr
    assert "meshkit: preempted (process 1 " in result.ranks[0].stderr


_HOOKS = """
import signal, sys, threading
import meshkit

meshkit.init()
watch = any(t.name == "meshkit-service" for t in threading.enumerate())
ours = sys.excepthook is not sys.__excepthook__
term = signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
print("hooks", ours, term, watch)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MESHKIT_FAIL_FAST": "1"}, "True True True"),
        ({"MESHKIT_FAIL_FAST": "0"}, "False False True"),  # the stall samples still run
        (
            {"MESHKIT_FAIL_FAST": "0", "MESHKIT_STALL_TIMEOUT": "0", "MESHKIT_STEP_WINDOW": "0"},
            "False False False",
        ),
    ],
    ids=["on", "fail-fast off", "all off"],
)
def test_fail_fast_can_be_turned_off(tmp_path, env, expected):
    result = _launch_script(tmp_path, _HOOKS, [], extra_env=env)
    assert result.returncode == 0, result.report
    assert [r.stdout.strip().splitlines()[-1] for r in result.ranks] == [f"hooks {expected}"] * 2
