"""The implementation of `meshkit.debug`: divergence checks, the stall watchdog, `barrier`."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import DivergenceError, MeshkitError
from ..core.frames import user_frame
from ..lifecycle import watchdog as _watchdog
from ..runtime import dispatch as _dispatch
from ..runtime import init as _runtime

__all__ = ["DivergenceError", "barrier", "disable", "enable", "enabled", "settings"]

ENV_DEBUG = "MESHKIT_DEBUG"
ENV_DEBUG_TIMEOUT = "MESHKIT_DEBUG_TIMEOUT"
ENV_WATCHDOG = "MESHKIT_WATCHDOG"

_MAX_DESC = 200
# A call that repeats this thread's call PERIOD calls back is verified beside the caller; any
# other waits for its verdict. Loops whose pattern repeats within PERIOD calls (1, 2, 3, 4, 6 or
# 12 calls: a step; a batch and a step; a batch, a step and a metric) wait only after a change.
PERIOD = 12
# Debug windows stay open longer than global_array_from_local's: a divergence is always first
# seen at a call that waits for its verdict (and drains its window at once), so a repeat's window
# can wait for more calls without delaying any error, and a loop of slow steps shares a window
# among more of them.
_LINGER_S = 0.2


@dataclass(frozen=True)
class Settings:
    """What debug mode is doing now.

    Attributes:
        timeout: seconds a call waits for the other processes' fingerprints.
        watchdog: seconds without progress before the stacks are dumped; None: no watchdog.
        exit_on_stall: whether a process still stalled ``timeout`` seconds after the dump exits.
    """

    timeout: float
    watchdog: float | None
    exit_on_stall: bool


class _State:
    """Debug mode's state in this process (one instance, guarded by ``_lock``)."""

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.count = 0  # SPMD entries checked in this process, all threads
        self.last = ""  # the last checked call, for messages
        self.tags: set[str] = set()
        self.previous: dict[str, dict[str, Any]] = {}  # per tag, the last call's fingerprint
        # per tag, the compared summaries of its last PERIOD calls
        self.history: dict[str, deque[str]] = {}
        self.watchdog: _watchdog.Watchdog | None = None
        self.observing = False  # _check is a `_dispatch` observer
        self.exit_hooks = False  # atexit and excepthook installed (once per process)
        self.left = False  # this process told the others it leaves


_state = _State()
_lock = threading.RLock()


# ---- switching on and off --------------------------------------------------------------------


def enable(
    *,
    timeout: float | None = None,
    watchdog: float | str | None = "auto",
    exit_on_stall: bool = True,
) -> None:
    """Turn debug mode on in this process (every process of the program must do the same).

    Args:
        timeout: seconds each call waits for the other processes' fingerprints before naming
            the missing ones (default: ``MESHKIT_DEBUG_TIMEOUT``, else ``MESHKIT_CHECK_TIMEOUT``,
            else 120). Must exceed the longest gap between two SPMD calls of any process (a
            checkpoint written by one process, a compilation), or it reports a slow process as
            missing.
        watchdog: seconds without progress before this process prints where it is and its
            Python stacks. Progress is the main thread moving (its Python stack changes) or
            running (using CPU), device work completing, or a meshkit call or batch; a stall is
            the main thread waiting in one place (a collective, ``block_until_ready``, a lock).
            ``"auto"`` (the default): ``MESHKIT_WATCHDOG`` if set, else half the timeout, so
            that the stacks are in the log before a waiting process reports a missing one; None
            or 0: no watchdog. It runs only in multi-process programs.
        exit_on_stall: after the dump, exit with status 1 if there is still no progress
            ``timeout`` seconds later, so that a hang outside meshkit's calls (a raw
            ``jax.jit`` collective, say) ends the run instead of lasting for ever. A process
            that waits longer than ``watchdog + timeout`` for another (at a collective, while
            process 0 alone writes a checkpoint) needs a longer watchdog, or
            ``exit_on_stall=False``.

    Raises:
        MeshkitError: a timeout or watchdog that is not a positive number.

    Examples:
        >>> import meshkit
        >>> meshkit.debug.enable(timeout=30, watchdog=None)
        >>> meshkit.debug.enabled()
        True
        >>> meshkit.debug.disable()
        >>> meshkit.debug.enabled()
        False
    """
    if timeout is None:
        timeout = _env.seconds(ENV_DEBUG_TIMEOUT) or _env.check_timeout()
    _positive(timeout, "timeout")
    if watchdog == "auto":
        env = _env.seconds(ENV_WATCHDOG, zero="off")
        watchdog = timeout / 2 if env is None else env
    if watchdog is not None:
        if watchdog == 0:
            watchdog = None
        else:
            _positive(watchdog, "watchdog")
    assert watchdog is None or isinstance(watchdog, int | float)
    with _lock:
        _stop_watchdog()
        _state.settings = Settings(float(timeout), watchdog, bool(exit_on_stall))
        _watchdog.note_progress()
        if not _state.observing:
            _dispatch.add_observer(_check)
            _state.observing = True
        if not _state.exit_hooks:
            _install_exit_hooks()
            _state.exit_hooks = True
        if watchdog is not None:
            _state.watchdog = _watchdog.Watchdog(
                float(watchdog), float(timeout), exit_on_stall, lambda: _state.last
            )
            _state.watchdog.start()


