"""The one wording of "process N did not arrive", and of who holds which value, for every check."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Groups = dict[str, list[int]]  # each value, with the processes that hold it (sorted)
ABSENT = "(absent)"  # the value of a name a process lacks (`differences`)


def processes(ids: Iterable[int]) -> str:
    """``"process 3"`` or ``"processes 2,5"``, in the order given (callers give them sorted)."""
    ordered = list(ids)
    listed = ",".join(map(str, ordered))
    return f"process {listed}" if len(ordered) == 1 else f"processes {listed}"


def did_not(ids: Iterable[int], *, timeout: float, arrive: str = "arrive") -> str:
    """``"process 3 did not arrive within 8 s"``; ``arrive`` names what they did not do."""
    return f"{processes(ids)} did not {arrive} within {timeout:g} s"


def stopped_waiting(ids: Iterable[int]) -> str:
    """``"processes 0,2 stopped waiting"`` (this process arrived after their timeout)."""
    return f"{processes(ids)} stopped waiting"


def outside_majority(groups: Iterable[list[int]]) -> list[int]:
    """The processes not in the one largest group, sorted; all of them when no group is largest.

    ``groups``: the processes that agree with each other, one list per value they hold. The
    processes a disagreement names as the ones that differ.
    """
    ordered = list(groups)
    size = max(len(ps) for ps in ordered)
    largest = [ps for ps in ordered if len(ps) == size]
    return sorted(p for ps in ordered for p in ps if len(largest) > 1 or ps is not largest[0])


def by_value(values: Mapping[int, str]) -> Groups:
    """Each value the processes hold, with its processes (sorted), in the order first held."""
    groups: dict[str, list[int]] = {}
    for p, value in sorted(values.items()):
        groups.setdefault(value, []).append(p)
    return groups


def differences(rows: Mapping[int, Iterable[tuple[Any, str]]]) -> list[tuple[Any, Groups]]:
    """Each name whose values differ between the processes, in order, with `by_value`'s groups.

    ``rows``: per process, its ``(name, value)`` pairs; a name a process lacks holds `ABSENT`.
    The one comparison behind every "the first X that differs" of a message.

    Examples:
        >>> differences({0: [("a", "1"), ("b", "2")], 1: [("a", "1"), ("b", "3")]})
        [('b', {'2': [0], '3': [1]})]
    """
    tables = {p: dict(row) for p, row in sorted(rows.items())}
    names = dict.fromkeys(k for table in tables.values() for k in table)  # in order, once each
    found = [(k, by_value({p: t.get(k, ABSENT) for p, t in tables.items()})) for k in names]
    return [(name, groups) for name, groups in found if len(groups) > 1]


def lines(groups: Mapping[str, list[int]]) -> str:
    """One indented line per value, naming its processes (``by_value``'s groups).

    Examples:
        >>> print(lines(by_value({2: "b", 0: "a", 1: "a"})))
          processes 0,1: a
          process 2: b
    """
    return "\n".join(f"  {processes(ps)}: {value}" for value, ps in groups.items())


def listed(groups: Mapping[str, list[int]]) -> str:
    """``"processes 0,1: float32[8]; process 2: float32[4]"``: who holds which value.

    Examples:
        >>> listed(by_value({2: "b", 0: "a", 1: "a"}))
        'processes 0,1: a; process 2: b'
    """
    return "; ".join(f"{processes(ps)}: {value}" for value, ps in groups.items())


def ordinal(n: int) -> str:
    """``"3rd"``: the n-th call of a sequence every process makes, as messages name it.

    Examples:
        >>> [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 112)]
        ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '112th']
    """
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def left_program(what: str, how: Mapping[int, str | None]) -> str:
    """The error for processes that left the program instead of making the call ``what``.

    ``how``: per process, its failure (``"ValueError: ..."``) or None when it ended normally.

    Examples:
        >>> left_program("meshkit.make_mesh", {1: None}).splitlines()[0]
        'meshkit.make_mesh: process 1 left the program without making this call (process 1 ended).'
    """
    said = "; ".join(
        f"process {p} " + (f"failed: {error}" if error else "ended")
        for p, error in sorted(how.items())
    )
    return (
        f"{what}: {processes(sorted(how))} left the program without making this call ({said}).\n"
        "Every process must make the same calls in the same order; consider what ended it early "
        "(its output says)."
    )
