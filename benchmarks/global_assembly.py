"""Global array assembly: meshkit.global_array_from_local against JAX's own paths, side by side.

Variants, each timed to ``.block_until_ready()`` and freed before the next call:

* ``jax``: ``jax.make_array_from_process_local_data(sharding, local, global_shape)``, the JAX
  baseline;
* ``bare``: the bound. One numpy view per local device, prepared once outside the timing; one
  batched ``jax.device_put(views, devices)``; ``jax.make_array_from_single_device_arrays``.
  No planning, no checks, and replicas are put from the host again;
* ``meshkit``: ``meshkit.global_array_from_local(local, mesh, spec)`` (``check=True``, the
  default: with several processes, one agreement through the coordination service, decided in
  the call);
* ``meshkit_verify``: ``meshkit`` with each round timed until `meshkit._src.coord.agree.drain`
  returns (multi-process rows only); with every default check decided in its call the drain has
  nothing to wait for, so it equals ``meshkit`` but for the drain's own call;
* ``meshkit_nocheck``: the same with ``check=False`` (multi-process rows only).

Rows: 1 process x 8 CPU devices (`bench_global_single_process`, in run.py's own process),
2 processes x 4 CPU devices (`bench_global_two_processes`, which launches
global_multiprocess.py; 64 MiB and 64 KiB per process, with issue 13's target: meshkit within
1.1x of ``jax.make_array_from_process_local_data`` at both sizes), and host to GPU
(`bench_global_gpu`, where a GPU is present).
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from _timing import bench_rounds, interleaved_samples, launched_result, median_uncertainty, table
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import meshkit

HERE = Path(__file__).parent
LOCAL_BYTES = 64 * 2**20  # float32 per process
SMALL_BYTES = 64 * 2**10  # the small size of the 2-process rows (issue 13's target)
COLUMNS = 1024
TARGET = 1.1  # issue 13: time(meshkit, check=True) / time(JAX baseline) at most this
VERIFIED = "meshkit_verify"
NAMES = {
    "jax": "jax.make_array_from_process_local_data",
    "bare": "bare device_put (the bound)",
    "meshkit": "meshkit, check=True (default)",
    VERIFIED: "meshkit, check=True, +verify (to drain)",
    "meshkit_nocheck": "meshkit, check=False",
}
NOTES = """\
steady: the median of the rounds shown per layout (calls per round), the variants taking turns
  round by round (A B C, C B A, ...) so that the machine's noise falls on all alike; every call
  is waited with block_until_ready and freed before the next. +-: 95% uncertainty of a median
  (boxplot notch, 1.57 IQR / sqrt(rounds)); a ratio's +- combines its two medians'.
first: each variant's first call on the layout, one call each in the order listed (cold: fresh
  buffers fault in, plan caches fill, threads start); later ones can reuse memory the earlier
  ones freed. An indication, not a steady-state figure: no ratios are taken from it.
GB/s: 1e9 bytes of local data (per process) per second; us/call: the steady median per call.
+verify: the same check=True call, each round timed until meshkit._src.coord.agree.drain
  returns (which verifies every check still pending: only check="deferred" leaves one). A
  check=True call decides its check before it returns, so +verify equals the plain call but for
  the drain's own cost."""
CPU_NOTES = """\
copy: the local data starts 16 B past a 64 B boundary, as numpy places large arrays under glibc
  (after an mmapped block's header): every variant copies it to the devices.
zero-copy: 64 B-aligned local data, which XLA's CPU client aliases instead of copying; what
  remains is each variant's per-call overhead plus any copy it makes itself. The issue's goals
  are for copied data: zero-copy rows show the ratios without them."""
ONE_PROCESS = "One process: check=True has nothing to exchange."
COPY = "copy"
ZERO_COPY = "zero-copy"
CPU_NOTE = (
    f"CPU GB/s are indicative only ({os.cpu_count()} cores, shared by every process); read the "
    "ratios."
)
CPU_NOTES += "\n" + CPU_NOTE


