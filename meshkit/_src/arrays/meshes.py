"""`meshkit.make_mesh`: the pure device order of `sharding.mesh`, agreed by every process."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.frames import public
from ..runtime import dispatch as _dispatch
from ..runtime import hosts as _hosts
from ..sharding import mesh as _mesh
from ..sharding.mesh import AxisTypeLike
from .records import agree_on

_SITE = _dispatch.CallSite(
    "make_mesh",
    "meshkit.make_mesh",
    info={
        "params": ("axes", "devices", "axis_types", "across_hosts"),
        "static_argnums": (0, 1, 2, 3),
    },
)


@public
def make_mesh(
    axes: Mapping[str, int] | Sequence[tuple[str, int]],
    *,
    devices: Sequence[Any] | np.ndarray | None = None,
    axis_types: AxisTypeLike | Mapping[str, AxisTypeLike] | Sequence[AxisTypeLike] | None = None,
    across_hosts: str | Sequence[str] | None = None,
) -> Mesh:
    """Make a `jax.sharding.Mesh` over all devices of all processes.

    Inner (later) axes stay inside one host, and one process, whenever the sizes allow; an axis
    that must straddle hosts or processes does so in whole blocks. With several processes,
    they check through the coordination service that they all built the same mesh.

    Args:
        axes: axis name -> size, outermost first; one size may be ``-1`` to fill the rest.
            Names must be Python identifiers.
        devices: the devices to use (default: ``jax.devices()``), the same number from each
            process.
        axis_types: one `jax.sharding.AxisType` (or ``"auto"``, ``"explicit"``, ``"manual"``)
            for all axes, one per axis, or a mapping name -> type. Default ``Auto``.
        across_hosts: the axis or axes that run across hosts (as ``dcn_mesh_shape`` in JAX's
            ``create_hybrid_device_mesh``): together they take every factor of the host
            count, outermost first. Default: the outermost axes that can.

    Returns:
        The mesh; JAX's own type, usable wherever JAX takes one.

    Raises:
        MeshkitError: bad names or sizes, sizes that do not use exactly the devices, unequal
            devices per process, ``across_hosts`` axes that are not mesh axes or cannot span
            the hosts, or processes that disagree on the mesh.

    Examples:
        >>> import meshkit
        >>> mesh = meshkit.make_mesh({"data": -1, "model": 2})
        >>> dict(mesh.shape)
        {'data': 4, 'model': 2}
    """
    parsed = _mesh.parse_axes(axes)
    _dispatch.enter(
        _SITE,
        (
            ",".join(f"{n}={s}" for n, s in parsed),
            None if devices is None else int(np.size(devices)),
            repr(axis_types),
            repr(across_hosts),
        ),
    )
    if devices is None:
        device_list = list(jax.devices())
    else:
        device_list = list(np.asarray(devices, dtype=object).flat)
        if not device_list:
            raise MeshkitError("meshkit.make_mesh: devices= is empty.")
        dup = sorted(i for i, k in collections.Counter(d.id for d in device_list).items() if k > 1)
        if dup:
            raise MeshkitError(
                f"meshkit.make_mesh: devices= lists devices {dup} more than once; each device "
                "can hold one mesh position."
            )
    names = tuple(n for n, _ in parsed)
    sizes = _mesh.resolve_sizes(parsed, len(device_list), devices is not None)
    types = _mesh.axis_types_of(axis_types, names)
    across = _mesh.across_positions(across_hosts, names)
    n = _compat.distributed_state()[2]
    hosts = _hosts.table(_env.check_timeout(), "meshkit.make_mesh") if n > 1 else None
    grid = _mesh.order_devices(
        device_list, sizes, host_of=_mesh.domains(device_list, hosts), across=across
    )
    if n > 1:  # every process built the same mesh
        ids = ",".join(str(d.id) for d in grid.flat)
        shape = ", ".join(f"{a!r}: {s}" for a, s in zip(names, sizes, strict=True))
        mine = f"{{{shape}}} devices [{ids}]"
        values = agree_on(
            _channel.scoped("make_mesh", "meshkit.make_mesh"), mine, "meshkit.make_mesh",
            arrive="reach make_mesh", did=f" (the others did, with {mine})",
            rule="Every process must call make_mesh, the same number of times and in the same "
            "order.",
        )  # fmt: skip
        if values is not None:
            raise MeshkitError(
                "meshkit.make_mesh: processes disagree on the mesh:\n"
                f"{_missing.lines(_missing.by_value(values))}\n"
                "Every process must build the same mesh (same axes, sizes and devices).\n"
                "Consider computing axes from values every process shares (jax.process_count(), "
                "jax.device_count(), a config file), not from per-process state."
            )
    return Mesh(grid, names, axis_types=types)
