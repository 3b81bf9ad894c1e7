"""Cost of meshkit's cross-process checks in N processes (run by coordination.bench_coordination).

Usage: ``meshkit launch -n N -d 1 --timeout 600 coordination_worker.py BENCHMARKS_DIR [--probe]``.
Process 0 prints one ``BENCH {json}`` line.

Series, each in rounds of ``CALLS`` calls (``GLOBAL_CALLS`` for ``global``) with a
`meshkit.barrier` before every round (outside the timed span); the variants of a series take
turns round by round (A B, B A, ...), so that the machine's noise falls on both alike, and an
overhead is the median over rounds of the difference between the paired rounds. Every call is
waited with `jax.block_until_ready`.

* ``global``: ``meshkit.global_array_from_local`` of a 4 KiB float32 batch per process, with
  ``check=True`` and ``check=False``;
* ``debug``: a small ``meshkit.spmd`` step on an already global array, debug mode on
  (``meshkit.debug.enable(timeout=60, watchdog=None)``) and off;
* ``global_paced``, ``debug_paced``: the same two, each call followed by a ``PACE_S`` wait (a
  step whose device work leaves the CPU idle), ``PACED_CALLS`` calls per round;
* ``mesh``: ``meshkit.make_mesh({"data": -1})`` and ``jax.make_mesh``;
* ``barrier``: ``meshkit.barrier`` alone.
* ``progress``: the always-on progress records during a `meshkit.global_batches` loop of
  ``PACE_S`` steps for ``PROGRESS_S`` seconds, with step windows of ``PROGRESS_WINDOW_S``
  (shorter than the default 30 s, to see several): the coordination requests each process
  made for its step windows and its stall records (counted on the boards they use), and process
  0's time per window (its own row posted, every row read, the straggler rule).

Per variant and process: seconds per call (process 0's clock), CPU seconds per call of the
whole process (``resource.getrusage``, every thread), and coordination-service round trips per
call and per agreement from ``meshkit._src.coord.agree.stats`` (None where meshkit has no such
counter). Deferred checks (verified by ``meshkit._src.coord.agree.drain``, where it exists) are
drained at the end of each round, outside the timed span but inside the CPU and round-trip
counts; the drain time is reported apart, and ``verified`` times each round to the end of its
drain. Every process's counts are gathered through the coordination service.

``--probe`` (given to the smallest run) also times the coordination service itself: per-RPC
latency seen by process 0 (which hosts the service) and by process 1 (another process), and the
service's CPU per RPC: process 0's CPU while only process 1 sends RPCs, less its CPU in an idle
window as long.
"""

import importlib
import inspect
import json
import os
import queue
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, sys.argv[1])
from _timing import bench_rounds, keep_freed_memory

MALLOC = keep_freed_memory()  # before JAX starts its threads

import meshkit  # noqa: E402

meshkit.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

PROBE = "--probe" in sys.argv[2:]
CALLS = 128  # calls per round of a series whose checks wait (debug, make_mesh, barrier)
# global_array_from_local's checks are agreed on windows of calls (up to window.WINDOW, open up
# to window.LINGER_S): a round of twice a window closes windows inside the timed span instead of
# leaving them to the untimed drain between rounds.
GLOBAL_CALLS = 1024
# The paced series: each call followed by a PACE_S wait, as a training step whose device work
# leaves the host's CPU idle. With every process mostly idle, 16 processes no longer queue for
# this machine's 2 cores, and an overhead measures the check's own latency.
PACE_S = 0.01
PACED_CALLS = 48
ROUNDS = bench_rounds(9)  # paired rounds per series
PROBE_RPCS = 500
LOAD_BEFORE = os.getloadavg()  # other work on the machine skews every figure

client, ME, N = meshkit._src.core.compat.distributed_state()
try:
    _agree: Any = importlib.import_module("meshkit._src.coord.agree")
except ImportError:
    _agree = None
STATS = getattr(_agree, "stats", None)
DRAIN: Callable[[], object] | None = getattr(_agree, "drain", None)


