"""meshkit.debug: what the check costs per SPMD call, off (1 process) and on (2 processes).

Off, every SPMD entry still passes `meshkit._src.runtime.dispatch.enter`: a counter increment and
one emptiness test. Its cost is timed directly over a million calls, and as the difference between
a meshkit.spmd call and the same jit(shard_map) by hand (the spmd_dispatch table shows the
same per-call figure). On, each call exchanges a fingerprint through the coordination service:
timed in 2 processes x 4 CPU devices on a small spmd step, debug off and on in alternating rounds.
"""

from __future__ import annotations

from pathlib import Path

from _timing import launched_result, per_call

from meshkit._src.runtime import dispatch as _dispatch

HERE = Path(__file__).parent


def _enter_cost(n: int = 1_000_000) -> float:
    site = _dispatch.CallSite("spmd", "bench")
    return per_call(_dispatch.enter, site, (1, 2), n=n)[0]


def bench_debug() -> str:
    off = _enter_cost()
    data = launched_result(HERE / "debug_multiprocess.py")
    extra = data["on"] - data["off"]
    return "\n".join(
        [
            "meshkit.debug: cost per SPMD call",
            f"debug off, _dispatch.enter per call (1 process):      {off * 1e9:8.0f} ns  "
            "(goal <= 1 us)",
            f"spmd step, 2 processes x 4 CPU devices, debug off:    {data['off'] * 1e6:8.1f} us",
            f"spmd step, 2 processes x 4 CPU devices, debug on:     {data['on'] * 1e6:8.1f} us",
            f"debug on, extra per call:                             {extra * 1e6:8.1f} us  "
            "(goal <= 2000 us)",
        ]
    )


if __name__ == "__main__":
    print(bench_debug())
