"""The one error family of meshkit: `MeshkitError`, a `ValueError`, and its subclasses."""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class MeshkitError(ValueError):
    """Raised when meshkit is called wrongly or processes of a program disagree.

    Examples:
        >>> import meshkit
        >>> issubclass(meshkit.MeshkitError, ValueError)
        True
    """


class LaunchError(MeshkitError):
    """Raised by the local launcher (``meshkit launch``) for bad arguments or a failed run."""


class DivergenceError(MeshkitError):
    """Raised when the processes of a program differ where they must be the same.

    Raised by every process that reaches the check (debug mode, the preflight, the program
    comparison, an assembly), with the same message.

    Attributes:
        processes: the processes that differ from a majority (all involved where none holds).
        field: what differs (``"function"``, ``"program"``, an argument, a preflight field,
            ``"arrival"``...).

    Examples:
        >>> import meshkit
        >>> meshkit.DivergenceError("differ", processes=[1], field="jax").processes
        [1]
    """

    def __init__(
        self, message: str, *, processes: list[int] | None = None, field: str = ""
    ) -> None:
        super().__init__(message)
        self.processes = list(processes or [])
        self.field = field


class MeshkitTypeError(MeshkitError, TypeError):
    """A `MeshkitError` where JAX raises `TypeError` for the same mistake (catchable as both)."""


class MeshkitIndexError(MeshkitError, IndexError):
    """A `MeshkitError` where JAX raises `IndexError` (a mapped axis beyond an argument's rank)."""


class MeshkitNameError(MeshkitError, NameError):
    """A `MeshkitError` where JAX raises `NameError` (a collective over an unbound axis name)."""


# Public classes print (and pickle) under the name users import them by.
for _public in (MeshkitError, LaunchError, DivergenceError, MeshkitTypeError, MeshkitIndexError,
                MeshkitNameError):  # fmt: skip
    _public.__module__ = "meshkit"
del _public


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in "..." where cut (a value in a message)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ranges(values: Iterable[int], sep: str = ", ") -> str:
    """Integers folded into runs for a message: ``0-2, 5`` for 5, 0, 2, 1 (each named once)."""
    runs = itertools.groupby(enumerate(sorted(set(values))), lambda iv: iv[1] - iv[0])
    firsts_lasts = [(run[0][1], run[-1][1]) for run in (list(r) for _, r in runs)]
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in firsts_lasts)