def counters() -> tuple[int, int]:
    if STATS is None:
        return 0, 0
    return int(STATS.rpcs), int(STATS.agreements)


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def series(
    name: str,
    fns: dict[str, Callable[[], Any]],
    *,
    setup: dict[str, tuple[Callable[[], object], Callable[[], object]]] | None = None,
    calls: int = CALLS,
    pace: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """Rounds of ``calls`` calls of each variant, taking turns; what each costs per call."""
    setup = setup or {}
    keys = list(fns)
    totals = {
        k: {"seconds": [], "verified": [], "cpu": 0.0, "rpcs": 0, "agreements": 0, "drain": 0.0}
        for k in keys
    }

    def one_round(key: str, timed: bool) -> None:
        enter, leave = setup.get(key, (lambda: None, lambda: None))
        fn = fns[key]
        meshkit.barrier(f"bench-{name}")  # processes start the round together
        enter()
        rpcs0, agreements0 = counters()
        cpu0 = cpu_seconds()
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn())
            if pace:
                time.sleep(pace)
        end = time.perf_counter()
        if DRAIN is not None:
            DRAIN()
        drained = time.perf_counter()
        cpu1 = cpu_seconds()
        rpcs1, agreements1 = counters()
        leave()
        if timed:
            t = totals[key]
            t["seconds"].append((end - start) / calls)
            t["verified"].append((drained - start) / calls)
            t["cpu"] += cpu1 - cpu0
            t["rpcs"] += rpcs1 - rpcs0
            t["agreements"] += agreements1 - agreements0
            t["drain"] += drained - end

    for key in keys:  # warm-up: compilation, caches, first (changed) agreements
        one_round(key, timed=False)
    for r in range(ROUNDS):
        for key in keys if r % 2 == 0 else keys[::-1]:
            one_round(key, timed=True)
    made = ROUNDS * calls
    out = {}
    for key in keys:
        t = totals[key]
        out[key] = {
            "seconds": statistics.median(t["seconds"]),
            "rounds": t["seconds"],
            "verified": statistics.median(t["verified"]),
            "cpu": t["cpu"] / made,
            "rpcs": t["rpcs"] / made if STATS is not None else None,
            "agreements": t["agreements"] / made if STATS is not None else None,
            "drain": t["drain"] / made,
            "calls": made,
        }
    if len(keys) == 2:
        a, b = keys  # overhead of the first over the second, round by round
        diffs = [x - y for x, y in zip(totals[a]["seconds"], totals[b]["seconds"], strict=True)]
        verified = [
            x - y for x, y in zip(totals[a]["verified"], totals[b]["verified"], strict=True)
        ]
        out["overhead"] = {
            "seconds": statistics.median(diffs),
            "rounds": diffs,
            "verified": statistics.median(verified),
            "verified_rounds": verified,
        }
    return out


def probe() -> dict[str, float]:
    """Per-RPC latency and the coordination service's CPU per RPC (processes 0 and 1)."""
    prefix = f"meshkit-bench/probe/{time.time_ns()}"
    meshkit.barrier("bench-probe-key")
    if ME == 0:
        client.key_value_set("meshkit-bench/probe-prefix", prefix)
    prefix = client.blocking_key_value_get("meshkit-bench/probe-prefix", 60_000)
    result: dict[str, float] = {}

    def per_call(fn: Callable[[int], object], count: int = 200) -> float:
        for i in range(10):
            fn(-1 - i)
        start = time.perf_counter()
        for i in range(count):
            fn(i)
        return (time.perf_counter() - start) / count

    meshkit.barrier("bench-probe")
    if ME == 0:  # process 0 hosts the service: its RPCs still go through gRPC on loopback
        result["set_p0"] = per_call(lambda i: client.key_value_set(f"{prefix}/set/{i}", "x"))
        result["increment_p0"] = per_call(
            lambda i: client.key_value_increment(f"{prefix}/count", 1)
        )
        result["get_p0"] = per_call(
            lambda i: client.blocking_key_value_get(f"{prefix}/set/0", 60_000)
        )
    meshkit.barrier("bench-probe")
    # The service's CPU per RPC: process 0 waits (one pending get) while process 1 sends
    # PROBE_RPCS sets; then an idle window as long, for process 0's background CPU.
    if ME == 0:
        cpu0, start = cpu_seconds(), time.perf_counter()
        client.blocking_key_value_get(f"{prefix}/busy-done", 120_000)
        busy_cpu, busy_wall = cpu_seconds() - cpu0, time.perf_counter() - start
        client.key_value_set(f"{prefix}/idle-length", repr(busy_wall))
        cpu0 = cpu_seconds()
        client.blocking_key_value_get(f"{prefix}/idle-done", 120_000)
        idle_cpu = cpu_seconds() - cpu0
        result["server_cpu_per_rpc"] = (busy_cpu - idle_cpu) / PROBE_RPCS
        result["set_p1"] = float(client.blocking_key_value_get(f"{prefix}/set-p1", 60_000))
    elif ME == 1:
        time.sleep(0.2)  # process 0 is waiting
        start = time.perf_counter()
        for i in range(PROBE_RPCS):
            client.key_value_set(f"{prefix}/p1/{i}", "x")
        elapsed = time.perf_counter() - start
        client.key_value_set(f"{prefix}/busy-done", "1")
        idle = float(client.blocking_key_value_get(f"{prefix}/idle-length", 60_000))
        time.sleep(idle)
        client.key_value_set(f"{prefix}/idle-done", "1")
        client.key_value_set(f"{prefix}/set-p1", repr(elapsed / PROBE_RPCS))
    meshkit.barrier("bench-probe")
    if ME == 0:
        client.key_value_delete(prefix + "/")
    return result


