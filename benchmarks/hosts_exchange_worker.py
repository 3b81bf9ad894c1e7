"""The hosts exchange of `meshkit.init` in N processes (run by hosts_exchange.bench_hosts).

Usage: ``meshkit launch -n N -d 1 hosts_exchange_worker.py BENCHMARKS_DIR``. Process 0 prints one
``BENCH {json}`` line: the seconds ``meshkit.init()`` took in each process, and the exchange
alone (`meshkit._src.coord.gather` through the real coordination service, as init makes it),
timed over ``ROUNDS`` rounds with a barrier before each (outside the timed span): process 0's
median seconds, and the round trips each process made per exchange; the exchange's share of
init (its first call, timed inside init); a coordination-service barrier alone, timed the same
way; and process 0's CPU seconds per exchange (it hosts the coordination service, so this is
the service's work for the 3N + 2 round trips, and process 0's own).
"""

import json
import resource
import statistics
import time

import jax  # noqa: F401  (imported before the timed span, as any program has)

import meshkit
from meshkit._src.coord import agree
from meshkit._src.coord.gather import gather
from meshkit._src.runtime import hosts

in_init: list[float] = []
exchange = hosts.table


def timed_exchange(*args, **kwargs):
    start = time.perf_counter()
    try:
        return exchange(*args, **kwargs)
    finally:
        in_init.append(time.perf_counter() - start)


hosts.table = timed_exchange  # init calls it through the module
t0 = time.perf_counter()
info = meshkit.init()
init_s = time.perf_counter() - t0

ROUNDS = 21
me, n = info.process_id, info.num_processes
node = agree.node()
assert node is not None
seconds, rpcs, barrier_s = [], [], []
cpu_start = resource.getrusage(resource.RUSAGE_SELF)
for r in range(ROUNDS):
    meshkit.barrier(f"bench-hosts-{r}")
    before = node.stats.rpcs
    start = time.perf_counter()
    got = gather(node.service, me, n, f"bench-hosts/{r}", hosts.here(), hosts._combine, timeout=60)
    seconds.append(time.perf_counter() - start)
    rpcs.append(node.stats.rpcs - before)
    assert got.answer is not None
cpu_end = resource.getrusage(resource.RUSAGE_SELF)
cpu = (cpu_end.ru_utime + cpu_end.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime) / ROUNDS
for r in range(ROUNDS):  # a barrier alone, for comparison: the floor of any all-process wait
    meshkit.barrier(f"bench-hosts-b-{r}")
    start = time.perf_counter()
    node.service.barrier(f"bench-hosts/barrier/{r}", 60)
    barrier_s.append(time.perf_counter() - start)
mine = json.dumps({"init": init_s, "in_init": in_init[0], "rpcs": statistics.median(rpcs)})
node.service.set(f"bench-hosts/report/{me}", mine)
meshkit.barrier("bench-hosts-report")
if me == 0:
    found = {int(k.rsplit("/", 1)[1]): v for k, v in node.service.dir_get("bench-hosts/report/")}
    reports = [json.loads(found[p]) for p in range(n)]
    print(
        "BENCH "
        + json.dumps(
            {
                "exchange": statistics.median(seconds),
                "barrier": statistics.median(barrier_s),
                "cpu0": cpu,
                "init": [r["init"] for r in reports],
                "in_init": [r["in_init"] for r in reports],
                "rpcs": [r["rpcs"] for r in reports],
                "table_bytes": len(hosts.Hosts.of([hosts.here()] * n).to_json()),
            }
        )
    )
