"""`ArgumentPlan`: where every leaf of one call structure lives on a mesh (spmd, pmap_compat)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches


@dataclass(frozen=True, eq=False)
class ArgumentPlan:
    """Each leaf's target sharding (equal specs share one object) and name in messages."""

    mesh: Mesh
    targets: tuple[NamedSharding, ...]
    paths: tuple[str, ...]
    _compare: list[Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compare", list(self.targets))

    @property
    def multiprocess(self) -> bool:
        """Whether the mesh spans processes."""
        return self.mesh.is_multi_process

    def placed(self, leaves: Sequence[Any]) -> bool:
        """Whether every leaf is an array laid out as its target already: one list comparison.

        The shardings of a call that passes replace equal ones, so the next compares by identity.
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


@_caches.cached(maxsize=256)
def argument_plan(
    mesh: Mesh, specs: tuple[PartitionSpec, ...], paths: tuple[str, ...]
) -> ArgumentPlan:
    """The cached plan of leaves with ``specs`` (one per leaf) on ``mesh``."""
    by_spec: dict[PartitionSpec, NamedSharding] = {}
    targets = tuple(by_spec.setdefault(s, NamedSharding(mesh, s)) for s in specs)
    return ArgumentPlan(mesh, targets, paths)