def size_text(nbytes: int) -> str:
    """``64 MiB``, ``64 KiB``, ... (whole binary units)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def drain_function() -> Callable[[], object] | None:
    """``meshkit._src.coord.agree.drain`` (verifies every deferred check), if it exists."""
    try:
        agree = importlib.import_module("meshkit._src.coord.agree")
    except ImportError:
        return None
    return getattr(agree, "drain", None)


def local_data(seed: int, *, aligned: bool = False, nbytes: int = LOCAL_BYTES) -> np.ndarray:
    """``nbytes`` of float32 (64 MiB unless told), touched (no page faults left in the source),
    ``COLUMNS`` wide, at a chosen alignment.

    XLA's CPU client aliases a host buffer aligned to 64 bytes instead of copying it, so the
    alignment decides what a CPU row measures. ``aligned=False`` starts the data 16 bytes past a
    64-byte boundary, as numpy's default allocator places large arrays under glibc (after the
    16-byte header of an mmapped block): every variant copies. ``aligned=True``: every variant
    aliases the same memory, and what is left is the per-call overhead. The placement is made
    here, whatever the size (numpy would place a small array elsewhere).
    """
    if nbytes % (4 * COLUMNS):
        raise ValueError(f"nbytes={nbytes} is not a whole number of {COLUMNS}-float32 rows")
    rows = nbytes // 4 // COLUMNS
    raw = np.empty(nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + (0 if aligned else 16)
    out = raw[start : start + nbytes].view(np.float32).reshape(rows, COLUMNS)
    out[...] = np.random.default_rng(seed).standard_normal((rows, COLUMNS), dtype=np.float32)
    return out


@dataclass
class Case:
    """One layout: the sharding, this process's data, and the variants that assemble it."""

    label: str
    mesh: Mesh
    sharding: NamedSharding
    local: np.ndarray
    global_shape: tuple[int, ...]
    variants: dict[str, Callable[[], jax.Array]]
    rounds: int  # timed rounds per variant
    number: int  # calls per round

    def check(self, out: jax.Array) -> None:
        """The assembled array holds the right rows on every local device."""
        assert out.shape == self.global_shape, (out.shape, self.global_shape)
        assert out.sharding.is_equivalent_to(self.sharding, out.ndim), out.sharding
        for shard in out.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), self.local_rows(shard.index))

    def local_rows(self, index: Any) -> np.ndarray:
        """The view of ``local`` that the device holding global ``index`` gets."""
        rows = self.global_shape[0]
        start = min(self._start(ix) for ix in self._indices().values())
        lo, hi, _ = index[0].indices(rows)
        return self.local[lo - start : hi - start]

    def _indices(self) -> Any:
        return self.sharding.addressable_devices_indices_map(self.global_shape)

    def _start(self, index: Any) -> int:
        return index[0].indices(self.global_shape[0])[0]


def make_case(
    mesh: Mesh,
    local: np.ndarray,
    *,
    label: str,
    rounds: int,
    number: int,
    nocheck: bool = True,
    verify: bool = False,
) -> Case:
    """The variants for ``local`` sharded by its rows over the mesh axis "data".

    ``nocheck``: add ``meshkit_nocheck``; ``verify``: add ``meshkit_verify`` (where
    ``meshkit._src.coord.agree.drain`` exists; `measure` drains its rounds).
    """
    spec = PartitionSpec("data")
    sharding = NamedSharding(mesh, spec)
    # The data axis spans every process (meshkit.make_mesh puts processes outermost), and each
    # process provides distinct rows.
    global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    case = Case(label, mesh, sharding, local, global_shape, {}, rounds, number)
    index = case._indices()
    devices = list(index)
    views = [case.local_rows(ix) for ix in index.values()]

    def base() -> jax.Array:
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    def bare() -> jax.Array:
        arrays = jax.device_put(views, devices)
        return jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)

    def ours() -> jax.Array:
        return meshkit.global_array_from_local(local, mesh, "data")

    def ours_nocheck() -> jax.Array:
        return meshkit.global_array_from_local(local, mesh, "data", check=False)

    fns = {"jax": base, "bare": bare, "meshkit": ours}
    if verify and drain_function() is not None:
        fns[VERIFIED] = ours  # the same call; measure times its rounds to the drain
    if nocheck:
        fns["meshkit_nocheck"] = ours_nocheck
    case.variants = {name: _waited(fn) for name, fn in fns.items()}
    return case


