"""Where processes agree: through JAX's coordination service, never a device collective."""
