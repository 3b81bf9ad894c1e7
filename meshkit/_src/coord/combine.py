"""`gather`: every process's value to process 0, and one combined answer back to every process.

Each process writes its value and waits at one barrier; process 0 reads all values in one
directory read and writes the answer the others read: three round trips per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .service import Barrier, Service


@dataclass(frozen=True)
class Gathered:
    """How one `gather` ended: the combined answer, or (None and) who did not arrive."""

    answer: str | None
    missing: tuple[int, ...] = ()


def gather(
    service: Service,
    me: int,
    n: int,
    tag: str,
    value: str,
    combine: Callable[[Mapping[int, str]], str],
    *,
    timeout: float,
) -> Gathered:
    """Gather every process's ``value`` at process 0, and give each the answer of ``combine``.

    Each of the ``n`` processes calls it once per ``tag`` (unique in the session); ``combine``
    runs in process 0 only, on the values by process.

    Examples:
        >>> from meshkit._src.coord.fake import FakeCluster
        >>> gather(FakeCluster(1).service(0), 0, 1, "t", "a", lambda v: ",".join(v.values()),
        ...        timeout=1.0)
        Gathered(answer='a', missing=())
    """
    deadline = time.monotonic() + timeout
    values, answer = f"meshkit/{tag}/v/", f"meshkit/{tag}/answer"
    service.set(f"{values}{me}", value)
    if service.barrier(f"meshkit/{tag}/b", timeout) is not Barrier.PASSED:
        arrived = {int(k.rsplit("/", 1)[1]) for k, _ in service.dir_get(values)}
        return Gathered(None, tuple(p for p in range(n) if p not in arrived))
    if me == 0:
        found = {int(k.rsplit("/", 1)[1]): v for k, v in service.dir_get(values)}
        combined = combine(dict(sorted(found.items())))
        service.set(answer, combined)
        service.delete(values)
        return Gathered(combined)
    got = service.get(answer, max(deadline - time.monotonic(), 0.001))
    return Gathered(got) if got is not None else Gathered(None, (0,))
