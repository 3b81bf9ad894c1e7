"""meshkit.debug in one process (switches, fingerprints, the comparison) and barrier in two.

What the fresh processes run is in `ranks/debug.py`; the warm cluster runs its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from ranks import debug as ranks

import meshkit
from meshkit import debug
from meshkit._src.debug import divergence as _divergence
from meshkit._src.lifecycle import exit as _exit
from meshkit._src.runtime import dispatch as _dispatch
from meshkit.testing import launch_in_processes, run_in_processes


@pytest.fixture(autouse=True)
def _debug_off():
    yield
    debug.disable()


def test_enable_disable_and_settings():
    assert not debug.enabled()
    debug.enable(timeout=30, watchdog=None)
    assert debug.settings() == debug.Settings(30.0, None, True)
    debug.enable(timeout=10)  # watchdog "auto": half the timeout
    assert debug.settings().watchdog == 5.0
    debug.disable()
    assert debug.settings() is None
    with debug.debugging(timeout=4, watchdog=0):
        assert debug.settings() == debug.Settings(4.0, None, True)
    assert not debug.enabled()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 0}, "timeout must be a finite positive number of seconds; got 0"),
        ({"timeout": -1.5}, "timeout must be a finite positive number of seconds; got -1.5"),
        ({"timeout": True}, "timeout must be a finite positive number of seconds; got True"),
        ({"watchdog": "soon"}, "watchdog must be a finite positive number of seconds; got 'soon'"),
        ({"watchdog": -2}, "watchdog must be a finite positive number of seconds; got -2"),
        ({"timeout": float("nan")}, "timeout must be a finite positive number of seconds; got nan"),
        (
            {"watchdog": float("inf")},
            "watchdog must be a finite positive number of seconds; got inf",
        ),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(meshkit.MeshkitError, match=message):
        debug.enable(**kwargs)
    assert not debug.enabled()


def test_environment(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "0")
    debug.enable_from_environment()
    assert not debug.enabled()
    monkeypatch.setenv("MESHKIT_DEBUG", "1")
    monkeypatch.setenv("MESHKIT_DEBUG_TIMEOUT", "12")
    monkeypatch.setenv("MESHKIT_WATCHDOG", "0")
    debug.enable_from_environment()
    assert debug.settings() == debug.Settings(12.0, None, True)
    debug.disable()
    monkeypatch.setenv("MESHKIT_DEBUG_TIMEOUT", "soon")
    with pytest.raises(meshkit.MeshkitError, match="MESHKIT_DEBUG_TIMEOUT='soon' is not a number"):
        debug.enable_from_environment()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "MESHKIT_DEBUG",
            "maybe",
            "MESHKIT_DEBUG='maybe' is not one of 1, true, yes, on (debug mode on) or empty, 0, "
            "false, no, off (off).",
        ),
        (
            "MESHKIT_DEBUG_TIMEOUT",
            "nan",
            "MESHKIT_DEBUG_TIMEOUT='nan' must be a finite number of seconds > 0.",
        ),
        ("MESHKIT_DEBUG_TIMEOUT", "0", "MESHKIT_DEBUG_TIMEOUT='0' must be a finite number"),
        (
            "MESHKIT_WATCHDOG",
            "inf",
            "MESHKIT_WATCHDOG='inf' must be a finite number of seconds > 0 (0: off).",
        ),
        ("MESHKIT_WATCHDOG", "-1", "MESHKIT_WATCHDOG='-1' must be a finite number"),
    ],
)
def test_bad_environment_values_name_the_variable_and_the_accepted_values(
    monkeypatch, name, value, message
):
    monkeypatch.setenv("MESHKIT_DEBUG", "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(meshkit.MeshkitError) as info:
        debug.enable_from_environment()
    assert str(info.value).startswith(message), info.value
    assert not debug.enabled()


def test_debug_mode_installs_no_hook(monkeypatch):
    # The record a process leaves at exit is coordination's (it names debug mode's last call).
    monkeypatch.setattr(_exit, "_registry", _exit._Registry())
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    hook = sys.excepthook
    debug.enable(timeout=5, watchdog=None)
    debug.disable()
    assert sys.excepthook is hook
    assert not _exit._registry.exit
    assert _exit._registry.exception is None


def test_debug_mode_says_once_that_it_is_on_and_how(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="meshkit")
    monkeypatch.setattr(_divergence.state, "announced", None)
    debug.enable(timeout=30, watchdog=None)
    debug.disable()
    debug.enable(timeout=30, watchdog=None)  # the same settings again: said already
    debug.enable(timeout=8, watchdog=2, exit_on_stall=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "meshkit.debug"]
    assert lines == [
        "meshkit debug: on in this process: timeout 30 s, watchdog off, exit_on_stall True "
        "(meshkit.debug.enable sets them).",
        "meshkit debug: on in this process: timeout 8 s, watchdog 2 s, exit_on_stall False "
        "(meshkit.debug.enable sets them).",
    ]


_ENTRY = """
import threading
import meshkit
print(meshkit.debug.enabled(), sorted(t.name for t in threading.enumerate()))
try:
    {call}
