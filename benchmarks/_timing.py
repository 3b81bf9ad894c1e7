"""Timing helpers shared by the benchmarks: medians of repeated runs, ratio tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