local = np.ones((1024,), np.float32).reshape(8, 128)  # 4 KiB per process
mesh = meshkit.make_mesh({"data": -1})
results: dict[str, Any] = {}

results["global"] = series(
    "global",
    {
        "check": lambda: meshkit.global_array_from_local(local, mesh, "data"),
        "nocheck": lambda: meshkit.global_array_from_local(local, mesh, "data", check=False),
    },
    calls=GLOBAL_CALLS,
)

step = meshkit.spmd(lambda x: x * 2, mesh=mesh, in_specs="data", out_specs="data")
x = meshkit.global_array_from_local(local, mesh, "data", check=False)
results["debug"] = series(
    "debug",
    {"on": lambda: step(x), "off": lambda: step(x)},
    setup={"on": (lambda: meshkit.debug.enable(timeout=60, watchdog=None), meshkit.debug.disable)},
)


global_fns = {
    "check": lambda: meshkit.global_array_from_local(local, mesh, "data"),
    "nocheck": lambda: meshkit.global_array_from_local(local, mesh, "data", check=False),
}
results["global_paced"] = series("global_paced", global_fns, calls=PACED_CALLS, pace=PACE_S)
results["debug_paced"] = series(
    "debug_paced",
    {"on": lambda: step(x), "off": lambda: step(x)},
    setup={"on": (lambda: meshkit.debug.enable(timeout=60, watchdog=None), meshkit.debug.disable)},
    calls=PACED_CALLS,
    pace=PACE_S,
)


# global_batches paced as a training step: its per-step cost against a hand-written prefetch
# (a thread assembling each batch with jax.make_array_from_process_local_data, two ahead, as
# global_batches' helper does, without its checks and agreements), with its default check and
# with check=False. One iterator per variant serves every round (made before the warm-up
# round, in which its windows grow to their size): the rounds time the steady state.
BATCH_CALLS = 96


class _HandWritten:
    """The baseline: a thread assembles the global batches, at most two ahead."""

    def __init__(self, count: int) -> None:
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        self.queue: queue.Queue[Any] = queue.Queue()
        self.slots = threading.Semaphore(2)
        self.stop = threading.Event()

        def work() -> None:
            for _ in range(count):
                while not self.slots.acquire(timeout=0.1):
                    if self.stop.is_set():
                        return
                self.queue.put(jax.make_array_from_process_local_data(sharding, local))

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def __next__(self) -> Any:
        item = self.queue.get()
        self.slots.release()
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


