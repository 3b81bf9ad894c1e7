"""The program's thread: the one that called `meshkit.init` (the main thread before that).

Calls pair up across processes in the order of this thread (Ray Train runs the program in a
worker thread); only the main thread may take signals.
"""

from __future__ import annotations

import threading

_thread: threading.Thread | None = None


def adopt() -> None:
    """Make the calling thread the program's thread (at `meshkit.init`; the first call wins)."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.current_thread()


def program_thread() -> threading.Thread:
    """The thread whose calls pair up with the other processes' without a channel."""
    thread = _thread
    return thread if thread is not None and thread.is_alive() else threading.main_thread()


def is_program_thread() -> bool:
    return threading.current_thread() is program_thread()
