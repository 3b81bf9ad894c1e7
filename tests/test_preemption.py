"""Preemption: SIGTERM is a notice, every process saves at the same step, the run ends 143.

The unit tests drive `meshkit._src.lifecycle.preemption` on a fresh state of its own (nothing
takes this process's SIGTERM); the processes alone run in a subprocess; the multi-process tests
run `tests/ranks/preempted.py` (2 processes x 4 CPU devices) under meshkit's launcher, with
process 1 sending itself SIGTERM after step 5.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit import MeshkitError
from meshkit._src.launch import rank_events
from meshkit._src.lifecycle import exit as _exit
from meshkit._src.lifecycle import preemption

RANKS = Path(__file__).parent / "ranks"


def require(module, why):
    from conftest import require as required

    return required(module, why)


@pytest.fixture
def fresh(monkeypatch):
    """A preemption state of this test's own, as if `install` ran (without taking SIGTERM)."""
    state = preemption._State()
    state.installed, state.me, state.grace = True, 1, 30.0
    monkeypatch.setattr(preemption, "_state", state)
    return state


# ---- the notice, the sync point, the save after it -----------------------------------------


def test_the_first_notice_counts_and_its_deadline_is_fixed(fresh):
    assert preemption.notice() is None
    before = time.time()
    mine = preemption.receive(None)
    assert mine is not None
    assert (mine.own, mine.process, mine.source) == (True, 1, "SIGTERM")
    assert before <= mine.received <= time.time()
    assert mine.deadline == mine.received + 30.0
    told = preemption.PreemptionNotice(process=3, received=1.0, deadline=2.0, own=False)
    assert preemption.receive(told) is mine  # a second SIGTERM, or a later post: no change
    assert preemption.receive(None) is mine
    assert fresh.untold  # for the service thread to tell the others


def test_a_notice_told_by_another_process_is_not_told_again(fresh):
    told = preemption.PreemptionNotice(process=0, received=5.0, deadline=35.0, own=False)
    assert preemption.receive(told) is told
    assert told.source == "process 0"
    assert not fresh.untold


def test_nothing_is_noticed_before_install(monkeypatch):
    monkeypatch.setattr(preemption, "_state", preemption._State())
    assert preemption.receive(None) is None
    assert preemption.notice() is None


def _agree_now():
    """What the service thread does once it knows of the notice: agree on the sync step."""
    notice = preemption.notice()
    assert notice is not None
    preemption._agree(notice)


def _answers(steps, notice_at, every, sync):
    """should_save over ``steps``, a notice before question ``notice_at`` agreed by ``sync``."""
    import meshkit

    state = preemption._State()
    state.installed, state.sync = True, sync
    old = preemption._state
    preemption._state = state
    try:
        answers = []
        for i, step in enumerate(steps):
            if i == notice_at:
                preemption.receive(None)
                _agree_now()
            answers.append(meshkit.checkpoint.should_save(step, every=every))
    finally:
        preemption._state = old
    return answers, state


@given(
    steps=st.lists(st.integers(0, 10_000), min_size=1, max_size=30, unique=True).map(sorted),
    notice_at=st.integers(0, 30),
    every=st.none() | st.integers(1, 7),
)
def test_should_save_alone_is_the_periodic_steps_and_the_first_step_after_the_notice(
    steps, notice_at, every
):
    # The reference: every multiple of `every` but 0, and the first step asked once the notice
    # came (the sync step of a process alone: the step after the last one it answered), once.
    answers, state = _answers(steps, notice_at, every, preemption.alone)
    sync = steps[notice_at] if notice_at < len(steps) else None
    expected = [(every is not None and s > 0 and s % every == 0) or s == sync for s in steps]
    assert answers == expected
    assert state.reached == (sync is not None)


@given(
    start=st.integers(0, 1000),
    count=st.integers(1, 40),
    notice_at=st.integers(0, 40),
    ahead=st.integers(0, 3),
)
def test_the_agreed_step_is_the_first_one_no_process_has_answered(start, count, notice_at, ahead):
    # Among joined processes the agreement (here: another process had answered ``ahead``
    # steps more when it heard of the notice) sets the step; this one answers True at the first
    # step at or past it, whether it had answered steps before the notice or none (a restart).
    steps = list(range(start, start + count))
    asked_before = steps[notice_at - 1] if 0 < notice_at <= len(steps) else None

    def others(asked, timeout, stop):
        furthest = [a for a in (asked, None if asked is None else asked + ahead) if a is not None]
        return preemption.Synced(max(furthest) + 1 if furthest else None)

    answers, _ = _answers(steps, notice_at, None, others)
    if notice_at >= len(steps):
        assert not any(answers)
        return
    sync = steps[notice_at] if asked_before is None else asked_before + ahead + 1
    assert answers == [s == sync for s in steps]


