"""Debug mode's state in this process: its settings, and what its checks remember."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..coord import agreement as _agreement
from ..lifecycle import watchdog as _watchdog

# Agreements that repeat a pattern for PERIOD calls in a row take one round trip (`predict`).
PERIOD = _agreement.SPAN


@dataclass(frozen=True)
class Settings:
    """What debug mode is doing now.

    Attributes:
        timeout: seconds a call waits for the other processes' fingerprints.
        watchdog: seconds without progress before the stacks are dumped; None: no watchdog.
        exit_on_stall: whether a process still stalled ``timeout`` seconds after the dump exits.
    """

    timeout: float
    watchdog: float | None
    exit_on_stall: bool


class State:
    """Debug mode's state in this process (one instance, guarded by `lock`)."""

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.count = 0  # SPMD entries checked in this process, all threads
        self.last = ""  # the last checked call, for messages
        self.channels: set[str | None] = set()  # the channels of checked calls (None: main)
        self.previous: dict[str, dict[str, Any]] = {}  # per tag, the last call's fingerprint
        self.sites: dict[str, Any] = {}  # `.multihost`'s functions checked since `enable`
        self.watchdog: _watchdog.Watchdog | None = None
        self.left = False  # this process told the others it leaves
        self.announced: Settings | None = None  # the settings last announced


state = State()
lock = threading.RLock()


def enabled() -> bool:
    """Whether debug mode is on in this process."""
    return state.settings is not None
