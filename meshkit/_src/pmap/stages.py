"""``pmap_compat(f).lower(...)`` and its ``.compile()``: called with f's own arguments.

`jax.pmap`'s compiled object cannot be called in a multi-process run (it has no host-local to
global conversion). These wrap JAX's `Lowered` and `Compiled` with the pmapped function's
placement, so the compiled function takes the arguments the pmapped one takes and returns the
same outputs, in any process count; argument mismatches are reported with JAX's phrases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..core.errors import MeshkitTypeError
from ..core.tracebacks import public

__all__ = ["Compiled", "Lowered", "Stage", "signature"]


def signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    """Each leaf's shape and dtype as given (before placement), to compare later calls with."""
    return [
        (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves
    ]


@dataclass(frozen=True)
class Stage:
    """What a lowering fixed, and the callables that run a call of the compiled function.

    Attributes:
        what: the function's name in messages (``pmap_compat(step)``).
        static: positions of the static arguments.
        key: the call key it was lowered for: ``(number of arguments, static values, ...)``.
        treedef: the structure of the dynamic arguments and keyword arguments.
        paths: each leaf's place in the arguments, for messages.
        given: each leaf's shape and dtype as lowered (`signature`).
        dynamic: drops the static arguments from a call's arguments.
        place: puts a call's leaves where the compiled function takes them.
        finish: turns the compiled function's outputs into the pmapped function's.
    """

    what: str
    static: tuple[int, ...]
    key: Any
    treedef: Any
    paths: Sequence[str]
    given: list[tuple[tuple[int, ...], str]]
    dynamic: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    place: Callable[[list[Any]], list[Any]]
    finish: Callable[[Any], Any]


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
            args = stage.dynamic(args)
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
                for where, want, got in zip(stage.paths, stage.given, now, strict=True)
                if want != got
            ]
            raise MeshkitTypeError(
                f"{stage.what}: Argument types differ from the types for which this computation "
                "was compiled.\n" + "\n".join(rows) + "\nConsider lowering again for these "
                "arguments, or calling the pmapped function itself (it compiles per signature)."
            )
        return stage.finish(self.compiled(*stage.place(leaves)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)  # as_text, cost_analysis, ...
