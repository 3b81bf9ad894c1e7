"""What the always-on progress records cost: stalls and stragglers (`docs/hangs.md`).

The program's thread pays only `stragglers.took` per step of `global_batches` (and a test of
`profiles.active`, off unless a profile of some steps was asked for); everything else
runs in `meshkit-service`: a stall sample every 5 s, a window every 30 s, and on process 0 the
reading of every process's window. Timed here in one process; the per-window work of process 0
is timed on 16 to 8,192 posted rows (1,024 hosts x 8 processes), and the requests per process
follow from the settings (none while the processes make progress, for stalls).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

from _timing import per_call

from meshkit._src.core.events import StepRow
from meshkit._src.lifecycle import profiles as _profiles
from meshkit._src.lifecycle import progress as _progress
from meshkit._src.lifecycle import stall as _stall
from meshkit._src.lifecycle import stragglers as _stragglers
from meshkit._src.lifecycle.progress import ServiceBoard


def _step() -> None:
    asked = time.perf_counter()
    _stragglers.took(asked, time.perf_counter())


def _profile_check() -> None:
    if _profiles.active is not None:  # what global_batches tests per step (profiles off)
        _profiles.active.step(0)


def _from_service(fn, n: int) -> float:
    """Seconds per call of ``fn`` in another thread while this (main) thread waits."""
    out: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def bench_progress_records() -> str:
    saved = _stragglers._totals
    _stragglers._totals = _stragglers._Totals()
    try:
        step, step_cpu = per_call(_step)
    finally:
        _stragglers._totals = saved
    check, _ = per_call(_profile_check)
    main = threading.main_thread()
    sampler = _progress.Sampler(main.ident or 0, _progress.main_native_id())
    sample = _from_service(lambda: sampler.moved(5.0), 200)
    record = _from_service(lambda: _stall.record(0, 61.0, main.ident or 0, ""), 200)
    row = json.dumps(asdict(StepRow(7, 1000, 81.0, 2.0, 6.0, 3.0, 70.0)))
    lines = [
        "Progress records: what stalls and stragglers cost",
        f"main thread per global_batches step (stragglers.took):  {step * 1e9:6.0f} ns wall, "
        f"{step_cpu * 1e9:.0f} ns CPU  (goal <= 1000 ns)",
        f"main thread per step, the profile check when off:        {check * 1e9:6.0f} ns wall "
        "(a call and one global's test)",
        f"service thread, one stall sample (every 5 s):            {sample * 1e6:6.1f} us "
        f"({sample / 5.0 * 100:.4f}% of a CPU)",
        f"service thread, one stall record (only while stalled):  {record * 1e6:6.1f} us",
        "requests per process while every process makes progress: stalls 0; step windows "
        "1 per 30 s (0.033/s; goal <= 0.1/s)",
    ]
    for n in (16, 1024, 8192):
        board = ServiceBoard(
            post=lambda k, v: None,
            read=lambda n=n: {str(p): row for p in range(n)},
            drop=lambda k: None,
        )
        t = time.perf_counter()
        table = _stragglers.rows(board)
        _stragglers.stragglers(table)
        took = time.perf_counter() - t
        lines.append(
            f"process 0, one window of {n:5d} processes (parse + rule): {took * 1e3:8.2f} ms, "
            f"{n * len(row) / 1e6:.2f} MB listed"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(bench_progress_records())
