"""meshkit: multi-host JAX made simple, fast and safe.

One Python process per host runs the same program; meshkit joins them (`init`), builds
meshes over every device of every process (`make_mesh`), and starts local multi-process
runs for development and tests (``meshkit launch``, `meshkit.testing`). Per-device code runs
through `spmd` with the named-axis collectives of `meshkit.collectives`. Data pipelines turn
each process's batches into global arrays (`global_array_from_local`, `global_batches`) and
back (`local_from_global`, `gather`); `process_slice` says which part each process loads, and
`meshkit.loaders` applies it to grain and Hugging Face `datasets` loaders.
Code written for `jax.pmap` runs on mesh sharding through `pmap_compat` and the legacy helpers
(`replicate`, `unreplicate`, `shard`, ...); ``meshkit migrate`` finds and rewrites it.
`meshkit.debug` (``MESHKIT_DEBUG=1``) turns processes that diverge or stall into errors that name
them (`DivergenceError`); `barrier` is a named meeting point with a timeout.
`meshkit.checkpoint` saves global arrays with orbax and restores them onto any mesh, checked.
"""

from . import checkpoint as checkpoint
from . import collectives as collectives
from . import debug as debug
from . import loaders as loaders
from ._src.arrays.assembly import global_array_from_local as global_array_from_local
from ._src.arrays.batches import GlobalBatches as GlobalBatches
from ._src.arrays.batches import global_batches as global_batches
from ._src.arrays.dtypes import DtypeWarning as DtypeWarning
from ._src.arrays.gather import gather as gather
from ._src.arrays.gather import local_from_global as local_from_global
from ._src.coord.channel import channel as channel
from ._src.core.errors import DivergenceError as DivergenceError
from ._src.core.errors import LaunchError as LaunchError
from ._src.core.errors import MeshkitError as MeshkitError
from ._src.core.errors import MeshkitIndexError as MeshkitIndexError
from ._src.core.errors import MeshkitNameError as MeshkitNameError
from ._src.core.errors import MeshkitTypeError as MeshkitTypeError
from ._src.core.version import __version__ as __version__
from ._src.launch.launcher import LaunchResult as LaunchResult
from ._src.launch.launcher import RankResult as RankResult
from ._src.launch.launcher import launch as launch
from ._src.pmap.entry import UncheckedOutputWarning as UncheckedOutputWarning
from ._src.pmap.legacy import device_put_replicated as device_put_replicated
from ._src.pmap.legacy import device_put_sharded as device_put_sharded
from ._src.pmap.legacy import replicate as replicate
from ._src.pmap.legacy import shard_prng_key as shard_prng_key
from ._src.pmap.legacy import unreplicate as unreplicate
from ._src.pmap.legacy_data import get_metrics as get_metrics
from ._src.pmap.legacy_data import pad_shard_unpad as pad_shard_unpad
from ._src.pmap.legacy_data import prefetch_to_device as prefetch_to_device
from ._src.pmap.legacy_data import shard as shard
from ._src.pmap.pmap import PmapFunction as PmapFunction
from ._src.pmap.pmap import pmap_compat as pmap_compat
from ._src.pmap.stages import Compiled as Compiled
from ._src.pmap.stages import Lowered as Lowered
from ._src.runtime.init import RuntimeInfo as RuntimeInfo
from ._src.runtime.init import init as init
from ._src.runtime.init import runtime_info as runtime_info
from ._src.sharding.layout import ProcessSlice as ProcessSlice
from ._src.sharding.layout import process_slice as process_slice
from ._src.sharding.mesh import describe as describe
from ._src.sharding.mesh import make_mesh as make_mesh
from ._src.sharding.specs import spec as spec
from ._src.spmd.spmd import ReshardWarning as ReshardWarning
from ._src.spmd.spmd import SpmdFunction as SpmdFunction
from ._src.spmd.spmd import spmd as spmd
from .debug import barrier as barrier

__all__ = [
    "Compiled",
    "DivergenceError",
    "DtypeWarning",
    "GlobalBatches",
    "LaunchError",
    "LaunchResult",
    "Lowered",
    "MeshkitError",
    "MeshkitIndexError",
    "MeshkitNameError",
    "MeshkitTypeError",
    "PmapFunction",
    "ProcessSlice",
    "RankResult",
    "ReshardWarning",
    "RuntimeInfo",
    "SpmdFunction",
    "UncheckedOutputWarning",
    "barrier",
    "channel",
    "checkpoint",
    "collectives",
    "debug",
    "describe",
    "device_put_replicated",
    "device_put_sharded",
    "gather",
    "get_metrics",
    "global_array_from_local",
    "global_batches",
    "init",
    "launch",
    "loaders",
    "local_from_global",
    "make_mesh",
    "pad_shard_unpad",
    "pmap_compat",
    "prefetch_to_device",
    "process_slice",
    "replicate",
    "runtime_info",
    "shard",
    "shard_prng_key",
    "spec",
    "spmd",
    "unreplicate",
]
