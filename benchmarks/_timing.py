"""Timing helpers shared by the benchmarks: medians of repeated runs, ratio tables."""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def keep_freed_memory() -> str:
    """Make glibc's malloc keep freed memory for reuse, so steady-state calls reuse warm pages.

    By default glibc gives large freed blocks back to the kernel (blocks over its mmap threshold,
    the tops of its heaps, and every large block of a thread's own arena), so a benchmark that
    allocates tens of MiB per call faults in fresh pages in a random number of its buffers on
    every call (about 15 ms per 16 MiB here), which swamps the differences being measured. One
    arena, no mmap for blocks under 1 GiB, no trimming below 2 GiB: the steady state then is
    what a long-running program sees; first calls still pay the faults.

    Call it first thing in the process (arenas already made stay). ``BENCH_MALLOC=default``
    skips it. Returns a line saying what was done, for the benchmark's output.
    """
    if os.environ.get("BENCH_MALLOC") == "default":
        return "malloc: glibc defaults (BENCH_MALLOC=default)"
    if not sys.platform.startswith("linux"):
        return "malloc: platform default (not glibc)"
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        return "malloc: platform default (no mallopt)"
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    ok = all(
        libc.mallopt(option, value)
        for option, value in (
            (m_arena_max, 1),
            (m_mmap_threshold, 1 << 30),
            (m_trim_threshold, 2**31 - 1),
        )
    )
    return (
        "malloc: freed memory kept for reuse (_timing.keep_freed_memory; BENCH_MALLOC=default "
        "to compare)"
        if ok
        else "malloc: mallopt refused, glibc defaults"
    )


def per_call(fn: Callable[..., object], *args: object, n: int = 1_000_000) -> tuple[float, float]:
    """Seconds per call of ``fn(*args)`` (the best of 5 rounds of ``n``, less an empty loop's),
    and the calling thread's CPU seconds per call."""
    best, cpu = float("inf"), float("inf")
    for _ in range(5):
        start, used = time.perf_counter(), time.thread_time()
        for _ in range(n):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / n)
        cpu = min(cpu, (time.thread_time() - used) / n)
    empty = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            pass
        empty = min(empty, (time.perf_counter() - start) / n)
    return best - empty, cpu


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, number: int = 20) -> float:
    """Median over `repeats` runs of the mean time of `number` calls of fn (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def table(title: str, rows: list[tuple[str, float, float]], base: str, new: str) -> str:
    """Rows of (case, baseline seconds, meshkit seconds) as a text table with ratios."""
    head = f"{'case':<44} {base:>16} {new:>16} {'ratio':>7}"
    lines = [title, head, "-" * len(head)]
    for case, b, n in rows:
        lines.append(f"{case:<44} {b * 1e6:>13.1f} us {n * 1e6:>13.1f} us {n / b:>6.2f}x")
    return "\n".join(lines)


def bench_rounds(default: int = 21) -> int:
    """Timed rounds per function: ``BENCH_REPEATS`` when set, else ``default``."""
    return int(os.environ.get("BENCH_REPEATS", str(default)))


def interleaved_medians(
    fns: Sequence[Callable[[], Any]],
    *,
    wait: Callable[[list[Any]], object],
    rounds: int | None = None,
    number: int = 50,
    max_in_flight: int = 50,
    dispatch_only: bool = False,
    before_round: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in alternating rounds.

    A round calls one function ``number`` times, then waits for the results with
    ``wait(outputs)`` (e.g. `jax.block_until_ready`); the functions take turns round by round,
    in an order reversed every other round (A B, B A, ...), so drift in a noisy machine's speed
    falls on all of them alike. The median is over ``rounds`` rounds per function
    (default: ``BENCH_REPEATS``, else 21), after one untimed warm-up round each.
    `interleaved_samples` gives every round's time instead.

    Args:
        fns: the functions to compare; each call returns something ``wait`` accepts.
        wait: blocks until the outputs of a batch of calls are ready.
        rounds: timed rounds per function.
        number: calls per round.
        max_in_flight: at most this many calls are issued before ``wait`` (async dispatch would
            otherwise queue work without bound; JAX 0.10.2 on CPU deadlocks with hundreds of
            queued collective calls). The outputs of a batch are freed before the next starts.
        dispatch_only: time only until the calls return, not until their results are ready;
            waiting still happens between batches, outside the timed span.
        before_round: called before every round, outside the timed span (e.g. a barrier, so
            that processes start each round together).
        clock: what is timed: wall time by default; `time.thread_time` times the calling
            thread's CPU (with ``dispatch_only``: meshkit's and JAX's own work per call, without
            the waits and the other threads that make wall time noisy on a small machine).
    """
    samples = interleaved_samples(
        fns,
        wait=wait,
        rounds=rounds,
        number=number,
        max_in_flight=max_in_flight,
        dispatch_only=dispatch_only,
        before_round=before_round,
        clock=clock,
    )
    return [statistics.median(s) for s in samples]


def interleaved_samples(
    fns: Sequence[Callable[[], Any]],
    *,
    wait: Callable[[list[Any]], object],
    rounds: int | None = None,
    number: int = 50,
    max_in_flight: int = 50,
    dispatch_only: bool = False,
    before_round: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Seconds per call of each of ``fns`` in each timed round; see `interleaved_medians`."""
    if rounds is None:
        rounds = bench_rounds()

    def one_round(fn: Callable[[], Any]) -> float:
        if before_round is not None:
            before_round()
        elapsed = 0.0
        done = 0
        while done < number:
            batch = min(max_in_flight, number - done)
            start = clock()
            outs = [fn() for _ in range(batch)]
            if dispatch_only:
                elapsed += clock() - start
                wait(outs)
            else:
                wait(outs)
                elapsed += clock() - start
            # Freed before the next batch is issued, so at most max_in_flight results live.
            del outs
            done += batch
        return elapsed / number

    for fn in fns:
        one_round(fn)
    samples: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            samples[i].append(one_round(fns[i]))
    return samples


def median_uncertainty(samples: Sequence[float]) -> float:
    """How far the median of ``samples`` can be trusted, relative to it (95%, a boxplot notch).

    ``1.57 * IQR / sqrt(n)`` (McGill, Tukey and Larsen 1978): two medians whose notches do not
    overlap differ at roughly the 95% level.
    """
    if len(samples) < 2:
        return float("nan")
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return 1.57 * (q3 - q1) / len(samples) ** 0.5 / statistics.median(samples)


def launched_result(
    script: Path,
    *args: str,
    num_processes: int = 2,
    devices_per_process: int = 4,
    timeout: float = 300,
) -> dict[str, Any]:
    """Run ``script`` in ``num_processes`` processes x ``devices_per_process`` CPU devices.

    Returns process 0's ``BENCH {json}`` line, parsed. The script gets the benchmarks folder as
    its first argument (to import this module), then ``args``. Every rank is killed after
    ``timeout`` seconds (the run then fails).
    """
    import meshkit

    result = meshkit.launch(
        [str(script), str(script.parent), *args],
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        platform="cpu",
        timeout=timeout,
        stream=False,
        keep_output=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"benchmark failed:\n{result.report}")
    # Gloo's own messages may share a line of stdout with the program's: BENCH anywhere.
    line = next(
        x[x.index("BENCH ") :] for x in result.ranks[0].stdout.splitlines() if "BENCH " in x
    )
    return json.loads(line.removeprefix("BENCH "))
