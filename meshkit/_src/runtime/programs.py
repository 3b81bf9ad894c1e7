"""What the processes run, compared: the same software and settings, the same computations.

The preflight, at `meshkit.init`: one exchange of `Facts` (versions, platform, devices, the
`jax.config` settings that reach compiled programs); the main file and ``XLA_FLAGS`` only warn.
Then every computation compiled for devices of several processes is hashed (StableHLO without
locations) and agreed on before it first runs. A difference raises `DivergenceError` on every
process. ``MESHKIT_PREFLIGHT=0`` and ``MESHKIT_PROGRAM_CHECK=0`` turn them off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core import frames as _frames
from ..core.errors import DivergenceError
from ..core.version import __version__

ENV_PREFLIGHT = "MESHKIT_PREFLIGHT"
_PREFLIGHT_TAG = "preflight"

# Settings JAX does not mark as compiled (`compat.compiled_settings`) that still change what a
# process compiles or runs, or that every process must share, with the reason:
ALSO_COMPARED: dict[str, str] = {
    "jax_exec_time_optimization_effort": "an XLA build option (JAX 0.10; jax_optimization_level "
    "in JAX 0.12)",
    "jax_memory_fitting_effort": "an XLA build option (JAX 0.10; jax_memory_fitting_level in "
    "JAX 0.12)",
    "jax_compiler_enable_remat_pass": "turns XLA's rematerialization pass off: other programs",
    "jax_default_prng_impl": "the random bits jax.random.key(seed) gives",
    "jax_enable_custom_prng": "whether jax.random.PRNGKey gives typed keys: other programs",
    "jax_debug_nans": "a NaN found re-runs the step op by op in that process alone, whose "
    "collectives the others never join",
    "jax_debug_infs": "as jax_debug_nans, for infinities",
    "jax_refs_to_pins": "how refs are lowered (JAX 0.10)",
    "jax_use_rgv3": "how shard_map's collectives name their replica groups (JAX 0.12)",
    "jax_ragged_dot_use_ragged_dot_instruction": "how ragged_dot is lowered on TPU",
    "jax_bcoo_cusparse_lowering": "how sparse (BCOO) operations are lowered on GPU",
    "jax_use_magma": "how eig is lowered on GPU",
    "jax_experimental_unsafe_xla_runtime_errors": "checkify's checks become errors inside the "
    "compiled program",
    "jax_pallas_poison_buffers": "Pallas kernels fill their buffers first: other programs",
    "jax_pgle_aggregation_percentile": "the profile the second compilation under PGLE uses",
    "jax_share_binary_between_hosts": "with it, one process compiles and the others wait for its "
    "program in the coordination service: a process without it never hands its program over",
    "jax_cpu_collectives_implementation": "processes with different CPU collectives (gloo, mpi) "
    "cannot talk",
}
# Marked settings that differ between processes by design:
NOT_COMPARED: dict[str, str] = {
    "jax_default_device": "names a device of the process that sets it; each sets its own",
}
# Fields that may differ on purpose: a difference is a warning, not an error.
WARN_ONLY = ("program", "XLA_FLAGS")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What one process runs, as the processes compare it at `meshkit.init`."""

    python: str
    jax: str
    jaxlib: str
    meshkit: str
    platform: str
    device_kind: str
    local_devices: int
    settings: dict[str, str]
    XLA_FLAGS: str
    program: str

    def fields(self) -> dict[str, str]:
        """Every compared value by its name in messages (a setting under its flag's name).

        The record the processes exchange, as JSON.
        """
        flat = {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}
        del flat["settings"]
        return {**flat, **self.settings}


def settings() -> tuple[str, ...]:
    """The `jax.config` settings the preflight compares on the running JAX, sorted by name."""
    marked = _compat.compiled_settings() - NOT_COMPARED.keys()
    also = ALSO_COMPARED.keys() & _compat.settings_of_jax()
    return tuple(sorted(marked | also))


