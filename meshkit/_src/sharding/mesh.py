"""Meshes over every device of every process, inner axes kept inside a host (`order_devices`).

The device order (hosts, then processes, then devices; each axis size split greedily into host,
process and device factors, outermost axis first) is documented in docs/meshes.md.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

from ..coord import missing as _missing
from ..core.errors import MeshkitError, ranges
from ..core.frames import public
from ..runtime import hosts as _hosts

AxisTypeLike = AxisType | str


def _axis_type(value: Any, where: str) -> AxisType:
    if isinstance(value, AxisType):
        return value
    by_name = {t.name.lower(): t for t in AxisType}
    if isinstance(value, str) and value.lower() in by_name:
        return by_name[value.lower()]
    names = ", ".join(map(repr, by_name))
    raise MeshkitError(
        f"meshkit.make_mesh: axis_types{where} must be a jax.sharding.AxisType or one of "
        f"{names}; got {value!r}."
    )


def parse_axes(axes: Any) -> list[tuple[str, int]]:
    """Validate ``axes`` (mapping or (name, size) pairs); sizes may still hold one -1."""
    mapping = isinstance(axes, Mapping)
    pairs = not mapping and isinstance(axes, Iterable) and not isinstance(axes, str | bytes)
    items: list[Any] = list(axes.items()) if mapping else list(axes) if pairs else []
    odd = [x for x in items if not (isinstance(x, tuple | list) and len(x) == 2)]
    if odd or not (mapping or pairs):
        raise MeshkitError(
            "meshkit.make_mesh: axes must be a mapping name -> size (outermost first), "
            "e.g. {'data': -1, 'model': 4}, or a sequence of (name, size) pairs; got "
            + (f"the element {odd[0]!r}." if odd else f"{type(axes).__name__} {axes!r}.")
        )
    if not items:
        raise MeshkitError(
            "meshkit.make_mesh: axes is empty; a mesh needs at least one axis. "
            "Consider {'data': -1} for a 1-D mesh over all devices."
        )
    parsed: list[tuple[str, int]] = []
    seen: set[str] = set()
    for name, size in items:
        if not isinstance(name, str):
            raise MeshkitError(
                f"meshkit.make_mesh: axis names must be strings; got {name!r} "
                f"({type(name).__name__}) in axes={_show(items)}."
            )
        if not name.isidentifier() or name == "_":
            raise MeshkitError(
                f"meshkit.make_mesh: axis name {name!r} is not a Python identifier (letters, "
                "digits and '_', not starting with a digit, not '_' alone); meshkit's spec "
                f"strings need that. Got axes={_show(items)}."
            )
        if name in seen:
            raise MeshkitError(
                f"meshkit.make_mesh: axis name {name!r} appears twice in axes={_show(items)}; "
                "each mesh axis needs its own name."
            )
        seen.add(name)
        try:
            size_int = None if isinstance(size, bool) else operator.index(size)
        except TypeError:
            size_int = None
        if size_int is None:
            raise MeshkitError(
                f"meshkit.make_mesh: the size of axis {name!r} must be an int (or -1 to fill); "
                f"got {size!r} ({type(size).__name__})."
            )
        if size_int < 1 and size_int != -1:
            raise MeshkitError(
                f"meshkit.make_mesh: the size of axis {name!r} is {size_int}; sizes must be "
                "positive, or -1 for the one axis that fills the remaining devices."
            )
        parsed.append((name, size_int))
    fill = [n for n, s in parsed if s == -1]
    if len(fill) > 1:
        raise MeshkitError(
            f"meshkit.make_mesh: axes {fill} are all -1 in axes={_show(parsed)}; at most one axis "
            "may be -1 (its size is what the others leave). Consider fixing all but one."
        )
    return parsed


def _show(items: Sequence[tuple[Any, Any]]) -> str:
    return "{" + ", ".join(f"{n!r}: {s!r}" for n, s in items) + "}"


def resolve_sizes(parsed: list[tuple[str, int]], count: int, given: bool) -> tuple[int, ...]:
    known = math.prod(s for _, s in parsed if s != -1)
    where = "devices= holds" if given else "the program has"
    if any(s == -1 for _, s in parsed):
        if count % known:
            raise MeshkitError(
                f"meshkit.make_mesh: cannot fill the -1 axis in axes={_show(parsed)}: {where} "
                f"{count} devices, which the other axes' product {known} does not divide.\n"
                f"Consider sizes whose product divides {count}."
            )
        return tuple(count // known if s == -1 else s for _, s in parsed)
    if known != count:
        first = parsed[0][0]
        suggest = ", ".join(f"{n!r}: {-1 if n == first else s}" for n, s in parsed)
        fix = (
            f"Consider using -1 for one axis to fill the remaining devices (e.g. {{{suggest}}}), "
            f"or pass devices= with the {known} devices you mean to use"
            if known < count
            else f"Consider sizes whose product is {count}, or -1 for one axis (e.g. {{{suggest}}})"
        )
        raise MeshkitError(
            f"meshkit.make_mesh: axes={_show(parsed)} multiply to {known}, but {where} {count} "
            f"device{'s' if count != 1 else ''}; a mesh must use exactly the devices it is given "
            f"(no silent subset).\n{fix}."
        )
    return tuple(s for _, s in parsed)


def _factors(
    sizes: Sequence[int], count: int, among: Collection[int] | None = None
) -> tuple[int, ...] | None:
    """Split ``count`` over the axes (those in ``among``), outermost first, by gcd; None if not.

    Over all axes this succeeds whenever ``count`` divides the product of the sizes.
    """
    remaining = count
    factors = []
    for i, size in enumerate(sizes):
        f = math.gcd(size, remaining) if among is None or i in among else 1
        factors.append(f)
        remaining //= f
    return tuple(factors) if remaining == 1 else None


def domains(devices: Sequence[Any], hosts: _hosts.Hosts | None) -> dict[int, Any] | None:
    """Each process's fast domain, its TPU slice (multi-slice) or its host; None: neither known."""
    slices = {int(d.process_index): getattr(d, "slice_index", None) for d in devices}
    if None not in slices.values() and len(set(slices.values())) > 1:
        return {p: ("slice", s) for p, s in slices.items()}
    if hosts is None:
        return None
    return {p: ("host", hosts.of_process[p]) for p in slices}


