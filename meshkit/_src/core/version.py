"""meshkit's version, importable without JAX (the package's face re-exports it)."""

__version__ = "0.1.0.dev0"