except meshkit.MeshkitError as e:
    print("raised:", e)
print(meshkit.debug.enabled(), meshkit._src.debug.divergence.state.count)
"""
_FIRST = 'meshkit.make_mesh({"data": -1})'
_INIT = "meshkit.init()"


@pytest.mark.parametrize(
    ("call", "env", "lines"),
    [
        # Read at the first SPMD call, whose check it then makes...
        (_FIRST, {"MESHKIT_DEBUG_TIMEOUT": "30"}, ["False ['MainThread']", "True 1"]),
        (
            _FIRST,
            {"MESHKIT_DEBUG_TIMEOUT": "soon"},
            [
                "False ['MainThread']",
                "raised: MESHKIT_DEBUG_TIMEOUT='soon' is not a number of seconds.",
                "False 0",
            ],
        ),
        # ... or at init, whichever comes first; never at import.
        (_INIT, {}, ["False ['MainThread']", "True 0"]),
        (
            _INIT,
            {"MESHKIT_DEBUG": "sometimes"},
            [
                "False ['MainThread']",
                "raised: MESHKIT_DEBUG='sometimes' is not one of 1, true, yes, on (debug mode on) "
                "or empty, 0, false, no, off (off).",
                "False 0",
            ],
        ),
    ],
)
def test_the_environment_is_read_at_init_or_the_first_call_not_at_import(call, env, lines):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    clean.update({"JAX_PLATFORMS": "cpu", "MESHKIT_DEBUG": "1", **env})
    out = subprocess.run(
        [sys.executable, "-c", _ENTRY.format(call=call)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.splitlines() == lines, out.stderr


def test_single_process_calls_run_and_are_counted():
    mesh = meshkit.make_mesh({"data": 8})
    f = meshkit.spmd(lambda x: x * 2, mesh=mesh, in_specs="data", out_specs="data")
    seen = []
    with (
        _dispatch.observing(lambda site, args: seen.append(site.kind)),
        debug.debugging(timeout=5, watchdog=None),
    ):
        out = f(np.arange(8.0))
        meshkit.make_mesh({"data": 8})
    np.testing.assert_array_equal(out, np.arange(8.0) * 2)
    assert seen == ["spmd", "make_mesh"]


def test_calls_are_checked_only_while_debug_mode_is_on():
    site = _dispatch.CallSite("spmd", "f")
    observers = list(_dispatch.observers)
    before = _divergence.state.count
    _dispatch.enter(site, (1,))
    assert _divergence.state.count == before
    with debug.debugging(timeout=5, watchdog=None):
        _dispatch.enter(site, (1,))
        assert _divergence.state.count == before + 1
        assert _dispatch.observers == observers  # debug mode registers no observer
    _dispatch.enter(site, (1,))
    assert _divergence.state.count == before + 1


# ---- fingerprints and the comparison, without processes -----------------------------------


def _record(site, args, count=1):
    return json.loads(json.dumps(_divergence.fingerprint(site, args, count)))


def _site(name="train_step", **info):
    site = _dispatch.CallSite("spmd", name, info={"params": ("params", "batch"), **info})
    site.calls = 57
    return site


def test_fingerprint_names_arguments_shapes_and_shardings():
    mesh = meshkit.make_mesh({"data": 8})
    sharded = jax.device_put(jnp.zeros((8, 2)), jax.sharding.NamedSharding(mesh, jax.P("data")))
    record = _record(_site(), ({"w": sharded}, {"image": np.zeros((32, 3), np.float32)}, 2.0))
    assert record["leaves"] == [
        {"name": "params['w']", "text": "float32[8,2] sharded ('data',) over {'data': 8}"},
        {"name": "batch['image']", "text": "float32[32,3]"},
        {"name": "argument 2", "text": "float"},
    ]
    assert record["n"] == 57
    assert record["where"].startswith("tests/test_debug.py:") or "test_debug.py:" in record["where"]


def test_issue_example_message():
    site = _site()
    good = _record(site, (1, {"image": np.zeros((32, 224, 224, 3), np.float32)}))
    bad = _record(site, (1, {"image": np.zeros((30, 224, 224, 3), np.float32)}))
    records = {0: good, 1: bad, 2: good, 3: good}
    with pytest.raises(meshkit.DivergenceError) as info:
        _divergence.compare(records, [], 0, "call #57 of train_step", 5.0, {})
    assert (
        "call #57 of train_step: process 1 passed batch['image'] float32[30,224,224,3]; "
        "processes 0,2,3 passed float32[32,224,224,3]." in str(info.value)
    )
    assert info.value.processes == [1]
    assert info.value.field == "batch['image']"


def test_static_arguments_and_ragged_leading_axis():
    site = _site(static_argnums=(0,))
    with pytest.raises(meshkit.DivergenceError, match=r"process 1 passed params static 'adam'"):
        _divergence.compare(
            {0: _record(site, ("sgd", 1)), 1: _record(site, ("adam", 1)), 2: _record(site, ("sgd", 1))},
            [], 0, "call #57 of train_step", 5.0, {},
        )  # fmt: skip
    ragged = _site(ragged=True)
    a, b = _record(ragged, (np.zeros((30, 3)),)), _record(ragged, (np.zeros((32, 3)),))
    _divergence.compare({0: a, 1: b}, [], 0, "x", 5.0, {})  # padded loaders may differ


def test_processes_that_left_are_named():
    site = _site()
    here = _record(site, (1,))
    gone = {"status": "exit", "last": "call #56 of train_step (spmd) at train.py:40"}
    with pytest.raises(meshkit.DivergenceError, match=r"process 1 ended its program \(normal exit\) "
                       r"after call #56 of train_step \(spmd\) at train.py:40") as info:  # fmt: skip
        _divergence.compare({0: here, 1: gone}, [], 0, "call #57 of train_step", 5.0, {})
    assert info.value.processes == [1]
    failed = {"status": "error", "last": "call #3 of f", "message": "ValueError: bad batch"}
    with pytest.raises(meshkit.DivergenceError, match="process 1 failed after call #3 of f: "
                       "ValueError: bad batch"):  # fmt: skip
        _divergence.compare({0: here, 1: failed}, [], 0, "call #57 of train_step", 5.0, {})


def test_a_missing_process_is_named_with_the_last_call_this_thread_made():
    site = _site()
    last = _record(site, (1,))
    text = _divergence.last_text(last)
    assert text.startswith("its last call was #57 of train_step at "), text
    # A thread's first call: there is no earlier call.
    assert _divergence.last_text({}) == "it made no meshkit call checked in debug mode"


_shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
_dtypes = st.sampled_from([np.float32, np.int32, np.bool_, np.float16])


@given(
    st.lists(st.tuples(_shapes, _dtypes), min_size=1, max_size=4),
    st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 3), _shapes, _dtypes)), min_size=2,
             max_size=5),
)  # fmt: skip
def test_comparison_against_a_direct_reference(base, changes):
    """Raises iff some process's arguments differ, naming exactly the minority processes."""
    site = _site()
    per_process = []
    for change in changes:
        leaves = list(base)
        if change is not None:
            i, shape, dtype = change
            leaves[i % len(leaves)] = (shape, dtype)
        per_process.append(leaves)
    records = {
        p: _record(site, (tuple(np.zeros(s, d) for s, d in leaves),))
        for p, leaves in enumerate(per_process)
    }
    # Reference: the first leaf position where the processes' (shape, dtype) differ.
    first = next(
        (i for i in range(len(base))
         if len({(tuple(lv[i][0]), np.dtype(lv[i][1])) for lv in per_process}) > 1),
        None,
    )  # fmt: skip
    if first is None:
        _divergence.compare(records, [], 0, "call", 1.0, {})
        return
    with pytest.raises(meshkit.DivergenceError) as info:
        _divergence.compare(records, [], 0, "call", 1.0, {})
    groups: dict[tuple, list[int]] = {}
    for p, lv in enumerate(per_process):
        groups.setdefault((tuple(lv[first][0]), np.dtype(lv[first][1])), []).append(p)
    sizes = sorted((len(ps) for ps in groups.values()), reverse=True)
    if sizes[0] > sizes[1]:  # a majority: the others are named
        majority = max(groups.values(), key=len)
        expected = sorted(p for p in range(len(per_process)) if p not in majority)
    else:
        expected = list(range(len(per_process)))
    assert info.value.processes == expected
    assert info.value.field == f"params[{first}]"


