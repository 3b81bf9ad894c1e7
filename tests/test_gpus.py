"""Which GPUs a task owns when its scheduler bound them (JAX issue 16788), and meshkit launch's.

The reference is a model of one SLURM node: G GPUs, T tasks, and the three ways SLURM hands them
out (every task sees all of them; ``--gpu-bind`` gives each task one; ``--gpus-per-task=k``
gives each task k, with ``SLURM_GPUS_PER_TASK``). The devices a task uses are meshkit's choice
where it makes one, else JAX's (the local rank); they must be the task's own. A real SLURM run
with bound GPUs is in ``tests/test_slurm.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit._src.core.env import bound_device_ids, visible_devices
from meshkit._src.launch.spawn import count_gpus, rank_environments


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "4,5"}, ("CUDA_VISIBLE_DEVICES", 2)),
        ({"CUDA_VISIBLE_DEVICES": " 3 , 7 ,"}, ("CUDA_VISIBLE_DEVICES", 2)),
        ({"CUDA_VISIBLE_DEVICES": ""}, ("CUDA_VISIBLE_DEVICES", 0)),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, ("CUDA_VISIBLE_DEVICES", 0)),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2"}, ("ROCR_VISIBLE_DEVICES", 3)),
        ({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, ("CUDA_VISIBLE_DEVICES", 2)),
        ({}, None),
    ],
)
def test_visible_devices(env, expected):
    assert visible_devices(env) == expected


def test_bound_devices_and_why():
    one = bound_device_ids({"CUDA_VISIBLE_DEVICES": "5"}, 1)
    assert one == (
        (0,),
        "local rank 1 with CUDA_VISIBLE_DEVICES=5: the scheduler bound these to the task",
    )
    two = bound_device_ids({"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_PER_TASK": "a100:2"}, 0)
    assert two == (
        (0, 1),
        "SLURM_GPUS_PER_TASK=a100:2 and CUDA_VISIBLE_DEVICES=2,3: the task's own GPUs",
    )
    # Nothing to correct: every GPU visible, none visible, or JAX chooses nothing.
    assert bound_device_ids({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 3) is None
    assert bound_device_ids({"CUDA_VISIBLE_DEVICES": ""}, 2) is None
    assert bound_device_ids({}, 2) is None
    assert bound_device_ids({"CUDA_VISIBLE_DEVICES": "4"}, None) is None


@st.composite
def _slurm_node(draw):
    """(mode, GPUs per task, tasks) on a node with enough GPUs for what is asked."""
    mode = draw(st.sampled_from(["all visible", "gpu-bind", "gpus-per-task"]))
    per_task = draw(st.integers(1, 4)) if mode == "gpus-per-task" else 1
    tasks = draw(st.integers(1, 8))
    spare = draw(st.integers(0, 4))
    return mode, per_task, tasks, tasks * per_task + spare


@given(_slurm_node(), st.data())
def test_property_each_task_uses_its_own_gpus(node, data):
    mode, per_task, tasks, gpus = node
    first = data.draw(st.integers(0, gpus - tasks * per_task))  # where SLURM starts handing out
    for rank in range(tasks):
        own = list(range(first + rank * per_task, first + (rank + 1) * per_task))
        env = {"SLURM_LOCALID": str(rank)}
        if mode == "all visible":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
            expected = [rank]  # one GPU each, numbered as the node numbers them
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, own))
            if mode == "gpus-per-task":
                env["SLURM_GPUS_PER_TASK"] = str(per_task)
            expected = list(range(per_task))  # its own, renumbered from 0
        binding = bound_device_ids(env, rank)
        used = list(binding[0]) if binding is not None else [rank]  # else JAX's choice
        assert used == expected, (mode, rank, env, binding)
        visible = visible_devices(env)
        assert visible is not None
        assert all(0 <= i < visible[1] for i in used)  # a device the task can see


def test_meshkit_launch_splits_the_gpus_it_sees(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=4,5,6,7 the launcher counts 4 GPUs and gives each rank ids in
    that numbering (its ranks inherit the variable): rank 1 of 2 gets 2,3, which are GPUs 6,7."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert count_gpus() == 4
    envs = rank_environments(2, 1234, devices_per_process=None, platform="auto", gpus=4)
    assert [e["MESHKIT_LOCAL_DEVICE_IDS"] for e in envs] == ["0,1", "2,3"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"ROCR_VISIBLE_DEVICES": "0,1"}, 2),
    ],
)
def test_the_launcher_counts_gpus_as_init_reads_them(monkeypatch, env, expected):
    """One reading of the visible-device variables for `meshkit launch` and `meshkit.init`."""
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert count_gpus() == expected == visible_devices(env)[1]