def _waited(fn: Callable[[], jax.Array]) -> Callable[[], jax.Array]:
    def call() -> jax.Array:
        return fn().block_until_ready()

    return call


def measure(cases: list[Case], *, sync: Callable[[], object] | None = None) -> dict[str, Any]:
    """First-call and steady-state seconds of every variant of every case (JSON-ready).

    ``sync`` runs before every first call and every round, untimed. With several processes it is
    a barrier, and the 64 MiB rounds are of one call: otherwise a check=True call would also
    wait for the other process to finish whatever noise delayed its previous call, and charge
    that to the check. Before ``sync``, the checks still pending are drained (untimed), so that
    no round verifies the checks of another; ``meshkit_verify`` rounds are timed until their
    own drain returns. Every call is waited (block_until_ready) and its result freed before the
    next.
    """
    drain = drain_function()

    def drained() -> None:
        if drain is not None:
            drain()

    def before() -> None:
        drained()
        if sync is not None:
            sync()

    verify_mark = object()

    def timed(name: str, fn: Callable[[], jax.Array]) -> Callable[[], object]:
        def call() -> object:
            fn()  # waited inside; the result is freed here
            return verify_mark if name == VERIFIED else None

        return call

    def wait(outs: list[object]) -> None:
        # Once per round (every call of a round in one batch), inside the timed span.
        if outs and outs[-1] is verify_mark:
            drained()

    layouts = []
    for case in cases:
        first = {}
        for name, fn in case.variants.items():
            before()
            start = time.perf_counter()
            out = fn()
            if name == VERIFIED:
                drained()
            first[name] = time.perf_counter() - start
            case.check(out)
            del out
        samples = interleaved_samples(
            [timed(name, fn) for name, fn in case.variants.items()],
            wait=wait,
            rounds=case.rounds,
            number=case.number,
            max_in_flight=case.number,
            before_round=before,
        )
        drained()
        layouts.append(
            {
                "label": case.label,
                "bytes": int(case.local.nbytes),
                "axes": {str(k): int(v) for k, v in case.mesh.shape.items()},
                "aligned": case.local.ctypes.data % 64 == 0,
                "rounds": case.rounds,
                "number": case.number,
                "variants": {
                    name: {
                        "first": first[name],
                        "median": statistics.median(s),
                        "uncertainty": median_uncertainty(s),
                    }
                    for name, s in zip(case.variants, samples, strict=True)
                },
            }
        )
    return {
        "bytes": LOCAL_BYTES,
        "jax": jax.__version__,
        "drain": drain is not None,
        "layouts": layouts,
    }


def _ratio(
    what: str, value: float, uncertainty: float, goal: float | None, percent: bool = False
) -> str:
    """One ratio line: value +- uncertainty, and the goal met, NOT met, or inside the noise.

    Speed goals (``percent=False``) are minimums; the check's cost (``percent=True``) a maximum.
    ``goal=None``: the ratio alone (the issue's goals are for data that is copied).
    """
    above = not percent
    if percent:
        shown = f"{value * 100:+.1f}% +-{uncertainty * 100:.1f}"
        goal_text = f"<= {goal:+.0%}" if goal is not None else ""
    else:
        shown = f"{value:.3g}x +-{uncertainty:.2g}"
        goal_text = f">= {goal:g}x" if goal is not None else ""
    if goal is None:
        return f"  {what}: {shown}"
    lo, hi = value - uncertainty, value + uncertainty
    if (lo >= goal) if above else (hi <= goal):
        verdict = "met"
    elif (hi < goal) if above else (lo > goal):
        verdict = "NOT met"
    else:
        verdict = "within the noise"
    return f"  {what}: {shown} (goal {goal_text}: {verdict})"