# ---- barrier -----------------------------------------------------------------------------


# ---- jax.experimental.multihost_utils in debug mode ---------------------------------------


_MULTIHOST = ("process_allgather", "broadcast_one_to_all", "sync_global_devices", "assert_equal")


def test_multihost_utils_are_checked_only_while_debug_mode_is_on():
    from jax.experimental import multihost_utils as mu

    jax_own = {name: getattr(mu, name) for name in _MULTIHOST}
    with debug.debugging(timeout=5, watchdog=None):
        before = _divergence.state.count
        debug.sync_global_devices("saved")  # JAX's calls assert_equal, then process_allgather
        line = sys._getframe().f_lineno - 1
        assert _divergence.state.count == before + 1  # the call made, not those inside it
        assert _divergence.state.last == (
            "call #1 of jax.experimental.multihost_utils.sync_global_devices (multihost_utils) "
            f"at tests/test_debug.py:{line} in "
            "test_multihost_utils_are_checked_only_while_debug_mode_is_on"
        ), _divergence.state.last
        assert {name: getattr(mu, name) for name in _MULTIHOST} == jax_own  # JAX's, unchanged
    before = _divergence.state.count
    debug.sync_global_devices("unchecked")
    assert _divergence.state.count == before


def test_multihost_utils_from_an_unnamed_thread_run_unchecked():
    import threading

    out = []
    with debug.debugging(timeout=5, watchdog=None):
        before = _divergence.state.count
        worker = threading.Thread(target=lambda: out.append(debug.process_allgather(np.ones(3))))
        worker.start()
        worker.join()
        assert _divergence.state.count == before
        with meshkit.channel("metrics"):  # a named channel pairs up: checked
            debug.process_allgather(np.ones(3))
        assert _divergence.state.count == before + 1
    np.testing.assert_array_equal(out[0], np.ones((1, 3)))


