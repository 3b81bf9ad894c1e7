"""The divergence check: each checked call's fingerprint, agreed on across processes first.

A fingerprint holds the function, the call's number, the arguments' structure and per leaf its
name, shape, dtype and sharding (or a static value); `compare` names who differs. Debug mode's
state in this process (`state`, guarded by `lock`) is here too: its settings and what the checks
remember.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ..coord import agree as _agree
from ..coord import agreement as _agreement
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import caches as _caches
from ..core import canonical as _canonical
from ..core import compat as _compat
from ..core.errors import DivergenceError, shorten
from ..core.frames import user_place
from ..lifecycle import progress as _progress

# Agreements that repeat a pattern for PERIOD calls in a row take one round trip (`predict`).
PERIOD = _agreement.SPAN
MAX_DESC = 200  # characters of a value's repr in a fingerprint or a message


@dataclass(frozen=True)
class Settings:
    """What debug mode is doing now.

    Attributes:
        timeout: seconds a call waits for the other processes' fingerprints.
        watchdog: seconds without progress before a stall is reported; None: as
            ``MESHKIT_STALL_TIMEOUT`` sets it.
        exit_on_stall: whether a run still stalled ``timeout`` seconds after the report ends.
    """

    timeout: float
    watchdog: float | None
    exit_on_stall: bool


class State:
    """Debug mode's state in this process (one instance, guarded by `lock`)."""

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.count = 0  # SPMD entries checked in this process, all threads
        self.last = ""  # the last checked call, for messages and this process's leave record
        self.previous: dict[str, dict[str, Any]] = {}  # per tag, the last call's fingerprint
        self.sites: dict[str, Any] = {}  # `.multihost`'s functions checked since `enable`
        self.announced: Settings | None = None  # the settings last announced


state = State()
lock = threading.RLock()


def enabled() -> bool:
    """Whether debug mode is on in this process."""
    return state.settings is not None


@dataclass(eq=False)
class CallSite:
    """One SPMD entry point a program created (a `meshkit.spmd` function, a multihost_utils one)."""

    kind: str
    name: str
    calls: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return (
            self.name if self.name.startswith("meshkit.") else f"meshkit.{self.kind}({self.name})"
        )


latest: CallSite | None = None  # the computation this process ran last (a stall names its count)


def latest_call() -> str:
    """``its 6th call of meshkit.spmd(step)``: the latest computation's count ("" before any)."""
    site = latest
    return "" if site is None else f"its {_missing.ordinal(site.calls)} call of {site}"


