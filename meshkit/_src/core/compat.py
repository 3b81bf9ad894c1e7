"""The few private JAX internals meshkit relies on, in one place (checked on JAX 0.10.2 and 0.12).

`tests/test_architecture.py` keeps every other module off ``jax._src``. Each touch point, and why:

- ``xla_bridge.backends_are_initialized``: `init` refuses to join once backends run.
- ``config.config_states``, ``config_ext.trace_context_names`` and ``jax/_src/config.py``'s
  ``include_in_jit_key=True`` / ``include_in_trace_context=True`` marks: the preflight compares
  the settings that reach compiled programs (JAX has no public list of them).
- ``pxla.batched_device_put``, ``core.update_aval_with_sharding``, ``core.ShapedArray``: one
  call assembles a global array, without `jax.make_array_from_callback`'s per-device callback.
- ``api.clean_up`` (on ``atexit``): a process leaving early must not wait at JAX's exit barrier.
- ``distributed.global_state``: the coordination client, read without starting backends.
- ``clusters.ClusterEnv.auto_detect_unset_distributed_params`` and ``._cluster_types``: `init`
  checks the coordinator before JAX aborts on it.
- ``core.trace_state_clean``, ``core.get_axis_env``: `pmap_compat` tells a call from a trace.
- the ``scan`` equation's ``num_consts``/``num_carry`` (0.10) or ``ft_in`` (0.12), the aval's
  ``manual_axis_type.varying``: `meshkit.spmd`'s replication analysis.
- ``pxla.MeshComputation`` (``compile``, ``_executable``, ``_name``, ``_device_list``, ``_hlo``,
  ``compile_args``): the program comparison hooks the step every computation passes.
- ``traceback_util._exclude_paths``, ``register_exclusion``: the comparison's frames hidden.
- the coordination key ``RECEIVED_PREEMPTION_NOTICE``: JAX's preemption sync managers learn of
  a notice meshkit's SIGTERM handler took.
"""

from __future__ import annotations

import ast
import atexit
import dataclasses
import datetime
import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from . import caches as _caches


def backends_are_initialized() -> bool:
    """True once JAX has created its backends (after which device settings are frozen)."""
    return bool(_module("jax._src.xla_bridge").backends_are_initialized())


@functools.cache
def _module(name: str) -> Any:
    """JAX's module ``name``, imported at first use (importing meshkit imports none of them)."""
    return importlib.import_module(name)


@functools.cache
def compiled_settings() -> frozenset[str]:
    """The `jax.config` options JAX marks as part of every traced or compiled program.

    jaxlib keeps the ``include_in_jit_key`` mark in C++ without an accessor, so the names are
    read from the literal ``True`` marks in ``jax/_src/config.py``, once per process (20 ms).
    """
    config = _module("jax._src.config")
    marked = set(trace_context_settings() or ())
    path = config.__file__ or ""
    if path.endswith(".py") and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            marked.update(_marked_declarations(f.read(), path))
    return frozenset(marked & set(config.config_states))


def settings_of_jax() -> frozenset[str]:
    """The names of every option registered with `jax.config` (``config_states``)."""
    return frozenset(_module("jax._src.config").config_states)


def setting(name: str) -> Any:
    """The value of `jax.config` option ``name`` (``jax_no_collectives`` is no attribute)."""
    return _module("jax._src.config").config_states[name].value


def trace_context_settings() -> frozenset[str] | None:
    """The `jax.config` options in JAX's trace context; None without ``trace_context_names``."""
    config = _module("jax._src.config")
    names = getattr(config.config_ext, "trace_context_names", None)
    if names is None:
        return None
    return frozenset(set(names()) & set(config.config_states))


def _marked_declarations(source: str, path: str) -> set[str]:
    """Names of the calls in ``source`` that pass one of the two marks as a literal ``True``."""
    found = set()
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        marks = [keywords.get(m) for m in ("include_in_jit_key", "include_in_trace_context")]
        if not any(isinstance(v, ast.Constant) and v.value is True for v in marks):
            continue
        name = keywords.get("name", node.args[0] if node.args else None)
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found.add(name.value)
    return found


def put_blocks(
    shape: tuple[int, ...], dtype: Any, sharding: Any, blocks: Sequence[Any], devices: Sequence[Any]
) -> Any:
    """`jax.make_array_from_callback`'s last step, unchecked: ``blocks[i]`` on ``devices[i]``."""
    return _module("jax._src.interpreters.pxla").batched_device_put(
        _sharded_aval(shape, dtype, sharding), sharding, blocks, devices
    )


