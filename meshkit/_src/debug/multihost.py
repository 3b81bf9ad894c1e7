"""``jax.experimental.multihost_utils``' collectives, checked in debug mode before they run.

`process_allgather`, `broadcast_one_to_all`, `sync_global_devices` and `assert_equal` each run a
computation over every device of every process: called with different shapes or names, or in a
different order, by the processes, it hangs or dies in the collective library. meshkit leaves
JAX's module as it is; a program that wants these calls checked calls meshkit's versions
(``meshkit.debug.process_allgather`` ...), which take JAX's arguments and return JAX's answers.
While debug mode is on, each call is an SPMD entry of its own (kind ``multihost_utils``),
fingerprinted and agreed on in this thread's sequence of checked calls before JAX's function
runs (`.divergence.check`); off, it is JAX's function behind one test.

Compared: the function; the arguments' pytree structure and each leaf's shape, dtype and
sharding; `sync_global_devices`' name and `process_allgather`'s ``tiled``. Not compared:
``is_source`` and ``fail_message``, which may differ by process, nor values (which `assert_equal`
itself compares). A call from a thread that is neither the program's thread nor inside a
`meshkit.channel` runs unchecked: its order against the other processes' calls is not defined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..coord import channel as _channel
from ..core.tracebacks import public
from . import divergence as _divergence
from . import state as _st

__all__ = ["assert_equal", "broadcast_one_to_all", "process_allgather", "sync_global_devices"]


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


def _jax() -> Any:
    from jax.experimental import multihost_utils  # imported at the first call, not at import

    return multihost_utils


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
