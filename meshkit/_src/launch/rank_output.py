"""What the launcher's ranks print: read from their pipes, written to the terminal and logs.

Every line a rank wrote reaches its log before `launch` returns, however slowly the launcher's
own stdout is read: the pumps are joined before the logs close, and they stop waiting on a pipe
only when nothing could still write to it (the rank is dead and its leftovers were swept), after
reading whatever it still holds. A pipe can outlive its rank: a child the rank started keeps a
copy of it, so waiting for end-of-file alone could wait for ever.

What a person reads is kept short: gloo's note that a rank's connections are up (one line per
device and run, about 15 on a small run) reaches the logs but not the terminal (`is_chatter`).
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

# How long a pump still waits for more output once the launcher is done with the ranks.
DRAIN_S = 0.5
# How long joining the pumps waits while no line is written at all (a terminal nobody reads).
STALL_S = 30.0
# The most a pump reads from a pipe, without waiting, after it stopped waiting: a dead rank's pipe
# holds at most its buffer (64 KiB by default); this only bounds a writer that never stops.
_DRAIN_MAX_BYTES = 16 << 20
_CHUNK = 1 << 16
# gloo (JAX's CPU collectives) prints this for every device of every rank once its connections are
# up. With as many peers as expected it says only that all is well; a shortfall is kept. Two of
# a rank's threads may write it at once, cut into each other ("[Gloo] Rank [Gloo] Rank 1 is
# connected ..." then "0 is connected ..."): both halves are recognised.
_GLOO_CONNECTED = re.compile(
    r"(?:\[Gloo\] Rank )*(?:\d+ )?is connected to (\d+) peer ranks?\. "
    r"Expected number of connected peer ranks is : (\d+)"
)


def is_chatter(line: str) -> bool:
    """Whether ``line`` is gloo's note that a rank's connections are all up (nothing to read).

    Examples:
        >>> is_chatter("[Gloo] Rank 2 is connected to 3 peer ranks. "
        ...            "Expected number of connected peer ranks is : 3")
        True
        >>> is_chatter("[Gloo] Rank 2 is connected to 1 peer ranks. "
        ...            "Expected number of connected peer ranks is : 3")
        False
        >>> is_chatter("[Gloo] Rank [Gloo] Rank 1 is connected to 7 peer ranks. "
        ...            "Expected number of connected peer ranks is : 7")  # two threads at once
        True
    """
    match = _GLOO_CONNECTED.fullmatch(line.strip())
    return match is not None and match[1] == match[2]


class Sink:
    """Writes rank-prefixed lines to the terminal and per-rank log files, one line at a time.

    Writing never raises: a terminal that went away (SIGHUP, a closed pipe) stops the echo
    there, a full disk stops that log, and a line that arrives after `close` is dropped.
    """

    def __init__(
        self, stream: bool, log_dir: Path | None, ranks: int | Iterable[int], attempt: int = 0
    ) -> None:
        self.stream, self.log_dir = stream, log_dir
        self.lock = threading.Lock()
        self.logs: dict[int, IO[str]] = {}
        self.lines = 0  # written so far: how `join_pumps` sees progress
        self.closed = False
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            for r in range(ranks) if isinstance(ranks, int) else ranks:
                # A restart (attempt > 0) appends: every attempt's lines stay in one log.
                log = open(log_dir / f"rank{r}.log", "a" if attempt else "w", encoding="utf-8")  # noqa: SIM115
                if attempt:
                    log.write(f"--- meshkit launch: attempt {attempt}, after a restart ---\n")
                self.logs[r] = log

    def write(self, rank: int, line: str, is_err: bool) -> None:
        """Append ``line`` to rank ``rank``'s log, then echo it (``[rank<r>] line``).

        gloo's chatter (`is_chatter`) goes to the log only.
        """
        with self.lock:
            if self.closed:
                return
            self.lines += 1
            # The log first: a terminal read slowly must not hold back what the log shows.
            log = self.logs.get(rank)
            if log is not None:
                try:
                    log.write(line + "\n")
                    log.flush()
                except (OSError, ValueError):  # a full disk; closed by `close` that gave up
                    self.logs.pop(rank, None)
            if self.stream and not is_chatter(line):
                target = sys.stderr if is_err else sys.stdout
                try:
                    target.write(f"[rank{rank}] {line}\n")
                    target.flush()
                except (OSError, ValueError):
                    self.stream = False

    def note(self, line: str) -> None:
        """Print one line of the launcher's own (not a rank's) to stderr, when streaming."""
        with self.lock:
            if self.closed or not self.stream:
                return
            try:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                self.stream = False

    def close(self) -> None:
        """Flush and close the logs; later writes are dropped.

        A writer stuck on a terminal nobody reads holds the lock; after a second the logs are
        closed anyway (each line reaches its log before the terminal, so none is lost).
        """
        locked = self.lock.acquire(timeout=1.0)
        try:
            self.closed = True
            for log in list(self.logs.values()):
                with contextlib.suppress(OSError):
                    log.close()
            self.logs = {}
        finally:
            if locked:
                self.lock.release()


class Pump:
    """A thread that reads one pipe of a rank and hands each line to ``on_line``.

    Args:
        pipe: the read end (the pump closes it when done).
        on_line: called with each line, without its newline, decoded as UTF-8 (bad bytes
            replaced); a last line without a newline is passed too.
        name: the thread's name.
    """

    def __init__(self, pipe: IO[bytes], on_line: Callable[[str], None], name: str) -> None:
        self._pipe = pipe
        self._on_line = on_line
        self._stop_waiting_at: float | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def finish(self, drain_s: float = DRAIN_S) -> None:
        """Stop waiting for end-of-file ``drain_s`` seconds from now.

        Call it once nothing that should be heard can still write to the pipe. The pump then
        reads what the pipe holds without waiting, and ends.
        """
        self._stop_waiting_at = time.monotonic() + drain_s

    def _run(self) -> None:
        fd = self._pipe.fileno()
        pending = b""
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                while True:
                    limit = self._stop_waiting_at
                    if limit is not None and time.monotonic() >= limit:
                        pending = self._drain(fd, pending)
                        break
                    if not sel.select(timeout=0.1):
                        continue
                    chunk = os.read(fd, _CHUNK)
                    if not chunk:
                        break
                    pending = self._emit(pending + chunk)
        except OSError:
            pass  # the pipe failed under us: keep what was read
        finally:
            if pending:
                self._on_line(pending.decode("utf-8", errors="replace"))
            with contextlib.suppress(OSError):
                self._pipe.close()

    def _drain(self, fd: int, pending: bytes) -> bytes:
        os.set_blocking(fd, False)
        taken = 0
        while taken < _DRAIN_MAX_BYTES:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break
            taken += len(chunk)
            pending = self._emit(pending + chunk)
        return pending

    def _emit(self, data: bytes) -> bytes:
        *lines, rest = data.split(b"\n")
        for raw in lines:
            self._on_line(raw.decode("utf-8", errors="replace"))
        return rest


def join_pumps(pumps: list[Pump], sink: Sink, drain_s: float = DRAIN_S) -> None:
    """Let ``pumps`` finish (see `Pump.finish`) and wait for them while lines still flow.

    The wait has no fixed limit, so a slow reader of the terminal still gets every line; it
    gives up after `STALL_S` seconds in which not one line was written.
    """
    for p in pumps:
        p.finish(drain_s)
    seen, since = sink.lines, time.monotonic()
    for p in pumps:
        while p.thread.is_alive():
            p.thread.join(timeout=0.1)
            if sink.lines != seen:
                seen, since = sink.lines, time.monotonic()
            elif time.monotonic() - since > STALL_S:
                return