def disable() -> None:
    """Turn debug mode off in this process (the watchdog stops too)."""
    with _lock:
        _stop_watchdog()
        _state.settings = None
        if _state.observing:
            _dispatch.remove_observer(_check)
            _state.observing = False


def enabled() -> bool:
    """Whether debug mode is on in this process."""
    return _state.settings is not None


def settings() -> Settings | None:
    """The current `Settings`, or None when debug mode is off."""
    return _state.settings


@contextlib.contextmanager
def debugging(**kwargs: Any) -> Iterator[None]:
    """Debug mode inside a ``with`` block (arguments as for `enable`); off again after it."""
    was = _state.settings
    enable(**kwargs)
    try:
        yield
    finally:
        if was is None:
            disable()
        else:
            enable(timeout=was.timeout, watchdog=was.watchdog, exit_on_stall=was.exit_on_stall)


def enable_from_environment() -> None:
    """Turn debug mode on if ``MESHKIT_DEBUG`` asks for it.

    meshkit asks at `meshkit.init` and at this process's first SPMD call
    (`_from_environment_at_first_call`), not at import: importing meshkit starts no thread and
    reads no setting, and a bad setting is an error of that call.

    Raises:
        MeshkitError: ``MESHKIT_DEBUG`` (or the timeout or watchdog variables) holds a value
            that is not one of those accepted, named with them.
    """
    if _env.flag(ENV_DEBUG, on="debug mode on", blank=False) and not enabled():
        enable()


def _from_environment_at_init() -> None:
    """Decide debug mode from the environment when this process joins (`meshkit.init`)."""
    if not enabled():
        enable_from_environment()


def _from_environment_at_first_call(site: _dispatch.CallSite, args: tuple[Any, ...]) -> None:
    """Decide debug mode from the environment once, at the first SPMD call, and check that call.

    An observer until then (so the calls after it pay nothing): it removes itself first, and
    checks the call it sees only when it turned debug mode on (an `enable` made earlier has
    installed the check already).
    """
    _dispatch.remove_observer(_from_environment_at_first_call)
    if enabled():
        return
    enable_from_environment()
    if enabled():
        _check(site, args)


def _positive(value: Any, what: str, where: str = "meshkit.debug.enable") -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value > 0 and math.isfinite(value))
    ):
        raise MeshkitError(
            f"{where}: {what} must be a finite positive number of seconds; got {value!r}."
        )


# ---- fingerprints --------------------------------------------------------------------------


_LEAF_TEXTS: dict[tuple[Any, ...], str] = {}  # array leaves described before (a steady loop)
_MAX_LEAF_TEXTS = 4096


