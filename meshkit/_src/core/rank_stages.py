"""What each rank of a `meshkit launch` run is doing while the cluster forms.

A rank writes its stage (``joining``, ``joined``, ``running``) to a file of the status
directory; the launcher reads them and, once a rank waited a while, says who is where.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .contract import ENV_STATUS
from .errors import ranges
from .events import own_rank

# In the order a rank goes through them; a summary lists them in this order.
STAGES = ("starting", "joining", "joined", "running", "exited")
_WAITING = ("starting", "joining")
_ARRIVED = ("joined", "running")


def mark(stage: str, process_id: int | None = None) -> None:
    """Record this rank's stage for the launcher (nothing outside a `meshkit launch` run)."""
    where = os.environ.get(ENV_STATUS)
    process_id = own_rank() if process_id is None else process_id
    if not where or process_id is None:
        return
    path = Path(where) / f"rank{process_id}"
    part = path.with_name(f".rank{process_id}.{os.getpid()}")
    with contextlib.suppress(OSError):  # written whole then renamed: never read in half
        part.write_text(stage)
        os.replace(part, path)


def joined(directory: Path, ranks: Iterable[int]) -> set[int]:
    """The ranks whose status file says they joined the cluster (``joined`` or ``running``)."""
    return {r for r in ranks if _written(directory, r) in _ARRIVED}


def _written(directory: Path, rank: int) -> str:
    """What ``rank``'s status file says ("" before it wrote one)."""
    try:
        return (directory / f"rank{rank}").read_text().strip()
    except OSError:  # not written yet
        return ""


def summary(stages: Mapping[int, str]) -> str:
    """``ranks 0-2 joining; rank 3 starting``: every rank once, grouped by stage."""
    parts = []
    for stage in ("joined", "running", "joining", "starting", "exited"):
        ranks = [r for r, s in stages.items() if s == stage]
        if ranks:
            word = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{word} {ranges(ranks)} {stage}")
    return "; ".join(parts)


class Board:
    """The launcher's view of the ranks' stages, and when to say it."""

    def __init__(
        self, directory: Path, ranks: int | Iterable[int], *, after: float = 2.0, every: float = 5.0
    ) -> None:
        self.directory = directory
        self.ranks = list(range(ranks) if isinstance(ranks, int) else ranks)
        self.after, self.every = after, every
        self.first_join: float | None = None  # seconds into the run when a rank left `starting`
        self.said_at: float | None = None
        self.said = ""
        self.done = False

    def stages(self, exits: Mapping[int, int | None]) -> dict[int, str]:
        """Each rank's stage, from its status file (``starting`` before it wrote one)."""
        out = {}
        for r in self.ranks:
            text = _written(self.directory, r)
            stage = text if text in STAGES else "starting"
            if exits.get(r) is not None and stage not in _ARRIVED:
                stage = "exited"
            out[r] = stage
        return out

    def line(
        self, stages: Mapping[int, str], elapsed: float, others: Mapping[str, str] | None = None
    ) -> str | None:
        """What to print now, given the stages ``elapsed`` seconds into the run, or None."""
        if self.done:
            return None
        if self.first_join is None and any(s != "starting" for s in stages.values()):
            self.first_join = elapsed
        waiting = any(s in _WAITING for s in stages.values())
        arrived = sum(1 for s in stages.values() if s in _ARRIVED)
        if not waiting and (arrived or self.said_at is not None):
            self.done = True
            if self.said_at is None:
                return None
            if not arrived:
                return (
                    f"meshkit launch: every rank exited before the cluster formed ({elapsed:.1f} s)"
                )
            ended = [r for r, s in stages.items() if s == "exited"]
            line = f"meshkit launch: the cluster formed after {elapsed:.1f} s: {arrived} "
            line += "rank joined" if arrived == 1 else "ranks joined"
            if ended:
                line += f"; {'rank' if len(ended) == 1 else 'ranks'} {ranges(ended)} exited"
            return line
        if self.first_join is None or elapsed - self.first_join < self.after:
            return None
        said = summary(stages) + "".join(f"; {m}: {what}" for m, what in (others or {}).items())
        due = self.said_at is None or elapsed - self.said_at >= self.every
        if said == self.said and not due:
            return None
        self.said, self.said_at = said, elapsed
        return f"meshkit launch: waiting for the cluster to form ({elapsed:.1f} s): {said}"
