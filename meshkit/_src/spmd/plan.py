"""One call plan for `spmd` and `pmap_compat`: classify the leaves, place, jit over shard_map.

Both front-ends compile a function as one `jax.jit` whose body runs `jax.shard_map`, one per
structure of the arguments: a `Signature` holds that jit and where each leaf of the arguments
must live. A call is decided before anything runs, never tried and retried:

1. **the steady state** (`Signatures.steady`): nothing traces and every leaf is already an array
   laid out as the signature of its structure expects (earlier outputs fed back): the jit is
   called at once, after one comparison per leaf;
2. otherwise the front-end classifies the leaves (`meshkit._src.spmd.placement`): tracers are
   kept, arrays laid out differently are moved, and host data is placed by `Signature.put_host`:
   in one process in one batched put; in a multi-process run as this process's parts of the
   arguments, assembled with the other processes' parts in one assembly
   (`Signature.assemble`). Where a front-end prepares that assembly with steps of its own that
   can fail (`spmd` makes its layout there), `failures_published` tells the processes that
   wait for this one.

What differs stays in each front-end: `spmd`'s spec per argument, its checks and its reshards
on Explicit meshes (`meshkit._src.spmd.bound`); `pmap_compat`'s mapped axes, device-axis
conversions and the check of outputs promised equal on every device (`meshkit._src.pmap`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ..core.errors import MeshkitError
from . import placement as _placement

__all__ = [
    "Signature",
    "Signatures",
    "argnums",
    "dynamic",
    "failures_published",
    "from_host",
    "jit_over_shard_map",
]


def argnums(
    value: int | Sequence[int], what: str, caller: str, *, from_end: bool = False
) -> tuple[int, ...]:
    """Positions of arguments (``static_argnums``, ``donate_argnums``...) as a tuple of ints.

    Args:
        value: one position or a sequence of them, as the user gave it.
        what: the parameter's name in messages.
        caller: the call that messages name (``meshkit.spmd(step)``).
        from_end: negative positions count from the end of each call's arguments; they are
            kept as given, in their order. Otherwise they must be non-negative and come back
            sorted, without repeats.

    Raises:
        MeshkitError: a position that is not an int (bools are not positions), or a negative
            one where they do not count from the end.
    """
    items = (value,) if isinstance(value, int) else tuple(value)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int) or (i < 0 and not from_end):
            kind = "ints" if from_end else "non-negative ints"
            raise MeshkitError(f"{caller}: {what} must be {kind}; got {value!r}.")
    return items if from_end else tuple(sorted(set(items)))


def dynamic(args: tuple[Any, ...], static: tuple[int, ...]) -> tuple[Any, ...]:
    """The arguments that are not static (at the positions ``static``), in their order."""
    if not static:
        return args
    return tuple(a for i, a in enumerate(args) if i not in static)


def from_host(value: Any, target: NamedSharding) -> jax.Array:
    """Host data, the same in every process, as a global array laid out by ``target``."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, target, lambda idx: arr[idx])


def jit_over_shard_map(
    body: Callable[..., Any], name: str, **jit_options: Any
) -> Callable[..., Any]:
    """``jax.jit(body, **jit_options)``, ``body`` (which runs `jax.shard_map`) named ``name``.

    Named after the user's function, so that HLO dumps and profiles tell the programs apart.
    """
    body.__name__ = body.__qualname__ = name
    return jax.jit(body, **jit_options)


@contextlib.contextmanager
def failures_published(tag: str) -> Iterator[None]:
    """Inside: an error is also published to the processes waiting in an assembly under ``tag``.

    For the preparation of a multi-process call's assembly: the other processes are waiting
    for this process's record, and stop at once with its error instead of timing out.
    """
    try:
        yield
    except Exception as e:
        _placement.publish_failure(tag, e)
        raise