def _describe_leaf(x: Any, ragged: bool) -> str:
    """``float32[32,224,224,3]`` plus the sharding, or the type of a non-array leaf."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None or isinstance(x, Tracer):
        return _describe_new_leaf(x, shape, dtype, ragged)
    key = (type(x), tuple(shape), dtype, getattr(x, "sharding", None), ragged)
    text = _LEAF_TEXTS.get(key)
    if text is None:
        if len(_LEAF_TEXTS) >= _MAX_LEAF_TEXTS:
            _LEAF_TEXTS.clear()
        text = _LEAF_TEXTS[key] = _describe_new_leaf(x, shape, dtype, ragged)
    return text


def _describe_new_leaf(x: Any, shape: Any, dtype: Any, ragged: bool) -> str:
    if shape is None or dtype is None:
        if isinstance(x, bool | int | float | complex):
            return type(x).__name__
        if x is None:
            return "None"
        text = repr(x)
        return type(x).__name__ + ":" + (text if len(text) <= _MAX_DESC else text[:_MAX_DESC])
    dims = [str(int(d)) for d in shape]
    if ragged and dims:
        dims[0] = "*"
    text = f"{np.dtype(dtype).name}[{','.join(dims)}]"
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        text += f" sharded {tuple(sharding.spec)} over {dict(sharding.mesh.shape)}"
    elif isinstance(x, jax.Array) and not isinstance(x, Tracer) and sharding is not None:
        count = len(sharding.device_set)
        if count > 1:
            text += f" on {count} devices"
    return text


def _caller() -> str:
    """``file:line in function`` of the first frame outside meshkit, jax and the stdlib."""
    frame = user_frame(sys._getframe(2))
    if frame is None:
        return "?"
    name = _watchdog.short_path(frame.f_code.co_filename)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


def _fingerprint(site: _dispatch.CallSite, args: tuple[Any, ...], count: int) -> dict[str, Any]:
    ragged = bool(site.info.get("ragged"))
    flat, treedef = jax.tree_util.tree_flatten(args)
    layout = _layout_of(site, args, treedef)
    leaves = [
        [where, "static " + _static_repr(leaf) if static else _describe_leaf(leaf, ragged)]
        for (where, static), leaf in zip(layout.names, flat, strict=True)
    ]
    return {
        "status": "call",
        "count": count,  # SPMD entries checked in this process, all functions
        "entry": layout.entry,
        "n": site.calls,
        "structure": layout.structure,
        "leaves": leaves,
        "where": _caller(),
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


def _layout_of(site: _dispatch.CallSite, args: tuple[Any, ...], treedef: Any) -> _ArgLayout:
    layouts: dict[Any, _ArgLayout] = site.info.setdefault(_LAYOUTS_KEY, {})
    layout = layouts.get(treedef)
    if layout is not None:
        return layout
    static = site.info.get("static_argnums") or ()
    pairs, _ = jax.tree_util.tree_flatten_with_path(args)
    names = tuple(
        (
            _arg_name(site, path),
            bool(path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx in static),
        )
        for path, _ in pairs
    )
    origin = site.info.get("origin")
    entry = f"{site.kind} {site.name}" + (f" [{origin}]" if origin else "")
    if len(layouts) >= _MAX_LAYOUTS:
        layouts.clear()
    layout = layouts[treedef] = _ArgLayout(entry, str(treedef), names)
    return layout


def _static_repr(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= _MAX_DESC else text[:_MAX_DESC] + "..."


def _arg_name(site: _dispatch.CallSite, path: tuple[Any, ...]) -> str:
    """``batch['image']``: the parameter's name when known, then the rest of the key path."""
    names = site.info.get("params")
    if not path:
        return "the argument"
    head, rest = path[0], path[1:]
    if isinstance(head, jax.tree_util.SequenceKey):
        idx = head.idx
        base = names[idx] if names and idx < len(names) else f"argument {idx}"
    else:
        base = jax.tree_util.keystr((head,))
    return base + jax.tree_util.keystr(tuple(rest))


# ---- the check ------------------------------------------------------------------------------


def _tag(what: str = "meshkit debug mode") -> str:
    return _channel.scoped("debug", what)


