"""Where each array of a checkpoint goes on a mesh and in which structure (``like=``); pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..core.errors import MeshkitError
from ..sharding.specs import SpecLike, as_partition_spec, layout_problem


@dataclass(frozen=True)
class SavedArray:
    """One leaf of a checkpoint, as its metadata describes it."""

    path: str  # in `jax.tree_util.keystr` form
    shape: tuple[int, ...]  # global
    dtype: str
    spec: PartitionSpec | None  # None: saved from the host or one device
    on_device: bool  # saved from a jax.Array; a host value is restored as saved
    scalar: bool = False  # a Python scalar (orbax's ScalarMetadata)


def saved_spec(sharding: Any) -> PartitionSpec | None:
    """The spec of a leaf's ``NamedSharding``, or of orbax's metadata of one; None: neither."""
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    entries = getattr(sharding, "partition_spec", None)  # names, None or tuples of names
    if entries is None:
        return None
    out: list[Any] = []
    for e in entries:
        names = (
            tuple(map(str, e)) if isinstance(e, list | tuple) else () if e is None else (str(e),)
        )
        out.append(names if len(names) > 1 else names[0] if names else None)
    return PartitionSpec(*out)


def describe_mesh(axes: Mapping[str, int]) -> str:
    """``{'data': 2, 'model': 4} (8 devices)``."""
    inner = ", ".join(f"{n!r}: {s}" for n, s in axes.items())
    return f"{{{inner}}} ({math.prod(axes.values())} devices)"


def plan(
    saved: Sequence[SavedArray],
    chosen: Sequence[SpecLike | None],
    axes: Mapping[str, int],
    what: str,
) -> list[PartitionSpec | None]:
    """The spec each leaf is restored with (``chosen``'s, else as saved); None: a host value."""
    out: list[PartitionSpec | None] = []
    for leaf, given in zip(saved, chosen, strict=True):
        if given is None and not leaf.on_device:
            out.append(None)  # a host value comes back as it was saved
            continue
        if given is None:
            partition = leaf.spec if leaf.spec is not None else PartitionSpec()
            source = "the spec it was saved with" if leaf.spec is not None else "replicated"
        else:
            partition = as_partition_spec(given, f"{what}: the spec for {leaf.path}")
            source = f"the spec string {given!r}" if isinstance(given, str) else "the spec given"
        found = layout_problem(leaf.shape, partition, axes)
        if found is None:
            out.append(partition)
            continue
        rule, fix = found
        if given is None:
            fix += (
                f" The spec is chosen per array with {what}(..., specs=...): a spec, or a pytree "
                "of them that is a prefix of the checkpoint's tree."
            )
        raise MeshkitError(
            f"{what}: the checkpoint's array {leaf.path} (saved shape {leaf.shape}, "
            f"{leaf.dtype}) cannot be restored with {partition if partition else 'P()'} "
            f"({source}) on the mesh {describe_mesh(axes)}: {rule}.\n{fix}"
        )
    return out


def _step(key: Any) -> str | int:
    """One step of a key path, as the checkpoint's dicts and lists name it."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            value = getattr(key, attr)
            return value if isinstance(value, int) else str(value)
    return str(key)


def _show(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f"[{p!r}]" for p in path) or "the top"


def _key(node: Any, step: str | int) -> str | int | None:
    """The key of ``node``'s child at ``step`` (a tuple's item may be ``"0"``); None: no child."""
    if isinstance(node, dict):
        return next((key for key in (step, str(step)) if key in node), None)
    if isinstance(node, list | tuple) and isinstance(step, int) and 0 <= step < len(node):
        return step
    return None


def _has(node: Any) -> str:
    if isinstance(node, dict):
        return f"the keys {sorted(map(str, node))}"
    if isinstance(node, list | tuple):
        return f"a sequence of {len(node)}"
    return f"a leaf ({type(node).__name__})"


def arrange_like(targets: Any, like: Any, what: str) -> tuple[Any, str | None]:
    """``targets`` (orbax's dicts and lists) in ``like``'s structure; or None and the difference."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    wanted: set[tuple[str | int, ...]] = set()
    for keys, leaf in flat:
        path = tuple(_step(k) for k in keys)
        node: Any = targets
        reached: list[str | int] = []  # the path in the checkpoint's own keys
        for depth, step in enumerate(path):
            key = _key(node, step)
            if key is None:
                return None, (
                    f"{what}: like= has {_show(path)}, which the checkpoint lacks: at "
                    f"{_show(path[:depth])} the checkpoint has {_has(node)}.\n"
                    "Consider as like= the state as the run that saved it built it (same "
                    "model, same optimizer)."
                )
            reached.append(key)
            node = node[key]
        saved_shape = tuple(np.shape(node))
        if hasattr(leaf, "shape") and tuple(leaf.shape) != saved_shape:
            return None, (
                f"{what}: like= has {_show(path)} of shape {tuple(leaf.shape)}; the checkpoint's "
                f"is of shape {saved_shape}.\nConsider as like= the state of the model that was "
                "saved (the same sizes)."
            )
        wanted.add(tuple(reached))
        out.append(node)
    for keys, _ in jax.tree_util.tree_flatten_with_path(targets)[0]:
        path = tuple(_step(k) for k in keys)
        if path not in wanted:
            return None, (
                f"{what}: the checkpoint has {_show(path)}, which like= lacks; a restore into "
                "like= would drop it.\nConsider as like= the whole state that was saved, or "
                "restore without like= and pick what you need."
            )
    return jax.tree_util.tree_unflatten(treedef, out), None
