"""Named-axis collectives for per-device code (inside `meshkit.spmd` or `jax.shard_map`).

Each function takes one mesh axis name or a tuple of them. With a tuple, the devices along those
axes form one group, numbered row-major in the order the names are given (so
``all_gather(x, ("data", "model"))`` puts the ``data`` index outermost). All of them work on
pytrees of arrays, like their `jax.lax` counterparts, which do the work.

What meshkit adds is checking with messages that name the function, the bad value and what
would be valid: an axis name that is not bound where the collective is called (outside spmd, a
typo, an axis the mesh lacks), a dimension that does not divide by the group size, a
permutation that leaves the group. The checks run while JAX traces, never per call.

`meshkit.testing` runs the same per-device code one device at a time against numpy references
of these functions; that works only for code that calls the collectives through this module.
"""

from ._src.spmd.axis_collectives import AxisName as AxisName
from ._src.spmd.axis_collectives import Interceptor as Interceptor
from ._src.spmd.axis_collectives import all_gather as all_gather
from ._src.spmd.axis_collectives import all_to_all as all_to_all
from ._src.spmd.axis_collectives import axis_index as axis_index
from ._src.spmd.axis_collectives import axis_size as axis_size
from ._src.spmd.axis_collectives import interceptor as interceptor
from ._src.spmd.axis_collectives import pmax as pmax
from ._src.spmd.axis_collectives import pmean as pmean
from ._src.spmd.axis_collectives import pmin as pmin
from ._src.spmd.axis_collectives import ppermute as ppermute
from ._src.spmd.axis_collectives import psum as psum
from ._src.spmd.axis_collectives import psum_scatter as psum_scatter
from ._src.spmd.axis_collectives import shift as shift

__all__ = [
    "AxisName",
    "Interceptor",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "shift",
]