def _check(site: _dispatch.CallSite, args: tuple[Any, ...]) -> None:
    settings = _state.settings
    if settings is None:
        return
    with _lock:
        _state.count += 1
        count = _state.count
    record = _fingerprint(site, args, count)
    label = f"call #{record['n']} of {site.name}"
    _state.last = f"{label} ({site.kind}) at {record['where']}"
    _watchdog.note_progress()
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    tag = _tag(site.name)
    _state.tags.add(tag)
    # Compared: which function, the arguments' structure and leaves; shown: all of the record.
    summary = json.dumps([record["entry"], record["structure"], record["leaves"]])
    before = _state.previous.get(tag)
    _state.previous[tag] = record
    history = _state.history.setdefault(tag, deque(maxlen=PERIOD))
    changed = len(history) < PERIOD or history[0] != summary
    history.append(summary)
    timeout = settings.timeout

    def on_outcome(outcome: _agree.Outcome) -> None:
        records = {p: json.loads(v) for p, v in outcome.records.items()}
        if me not in records:
            records[me] = record
        # ``{}``: no earlier call of this thread (the missing processes made none either).
        last = before if before is not None else {}
        _compare(records, list(outcome.missing), me, label, timeout, tag, count, last=last)

    _agree.agree_later(tag, summary, lambda: json.dumps(record), timeout=timeout,
                       on_outcome=on_outcome, linger=_LINGER_S)  # fmt: skip
    if changed:
        # The first call at which processes diverge is a change for at least one of them (had
        # every process repeated its call PERIOD calls back, they would agree again): such a
        # call waits for its verdict, and a divergent one is raised here, before it runs.
        _agree.drain(timeout + 35.0, tags=[tag])
        _agree.settle()
    _watchdog.note_progress()


def _compare(
    records: dict[int, dict[str, Any]],
    missing: list[int],
    me: int,
    label: str,
    timeout: float,
    tag: str,
    count: int,
    last: dict[str, Any] | None = None,
) -> None:
    """Raise a `DivergenceError` if ``records`` (every process's fingerprint) differ.

    ``last``: this process's previous fingerprint under ``tag`` (default: the last one made),
    which the processes that did not arrive made too.
    """
    mine = records[me]
    left = {p: r for p, r in records.items() if r.get("status") != "call"}
    problems: list[str] = []
    if left:
        for p, r in sorted(left.items()):
            problems.append(f"process {p} {_left_text(r)}")
    if missing:
        lines = [
            f"process {p} did not arrive within {timeout:g} s ({_last_text(tag, p, last)})"
            for p in missing
        ]
        problems.extend(lines)
    if problems:
        here = sorted(p for p in records if p not in left)
        raise DivergenceError(
            f"meshkit debug: {label} ({mine['entry'].split()[0]} at {mine['where']}): "
            + "; ".join(problems)
            + f".\n{_procs(here).capitalize()} made this call (SPMD call #"
            + str(mine.get("count", count))
            + " of the process in all).\n"
            "Every process must make the same meshkit calls in the same order; consider the "
            "missing processes' output (a crash, an early exit, a different branch or a stall).",
            processes=sorted(set(missing) | set(left)),
            field="arrival",
        )
    for field, what in (
        ("entry", "called"),
        ("structure", "passed arguments structured as"),
        ("leaves", None),
    ):
        groups = _group(records, field)
        if len(groups) == 1:
            continue
        if field == "leaves":
            _leaf_divergence(records, label, mine)
        raise DivergenceError(
            f"meshkit debug: SPMD call #{mine['count']} of the program: "
            + "; ".join(f"{_procs(ps)} {what} {_show_value(field, value)}" for value, ps in groups)
            + ".\nEvery process must make the same meshkit calls in the same order; consider "
            "what decides which function each process calls (rank-dependent branches, "
            "iteration over sets or dicts with per-process order, an early exit).\n"
            + _where_lines(records),
            processes=_outside_majority([ps for _, ps in groups]),
            field=field,
        )


