"""The preflight: at `meshkit.init`, processes agree on their software and settings.

One exchange of `Facts` (versions, platform, devices, the `jax.config` settings that reach
compiled programs); a difference raises `DivergenceError` on every process. The main file and
``XLA_FLAGS`` only warn. ``MESHKIT_PREFLIGHT=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import textwrap
import warnings

import jax

from ..coord import agree as _agree
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import DivergenceError
from ..core.version import __version__

ENV_PREFLIGHT = "MESHKIT_PREFLIGHT"
_TAG = "preflight"

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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Facts:
        return cls(**json.loads(text))

    def fields(self) -> dict[str, str]:
        """Every compared value by its name in messages (a setting under its flag's name)."""
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


def describe(mine: Facts) -> str:
    """What the preflight compares, as ``meshkit info`` shows it: versions, devices, settings."""
    settings = "  ".join(f"{name}={value}" for name, value in mine.settings.items())
    indent = {"initial_indent": "    ", "subsequent_indent": "    ", "break_on_hyphens": False}
    return (
        "compared by the processes at meshkit.init (the preflight):\n"
        f"  python {mine.python}, jax {mine.jax}, jaxlib {mine.jaxlib}, meshkit {mine.meshkit}\n"
        f"  {mine.platform}: {mine.local_devices} x {mine.device_kind} per process\n"
        f"  {len(mine.settings)} jax.config settings:\n" + textwrap.fill(settings, 100, **indent)
    )


def differences(records: dict[int, Facts]) -> list[tuple[str, dict[str, list[int]]]]:
    """The fields whose values differ, in `Facts` order: each value with its processes."""
    fields = {p: f.fields() for p, f in sorted(records.items())}
    names = dict.fromkeys(k for flat in fields.values() for k in flat)  # in order, once each
    found = [
        (name, _missing.by_value({p: flat.get(name, "(absent)") for p, flat in fields.items()}))
        for name in names
    ]
    return [(name, values) for name, values in found if len(values) > 1]


def check(me: int, n: int, timeout: float) -> None:
    """Compare this process's `Facts` with the others' (one exchange), once joined."""
    if n == 1 or not _env.flag(ENV_PREFLIGHT, where="meshkit.init()", blank=True):
        return
    mine = facts().to_json()
    outcome = _agree.check(_TAG, mine, mine, timeout=timeout, what="the preflight of meshkit.init")
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
    records = {p: Facts.from_json(r) for p, r in outcome.records.items()}
    found = differences(records)
    errors = [(name, values) for name, values in found if name not in WARN_ONLY]
    for name, values in found:
        if name in WARN_ONLY:
            warnings.warn(_warning(name, values), stacklevel=3)
    if errors:
        suspects = sorted({p for _, v in errors for p in _missing.outside_majority(v.values())})
        compared = {name for record in records.values() for name in record.settings}
        message = _message(errors, suspects, compared)
        raise DivergenceError(message, processes=suspects, field=errors[0][0])


def _warning(name: str, values: dict[str, list[int]]) -> str:
    what = "main program file" if name == "program" else "XLA_FLAGS"
    return (
        f"meshkit.init(): the processes run different {what}s ({_missing.listed(values)}"
        f"{' by SHA-256' if name == 'program' else ''}). That may be on purpose; if not, "
        "consider how each host got its copy of the program."
    )


def _message(
    errors: list[tuple[str, dict[str, list[int]]]], suspects: list[int], compared: set[str]
) -> str:
    rows = "\n".join(f"  {name}: {_missing.listed(values)}" for name, values in errors)
    named = [name for name, _ in errors if name in compared]
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
