"""What the flow analysis of ``meshkit migrate`` reads and learns: files, kinds of values, facts.

The analysis (`meshkit._src.migrate.flow`) reads each file through the `ScannedFile` protocol
(the scanner's resolution of names, `meshkit._src.migrate.resolve`, is one), finds which values
are device-stacked and of what kind (`STACKED`, `TUPLE`, `LIST`), and gathers in `Facts` what
the run's files say of each other's functions.

A pmapped function whose ``out_axes`` is a tuple with ``None`` entries returns a tuple whose
``None`` outputs are one value, not one entry per device: its kind is a partial tuple
(`tuple_of`), and `element` of it says which outputs are stacked.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class ScannedFile(Protocol):
    """What the flow analysis reads of a file the scanner has parsed and resolved."""

    path: str
    tree: ast.Module
    nodes: list[ast.AST]  # every node, in `ast.walk` order
    parents: dict[ast.AST, ast.AST]
    defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]  # functions by dotted name

    def qual(self, node: ast.AST) -> str | None:
        """The dotted name that ``node`` refers to, through the file's imports."""
        ...

    def pmapped_value(self, expr: ast.AST) -> ast.expr | None:
        """The pmap that makes ``expr`` a pmapped function, if it is one."""
        ...

    def mapped_function(self, expr: ast.AST) -> ast.AST | None:
        """The function a pmapped ``expr`` maps, where the file defines it."""
        ...


STACKED = "stacked"  # device axis first: an entry per device
TUPLE = "tuple"  # a tuple of stacked outputs (a pmapped function returning a tuple)
LIST = "list"  # a list or dict of stacked values (metrics appended each step)
_ORDER = {TUPLE: 3, STACKED: 2, LIST: 1}


def tuple_of(stacked: Sequence[bool]) -> str | None:
    """The kind of a tuple of outputs, given which are stacked (``out_axes=(None, 0)``)."""
    if not any(stacked):
        return None
    if all(stacked):
        return TUPLE
    return f"{TUPLE}:" + "".join("s" if s else "-" for s in stacked)


def is_tuple(kind: str | None) -> bool:
    """Whether a kind is a tuple of outputs, all or some of them stacked."""
    return kind is not None and kind.startswith(TUPLE)


def _mask(kind: str) -> str:
    return kind.partition(":")[2]


def join(*kinds: str | None) -> str | None:
    """The strongest of the kinds (a tuple of outputs, then stacked, then a list), or None.

    Two partial tuples join output by output: an output stacked in either is stacked.
    """
    # Callers pass lists, not generators: a kind resolves through the kinds of what flowed into
    # it (a value passed through 3,000 names recurses 3,000 deep), and since Python 3.12 a
    # generator consumed from C (`*gen`) adds a C frame per level under a fixed C limit that
    # no recursion limit raises; comprehensions are inlined there and cost Python frames only.
    best = None
    for k in kinds:
        if k is None:
            continue
        if best is None or _ORDER[k.partition(":")[0]] > _ORDER[best.partition(":")[0]]:
            best = k
        elif is_tuple(k) and is_tuple(best) and k != best:
            a, b = _mask(k), _mask(best)
            if not a or not b:
                best = TUPLE
            else:
                n = max(len(a), len(b))
                a, b = a.ljust(n, "-"), b.ljust(n, "-")
                best = tuple_of([x == "s" or y == "s" for x, y in zip(a, b, strict=True)])
    return best


def element(kind: str | None, index: int | None = None) -> str | None:
    """What iterating over, or indexing, a value of this kind gives (not a device's entry).

    Args:
        kind: the value's kind.
        index: the position taken, where known (a literal index, a tuple target's place): a
            partial tuple's element is stacked only where its ``out_axes`` entry is not None.
    """
    if kind in (LIST, TUPLE):
        return STACKED
    if not is_tuple(kind):
        return None
    assert kind is not None
    mask = _mask(kind)
    if index is None or not -len(mask) <= index < len(mask):
        return None  # which output is unknown: not followed
    return STACKED if mask[index] == "s" else None


@dataclass
class Facts:
    """What the files of one run know of each other's functions.

    Functions are keyed by (path, qualified name in the file: ``f``, ``Trainer.step``).

    Attributes:
        modules: path -> its dotted name parts (``examples/imagenet/train.py`` -> ``("examples",
            "imagenet", "train")``), to resolve imports between the run's files.
        returns: functions whose return value is stacked, and its kind.
        params: functions' parameters that some call passes a stacked value, and its kind.
        tuples: functions every return of which is a tuple display (their pmap returns a tuple).
        classes: the classes the run's files define.
        defs: every function definition of the run's files.
    """

    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    returns: dict[tuple[str, str], str] = field(default_factory=dict)
    params: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    tuples: set[tuple[str, str]] = field(default_factory=set)
    classes: set[tuple[str, str]] = field(default_factory=set)
    defs: dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef] = field(
        default_factory=dict
    )

    @classmethod
    def for_paths(cls, paths: Mapping[str, object]) -> Facts:
        """Empty facts for a run over these paths."""
        facts = cls()
        for path in paths:
            parts = os.path.normpath(path).replace(os.sep, "/").split("/")
            name = parts[-1].rsplit(".", 1)[0]
            parts = [p for p in parts[:-1] if p not in ("", ".", "..")]
            facts.modules[path] = (*parts, name) if name != "__init__" else tuple(parts)
        return facts

    def receives(self, path: str) -> bool:
        """Whether some function of ``path`` is passed a stacked value by the run's files."""
        return any(p == path and names for (p, _), names in self.params.items())

    def resolve(self, importer: str, module: str, level: int) -> str | None:
        """The run's file a module name imported from ``importer`` is, or None.

        Relative imports count from the importer's package; absolute ones match the end of a
        file's dotted path (``import input_pipeline`` beside the script, ``from
        examples.imagenet import train``), the file nearest the importer first.
        """
        here = self.modules.get(importer)
        if here is None:
            return None
        wanted = tuple(module.split(".")) if module else ()
        if level:
            base = here[: len(here) - level] if len(here) >= level else ()
            target = (*base, *wanted)
            for path, parts in self.modules.items():
                if parts == target:
                    return path
            return None
        best, best_shared = None, -1
        for path, parts in self.modules.items():
            if wanted and parts[-len(wanted) :] == wanted and path != importer:
                shared = _shared(parts[:-1], here[:-1])
                if shared > best_shared:
                    best, best_shared = path, shared
        return best


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many leading parts two dotted paths share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