@given(
    _shapes, _dtypes, st.booleans(), st.sampled_from(["process_allgather", "broadcast_one_to_all"])
)
def test_checked_multihost_utils_give_jax_s_answers(shape, dtype, tiled, name):
    """In one process: the checked helpers return what JAX's return (numpy's reference too)."""
    from jax.experimental import multihost_utils as mu

    x = (np.arange(math.prod(shape)) % 7).astype(dtype).reshape(shape)
    expected = x if tiled or name == "broadcast_one_to_all" else x[None]
    call = (lambda f: f(x, tiled=tiled)) if name == "process_allgather" else (lambda f: f(x))
    with debug.debugging(timeout=5, watchdog=None):
        out = call(getattr(debug, name))
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert np.asarray(out).dtype == np.asarray(call(getattr(mu, name))).dtype


def test_barrier_bad_arguments():
    with pytest.raises(meshkit.MeshkitError, match="name must be a non-empty string; got ''"):
        meshkit.barrier("")
    with pytest.raises(
        meshkit.MeshkitError, match="timeout must be a finite positive number of seconds"
    ):
        meshkit.barrier("x", timeout=0)
    meshkit.barrier("single process returns at once", timeout=1)


@pytest.mark.multiprocess
def test_barrier_in_two_processes(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)
    times = run_in_processes(ranks.barrier_meets, devices_per_process=1)
    late = times[1][0]
    assert all(passed >= late for _, passed in times), times  # process 0 waited for the late one
    result = launch_in_processes(ranks.barrier_missing, devices_per_process=1, timeout=60)
    early, late = result.values
    assert early is not None, result.report
    assert (
        "meshkit.barrier('checkpoint written'): process 1 did not arrive within 2 s (use #1 of "
        "this barrier); this process (process 0) did." in early
    ), early
    # The late one fails too, instead of passing a barrier the other gave up on.
    assert (
        "meshkit.barrier('checkpoint written'): this process (process 1) arrived after process "
        "0 stopped waiting (after 2 s) at use #1 of this barrier." in late
    ), late


