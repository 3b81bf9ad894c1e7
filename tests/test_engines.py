"""Other engines' environments (Kubeflow's JAX_*, SkyPilot, JobSet), and JAX's join options.

The reading is a pure function of an environment mapping (`read_engine`): its cases and
properties run here, in this process. `meshkit.init`'s refusals of a bad environment or option
come before it reads or changes any state, so they run in this process too (as in
test_runtime). The joins themselves, two real processes per engine, are in
test_engines_multiprocess.
"""

from __future__ import annotations

import inspect
import os
import re

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshkit
from meshkit._src.core.env import DEFAULT_PORT, EngineJoin, check_agreement, read_engine
from meshkit._src.runtime import init as _init_module

JAX3 = {"JAX_COORDINATOR_ADDRESS": "trainer-node-0-0.trainer:6666", "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1"}  # fmt: skip
SKY = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
       "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8\n"}  # fmt: skip
JOBSET = {"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "workers",
          "JOB_INDEX": "0", "MESHKIT_NUM_PROCESSES": "2"}  # fmt: skip


# ---- what each engine's environment says ------------------------------------------------------


def test_kubeflow_trainer_jax_variables():
    assert read_engine(JAX3) == EngineJoin(
        "JAX_* variables", 2, 1, "trainer-node-0-0.trainer:6666",
        "JAX_COORDINATOR_ADDRESS='trainer-node-0-0.trainer:6666', JAX_NUM_PROCESSES='2', "
        "JAX_PROCESS_ID='1'",
    )  # fmt: skip


