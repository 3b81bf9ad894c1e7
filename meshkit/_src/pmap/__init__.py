"""``pmap_compat`` (`jax.pmap` on jit and shard_map), its stages and the flax-era helpers."""
