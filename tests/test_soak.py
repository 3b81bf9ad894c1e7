"""Soak: healthy loops under debug mode with short settings: no stall and no straggler reported.

Each case runs 2 processes x 4 CPU devices for at least `SOAK_S` seconds with
``MESHKIT_DEBUG=1`` and short settings: the checkpoint case a 2 s watchdog and a 2 s timeout, so
a run judged stalled would print the stall verdict after 2 s and end after 4 s;
the paced cases, whose every step is checked, a 5 s watchdog and 10 s for the others' arrival
(`PACED_ENV`). (Below that is less than a collective between two processes can promise on 2
cores running two copies of this suite, some 27 runnable processes: a step waited 1 s, then
2 s, there for its starved peer.) The loops are the ones users leave running: plain
``jax.jit`` steps (no meshkit call at all), a `meshkit.global_batches` pipeline feeding a
``jax.jit`` step, steps interrupted by a checkpoint write that keeps the main thread busy in
Python for two watchdog periods and more, and `meshkit.pmap_compat` steps. Every step paces
itself with a short sleep, the way a step waits for an accelerator: at most samples the main
thread sits in the same place, and only the device work it completes shows it moves. Each case
checks its numbers, that it ran for `SOAK_S`, and that no stall and no straggler was reported
(step times are summed in windows of 2 s).

What the launched processes run is in `ranks/soak.py`.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from ranks import soak as ranks
from ranks.soak import CHECKPOINT_STEPS, SOAK_S, STEPS

from meshkit.testing import launch_in_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

# Step times in windows of 2 s: healthy loops, whose processes are alike, name no straggler.
ENV = {
    "MESHKIT_DEBUG": "1",
    "MESHKIT_DEBUG_TIMEOUT": "2",
    "MESHKIT_WATCHDOG": "2",
    "MESHKIT_STEP_WINDOW": "2",
}
# The paced cases make a debug-checked call per step; the timeout is also how long a process
# waits there for the others, and a first call that compiles can lag 7 s under heavy load (beside
# a second copy of the suite). A process sees only itself: waiting 2 s in a collective for a
# peer starved of CPU (measured beside a second copy of the suite: 2 s and more) is a stall
# from where it stands. Their watchdog is 5 s, still 6 periods in each soak; only the checkpoint
# case, which runs alone, keeps the 2 s watchdog and timeout (its write outlasts 2 s + 2 s).
PACED_ENV = {**ENV, "MESHKIT_DEBUG_TIMEOUT": "10", "MESHKIT_WATCHDOG": "5"}


# The cases whose steps mostly sleep. The checkpoint case keeps both of its processes busy in
# Python for 4.5 s: run beside the others, it starves them on a 2-core machine, and
# their watchdogs rightly call that a stall; it runs alone, after them.
_PACED = ("jit_only", "batches_and_jit", "pmap_compat_steps")


def _launch(target):
    env = PACED_ENV if target.__name__ in _PACED else ENV
    return launch_in_processes(target, timeout=SOAK_S * 4 + 60, env=env)


@pytest.fixture(scope="module")
def soaks():
    """The paced cases' launches, started together when the module's first test asks.

    A paced soak is `SOAK_S` of steps that mostly sleep: one after the other, they cost three
    times that in wall time, together about once. Each case still runs its own 2 processes for
    `SOAK_S` under its own watchdog; only the waiting overlaps.
    """
    with concurrent.futures.ThreadPoolExecutor(len(_PACED)) as pool:
        yield {name: pool.submit(_launch, getattr(ranks, name)) for name in _PACED}


def _ran(soaks, target):
    if target.__name__ in soaks:
        result = soaks[target.__name__].result()
    else:
        concurrent.futures.wait(soaks.values())  # alone: after the paced cases
        result = _launch(target)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    assert "no process has made progress" not in text, text  # no stall reported
    assert "slower than the other processes" not in text, text
    assert all(v[1] >= SOAK_S for v in result.values), result.values
    return result.values


def test_jit_only_steps(soaks):
    # 16 rows of 4 ones: 64 per step.
    assert [v[0] for v in _ran(soaks, ranks.jit_only)] == [64.0 * STEPS] * 2


def test_global_batches_feeding_a_jit_step(soaks):
    # Step i: 16 rows of 4 values (i % 7), from 2 processes.
    expected = sum(64.0 * (i % 7) for i in range(STEPS))
    assert [v[0] for v in _ran(soaks, ranks.batches_and_jit)] == [expected] * 2


def test_steps_with_checkpoint_writes_longer_than_the_watchdog(soaks):
    values = _ran(soaks, ranks.steps_with_checkpoints)
    assert [v[0] for v in values] == [64.0 * CHECKPOINT_STEPS] * 2
    # The write outlasted the watchdog and its timeout together (2 s + 2 s).
    assert all(v[2] > 4.0 for v in values), values


def test_pmap_compat_steps(soaks):
    # Every device sums 4 ones... over 8 devices: 8 per read, one read every 10 steps.
    expected = 8.0 * len(range(0, STEPS, 10))
    assert [v[0] for v in _ran(soaks, ranks.pmap_compat_steps)] == [expected] * 2
