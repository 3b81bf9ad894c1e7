"""What a failure's text says about its cause, when JAX's own cross-process machinery ended it.

A process that waits for another process that never comes ends in JAX's timeouts, not in
meshkit's: gloo's key exchange (``Gloo context initialization failed: DEADLINE_EXCEEDED:
GetKeyValue() timed out``), NCCL's watchdog, the coordination service's barriers. A process
whose peer is gone ends in gRPC's words (``UNAVAILABLE``, ``Stream removed``) or in the
coordination service's fatal error (``another task died``). Such an error names neither the
process that is missing nor why. `diagnose` recognises them, so that the fail-fast hook can
say what usually causes them and what to run next, and ``meshkit launch`` can look for the rank
the evidence points to instead of blaming the first one to exit.

Only JAX's, gloo's and NCCL's own words are read here: what meshkit itself has to tell (a rank
failed and told the others, a meshkit check waited for a rank in vain) is a ``failed`` event
(`meshkit._src.core.events`), which `from_event` classifies the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ENDED_MARK", "Diagnosis", "diagnose", "explain", "from_event"]

# Words of the note a process prints once it reached the end of its program while others still
# run (`meshkit._src.lifecycle.failfast`); for people only: the launcher reads the ``ended`` event.
ENDED_MARK = "reached the end of its program"


@dataclass(frozen=True)
class Diagnosis:
    """A failure that JAX's cross-process machinery reported.

    Attributes:
        kind: ``"timeout"`` (this process waited for another that never joined) or ``"lost"``
            (another process, or the coordination service it hosted, is gone).
        system: what reported it: ``"gloo"``, ``"NCCL"``, ``"the coordination service"`` or
            ``"meshkit"`` (its failure watch, or one of its checks).
        line: the line of the text that says so (for an event: the error's name).
        process: the process the failure names (only a ``failed`` event names one): the one
            that failed first (``"lost"``), or the one a meshkit check waited for in vain.
    """

    kind: str
    system: str
    line: str
    process: int | None = None


_RULES: tuple[tuple[str, str, re.Pattern[str]], ...] = tuple(
    (kind, system, re.compile(pattern, re.IGNORECASE))
    for kind, system, pattern in (
        ("timeout", "gloo", r"gloo.*(timed? ?out|deadline_exceeded)"),
        ("timeout", "NCCL", r"nccl.*(timed? ?out|timeout|watchdog)"),
        ("lost", "NCCL", r"nccl.*(remote process exited|connection closed|failed)"),
        ("timeout", "the coordination service", r"(GetKeyValue|barrier).*timed out"),
        ("timeout", "the coordination service", r"DEADLINE_EXCEEDED"),
        ("lost", "the coordination service", r"another task died"),
        ("lost", "the coordination service", r"leader task was preempted|Stream removed"),
        ("lost", "the coordination service", r"UNAVAILABLE|Socket closed|Connection reset"),
        ("lost", "gloo", r"gloo.*(connection closed|connection reset|Read error|EOF)"),
    )
)


def diagnose(text: str) -> Diagnosis | None:
    """The first line of ``text`` that a known cross-process failure wrote, classified."""
    for line in text.splitlines():
        for kind, system, pattern in _RULES:
            if pattern.search(line):  # JAX's, gloo's and NCCL's words name no process
                return Diagnosis(kind, system, line.strip())
    return None


def from_event(fields: Mapping[str, Any]) -> Diagnosis | None:
    """The diagnosis a rank recorded in its ``failed`` event, or None for an error of its own.

    Args:
        fields: the event's fields: ``cause`` ``"peer"`` (another process failed first; its id
            in ``process``) or ``"timeout"`` (a cross-process wait ran out; ``system`` says
            whose, ``process`` whom a meshkit check waited for) make a diagnosis; any other
            cause (an exception, a signal) is the rank's own error.

    Example:
        >>> from_event({"cause": "peer", "process": 3, "system": "meshkit"}).kind
        'lost'
        >>> from_event({"cause": "exception", "error": "KeyError"}) is None
        True
    """
    cause = fields.get("cause")
    if cause not in ("peer", "timeout"):
        return None
    raw = fields.get("process")
    process = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    system = str(fields.get("system") or ("meshkit" if process is not None else "JAX"))
    kind = "lost" if cause == "peer" else "timeout"
    return Diagnosis(kind, system, str(fields.get("error") or ""), process)


def explain(diagnosis: Diagnosis, who: str = "this process") -> str:
    """What usually causes ``diagnosis``, and what to run next (several lines, no newline)."""
    if diagnosis.kind == "timeout":
        what = (
            f"a timeout of {diagnosis.system}: {who} waited for another process that never joined"
        )
    else:
        what = (
            f"reported by {diagnosis.system}: another process of the program (or the "
            "coordination service, which process 0 hosts) is gone"
        )
    return (
        f"meshkit: this error is {what}.\n"
        "Usual causes: a computation or collective run by only some processes (a branch on "
        "jax.process_index(), a value read on one process only), or a process that exited, "
        "crashed or stalled first; its own output holds the cause.\n"
        "Consider running again with MESHKIT_DEBUG=1: debug mode names the first meshkit call "
        "where processes differ, and its stall watchdog prints where each process waits."
    )
