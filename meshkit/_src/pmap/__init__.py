"""``pmap_compat``: ``jax.pmap``'s interface and results, on the spmd machinery.

Also its stages (`Lowered`, `Compiled`), the device-axis conversions and the flax-era helpers
(`replicate`, `shard`, ...).
"""