def test_kubeflow_trainer_pod_also_has_its_jobset_variables():
    # Trainer's runtime is a JobSet: its pods carry JOB_COMPLETION_INDEX too; JAX_* decide.
    join = read_engine({**JAX3, "JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "trainer"})
    assert (join.engine, join.process_id) == ("JAX_* variables", 1)


def test_jax_coordinator_address_alone_stays_jax_s_override_of_a_detected_cluster():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1234"}
    assert read_engine(env, jax_detects="SlurmCluster") is None


def test_skypilot_one_process_per_node_coordinator_on_the_first_ip():
    join = read_engine(SKY)
    assert (join.engine, join.num_processes, join.process_id) == ("SkyPilot", 2, 1)
    assert join.coordinator_address == f"10.0.0.7:{DEFAULT_PORT}"
    assert read_engine({**SKY, "JAX_COORDINATOR_PORT": "7000"}).coordinator_address == (
        "10.0.0.7:7000"
    )


def test_skypilot_single_node_is_one_process():
    env = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_IPS": "10.0.0.7"}
    assert read_engine(env) == EngineJoin("SkyPilot", 1, 0, None, read_engine(env).found)


def test_skypilot_ipv6_head_is_bracketed():
    env = {**SKY, "SKYPILOT_NODE_IPS": "fd00::1\nfd00::2"}
    assert read_engine(env).coordinator_address == f"[fd00::1]:{DEFAULT_PORT}"


def test_jobset_coordinator_is_index_zero_of_the_first_job():
    join = read_engine(JOBSET)
    assert (join.engine, join.num_processes, join.process_id) == ("JobSet", 2, 1)
    assert join.coordinator_address == f"train-workers-0-0.train:{DEFAULT_PORT}"
    env = {**JOBSET, "MESHKIT_K8S_SUBDOMAIN": "net", "JAX_COORDINATOR_PORT": "1234"}
    assert read_engine(env).coordinator_address == "train-workers-0-0.net:1234"


def test_indexed_job_coordinator_from_hostname_and_subdomain():
    env = {"JOB_COMPLETION_INDEX": "3", "HOSTNAME": "sim-3", "MESHKIT_K8S_SUBDOMAIN": "sims",
           "MESHKIT_NUM_PROCESSES": "4"}  # fmt: skip
    join = read_engine(env)
    assert (join.engine, join.process_id, join.coordinator_address) == (
        "Indexed Job", 3, f"sim-0.sims:{DEFAULT_PORT}",
    )  # fmt: skip


def test_indexed_job_without_a_count_runs_alone():
    # Indexed Jobs also run independent tasks; JAX's own K8s detection may ask the API.
    assert read_engine({"JOB_COMPLETION_INDEX": "2"}) is None
    env = {"JOB_COMPLETION_INDEX": "2", "JOBSET_NAME": "train"}
    assert read_engine(env, jax_detects="K8sCluster") is None


def test_no_engine():
    assert read_engine({"HOME": "/root", "PATH": "/bin"}) is None


# ---- partial and contradictory environments ---------------------------------------------------


@pytest.mark.parametrize(
    ("env", "parts"),
    [
        (
            {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"},
            [
                "meshkit.init(): the environment sets JAX_COORDINATOR_ADDRESS='10.0.0.1:1234' "
                "but not JAX_NUM_PROCESSES and JAX_PROCESS_ID",
                "Kubeflow Trainer's JAX runtime sets JAX_COORDINATOR_ADDRESS, "
                "JAX_NUM_PROCESSES, JAX_PROCESS_ID together",
                "would run alone as process 0 of 1",
                "Consider setting JAX_NUM_PROCESSES and JAX_PROCESS_ID too, or unsetting "
                "JAX_COORDINATOR_ADDRESS",
            ],
        ),
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            ["sets JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='0' but not JAX_COORDINATOR_ADDRESS"],
        ),
        (
            {**JAX3, "JAX_PROCESS_ID": "2"},
            [
                "meshkit.init(): JAX_PROCESS_ID='2' is not a process id below "
                "JAX_NUM_PROCESSES=2 (JAX_* variables: ",
                "Process ids run from 0 to 1",
                "Consider giving each process its own id from 0 to 1",
            ],
        ),
        (
            {**JAX3, "JAX_NUM_PROCESSES": "0"},
            ["JAX_NUM_PROCESSES='0' is not a process count >= 1"],
        ),
        (
            {**JAX3, "JAX_COORDINATOR_ADDRESS": "trainer-node-0-0"},
            ["JAX_COORDINATOR_ADDRESS='trainer-node-0-0' is not of the form 'host:port'"],
        ),
        (
            {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2"},
            ["sets SKYPILOT_NODE_RANK='0', SKYPILOT_NUM_NODES='2' but not SKYPILOT_NODE_IPS",
             "SkyPilot sets SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NODE_IPS together"],
        ),
        (
            {**SKY, "SKYPILOT_NODE_RANK": "2"},
            ["SKYPILOT_NODE_RANK='2' is not a process id below SKYPILOT_NUM_NODES=2 (SkyPilot: "],
        ),
        (
            {**SKY, "SKYPILOT_NUM_NODES": "3"},
            ["SKYPILOT_NODE_IPS lists 2 IPs for SKYPILOT_NUM_NODES=3 nodes",
             "Consider running the program from the task's run commands"],
        ),
        (
            {**SKY, "JAX_COORDINATOR_PORT": "http"},
            ["JAX_COORDINATOR_PORT='http' is not a port"],
        ),
        (
            {k: v for k, v in JOBSET.items() if k != "MESHKIT_NUM_PROCESSES"},
            [
                "meshkit.init(): this process is index 1 of a JobSet (JOB_COMPLETION_INDEX='1', "
                "JOBSET_NAME='train'",
                "no variable gives the\nnumber of processes",
                "Consider setting MESHKIT_NUM_PROCESSES=<completions> in the pod template",
            ],
        ),
        (
            {**JOBSET, "JOB_COMPLETION_INDEX": "2"},
            ["JOB_COMPLETION_INDEX='2' is not a process id below MESHKIT_NUM_PROCESSES=2"],
        ),
        (
            {**JOBSET, "JOB_INDEX": "1"},
            ["JOB_INDEX='1': this pod belongs to a JobSet's second or later Job",
             "Consider one replicated Job (replicas: 1)"],
        ),
        (
            {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "sim-1", "MESHKIT_NUM_PROCESSES": "2"},
            ["index 0's host is unknown: MESHKIT_K8S_SUBDOMAIN is not set",
             "Consider MESHKIT_K8S_SUBDOMAIN=<the service's name>"],
        ),
        (
            {**JAX3, "MESHKIT_NUM_PROCESSES": "3"},
            [
                "meshkit.init(): the environment gives this process two different process "
                "counts: JAX_NUM_PROCESSES=2 but MESHKIT_NUM_PROCESSES=3.",
                "would wait for ones that never come",
                "Consider setting one of them only, or the same value in both",
            ],
        ),
        (
            {**JAX3, "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"},
            ["two different process counts: JAX_NUM_PROCESSES=2 but SLURM_NTASKS=4."],
        ),
        (
            {**JAX3, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
            ["two different process ids: JAX_PROCESS_ID=1 but OMPI_COMM_WORLD_RANK=0."],
        ),
    ],
    ids=lambda v: ",".join(sorted(v)) if isinstance(v, dict) else None,
)  # fmt: skip
def test_partial_or_contradictory_environment_is_named(env, parts):
    with pytest.raises(meshkit.MeshkitError) as refusal:
        check_agreement(env) or read_engine(env)  # as meshkit.init reads them
    for part in parts:
        assert part in str(refusal.value), str(refusal.value)


def test_launch_in_a_slurm_step_is_not_a_contradiction():
    # The step's tasks are launchers, each starting several ranks: counts differ on purpose.
    check_agreement({"MESHKIT_NUM_PROCESSES": "8", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2",
                     "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0"})  # fmt: skip


# ---- properties ------------------------------------------------------------------------------

counts_and_ids = st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1)))


@given(counts_and_ids, st.integers(1, 65535))
def test_jax_variables_round_trip(n_pid, port):
    n, pid = n_pid
    env = {"JAX_COORDINATOR_ADDRESS": f"h0:{port}", "JAX_NUM_PROCESSES": str(n),
           "JAX_PROCESS_ID": str(pid)}  # fmt: skip
    join = read_engine(env)
    assert (join.num_processes, join.process_id) == (n, pid)
    assert join.coordinator_address == (f"h0:{port}" if n > 1 else None)


@given(counts_and_ids, st.integers(1, 65535))
def test_every_skypilot_node_names_the_same_coordinator(n_pid, port):
    n, rank = n_pid
    ips = "\n".join(f"10.1.{i // 250}.{i % 250 + 1}" for i in range(n))
    joins = [
        read_engine({"SKYPILOT_NODE_RANK": str(r), "SKYPILOT_NUM_NODES": str(n),
                     "SKYPILOT_NODE_IPS": ips, "JAX_COORDINATOR_PORT": str(port)})
        for r in {0, rank}
    ]  # fmt: skip
    assert {j.coordinator_address for j in joins} == {f"10.1.0.1:{port}" if n > 1 else None}
    assert sorted(j.process_id for j in joins) == sorted({0, rank})


@given(st.integers(1, 64), st.integers(0, 200))
def test_an_index_outside_the_count_is_always_an_error(n, index):
    env = {**JOBSET, "MESHKIT_NUM_PROCESSES": str(n), "JOB_COMPLETION_INDEX": str(index)}
    if index < n:
        assert read_engine(env).process_id == (index if n > 1 else 0)
    else:
        with pytest.raises(meshkit.MeshkitError, match="is not a process id below"):
            read_engine(env)


# ---- meshkit.init refuses before it reads or changes state ------------------------------------


def _refused(monkeypatch, call, env) -> str:
    for name in list(os.environ):
        if name.startswith(("MESHKIT_", "SLURM_", "OMPI_", "JAX_", "SKYPILOT_", "JOB")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    jax.devices()  # started: a refusal after init's state checks would say so instead
    before = _init_module._INFO
    with pytest.raises(meshkit.MeshkitError) as refusal:
        call()
    assert _init_module._INFO is before
    return str(refusal.value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}, "but not JAX_NUM_PROCESSES and JAX_PROCESS_ID"),
        ({**JAX3, "MESHKIT_COORDINATOR": "127.0.0.1:2", "MESHKIT_NUM_PROCESSES": "4",
          "MESHKIT_PROCESS_ID": "1"},
         "JAX_NUM_PROCESSES=2 but MESHKIT_NUM_PROCESSES=4"),
        ({"MESHKIT_HEARTBEAT_TIMEOUT": "soon"}, "MESHKIT_HEARTBEAT_TIMEOUT='soon' is not an integer"),
        ({"MESHKIT_SHUTDOWN_TIMEOUT": "0"},
         "shutdown_timeout must be a whole number of seconds >= 1; got 0 (from the environment "
         "variable MESHKIT_SHUTDOWN_TIMEOUT)"),
    ],
    ids=["jax-partial", "jax-vs-launch", "heartbeat-env", "shutdown-env"],
)  # fmt: skip
def test_init_refuses_a_bad_environment(monkeypatch, env, expected):
    assert expected in _refused(monkeypatch, meshkit.init, env)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"heartbeat_timeout": 0}, "heartbeat_timeout must be a whole number of seconds >= 1; "
         "got 0.\nJAX's jax.distributed.initialize takes it as heartbeat_timeout_seconds"),
        ({"heartbeat_timeout": 1.5}, "heartbeat_timeout must be a whole number of seconds >= 1; "
         "got 1.5"),
        ({"shutdown_timeout": True}, "shutdown_timeout must be a whole number of seconds >= 1; "
         "got True"),
    ],
)  # fmt: skip
def test_init_refuses_bad_options(monkeypatch, kwargs, expected):
    assert expected in _refused(monkeypatch, lambda: meshkit.init(**kwargs), {})


