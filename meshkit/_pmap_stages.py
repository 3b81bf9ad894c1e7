"""``pmap_compat(f).lower(...)`` and its ``.compile()``: called with f's own arguments.

`jax.pmap`'s compiled object cannot be called in a multi-process run (it has no host-local to
global conversion). These wrap JAX's `Lowered` and `Compiled` with the pmapped function's
placement, so the compiled function takes the arguments the pmapped one takes and returns the
same outputs, in any process count; argument mismatches are reported with JAX's phrases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ._errors import MeshkitTypeError

if TYPE_CHECKING:
    from ._pmap import PmapFunction, _Entry

__all__ = ["Compiled", "Lowered", "Stage", "signature"]


def signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    """Each leaf's shape and dtype as given (before placement), to compare later calls with."""
    return [
        (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves
    ]


@dataclass(frozen=True)
class Stage:
    """What a lowering fixed: the function, its call key and structure, its entry, the types."""

    fn: PmapFunction
    key: Any
    treedef: Any
    entry: _Entry
    given: list[tuple[tuple[int, ...], str]]


class Lowered:
    """``pmap_compat(f).lower(...)``: JAX's `Lowered`, with `compile` keeping f's signature."""

    def __init__(self, stage: Stage, lowered: Any) -> None:
        self._stage = stage
        self.lowered = lowered

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage
        fn = stage.fn
        n_args, static_vals, _ = stage.key
        if fn.static and len(args) == n_args:  # static arguments given again: they must match
            given = tuple(args[i] for i in fn.static)
            if given != static_vals:
                raise MeshkitTypeError(
                    f"{fn._what}: compiled for static arguments {static_vals}, called with "
                    f"{given}.\nConsider lowering again for these values."
                )
            args = fn._dyn(args)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if treedef != stage.treedef:
            raise MeshkitTypeError(
                f"{fn._what}: Function compiled with input pytree does not match the input "
                f"pytree it was called with.\ncompiled for: {stage.treedef}\ncalled with:  "
                f"{treedef}\nConsider calling it with the (non-static) arguments it was lowered "
                "for, or lowering again."
            )
        now = signature(leaves)
        if now != stage.given:
            rows = [
                f"  {where}: compiled for {want[1]}{list(want[0])}, called with "
                f"{got[1]}{list(got[0])}"
                for where, want, got in zip(stage.entry.paths, stage.given, now, strict=True)
                if want != got
            ]
            raise MeshkitTypeError(
                f"{fn._what}: Argument types differ from the types for which this computation "
                "was compiled.\n" + "\n".join(rows) + "\nConsider lowering again for these "
                "arguments, or calling the pmapped function itself (it compiles per signature)."
            )
        return fn._finish(self.compiled(*fn._place(leaves, stage.entry)), stage.entry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)  # as_text, cost_analysis, ...