def format_results(title: str, data: dict[str, Any], notes: list[str]) -> str:
    """The table of one `measure` result: GB/s per variant, then the ratios of medians.

    The goals shown are for 64 MiB (``LOCAL_BYTES``) of copied data; other rows show the ratios
    alone.
    """
    head = (
        f"{'layout / variant':<46} {'steady GB/s':>12} {'+-':>6} {'first GB/s':>11}"
        f" {'steady us/call':>15}"
    )
    lines = [title, NOTES, *notes, head, "-" * len(head)]
    for lay in data["layouts"]:
        v = lay["variants"]
        nbytes = lay.get("bytes", data["bytes"])
        gb = nbytes / 1e9
        lines.append(f"{lay['label']} ({lay['rounds']} rounds x {lay['number']})")
        for name, r in v.items():
            lines.append(
                f"  {NAMES[name]:<44} {gb / r['median']:>12.2f} {r['uncertainty'] * 100:>5.1f}%"
                f" {gb / r['first']:>11.2f} {r['median'] * 1e6:>15.1f}"
            )
        t = {name: r["median"] for name, r in v.items()}
        u = {name: r["uncertainty"] for name, r in v.items()}

        def both(a: str, b: str, u: dict[str, float] = u) -> float:
            return (u[a] ** 2 + u[b] ** 2) ** 0.5

        copied = ZERO_COPY not in lay["label"] and nbytes == LOCAL_BYTES  # the goals' rows
        vs_jax, vs_bare = t["jax"] / t["meshkit"], t["bare"] / t["meshkit"]
        lines.append(
            _ratio("speed, meshkit / JAX baseline", vs_jax, vs_jax * both("jax", "meshkit"),
                   5 if copied else None)
        )  # fmt: skip
        lines.append(
            _ratio("speed, meshkit / bare device_put", vs_bare,
                   vs_bare * both("bare", "meshkit"), 0.7 if copied else None)
        )  # fmt: skip
        if "meshkit_nocheck" in t:
            ratio = t["meshkit"] / t["meshkit_nocheck"]
            lines.append(
                _ratio("cost of the check, time(check=True) / time(check=False) - 1", ratio - 1,
                       ratio * both("meshkit", "meshkit_nocheck"), 0.05 if copied else None,
                       percent=True)
                + f" ({(t['meshkit'] - t['meshkit_nocheck']) * 1e6:+.1f} us per call)"
            )  # fmt: skip
    return "\n".join(lines)


def bench_global_single_process(malloc: str) -> str:
    """1 process x 8 CPU devices (run.py's own process)."""
    devices = jax.devices("cpu")
    mesh = meshkit.make_mesh({"data": -1}, devices=devices)
    cases = [
        make_case(
            mesh,
            local_data(0, aligned=aligned),
            label=f"data={len(devices)}, {kind}",
            rounds=bench_rounds(21),
            number=number,
            nocheck=False,
        )
        for aligned, kind, number in ((False, COPY, 4), (True, ZERO_COPY, 20))
    ]
    title = (
        f"global_array_from_local, 1 process x {len(devices)} CPU devices, "
        f"{LOCAL_BYTES // 2**20} MiB float32"
    )
    notes = [CPU_NOTES, malloc, ONE_PROCESS]
    return format_results(title, measure(cases), notes)


def bench_global_gpu() -> str:
    """Host to GPU, every GPU of this process; skipped (one line) without one."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "no GPU: host->GPU row skipped"
    if jax.devices()[0].platform != "gpu":
        return "no GPU: host->GPU row skipped (the default backend is not a GPU)"
    mesh = meshkit.make_mesh({"data": -1}, devices=gpus)
    label = f"data={len(gpus)}"
    case = make_case(
        mesh, local_data(0), label=label, rounds=bench_rounds(21), number=4, nocheck=False
    )
    title = (
        f"global_array_from_local, host -> {len(gpus)} GPU(s) ({gpus[0].device_kind}), "
        f"{LOCAL_BYTES // 2**20} MiB float32 from pageable numpy memory"
    )
    return format_results(title, measure([case]), [ONE_PROCESS])


def _time_ratio(t: dict[str, float], u: dict[str, float], name: str) -> tuple[float, float]:
    """time(name) / time(jax) and its +-: the two medians' relative uncertainties combined."""
    r = t[name] / t["jax"]
    return r, r * (u[name] ** 2 + u["jax"] ** 2) ** 0.5


