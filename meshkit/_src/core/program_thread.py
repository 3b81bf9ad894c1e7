"""The program's thread: the one that called `meshkit.init` (the main thread before that).

A multi-process program's calls pair up across processes in program order. That order is the
order of one thread: usually the main thread, but Ray Train's ``JaxTrainer`` runs the training
function in a worker thread of its own, and so do other engines. The thread that called
`meshkit.init` is taken to be the program's thread wherever it runs; `meshkit.channel` stays for a
program's *other* threads. Signals are another matter: only Python's main thread may take them.
"""

from __future__ import annotations

import threading

__all__ = ["adopt", "is_program_thread", "program_thread"]

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
    """Whether the calling thread is the program's thread."""
    return threading.current_thread() is program_thread()
