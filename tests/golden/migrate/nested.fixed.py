"""Nested pmap in each form meshkit migrate finds."""

import functools

import jax
import meshkit

inner = meshkit.pmap_compat(lambda x: x * 2, axis_name="j")

# pmap of a pmapped function, and of a pmap call
twice = meshkit.pmap_compat(inner, axis_name="i")
again = meshkit.pmap_compat(meshkit.pmap_compat(lambda x: x, axis_name="j"), axis_name="i")


# stacked decorators
@meshkit.pmap_compat
@functools.partial(meshkit.pmap_compat, axis_name="j")
def stacked(x):
    return x


# a pmapped function called in the body of another; one of them has out_axes=None
flat = meshkit.pmap_compat(lambda x: x.sum(), axis_name="k", out_axes=None)


@functools.partial(meshkit.pmap_compat, axis_name="i")
def body(x):
    return inner(x) + flat(x)


# already on meshkit at both levels: nothing to report
inner_ok = meshkit.pmap_compat(lambda x: x, axis_name="j")
outer_ok = meshkit.pmap_compat(lambda x: inner_ok(x), axis_name="i")


# the pmapped body reached through functools.partial
def scaled(x, scale):
    return inner(x) * scale


by_partial = meshkit.pmap_compat(functools.partial(scaled, scale=2), axis_name="i")


# A script (or a notebook's cells) that binds a name plainly, uses it, then binds it to a pmap:
# the first use is of the plain function, not nested.
def square(x):
    return x * x


squares = meshkit.pmap_compat(square)(jax.numpy.ones(1))  # MK001 only
square = meshkit.pmap_compat(square)  # MK001, and square is pmapped from here on
