"""Layouts seen before: a process's part prepared from a template, without checking it again.

A call is: a template of the layout (plans, shardings, the record the processes compare), made
on the first call with that layout and reused while it repeats, then numpy views of this call's
values. A layout is everything `prepare` reads but the values; the last `_MAX_TEMPLATES`
layouts are kept (`meshkit._src.core.caches`), so a loop over a few layouts never plans again.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import caches as _caches
from .blocks import Leaf, Prepared, Template, describe, plan_leaves, prepare_tree, replica_slots
from .dtypes import Note, note_narrowing
from .records import summary

__all__ = ["prepare"]

_MAX_TEMPLATES = 64
_templates: _caches.Cache[Any, Template] = _caches.Cache(maxsize=_MAX_TEMPLATES)


def prepare(
    local: Any,
    mesh_or_sharding: Any,
    spec: Any,
    *,
    global_shape: Any,
    dtype: Any,
    pad: bool,
) -> Prepared:
    """Check and plan this process's contribution; no communication, no device transfer.

    A layout seen before (see `Template`) is not checked and planned again: only the values
    are taken (and cast, if the template says so).
    """
    flat, treedef = jax.tree_util.tree_flatten(local)
    key = _layout_key(flat, treedef, mesh_or_sharding, spec, global_shape, dtype, pad)
    template = _templates.get(key) if key is not None else None
    if template is not None:
        return _from_template(template, flat)
    prepared = prepare_tree(
        local, mesh_or_sharding, spec, global_shape=global_shape, dtype=dtype, pad=pad
    )
    if key is not None:
        template = _make_template(prepared, flat, dtype)
        _templates.put(key, template)
    return prepared


def _layout_key(
    flat: list[Any],
    treedef: Any,
    mesh_or_sharding: Any,
    spec: Any,
    global_shape: Any,
    dtype: Any,
    pad: bool,
) -> Any:
    """The key of `prepare`'s template for this call; None: the call is not of a cached kind.

    Cached: numpy leaves, one spec (a string, a PartitionSpec or None) with a Mesh or a
    NamedSharding, no padding, and a global shape and dtype given as hashable values. Anything
    else is checked and planned on every call.
    """
    if pad or not all(type(x) is np.ndarray for x in flat):
        return None
    if not isinstance(mesh_or_sharding, Mesh | NamedSharding):
        return None
    if not (spec is None or isinstance(spec, str | PartitionSpec)):
        return None
    if global_shape is not None and not (
        isinstance(global_shape, tuple) and all(type(s) is int for s in global_shape)
    ):
        return None
    if not (dtype is None or isinstance(dtype, str | np.dtype | type)):
        return None
    shapes = tuple((x.shape, x.dtype) for x in flat)
    x64 = bool(jax.config.jax_enable_x64)  # decides the dtypes leaves are cast to
    return (treedef, shapes, mesh_or_sharding, spec, global_shape, dtype, x64)


def _make_template(prepared: Prepared, flat: list[np.ndarray], dtype: Any) -> Template:
    """The template of ``prepared`` (just made from the numpy leaves ``flat``), planned."""
    plan_leaves(prepared)
    record = describe(prepared, pad=False)
    leaves = tuple(
        (
            leaf.path,
            leaf.sharding,
            leaf.dims,
            leaf.global_shape,
            leaf.plan,
            leaf.rows,
            leaf.value.dtype,
        )
        for leaf in prepared.leaves
    )
    narrowings = []
    for x, leaf in zip(flat, prepared.leaves, strict=True):
        wanted = x.dtype if dtype is None else np.dtype(dtype)
        if leaf.value.dtype != wanted:
            narrowings.append((leaf.path, wanted, leaf.value.dtype, dtype is not None))
    template = Template(
        prepared.treedef,
        leaves,
        record,
        summary(record.wire()),
        replica_slots(prepared.leaves),
        tuple(narrowings),
    )
    prepared.template = template
    return template


def _from_template(template: Template, flat: list[np.ndarray]) -> Prepared:
    """This call's part from a template: the values taken (and cast) under its plans."""
    notes: list[Note] = []
    for path, wanted, target, given in template.narrowings:
        note_narrowing(path, wanted, target, given, notes)
    leaves = [
        Leaf(path, x if x.dtype == target else x.astype(target), sharding, dims, shape, plan, rows)
        for x, (path, sharding, dims, shape, plan, rows, target) in zip(
            flat, template.leaves, strict=True
        )
    ]
    return Prepared(template.treedef, leaves, notes=notes, template=template)