@_caches.cached(maxsize=512)
def _sharded_aval(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    core = _module("jax._src.core")
    return core.update_aval_with_sharding(core.ShapedArray(shape, dtype), sharding)


def skip_jax_exit_barrier() -> None:
    """Take JAX's exit handler (``api.clean_up``, a barrier for all) off ``atexit``, if any."""
    handler = getattr(_module("jax._src.api"), "clean_up", None)
    if handler is not None:
        atexit.unregister(handler)


def distributed_state() -> tuple[Any | None, int, int]:
    """``(client, process_id, num_processes)``, client None when not joined; starts no backend."""
    state = _module("jax._src.distributed").global_state
    if state.client is None:
        return None, 0, 1
    return state.client, int(state.process_id), int(state.num_processes)


# JAX's preemption sync manager reads this key (the time of death, RFC 3339) that its SIGTERM
# handler writes.
_PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


def tell_jax_preemption(client: Any, received: float) -> None:
    """Tell JAX's preemption sync managers of a notice, as JAX's SIGTERM handler would."""
    when = datetime.datetime.fromtimestamp(received, tz=datetime.UTC).isoformat()
    try:
        client.key_value_set(_PREEMPTION_NOTICE_KEY, when)
    except Exception as e:  # JaxRuntimeError; the key there already: another process told it
        if service_error_code(e) != _ALREADY_EXISTS:
            raise


_ALREADY_EXISTS = 6  # gRPC's status code


def service_error_code(error: BaseException) -> int | None:
    """The gRPC status code of a ``jax.distributed`` client error (``error_code``), else None."""
    code = getattr(error, "error_code", None)
    return int(code) if isinstance(code, int) else None


def cluster_params(
    local_device_ids: Sequence[int] | None, timeout_s: int
) -> tuple[str | None, int | None, int | None, Sequence[int] | None]:
    """``(address, num_processes, process_id, local_device_ids)`` JAX's detection will use."""
    return _module("jax._src.clusters").ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, local_device_ids, None, timeout_s
    )


def cluster_envs() -> list[Any]:
    """JAX's cluster detectors (Open MPI, SLURM, TPU, Kubernetes ...), in JAX's own order."""
    return list(_module("jax._src.clusters").ClusterEnv._cluster_types)


def trace_state_clean() -> bool:
    """True outside every JAX transformation (as `jax.pmap` asks)."""
    return bool(_module("jax._src.core").trace_state_clean())


def idle() -> bool:
    """Nothing traces here and no ``jax.set_mesh`` is active (per call: lookups cached)."""
    return trace_state_clean() and _module("jax.sharding").get_abstract_mesh().empty


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(constants, carries)`` among a ``scan``'s inputs (0.10: ``num_*``; 0.12: ``ft_in``)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def bound_axis_sizes() -> dict[Any, int]:
    """The named axes bound here (inside shard_map, pmap, vmap) with their sizes."""
    return dict(_module("jax._src.core").get_axis_env().axis_sizes)


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes a traced value is typed as varying over (check_vma's aval)."""
    manual = getattr(_module("jax").typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()) or ())


@dataclasses.dataclass(frozen=True)
class Compiling:
    """A computation JAX is about to compile (`on_compile`): a ``pxla.MeshComputation``."""

    computation: Any

    @property
    def name(self) -> str:
        """JAX's name for it: ``jit(step)``, ``pmap(f)``..."""
        return str(self.computation._name)

    def processes(self) -> frozenset[int]:
        """The processes whose devices run it (one: a computation of this process alone)."""
        return frozenset(int(d.process_index) for d in self.computation._device_list or ())

    def where(self) -> str | None:
        """The traced function and its definition, ``step at train.py:12``, when JAX knows it."""
        info = getattr(self.computation.compile_args.get("all_args_info"), "debug_info", None)
        return getattr(info, "func_src_info", None) or None

    def module_text(self) -> str:
        """The StableHLO module without locations: equal programs give equal text."""
        return str(self.computation._hlo.operation.get_asm(enable_debug_info=False))

    def args(self) -> list[tuple[str, str, str]]:
        """Every argument (also those the program does not use): name, type, sharding."""
        info = self.computation.compile_args.get("all_args_info")
        avals = list(getattr(info, "in_avals", None) or ())
        names = list(getattr(getattr(info, "debug_info", None), "arg_names", None) or ())
        shardings = list(self.computation.compile_args.get("in_shardings") or ())
        out = []
        for i, aval in enumerate(avals):
            name = names[i] if i < len(names) and names[i] else f"argument {i}"
            sharding = shardings[i] if i < len(shardings) else None
            out.append((str(name), str(aval), _sharding_text(sharding)))
        return out


def _sharding_text(sharding: Any) -> str:
    if sharding is None:
        return "?"
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is not None and mesh is not None and hasattr(mesh, "shape"):
        axes = ", ".join(f"{k}={v}" for k, v in dict(mesh.shape).items())
        return f"{spec} over mesh({axes})"
    return str(sharding)


def on_compile(hook: Callable[[Compiling], None]) -> Callable[[], None] | None:
    """Call ``hook`` before JAX compiles a computation (wraps ``MeshComputation.compile``).

    What ``hook`` raises reaches the caller. Returns the hook's remover (removed in the reverse
    order of installation), or None where this JAX has no such step.
    """
    cls = getattr(_module("jax._src.interpreters.pxla"), "MeshComputation", None)
    original = getattr(cls, "compile", None)
    if original is None:
        return None

    @functools.wraps(original)
    def compile(self: Any, compiler_options: Any = None, *, device_assignment: Any = None) -> Any:
        cached = getattr(self, "_executable", None) is not None
        if not (cached and compiler_options is None and device_assignment is None):
            hook(Compiling(self))
        return original(self, compiler_options, device_assignment=device_assignment)

    def remove() -> None:
        cls.compile = original  # type: ignore[union-attr]

    cls.compile = compile  # type: ignore[union-attr]
    return remove


def hide_from_jax_tracebacks(path: str) -> None:
    """Leave file ``path``'s frames out of the tracebacks JAX filters, as it does its own."""
    traceback_util = _module("jax._src.traceback_util")
    if path not in traceback_util._exclude_paths:
        traceback_util.register_exclusion(path)
