"""Which public function an assembly's messages name, and whether it takes ``pad=``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

WHAT = "meshkit.global_array_from_local"  # the default
# (the public function messages name, whether it takes pad=): set by global_batches' helper
# thread, and around spmd's assembly of host arguments.
_caller: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "meshkit_caller", default=(WHAT, True)
)


def who() -> str:
    """The public meshkit function the current assembly runs for, for messages."""
    return _caller.get()[0]


def pads() -> bool:
    """Whether that function takes ``pad=`` (the fixes for an uneven batch suggest it)."""
    return _caller.get()[1]


def set_caller(name: str) -> None:
    """Name ``name`` in this thread's messages."""
    _caller.set((name, True))


@contextlib.contextmanager
def calling(name: str, *, pads: bool) -> Iterator[None]:
    """Name ``name`` in the messages of assemblies inside the block."""
    token = _caller.set((name, pads))
    try:
        yield
    finally:
        _caller.reset(token)