def target_block(data: dict[str, Any]) -> str:
    """Issue 13's target from a 2-process `measure` result: meshkit / JAX at each size.

    The copied rows of the mesh with the one axis "data": time(meshkit, check=True) /
    time(jax.make_array_from_process_local_data), +- as the table's ratios (the two medians'
    uncertainties combined), PASS when at most ``TARGET``; beside it the same with the check
    verified (+verify), and the check's cost per call against check=False.
    """
    head = (
        f"target (issue 13): meshkit check=True (default) / {NAMES['jax']} <= {TARGET:g}x, "
        "copied data, mesh with the one axis 'data'"
    )
    lines = [
        head,
        "  ratio of medians (plain call time; +verify: rounds timed until every check is "
        "verified); check cost: meshkit - meshkit check=False, per call",
    ]
    rows = {
        lay["bytes"]: lay
        for lay in data["layouts"]
        if set(lay.get("axes", {})) == {"data"} and not lay.get("aligned", True)
    }
    for nbytes in (SMALL_BYTES, LOCAL_BYTES):
        lay = rows.get(nbytes)
        size = size_text(nbytes)
        if lay is None:
            lines.append(f"  {size:>7}: not measured")
            continue
        v = lay["variants"]
        t = {name: r["median"] for name, r in v.items()}
        u = {name: r["uncertainty"] for name, r in v.items()}
        r, ur = _time_ratio(t, u, "meshkit")
        verdict = "PASS" if r <= TARGET else "FAIL"
        if r - ur <= TARGET <= r + ur:
            verdict += " (within the noise)"
        line = f"  {size:>7}: {r:.3f}x +-{ur:.3f} {verdict}"
        if VERIFIED in t:
            rv, uv = _time_ratio(t, u, VERIFIED)
            line += f"; +verify {rv:.3f}x +-{uv:.3f}"
        else:
            line += "; +verify: n/a (no meshkit._src.coord.agree.drain)"
        if "meshkit_nocheck" in t:
            line += f"; check cost {(t['meshkit'] - t['meshkit_nocheck']) * 1e6:+.1f} us/call"
            if VERIFIED in t:
                line += f" (+verify {(t[VERIFIED] - t['meshkit_nocheck']) * 1e6:+.1f} us/call)"
        line += f" [jax {t['jax'] * 1e6:.1f} us/call]"
        lines.append(line)
    return "\n".join(lines)


def bench_global_two_processes() -> str:
    """2 processes x 4 CPU devices, through global_multiprocess.py (process 0's timings)."""
    data = launched_result(HERE / "global_multiprocess.py")
    sizes = sorted({lay.get("bytes", data["bytes"]) for lay in data["layouts"]}, reverse=True)
    title = (
        f"global_array_from_local, 2 processes x 4 CPU devices, "
        f"{' and '.join(size_text(b) for b in sizes)} float32 per process (process 0's timings)"
    )
    notes = [
        CPU_NOTES,
        data["malloc"],
        "Both processes start every round together (a barrier before each, untimed; a 64 MiB "
        "round is 48 calls copied, 1024 zero-copy; a 64 KiB round 1024). 64 KiB rows: ratios "
        "only (the table's goals are for 64 MiB); issue 13's target is below the table.",
    ]
    return format_results(title, data, notes) + "\n\n" + target_block(data)


def bench_check_changes() -> str:
    """Issue 43: a call whose layout changed costs at most one round trip more than a steady one."""
    data = launched_result(HERE / "check_changes.py")
    title = (
        f"global_array_from_local, a call whose layout changed, 2 processes x 4 CPU devices, "
        f"{size_text(data['bytes'])} float32 per process (process 0's timings)"
    )
    rows = [
        ("one layout, check=True (steady: agreed in the call)", data["jax"], data["steady"]),
        ("17 layouts in turn, check=True (each agreed in the call)", data["jax"], data["changed"]),
        ("17 layouts in turn, check='deferred'", data["jax"], data["deferred"]),
    ]
    extra = data["changed"] - data["steady"]
    lines = [
        table(title, rows, "jax", "meshkit"),
        f"A changed call over a steady one: {extra * 1e6:.0f} us; one coordination round trip "
        f"(the service's barrier): {data['round_trip'] * 1e6:.0f} us; goal: at most one round trip "
        f"({'met' if extra <= data['round_trip'] else 'NOT met'}).",
    ]
    return "\n".join(lines)