def test_no_agreement_means_no_save_and_the_deadline_ends_the_run(fresh, caplog):
    fresh.sync = lambda answered, timeout, stop: preemption.Synced(None, False, (2,))
    preemption.receive(None)
    _agree_now()
    assert not any(preemption.reached_sync_point(s) for s in range(5))
    assert "meshkit: no step to save at after the preemption notice: process(es) 2 did not " in (
        caplog.text
    )


def test_questions_wait_once_the_step_is_sent_and_the_answer_is_the_agreed_step(fresh):
    sent = []
    release = threading.Event()

    def sync(answered, timeout, stop):
        sent.append((answered, timeout))
        release.wait(10)  # the others have not all sent theirs yet
        return preemption.Synced(answered + 2)  # another process had answered one more

    fresh.sync = sync
    assert not preemption.reached_sync_point(3)  # no notice: at once, no agreement
    preemption.receive(None)
    assert not preemption.reached_sync_point(4)  # the service thread has not sent its step yet
    agreeing = threading.Thread(target=_agree_now)
    agreeing.start()
    while not sent:
        time.sleep(0.01)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(preemption.reached_sync_point(5)))
    asking.start()
    asking.join(0.3)
    assert asking.is_alive()  # step 5 might be the one the others save at: it waits
    release.set()
    asking.join(10)
    agreeing.join(10)
    ((answered, timeout),) = sent
    assert answered == 4
    assert 29 < timeout <= 30  # the time left before the deadline
    assert answers == [False]
    assert [preemption.reached_sync_point(s) for s in (6, 7)] == [True, False]


def test_the_save_after_the_sync_point_ends_the_program_with_143(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHKIT_LAUNCH_STATUS", str(tmp_path))
    monkeypatch.setenv("MESHKIT_PROCESS_ID", "1")
    fresh.sync = preemption.alone
    preemption.saved(4)  # no notice: a save like any other
    preemption.receive(None)
    _agree_now()
    preemption.saved(4)  # a notice, but not yet the sync point: the program goes on
    assert preemption.reached_sync_point(6)
    with pytest.raises(SystemExit) as raised:
        preemption.saved(6)
    assert raised.value.code == 143
    (event,) = rank_events.read(tmp_path, 2)
    assert event.kind == "preempted"
    assert (event.fields["how"], event.fields["saved"]) == ("saved", 6)
    assert (event.fields["source"], event.fields["step"]) == ("SIGTERM", 6)


def test_the_deadline_waits_for_a_save_in_progress(fresh, monkeypatch):
    ended: list[int] = []
    monkeypatch.setattr(_exit, "end", lambda status, **kwargs: ended.append(status))
    notice = preemption.receive(None)
    assert notice is not None
    with preemption.saving():
        late = threading.Thread(target=preemption._end_at_deadline, args=(notice,))
        late.start()
        late.join(0.3)
        assert late.is_alive()  # the save goes on
        assert not ended
    late.join(10)
    assert ended == [143]


def test_the_deadline_says_the_step_global_batches_reached(fresh, tmp_path, monkeypatch):
    import numpy as np

    import meshkit

    monkeypatch.setenv("MESHKIT_LAUNCH_STATUS", str(tmp_path))
    monkeypatch.setenv("MESHKIT_PROCESS_ID", "1")
    monkeypatch.setattr(_exit, "end", lambda status, **kwargs: None)
    mesh = meshkit.make_mesh({"data": -1})
    loader = (np.ones((8, 2), np.float32) for _ in range(5))
    with meshkit.global_batches(loader, mesh, "data") as batches:
        for _ in range(3):
            next(batches)
    notice = preemption.receive(None)
    assert notice is not None
    preemption._end_at_deadline(notice)
    (event,) = rank_events.read(tmp_path, 2)
    assert (event.kind, event.fields["how"], event.fields["step"]) == ("preempted", "deadline", 3)


def test_past_the_deadline_an_error_is_the_echo_of_others_ending(fresh):
    assert preemption.past_deadline() is None
    fresh.notice = preemption.PreemptionNotice(1, time.time() - 40, time.time() + 5, own=True)
    assert preemption.past_deadline() is None
    fresh.notice = preemption.PreemptionNotice(1, time.time() - 40, time.time() - 1, own=True)
    assert preemption.past_deadline() is fresh.notice


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, "should_save: step must be an int >= 0; got -1."),
        ({"step": 1.0}, "should_save: step must be an int >= 0; got 1.0."),
        ({"step": 2, "every": 0}, r"every must be an int >= 1 \(save at every multiple of it\)"),
        ({"step": 2, "every": True}, "or None; got True."),
    ],
)
def test_should_save_refuses_bad_arguments(kwargs, message):
    import meshkit

    with pytest.raises(MeshkitError, match=message):
        meshkit.checkpoint.should_save(**kwargs)


