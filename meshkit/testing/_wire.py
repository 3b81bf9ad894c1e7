"""Messages between a `WarmCluster` and its workers: pickles, each after its 8-byte length.

Both ends are on this machine (127.0.0.1) and started by the same user; the connection is
authenticated by a random token the worker sends first, so no other local program can hand a
worker code to run.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
from typing import Any

__all__ = ["Call", "Hello", "Reply", "receive", "send"]

_LENGTH = struct.Struct("!Q")


@dataclasses.dataclass(frozen=True)
class Hello:
    """A worker's first message: who it is, and the token that proves it was launched by us."""

    token: str
    rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class Call:
    """Run ``qualname`` from the module at ``file`` with ``args``, under ``env``."""

    file: str
    qualname: str
    args: tuple[Any, ...]
    env: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Reply:
    """What one call did on one worker: ``value`` is a pickle, ``error`` a traceback or None."""

    value: bytes | None
    stdout: str
    error: str | None


def send(sock: socket.socket, message: object) -> None:
    """Send one message."""
    data = pickle.dumps(message)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            return None  # the other end closed
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket) -> object | None:
    """The next message, or None once the other end has closed the connection."""
    head = _exactly(sock, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    body = _exactly(sock, size)
    return None if body is None else pickle.loads(body)
