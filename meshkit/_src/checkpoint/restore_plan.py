"""Where each array of a checkpoint goes on a mesh and in which structure (``like=``); no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.errors import MeshkitError
from ..core.trees import broadcast_prefix, prefix_mismatch
from ..sharding.specs import as_partition_spec, is_spec_leaf, layout_problem


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


def plan_targets(source: Any, mesh: Any, specs: Any, what: str) -> tuple[Any, list[Any]]:
    """The restore targets of a metadata (or abstract) tree, and its entries in the agreement."""
    if not isinstance(mesh, Mesh):
        raise MeshkitError(
            f"{what}: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}.\n"
            "Consider meshkit.make_mesh({...})."
        )
    found = prefix_mismatch(specs, source, is_leaf=is_spec_leaf)
    if found is not None:
        at, has, full = found
        raise MeshkitError(
            f"{what}: specs is not a prefix of the checkpoint's tree: at {at or 'the top'} "
            f"specs has {has}, the checkpoint {full}.\n"
            "Consider one spec for every array, or a pytree of specs with the checkpoint's "
            "keys (None for an array that keeps the spec it was saved with)."
        )
    axes = dict(mesh.shape)
    flat, treedef = jax.tree_util.tree_flatten_with_path(source)
    chosen = broadcast_prefix(specs, source, is_leaf=is_spec_leaf)
    out: list[Any] = []
    entries: list[Any] = []
    for (keys, leaf), given in zip(flat, chosen, strict=True):
        path = jax.tree_util.keystr(keys)
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            raise MeshkitError(
                f"{what}: the checkpoint's leaf {path} is a {type(leaf).__name__}, not an array; "
                "meshkit restores arrays and numbers.\n"
                "Consider orbax's own restore for this checkpoint."
            )
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        entries.append(
            [f"the array {path}", "target", f"shape {shape}, {dtype}, restored with {given}"]
        )
        sharding = getattr(leaf, "sharding", None)
        # orbax's ArrayMetadata has sharding metadata for a saved jax.Array, none for numpy's.
        on_device = sharding is not None or isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        if given is None and not on_device:
            scalar = type(leaf).__name__ == "ScalarMetadata"  # a host value comes back as saved
            out.append(dtype.type(0).item() if scalar else np.zeros(shape, dtype))
            continue
        saved = saved_spec(sharding)
        if given is None:
            partition = saved if saved is not None else PartitionSpec()
            source_words = "the spec it was saved with" if saved is not None else "replicated"
        else:
            partition = as_partition_spec(given, f"{what}: the spec for {path}")
            source_words = (
                f"the spec string {given!r}" if isinstance(given, str) else "the spec given"
            )
        found = layout_problem(shape, partition, axes)
        if found is not None:
            rule, fix = found
            if given is None:
                fix += (
                    f" The spec is chosen per array with {what}(..., specs=...): a spec, or a "
                    "pytree of them that is a prefix of the checkpoint's tree."
                )
            raise MeshkitError(
                f"{what}: the checkpoint's array {path} (saved shape {shape}, {dtype}) cannot be "
                f"restored with {partition if partition else 'P()'} ({source_words}) on the mesh "
                f"{describe_mesh(axes)}: {rule}.\n{fix}"
            )
        out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, partition)))
    processes = {d.process_index for d in mesh.devices.flat}
    left_out = [str(p) for p in range(jax.process_count()) if p not in processes]
    if left_out and any(isinstance(t, jax.ShapeDtypeStruct) for t in out):
        raise MeshkitError(
            f"{what}: the mesh {describe_mesh(axes)} has no device of process"
            f"{'es' if len(left_out) > 1 else ''} {', '.join(left_out)}, in a program of "
            f"{jax.process_count()} processes. Each process restores the blocks its devices hold, "
            "so a process outside the mesh has nowhere to put its part (orbax fails there "
            "alone).\nConsider a mesh over every process's devices (meshkit.make_mesh)."
        )
    return jax.tree_util.tree_unflatten(treedef, out), entries


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


def arrange_like(targets: Any, like: Any, what: str) -> Any:
    """``targets`` (orbax's dicts and lists) in ``like``'s structure, or the first difference."""
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
                raise MeshkitError(
                    f"{what}: like= has {_show(path)}, which the checkpoint lacks: at "
                    f"{_show(path[:depth])} the checkpoint has {_has(node)}.\n"
                    "Consider as like= the state as the run that saved it built it (same "
                    "model, same optimizer)."
                )
            reached.append(key)
            node = node[key]
        saved_shape = tuple(np.shape(node))
        if hasattr(leaf, "shape") and tuple(leaf.shape) != saved_shape:
            raise MeshkitError(
                f"{what}: like= has {_show(path)} of shape {tuple(leaf.shape)}; the checkpoint's "
                f"is of shape {saved_shape}.\nConsider as like= the state of the model that was "
                "saved (the same sizes)."
            )
        wanted.add(tuple(reached))
        out.append(node)
    for keys, _ in jax.tree_util.tree_flatten_with_path(targets)[0]:
        path = tuple(_step(k) for k in keys)
        if path not in wanted:
            raise MeshkitError(
                f"{what}: the checkpoint has {_show(path)}, which like= lacks; a restore into "
                "like= would drop it.\nConsider as like= the whole state that was saved, or "
                "restore without like= and pick what you need."
            )
    return jax.tree_util.tree_unflatten(treedef, out)
