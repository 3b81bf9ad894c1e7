"""JAX's ``multihost_utils`` collectives, checked in debug mode before they run.

Each is an SPMD entry of its own (kind ``multihost_utils``); ``is_source`` and ``fail_message``
may differ by process and are not compared. A call from an unpaired thread runs unchecked.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

from ..coord import channel as _channel
from ..core.tracebacks import public
from . import divergence as _divergence
from . import state as _st


@dataclass(eq=False)
class _Site:
    """A function of multihost_utils as an SPMD entry (what `.fingerprint.Site` reads)."""

    kind: str
    name: str
    calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def _check(name: str, params: tuple[str, ...], values: tuple[Any, ...], static: int = -1) -> None:
    """Check this call of ``name`` against the other processes' while debug mode is on."""
    if _st.state.settings is None or not _channel.paired():
        return
    site = _st.state.sites.get(name)
    if site is None:  # numbered from the call debug mode was turned on
        info = {"params": params, "static_argnums": () if static < 0 else (static,)}
        site = _st.state.sites[name] = _Site("multihost_utils", _PREFIX + name, info=info)
    site.calls += 1
    _divergence.check(site, values)


_PREFIX = "jax.experimental.multihost_utils."


# JAX's module, imported at the first call, not at import.
_jax = functools.partial(importlib.import_module, "jax.experimental.multihost_utils")


@public
def process_allgather(in_tree: Any, tiled: bool = False) -> Any:
    """``jax.experimental.multihost_utils.process_allgather``, checked in debug mode first."""
    _check("process_allgather", ("in_tree", "tiled"), (in_tree, tiled), static=1)
    return _jax().process_allgather(in_tree, tiled=tiled)


@public
def broadcast_one_to_all(in_tree: Any, is_source: bool | None = None) -> Any:
    """``jax.experimental.multihost_utils.broadcast_one_to_all``, checked in debug mode first."""
    _check("broadcast_one_to_all", ("in_tree",), (in_tree,))
    return _jax().broadcast_one_to_all(in_tree, is_source=is_source)


@public
def sync_global_devices(name: str) -> None:
    """``jax.experimental.multihost_utils.sync_global_devices``, checked in debug mode first."""
    _check("sync_global_devices", ("name",), (name,), static=0)
    _jax().sync_global_devices(name)


@public
def assert_equal(in_tree: Any, fail_message: str = "") -> None:
    """``jax.experimental.multihost_utils.assert_equal``, checked in debug mode first."""
    _check("assert_equal", ("in_tree",), (in_tree,))
    _jax().assert_equal(in_tree, fail_message=fail_message)
