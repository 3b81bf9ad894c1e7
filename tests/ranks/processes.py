"""What the fresh processes of `tests/test_multiprocess.py` run (its warm cluster runs its own).

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest.
"""

from __future__ import annotations


def many_agreements():
    import jax

    from meshkit._src.coord import agree as _agree

    me = jax.process_index()
    seen = []
    # Equal, equal, different (every record comes back), equal again, then equal summaries
    # with different records (records are shown, not compared).
    for i, summary in enumerate(["a", "a", f"b{me}", "a", "a"]):
        outcome = _agree.agree("test", summary, f"{me}:{i}", timeout=20)
        seen.append((outcome.agreed, sorted(outcome.records.items()), outcome.missing))
    return seen


def checks():
    import time

    import jax

    from meshkit._src.coord import agree as _agree

    me = jax.process_index()
    seen = []

    def check(summary, timeout=60.0):
        rpcs, start = _agree.stats.rpcs, time.monotonic()
        outcome = _agree.check("test-check", summary, f"{me}:{summary}", timeout=timeout)
        took = time.monotonic() - start
        seen.append(
            (
                summary,
                outcome.agreed,
                sorted(outcome.records.items()),
                outcome.missing,
                outcome.gave_up,
                _agree.stats.rpcs - rpcs,
                took,
            )
        )

    # Equal, alternating, then different.
    for summary in ["a", "a", "b", "a", "b", "b"]:
        check(summary)
    check(f"c{me}")  # different: found when the last arrives, long before the 60 s timeout
    check("a")  # equal again
    # Process 1 is late: process 0 stops waiting after 2 s; process 1 arrives after that.
    if me == 1:
        time.sleep(4.0)
    check("late", timeout=2.0)
    check("a")
    # Process 1 leaves the tag (a failure, an exit): process 0 is told at once.
    if me == 1:
        _agree.leave("test-check", "1:left")
    else:
        time.sleep(0.5)
        check("a")
    return seen


def fails_on_rank_1():
    import jax

    return 1 / (1 - jax.process_index())
