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
from ._assembly import global_array_from_local as global_array_from_local
from ._batches import GlobalBatches as GlobalBatches
from ._batches import global_batches as global_batches
from ._channel import channel as channel
from ._errors import DivergenceError as DivergenceError
from ._errors import LaunchError as LaunchError
from ._errors import MeshkitError as MeshkitError
from ._errors import MeshkitIndexError as MeshkitIndexError
from ._errors import MeshkitNameError as MeshkitNameError
from ._errors import MeshkitTypeError as MeshkitTypeError
from ._gather import gather as gather
from ._gather import local_from_global as local_from_global
from ._global import DtypeWarning as DtypeWarning
from ._launch import LaunchResult as LaunchResult
from ._launch import RankResult as RankResult
from ._launch import launch as launch
from ._layout import ProcessSlice as ProcessSlice
from ._layout import process_slice as process_slice
from ._legacy import device_put_replicated as device_put_replicated
from ._legacy import device_put_sharded as device_put_sharded
from ._legacy import get_metrics as get_metrics
from ._legacy import pad_shard_unpad as pad_shard_unpad
from ._legacy import prefetch_to_device as prefetch_to_device
from ._legacy import replicate as replicate
from ._legacy import shard as shard
from ._legacy import shard_prng_key as shard_prng_key
from ._legacy import unreplicate as unreplicate
from ._mesh import describe as describe
from ._mesh import make_mesh as make_mesh
from ._pmap import PmapFunction as PmapFunction
from ._pmap import UncheckedOutputWarning as UncheckedOutputWarning
from ._pmap import pmap_compat as pmap_compat
from ._pmap_stages import Compiled as Compiled
from ._pmap_stages import Lowered as Lowered
from ._runtime import RuntimeInfo as RuntimeInfo
from ._runtime import init as init
from ._runtime import runtime_info as runtime_info
from ._specs import spec as spec
from ._spmd import ReshardWarning as ReshardWarning
from ._spmd import SpmdFunction as SpmdFunction
from ._spmd import spmd as spmd
from .debug import barrier as barrier

__version__ = "0.1.0.dev0"

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
