"""What a failure's text says about its cause, when JAX's cross-process machinery ended it.

`diagnose` recognises gloo's, NCCL's and the coordination service's timeouts and lost-peer
errors (which name no process); `from_event` classifies a rank's ``failed`` event the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Words of fail-fast's end note (for people; the launcher reads the ``ended`` event).
ENDED_MARK = "reached the end of its program"


@dataclass(frozen=True)
class Diagnosis:
    """A failure that JAX's cross-process machinery reported."""

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
    """The diagnosis a rank recorded in its ``failed`` event, or None for an error of its own."""
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
    what = (
        f"a timeout of {diagnosis.system}: {who} waited for another process that never joined"
        if diagnosis.kind == "timeout"
        else f"reported by {diagnosis.system}: another process of the program (or the "
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