def test_options_come_from_arguments_else_environment(monkeypatch):
    monkeypatch.setenv("MESHKIT_HEARTBEAT_TIMEOUT", "40")
    monkeypatch.setenv("MESHKIT_SHUTDOWN_TIMEOUT", "50")
    assert _init_module.distributed_options(heartbeat_timeout=30) == {
        "heartbeat_timeout_seconds": 30, "shutdown_timeout_seconds": 50,
    }  # fmt: skip
    monkeypatch.delenv("MESHKIT_HEARTBEAT_TIMEOUT")
    monkeypatch.delenv("MESHKIT_SHUTDOWN_TIMEOUT")
    assert _init_module.distributed_options() == {}


def test_the_installed_jax_takes_every_option():
    params = inspect.signature(jax.distributed.initialize).parameters
    for parameter in _init_module.DISTRIBUTED_OPTIONS:
        assert parameter in params
    assert _init_module.INITIALIZATION in params
    _init_module.distributed_options(heartbeat_timeout=5, shutdown_timeout=5)


def test_a_jax_without_the_option_is_named_with_the_versions_that_have_it(monkeypatch):
    def old_initialize(
        coordinator_address=None,
        num_processes=None,
        process_id=None,
        local_device_ids=None,
        initialization_timeout=300,
    ):
        raise AssertionError("never called")  # fmt: skip

    monkeypatch.setenv("MESHKIT_SHUTDOWN_TIMEOUT", "9")
    monkeypatch.setattr(jax.distributed, "initialize", old_initialize)
    monkeypatch.setattr(jax, "__version__", "0.4.1")
    with pytest.raises(meshkit.MeshkitError) as refusal:
        _init_module.distributed_options()
    text = str(refusal.value)
    assert text.startswith(
        "meshkit.init(shutdown_timeout=...): the running JAX 0.4.1 has no "
        "shutdown_timeout_seconds parameter in\njax.distributed.initialize, so it cannot be "
        "passed (from the environment variable MESHKIT_SHUTDOWN_TIMEOUT).\n"
        "JAX 0.10.2 and 0.12 have it."
    ), text
    assert re.search(r"Consider installing one of those JAX versions, or leaving "
                     r"shutdown_timeout unset", text.replace("\n", " "))  # fmt: skip


# ---- meshkit launch's flags -----------------------------------------------------------------


def test_launch_flags_set_the_ranks_variables():
    from meshkit.cli import _join_options, _parser

    args = _parser().parse_args(
        ["launch", "--init-timeout", "90", "--heartbeat-timeout", "30", "--shutdown-timeout",
         "60", "prog.py"]
    )  # fmt: skip
    assert _join_options(args) == {
        "MESHKIT_INIT_TIMEOUT": "90.0",
        "MESHKIT_HEARTBEAT_TIMEOUT": "30",
        "MESHKIT_SHUTDOWN_TIMEOUT": "60",
    }
    assert _join_options(_parser().parse_args(["launch", "prog.py"])) == {}


def test_a_wrapper_that_passes_keywords_on_is_accepted(monkeypatch):
    def wrapper(*args, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(jax.distributed, "initialize", wrapper)
    _init_module.distributed_options(heartbeat_timeout=5)
