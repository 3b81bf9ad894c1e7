"""What a compilation cache saves a restart: ``examples/restart_on_failure.py`` under
``meshkit launch -n 2 -d 2 --max-restarts 2``, without and with ``--compilation-cache``.

Process 1 kills itself after step 7 of the first attempt; the second attempt restores step 6
and finishes. Each run starts with an empty cache directory (the first attempt fills it, the
second reads it). The compile times are what the ranks report to the launcher (seconds spent
compiling or fetching programs from the cache, `LaunchAttempt.compiled`), process 0's: on CPU
only process 0's programs are found again (each process's devices are part of JAX's key).
Medians of ``BENCH_REPEATS`` runs (default 3), alternating without and with the cache.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
EXAMPLE = HERE.parent / "examples" / "restart_on_failure.py"


def _attempts(cache: str | None) -> tuple[float, float]:
    import meshkit
    from meshkit._src.core.events import ENV_COMPILATION_CACHE

    with tempfile.TemporaryDirectory() as root:
        result = meshkit.launch(
            [str(EXAMPLE), "--dir", os.path.join(root, "checkpoints")],
            num_processes=2,
            devices_per_process=2,
            platform="cpu",
            timeout=300,
            stream=False,
            max_restarts=2,
            env={ENV_COMPILATION_CACHE: os.path.join(root, cache)} if cache else None,
        )
    if result.returncode != 0 or len(result.attempts) != 2:
        raise SystemExit(f"benchmark failed:\n{result.report}")
    first, second = (dict((c[0], c[1]) for c in a.compiled)[0] for a in result.attempts)
    return first, second


def bench_compile_cache() -> str:
    repeats = int(os.environ.get("BENCH_REPEATS", "3"))
    runs: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
    for _ in range(repeats):
        runs["without"].append(_attempts(None))
        runs["with"].append(_attempts("jax-cache"))
    head = f"{'case':<44} {'attempt 0':>12} {'attempt 1':>12} {'ratio':>7}"
    lines = [
        "compile time of a restart, process 0 of 2 x 2 CPU devices (restart_on_failure.py)",
        head,
        "-" * len(head),
    ]
    for name, label in (("without", "no compilation cache"), ("with", "--compilation-cache")):
        a = statistics.median(x for x, _ in runs[name])
        b = statistics.median(y for _, y in runs[name])
        lines.append(f"{label:<44} {a * 1e3:>9.1f} ms {b * 1e3:>9.1f} ms {b / a:>6.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    print(bench_compile_cache())
