"""The ground floor: errors, JAX internals (`compat`), settings, frames, the launcher contract."""
