"""A legacy program run by `python entry_point.py` on each host: --fix must make it join."""

import jax
import jax.numpy as jnp
import meshkit


def main():
    step = meshkit.pmap_compat(lambda x: x * 2, axis_name="batch")
    out = step(jnp.ones((jax.local_device_count(), 3)))
    print(out.sum())


if __name__ == "__main__":
    meshkit.init()  # meshkit migrate: join this program's processes (before any JAX work)
    main()
