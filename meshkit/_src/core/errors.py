"""The one error family of meshkit.

Every error meshkit raises on purpose is a `MeshkitError`, a `ValueError`, so code
that already catches ``ValueError`` around JAX calls keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "DivergenceError",
    "LaunchError",
    "MeshkitError",
    "MeshkitIndexError",
    "MeshkitNameError",
    "MeshkitTypeError",
    "ranges",
]


class MeshkitError(ValueError):
    """Raised when meshkit is called wrongly or processes of a program disagree.

    Messages follow one template: what was called, what was given, the rule that was broken, and
    a "Consider ..." line with the likely fix.
    """


class LaunchError(MeshkitError):
    """Raised by the local launcher (``meshkit launch``) for bad arguments or a failed run."""


class DivergenceError(MeshkitError):
    """Raised when the processes of a program differ where they must be the same.

    In debug mode: the processes stopped making the same calls. At `meshkit.init` (its
    preflight): they run different software or settings. At a compilation: they compiled
    different programs. In an assembly (`meshkit.global_array_from_local`,
    `meshkit.global_batches`): their parts do not fit together. Every process that reaches the
    check raises it, with the same message: what each process did or passed, the first field
    that differs (which function was called, the arguments' structure, one argument's shape,
    dtype or sharding, a version or a `jax.config` setting) or the processes that did not
    arrive, and where each process made the call. Under ``meshkit launch`` the report names the
    process it names as the root cause, when it names one.

    Attributes:
        processes: the ids of the processes that differ from a majority of the others (or did
            not arrive while most did); all of those involved where no majority says which is
            wrong (two processes that disagree).
        field: what differs: ``"entry"``, ``"function"``, ``"program"``, ``"structure"``, an
            argument's name or an array's pytree path, a field of the preflight (``"jax"``,
            ``"jax_enable_x64"``, ...), or ``"arrival"``.
    """

    def __init__(
        self, message: str, *, processes: list[int] | None = None, field: str = ""
    ) -> None:
        super().__init__(message)
        self.processes = list(processes or [])
        self.field = field


class MeshkitTypeError(MeshkitError, TypeError):
    """A `MeshkitError` where JAX raises `TypeError` for the same mistake (kept catchable as both).

    `meshkit.pmap_compat` raises it where `jax.pmap` raises `TypeError` (a non-callable function,
    ``in_axes`` that are not ints or None), so code and tests written against `jax.pmap` keep
    working.
    """


class MeshkitIndexError(MeshkitError, IndexError):
    """A `MeshkitError` where JAX raises `IndexError` (a mapped axis beyond an argument's rank)."""


class MeshkitNameError(MeshkitError, NameError):
    """A `MeshkitError` where JAX raises `NameError` (a collective over an unbound axis name)."""


# Public classes print (and pickle) under the name users import them by.
for _public in (
    MeshkitError,
    LaunchError,
    DivergenceError,
    MeshkitTypeError,
    MeshkitIndexError,
    MeshkitNameError,
):
    _public.__module__ = "meshkit"
del _public


def ranges(values: Iterable[int], sep: str = ", ") -> str:
    """Integers folded into runs for a message: ``0-2, 5`` for 5, 0, 2, 1 (each named once)."""
    out: list[str] = []
    ordered = sorted(set(values))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return sep.join(out)