# ---- a process alone -----------------------------------------------------------------------

_ALONE = """
import os, signal, sys, time
import meshkit
if sys.argv[4:] == ["user-handler"]:  # the program's own handler, set before init: chained
    signal.signal(signal.SIGTERM, lambda signum, frame: print("USER HANDLER", signum, flush=True))
if sys.argv[2] == "init":
    meshkit.init()
import jax.numpy as jnp
root = sys.argv[1]
x = jnp.zeros(3)
for step in range(1, 100):
    x = x + 1
    if step == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    if sys.argv[3] == "check" and meshkit.checkpoint.should_save(step, every=3):
        meshkit.checkpoint.save(meshkit.checkpoint.step_path(root, step), {"x": x})
        print("SAVED", step, flush=True)
    time.sleep(0.05)
print("END", step, flush=True)
"""


def _alone(tmp_path, *args, env=None):
    script = tmp_path / "alone.py"
    script.write_text(_ALONE)
    from conftest import run_python

    return run_python(
        [str(script), str(tmp_path / "ckpt"), *args],
        {**os.environ, "MESHKIT_PREEMPT_GRACE": "1", **(env or {})}, tmp_path, timeout=120,
    )  # fmt: skip


def test_alone_the_notice_saves_at_the_step_it_came_and_ends_with_143(tmp_path):
    # Without init no notice is taken: tests/test_checkpoint_steps.py.
    require("orbax.checkpoint", "orbax")
    out = _alone(tmp_path, "init", "check")
    assert out.returncode == 143, out.stderr
    assert out.stdout.split() == ["SAVED", "3"], out.stdout  # every 3; the last save ends it
    # The notice came during step 4: it saves at 4, or at 5 when the service thread sent its
    # step after the program had answered for 4.
    found = re.search(r"meshkit: preempted \(SIGTERM\): saved step (\d+); exiting", out.stderr)
    assert found, out.stderr
    assert found.group(1) in ("4", "5"), out.stderr
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_3", f"step_{found.group(1)}"]


def test_a_sigterm_handler_set_before_init_is_chained(tmp_path):
    require("orbax.checkpoint", "orbax")
    out = _alone(tmp_path, "init", "check", "user-handler")
    assert out.returncode == 143, out.stderr
    lines = out.stdout.split("\n")
    assert f"USER HANDLER {int(signal.SIGTERM)}" in lines, out.stdout  # the program's, once
    assert lines.count(f"USER HANDLER {int(signal.SIGTERM)}") == 1
    assert "meshkit: preempted (SIGTERM): saved step" in out.stderr  # and meshkit's notice


def test_alone_a_program_that_never_checks_ends_at_the_deadline(tmp_path):
    start = time.monotonic()
    out = _alone(tmp_path, "init", "ignore")
    assert out.returncode == 143, out.stderr
    assert 1.0 <= time.monotonic() - start < 60
    assert "END" not in out.stdout
    assert "the program did not save and stop within MESHKIT_PREEMPT_GRACE=1 s" in out.stderr


def test_fail_fast_off_leaves_sigterm_to_python(tmp_path):
    out = _alone(tmp_path, "init", "check", env={"MESHKIT_FAIL_FAST": "0"})
    assert out.returncode == -15, out.stderr  # Python's default: the signal ends it


def test_a_bad_grace_is_an_error_of_init(tmp_path):
    out = _alone(tmp_path, "init", "check", env={"MESHKIT_PREEMPT_GRACE": "soon"})
    assert out.returncode == 1
    assert (
        "MeshkitError: meshkit.init(): environment variable MESHKIT_PREEMPT_GRACE='soon' is not "
        "a number of seconds." in out.stderr
    ), out.stderr


# ---- 2 processes x 4 CPU devices: process 1 receives SIGTERM after step 5 ------------------


def _run(tmp_path, *args, env=None):
    from ranks.preloads import ECOSYSTEM

    from meshkit.testing import launch_in_processes

    return launch_in_processes(
        RANKS / "preempted.py", num_processes=2, devices_per_process=4, timeout=120,
        args=[str(tmp_path / "ckpt"), *args], env=env, preload=ECOSYSTEM,
    )  # fmt: skip


def _said(result, word):
    """The step each rank printed after ``word`` (``SAVED 7`` -> 7), by rank."""
    from conftest import said

    return {
        r.rank: int(line.split()[1]) for r in result.ranks for line in said(r.stdout, word + " ")
    }


def _restored_x(path):
    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    return float(meshkit.checkpoint.restore(path, mesh)["x"].addressable_data(0)[0])