@dataclass(eq=False)
class Signature:
    """One structure of a function's arguments, compiled: its jit and where each leaf goes.

    Attributes:
        mesh: the mesh the function runs on.
        jitted: ``jax.jit`` over the body that runs `jax.shard_map` (None over an
            `AbstractMesh`, met while tracing: the body is traced in place).
        what: the call messages name (``meshkit.pmap_compat(step)``).
        tag: names the coordination-service exchanges of the function's host arguments.
        targets: each leaf's sharding once placed, for the steady-state test of later calls;
            None until a call has placed them.
    """

    mesh: Mesh | AbstractMesh
    jitted: Any
    what: str
    tag: str
    targets: list[NamedSharding] | None = None

    @property
    def multiprocess(self) -> bool:
        """Whether the mesh spans processes (host data is then this process's part)."""
        return isinstance(self.mesh, Mesh) and self.mesh.is_multi_process

    def put_host(
        self,
        leaves: list[Any],
        targets: Sequence[NamedSharding],
        paths: Sequence[str],
        treedef: Any = None,
    ) -> list[Any]:
        """``leaves`` with their host data placed at its ``targets`` (other leaves as they are).

        In one process, one batched `jax.device_put` (jit would place host data too, but it
        traces a numpy argument and a placed array separately); across processes the host data
        is this process's parts, assembled with the others' (`assemble`). ``paths``: each leaf's
        name in messages; ``treedef``: the structure of ``leaves``, for messages.
        """
        host = [
            i
            for i, leaf in enumerate(leaves)
            if _placement.is_host(leaf) and not _placement.is_abstract(leaf)
        ]
        if not host:
            return leaves
        values = [leaves[i] for i in host]
        if self.multiprocess:
            placed = self.assemble(
                leaves, host, [paths[i] for i in host], [targets[i].spec for i in host], treedef
            )
        else:
            placed = _placement.put_host(values, [targets[i] for i in host])
        out = list(leaves)
        for i, value in zip(host, placed, strict=True):
            out[i] = value
        return out

    def assemble(
        self,
        leaves: list[Any],
        chosen: list[int],
        paths: list[str],
        specs: list[Any],
        treedef: Any = None,
    ) -> list[jax.Array]:
        """The ``chosen`` leaves, this process's parts of a multi-process call, as global arrays.

        One assembly for all of them (`meshkit._src.spmd.placement.assemble`): ``paths`` and
        ``specs`` are each chosen leaf's name in messages and spec on the mesh; ``treedef``
        the structure of ``leaves``, which messages show.
        """
        mesh = self.mesh
        assert isinstance(mesh, Mesh)  # a multi-process signature has a concrete mesh
        structure = None
        if treedef is not None:
            keep = set(chosen)
            structure = jax.tree_util.tree_unflatten(
                treedef, [leaf if i in keep else None for i, leaf in enumerate(leaves)]
            )
        return _placement.assemble(
            [(where, leaves[i]) for where, i in zip(paths, chosen, strict=True)],
            mesh,
            specs,
            what=self.what,
            tag=self.tag,
            structure=structure,
        )


S = TypeVar("S", bound=Signature)


class Signatures(Generic[S]):
    """A function's signatures by call structure, and the steady-state test on them.

    Args:
        clean: says that a call may run as it is (no transformation traces; for
            `pmap_compat` also no ``jax.set_mesh`` around it, whose mesh the call must take).
    """

    def __init__(self, clean: Callable[[], bool]) -> None:
        self._by_structure: dict[Any, S] = {}
        self._clean = clean

    def get(self, structure: Any) -> S | None:
        """The signature kept for ``structure`` (a treedef, or a key made of one), if any."""
        return self._by_structure.get(structure)

    def keep(self, structure: Any, signature: S) -> S:
        """Keep ``signature`` for ``structure``; returns it."""
        self._by_structure[structure] = signature
        return signature

    def steady(self, structure: Any, leaves: Sequence[Any]) -> S | None:
        """The signature of ``structure`` when the call may go straight to its jit, else None.

        That is when it has placed a call before, the call may run as it is (``clean``) and
        every leaf is an array already laid out as its target. Each step shows in the
        per-call time, so this does only what deciding needs.
        """
        found = self._by_structure.get(structure)
        if (
            found is not None
            and found.targets is not None
            and self._clean()
            and _placement.placed(leaves, found.targets)
        ):
            return found
        return None
