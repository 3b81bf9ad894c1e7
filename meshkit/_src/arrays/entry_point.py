"""Which public function an assembly's messages name, and whether it takes ``pad=``.

`meshkit.global_array_from_local`, `meshkit.global_batches` (in its helper thread) and the host
arguments of `meshkit.spmd` / `meshkit.pmap_compat` all assemble through `meshkit._src.arrays`;
a message names the function the user called, and suggests ``pad=True`` only where it exists.
A context variable carries it, so the helpers below the assembly never take a ``what`` argument.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["WHAT", "calling", "pads", "set_caller", "who"]

WHAT = "meshkit.global_array_from_local"  # the default


@dataclass(frozen=True)
class _Caller:
    name: str  # the public function messages name
    pads: bool  # whether it takes pad= (the fixes for an uneven batch suggest it)


_DEFAULT_CALLER = _Caller(WHAT, pads=True)  # frozen: safe to share as the default
# Which public function messages name: global_batches sets it in its helper thread, spmd around
# its assembly of host arguments.
_caller: contextvars.ContextVar[_Caller] = contextvars.ContextVar(
    "meshkit_caller", default=_DEFAULT_CALLER
)


def who() -> str:
    """The public meshkit function the current assembly runs for, for messages."""
    return _caller.get().name


def set_caller(name: str) -> None:
    """Name ``name`` in this thread's messages (the thread's own context)."""
    _caller.set(_Caller(name, pads=True))


@contextlib.contextmanager
def calling(name: str, *, pads: bool) -> Iterator[None]:
    """Name ``name`` in the messages of assemblies inside the block; ``pads``: it takes pad=."""
    token = _caller.set(_Caller(name, pads))
    try:
        yield
    finally:
        _caller.reset(token)


def pads() -> bool:
    """Whether the public function the current assembly runs for takes ``pad=``."""
    return _caller.get().pads