def _describe_leaf(x: Any, ragged: bool) -> str:
    """``float32[32,224,224,3]`` plus the sharding, or the type of a non-array leaf."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        if x is None or isinstance(x, bool | int | float | complex):
            return "None" if x is None else type(x).__name__
        return shorten(_canonical.value(x), MAX_DESC)
    traced = isinstance(x, Tracer)  # its sharding may not hash: described afresh
    describe = _array_text.__wrapped__ if traced else _array_text
    sharding = getattr(x, "sharding", None)
    return describe(isinstance(x, jax.Array) and not traced, tuple(shape), dtype, sharding, ragged)


@_caches.cached(maxsize=4096)  # a steady loop describes the same leaves every call
def _array_text(
    concrete: bool, shape: tuple[int, ...], dtype: Any, sharding: Any, ragged: bool
) -> str:
    dims = [str(int(d)) for d in shape]
    if ragged and dims:
        dims[0] = "*"
    text = f"{np.dtype(dtype).name}[{','.join(dims)}]"
    if isinstance(sharding, jax.sharding.NamedSharding):
        text += f" sharded {tuple(sharding.spec)} over {dict(sharding.mesh.shape)}"
    elif concrete and sharding is not None:
        count = len(sharding.device_set)
        text += f" on {count} devices" if count > 1 else ""
    return text


def fingerprint(site: CallSite, args: tuple[Any, ...], count: int) -> dict[str, Any]:
    ragged = bool(site.info.get("ragged"))
    flat, treedef = jax.tree_util.tree_flatten(args)
    layout = _layout_of(site, args, treedef)
    leaves = [  # each leaf as sent to the other processes: its name in messages, what it is
        {
            "name": where,
            "text": "static " + shorten(_canonical.value(x), MAX_DESC)
            if static
            else _describe_leaf(x, ragged),
        }
        for (where, static), x in zip(layout.names, flat, strict=True)
    ]
    return {
        "status": "call",
        "count": count,  # SPMD entries checked in this process, all functions
        "entry": layout.entry,
        "n": site.calls,
        "structure": layout.structure,
        "leaves": leaves,
        # ``file:line in function`` of the user's code, as the program comparison names it.
        "where": user_place(sys._getframe(1)) or "?",
        "time": time.time(),
    }


@dataclass(frozen=True)
class _ArgLayout:
    """What a call site's fingerprint takes from its arguments' structure (cached per treedef)."""

    entry: str  # the function's name and where it was made: lambdas of one name differ
    structure: str
    names: tuple[tuple[str, bool], ...]  # per leaf: its name in messages, whether static


_LAYOUTS_KEY = "debug layouts"  # in CallSite.info: treedef -> _ArgLayout
_MAX_LAYOUTS = 64  # per call site


def _layout_of(site: CallSite, args: tuple[Any, ...], treedef: Any) -> _ArgLayout:
    layouts: _caches.Cache[Any, _ArgLayout] | None = site.info.get(_LAYOUTS_KEY)
    if layouts is None:  # the site's first call in debug mode
        layouts = site.info[_LAYOUTS_KEY] = _caches.Cache(maxsize=_MAX_LAYOUTS)
    layout = layouts.get(treedef)
    if layout is not None:
        return layout
    static = site.info.get("static_argnums") or ()
    params = site.info.get("params") or ()
    names = []  # ``batch['image']``: the parameter's name when known, then the rest of the path
    for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]:
        idx = path[0].idx if path and isinstance(path[0], jax.tree_util.SequenceKey) else None
        if idx is None:
            names.append((jax.tree_util.keystr(path) if path else "the argument", False))
        else:
            base = str(params[idx]) if idx < len(params) else f"argument {idx}"
            names.append((base + jax.tree_util.keystr(path[1:]), idx in static))
    origin = site.info.get("origin")
    entry = f"{site.kind} {site.name}" + (f" [{origin}]" if origin else "")
    layout = _ArgLayout(entry, _canonical.structure(treedef), tuple(names))
    layouts.put(treedef, layout)
    return layout


def check(site: CallSite, args: tuple[Any, ...]) -> None:
    """Agree on this call's fingerprint with the other processes (debug mode on); raise if not."""
    settings = state.settings
    if settings is None:
        return
    with lock:
        state.count += 1
        count = state.count
    record = fingerprint(site, args, count)
    label = f"call #{record['n']} of {site.name}"
    state.last = _agree.leaving["last"] = f"{label} ({site.kind}) at {record['where']}"
    _progress.note_progress()
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    tag = _channel.scoped("debug", site.name)
    # Compared: which function, the arguments' structure and leaves; shown: all of the record.
    summary = json.dumps([record["entry"], record["structure"], record["leaves"]])
    # ``{}``: no earlier call of this thread (the missing processes made none either).
    last = state.previous.get(tag) or {}
    state.previous[tag] = record
    timeout = settings.timeout
    outcome = _agree.agree(
        tag, summary, lambda: json.dumps(record), timeout=timeout, what=f"{label}, debug mode"
    )
    if not outcome.agreed:
        records = {p: json.loads(v) for p, v in outcome.records.items()}  # this process's too
        compare(records, list(outcome.missing), me, label, timeout, last)
    _progress.note_progress()