def _text(value: object) -> str:
    """A setting's value as text that is the same in every process that has the same value."""
    if isinstance(value, set | frozenset):  # their order of iteration follows string hashes
        return f"{type(value).__name__}([{', '.join(sorted(map(repr, value)))}])"
    kind = type(value)
    if kind.__str__ is object.__str__ and kind.__repr__ is object.__repr__:  # an address
        return f"{kind.__module__}.{kind.__qualname__}"
    return str(value)


def _program_digest() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def facts() -> Facts:
    """This process's `Facts` (it reads the local devices: call it after joining)."""
    devices = jax.local_devices()
    return Facts(
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=importlib.metadata.version("jaxlib"),
        meshkit=__version__,
        platform=jax.default_backend(),
        device_kind=devices[0].device_kind if devices else "",
        local_devices=len(devices),
        settings={name: _text(_compat.setting(name)) for name in settings()},
        XLA_FLAGS=os.environ.get("XLA_FLAGS", ""),
        program=_program_digest(),
    )


def preflight(me: int, n: int, timeout: float) -> None:
    """Compare this process's `Facts` with the others' (one exchange), once joined."""
    if n == 1 or not _env.flag(ENV_PREFLIGHT, where="meshkit.init()", blank=True):
        return
    mine = json.dumps(facts().fields(), sort_keys=True)
    outcome = _agree.check(
        _PREFLIGHT_TAG, mine, mine, timeout=timeout, what="the preflight of meshkit.init"
    )
    if outcome.agreed:
        return
    if outcome.missing:
        raise DivergenceError(
            f"meshkit.init(): {_missing.did_not(list(outcome.missing), timeout=timeout)} to "
            "compare software and settings (the preflight), though every process had joined. "
            "Consider the output of the missing processes (a crash or a stall right after "
            f"init); {ENV_PREFLIGHT}=0 turns the preflight off.",
            processes=list(outcome.missing),
            field="arrival",
        )
    records = {p: json.loads(r) for p, r in outcome.records.items()}
    found = _missing.differences({p: r.items() for p, r in records.items()})
    errors = [(name, values) for name, values in found if name not in WARN_ONLY]
    for name, values in found:
        if name in WARN_ONLY:
            what = "main program file" if name == "program" else "XLA_FLAGS"
            warnings.warn(
                f"meshkit.init(): the processes run different {what}s ({_missing.listed(values)}"
                f"{' by SHA-256' if name == 'program' else ''}). That may be on purpose; if not, "
                "consider how each host got its copy of the program.",
                stacklevel=3,
            )
    if errors:
        suspects = sorted({p for _, v in errors for p in _missing.outside_majority(v.values())})
        raise DivergenceError(_message(errors, suspects), processes=suspects, field=errors[0][0])


def _message(errors: list[tuple[str, _missing.Groups]], suspects: list[int]) -> str:
    rows = "\n".join(f"  {name}: {_missing.listed(values)}" for name, values in errors)
    own = {f.name for f in dataclasses.fields(Facts)}
    named = [name for name, _ in errors if name not in own]  # settings, by their flags' names
    advice = (
        f"consider how {_missing.processes(suspects)} set{'s' if len(suspects) == 1 else ''} "
        f"{', '.join(named)} (a jax.config.update or JAX_* environment variable on one host)"
        if named
        else f"consider the installation of {_missing.processes(suspects)} (its environment, "
        "image or devices)"
    )
    return (
        f"meshkit.init(): the processes differ in their software or settings:\n{rows}\n"
        "Every process must run the same JAX, jaxlib, meshkit and Python, on the same platform "
        "and kind of device with as many local devices, and the same jax.config settings that "
        f"reach compiled programs; {advice}. {ENV_PREFLIGHT}=0 turns this check off."
    )


ENV_PROGRAM_CHECK = "MESHKIT_PROGRAM_CHECK"
_TAG = "programs"
_WHAT = "meshkit (programs compared at compilation)"

