"""Thread safety: meshkit calls from several threads pair up across processes by channel.

What the launched processes run is in `ranks/threads.py`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from ranks import threads as ranks

import meshkit
from meshkit.testing import launch_in_processes


@pytest.mark.multiprocess
@pytest.mark.parametrize("debug", ["0", "1"], ids=["debug-off", "debug-on"])
def test_global_array_from_local_from_two_threads_at_once(debug):
    result = launch_in_processes(
        ranks.two_threads,
        timeout=180,
        env={"MESHKIT_DEBUG": debug, "MESHKIT_CHECK_TIMEOUT": "30", "MESHKIT_DEBUG_TIMEOUT": "30"},
    )
    assert result.returncode == 0, result.report
    for me, (errors, sums, unnamed) in enumerate(result.values):
        assert errors == [], errors
        for channel, (rows, cols) in ranks.SHAPES.items():
            # Each of the 4 local devices holds a quarter of this process's rows.
            per_device = rows // 4 * cols
            assert sums[channel] == [float(per_device * (i + me)) for i in range(ranks.CALLS)]
        assert unnamed.startswith(
            "meshkit.global_array_from_local was called from thread 'Thread-"
        ), unnamed
        assert "outside any meshkit.channel" in unnamed
        assert 'Consider wrapping the thread\'s work in `with meshkit.channel("loader"):`' in (
            unnamed
        )


def test_channel_names_are_checked():
    for bad, shown in (("", "''"), (3, "3")):
        with (
            pytest.raises(
                meshkit.MeshkitError, match=f"name must be a non-empty string; got {shown}"
            ),
            meshkit.channel(bad),  # type: ignore[arg-type]
        ):
            pass


def test_a_channel_is_used_by_one_thread_at_a_time():
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with meshkit.channel("loader"):
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=hold, name="holder")
    t.start()
    inside.wait(30)
    try:
        with pytest.raises(meshkit.MeshkitError) as info, meshkit.channel("loader"):
            pass
        assert str(info.value).startswith(
            "meshkit.channel('loader'): thread 'holder' of this process is using this channel; "
            "thread 'MainThread' cannot use it at the same time"
        ), info.value
    finally:
        leave.set()
        t.join(30)
    with meshkit.channel("loader"):  # free again
        with meshkit.channel("loader"):  # and re-entrant in one thread
            assert meshkit._src.coord.channel.current() == "loader"
        assert meshkit._src.coord.channel.current() == "loader"
    assert meshkit._src.coord.channel.current() is None


@pytest.mark.multiprocess
def test_close_from_another_thread_ends_a_waiting_next_and_the_others_are_told():
    result = launch_in_processes(
        ranks.closed_from_another_thread, timeout=120, env={"MESHKIT_CHECK_TIMEOUT": "60"}
    )
    assert result.returncode == 0, result.report
    # Steps 1, 2, 3: 8 rows of value 0, 1, 2. Process 0's loader blocks at its 4th batch, so
    # no process's helper has step 4; process 0's close ends its waiting next(), and process 1,
    # which asks for step 4, is told that process 0 will not take it; it says so, and process
    # 0's close, which waited for that, raises too.
    for sums, took, _ in result.values:
        assert sums == [0.0, 16.0, 32.0], result.values
        assert took < 20, result.values  # not the 60 s check timeout
    assert [error for _, _, error in result.values] == [
        "meshkit.global_batches: the processes left their loops at different steps: this "
        "process (process 0) closed its iterator after step 3, but process 1 asks for step 4.",
        "meshkit.global_batches: the processes left their loops at different steps: process 0 "
        "after step 3 closed its iterator, but this process (process 1) asks for step 4, which "
        "process 0 will not take.",
    ]


def test_close_from_another_thread_in_one_process():
    mesh = meshkit.make_mesh({"data": -1})
    gate = threading.Event()

    def loader():
        yield np.ones((8, 2), np.float32)
        gate.wait(30)
        yield np.ones((8, 2), np.float32)

    it = meshkit.global_batches(loader(), mesh, "data")
    assert float(next(it).sum()) == 16.0
    threading.Timer(0.5, it.close).start()
    start = time.monotonic()
    with pytest.raises(StopIteration):
        next(it)  # waits for the blocked loader until the close
    assert time.monotonic() - start < 10
    with pytest.raises(StopIteration):
        next(it)
    gate.set()


@pytest.mark.multiprocess
def test_an_idle_joined_process_runs_one_meshkit_thread_and_a_loop_adds_its_prefetcher():
    result = launch_in_processes(ranks.meshkit_threads, timeout=180)
    assert result.returncode == 0, result.report
    for idle, loop in result.values:
        assert all(name.startswith("meshkit-") for name in idle), idle  # no thread but ours
        assert idle == ["meshkit-service"], idle  # the one service thread, nothing else
        added = set(loop) - set(idle)
        assert added == {"meshkit-global-batches"}, loop  # the prefetcher, nothing else


@pytest.mark.multiprocess
def test_with_its_three_background_guards_off_an_idle_process_runs_no_meshkit_thread():
    # Fail-fast's watch, stall samples and step-time windows are what keep meshkit-service in
    # an idle process (docs/what-init-installs.md); a loop still watches the others' closes.
    off = {"MESHKIT_FAIL_FAST": "0", "MESHKIT_STALL_TIMEOUT": "0", "MESHKIT_STEP_WINDOW": "0"}
    result = launch_in_processes(ranks.meshkit_threads, timeout=180, env=off)
    assert result.returncode == 0, result.report
    for idle, loop in result.values:
        assert idle == [], idle
        assert set(loop) == {"meshkit-global-batches", "meshkit-service"}, loop
