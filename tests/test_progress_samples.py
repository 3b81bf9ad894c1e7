"""What counts as progress for stall detection (`meshkit._src.lifecycle.progress`), one signal at a time.

A helper thread samples the main thread (pytest's) while it does one thing: the sampler must
tell a wait from every kind of progress. The multi-process behaviour (healthy loops never
ended, stalls ended in time) is in test_soak.py and test_faults.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from meshkit._src.lifecycle import progress as _progress

FIRST_S, GAP_S = 0.15, 0.6


def _verdict(activity, during=None):
    """What the sampler says of ``activity`` in the main thread between its last two samples.

    Samples at FIRST_S and 2 * FIRST_S (a baseline inside the activity: the stack, the CPU
    clock, then the arrays) and GAP_S later; ``during`` runs in the sampling thread just
    before the last sample.
    """
    main = threading.main_thread()
    sampler = _progress.Sampler(main.ident, main.native_id)  # as the stall detector makes it
    verdicts = []

    def sample():
        for delay in (FIRST_S, FIRST_S, GAP_S):
            time.sleep(delay)
            if delay == GAP_S and during is not None:
                during()
            verdicts.append(sampler.moved(delay))

    thread = threading.Thread(target=sample)
    thread.start()
    activity()
    thread.join()
    return verdicts[-1]


def _wait():
    time.sleep(2 * FIRST_S + GAP_S + 0.2)


def test_a_wait_in_one_place_is_no_progress():
    # In a fresh process: a wait is no progress only if no other thread of the process wants
    # a CPU, and pytest's worker has threads of its own (beside a second copy of the suite, 8
    # workers on 2 cores, one of them counted as starved).
    out = subprocess.run(
        [sys.executable, "-c", _WAIT_IN_A_FRESH_PROCESS],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.split() == ["None", "None"], out


_WAIT_IN_A_FRESH_PROCESS = f"""
import threading, time
import jax
from meshkit._src.lifecycle import progress

# The backend starts before the sampling (the sampler's first look at the arrays would start
# it, and its threads' start-up, starved beside a second copy of the suite, is progress).
jax.devices()
main = threading.main_thread()
verdicts = []

def sample():
    # Made in the sampling thread, as the stall detector makes it: the sampler leaves its own thread
    # out (woken from each sleep, it waits for a CPU itself beside a second copy of the suite).
    sampler = progress.Sampler(main.ident, main.native_id)
    then = time.monotonic()
    for delay in ({FIRST_S}, {FIRST_S}, {GAP_S}, {GAP_S}):
        time.sleep(delay)
        now = time.monotonic()
        verdicts.append(sampler.moved(now - then))  # the interval measured, as the stall detector
        then = now

thread = threading.Thread(target=sample)
thread.start()
thread.join()  # the main thread waits in one place, blocked
print(*verdicts[2:])
"""


def test_the_main_thread_moving_is_progress():
    def first():
        time.sleep(2 * FIRST_S + 0.1)

    def then():
        time.sleep(GAP_S)

    assert _verdict(lambda: (first(), then())) == "main thread moved"


def test_a_long_computation_in_one_call_is_progress():
    data = np.random.default_rng(0).bytes(1 << 20)
    start = time.thread_time()  # CPU time: on a loaded machine the wall time says little
    zlib.compress(data, 9)
    per_mib = time.thread_time() - start
    # One C call of about 1.5 s of CPU (as long or longer in wall time): the stack stays put,
    # the thread runs.
    big = data * max(1, int(1.5 / max(per_mib, 1e-4)))
    assert _verdict(lambda: zlib.compress(big, 9)) == "main thread ran"


def _verdicts_in_this_thread(*actions):
    """The sampler's verdict after each action, all sampled from one line of this thread.

    The stack is the same at every sample and the CPU share is ignored (an endless interval),
    so only the arrays and meshkit's own count can speak.
    """
    main = threading.main_thread()
    sampler = _progress.Sampler(main.ident, main.native_id)  # as the stall detector makes it
    verdicts = []
    for action in (None, None, *actions):
        if action is not None:
            action()
        verdicts.append(sampler.moved(float("inf")))
    return verdicts[2:]


def test_device_work_is_progress():
    kept = [jnp.ones(3)]

    def replace():
        kept[0] = jnp.ones(4)  # one array made, one freed: a step's output replaced

    assert _verdicts_in_this_thread(lambda: None, replace) == [None, "device work"]


def test_a_pending_array_that_completes_is_progress():
    x = jnp.ones((256, 256)) / 256
    slow = jax.jit(lambda a: jax.lax.fori_loop(0, 400, lambda _, b: b @ a, a))
    slow(x).block_until_ready()  # compiled
    y = slow(x)
    assert not y.is_ready(), "the computation ended before it could be seen pending"
    assert _verdicts_in_this_thread(y.block_until_ready) == ["device work"]


def test_meshkit_progress_counts():
    assert _verdict(_wait, during=_progress.note_progress) == "meshkit call"
    assert _verdicts_in_this_thread(_progress.note_progress) == ["meshkit call"]


def _pinned(body: str) -> str:
    """Run ``body`` (indented for a ``try:``) in a child pinned to CPU 0 beside 12 busy loops.

    Returns its stdout; skips where Linux's per-thread scheduler statistics are missing.
    """
    import os
    import subprocess
    import sys

    import pytest

    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("no per-thread scheduler statistics here (Linux's schedstat)")
    script = _PINNED_PRELUDE + body + _PINNED_END
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout


_PINNED_PRELUDE = """
import os, threading, time, zlib
from meshkit._src.lifecycle import progress