def order_devices(
    devices: Sequence[Any],
    sizes: Sequence[int],
    *,
    host_of: Sequence[int] | Mapping[int, Any] | None = None,
    across: Collection[int] | None = None,
) -> np.ndarray:
    """Arrange ``devices`` into an array of shape ``sizes``, inner axes inside a host.

    The order is docs/meshes.md's; any objects with ``process_index`` work (test doubles too).
    ``host_of`` gives each process's host (None: one host per process); ``across``, the positions
    of the axes that take the host factors (None: any, outermost first).

    Examples:
        >>> from types import SimpleNamespace as D
        >>> devs = [D(id=i, process_index=i // 2) for i in range(8)]
        >>> # processes 0 and 2 on one host, 1 and 3 on another (ranks interleaved)
        >>> grid = order_devices(devs, (2, 4), host_of=["a", "b", "a", "b"])
        >>> [[d.id for d in row] for row in grid]
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    by_process: dict[int, list[Any]] = {}
    for d in devices:
        by_process.setdefault(int(d.process_index), []).append(d)
    counts = {p: len(ds) for p, ds in sorted(by_process.items())}
    if len(set(counts.values())) > 1:
        raise MeshkitError(
            "meshkit.make_mesh: the devices belong to processes in unequal numbers "
            f"(process: devices = {counts}); meshkit keeps each process's devices together, "
            "which needs the same number from each.\n"
            "Consider passing devices= with the same number of devices from every process."
        )
    # The processes grouped by host, in order; one per process if hosts are unknown or unequal.
    groups = [[p] for p in sorted(by_process)]
    if host_of is not None:
        hosts: dict[Any, list[int]] = {}
        for p in sorted(by_process):
            hosts.setdefault(host_of[p], []).append(p)
        if len({len(g) for g in hosts.values()}) == 1:
            groups = list(hosts.values())
    n_hosts, per_host, per_process = len(groups), len(groups[0]), len(by_process[groups[0][0]])
    h = _factors(sizes, n_hosts, across)
    if h is None:
        assert across is not None
        chosen = [sizes[i] for i in sorted(across)]
        raise MeshkitError(
            f"meshkit.make_mesh: the axes across hosts, of sizes {chosen}, cannot span the "
            f"{n_hosts} hosts: their product must be a multiple of {n_hosts} (the other axes "
            "stay inside a host).\nConsider sizes for those axes whose product is a multiple "
            f"of the host count, e.g. {n_hosts}."
        )
    inner = tuple(s // f for s, f in zip(sizes, h, strict=True))
    q = _factors(inner, per_host)
    assert q is not None  # prod(inner) == per_host * per_process
    local = tuple(s // f for s, f in zip(inner, q, strict=True))
    grid = np.empty((n_hosts, per_host, per_process), dtype=object)
    grid[...] = [[by_process[p] for p in group] for group in groups]
    k = len(sizes)
    # (hosts, processes, devices) -> (h_0..h_k-1, q_0..q_k-1, l_0..l_k-1)
    # -> (h_0, q_0, l_0, h_1, q_1, l_1, ...) -> sizes
    split = grid.reshape(h + q + local)
    interleave = [ax for i in range(k) for ax in (i, k + i, 2 * k + i)]
    return split.transpose(interleave).reshape(tuple(sizes))


def axis_types_of(axis_types: Any, names: Sequence[str]) -> tuple[AxisType, ...]:
    if axis_types is None or isinstance(axis_types, AxisType | str):
        return (_axis_type(AxisType.Auto if axis_types is None else axis_types, ""),) * len(names)
    if isinstance(axis_types, Mapping):
        unknown = set(axis_types) - set(names)
        if unknown:
            raise MeshkitError(
                f"meshkit.make_mesh: axis_types names {sorted(unknown)}, which are not mesh axes "
                f"{list(names)}."
            )
        return tuple(_axis_type(axis_types.get(n, AxisType.Auto), f"[{n!r}]") for n in names)
    types = list(axis_types)
    if len(types) != len(names):
        raise MeshkitError(
            f"meshkit.make_mesh: axis_types has {len(types)} "
            f"entr{'y' if len(types) == 1 else 'ies'} for {len(names)} axes "
            f"{list(names)}; give one per axis, a mapping, or a single type for all."
        )
    return tuple(_axis_type(t, f"[{i}]") for i, t in enumerate(types))


def across_positions(across_hosts: Any, names: Sequence[str]) -> frozenset[int] | None:
    """The positions of the ``across_hosts`` axes, None when not given."""
    if across_hosts is None:
        return None
    chosen = [across_hosts] if isinstance(across_hosts, str) else across_hosts
    if not isinstance(chosen, Iterable) or not all(isinstance(a, str) for a in chosen):
        raise MeshkitError(
            "meshkit.make_mesh: across_hosts must be an axis name or a sequence of them; got "
            f"{across_hosts!r}."
        )
    chosen = list(chosen)
    unknown = [a for a in chosen if a not in names]
    if unknown or not chosen:
        raise MeshkitError(
            f"meshkit.make_mesh: across_hosts={across_hosts!r} names "
            f"{'no axis' if not chosen else ', '.join(map(repr, unknown))}, not "
            f"{'an axis' if len(unknown) <= 1 else 'axes'} of the mesh {list(names)}.\n"
            "Consider the name of the outer axis that runs across hosts, e.g. "
            f"across_hosts={names[0]!r}."
        )
    return frozenset(names.index(a) for a in chosen)


@public
def describe(mesh: Mesh) -> str:
    """A readable text picture of any ``mesh``: its axes, which process owns which part, devices.

    Rows are the coordinates of all axes but the last, columns those of the last; each cell is
    ``p<process>/d<device id>``. Across several hosts (as `meshkit.init` learned them), a line
    per host says what it holds.

    Examples:
        >>> import meshkit
        >>> mesh = meshkit.make_mesh({"data": 2, "model": 4})
        >>> print(meshkit.describe(mesh))  # doctest: +ELLIPSIS
        Mesh {'data': 2, 'model': 4}: 8 devices on 1 process
        ...
    """
    devs = np.asarray(mesh.devices, dtype=object)
    names = list(mesh.axis_names)
    shape = devs.shape
    processes = sorted({int(d.process_index) for d in devs.flat})
    kinds = Counter(
        d.platform if kind.lower() == d.platform else f"{d.platform} ({kind})"
        for d in devs.flat
        for kind in [str(getattr(d, "device_kind", d.platform))]
    )
    axis_desc = ", ".join(f"{n!r}: {s}" for n, s in zip(names, shape, strict=True))
    n_proc = len(processes)
    table = _hosts.known()
    host_of = None
    if table is not None and len({table.of_process[p] for p in processes}) > 1:
        host_of = {p: table.host_of(p) for p in processes}
    on_hosts = "" if host_of is None else f" on {len(set(host_of.values()))} hosts"
    lines = [
        f"Mesh {{{axis_desc}}}: {devs.size} device{'s' if devs.size != 1 else ''} on {n_proc} "
        f"process{'es' if n_proc > 1 else ''}{on_hosts}"
    ]
    types = zip(names, mesh.axis_types, strict=True)
    lines.append("axis types: " + ", ".join(f"{n}={t.name}" for n, t in types))
    lines.append("devices: " + ", ".join(f"{c} x {k}" for k, c in kinds.items()))
    lines.append("")
    rows = [("", [f"{names[-1]}={j}" for j in range(shape[-1])])]  # the column labels first
    for idx, row in zip(np.ndindex(*shape[:-1]), devs.reshape(-1, shape[-1]), strict=True):
        label = " ".join(f"{n}={i}" for n, i in zip(names[:-1], idx, strict=True))
        rows.append((label, [f"p{d.process_index}/d{d.id}" for d in row]))
    label_w = max(len(label) for label, _ in rows)
    cell_w = max(len(c) for _, cells in rows for c in cells)
    for label, cells in rows:
        prefix = label.ljust(label_w) + "  " if label_w else ""
        lines.append(prefix + "  ".join(c.ljust(cell_w) for c in cells).rstrip())
    lines.append("")
    owner = np.vectorize(lambda d: int(d.process_index), otypes=[int])(devs)

    def place(held: np.ndarray) -> str:
        where = np.argwhere(held)
        ids = [int(d.id) for d in devs[held]]
        coords = ", ".join(
            f"{n}={ranges(where[:, i].tolist(), sep=',')}" for i, n in enumerate(names)
        )
        return f"devices {ranges(ids, sep=',')}; {coords}"

    if host_of is not None:
        for host in dict.fromkeys(host_of.values()):
            mine = [p for p in processes if host_of[p] == host]
            held = np.isin(owner, mine)
            lines.append(f"host {host}: {_missing.processes(mine)}; {place(held)}")
    for p in processes:
        at = "" if host_of is None else f" on {host_of[p]}"
        lines.append(f"process {p}{at}: {place(owner == p)}")
    return "\n".join(lines)
