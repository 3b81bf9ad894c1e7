"""The CPU backend's facts for joining: its local device count and its collectives."""

from __future__ import annotations

import jax

__all__ = ["collectives", "local_cpu_count", "select_gloo"]


def local_cpu_count() -> int | None:
    """This process's CPU devices, or None where JAX has no CPU backend."""
    try:
        return len(jax.local_devices(backend="cpu"))
    except RuntimeError:
        return None


def collectives() -> str | None:
    """The CPU collectives implementation JAX is set to use (None: none chosen)."""
    value = jax.config.values.get("jax_cpu_collectives_implementation")
    return None if value in (None, "", "none") else str(value)


def select_gloo() -> str | None:
    """Multi-process CPU collectives need an implementation; gloo ships with jaxlib."""
    if collectives() is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    return collectives()
