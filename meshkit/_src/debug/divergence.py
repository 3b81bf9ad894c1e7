"""The divergence check: each checked call's fingerprint, agreed on across processes first.

`check` runs at the dispatch point and in `.multihost`'s collectives; `compare` turns different
fingerprints, or missing or departed processes, into a `DivergenceError` naming them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core.errors import DivergenceError
from ..lifecycle import watchdog as _watchdog
from . import fingerprint as _fingerprint
from . import state as _st
from .state import enabled as enabled  # read here by meshkit._src.spmd.placement


def check(site: _fingerprint.Site, args: tuple[Any, ...]) -> None:
    """Agree on this call's fingerprint with the other processes (debug mode on); raise if not."""
    settings = _st.state.settings
    if settings is None:
        return
    with _st.lock:
        _st.state.count += 1
        count = _st.state.count
    record = _fingerprint.fingerprint(site, args, count)
    label = f"call #{record['n']} of {site.name}"
    _st.state.last = f"{label} ({site.kind}) at {record['where']}"
    _watchdog.note_progress()
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    tag = _channel.scoped("debug", site.name)
    _st.state.channels.add(_channel.current())
    # Compared: which function, the arguments' structure and leaves; shown: all of the record.
    summary = json.dumps([record["entry"], record["structure"], record["leaves"]])
    # ``{}``: no earlier call of this thread (the missing processes made none either).
    last = _st.state.previous.get(tag) or {}
    _st.state.previous[tag] = record
    timeout = settings.timeout
    outcome = _agree.agree(
        tag, summary, lambda: json.dumps(record), timeout=timeout, what=f"{label}, debug mode"
    )
    if not outcome.agreed:
        records = {p: json.loads(v) for p, v in outcome.records.items()}
        records.setdefault(me, record)
        compare(records, list(outcome.missing), me, label, timeout, tag, count, last=last)
    _watchdog.note_progress()


def compare(
    records: dict[int, dict[str, Any]],
    missing: list[int],
    me: int,
    label: str,
    timeout: float,
    tag: str,
    count: int,
    last: dict[str, Any] | None = None,
) -> None:
    """Raise a `DivergenceError` if ``records`` (per process) differ, or some are missing or left.

    ``last``: this process's previous fingerprint under ``tag`` (default: the last one made).
    """
    mine = records[me]
    left = {p: r for p, r in records.items() if r.get("status") != "call"}
    problems = [f"process {p} {_left_text(r)}" for p, r in sorted(left.items())]
    for p in missing:
        problems.append(f"{_missing.did_not([p], timeout=timeout)} ({last_text(tag, p, last)})")
    if problems:
        here = _missing.processes(sorted(p for p in records if p not in left)).capitalize()
        raise DivergenceError(
            f"meshkit debug: {label} ({mine['entry'].split()[0]} at {mine['where']}): "
            f"{'; '.join(problems)}.\n{here} made this call (SPMD call "
            f"#{mine.get('count', count)} of the process in all).\n"
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


def _group(values: dict[int, Any]) -> list[tuple[Any, list[int]]]:
    """The distinct values and the processes of each, the smallest group first."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for p, value in sorted(values.items()):
        groups.setdefault(json.dumps(value), (value, []))[1].append(p)
    return sorted(groups.values(), key=lambda vp: (len(vp[1]), vp[1]))


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


def last_text(tag: str, process: int, last: dict[str, Any] | None = None) -> str:
    """What ``process`` last did: the previous call of ``tag`` (``last``), made by all."""
    record = last if last is not None else _st.state.previous.get(tag)
    if not record:
        return "it made no meshkit call checked in debug mode"
    ago = time.time() - float(record.get("time", time.time()))
    return (
        f"its last call was #{record['n']} of {record['entry'].partition(' ')[2]} at "
        f"{record['where']}, {ago:.1f} s ago"
    )
