"""Where every leaf of one call's arguments lives on a mesh, and which blocks each process holds.

An `ArgumentPlan` is pure and frozen: the mesh, one `NamedSharding` per leaf (in flattening
order) and each leaf's name in messages. `spmd` and `pmap_compat` make one per call structure
and use it twice: to tell a call whose leaves are all placed already (the steady state, one
list comparison) and to say, per leaf, which blocks of the global array each process holds
(`meshkit._src.sharding.layout.plan`, which the assembly of host data follows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from . import layout as _layout

__all__ = ["ArgumentPlan", "argument_plan"]


@dataclass(frozen=True, eq=False)
class ArgumentPlan:
    """The shardings of one call structure's leaves on ``mesh``.

    Attributes:
        mesh: the mesh the call runs on.
        targets: each leaf's sharding, in flattening order; leaves with equal specs share one
            object, so arrays fed back from outputs compare by identity first.
        paths: each leaf's name in messages (``args[0]['w']``).
    """

    mesh: Mesh
    targets: tuple[NamedSharding, ...]
    paths: tuple[str, ...]
    _compare: list[Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compare", list(self.targets))

    @property
    def specs(self) -> tuple[PartitionSpec, ...]:
        """Each leaf's spec on the mesh."""
        return tuple(t.spec for t in self.targets)

    @property
    def multiprocess(self) -> bool:
        """Whether the mesh spans processes (a process then holds only some blocks)."""
        return self.mesh.is_multi_process

    def placed(self, leaves: Sequence[Any]) -> bool:
        """Whether every leaf is an array laid out as its target already (no host data).

        One list comparison (identity first, then equality, per element); tracers and host
        data have no ``sharding`` here and fail it. The sharding objects of a call that
        passes are kept in place of equal ones, so that a loop feeding the same objects
        back is decided by identity.
        """
        now = [getattr(leaf, "sharding", None) for leaf in leaves]
        if now != self._compare:
            return False
        self._compare[:] = now
        return True

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """The target object of ``spec`` where a leaf has it (outputs share it), else a new one."""
        for target in self.targets:
            if target.spec == spec:
                return target
        return NamedSharding(self.mesh, spec)

    def blocks(self, index: int, shape: Sequence[int], process: int | None = None) -> Any:
        """The blocks of leaf ``index`` (of global ``shape``) that ``process`` holds.

        As a `meshkit._src.sharding.layout.Plan` (their global and local indices); ``process``
        defaults to this one.
        """
        me = jax.process_index() if process is None else process
        return _layout.plan(self.targets[index], tuple(int(s) for s in shape), me)


@_caches.cached(maxsize=256)
def argument_plan(
    mesh: Mesh, specs: tuple[PartitionSpec, ...], paths: tuple[str, ...]
) -> ArgumentPlan:
    """The cached plan of leaves with ``specs`` (one per leaf) on ``mesh``."""
    by_spec: dict[PartitionSpec, NamedSharding] = {}
    targets = tuple(by_spec.setdefault(s, NamedSharding(mesh, s)) for s in specs)
    return ArgumentPlan(mesh, targets, paths)