_remove: Callable[[], None] | None = None


def install(num_processes: int) -> None:
    """Compare the processes' programs at every compilation from now on (at `meshkit.init`)."""
    global _remove
    if num_processes < 2 or not _env.flag(ENV_PROGRAM_CHECK, where="meshkit.init()", blank=True):
        return
    if _remove is None:
        _remove = _compat.on_compile(_compare)
        if _frames.filtering():
            for path in (_compat.__file__, __file__):  # the hook's frames, inside JAX's call
                _compat.hide_from_jax_tracebacks(path)
        if _remove is None:
            warnings.warn(
                f"meshkit.init(): JAX {jax.__version__} has no compilation step meshkit can "
                "hook (pxla.MeshComputation.compile), so the processes' programs are not "
                "compared when compiled; debug mode (MESHKIT_DEBUG=1) still compares meshkit's "
                "calls.",
                stacklevel=3,
            )


def installed() -> bool:
    return _remove is not None


def uninstall() -> None:
    """Stop comparing programs in this process (tests and benchmarks toggle it in every process)."""
    global _remove
    if _remove is not None:
        _remove()
        _remove = None


def _compare(compiling: _compat.Compiling) -> None:
    # This process's devices alone: nothing to pair; no order shared with the others: not compared.
    if len(compiling.processes()) < 2 or not _channel.paired():
        return
    tag = _channel.scoped(_TAG, _WHAT)
    digest = hashlib.sha256(compiling.module_text().encode()).hexdigest()[:32]
    # Shown only where the programs differ (the arguments, to say which one); never compared.
    mine: dict[str, Any] = {"name": compiling.name, "where": compiling.where(), "digest": digest}
    line = _frames.user_place(sys._getframe())
    if line is not None:
        mine["line"] = line
    else:  # no frame of the user's code: a thread of meshkit's or a library's
        mine["thread"] = threading.current_thread().name
    timeout = _env.check_timeout()
    what = f"the first compilation of {_function(mine)}"
    record = lambda: json.dumps({**mine, "args": compiling.args()})  # noqa: E731
    outcome = _agree.agree(tag, f"{compiling.name} {digest}", record, timeout=timeout, what=what)
    if outcome.agreed:
        return
    number = outcome.seq + 1
    records = {p: json.loads(r) for p, r in sorted(outcome.records.items())}
    left = sorted(p for p, r in records.items() if r.get("left"))
    late = left or list(outcome.missing or outcome.gave_up)
    if late:
        if left:
            gone = f"{_missing.processes(left)} left the program (it ended or failed) without it"
        elif outcome.missing:
            gone = _missing.did_not(late, timeout=timeout, arrive="compile a computation with it")
        else:
            gone = f"{_missing.stopped_waiting(late)} for it"
        # Blame the late ones only where they are the minority.
        came = len(compiling.processes()) - len(late)
        raise DivergenceError(
            _ALONE.format(what=_WHAT, mine=_ran(mine), number=_missing.ordinal(number), gone=gone),
            processes=late if came > len(late) else sorted(compiling.processes()),
            field="arrival",
        )
    raise _difference(records, number)


_EVERYWHERE = (
    "Consider running that computation on every process (and using or printing its result on "
    "one), or computing a value one process needs from host data with numpy "
    "(meshkit.local_from_global(x) gives this process's part of a global array as numpy)."
)
_ALONE = (
    "{what}: this process compiled {mine} as its {number} computation across processes, "
    "and {gone}.\n"
    "Every process must run the same computations on global arrays, in the same order: a "
    "computation that some processes run and others skip (under `if jax.process_index() == 0:`, "
    "or on a condition of one process's own data) waits for the others for ever.\n"
) + _EVERYWHERE


