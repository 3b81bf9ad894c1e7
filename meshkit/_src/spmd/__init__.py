"""``spmd``: per-device code over a mesh, as ``jax.jit(jax.shard_map(...))``.

With input placement, the named-axis collectives and the replication analysis.
"""
