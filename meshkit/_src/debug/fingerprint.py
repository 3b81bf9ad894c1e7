"""Fingerprints of SPMD calls: what debug mode compares between processes.

The entry and function, the call's number, the arguments' pytree structure, and per leaf its
name, shape, dtype and sharding (or a static value). Leaf texts and layouts are cached.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
from jax.core import Tracer

from ..core import caches as _caches
from ..core import canonical as _canonical
from ..core.frames import place, user_frame

MAX_DESC = 200  # characters of a value's repr in a fingerprint or a message


class Site(Protocol):
    """An SPMD entry as the check reads it (`meshkit._src.runtime.dispatch.CallSite`)."""

    kind: str
    name: str
    calls: int
    info: dict[str, Any]


# Array leaves described before (a steady loop describes the same ones every call).
_LEAF_TEXTS: _caches.Cache[tuple[Any, ...], str] = _caches.Cache(maxsize=4096)


def _describe_leaf(x: Any, ragged: bool) -> str:
    """``float32[32,224,224,3]`` plus the sharding, or the type of a non-array leaf."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        if x is None or isinstance(x, bool | int | float | complex):
            return "None" if x is None else type(x).__name__
        return _canonical.value(x)[:MAX_DESC]
    tracer = isinstance(x, Tracer)
    sharding = getattr(x, "sharding", None)
    key = (type(x), tuple(shape), dtype, sharding, ragged)
    text = None if tracer else _LEAF_TEXTS.get(key)
    if text is not None:
        return text
    dims = [str(int(d)) for d in shape]
    if ragged and dims:
        dims[0] = "*"
    text = f"{np.dtype(dtype).name}[{','.join(dims)}]"
    if isinstance(sharding, jax.sharding.NamedSharding):
        text += f" sharded {tuple(sharding.spec)} over {dict(sharding.mesh.shape)}"
    elif isinstance(x, jax.Array) and not tracer and sharding is not None:
        count = len(sharding.device_set)
        text += f" on {count} devices" if count > 1 else ""
    if not tracer:
        _LEAF_TEXTS.put(key, text)
    return text


def fingerprint(site: Site, args: tuple[Any, ...], count: int) -> dict[str, Any]:
    ragged = bool(site.info.get("ragged"))
    flat, treedef = jax.tree_util.tree_flatten(args)
    layout = _layout_of(site, args, treedef)
    leaves = [  # each leaf as sent to the other processes: its name in messages, what it is
        {
            "name": where,
            "text": "static " + _static_repr(x) if static else _describe_leaf(x, ragged),
        }
        for (where, static), x in zip(layout.names, flat, strict=True)
    ]
    return {
        "status": "call",
        "count": count,  # SPMD entries checked in this process, all functions
        "entry": layout.entry,
        "n": site.calls,
        "structure": layout.structure,
        "leaves": leaves,
        # ``file:line in function`` of the first frame outside meshkit, jax and the stdlib.
        "where": place(user_frame(sys._getframe(1))),
        "time": time.time(),
    }


@dataclass(frozen=True)
class _ArgLayout:
    """What a call site's fingerprint takes from its arguments' structure (cached per treedef)."""

    entry: str  # the function's name and where it was made: lambdas of one name differ
    structure: str
    names: tuple[tuple[str, bool], ...]  # per leaf: its name in messages, whether static


_LAYOUTS_KEY = "debug layouts"  # in CallSite.info: treedef -> _ArgLayout
_MAX_LAYOUTS = 64  # per call site


def _layout_of(site: Site, args: tuple[Any, ...], treedef: Any) -> _ArgLayout:
    layouts: _caches.Cache[Any, _ArgLayout] | None = site.info.get(_LAYOUTS_KEY)
    if layouts is None:  # the site's first call in debug mode
        layouts = site.info[_LAYOUTS_KEY] = _caches.Cache(maxsize=_MAX_LAYOUTS)
    layout = layouts.get(treedef)
    if layout is not None:
        return layout
    static = site.info.get("static_argnums") or ()
    params = site.info.get("params") or ()
    names = []  # ``batch['image']``: the parameter's name when known, then the rest of the path
    for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]:
        idx = path[0].idx if path and isinstance(path[0], jax.tree_util.SequenceKey) else None
        if idx is None:
            names.append((jax.tree_util.keystr(path) if path else "the argument", False))
        else:
            base = str(params[idx]) if idx < len(params) else f"argument {idx}"
            names.append((base + jax.tree_util.keystr(path[1:]), idx in static))
    origin = site.info.get("origin")
    entry = f"{site.kind} {site.name}" + (f" [{origin}]" if origin else "")
    layout = _ArgLayout(entry, _canonical.structure(treedef), tuple(names))
    layouts.put(treedef, layout)
    return layout


def _static_repr(x: Any) -> str:
    text = _canonical.value(x)
    return text if len(text) <= MAX_DESC else text[:MAX_DESC] + "..."
