import jax


def f(:
    return jax.pmap(f)
