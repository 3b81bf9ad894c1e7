"""``pmap_compat(f).lower(...)`` and its ``.compile()``, called with f's own arguments.

They wrap JAX's `Lowered` and `Compiled` with the entry's placement, so the compiled function
works in any process count (`jax.pmap`'s does not across processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..core.errors import MeshkitTypeError
from ..core.tracebacks import public
from ..spmd.placement import dynamic
from .entry import Entry

__all__ = ["Compiled", "Lowered", "Stage", "signature"]


def signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    """Each leaf's shape and dtype as given (before placement)."""
    return [(tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves]


@dataclass(frozen=True)
class Stage:
    """What a lowering fixed: the call key and structure, the leaves' signature, the entry."""

    what: str
    static: tuple[int, ...]
    key: Any
    treedef: Any
    given: list[tuple[tuple[int, ...], str]]
    entry: Entry


class Lowered:
    """``pmap_compat(f).lower(...)``: JAX's `Lowered`, with `compile` keeping f's signature."""

    def __init__(self, stage: Stage, lowered: Any) -> None:
        self._stage = stage
        self.lowered = lowered

    @public
    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        """Compile; the result is called like the pmapped function."""
        return Compiled(self._stage, self.lowered.compile(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)  # as_text, compiler_ir, cost_analysis, ...


class Compiled:
    """A compiled `pmap_compat` function: call it with the arguments it was lowered for."""

    def __init__(self, stage: Stage, compiled: Any) -> None:
        self._stage = stage
        self.compiled = compiled

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage
        n_args, static_vals, _ = stage.key
        if stage.static and len(args) == n_args:  # static arguments given again: they must match
            given = tuple(args[i] for i in stage.static)
            if given != static_vals:
                raise MeshkitTypeError(
                    f"{stage.what}: compiled for static arguments {static_vals}, called with "
                    f"{given}.\nConsider lowering again for these values."
                )
            args = dynamic(args, stage.static)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if treedef != stage.treedef:
            raise MeshkitTypeError(
                f"{stage.what}: Function compiled with input pytree does not match the input "
                f"pytree it was called with.\ncompiled for: {stage.treedef}\ncalled with:  "
                f"{treedef}\nConsider calling it with the (non-static) arguments it was lowered "
                "for, or lowering again."
            )
        now = signature(leaves)
        if now != stage.given:
            rows = [
                f"  {where}: compiled for {want[1]}{list(want[0])}, called with "
                f"{got[1]}{list(got[0])}"
                for where, want, got in zip(stage.entry.plan.paths, stage.given, now, strict=True)
                if want != got
            ]
            raise MeshkitTypeError(
                f"{stage.what}: Argument types differ from the types for which this computation "
                "was compiled.\n" + "\n".join(rows) + "\nConsider lowering again for these "
                "arguments, or calling the pmapped function itself (it compiles per signature)."
            )
        return stage.entry.finish(self.compiled(*stage.entry.place(leaves)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)  # as_text, cost_analysis, ...
