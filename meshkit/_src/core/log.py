"""meshkit's messages for people, through `logging` under the ``"meshkit"`` logger.

Where the program configured no logging, the first message installs a handler writing each
message to ``sys.stderr`` as it is (it steps aside once the program adds one) and sets the
level to INFO where unset. Nothing is installed at import.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import TextIO

ROOT = "meshkit"

_lock = threading.Lock()
_said = threading.Event()  # a first message was said: the level and handler are settled


class _Stderr(logging.StreamHandler):
    """The default handler: the message alone, to the ``sys.stderr`` of the moment of the call."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # no stream of its own, as logging's last-resort handler
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    def handle(self, record: logging.LogRecord) -> bool:
        if _configured(besides=self):
            return False  # the program's own handlers have it (through propagation)
        return bool(super().handle(record))


def _configured(besides: logging.Handler | None = None) -> bool:
    """Whether the program put a handler on ``"meshkit"`` or on the root logger."""
    mine = [h for h in logging.getLogger(ROOT).handlers if h is not besides]
    return bool(mine or logging.getLogger().handlers)


def _first_message() -> None:
    """At the first message: the level INFO where unset, the stderr handler where none is."""
    with _lock:
        if _said.is_set():
            return
        top = logging.getLogger(ROOT)
        if top.level == logging.NOTSET:
            top.setLevel(logging.INFO)
        if not _configured():
            top.addHandler(_Stderr())
        _said.set()


def logger(concept: str) -> logging.Logger:
    """The logger of one concept: ``logging.getLogger("meshkit." + concept)``."""
    return logging.getLogger(f"{ROOT}.{concept}")


def say(log: logging.Logger, level: int, text: str) -> None:
    """Log ``text`` (one trailing newline dropped: the handler adds it); never raises."""
    with contextlib.suppress(Exception):
        _first_message()
        log.log(level, text.removesuffix("\n"), stacklevel=2)  # the record names our caller


def flush() -> None:
    """Flush the handlers of meshkit's loggers and the root logger (before ``os._exit``)."""
    ours = list(logging.Logger.manager.loggerDict.items())  # a copy: others may add loggers
    ours = [v for k, v in ours if k.startswith(ROOT + ".") and isinstance(v, logging.Logger)]
    for each in [logging.getLogger(), logging.getLogger(ROOT), *ours]:
        for handler in list(each.handlers):
            with contextlib.suppress(Exception):
                handler.flush()
