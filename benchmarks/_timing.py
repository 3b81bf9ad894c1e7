"""Timing helpers shared by the benchmarks: medians of repeated runs, ratio tables."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


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


def interleaved_medians(
    fns: Sequence[Callable[[], Any]],
    *,
    wait: Callable[[list[Any]], object],
    rounds: int | None = None,
    number: int = 50,
    max_in_flight: int = 50,
    dispatch_only: bool = False,
) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in alternating rounds.

    A round calls one function ``number`` times, then waits for the results with
    ``wait(outputs)`` (e.g. `jax.block_until_ready`); the functions take turns round by round,
    in an order reversed every other round (A B, B A, ...), so drift in a noisy machine's speed
    falls on all of them alike. The median is over ``rounds`` rounds per function
    (default: ``BENCH_REPEATS``, else 21), after one untimed warm-up round each.

    Args:
        fns: the functions to compare; each call returns something ``wait`` accepts.
        wait: blocks until the outputs of a batch of calls are ready.
        rounds: timed rounds per function.
        number: calls per round.
        max_in_flight: at most this many calls are issued before ``wait`` (async dispatch would
            otherwise queue work without bound; JAX 0.10.2 on CPU deadlocks with hundreds of
            queued collective calls).
        dispatch_only: time only until the calls return, not until their results are ready;
            waiting still happens between batches, outside the timed span.
    """
    if rounds is None:
        rounds = int(os.environ.get("BENCH_REPEATS", "21"))

    def one_round(fn: Callable[[], Any]) -> float:
        elapsed = 0.0
        done = 0
        while done < number:
            batch = min(max_in_flight, number - done)
            start = time.perf_counter()
            outs = [fn() for _ in range(batch)]
            if dispatch_only:
                elapsed += time.perf_counter() - start
                wait(outs)
            else:
                wait(outs)
                elapsed += time.perf_counter() - start
            done += batch
        return elapsed / number

    for fn in fns:
        one_round(fn)
    samples: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            samples[i].append(one_round(fns[i]))
    return [statistics.median(s) for s in samples]
