"""Named-axis collectives for per-device code (inside `meshkit.spmd` or `jax.shard_map`).

Each takes a mesh axis name or a tuple of them (one group, numbered row-major in the order
given) and works on pytrees like its `jax.lax` counterpart. meshkit adds checks while tracing:
an axis not bound where the collective is called, a dimension the group size does not divide,
a permutation that leaves the group.
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
    "AxisName", "Interceptor", "all_gather", "all_to_all", "axis_index", "axis_size", "pmax",
    "pmean", "pmin", "ppermute", "psum", "psum_scatter", "shift",
]  # fmt: skip