def compare(
    records: dict[int, dict[str, Any]],
    missing: list[int],
    me: int,
    label: str,
    timeout: float,
    last: dict[str, Any],
) -> None:
    """Raise a `DivergenceError` if ``records`` differ, or some are missing or left."""
    mine = records[me]
    left = {p: r for p, r in records.items() if r.get("status") != "call"}
    problems = [f"process {p} {_left_text(r)}" for p, r in sorted(left.items())]
    for p in missing:
        problems.append(f"{_missing.did_not([p], timeout=timeout)} ({last_text(last)})")
    if problems:
        here = _missing.processes(sorted(p for p in records if p not in left)).capitalize()
        raise DivergenceError(
            f"meshkit debug: {label} ({mine['entry'].split()[0]} at {mine['where']}): "
            f"{'; '.join(problems)}.\n{here} made this call (SPMD call "
            f"#{mine['count']} of the process in all).\n"
            "Every process must make the same meshkit calls in the same order; consider the "
            "missing processes' output (a crash, an early exit, a different branch or a stall).",
            processes=sorted(set(missing) | set(left)),
            field="arrival",
        )
    for field, what in (("entry", "called"), ("structure", "passed arguments structured as")):
        groups = _group({p: r[field] for p, r in records.items()})
        if len(groups) > 1:
            said = (f"{_missing.processes(ps)} {what} {_shown(field, v)}" for v, ps in groups)
            raise DivergenceError(
                f"meshkit debug: SPMD call #{mine['count']} of the program: "
                + "; ".join(said)
                + ".\nEvery process must make the same meshkit calls in the same order; consider "
                "what decides which function each process calls (rank-dependent branches, "
                "iteration over sets or dicts with per-process order, an early exit).\n"
                + _where_lines(records),
                processes=_missing.outside_majority(ps for _, ps in groups),
                field=field,
            )  # fmt: skip
    for i, leaf in enumerate(mine["leaves"]):  # one structure: as many leaves everywhere
        groups = _group({p: r["leaves"][i]["text"] for p, r in records.items()})
        if len(groups) == 1:
            continue
        (first, few), (second, more) = groups[0], groups[1]
        text = f"{_missing.processes(few)} passed {leaf['name']} {first}; " + "; ".join(
            f"{_missing.processes(ps)} passed {value}" for value, ps in groups[1:]
        )
        suspects = (
            _missing.processes(few)
            if len(few) < len(more)
            else "the processes (no majority says which is wrong)"
        )
        rule = (
            "Static arguments (and make_mesh's axes) must be equal in every process; consider "
            f"what sets them in {suspects} (a per-process setting, an environment variable)."
            if first.startswith("static") or second.startswith("static")
            else "Every process must pass arguments of the same shapes, dtypes and shardings to "
            f"an SPMD call; consider the data pipeline of {suspects} (a short last batch, a "
            "per-process setting)."
        )
        raise DivergenceError(
            f"meshkit debug: {label}: {text}.\n{rule}\n" + _where_lines(records),
            processes=_missing.outside_majority(ps for _, ps in groups),
            field=leaf["name"],
        )


def _group(values: dict[int, str]) -> list[tuple[str, list[int]]]:
    """The distinct values and the processes of each, the smallest group first."""
    return sorted(_missing.by_value(values).items(), key=lambda vp: (len(vp[1]), vp[1]))


def _shown(field: str, value: Any) -> str:
    if field != "entry":
        return str(value)
    kind, _, name = str(value).partition(" ")
    name, _, origin = name.partition(" [")
    return f"{name} ({kind}{', made at ' + origin.rstrip(']') if origin else ''})"


def _where_lines(calls: dict[int, dict[str, Any]]) -> str:
    return "\n".join(
        f"  process {p}: call #{r['n']} of {r['entry'].partition(' ')[2]} at {r['where']}"
        for p, r in sorted(calls.items())
    )


def _left_text(record: dict[str, Any]) -> str:
    status, last = record.get("status"), record.get("last") or "no meshkit call"
    if status == "exit":
        return f"ended its program (normal exit) after {last}"
    if status == "error":
        return f"failed after {last}: {record.get('message', '?')}"
    return f"left ({status}) after {last}"


def last_text(record: dict[str, Any] | None) -> str:
    """What a missing process last did: ``record``, the previous call that all processes made."""
    if not record:
        return "it made no meshkit call checked in debug mode"
    ago = time.time() - float(record.get("time", time.time()))
    return (
        f"its last call was #{record['n']} of {record['entry'].partition(' ')[2]} at "
        f"{record['where']}, {ago:.1f} s ago"
    )
