"""One process of the preemption benchmark (benchmarks/preemption.py): a loop of 10 ms steps.

    python preemption_worker.py BENCH_DIR STEPS

Phase 1, no notice: ``STEPS`` steps of 10 ms of host work each, with and without
``meshkit.checkpoint.should_save(step)`` (interleaved rounds), and the question alone (median
of many calls, in wall and in CPU time). Phase 2, after a barrier: process 1 sends itself
SIGTERM 20 steps in; every process goes on asking at each step (steps increase across both
phases), and records how many steps and seconds after the notice the sync step came, the
longest single question (the one that waited for the agreement) and the round trips of the
agreement. Process 0 prints ``BENCH {json}``; the others print ``RANK {json}``.
"""

import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
STEPS = int(sys.argv[2])

import meshkit  # noqa: E402

meshkit.init()

from meshkit._src.coord import gather as _sync  # noqa: E402
from meshkit._src.coord import service as _service  # noqa: E402
from meshkit._src.lifecycle import preemption as _preemption  # noqa: E402

STEP_S = 0.010
me = meshkit.runtime_info().process_id


def work() -> None:
    end = time.perf_counter() + STEP_S
    while time.perf_counter() < end:
        pass


# Round trips of the agreement: count what the coordination client is asked.
stats = _service.Stats()
_real = _sync.JaxService


def _counted(client):
    return _service.Counted(_real(client), stats)


_sync.JaxService = _counted  # type: ignore[assignment]

# Phase 1: the cost of asking, no notice.
# Steps only increase, as in a training loop, across both phases (a process answers each step
# once; the agreement's sync step is after the highest step any process answered).
step = 0
question, question_cpu = [], []  # wall time, and this thread's CPU time (N > cores: shared)
for _ in range(5):
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(10_000):
        step += 1
        meshkit.checkpoint.should_save(step, every=10**9)
    question.append((time.perf_counter() - start) / 10_000)
    question_cpu.append((time.thread_time() - start_cpu) / 10_000)
with_q, without_q = [], []
for r in range(6):
    for asks in (True, False) if r % 2 == 0 else (False, True):
        start = time.perf_counter()
        for _ in range(STEPS):
            step += 1
            work()
            if asks:
                meshkit.checkpoint.should_save(step, every=10**9)
        (with_q if asks else without_q).append((time.perf_counter() - start) / STEPS)

# Phase 2, once every process is done with phase 1 (a notice must not find a process still
# measuring): a notice 20 steps in, the agreement, the sync step.
meshkit.barrier("preemption benchmark: phase 2")
NOTICE_AT = 20
asked_at = None
longest = 0.0
sync = None
for k in range(1, 400):
    step += 1
    work()
    if me == 1 and k == NOTICE_AT:
        os.kill(os.getpid(), signal.SIGTERM)
    start = time.perf_counter()
    answer = meshkit.checkpoint.should_save(step)
    longest = max(longest, time.perf_counter() - start)
    notice = meshkit.preemption_notice()
    if notice is not None and asked_at is None:
        asked_at = k - NOTICE_AT
    if answer:
        sync = k
        break
notice = meshkit.preemption_notice()
record = {
    "question": statistics.median(question),
    "question_cpu": statistics.median(question_cpu),
    "step_with": statistics.median(with_q),
    "step_without": statistics.median(without_q),
    "heard_after": asked_at,
    "sync": None if sync is None else sync - NOTICE_AT,
    "sync_after_s": None if notice is None else time.time() - notice.received,
    "longest_question": longest,
    "rpcs": stats.rpcs,
    # What this process's agreement ended with (for a run whose processes disagree).
    "agreed": repr(_preemption._state.synced),
    "answered_last": _preemption._state.asked,
}
print(("BENCH " if me == 0 else "RANK ") + json.dumps(record), flush=True)
