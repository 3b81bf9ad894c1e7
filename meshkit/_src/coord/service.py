"""One typed interface to the coordination service of ``jax.distributed`` (`Service`).

Expected outcomes are values, not exceptions: a blocking read that times out returns None, a
barrier returns a `Barrier`, told apart by the gRPC status code the client reports, never by
message text. Any other failure (the service is gone, say) propagates as JAX raised it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core import compat as _compat

# gRPC status codes the coordination service answers with (grpc/status.h).
DEADLINE_EXCEEDED = 4
UNAVAILABLE = 14
# The codes of a service that is gone (its host exited, or the connection to it broke), as
# opposed to one that is slow (DEADLINE_EXCEEDED) or refuses a request: CANCELLED, UNKNOWN,
# ABORTED, INTERNAL and UNAVAILABLE.
GONE = frozenset({1, 2, 10, 13, UNAVAILABLE})


class Barrier(enum.Enum):
    """How a wait at a barrier ended."""

    PASSED = "passed"  # every participant arrived
    TIMED_OUT = "timed out"  # the barrier's timeout expired first (now or for earlier waiters)
    REFUSED = "refused"  # the service refused it (participant lists that differ, ...)


class Service(Protocol):
    """The coordination service as one process sees it: a key-value store and barriers.

    Keys are ``/``-separated paths; values are text. Timeouts are in seconds.
    """

    def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
        """Write ``key``; without ``overwrite``, writing an existing key is an error."""
        ...

    def get(self, key: str, timeout: float) -> str | None:
        """The value of ``key`` once written; None if it is not written within ``timeout``."""
        ...

    def dir_get(self, prefix: str) -> list[tuple[str, str]]:
        """Every ``(key, value)`` under ``prefix`` (which ends with ``/``), now."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``, or every key under it when it ends with ``/``."""
        ...

    def increment(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if unset), atomically; the new value."""
        ...

    def barrier(
        self, name: str, timeout: float, participants: Sequence[int] | None = None
    ) -> Barrier:
        """Wait at this process's next use of barrier ``name`` until ``participants`` arrive.

        Processes that arrive at one use with different participant lists are all refused.
        """
        ...


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class JaxService:
    """`Service` over the client of ``jax.distributed`` (see `_compat.distributed_state`)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
        self._client.key_value_set(key, value, allow_overwrite=overwrite)

    def get(self, key: str, timeout: float) -> str | None:
        try:
            return str(self._client.blocking_key_value_get(key, _ms(timeout)))
        except Exception as e:  # JaxRuntimeError; only a deadline is an expected outcome
            if _compat.service_error_code(e) != DEADLINE_EXCEEDED:
                raise
        return None

    def dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(str(k), str(v)) for k, v in self._client.key_value_dir_get(prefix)]

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)

    def increment(self, key: str, amount: int) -> int:
        return int(self._client.key_value_increment(key, amount))

    def barrier(
        self, name: str, timeout: float, participants: Sequence[int] | None = None
    ) -> Barrier:
        ids = None if participants is None else list(participants)
        try:
            self._client.wait_at_barrier(name, _ms(timeout), ids)
        except Exception as e:  # JaxRuntimeError: the barrier did not pass
            # Every status other than a deadline means the service will not let it pass (a
            # participant list of another process, a barrier spoiled earlier, a lost service):
            # the waiter stops and reads the records to say why.
            timed_out = _compat.service_error_code(e) == DEADLINE_EXCEEDED
            return Barrier.TIMED_OUT if timed_out else Barrier.REFUSED
        return Barrier.PASSED


@dataclass
class Stats:
    """Round trips to the coordination service made by one process (for tests and bench)."""

    rpcs: int = 0
    agreements: int = 0

    def reset(self) -> None:
        self.rpcs = self.agreements = 0


class Counted:
    """A `Service` that counts its round trips in ``stats.rpcs``: each method call is one."""

    def __init__(self, inner: Service, stats: Stats) -> None:
        self.inner, self.stats = inner, stats

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.stats.rpcs += 1
            return call(*args, **kwargs)

        return counted
