"""meshkit: multi-host JAX made simple, fast and safe.

One Python process per host runs the same program; meshkit joins them (`init`), builds
meshes over every device of every process (`make_mesh`), and starts local multi-process
runs for development and tests (``meshkit launch``, `meshkit.testing`). Per-device code runs
through `spmd` with the named-axis collectives of `meshkit.collectives`.
"""

from . import collectives as collectives
from ._errors import LaunchError as LaunchError
from ._errors import MeshkitError as MeshkitError
from ._launch import LaunchResult as LaunchResult
from ._launch import RankResult as RankResult
from ._launch import launch as launch
from ._mesh import describe as describe
from ._mesh import make_mesh as make_mesh
from ._runtime import RuntimeInfo as RuntimeInfo
from ._runtime import init as init
from ._runtime import runtime_info as runtime_info
from ._specs import spec as spec
from ._spmd import ReshardWarning as ReshardWarning
from ._spmd import SpmdFunction as SpmdFunction
from ._spmd import spmd as spmd

__version__ = "0.1.0.dev0"

__all__ = [
    "LaunchError",
    "LaunchResult",
    "MeshkitError",
    "RankResult",
    "ReshardWarning",
    "RuntimeInfo",
    "SpmdFunction",
    "collectives",
    "describe",
    "init",
    "launch",
    "make_mesh",
    "runtime_info",
    "spec",
    "spmd",
]
