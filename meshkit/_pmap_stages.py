"""``pmap_compat(f).lower(...)`` and its ``.compile()``: called with f's own arguments.

`jax.pmap`'s compiled object cannot be called in a multi-process run (it has no host-local to
global conversion). These wrap JAX's `Lowered` and `Compiled` with the pmapped function's
placement, so the compiled function takes the arguments the pmapped one takes and returns the
same outputs, in any process count; argument mismatches are reported with JAX's phrases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ._errors import MeshkitTypeError

if TYPE_CHECKING:
    from ._pmap import PmapFunction, _Entry

__all__ = ["Compiled", "Lowered"]


def signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    """Each leaf's shape and dtype as given (before placement), to compare later calls with."""
    return [
        (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves
    ]


class Lowered:
    """``pmap_compat(f).lower(...)``: JAX's `Lowered`, with `compile` keeping f's signature."""

    def __init__(
        self,
        fn: PmapFunction,
        key: Any,
        treedef: Any,
        entry: _Entry,
        given: list[tuple[tuple[int, ...], str]],
        lowered: Any,
    ) -> None:
        self._fn, self._key, self._treedef, self._entry = fn, key, treedef, entry
        self._given = given
        self.lowered = lowered

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        """Compile; the result is called like the pmapped function."""
        compiled = self.lowered.compile(*args, **kwargs)
        return Compiled(self._fn, self._key, self._treedef, self._entry, self._given, compiled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)  # as_text, compiler_ir, cost_analysis, ...


class Compiled:
    """A compiled `pmap_compat` function: call it with the arguments it was lowered for."""

    def __init__(
        self,
        fn: PmapFunction,
        key: Any,
        treedef: Any,
        entry: _Entry,
        given: list[tuple[tuple[int, ...], str]],
        compiled: Any,
    ) -> None:
        self._fn, self._key, self._treedef, self._entry = fn, key, treedef, entry
        self._given = given
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        n_args, static_vals, _ = self._key
        if fn.static and len(args) == n_args:  # static arguments given again: they must match
            given = tuple(args[i] for i in fn.static)
            if given != static_vals:
                raise MeshkitTypeError(
                    f"{fn._what}: compiled for static arguments {static_vals}, called with "
                    f"{given}.\nConsider lowering again for these values."
                )
            args = fn._dyn(args)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if treedef != self._treedef:
            raise MeshkitTypeError(
                f"{fn._what}: Function compiled with input pytree does not match the input "
                f"pytree it was called with.\ncompiled for: {self._treedef}\ncalled with:  "
                f"{treedef}\nConsider calling it with the (non-static) arguments it was lowered "
                "for, or lowering again."
            )
        now = signature(leaves)
        if now != self._given:
            rows = [
                f"  {where}: compiled for {want[1]}{list(want[0])}, called with "
                f"{got[1]}{list(got[0])}"
                for where, want, got in zip(self._entry.paths, self._given, now, strict=True)
                if want != got
            ]
            raise MeshkitTypeError(
                f"{fn._what}: Argument types differ from the types for which this computation "
                "was compiled.\n" + "\n".join(rows) + "\nConsider lowering again for these "
                "arguments, or calling the pmapped function itself (it compiles per signature)."
            )
        return fn._finish(self.compiled(*fn._place(leaves, self._entry)), self._entry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)  # as_text, cost_analysis, ...