if "stop_together" in inspect.signature(meshkit.global_batches).parameters:
    held: dict[str, Any] = {}

    kinds = ("check", "nocheck", "thread")
    total = (ROUNDS + 1) * BATCH_CALLS + 8  # every round's steps, the warm-up's too
    for kind in kinds:
        if kind == "thread":
            held[kind] = _HandWritten(total)
        else:
            loader = (local for _ in range(total))
            held[kind] = meshkit.global_batches(loader, mesh, "data", check=kind == "check")

    results["batches_paced"] = series(
        "batches_paced",
        {kind: (lambda kind=kind: next(held[kind])) for kind in kinds},
        calls=BATCH_CALLS,
        pace=PACE_S,
    )
    for kind in kinds:
        held[kind].close()


PROGRESS_S = 6.0
PROGRESS_WINDOW_S = 1.0


def progress() -> dict[str, float] | None:
    """The progress records' requests per process and process 0's time per window (above)."""
    try:
        from meshkit._src.coord import failures
        from meshkit._src.lifecycle import stall, stragglers
        from meshkit._src.lifecycle.progress import ServiceBoard
    except ImportError:  # a meshkit without progress records
        return None
    asked = {"steps": 0, "stall": 0}

    def counted(kind: str, board: ServiceBoard) -> ServiceBoard:
        def count(call: Callable[..., Any]) -> Callable[..., Any]:
            def counting(*args: Any) -> Any:
                asked[kind] += 1
                return call(*args)

            return counting

        return ServiceBoard(count(board.post), count(board.read), count(board.drop))

    steps_board, stall_board = failures.board(failures.STEPS), failures.board(failures.STALL)
    assert steps_board is not None
    assert stall_board is not None
    stragglers.install(ME, counted("steps", steps_board), PROGRESS_WINDOW_S)
    detector = stall._detector
    if detector is not None:
        detector.board = counted("stall", stall_board)
    windows = stragglers._windows
    assert windows is not None
    turn, turns = windows.turn, []

    def timed_turn(*, last: bool = False) -> None:
        began = time.perf_counter()
        turn(last=last)
        turns.append(time.perf_counter() - began)

    windows.turn = timed_turn  # the task scheduled next calls the timed one
    meshkit.barrier("progress")
    began = time.monotonic()
    loader = (local for _ in range(int(PROGRESS_S / PACE_S)))  # every process: as many steps
    with meshkit.global_batches(loader, mesh, "data") as batches:
        for batch in batches:
            jax.block_until_ready(batch)
            time.sleep(PACE_S)
    took = time.monotonic() - began
    meshkit.barrier("progress-end")
    stragglers.install(ME, None, 3600.0)  # no more windows in the rest of the run
    return {
        "seconds": took,
        "steps_requests_per_s": asked["steps"] / took,
        "stall_requests": asked["stall"],
        "window_s": PROGRESS_WINDOW_S,
        "turn_ms": 1e3 * statistics.median(turns) if turns else float("nan"),
        "windows": len(turns),
    }


def meshkit_mesh() -> None:
    meshkit.make_mesh({"data": -1})


def jax_mesh() -> None:
    jax.make_mesh((jax.device_count(),), ("data",))


progressed = progress()
results["mesh"] = series("mesh", {"meshkit": meshkit_mesh, "jax": jax_mesh})
results["barrier"] = series("barrier", {"barrier": lambda: meshkit.barrier("x")})

# Every process's own counts, gathered through the coordination service (no device collective).
FIELDS = ("cpu", "rpcs", "agreements")
mine: dict[str, Any] = {
    s: {k: {f: v[f] for f in FIELDS} for k, v in d.items() if k != "overhead"}
    for s, d in results.items()
}
mine["progress"] = progressed
client.key_value_set(f"meshkit-bench/coordination/{ME}", json.dumps(mine))
probed = probe() if PROBE and N >= 2 else None
if ME == 0:
    per_process = [
        json.loads(client.blocking_key_value_get(f"meshkit-bench/coordination/{p}", 120_000))
        for p in range(N)
    ]
    print(
        "BENCH "
        + json.dumps(
            {
                "processes": N,
                "cpu_count": os.cpu_count(),
                "load_before": LOAD_BEFORE,
                "load_after": os.getloadavg(),
                "calls": ROUNDS * CALLS,
                "rounds": ROUNDS,
                "counters": STATS is not None,
                "deferred": DRAIN is not None,
                "results": results,
                "per_process": per_process,
                "probe": probed,
                "malloc": MALLOC,
            }
        )
    )
meshkit.barrier("bench-end")
