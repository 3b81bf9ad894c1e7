"""meshkit: multi-host JAX made simple, fast and safe.

Join the processes (`init`), build meshes over all their devices (`make_mesh`), run per-device
code (`spmd`, `meshkit.collectives`), turn per-process batches into global arrays and back
(`global_batches`, `local_from_global`), checkpoint (`meshkit.checkpoint`) and debug
(`meshkit.debug`). See docs/index.md.
"""
# Lazy (PEP 562): a name's module loads on first use, so that ``meshkit launch`` starts without
# JAX. The TYPE_CHECKING imports are the one list: type checkers read them, and so does `_lazy`
# (as lazy_loader's ``attach_stub`` reads a stub), at the first public name asked for.

from __future__ import annotations

import functools as _functools
import importlib as _importlib
import typing as _typing

from ._src.core.errors import DivergenceError as DivergenceError
from ._src.core.errors import LaunchError as LaunchError
from ._src.core.errors import MeshkitError as MeshkitError
from ._src.core.errors import MeshkitIndexError as MeshkitIndexError
from ._src.core.errors import MeshkitNameError as MeshkitNameError
from ._src.core.errors import MeshkitTypeError as MeshkitTypeError
from ._src.core.version import __version__ as __version__

if _typing.TYPE_CHECKING:
    from . import checkpoint as checkpoint
    from . import collectives as collectives
    from . import debug as debug
    from . import loaders as loaders
    from ._src.arrays.assembly import global_array_from_local as global_array_from_local
    from ._src.arrays.batches import GlobalBatches as GlobalBatches
    from ._src.arrays.batches import global_batches as global_batches
    from ._src.arrays.blocks import DtypeWarning as DtypeWarning
    from ._src.arrays.meshes import make_mesh as make_mesh
    from ._src.arrays.to_host import gather as gather
    from ._src.arrays.to_host import local_from_global as local_from_global
    from ._src.coord.channel import channel as channel
    from ._src.core.data_position import DataPosition as DataPosition
    from ._src.core.events import Goodput as Goodput
    from ._src.launch.launcher import LaunchResult as LaunchResult
    from ._src.launch.launcher import RankResult as RankResult
    from ._src.launch.launcher import launch as launch
    from ._src.launch.report import LaunchAttempt as LaunchAttempt
    from ._src.lifecycle.preemption import PreemptionNotice as PreemptionNotice
    from ._src.lifecycle.preemption import notice as preemption_notice
    from ._src.lifecycle.profiles import profile_steps as profile_steps
    from ._src.lifecycle.stragglers import StepRow as StepRow
    from ._src.lifecycle.stragglers import step_times as step_times
    from ._src.pmap.entry import UncheckedOutputWarning as UncheckedOutputWarning
    from ._src.pmap.legacy import device_put_replicated as device_put_replicated
    from ._src.pmap.legacy import device_put_sharded as device_put_sharded
    from ._src.pmap.legacy import get_metrics as get_metrics
    from ._src.pmap.legacy import pad_shard_unpad as pad_shard_unpad
    from ._src.pmap.legacy import prefetch_to_device as prefetch_to_device
    from ._src.pmap.legacy import replicate as replicate
    from ._src.pmap.legacy import shard as shard
    from ._src.pmap.legacy import shard_prng_key as shard_prng_key
    from ._src.pmap.legacy import unreplicate as unreplicate
    from ._src.pmap.pmap import Compiled as Compiled
    from ._src.pmap.pmap import Lowered as Lowered
    from ._src.pmap.pmap import PmapFunction as PmapFunction
    from ._src.pmap.pmap import pmap_compat as pmap_compat
    from ._src.runtime.hosts import Hosts as Hosts
    from ._src.runtime.init import RuntimeInfo as RuntimeInfo
    from ._src.runtime.init import init as init
    from ._src.runtime.init import runtime_info as runtime_info
    from ._src.sharding.layout import ProcessSlice as ProcessSlice
    from ._src.sharding.layout import process_slice as process_slice
    from ._src.sharding.mesh import describe as describe
    from ._src.sharding.specs import spec as spec
    from ._src.spmd.spmd import ReshardWarning as ReshardWarning
    from ._src.spmd.spmd import SpmdFunction as SpmdFunction
    from ._src.spmd.spmd import spmd as spmd
    from .debug import barrier as barrier

__all__ = [
    "Compiled", "DataPosition", "DivergenceError", "DtypeWarning", "GlobalBatches", "Goodput",
    "Hosts", "LaunchAttempt", "LaunchError", "LaunchResult", "Lowered", "MeshkitError",
    "MeshkitIndexError", "MeshkitNameError", "MeshkitTypeError", "PmapFunction",
    "PreemptionNotice", "ProcessSlice", "RankResult", "ReshardWarning", "RuntimeInfo",
    "SpmdFunction", "StepRow", "UncheckedOutputWarning", "barrier", "channel", "checkpoint",
    "collectives", "debug", "describe", "device_put_replicated", "device_put_sharded",
    "gather", "get_metrics", "global_array_from_local", "global_batches", "init", "launch",
    "loaders", "local_from_global", "make_mesh", "pad_shard_unpad", "pmap_compat",
    "preemption_notice", "prefetch_to_device", "process_slice", "profile_steps", "replicate",
    "runtime_info", "shard", "shard_prng_key", "spec", "spmd", "step_times", "unreplicate",
]  # fmt: skip


@_functools.cache
def _lazy() -> dict[str, tuple[str, str]]:
    """Public name -> (module, name in it), read from the TYPE_CHECKING imports above."""
    import ast  # here, not at import: ``import meshkit`` stays light

    with open(__file__, encoding="utf-8") as f:
        block = next(node for node in ast.parse(f.read()).body if isinstance(node, ast.If))
    return {
        alias.asname or alias.name: ("." * node.level + (node.module or ""), alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def __getattr__(name: str) -> _typing.Any:
    """Loads a public name's module on first use (PEP 562), then keeps the name here."""
    where = _lazy().get(name)
    if where is None:
        raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
    module_name, attribute = where
    if module_name == ".":  # ``from . import checkpoint``: a public module
        value = _importlib.import_module(f".{attribute}", __name__)
    else:
        value = getattr(_importlib.import_module(module_name, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