def _difference(records: dict[int, dict[str, Any]], number: int) -> DivergenceError:
    by_digest = _missing.by_value({p: r["digest"] for p, r in records.items()})
    suspects = _missing.outside_majority(by_digest.values())
    lines = "\n".join(_group_line(records, ps) for ps in by_digest.values())
    head = (
        f"{_WHAT}: the processes compiled different programs as their {_missing.ordinal(number)} "
        f"computation across processes:\n{lines}\n"
    )
    field, detail = _first_difference(records)
    return DivergenceError((head + detail).rstrip("\n"), processes=suspects, field=field)


def _group_line(records: dict[int, dict[str, Any]], ps: list[int]) -> str:
    """``  process 0: jit(step) (step at train.py:12), run at train.py:95 in <module>``."""
    ran = _missing.by_value({p: _ran(records[p]) for p in ps})
    if len(ran) == 1:
        return f"  {_missing.processes(ps)}: {next(iter(ran))}"
    function = _function(records[ps[0]])
    each = "; ".join(
        f"{_missing.processes(qs)}{text.removeprefix(function + ', run')}"
        for text, qs in ran.items()
    )
    return f"  {_missing.processes(ps)}: {function}, run by {each}"


_PARTS = ("type", "sharding")  # what `Compiling.args` gives per argument, after its name
# What differs, and the fix that fits it: the field, what to say.
_OTHER_FUNCTIONS = (
    "They are different functions: the processes ran different computations at this point "
    "(a computation that some processes run and others skip, under "
    "`if jax.process_index() == 0:` or a condition of one process's own data, meets another "
    "computation of the others).\n" + _EVERYWHERE + "\n"
)
_INSIDE = (
    "Their arguments are the same: the computations differ inside (a constant, a shape or a "
    "branch traced from a value that differs between processes, such as "
    "jax.process_index() or one process's own data).\n"
    "Consider computing such values from what every process holds alike (the step number, a "
    "setting), or passing them as arguments of the computation.\n"
)
_ARGUMENT = (
    "The first argument that differs is {name}, its {label}: {values}.\n"
    "Every process must compile the same program for the same global shapes (a size that "
    "depends on the process, such as each process padding its batch to its own longest "
    "sequence, makes a different program).\n"
    "Consider sizes fixed for every process (pad every batch to one length chosen in advance), "
    "or the same shardings on every process.\n"
)


def _first_difference(records: dict[int, dict[str, Any]]) -> tuple[str, str]:
    """The first argument whose type or sharding differs, as (field, sentences with the fix)."""
    if len({r["name"] for r in records.values()}) > 1:
        return "function", _OTHER_FUNCTIONS
    args = {p: r.get("args", []) for p, r in records.items()}
    if len({len(a) for a in args.values()}) > 1:
        counts = _missing.listed(_missing.by_value({p: str(len(a)) for p, a in args.items()}))
        return "structure", (
            f"They take different numbers of arguments: {counts}.\n"
            "Consider passing the same pytree (same keys, same number of arrays) on every "
            "process.\n"
        )
    rows = {
        p: [
            ((i, n, label), x)
            for i, (n, *xs) in enumerate(a)
            for label, x in zip(_PARTS, xs, strict=True)
        ]
        for p, a in args.items()
    }
    found = _missing.differences(rows)
    if not found:
        return "program", _INSIDE
    (_, name, label), groups = found[0]
    return name, _ARGUMENT.format(name=name, label=label, values=_missing.listed(groups))


def _function(record: dict[str, Any]) -> str:
    """``jit(step) (step at train.py:12)``; JAX's own definitions are not named (not the user's)."""
    where = record.get("where")
    if where and not _frames.library_file(str(where).rpartition(" at ")[2].rpartition(":")[0]):
        return f"{record['name']} ({where})"
    return str(record["name"])


def _ran(record: dict[str, Any]) -> str:
    """``jit(step) (step at train.py:12), run at train.py:95 in <module>``."""
    line, thread = record.get("line"), record.get("thread")
    where = f", run at {line}" if line else f", run in thread {thread}" if thread else ""
    return _function(record) + where
