"""Which host each process runs on, learned in one exchange when the processes join.

A host is named by its hostname and boot id (``MESHKIT_HOST`` overrides); one `gather` collects
every name and publishes a run-length table. `make_mesh` keeps inner axes inside a host.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..coord import agree as _agree
from ..coord import gather as _gather
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core.errors import MeshkitError, ranges

ENV_HOST = "MESHKIT_HOST"
_TAG = "hosts"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class Hosts:
    """The hosts of a program: which processes run on which machine.

    Attributes:
        names: each host's name (hostname or ``MESHKIT_HOST``; ``#2``... for a repeated name),
            ordered by their lowest process.
        of_process: for each process, the index of its host in ``names``.

    Examples:
        >>> hosts = Hosts(names=("node-a", "node-b"), of_process=(0, 1, 0, 1))
        >>> hosts.processes(1)
        (1, 3)
        >>> print(hosts)
        node-a: processes 0,2; node-b: processes 1,3
    """

    names: tuple[str, ...]
    of_process: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def host_of(self, process: int) -> str:
        """The name of the host that runs ``process``."""
        return self.names[self.of_process[process]]

    def processes(self, host: int) -> tuple[int, ...]:
        """The processes of host number ``host``, ascending."""
        return tuple(p for p, h in enumerate(self.of_process) if h == host)

    def __str__(self) -> str:
        members = [self.processes(h) for h in range(len(self.names))]
        return "; ".join(
            f"{name}: process{'es' if len(ps) > 1 else ''} {ranges(ps, sep=',')}"
            for name, ps in zip(self.names, members, strict=True)
        )

    def to_json(self) -> str:
        """Run-length text: ``[[name, ...], [[host, count], ...]]`` (small when node-major)."""
        runs = [[h, len(list(run))] for h, run in itertools.groupby(self.of_process)]
        return json.dumps([list(self.names), runs], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Hosts:
        names, runs = json.loads(text)
        return cls(tuple(names), tuple(h for h, count in runs for _ in range(count)))

    @classmethod
    def of(cls, identities: Sequence[str]) -> Hosts:
        """The table of processes whose identities (`here`, by process) are given.

        An identity is a name, a NUL character and a machine id; equal ones are one host.
        """
        first = {ident: i for i, ident in enumerate(dict.fromkeys(identities))}
        shown: list[str] = []
        seen: dict[str, int] = {}
        for ident in first:
            name = ident.split("\0", 1)[0]
            seen[name] = seen.get(name, 0) + 1
            shown.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
        return cls(tuple(shown), tuple(first[i] for i in identities))


def here() -> str:
    """This process's host identity: its name, a NUL character, and the machine's boot id."""
    name = os.environ.get(ENV_HOST, "").strip()
    if name:
        return f"{name}\0"
    boot = ""
    with contextlib.suppress(OSError), open(_BOOT_ID) as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}\0{boot}"


def _combine(values: Mapping[int, str]) -> str:
    return Hosts.of([values[p] for p in sorted(values)]).to_json()


_TABLE: Hosts | None = None


def known() -> Hosts | None:
    """The hosts this process learned (at `meshkit.init`, or at the first `make_mesh`)."""
    n = _compat.distributed_state()[2]
    return _TABLE if _TABLE is not None and len(_TABLE.of_process) == n else None


def table(timeout: float, what: str) -> Hosts:
    """The hosts of the program, learned at the first call (one `gather`) and kept."""
    global _TABLE
    found = known()
    if found is not None:
        return found
    _, me, n = _compat.distributed_state()
    node = _agree.node()
    if n == 1 or node is None:
        _TABLE = Hosts.of([here()])
        return _TABLE
    got = _gather.gather(node.service, me, n, _TAG, here(), _combine, timeout=timeout)
    if got.answer is None:
        raise MeshkitError(
            f"{what}: {_missing.did_not(got.missing, timeout=timeout)} to say which host it runs "
            "on, though every process had joined.\nConsider the output of "
            f"{_missing.processes(got.missing)} (a crash or a stall), and that every process makes "
            "the same calls."
        )
    _TABLE = Hosts.from_json(got.answer)
    return _TABLE
