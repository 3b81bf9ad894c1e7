"""What saving the data position adds to a checkpoint (issue 27: under 1 ms and 1 KiB per process).

data_position_worker.py in 2 processes x 4 CPU devices: ``meshkit.checkpoint.save`` of a 1 MiB
per process tree without and with ``data=batches`` (medians over interleaved rounds), for a
meshkit loader (its position is the same on every process: one more entry in the save's
agreement) and a grain DataLoader (each process's state goes to process 0 through the
coordination service); then the position's own work per process, timed alone, and its bytes.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
from pathlib import Path

from _timing import launched_result, median_uncertainty, table

HERE = Path(__file__).parent


def bench_data_position() -> str:
    missing = [m for m in ("grain", "orbax") if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"checkpoint.save with the data position: skipped, {' and '.join(missing)} not "
            "installed (the bench dependency group installs them)"
        )
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-data-") as root:
        data = launched_result(HERE / "data_position_worker.py", root)
    sources = data["sources"]
    rows = [
        (f"save 1 MiB/process, {name}", statistics.median(d["plain"]), statistics.median(d["data"]))
        for name, d in sources.items()
    ]
    noise = max(median_uncertainty(d[k]) for d in sources.values() for k in ("plain", "data"))
    lines = [
        table(
            "checkpoint.save with the data position, 2 processes x 4 CPU devices",
            rows,
            "save(tree)",
            "save(data=)",
        ),
        f"(each median within +-{noise:.0%} at 95%: a whole save's noise hides a millisecond; "
        "the position's own work is timed alone below)",
    ]
    for name, d in sources.items():
        own = ", ".join(f"process {p} {s * 1e3:.3f} ms" for p, s in enumerate(d["own"]))
        lines.append(
            f"the position's own work per save, {name}: {own} (budget 1 ms); "
            f"{d['bytes_per_process']:.0f} bytes per process in the checkpoint (budget 1,024)"
        )
    lines.append(f"one coordination-service request here: {data['request'] * 1e3:.3f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    print(bench_data_position())
