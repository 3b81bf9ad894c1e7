"""The checkpoint calls' cross-process verdict, reached before orbax is called.

Each call describes what its process was given as entries (``[where, kind, in words]``) and a
problem found locally, if any; `agree_on` compares them in one barrier and raises the same
`MeshkitError` everywhere when they differ, so no process is left waiting inside orbax.
"""

from __future__ import annotations

import json
from typing import Any

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from . import data as _data


def agree_on(what: str, tag: str, entries: list[Any], problem: str | None, doing: str) -> None:
    """Agree on ``entries`` and ``problem`` across processes; raise the verdict on every one."""
    if _compat.distributed_state()[2] > 1:
        mine = json.dumps({"entries": entries, "problem": problem}, sort_keys=True)
        timeout = _env.check_timeout()
        outcome = _agree.check(_channel.scoped(tag, what), mine, mine, timeout=timeout, what=what)
        if not outcome.agreed and (outcome.missing or outcome.gave_up):
            gone = (
                f"{_missing.stopped_waiting(outcome.gave_up)} for this process (their wait ran "
                "out before it arrived)"
                if not outcome.missing
                else _missing.did_not(outcome.missing, timeout=timeout, arrive="reach this call")
                + " (the others did)"
            )
            raise MeshkitError(
                f"{what}: {gone}.\nEvery process must {doing}, in the same order.\n"
                f"Consider looking at those processes' output; {_env.ENV_CHECK_TIMEOUT} sets the "
                "wait."
            )
        if not outcome.agreed and problem is None:  # a process with a problem raises its own
            records = {p: json.loads(v) for p, v in sorted(outcome.records.items())}
            for p, record in records.items():
                if record["problem"] is not None:
                    raise MeshkitError(
                        f"{what}: process {p} refused the call:\n{record['problem']}"
                    )
            raise MeshkitError(difference(what, records, doing))
    if problem is not None:
        raise MeshkitError(problem)


_SHARED_VALUES = (
    "Consider computing what differs from values every process shares (host values are written "
    "by process 0 alone: any other process's would be lost)."
)
_SHARED_PATH = (
    "Consider a path every process computes the same way, on a filesystem they all see (not "
    "tempfile.mkdtemp() in each process)."
)


def difference(what: str, records: dict[int, dict[str, Any]], doing: str) -> str:
    """The message naming the first entry where the processes' records differ."""
    ref_p, ref = next(iter(records.items()))
    for p, record in records.items():
        a, b = ref["entries"], record["entries"]
        for x, y in zip(a, b, strict=False):
            if x != y:
                fix = {"path": _SHARED_PATH, "data": _data.DATA_FIX}.get(x[1], _SHARED_VALUES)
                return (
                    f"{what}: processes {ref_p} and {p} differ at {x[0]}: {x[-1]} on "
                    f"process {ref_p}, {y[-1]} on process {p}.\nEvery process must {doing}."
                    f"\n{fix}"
                )
        if len(a) != len(b):
            count = [sum(1 for e in entries if e[1] != "path") for entries in (a, b)]
            return (
                f"{what}: process {ref_p} has {count[0]} leaves, process {p} has {count[1]}."
                f"\nEvery process must {doing}."
            )
    return f"{what}: the processes' calls differ.\nEvery process must {doing}."  # pragma: no cover
