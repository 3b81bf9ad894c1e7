"""Cost of meshkit's cross-process checks as the number of processes grows.

Launches coordination_worker.py in N processes x 1 CPU device for each N of
``MESHKIT_BENCH_PROCS`` (default ``2,4,8,16``) and prints:

* a scaling table: ``global_array_from_local`` of a 4 KiB batch per process with
  ``check=False`` and ``check=True`` and the check's overhead (median of paired-round
  differences), debug mode's overhead per ``spmd`` call, ``meshkit.make_mesh`` and
  ``jax.make_mesh``, ``meshkit.barrier``, and the coordination-service round trips per call and
  process (from ``meshkit._src.coord.agree.stats``; "n/a" where meshkit has no such counter);
* CPU per call per process, to tell CPU contention (every process shares this machine's
  cores) from the protocol's own cost;
* a projection to 1,024 hosts computed from the measured figures (round trips per call, the
  per-RPC latency and the coordination service's CPU per RPC timed in the smallest run), for
  this protocol and for the previous one (every process reads every other's record: N - 1
  sequential reads per process, N(N - 1) at the coordinator);
* the issue's targets, PASS or FAIL.

``BENCH_REPEATS`` sets the paired rounds per series (default 9, 128 calls each; 1,024 for
global_array_from_local).
"""

from __future__ import annotations

import os
import statistics
import textwrap
from pathlib import Path
from typing import Any

from _timing import launched_result

HERE = Path(__file__).parent
WORKER = HERE / "coordination_worker.py"
HOSTS = 1024
LAUNCH_TIMEOUT = 600  # seconds per launch
# Issue targets: check overhead at the smallest N, and growth up to 16 processes.
CHECK_TARGET_S = 0.3e-3
DEBUG_TARGET_S = 0.5e-3
GROWTH_TARGET = 2.0
# global_batches with 10 ms steps: overhead per step at every N (flat to 16), and the check's cost.
BATCHES_TARGET_S = 0.1e-3
BATCHES_CHECK_RATIO = 1.05
WIDTH = 110  # notes are wrapped to this width