os.sched_setaffinity(0, {0})
hogs = []
for _ in range(12):
    pid = os.fork()
    if pid == 0:
        while True:  # a busy loop on the same CPU
            pass
    hogs.append(pid)
try:
"""
_PINNED_END = """finally:
    for pid in hogs:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
"""


# A child process pinned to one CPU with busy loops beside it: its main thread gets a few
# percent of that CPU. A thread of its own measures what the sampler counts as running (CPU time
# plus time runnable, waiting for the CPU) while the main thread compresses, then while it waits
# on an event (blocked).
_STARVED = """
    main = threading.main_thread()
    shares, ran, waiting, ended = [], threading.Event(), threading.Event(), threading.Event()

    def window():
        sampler = progress.Sampler(main.ident, main.native_id)
        clock = progress.Sampler(main.ident, None)  # the CPU clock alone
        used, cpu, start = sampler._cpu(), clock._cpu(), time.monotonic()
        time.sleep(0.6)
        wall = time.monotonic() - start
        shares.extend([(sampler._cpu() - used) / wall, (clock._cpu() - cpu) / wall])

    def measure():
        window()
        ran.set()
        waiting.wait()
        time.sleep(0.2)  # the main thread is blocked by now
        window()
        ended.set()

    t = threading.Thread(target=measure)
    t.start()
    chunk = os.urandom(1 << 16)
    while not ran.is_set():
        zlib.compress(chunk, 6)  # running, starved
    waiting.set()
    ended.wait()  # blocked
    t.join()
    print(*(f"{x:.3f}" for x in shares))
"""


def test_a_thread_starved_of_cpu_counts_as_running_and_a_blocked_one_does_not():
    out = _pinned(_STARVED)
    running, running_cpu, blocked, _ = map(float, out.split())
    # Runnable nearly all the time while it computes, though it got a few percent of a CPU
    # (running_cpu: the CPU clock alone, below RUN_SHARE here: it would have looked idle).
    assert running > 0.5, out
    assert blocked < _progress.RUN_SHARE, out
    print(
        f"starved: ran or runnable {running:.0%} (CPU alone {running_cpu:.0%}); blocked {blocked:.0%}"
    )


# The same pinned child: its main thread waits (one place, blocked) on a worker thread that
# computes, starved; then on a thread that sleeps. The sampler's verdicts in each phase.
_STARVED_WORKER = """
    main = threading.main_thread()
    stop = threading.Event()

    def work():
        chunk = os.urandom(1 << 16)
        while not stop.is_set():
            zlib.compress(chunk, 6)

    def phase():
        verdicts = []

        def sample():
            sampler = progress.Sampler(main.ident, main.native_id)
            for _ in range(3):
                time.sleep(0.4)
                verdicts.append(sampler.moved(0.4))

        t = threading.Thread(target=sample)
        t.start()
        t.join()  # the main thread: blocked in one place
        return verdicts[-1]

    worker = threading.Thread(target=work)
    worker.start()
    starved = phase()
    stop.set()
    worker.join()
    print(starved, "|", phase())
"""


def test_a_process_whose_threads_wait_for_a_cpu_is_not_stalled():
    out = _pinned(_STARVED_WORKER)
    starved, blocked = (part.strip() for part in out.split("|"))
    # The main thread waits on a worker that computes (hardly getting the CPU): not a stall.
    assert starved == "a thread ran", out
    # Every thread blocked, the same CPU as busy: a stall.
    assert blocked == "None", out


def test_the_main_thread_is_found_in_a_forked_process():
    """After ``os.fork``, ``threading.main_thread().native_id`` is still the parent's: the
    sampler asks the main thread itself, so it reads the right scheduler statistics (without
    them, a main thread busy but starved of CPU on a loaded machine looked stalled)."""
    code = (
        "import os, threading\n"
        "from meshkit._src.lifecycle import progress\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if progress.main_native_id() == os.getpid() else 3)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), progress.main_native_id() == os.getpid())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0", "True"], out.stderr