def test_barrier_names_that_look_alike_are_different_barriers():
    # Each process waits at its own barrier for the other: named at once, as processes waiting
    # at different agreements, before the barrier's 2 s timeout.
    values = run_in_processes(ranks.names_that_look_alike, devices_per_process=1)
    where = r"\S*tests/ranks/debug\.py:\d+ in names_that_look_alike"
    expected = (
        r"meshkit: the processes wait at different agreements of their main thread, and none "
        rf"can go on: process 0 at {where} \(meshkit\.barrier\('ckpt/a'\)\); process 1 at "
        rf"{where} \(meshkit\.barrier\('ckpt_a'\)\)\."
    )
    assert all(re.fullmatch(expected, v) for v in values), values


@given(st.text(max_size=12), st.text(max_size=12))
def test_tag_parts_of_distinct_names_are_distinct(a, b):
    from meshkit._src.coord import agree as _agree

    assert (_agree.tag_part(a) == _agree.tag_part(b)) == (a == b)
    assert "/" not in _agree.tag_part(a)


def _each_call_is_agreed_before_it_runs():
    import jax
    import numpy as np

    import meshkit
    from meshkit import debug
    from meshkit._src.coord import agree as _agree

    mesh = meshkit.make_mesh({"data": -1})
    double = meshkit.spmd(lambda x: x * 2, mesh=mesh, in_specs="data", out_specs="data")
    batch = np.ones((8, 2), np.float32)
    x = meshkit.global_array_from_local(batch, mesh, "data", check=False)
    meshkit.debug.enable(timeout=20, watchdog=None)

    def round_trips(step, calls=240):
        meshkit.barrier("steady")
        for _ in range(2 * debug.PERIOD):  # the first calls of a pattern post their records
            step()
        rpcs = _agree.stats.rpcs
        for _ in range(calls):  # repeats: each agreed on in the call, unflagged
            step()
        cost = (_agree.stats.rpcs - rpcs) / calls
        meshkit.barrier("steady done")
        return cost

    # A loop of one step, then a loop of a batch and a step (period 2).
    costs = [
        round_trips(lambda: jax.block_until_ready(double(x))),
        round_trips(
            lambda: jax.block_until_ready(
                double(meshkit.global_array_from_local(batch, mesh, "data", check=False))
            )
        ),
    ]
    # Process 1 changes shape; process 0 repeats its call.
    rows = 16 if jax.process_index() == 1 else 8
    y = meshkit.global_array_from_local(np.ones((rows, 2), np.float32), mesh, "data", check=False)
    try:
        double(y)
    except meshkit.DivergenceError as e:
        return costs, "at the call", str(e)
    try:
        meshkit.barrier("after")  # the next meshkit call raises what was found meanwhile
    except meshkit.DivergenceError as e:
        return costs, "at the next call", str(e)
    return costs, "never", ""


