"""What checking for preemption costs: ``meshkit.checkpoint.should_save`` at every step.

``preemption_worker.py`` in N processes x 1 CPU device for each N of ``MESHKIT_BENCH_PROCS``
(default ``2,4,8,16``): a question without a notice (per call), a 10 ms step with and without
it, and, after process 1 receives SIGTERM, the steps until the sync step, the longest single
question (it waited for the agreement) and the round trips of the agreement per process.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
WORKER = HERE / "preemption_worker.py"
STEPS = 100
_RECORD = re.compile(r"(?:BENCH|RANK) (\{.*\})$")


def _counts() -> list[int]:
    text = os.environ.get("MESHKIT_BENCH_PROCS", "2,4,8,16")
    return sorted({int(x) for x in text.split(",") if x.strip()})


def _run(n: int) -> list[dict[str, Any]]:
    import meshkit

    result = meshkit.launch(
        [str(WORKER), str(HERE), str(STEPS)],
        num_processes=n,
        devices_per_process=1,
        platform="cpu",
        timeout=600,
        stream=False,
        keep_output=True,
        env={"MESHKIT_PREEMPT_GRACE": "120"},
    )
    if not result.preempted:  # the notice makes the run end as preempted (status 143)
        raise SystemExit(f"benchmark failed:\n{result.report}")
    records = []
    for rank in result.ranks:
        # Gloo's own messages may share a line of stdout with the program's: the record
        # is what follows "BENCH " or "RANK " anywhere in a line.
        found = (_RECORD.search(x) for x in rank.stdout.splitlines())
        line = next(m.group(1) for m in found if m)
        records.append(json.loads(line))
    return records


def bench_preemption() -> str:
    head = (
        f"{'N':>3} {'question':>10} {'(CPU)':>9} {'10 ms step':>11} {'+question':>10} {'ratio':>7} "
        f"{'notice->sync':>13} {'steps':>6} {'longest wait':>13} {'RPCs/proc':>10}"
    )
    lines = [
        "checking for preemption at every step, N processes x 1 CPU device (should_save)",
        head,
        "-" * len(head),
    ]
    for n in _counts():
        records = _run(n)
        first = records[0]
        syncs = {r["sync"] for r in records}
        steps = max(r["sync"] for r in records) if None not in syncs else None
        lines.append(
            f"{n:>3} {first['question'] * 1e6:>7.2f} us {first['question_cpu'] * 1e6:>6.2f} us "
            f"{first['step_without'] * 1e3:>8.3f} ms "
            f"{first['step_with'] * 1e3:>7.3f} ms "
            f"{first['step_with'] / first['step_without']:>6.3f}x "
            f"{max(r['sync_after_s'] for r in records):>11.2f} s {steps!s:>6} "
            f"{max(r['longest_question'] for r in records) * 1e3:>10.1f} ms "
            f"{max(r['rpcs'] for r in records):>10}"
            + ("" if len(syncs) == 1 else f"  DIFFERENT SYNC STEPS: {records}")
        )
    lines.append(
        "question: should_save without a notice (no round trip), wall and this thread's CPU "
        "time (more processes than cores stretch the wall time, not the work); "
        "steps: from the notice to the sync step; longest wait: the question that waited for "
        "the agreement; RPCs/proc: round trips of the agreement, the most any process made."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(bench_preemption())