def _leaf_divergence(calls: dict[int, dict[str, Any]], label: str, mine: dict[str, Any]) -> None:
    n_leaves = len(mine["leaves"])
    for i in range(n_leaves):
        values: dict[str, list[int]] = {}
        for p, r in sorted(calls.items()):
            leaf = r["leaves"][i] if i < len(r["leaves"]) else ["?", "(absent)"]
            values.setdefault(leaf[1], []).append(p)
        if len(values) == 1:
            continue
        groups = sorted(values.items(), key=lambda kv: (len(kv[1]), kv[1]))
        where = mine["leaves"][i][0]
        first, rest = groups[0], groups[1:]
        text = f"{_procs(first[1])} passed {where} {first[0]}; " + "; ".join(
            f"{_procs(ps)} passed {value}" for value, ps in rest
        )
        suspects = (
            f"{_procs(first[1])}"
            if len(first[1]) < len(rest[0][1])
            else "the processes (no majority says which is wrong)"
        )
        if first[0].startswith("static") or rest[0][0].startswith("static"):
            rule = (
                "Static arguments (and make_mesh's axes) must be equal in every process; "
                f"consider what sets them in {suspects} (a per-process setting, an "
                "environment variable)."
            )
        else:
            rule = (
                "Every process must pass arguments of the same shapes, dtypes and shardings to "
                f"an SPMD call; consider the data pipeline of {suspects} (a short last batch, "
                "a per-process setting)."
            )
        raise DivergenceError(
            f"meshkit debug: {label}: {text}.\n{rule}\n" + _where_lines(calls),
            processes=_outside_majority([ps for _, ps in groups]),
            field=where,
        )


def _outside_majority(groups: list[list[int]]) -> list[int]:
    """The processes not in the one largest group; all of them when no group is largest."""
    size = max(len(ps) for ps in groups)
    largest = [ps for ps in groups if len(ps) == size]
    rest = [p for ps in groups for p in ps if len(largest) > 1 or ps is not largest[0]]
    return sorted(rest)


def _group(calls: dict[int, dict[str, Any]], field: str) -> list[tuple[Any, list[int]]]:
    values: dict[str, tuple[Any, list[int]]] = {}
    for p, r in sorted(calls.items()):
        value = r.get(field)
        key = json.dumps(value)
        values.setdefault(key, (value, []))[1].append(p)
    return sorted(values.values(), key=lambda vp: (len(vp[1]), vp[1]))


def _show_value(field: str, value: Any) -> str:
    if field == "entry":
        kind, _, name = str(value).partition(" ")
        name, _, origin = name.partition(" [")
        return f"{name} ({kind}{', made at ' + origin.rstrip(']') if origin else ''})"
    return str(value)


def _where_lines(calls: dict[int, dict[str, Any]]) -> str:
    return "\n".join(
        f"  process {p}: call #{r['n']} of {r['entry'].partition(' ')[2]} at {r['where']}"
        for p, r in sorted(calls.items())
    )


def _procs(ps: list[int]) -> str:
    return f"process{'es' if len(ps) > 1 else ''} {_ids(ps)}"


def _ids(ps: list[int]) -> str:
    return ",".join(map(str, ps))


def _left_text(record: dict[str, Any]) -> str:
    status = record.get("status")
    last = record.get("last") or "no meshkit call"
    if status == "exit":
        return f"ended its program (normal exit) after {last}"
    if status == "error":
        return f"failed after {last}: {record.get('message', '?')}"
    return f"left ({status}) after {last}"


def _last_text(tag: str, process: int, last: dict[str, Any] | None = None) -> str:
    """What ``process`` last did: the previous call of ``tag`` (``last``), made by all."""
    record = last if last is not None else _state.previous.get(tag)
    if not record:
        return "it made no meshkit call checked in debug mode"
    ago = time.time() - float(record.get("time", time.time()))
    return (
        f"its last call was #{record['n']} of {record['entry'].partition(' ')[2]} at "
        f"{record['where']}, {ago:.1f} s ago"
    )


_LEAVE_WAIT_S = 5.0  # at exit, the most a process waits to post that it leaves


