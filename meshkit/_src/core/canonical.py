"""Canonical text for what processes compare: pytree structures and static values.

Python's own texts carry object identity (``<function f at 0x7f...>``); these hold only what is
the same in every process running the same code: types by qualified name, functions by module,
qualified name and first line, other values by their parts, with addresses taken out.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .caches import cached

# A memory address as Python prints it in default reprs: "<Foo object at 0x7f2c...>".
_ADDRESS = re.compile(r"\s+at\s+0x[0-9a-fA-F]+|0x[0-9a-fA-F]{8,}")
_MAX_DEPTH = 8  # nesting followed inside static values; deeper parts are named by type
_MAX_ITEMS = 64  # elements of one container spelled out; more are counted and digested
_MAX_TEXT = 400  # a repr longer than this is digested


def _type_name(t: type) -> str:
    module = getattr(t, "__module__", None)
    qualname = getattr(t, "__qualname__", None) or getattr(t, "__name__", "?")
    return f"{module}.{qualname}" if module and module != "builtins" else str(qualname)


def _digest(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def function_name(f: Callable[..., Any]) -> str:
    """The short name messages and compiled programs give a user's function."""
    while isinstance(f, functools.partial):
        f = f.func
    name = getattr(f, "__name__", None)
    return str(name) if isinstance(name, str) and name else type(f).__name__


def value(x: Any, _depth: int = 0) -> str:
    """A static value's canonical text (see the module docstring for the rules)."""
    if x is None or isinstance(x, bool | int | float | complex | str | bytes):
        text = repr(x)
        return text if len(text) <= _MAX_TEXT else f"{type(x).__name__}#{_digest(text.encode())}"
    if isinstance(x, type):
        return _type_name(x)
    if isinstance(x, enum.Enum):
        return f"{_type_name(type(x))}.{x.name}"
    if isinstance(x, np.ndarray | np.generic):
        array = np.asarray(x)
        data = array.tobytes() if array.dtype != object else repr(array.tolist()).encode()
        return f"{array.dtype.name}{list(array.shape)}#{_digest(data)}"
    if isinstance(x, jax.Array):
        return f"jax.Array {x.dtype.name}{list(x.shape)}"  # never read back: it may be remote
    if isinstance(x, np.dtype):
        return f"dtype({x.name})"
    d = _depth + 1
    if isinstance(x, functools.partial):  # a function: what it runs, where, what it is bound to
        parts = [value(x.func, d), *(value(a, d) for a in x.args)]
        parts += [f"{k}={value(v, d)}" for k, v in sorted(x.keywords.items())]
        return f"functools.partial({', '.join(parts)})"
    if isinstance(x, types.MethodType):
        return f"{value(x.__func__, d)} of {value(x.__self__, d)}"
    qualname = getattr(x, "__qualname__", None) if callable(x) else None
    if isinstance(getattr(x, "__code__", None), types.CodeType) and qualname:
        return f"{getattr(x, '__module__', None) or '?'}.{qualname}:{x.__code__.co_firstlineno}"
    if isinstance(x, types.BuiltinFunctionType) and qualname:  # also BuiltinMethodType
        module = getattr(x, "__module__", None)
        return f"{module}.{qualname}" if module else str(qualname)
    if _depth >= _MAX_DEPTH:
        return _type_name(type(x))
    if isinstance(x, tuple | list | set | frozenset | dict):
        if isinstance(x, dict):
            texts = [f"{value(k, d)}: {value(x[k], d)}" for k in sorted(x, key=repr)]
        else:
            items = sorted(x, key=repr) if isinstance(x, set | frozenset) else x
            texts = [value(i, d) for i in items]
        inner = ", ".join(texts[:_MAX_ITEMS])
        if len(texts) > _MAX_ITEMS:
            rest = _digest("".join(texts[_MAX_ITEMS:]).encode())
            inner += f", ... {len(texts) - _MAX_ITEMS} more #{rest}"
        name = _type_name(type(x))
        return f"{name}{{{inner}}}" if isinstance(x, dict) else f"{name}({inner})"
    if dataclasses.is_dataclass(x):
        shown = [f.name for f in dataclasses.fields(x) if f.repr]
        inner = ", ".join(f"{name}={value(getattr(x, name, None), d)}" for name in shown)
        return f"{_type_name(type(x))}({inner})"
    if type(x).__repr__ is object.__repr__:
        return _type_name(type(x))
    try:
        text = _ADDRESS.sub("", repr(x))
    except Exception:  # a repr that fails is no reason to fail the comparison
        return _type_name(type(x))
    if len(text) > _MAX_TEXT:
        text = f"#{_digest(text.encode())}"
    return f"{_type_name(type(x))}:{text}"


def structure(treedef: Any) -> str:
    """A pytree structure's canonical text, equal in every process that builds it the same way."""
    try:
        return _structure(treedef)
    except TypeError:  # unhashable static data (JAX allows it outside jit): not cached
        return _structure.__wrapped__(treedef)


@cached(maxsize=512)
def _structure(treedef: Any) -> str:
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "*"
    kind, aux = treedef.node_data()
    children = [structure(c) for c in treedef.children()]
    if kind is type(None):
        return "None"
    if kind is tuple:
        return f"({children[0]},)" if len(children) == 1 else f"({', '.join(children)})"
    if kind is list:
        return f"[{', '.join(children)}]"
    if kind is dict:
        keys = list(aux or ())
        return (
            "{" + ", ".join(f"{value(k)}: {c}" for k, c in zip(keys, children, strict=True)) + "}"
        )
    head = _type_name(kind)
    if aux is not None:
        head += f"[{value(aux)}]"
    return f"{head}({', '.join(children)})"