def _note(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def process_counts() -> list[int]:
    """``MESHKIT_BENCH_PROCS`` (comma-separated), default 2,4,8,16."""
    text = os.environ.get("MESHKIT_BENCH_PROCS", "2,4,8,16")
    counts = sorted({int(x) for x in text.split(",") if x.strip()})
    if not counts or counts[0] < 2:
        raise SystemExit(f"MESHKIT_BENCH_PROCS: process counts >= 2 expected; got {text!r}")
    return counts


def run_all(counts: list[int]) -> dict[int, dict[str, Any]]:
    """One launch per process count; the smallest also probes the coordination service."""
    data = {}
    for n in counts:
        args = ["--probe"] if n == counts[0] else []
        data[n] = launched_result(
            WORKER, *args, num_processes=n, devices_per_process=1, timeout=LAUNCH_TIMEOUT
        )
    return data


def _notch(samples: list[float]) -> float:
    """95% uncertainty of a median, absolute (boxplot notch, 1.57 IQR / sqrt(n))."""
    if len(samples) < 2:
        return float("nan")
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return 1.57 * (q3 - q1) / len(samples) ** 0.5


def _global_calls(d: dict[str, Any]) -> int:
    """Calls per round of the global_array_from_local series."""
    made = d["results"]["global"]["check"].get("calls", d["calls"])
    return int(made) // int(d["rounds"])


def _ms(seconds: float | None, digits: int = 3) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def _mean_over_processes(d: dict[str, Any], series: str, variant: str, field: str) -> float | None:
    values = [p[series][variant][field] for p in d["per_process"]]
    if any(v is None for v in values):
        return None
    return statistics.fmean(values)


def _rpcs(d: dict[str, Any], series: str, variant: str) -> float | None:
    return _mean_over_processes(d, series, variant, "rpcs")


def _per_agreement(d: dict[str, Any], series: str, variant: str) -> float | None:
    rpcs = sum(p[series][variant]["rpcs"] or 0 for p in d["per_process"])
    agreements = sum(p[series][variant]["agreements"] or 0 for p in d["per_process"])
    return rpcs / agreements if d["counters"] and agreements else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def scaling_table(data: dict[int, dict[str, Any]]) -> str:
    base_n = min(data)
    base = data[base_n]["results"]
    head = (
        f"{'procs':>5} {'check=False':>11} {'check=True':>10} {'check overhead':>15} "
        f"{f'x N={base_n}':>7} {'+verify':>7} {'debug overhead':>15} {f'x N={base_n}':>7} "
        f"{'+verify':>7} {'make_mesh':>9} {'jax.make_mesh':>13} {'barrier':>7} "
        f"{'RTs/call/proc':>13}"
    )
    units = (
        f"{'':>5} {'ms/call':>11} {'ms/call':>10} {'ms':>15} {'':>7} {'ms':>7} {'ms':>15} "
        f"{'':>7} {'ms':>7} {'ms':>9} {'ms':>13} {'ms':>7} {'(check=True)':>13}"
    )
    lines = [
        "Cross-process checks vs process count (N processes x 1 CPU device, "
        f"{data[base_n]['cpu_count']} cores shared by all)",
        head,
        units,
        "-" * len(head),
    ]
    for n, d in sorted(data.items()):
        r = d["results"]
        g, dbg = r["global"]["overhead"], r["debug"]["overhead"]
        lines.append(
            f"{n:>5} {_ms(r['global']['nocheck']['seconds']):>11} "
            f"{_ms(r['global']['check']['seconds']):>10} "
            f"{_ms(g['seconds']) + ' +-' + _ms(_notch(g['rounds'])):>15} "
            f"{g['seconds'] / base['global']['overhead']['seconds']:>6.2f}x "
            f"{_ms(g['verified']):>7} "
            f"{_ms(dbg['seconds']) + ' +-' + _ms(_notch(dbg['rounds'])):>15} "
            f"{dbg['seconds'] / base['debug']['overhead']['seconds']:>6.2f}x "
            f"{_ms(dbg['verified']):>7} "
            f"{_ms(r['mesh']['meshkit']['seconds']):>9} {_ms(r['mesh']['jax']['seconds']):>13} "
            f"{_ms(r['barrier']['barrier']['seconds']):>7} "
            f"{_fmt(_rpcs(d, 'global', 'check')):>13}"
        )
    d0 = data[base_n]
    load = ", ".join(
        f"N={n} {d['load_before'][0]:.1f}/{d['load_after'][0]:.1f}" for n, d in sorted(data.items())
    )
    lines += [
        _note(
            f"Medians over {d0['rounds']} paired rounds of {d0['calls'] // d0['rounds']} calls "
            f"per variant ({_global_calls(d0)} for global_array_from_local): a meshkit.barrier "
            "before each round (outside the timed span), the variants taking turns (A B, B A, "
            "...), every call waited with "
            "block_until_ready. Overhead: "
            "the median of the per-round differences, +- its 95% notch (1.57 IQR / "
            "sqrt(rounds)). +verify: the same with each round timed until "
            "meshkit._src.coord.agree.drain() returns, i.e. until every check the round issued is "
            "verified (deferred checks "
            "return before their verdict). Debug overhead: an spmd step "
            "(x * 2 on a global array) with meshkit.debug.enable(timeout=60, watchdog=None) "
            "minus the same with debug off. Times: process 0's clock."
        ),
        _note(
            f"Load average (1 min) before/after each launch: {load} (other work on the "
            f"{d0['cpu_count']} cores skews every figure)."
        ),
    ]
    return "\n".join(lines)


def _paired(r: dict[str, Any], a: str, b: str) -> tuple[float, float]:
    """Median and 95% notch of ``a`` minus ``b``, round by round (seconds per step)."""
    diffs = [x - y for x, y in zip(r[a]["rounds"], r[b]["rounds"], strict=True)]
    return statistics.median(diffs), _notch(diffs)


def _others_cpu(d: dict[str, Any], variant: str) -> float | None:
    """CPU per step of the processes other than 0 (which also serves the coordination service)."""
    cpus = [p["batches_paced"][variant]["cpu"] for p in d["per_process"][1:]]
    return statistics.fmean(cpus) if cpus else None


def batches_table(data: dict[int, dict[str, Any]]) -> str:
    """global_batches per step, paced as a training step, against batches assembled before."""
    if any("batches_paced" not in d["results"] for d in data.values()):
        return ""
    if any("thread" not in d["results"]["batches_paced"] for d in data.values()):
        return ""  # an older worker (the handover series)
    base_n = min(data)
    calls = data[base_n]["results"]["batches_paced"]["check"]["calls"] // data[base_n]["rounds"]
    lines = [
        "global_batches: 10 ms paced steps; overhead against a hand-written prefetch thread",
        f"{'procs':>5} {'thread':>8} {'check':>8} {'overhead':>15} {'check/nocheck':>13} "
        f"{'CPU thread':>10} {'CPU check':>9} {'RTs/step/proc':>13} {'coord req/step':>14}",
        f"{'':>5} {'ms/step':>8} {'ms/step':>8} {'ms':>15} {'':>13} {'ms/step':>10} "
        f"{'ms/step':>9} {'(check)':>13} {'(check)':>14}",
    ]
    lines.append("-" * len(lines[1]))
    for n, d in sorted(data.items()):
        r = d["results"]["batches_paced"]
        over, notch = _paired(r, "check", "thread")
        ratio = r["check"]["seconds"] / r["nocheck"]["seconds"]
        rts = _rpcs(d, "batches_paced", "check")
        lines.append(
            f"{n:>5} {_ms(r['thread']['seconds']):>8} {_ms(r['check']['seconds']):>8} "
            f"{_ms(over) + ' +-' + _ms(notch):>15} {ratio:>13.3f} "
            f"{_ms(_others_cpu(d, 'thread')):>10} {_ms(_others_cpu(d, 'check')):>9} "
            f"{_fmt(rts):>13} "
            f"{_fmt(None if rts is None else rts * n, '.1f'):>14}"
        )
    lines.append(
        _note(
            f"Medians over {data[base_n]['rounds']} paired rounds of {calls} steps, each step "
            "followed by a 10 ms wait, one iterator per variant for every round (its windows "
            "grew to their size in a warm-up round: the steady state); "
            "global_batches(check=True, the default) and check=False on a 4 "
            "KiB batch per process; 'thread': a hand-written prefetch, a thread that assembles "
            "each batch with jax.make_array_from_process_local_data, two ahead (no checks, no "
            "agreement). Times: next() and the 10 ms wait, process 0's clock; CPU: per step, "
            "every thread, mean of the processes other than 0. RTs: "
            "coordination-service round trips per step and process (the windows' agreements and "
            "the close watch's reads, about one a second); coord req/step: all processes'."
        )
    )
    return "\n".join(lines)


def batches_projection(data: dict[int, dict[str, Any]]) -> str:
    """global_batches' requests and coordinator CPU per step at 1,024 hosts, from the design."""
    if not batches_table(data):
        return ""
    base_n = min(data)
    probe = data[base_n]["probe"] or {}
    server = probe.get("server_cpu_per_rpc")
    if server is None:
        return ""
    step_s, batch_bytes = 0.01, 4096
    window = max(1, min(max(32, HOSTS), (64 << 20) // (2 * batch_bytes)))
    watch_period = max(1.0, HOSTS / 500)
    windows = 2 * HOSTS / window
    watch = HOSTS / watch_period * step_s
    total = windows + watch
    old = 3 * HOSTS  # the per-step agreement (2N) and the handover barrier (N)
    return "\n".join(
        [
            f"PROJECTION of global_batches to {HOSTS:,} hosts (computed from the design and the "
            "probe's figure; not a run)",
            f"  windows of {window:,} steps (the process count, within 64 MiB of 4 KiB batches "
            f"read ahead): 2 x {HOSTS:,} / {window:,} = {windows:.1f} coordinator requests per "
            f"step; the close watch, one read per {watch_period:.2f} s per host: "
            f"{watch:.1f} per {step_s * 1e3:.0f} ms step; {total:.1f} in all.",
            f"  coordinator CPU per step: {total:.1f} x {server * 1e6:.0f} us = "
            f"{total * server * 1e3:.2f} ms; before (an agreement per step, 2N requests, and "
            f"the handover barrier, N): {old:,} requests, {old * server * 1e3:,.0f} ms.",
        ]
    )


def _service_cpu_per_rpc(d: dict[str, Any], series: str, variant: str) -> float | None:
    """In-run estimate: process 0's extra CPU per call over the others' mean, per RPC made."""
    cpus = [p[series][variant]["cpu"] for p in d["per_process"]]
    rpcs = [p[series][variant]["rpcs"] for p in d["per_process"]]
    if any(r is None for r in rpcs) or not sum(rpcs):
        return None
    return (cpus[0] - statistics.fmean(cpus[1:])) / sum(rpcs)


def _server_text(server: float | None) -> str:
    """The in-run estimate of the service's CPU per RPC, as the table shows it.

    The estimate is a difference of two processes' CPU: below zero, the noise of the run
    exceeds what the service cost, and the number says nothing (the probe's figure does).
    """
    if server is None:
        return "n/a"
    return f"{server * 1e6:.0f} us" if server > 0 else "below noise"


def round_trip_table(data: dict[int, dict[str, Any]]) -> str:
    cols = ("check=True", "per agreement", "debug on", "make_mesh", "barrier", "service CPU/RPC")
    head = f"{'procs':>5} " + " ".join(f"{c:>15}" for c in cols)
    lines = [
        "Coordination-service round trips per call and process "
        "(meshkit._src.coord.agree.stats, mean over processes; n/a: no such counter)",
        head,
        "-" * len(head),
    ]
    for n, d in sorted(data.items()):
        server = _service_cpu_per_rpc(d, "global", "check")
        cells = (
            _fmt(_rpcs(d, "global", "check")),
            _fmt(_per_agreement(d, "global", "check")),
            _fmt(_rpcs(d, "debug", "on")),
            _fmt(_rpcs(d, "mesh", "meshkit")),
            _fmt(_rpcs(d, "barrier", "barrier")),
            _server_text(server),
        )
        lines.append(f"{n:>5} " + " ".join(f"{c:>15}" for c in cells))
    lines.append(
        _note(
            "service CPU/RPC: an in-run estimate from the check=True rounds, (process 0's CPU - "
            "the others' mean) / every process's RPCs (process 0 hosts the coordination service); "
            "below noise: that difference was negative (the projection uses the probe's figure)."
        )
    )
    return "\n".join(lines)


def cpu_table(data: dict[int, dict[str, Any]]) -> str:
    sub = ("proc 0", "others mean", "floor", "wall+verify")
    head = (
        f"{'':>5} {'global_array_from_local check=True, ms/call':^51}   "
        f"{'spmd step, debug on, ms/call':^51}"
    )
    cols = f"{'procs':>5} " + " ".join(f"{c:>12}" for c in sub) + "   "
    cols += " ".join(f"{c:>12}" for c in sub)
    lines = [
        "CPU per call of each process (resource.getrusage over the timed rounds, every thread) "
        "vs wall time",
        head,
        cols,
        "-" * len(cols),
    ]
    for n, d in sorted(data.items()):
        cells = []
        for series, variant in (("global", "check"), ("debug", "on")):
            cpus = [p[series][variant]["cpu"] for p in d["per_process"]]
            cells.append(
                " ".join(
                    f"{x * 1e3:>12.3f}"
                    for x in (
                        cpus[0],
                        statistics.fmean(cpus[1:]),
                        sum(cpus) / d["cpu_count"],
                        d["results"][series][variant]["verified"],
                    )
                )
            )
        lines.append(f"{n:>5} " + "   ".join(cells))
    lines.append(
        _note(
            "floor: every process's CPU per call / cores, the least wall time per call this "
            "machine allows; where the wall time (each round timed to the end of its drain) is "
            "close to it, the figure measures CPU contention, not the protocol's waits. Process 0 "
            "also hosts the coordination service."
        )
    )
    return "\n".join(lines)


def projection(data: dict[int, dict[str, Any]]) -> str:
    base_n = min(data)
    probe = data[base_n]["probe"] or {}
    latency = probe.get("set_p1")
    server = probe.get("server_cpu_per_rpc")
    counts = sorted(data)
    by_n = {n: _rpcs(data[n], "global", "check") for n in counts}
    known = {n: r for n, r in by_n.items() if r is not None}
    # The most any measured N needed: the projection's figure (conservative).
    worst = max(known, key=lambda n: known[n]) if known else None
    rts = known[worst] if worst is not None else None
    debug_values = [r for n in counts if (r := _rpcs(data[n], "debug", "on")) is not None]
    rts_debug = max(debug_values) if debug_values else None
    per_agreement = _per_agreement(data[worst], "global", "check") if worst is not None else None
    lines = [f"PROJECTION to {HOSTS:,} hosts (computed from the figures measured above; not a run)"]
    if latency is None or server is None:
        return "\n".join([*lines, "  n/a: the coordination service was not probed."])
    lines += [
        f"  measured (N={base_n} run): per-RPC latency {latency * 1e6:.0f} us from process 1 "
        f"(key_value_set; process 0, which hosts the service: set {probe['set_p0'] * 1e6:.0f} us, "
        f"increment {probe['increment_p0'] * 1e6:.0f} us, get {probe['get_p0'] * 1e6:.0f} us); "
        f"coordination service CPU {server * 1e6:.0f} us per RPC (process 0's CPU while only "
        "process 1 sends RPCs, less an idle window as long).",
    ]
    if rts is None:
        lines.append(
            "  this protocol: n/a (meshkit._src.coord.agree.stats does not exist: round trips not "
            "counted)."
        )
    else:
        agreements = "n/a" if per_agreement is None else f"{per_agreement:.2f}"
        grows = known[counts[-1]] - known[counts[0]] > 0.5 if len(known) == len(counts) else None
        trend = ", ".join(f"N={n}: {r:.2f}" for n, r in known.items())
        verdict = {True: "GROWS with N.", False: "does not grow with N."}.get(
            grows, "not counted at every N."
        )
        lines += [
            f"  this protocol: {rts:.2f} round trips per call per process for check=True, the most "
            f"any measured N needed (N={worst}; {agreements} per agreement); by N: {trend}: "
            f"{verdict}",
            f"    bytes per call per process: {rts:.2f} round trips of under ~100 bytes each in "
            "the common case (the window's size under a key naming tag/block/seq, a barrier "
            "wait named by the window's digest); constant in N.",
            f"    verification latency floor per call: {rts:.2f} x {latency * 1e6:.0f} us = "
            f"{rts * latency * 1e3:.2f} ms (sequential round trips, the same at any N).",
            f"    coordinator requests per call: {HOSTS:,} x {rts:.2f} = {HOSTS * rts:,.0f}.",
            f"    coordinator CPU per call: {HOSTS:,} x {rts:.2f} x {server * 1e6:.0f} us = "
            f"{HOSTS * rts * server * 1e3:,.1f} ms (at most "
            f"{1 / (HOSTS * rts * server):,.1f} checked calls/s per coordinator core).",
        ]
        if rts_debug is not None:
            lines.append(
                f"    debug on: {rts_debug:.2f} round trips per spmd call per process (the most "
                f"any N needed; windows of calls, as check=True, in a loop that repeats its "
                f"pattern; a call that differs from its thread's call 12 back waits for its "
                f"window: 2 round trips): {HOSTS * rts_debug:,.0f} coordinator requests and "
                f"{HOSTS * rts_debug * server * 1e3:,.1f} ms of coordinator CPU per call."
            )
    old_requests = HOSTS * (HOSTS - 1) + HOSTS
    lines += [
        "  previous protocol (each process writes its record, then reads the N - 1 others in "
        "turn):",
        f"    {HOSTS:,} round trips per call per process (1 write + {HOSTS - 1:,} sequential "
        f"reads), each carrying a whole record: latency floor {HOSTS - 1:,} x "
        f"{latency * 1e6:.0f} us = {(HOSTS - 1) * latency * 1e3:,.0f} ms per call.",
        f"    coordinator requests per call: {HOSTS:,} x {HOSTS - 1:,} reads + {HOSTS:,} writes "
        f"= {old_requests:,}; coordinator CPU per call: {old_requests:,} x "
        f"{server * 1e6:.0f} us = {old_requests * server:,.1f} s.",
        "  (Assumes the coordinator's CPU per RPC and the RPC latency stay as measured on this "
        "loopback machine; a real network adds its round-trip time to each sequential RPC.)",
    ]
    return "\n".join(_note(line.lstrip(), line[: len(line) - len(line.lstrip())]) for line in lines)


_VARIANTS = {"global": ("check", "nocheck"), "debug": ("on", "off")}


def _cpu_overhead(d: dict[str, Any] | None, series: str) -> float | None:
    """Mean over processes 1..N-1 of the CPU per call of a series' variant over its baseline."""
    if d is None or len(d["per_process"]) < 2:
        return None
    a, b = _VARIANTS[series]
    others = d["per_process"][1:]
    return statistics.mean(p[series][a]["cpu"] - p[series][b]["cpu"] for p in others)


def targets(data: dict[int, dict[str, Any]]) -> str:
    def overhead(n: int, series: str, field: str) -> float | None:
        if n not in data or series not in data[n]["results"]:
            return None
        return data[n]["results"][series]["overhead"][field]

    def judge(value: float | None, limit: float) -> str:
        return "n/a" if value is None else ("PASS" if value <= limit else "FAIL")

    rows = []
    for series, what, limit in (
        ("global", "check overhead", CHECK_TARGET_S),
        ("debug", "debug overhead", DEBUG_TARGET_S),
    ):
        cells = []
        growth = []
        for field in ("seconds", "verified"):
            at2, at16 = overhead(2, series, field), overhead(16, series, field)
            cells.append(("n/a" if at2 is None else f"{at2 * 1e3:.3f} ms", judge(at2, limit)))
            if at2 is None or at16 is None:
                growth.append(("n/a", "n/a"))
            else:
                ratio = at16 / at2
                verdict = judge(ratio, GROWTH_TARGET)
                # The 95% notches of both medians: a target inside them is not a clear verdict.
                rounds = "rounds" if field == "seconds" else "verified_rounds"
                n16 = _notch(data[16]["results"][series]["overhead"][rounds])
                n2 = _notch(data[2]["results"][series]["overhead"][rounds])
                if verdict == "FAIL" and at16 - n16 <= GROWTH_TARGET * (at2 + n2):
                    verdict = "FAIL*"
                growth.append((f"{at16 * 1e3:.3f} ms = {ratio:.2f}x", verdict))
        rows.append((f"{what} at 2 processes <= {limit * 1e3:.1f} ms", *cells[0], *cells[1]))
        rows.append((f"{what} at 16 <= {GROWTH_TARGET:.0f}x at 2", *growth[0], *growth[1]))
        # What a process pays whatever the cores: the CPU overhead per call of the processes
        # other than 0 (which also serves the coordination service: O(N) there by design).
        at2, at16 = _cpu_overhead(data.get(2), series), _cpu_overhead(data.get(16), series)
        if at2 is not None and at16 is not None and at2 > 0:
            ratio = at16 / at2
            cell = (f"{at16 * 1e3:.3f} ms = {ratio:.2f}x", judge(ratio, GROWTH_TARGET))
        else:
            cell = ("n/a", "n/a")
        rows.append((f"  its CPU per process at 16 <= {GROWTH_TARGET:.0f}x", *cell, "", ""))
        paced = series + "_paced"
        at2, at16 = overhead(2, paced, "seconds"), overhead(16, paced, "seconds")
        if at2 is not None and at16 is not None and paced in data[2]["results"] and at2 > 0:
            ratio = at16 / at2
            cell = (f"{at16 * 1e3:.3f} ms = {ratio:.2f}x", judge(ratio, GROWTH_TARGET))
        else:
            cell = ("n/a", "n/a")
        rows.append((f"  paced (10 ms steps) at 16 <= {GROWTH_TARGET:.0f}x", *cell, "", ""))
        # The other reading of the growth target ("at most 2x that at 16", that being
        # the 2-process limit): the 16-process overhead against twice the 2-process limit.
        at16 = overhead(16, series, "seconds")
        bound = GROWTH_TARGET * limit
        cell = ("n/a", "n/a") if at16 is None else (f"{at16 * 1e3:.3f} ms", judge(at16, bound))
        rows.append((f"  at 16 <= {GROWTH_TARGET:.0f} x {limit * 1e3:.1f} ms", *cell, "", ""))
    if batches_table(data):  # issue 25, point 6, and its costs
        for n in sorted(data):
            r = data[n]["results"]["batches_paced"]
            over, _ = _paired(r, "check", "thread")
            ratio = r["check"]["seconds"] / r["nocheck"]["seconds"]
            rows.append(
                (f"global_batches overhead at {n} <= {BATCHES_TARGET_S * 1e3:.1f} ms",
                 f"{over * 1e3:.3f} ms", judge(over, BATCHES_TARGET_S), "", "")
            )  # fmt: skip
            rows.append(
                (f"  check/nocheck at {n} <= {BATCHES_CHECK_RATIO:.2f}", f"{ratio:.3f}",
                 judge(ratio, BATCHES_CHECK_RATIO), "", "")
            )  # fmt: skip
    head = (
        f"{'target':<38} {'measured':>20} {'result':>6}   {'+verify (see above)':>20} {'result':>6}"
    )
    lines = ["Targets (the issue's)", head, "-" * len(head)]
    lines += [f"{t:<38} {m:>20} {r:>6}   {mv:>20} {rv:>6}" for t, m, r, mv, rv in rows]
    if 16 in data:
        lines.append(
            _note(
                f"(16 processes share {data[16]['cpu_count']} cores here: see the CPU floor "
                "above before reading the growth targets. 'its CPU per process': the overhead's "
                "CPU per call of each process other than 0, mean, from resource.getrusage: what "
                "one host pays when every process has cores of its own. 'paced': the overhead "
                "when each call is followed by a 10 ms wait, so that the processes do not queue "
                "for the cores: the check's latency. FAIL*: within the noise, the target inside "
                "the two medians' 95% notches.)"
            )
        )
    return "\n".join(lines)


def paced_table(data: dict[int, dict[str, Any]]) -> str:
    """The overheads with every call followed by a 10 ms wait (the host's CPU mostly idle)."""
    base_n = min(data)
    if "debug_paced" not in data[base_n]["results"]:
        return "Paced series: not measured (an older worker)."
    head = (
        f"{'procs':>5} {'check overhead, ms':>22} {f'x N={base_n}':>7} "
        f"{'debug overhead, ms':>22} {f'x N={base_n}':>7} {'load (1 min)':>13}"
    )
    lines = [
        "Paced: each call followed by a 10 ms wait, as a step whose device work leaves the host "
        "idle (overhead per call, +- 95% notch)",
        head,
        "-" * len(head),
    ]
    base = {s: data[base_n]["results"][s]["overhead"]["seconds"] for s in _PACED}
    for n, d in sorted(data.items()):
        cells = []
        for s in _PACED:
            o = d["results"][s]["overhead"]
            cells.append(f"{_ms(o['seconds']) + ' +-' + _ms(_notch(o['rounds'])):>22}")
            cells.append(f"{o['seconds'] / base[s]:>6.2f}x" if base[s] > 0 else f"{'n/a':>7}")
        lines.append(f"{n:>5} {' '.join(cells)} {d['load_after'][0]:>13.1f}")
    lines.append(
        _note(
            "Every process is idle most of the time, so N processes do not queue for this "
            "machine's cores as in the table above: the overhead is the check's latency (its "
            "round trips, and the coordinator's work for N requests), what a host of its own "
            "would see."
        )
    )
    return "\n".join(lines)


_PACED = ("global_paced", "debug_paced")
DEFAULT_WINDOW_S = 30.0  # MESHKIT_STEP_WINDOW's default
REQUESTS_TARGET = 0.1  # per process per second (issue 44, point 6)


def progress_table(data: dict[int, dict[str, Any]]) -> str:
    """The always-on progress records in a loop of 10 ms steps, per process count (issue 44)."""
    rows = {n: [p.get("progress") for p in d["per_process"]] for n, d in sorted(data.items())}
    if any(r is None for per in rows.values() for r in per):
        return "Progress records: not measured (a meshkit without them)."
    head = (
        f"{'procs':>5} {'step-window requests/s per process':>36} {'at 30 s windows':>16} "
        f"{'stall requests':>15} {'process 0 per window, ms':>25}"
    )
    lines = [
        "Progress records (stall records and step windows) in a global_batches loop of 10 ms "
        "steps, windows of 1 s (the default is 30 s)",
        head,
        "-" * len(head),
    ]
    turns = {}
    for n, per in rows.items():
        window = per[0]["window_s"]
        rates = [r["steps_requests_per_s"] for r in per]
        at_default = max(rates) * window / DEFAULT_WINDOW_S
        turns[n] = per[0]["turn_ms"]
        lines.append(
            f"{n:>5} {f'{min(rates):.2f} to {max(rates):.2f}':>36} {at_default:>16.3f} "
            f"{sum(r['stall_requests'] for r in per):>15d} {turns[n]:>25.2f}"
        )
    small, large = min(turns), max(turns)
    growth = turns[large] / turns[small] if turns[small] > 0 else float("nan")
    lines.append(
        _note(
            "Each process posts its window (1 request) and process 0 also lists every "
            "process's (1 request): per process at most 2 requests per window whatever N, "
            f"{2 / DEFAULT_WINDOW_S:.3f}/s at the default window (target <= "
            f"{REQUESTS_TARGET}/s). The stall records cost no request while the processes make "
            "progress (0 above): a process posts only once it has shown none for a fifth of "
            "the deadline, and reads the others' then. Process 0's window grows with N through "
            f"the rows it lists and ranks ({turns[small]:.2f} ms at {small}, "
            f"{turns[large]:.2f} ms at {large}, {growth:.1f}x): at 1,024 hosts x 8 processes, "
            "8,192 rows of about 110 bytes (0.9 MB listed, about 44 ms to parse and rank: "
            "benchmarks/progress_records.py) once per 30 s on process 0's service thread; the "
            f"coordination service takes 8,192 posts per window ({8192 / DEFAULT_WINDOW_S:.0f} "
            "requests/s, spread over the window by each process's own clock)."
        )
    )
    return "\n".join(lines)


def bench_coordination() -> str:
    data = run_all(process_counts())
    parts = [
        scaling_table(data),
        paced_table(data),
        batches_table(data),
        progress_table(data),
        round_trip_table(data),
        cpu_table(data),
        projection(data),
        batches_projection(data),
    ]
    return "\n\n".join([*(p for p in parts if p), targets(data)])


if __name__ == "__main__":
    print(bench_coordination())
