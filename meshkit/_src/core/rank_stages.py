"""What each rank of a `meshkit launch` run is doing while the cluster forms.

A rank marks its stage in a file of the run's status directory, which the launcher passes in
``MESHKIT_LAUNCH_STATUS``: ``joining`` when ``meshkit.init`` starts to wait for the others,
``joined`` once JAX's distributed runtime is up, ``running`` at its first SPMD call. The
launcher reads those files while it waits and, once some rank has waited longer than a moment,
says who is where, on stderr::

    meshkit launch: waiting for the cluster to form (2.0 s): ranks 0-2 joining; rank 3 starting
    meshkit launch: the cluster formed after 3.1 s: 4 ranks joined

``starting`` is a rank that runs but has not reached ``meshkit.init`` yet (importing, loading
data); ``exited`` one that ended. A program that never calls ``meshkit.init`` marks nothing,
and the launcher says nothing about it; neither does a cluster that forms within two seconds.
Marking is one small file write per stage, three per rank and run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .contract import ENV_PROCESS_ID, ENV_STATUS
from .errors import ranges

__all__ = ["ENV_STATUS", "STAGES", "Board", "joined", "mark", "ranges"]

# In the order a rank goes through them; a summary lists them in this order.
STAGES = ("starting", "joining", "joined", "running", "exited")
_WAITING = ("starting", "joining")
_ARRIVED = ("joined", "running")


def mark(stage: str, process_id: int | None = None) -> None:
    """Record this rank's stage for the launcher (nothing outside a `meshkit launch` run).

    Args:
        stage: ``"joining"``, ``"joined"`` or ``"running"``.
        process_id: this rank (default: the launcher's ``MESHKIT_PROCESS_ID``).
    """
    where = os.environ.get(ENV_STATUS)
    if not where:
        return
    if process_id is None:
        raw = os.environ.get(ENV_PROCESS_ID, "")
        if not raw.isdigit():
            return
        process_id = int(raw)
    path = Path(where) / f"rank{process_id}"
    part = path.with_name(f".rank{process_id}.{os.getpid()}")
    try:  # written whole then renamed: the launcher never reads half a word
        part.write_text(stage)
        os.replace(part, path)
    except OSError:  # a status the launcher cannot read only makes a quieter launcher
        pass


def joined(directory: Path, ranks: Iterable[int]) -> set[int]:
    """The ranks whose status file says they joined the cluster (``joined`` or ``running``).

    A rank that never called ``meshkit.init`` (or ran alone) wrote nothing, or no more than
    ``joining``.
    """
    return {r for r in ranks if _written(directory, r) in _ARRIVED}


def _written(directory: Path, rank: int) -> str:
    """What ``rank``'s status file says ("" before it wrote one)."""
    try:
        return (directory / f"rank{rank}").read_text().strip()
    except OSError:  # not written yet
        return ""


def summary(stages: Mapping[int, str]) -> str:
    """``ranks 0-2 joining; rank 3 starting``: every rank once, grouped by stage.

    Example:
        >>> summary({0: "joining", 1: "joining", 2: "starting", 3: "exited"})
        'ranks 0-1 joining; rank 2 starting; rank 3 exited'
    """
    parts = []
    for stage in ("joined", "running", "joining", "starting", "exited"):
        ranks = [r for r, s in stages.items() if s == stage]
        if ranks:
            word = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{word} {ranges(ranks)} {stage}")
    return "; ".join(parts)


class Board:
    """The launcher's view of the ranks' stages, and when to say it.

    Nothing is said until some rank has waited ``after`` seconds in ``meshkit.init`` (a cluster
    that forms quickly is not worth a line); then a line whenever the stages change, and at
    least every ``every`` seconds while they do not; and one closing line when no rank is
    starting or joining any more, if anything was said before.

    Args:
        directory: the run's status directory (`ENV_STATUS`).
        ranks: the ranks to watch (a count: ranks 0..n-1).
        after: seconds of waiting before the first line.
        every: seconds between two lines when nothing changes.

    Example:
        >>> import tempfile
        >>> board = Board(Path(tempfile.mkdtemp()), 2)
        >>> board.line({0: "joining", 1: "starting"}, 1.0) is None  # too early to say
        True
        >>> board.line({0: "joining", 1: "starting"}, 3.0)
        'meshkit launch: waiting for the cluster to form (3.0 s): rank 0 joining; rank 1 starting'
        >>> board.line({0: "joined", 1: "joined"}, 4.5)
        'meshkit launch: the cluster formed after 4.5 s: 2 ranks joined'
    """

    def __init__(
        self,
        directory: Path,
        ranks: int | Iterable[int],
        *,
        after: float = 2.0,
        every: float = 5.0,
    ) -> None:
        self.directory = directory
        self.ranks = list(range(ranks) if isinstance(ranks, int) else ranks)
        self.after = after
        self.every = every
        self.first_join: float | None = None
        self.said_at: float | None = None
        self.said = ""
        self.done = False

    def stages(self, exits: Mapping[int, int | None]) -> dict[int, str]:
        """Each rank's stage, from its status file (``starting`` before it wrote one).

        A rank that ended is ``exited``, unless it had joined the cluster first: then it keeps
        the stage it reached, so that ranks which join and end between two looks still count
        as a cluster that formed.

        Args:
            exits: each rank's exit status, None while it runs.
        """
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
        """What to print now, given the stages ``elapsed`` seconds into the run, or None.

        ``others``: on several machines, each other machine still forming, by name, with what
        its ranks do (``{"machine 1 (host-1)": "ranks 2-3 starting"}``); the waiting line
        names them after this machine's ranks.
        """
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
