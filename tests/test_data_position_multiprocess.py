"""The data position across real processes: saved mid-run by 2 x 4, resumed on 1, 2 and 4.

Two processes run meshkit's grain and Hugging Face loaders and a grain ``DataLoader`` through
`meshkit.global_batches` (the helper thread agreeing on windows of steps and reading ahead), and
save a checkpoint with ``data=`` after step 3. Resumed from it on the same 2 processes, on this
test process alone (8 devices) and on 4 fresh processes x 2 devices, the meshkit loaders give
the global batches the uninterrupted run took next; the DataLoader's per-process states resume
on 2 processes only, and are a clear error, the same on every process, elsewhere. Every bad
input raises on every process, and the processes stay in step. The bodies are in
`tests/ranks/positions.py`.
"""

from __future__ import annotations

import re

import pytest
from ranks import positions as ranks
from ranks.preloads import ECOSYSTEM

import meshkit
from meshkit.testing import run_in_processes

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.long,
    pytest.mark.filterwarnings("ignore::meshkit.DtypeWarning"),
    pytest.mark.warm_cluster(preload=ECOSYSTEM),
]

_ENV = {"MESHKIT_CHECK_TIMEOUT": "60"}


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    from conftest import require

    for module in ("grain", "datasets", "orbax.checkpoint"):
        require(module)
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _expect_resumed(resumed, full, processes):
    """The meshkit loaders resume at the next global batch; the DataLoader only on 2 processes."""
    for name in ("grain", "datasets"):
        assert resumed[name] == full[name][ranks.SAVE_AT :], name
        assert resumed[name + " steps"] == len(full[name])
    if processes == 2:
        assert resumed["dataloader"] == full["dataloader"][ranks.SAVE_AT :]
        return
    assert resumed["dataloader"] == (
        "meshkit.global_batches: start= holds per-process states of a source with get_state() "
        f"(a grain DataLoader or IterDataset iterator) from 2 processes; this run has {processes}."
        " Each state is one process's place in its own part of the data, so it resumes only on "
        "as many processes, with the same layout.\nConsider meshkit.loaders.grain_batches or "
        "hf_batches, whose position is global and resumes on any number of processes; or "
        "resuming on 2 processes."
    )


def test_a_position_saved_by_two_processes_resumes_on_one_two_and_four(
    warm_cluster, tmp_path, monkeypatch
):
    root = str(tmp_path)
    saved = warm_cluster.run(ranks.save_mid_run, root, timeout=240, env=_ENV)
    # How far each process's helper had read is its own (a matter of timing), at least what the
    # rank waited for: past the saved step (the trap: a loader's own state is ahead there).
    for one in saved:
        ahead = {name: one.pop(name + " read ahead") for name in ranks.LOADERS}
        assert ahead["grain"] >= 2
        assert ahead["dataloader"] >= 2
        assert ahead["datasets"] == 1  # all that was left after the saved step
    assert saved[0] == saved[1]  # every process gathers the same global batches
    full = saved[0]
    assert full.pop("state after the steps taken") is True
    assert [len(full[name]) for name in ranks.LOADERS] == [6, 3, 6]
    for name in ("grain", "datasets"):  # the loaders' global order: every row, once per epoch
        rows = sorted(i for step in full[name] for i in step)
        assert rows == sorted(list(range(45)) * 2 if name == "grain" else range(33))
    position = meshkit.checkpoint.data_position(tmp_path / "grain")
    assert (position.step, position.epoch, position.epoch_step, position.processes) == (
        2, 0, 2, 2,
    )  # fmt: skip
    states = meshkit.checkpoint.data_position(tmp_path / "dataloader").states
    assert sorted(states) == [0, 1]
    assert all(len(s) < 1024 for s in states.values())

    two = warm_cluster.run(ranks.resume, root, timeout=240, env=_ENV)
    assert two[0] == two[1]
    _expect_resumed(two[0], full, 2)

    _expect_resumed(ranks.resume(root), full, 1)  # this process alone, 8 devices

    monkeypatch.setenv(ranks.CKPT, root)
    four = run_in_processes(
        ranks.resume_from_env, num_processes=4, devices_per_process=2, timeout=240, env=_ENV,
        preload=ECOSYSTEM,
    )  # fmt: skip
    assert all(r == four[0] for r in four)
    _expect_resumed(four[0], full, 4)


def test_bad_positions_are_errors_on_every_process_never_a_hang(warm_cluster, tmp_path):
    root = str(tmp_path)
    warm_cluster.run(ranks.save_mid_run, root, timeout=240, env=_ENV)
    results = warm_cluster.run(ranks.refusals, root, timeout=240, env=_ENV)
    for out in results:
        assert re.fullmatch(
            r"meshkit.checkpoint.save: processes 0 and 1 differ at data=: step 10 on process 0, "
            r"step 11 on process 1.\nEvery process must save the same tree.\nConsider data= the "
            r"iterator that fed the step being saved, saved after the same step on every "
            r"process \(each process's position then says the same\).",
            out["different positions"],
        )
        assert out["nothing written"] is True
        assert out["another loader"].startswith(
            "meshkit.global_batches: start= is the position of another loader: it was taken "
            "from grain_batches(num_rows=45, global_batch=16, seed=7, epochs=2), and the loader "
            "given is grain_batches(num_rows=45, global_batch=16, seed=8, epochs=2); they differ "
            "in seed 7 (this loader: 8)."
        )
        assert out["resumed at different positions"] == (
            "meshkit.global_batches (start=): the processes resume at different positions:\n"
            "  process 0: step 2 of grain_batches(num_rows=45, global_batch=16, seed=7, "
            "epochs=2), epoch 0 at its step 2\n"
            "  process 1: step 3 of grain_batches(num_rows=45, global_batch=16, seed=7, "
            "epochs=2), epoch 0 at its step 3\n"
            "Every process must resume at the same position.\nConsider reading it from the same "
            "checkpoint on every process (meshkit.checkpoint.data_position(path))."
        )
        assert out["no data position"].startswith(
            "meshkit.checkpoint.data_position: the checkpoint at "
        )
        assert "was saved without a data position" in out["no data position"]
        assert out["missing_ok"] is None
        assert out["still in step"] == 4
        assert out["closed together after"] == ranks.SAVE_AT + 1
    # Another loader on process 1 only: process 1 says what differs, process 0 names process 1.
    assert results[1]["another loader on process 1"] == results[1]["another loader"]
    assert results[0]["another loader on process 1"] == (
        "meshkit.global_batches (start=): process 1 refused the position:\n"
        + results[1]["another loader"]
    )
