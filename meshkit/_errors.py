"""The one error family of meshkit.

Every error meshkit raises on purpose is a `MeshkitError`, a `ValueError`, so code
that already catches ``ValueError`` around JAX calls keeps working.
"""

from __future__ import annotations

__all__ = ["DivergenceError", "LaunchError", "MeshkitError"]


class MeshkitError(ValueError):
    """Raised when meshkit is called wrongly or processes of a program disagree.

    Messages follow one template: what was called, what was given, the rule that was broken, and
    a "Consider ..." line with the likely fix.
    """


class LaunchError(MeshkitError):
    """Raised by the local launcher (``meshkit launch``) for bad arguments or a failed run."""


class DivergenceError(MeshkitError):
    """Raised in debug mode when the processes of a program stopped making the same calls.

    Every process that reaches the check raises it, with the same message: the processes that
    differ, the first field that differs (which function was called, the arguments' structure,
    one argument's shape, dtype or sharding) or the processes that did not arrive, and where
    each process made the call.

    Attributes:
        processes: the ids of the processes that differ from the rest (or did not arrive).
        field: what differs: ``"entry"``, ``"structure"``, an argument's name, or
            ``"arrival"``.
    """

    def __init__(
        self, message: str, *, processes: list[int] | None = None, field: str = ""
    ) -> None:
        super().__init__(message)
        self.processes = list(processes or [])
        self.field = field
