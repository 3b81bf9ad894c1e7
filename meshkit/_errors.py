"""The one error family of meshkit.

Every error meshkit raises on purpose is a `MeshkitError`, a `ValueError`, so code
that already catches ``ValueError`` around JAX calls keeps working.
"""

from __future__ import annotations

__all__ = ["LaunchError", "MeshkitError"]


class MeshkitError(ValueError):
    """Raised when meshkit is called wrongly or processes of a program disagree.

    Messages follow one template: what was called, what was given, the rule that was broken, and
    a "Consider ..." line with the likely fix.
    """


class LaunchError(MeshkitError):
    """Raised by the local launcher (``meshkit launch``) for bad arguments or a failed run."""