def _publish_leaving(status: str, message: str = "") -> None:
    """Tell the other processes, at this process's next check, that it will not come."""
    client, _, n = _compat.distributed_state()
    if client is None or n == 1 or _state.settings is None or _state.left:
        return
    _state.left = True  # an uncaught error is told once, not again by the exit that follows
    record = {"status": status, "last": _state.last or "no meshkit call", "message": message}
    wait = min(_state.settings.timeout, _LEAVE_WAIT_S)
    for tag in sorted(_state.tags | {"debug"}):
        with contextlib.suppress(Exception):  # leaving anyway: a store that is gone is no news
            _agree.leave(tag, json.dumps(record), later=True, wait=wait)


def _install_exit_hooks() -> None:
    atexit.register(lambda: _publish_leaving("exit"))
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if _state.settings is not None and not isinstance(value, DivergenceError):
            text = f"{kind.__name__}: {value}".splitlines()[0][:_MAX_DESC]
            _publish_leaving("error", text)
        previous(kind, value, tb)

    sys.excepthook = hook


# ---- barrier ----------------------------------------------------------------------------------


def barrier(name: str, *, timeout: float | None = None) -> None:
    """Wait until every process reaches the barrier ``name``, or fail naming those that did not.

    Works through the coordination service's key-value store (no device collective), so a
    barrier never hangs: after ``timeout`` seconds every process that arrived raises. A barrier
    name may be used any number of times; the n-th use in one process meets the n-th use in the
    others. With one process it returns at once.

    Args:
        name: the meeting point (the same string in every process).
        timeout: seconds to wait (default ``MESHKIT_CHECK_TIMEOUT``, else 120).

    Raises:
        MeshkitError: some processes did not arrive in time (they are named, with their last
            meshkit call when debug mode is on), or a bad name or timeout.

    Examples:
        >>> import meshkit
        >>> meshkit.barrier("checkpoint-written", timeout=60)  # one process: returns at once
    """
    if not isinstance(name, str) or not name:
        raise MeshkitError(f"meshkit.barrier: name must be a non-empty string; got {name!r}.")
    if timeout is None:
        timeout = _env.check_timeout()
    _positive(timeout, "timeout", f"meshkit.barrier({name!r})")
    client, me, n = _compat.distributed_state()
    if client is None or n == 1:
        return
    outcome = _agree.check(
        "barrier/" + _agree.tag_part(name),
        "",
        json.dumps({"waited": float(timeout)}),
        timeout=float(timeout),
    )
    use = outcome.seq + 1
    if _state.settings is not None:
        _watchdog.note_progress()
    if outcome.agreed:
        return
    if outcome.gave_up and not outcome.missing:
        # Arrived last, but after another process stopped waiting: fail with it.
        waited = json.loads(outcome.records[outcome.gave_up[0]])["waited"]
        raise MeshkitError(
            f"meshkit.barrier({name!r}): this process (process {me}) arrived after "
            f"process{'es' if len(outcome.gave_up) > 1 else ''} {_ids(list(outcome.gave_up))} "
            f"stopped waiting (after {waited:g} s) at use #{use} of this barrier.\n"
            "Consider a longer timeout, or what delayed this process."
        )
    missing = list(outcome.missing)
    tag = "debug" if _channel.current() is None else _channel.scoped("debug", "")
    detail = "; ".join(
        f"process {p} ({_last_text(tag, p) if _state.settings else 'no debug record'})"
        for p in missing
    )
    raise MeshkitError(
        f"meshkit.barrier({name!r}): process{'es' if len(missing) > 1 else ''} "
        f"{_ids(missing)} did not arrive within {timeout:g} s (use #{use} of this barrier); "
        f"this process (process {me}) did.\nMissing: {detail}.\n"
        "Consider those processes' output (a crash, a stall, a different branch); "
        f"MESHKIT_DEBUG=1 names their last meshkit call."
    )


# ---- the stall watchdog -------------------------------------------------------------------------


def _stop_watchdog() -> None:
    if _state.watchdog is not None:
        _state.watchdog.stop.set()
        _state.watchdog = None


# MESHKIT_DEBUG=1 is read at init or at the first SPMD call; registering starts nothing.
_dispatch.add_observer(_from_environment_at_first_call)
_runtime.on_join(_from_environment_at_init)