@pytest.mark.multiprocess
@pytest.mark.waits  # steps paced for the notice to arrive, orbax's saves
def test_jaxs_own_protocol_and_orbax_save_at_one_step_on_every_process(tmp_path):
    # JAX's documented pattern, under meshkit's defaults: the sync point, a save, the loop ends;
    # orbax's CheckpointManager, asking JAX's sync point too, saves the same step.
    require("orbax.checkpoint", "orbax")
    result = _run(tmp_path, "jax")
    saved = _said(result, "SAVED")
    assert set(saved) == {0, 1}, result.report
    (step,) = set(saved.values())  # the same on both
    assert 5 <= step <= 300, saved  # the processes step apart: no collective binds them
    assert _said(result, "ORBAX") == saved  # the first step orbax saved (interval 1000)
    assert (tmp_path / "ckpt" / "orbax" / str(step)).is_dir()
    assert [r.returncode for r in result.ranks] == [0, 0], result.report
    # The ranks' programs ended by themselves; the launcher says the run was preempted.
    assert result.preempted, result.report
    assert result.returncode == 143
    assert result.report.startswith("meshkit launch: preempted: the notice (SIGTERM to rank 1)")
    assert _restored_x(tmp_path / "ckpt" / f"step_{step}") == step


@pytest.mark.multiprocess
def test_should_save_saves_once_everywhere_and_a_second_sigterm_does_not_cut_it(tmp_path):
    # The victim sends itself a second SIGTERM while the preemption save runs.
    require("orbax.checkpoint", "orbax")
    result = _run(tmp_path, "should", "--again")
    saving = _said(result, "SAVING")
    (step,) = set(saving.values())
    assert set(saving) == {0, 1}, result.report
    # Process 0 hears of the notice at its failure watch's next look (1 s: 20 steps of 50 ms;
    # more on a loaded machine).
    assert 5 <= step <= 300, result.report
    assert _said(result, "SAVED") == {}  # the save ends the program: SystemExit(143)
    assert [r.returncode for r in result.ranks] == [143, 143], result.report
    assert result.report == (
        f"meshkit launch: preempted: the notice (SIGTERM to rank 1) reached every rank at step "
        f"{step}.\nEvery rank saved step {step} after it and exited (status 143); start the run "
        "again to resume there.\n"
    )
    assert "meshkit: preempted (SIGTERM): saved step" in result.ranks[1].stderr
    assert "meshkit: preempted (process 1): saved step" in result.ranks[0].stderr
    assert _restored_x(tmp_path / "ckpt" / f"step_{step}") == step


@pytest.mark.multiprocess
def test_a_sigkill_during_the_preemption_save_leaves_the_last_step_whole(tmp_path):
    import meshkit

    require("orbax.checkpoint", "orbax")
    result = _run(tmp_path, "should", "--every", "2", "--kill-in-save")
    saved = _said(result, "SAVED")
    assert result.ranks[1].returncode == -9, result.report
    assert not result.preempted, result.report
    assert result.returncode != 0
    last = max(saved.values())  # the last periodic save, complete on every process
    found = meshkit.checkpoint.latest(tmp_path / "ckpt")
    assert found is not None, saved
    assert found.step == last, (found, saved)
    assert _restored_x(found.path) == last


@pytest.mark.multiprocess
def test_a_notice_during_init_is_told_once_the_processes_joined(tmp_path):
    require("orbax.checkpoint", "orbax")
    result = _run(tmp_path, "should", "--during-init")
    saving = _said(result, "SAVING")
    (step,) = set(saving.values())  # the same on both: from the first step, once process 0
    assert set(saving) == {0, 1}, result.report  # has heard of the notice (its watch, 1 s)
    assert 1 <= step <= 300, result.report
    assert [r.returncode for r in result.ranks] == [143, 143], result.report


@pytest.mark.multiprocess
def test_a_notice_during_a_restore_lets_it_finish_then_saves_at_the_next_step(tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    require("orbax.checkpoint", "orbax")
    # Step 4 of a run, saved here (8 devices of one process; restored on 2 x 4).
    mesh = meshkit.make_mesh({"data": -1})
    x = jax.jit(lambda: jnp.full(4, 4.0), out_shardings=NamedSharding(mesh, P()))()
    meshkit.checkpoint.save(tmp_path / "ckpt" / "step_4", {"x": x, "step": 4})
    result = _run(tmp_path, "should", "--restore")
    assert _said(result, "RESTORED") == {0: 4, 1: 4}, result.report
    saving = _said(result, "SAVING")
    (step,) = set(saving.values())
    assert set(saving) == {0, 1}, result.report
    assert 5 <= step <= 300, result.report
    assert [r.returncode for r in result.ranks] == [143, 143], result.report
    assert _restored_x(tmp_path / "ckpt" / f"step_{step}") == step  # went on from 4