@pytest.mark.multiprocess
def test_each_call_is_one_agreement_and_a_change_stops_before_it_runs(warm_cluster):
    results = warm_cluster.run(_each_call_is_agreed_before_it_runs, timeout=120)
    (costs0, where0, message0), (costs1, where1, message1) = results
    # A repeated call: one wait at the service's barrier; the second loop checks two calls per
    # step (the batch and the step).
    for one, two in (costs0, costs1):
        assert 0.9 <= one <= 1.1, results
        assert 1.9 <= two <= 2.1, results
    # Both processes raise in the call where they differ, before it runs.
    assert where0 == where1 == "at the call", results
    for message in (message0, message1):
        assert re.search(r"call #\d+ of <lambda>: process 0 passed x float32\[16,2\]", message)
        assert "process 1 passed float32[32,2]" in message, message


def _multihost_utils_checked_in_two_processes():
    import jax
    import numpy as np

    import meshkit
    from meshkit import debug as mu  # the checked versions of multihost_utils' collectives

    me = jax.process_index()
    found = {}
    with meshkit.debug.debugging(timeout=20, watchdog=None):
        # Calls that agree run, and give JAX's answers.
        gathered = mu.process_allgather(np.full((2, 3), me, np.float32))
        sent = mu.broadcast_one_to_all(np.full((3,), me + 5, np.int32))
        mu.sync_global_devices("agreed")
        mu.assert_equal(np.arange(4))
        found["ran"] = np.asarray(gathered).tolist(), np.asarray(sent).tolist()
        cases = {
            "shape": lambda: mu.process_allgather(np.zeros((2 + me, 3), np.float32)),
            "name": lambda: mu.sync_global_devices(f"after step {100 + me}"),
            "function": lambda: (
                mu.process_allgather(np.ones(3)) if me == 0 else mu.broadcast_one_to_all(np.ones(3))
            ),
        }
        for case, call in cases.items():
            try:
                call()
                found[case] = "ran"
            except meshkit.DivergenceError as e:
                found[case] = str(e), e.processes, e.field
    return found


@pytest.mark.multiprocess
def test_multihost_utils_that_differ_are_named_before_they_run(warm_cluster):
    results = warm_cluster.run(_multihost_utils_checked_in_two_processes, timeout=120)
    prefix = "jax.experimental.multihost_utils."
    expected = {  # each case: what the message says differs, and the field
        "shape": (
            f"call #2 of {prefix}process_allgather: process 0 passed in_tree float32[2,3]; "
            "process 1 passed float32[3,3].",
            "in_tree",
        ),
        "name": (
            f"call #2 of {prefix}sync_global_devices: process 0 passed name static 'after step "
            "100'; process 1 passed static 'after step 101'.",
            "name",
        ),
        "function": (
            f"process 0 called {prefix}process_allgather (multihost_utils); process 1 called "
            f"{prefix}broadcast_one_to_all (multihost_utils).",
            "entry",
        ),
    }
    for found in results:
        # The calls that agree ran and gave JAX's answers: the gathered blocks, process 0's value.
        assert found["ran"] == ([[[0.0] * 3] * 2, [[1.0] * 3] * 2], [5, 5, 5]), found
        for case, (says, field) in expected.items():
            assert found[case] != "ran", (case, found)  # raised in both, before it ran
            message, processes, raised_field = found[case]
            assert says in message.splitlines()[0], (case, message)
            assert "test_debug.py:" in message, message  # each process's line of the call
            assert (processes, raised_field) == ([0, 1], field), (case, message)
    assert results[0] == results[1]  # the same error in both processes
