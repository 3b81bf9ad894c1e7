"""Programs compared when they are compiled (`meshkit._src.runtime.programs`).

In one process: the compilation hook sees every computation JAX compiles once (jit, shard_map,
pmap) and no cached call, and the messages name the first difference, checked against a plain
reference. In 2 processes x 4 CPU devices: raw `jax.jit` code whose processes pad their batches
to their own lengths, or trace a value of their own, raises a `DivergenceError` in every process
before the step runs; equal programs cost one agreement per compilation and none per call. In 8
processes: the one process that differs is named.
"""

from __future__ import annotations

import inspect
import json
import re
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ranks import programs as ranks

from meshkit._src.core import compat
from meshkit._src.runtime import programs
from meshkit.testing import launch_in_processes

pytestmark = pytest.mark.warm_cluster(num_processes=2, devices_per_process=4, timeout=120)

_FAST = {"MESHKIT_CHECK_TIMEOUT": "20"}


# ---- one process ---------------------------------------------------------------------------


def test_the_hook_sees_each_compilation_once_and_no_cached_call():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    seen = []
    remove = compat.on_compile(lambda c: seen.append((c.name, c.where(), c.args())))
    assert remove is not None
    try:
        mesh = jax.make_mesh((len(jax.devices()),), ("data",))
        x = jax.device_put(np.ones((8, 3), np.float32), NamedSharding(mesh, P("data")))

        @jax.jit
        def step(batch, w):
            return (batch["x"] * w).sum()

        for _ in range(3):
            step({"x": x}, 2.0)  # compiled once; the later calls are cached
        shard = jax.jit(
            jax.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        )
        shard(x).block_until_ready()
        shard(x).block_until_ready()
        jax.pmap(lambda v: v + 1)(jnp.ones((len(jax.devices()), 2)))
    finally:
        remove()
    names = [name for name, _, _ in seen]
    assert names.count("jit(step)") == 1, names
    assert sum(1 for n in names if n.startswith("jit(")) >= 2, names
    assert any("pmap" in n or n.startswith("jit(") for n in names[2:]), names
    _, where, args = next(s for s in seen if s[0] == "jit(step)")
    assert where is not None
    assert where.startswith("step at ")
    # JAX names the function's first line, its decorator.
    assert where == f"step at {__file__}:{_line_of('def step(batch, w)') - 1}"
    assert [a[0] for a in args] == ["batch['x']", "w"]
    assert args[0][1].startswith("float32[8")
    assert "over mesh(data=" in args[0][2]


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


def test_one_process_installs_nothing(monkeypatch):
    programs.install(1)
    assert not programs.installed()
    monkeypatch.setenv(programs.ENV_PROGRAM_CHECK, "0")
    programs.install(2)
    assert not programs.installed()


def test_a_bad_switch_is_named(monkeypatch):
    import meshkit

    monkeypatch.setenv(programs.ENV_PROGRAM_CHECK, "maybe")
    with pytest.raises(meshkit.MeshkitError, match="MESHKIT_PROGRAM_CHECK"):
        programs.install(2)


_TYPES = st.sampled_from(["float32[8,16]", "float32[8,24]", "int32[8,16]", "float32[]"])
_SHARDINGS = st.sampled_from(["P('data',) over mesh(data=8)", "P() over mesh(data=8)"])


@st.composite
def _records(draw):
    """Records of 2-5 processes: one shared argument list, some processes changed in one place."""
    n_args = draw(st.integers(1, 4))
    base = [[f"a{i}", draw(_TYPES), draw(_SHARDINGS)] for i in range(n_args)]
    n = draw(st.integers(2, 5))
    out = {}
    for p in range(n):
        args = [list(a) for a in base]
        if draw(st.booleans()):
            i, part = draw(st.integers(0, n_args - 1)), draw(st.sampled_from([1, 2]))
            args[i][part] = draw(_TYPES if part == 1 else _SHARDINGS)
        digest = json.dumps(args)  # equal arguments, equal programs (plus the inside case)
        out[p] = (
            {"name": "jit(step)", "where": "step at t.py:3", "digest": digest, "args": args},
            args,
        )
    return out


@given(_records())
def test_the_first_differing_argument_is_named(drawn):
    records = {p: r for p, (r, _) in drawn.items()}
    args = {p: a for p, (_, a) in drawn.items()}
    # The reference: scan arguments in order, type before sharding.
    want = None
    for i in range(len(args[0])):
        for part, label in ((1, "type"), (2, "sharding")):
            values = {p: a[i][part] for p, a in args.items()}
            if want is None and len(set(values.values())) > 1:
                want = (args[0][i][0], label, values)
    if want is None:
        return  # every process has the same program: no error is built
    error = programs._difference(records, 3)
    name, label, values = want
    assert error.field == name
    text = str(error)
    assert "as their 3rd computation across processes" in text
    assert f"The first argument that differs is {name}, its {label}: " in text
    for v in values.values():
        assert v in text
    groups: dict[str, list[int]] = {}
    for p, r in sorted(records.items()):
        groups.setdefault(r["digest"], []).append(p)
    largest = max(len(g) for g in groups.values())
    tops = [g for g in groups.values() if len(g) == largest]
    expected = sorted(p for g in groups.values() for p in g if len(tops) > 1 or g is not tops[0])
    assert error.processes == expected


def test_programs_that_differ_inside_are_named_as_such():
    records = {
        0: {"name": "jit(f)", "where": "f at t.py:1", "digest": "a"},
        1: {"name": "jit(f)", "where": "f at t.py:1", "digest": "b"},
    }
    error = programs._difference(records, 1)  # no arguments that differ
    assert error.field == "program"
    assert "Their arguments are the same: the computations differ inside" in str(error)
    assert "as their 1st computation" in str(error)


def test_different_functions_are_named_as_such():
    records = {
        0: {"name": "jit(f)", "where": "f at t.py:1", "digest": "a"},
        1: {
            "name": "jit(g)",
            "where": "g at t.py:5",
            "digest": "b",
            "args": [["x", "int32[]", "?"]],
        },
    }
    error = programs._difference(records, 2)
    assert error.field == "function"
    assert "  process 0: jit(f) (f at t.py:1)\n  process 1: jit(g) (g at t.py:5)" in str(error)


# ---- two processes (a warm cluster) --------------------------------------------------------


def _padded_to_own_length():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    length = 16 if jax.process_index() == 0 else 24  # each pads to its own longest sequence
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones((4, length), np.float32)
    )

    @jax.jit
    def step(batch):
        return batch.sum()

    try:
        return float(step(x))
    except meshkit.DivergenceError as e:
        return str(e), e.processes, e.field


def test_batches_padded_to_each_processs_own_length_are_named_before_the_step(warm_cluster):
    results = warm_cluster.run(_padded_to_own_length, env=_FAST)
    assert results[0] == results[1], results
    text, processes, field = results[0]
    assert processes == [0, 1]
    assert field == "batch"
    line = _line_of("def step(batch):") - 1  # JAX names the decorator's line
    assert text.startswith(
        "meshkit (programs compared at compilation): the processes compiled different programs "
        "as their "
    ), text
    # The function, where it is defined, and the line of the user's code that ran it.
    ran = f"run at {__file__}:{_line_of('return float(step(x))')} in _padded_to_own_length"
    assert f"  process 0: jit(step) (step at {__file__}:{line}), {ran}\n" in text, text
    assert f"  process 1: jit(step) (step at {__file__}:{line}), {ran}\n" in text, text
    assert (
        "The first argument that differs is batch, its type: process 0: float32[8@data,16]; "
        "process 1: float32[8@data,24]."
        in text
        or "The first argument that differs is batch, its type: process 0: float32[8,16]; "
        "process 1: float32[8,24]."
        in text
    ), text
    assert "Consider sizes fixed for every process" in text, text
    assert "MESHKIT_PROGRAM_CHECK" not in text, text


def _traced_process_index():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshkit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P("data")))
    scale = float(jax.process_index() + 1)  # a Python value of this process, traced in

    @jax.jit
    def step(v):
        return (v * scale).sum()

    try:
        return float(step(x))
    except meshkit.DivergenceError as e:
        return str(e).split("\n")[3], e.field


def test_a_value_of_one_process_traced_into_the_program_is_named(warm_cluster):
    results = warm_cluster.run(_traced_process_index, env=_FAST)
    assert results[0] == results[1], results
    assert results[0] == (
        "Their arguments are the same: the computations differ inside (a constant, a shape or a "
        "branch traced from a value that differs between processes, such as "
        "jax.process_index() or one process's own data).",
        "program",
    )


def _equal_programs():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshkit._src.coord import agree

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
    stats = agree.node().stats

    @jax.jit
    def step(v, k):
        return (v * k).sum()

    before = stats.agreements
    first = float(step(x, 2.0))  # compiled: one agreement
    after_compile = stats.agreements
    start = time.perf_counter()
    for k in range(50):
        step(x, float(k)).block_until_ready()  # cached: none
    per_call = (time.perf_counter() - start) / 50
    return first, after_compile - before, stats.agreements - after_compile, per_call


def test_equal_programs_agree_once_per_compilation_and_never_per_call(warm_cluster):
    results = warm_cluster.run(_equal_programs, env=_FAST)
    for first, at_compile, per_calls, per_call in results:
        assert first == 2 * sum(range(16))
        assert at_compile == 1
        assert per_calls == 0
        assert per_call < 1.0


# ---- fresh processes -----------------------------------------------------------------------


def test_the_one_process_of_eight_whose_program_differs_is_named():
    start = time.monotonic()
    result = launch_in_processes(
        ranks.one_of_eight_differs, num_processes=8, devices_per_process=1, timeout=120, env=_FAST
    )
    took = time.monotonic() - start
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert not result.timed_out, text
    assert "meshkit.DivergenceError: meshkit (programs compared at compilation)" in text, text
    assert "  processes 0,1,2,3,4,6,7: jit(<lambda>)" in text, text
    assert "  process 5: jit(<lambda>)" in text, text
    # Each process's rows, times 8: process 5's 3 rows make a global batch of 24.
    assert re.search(
        r"The first argument that differs is v, its type: processes 0,1,2,3,4,6,7: "
        r"float32\[16(@data)?,2\]; process 5: float32\[24(@data)?,2\]\.",
        text,
    ), text
    assert "The evidence points to rank 5" in result.report, result.report
    assert took < 90, text


def test_a_computation_one_process_runs_alone_is_named_when_the_other_ends():
    start = time.monotonic()
    result = launch_in_processes(
        ranks.only_process_0_computes, devices_per_process=1, timeout=120, env=_FAST
    )
    took = time.monotonic() - start
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode == 0, text
    first, processes, field, waited = result.values[0]
    assert first.startswith(
        "meshkit (programs compared at compilation): this process compiled jit(<lambda>) ("
    ), first
    assert first.endswith(
        "as its 1st computation across processes, and process 1 left the program (it ended or "
        "failed) without it."
    ), first
    # One process on each side: both are named (no majority says which is wrong).
    assert (processes, field) == ([0, 1], "arrival")
    assert result.values[1] == "ended"
    # Told when process 1 left, not after the 20 s check timeout (nor gloo's 30 s).
    assert waited < 10, (waited, text)
    assert took < 60, text


@pytest.mark.waits  # until the cycle's probes find it, seconds apart
def test_processes_waiting_at_different_agreements_are_named_with_both_places():
    # Process 0 waits at the first compilation of a program in step 2, process 1 in step 3 of
    # its global_batches, in that step's sum, which waits for process 0: process 0 finds the
    # cycle at its probes once process 1's watch has posted where it is (it stayed in step 3),
    # raises it, and tells process 1, which is ended with the same error.
    result = launch_in_processes(ranks.waits_at_different_agreements, timeout=120, env=_FAST)
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    source, first = inspect.getsourcelines(ranks.waits_at_different_agreements)
    line = {mark: first + next(i for i, t in enumerate(source) if f"# {mark}" in t)
            for mark in ("process 0", "process 1")}  # fmt: skip
    # A path as the rank shows it: relative to its working directory, or whole.
    file = r"\S*tests/ranks/programs\.py"
    where = file + r":{} in waits_at_different_agreements"
    expected = (
        r"meshkit: the processes wait at different agreements of their main thread, and none "
        rf"can go on: process 0 at {where.format(line['process 0'])} \(the first compilation "
        rf"of jit\(<lambda>\) \(<lambda> at {file}:{line['process 0']}\)\); process 1 at "
        rf"{where.format(line['process 1'])} \(step 3 of meshkit\.global_batches\)\."
    )
    message, processes, field, waited = result.values[0]
    assert re.fullmatch(expected, message), message
    assert (processes, field) == ([0, 1], "order"), (processes, field)
    assert waited < 10, (waited, text)  # not the 20 s check timeout
    said = result.ranks[1].stderr
    assert re.search(expected, said), said
    assert "meshkit: process 1 stops inside step 3 of meshkit.global_batches: the other " in said


def _assert_verdict_cycle(result, target, call):
    """Both processes raised the cycle: process 0 compiling, process 1 at ``call``'s verdict."""
    text = result.report + "\n" + "\n".join(r.stderr for r in result.ranks)
    line = {}
    for fn, mark in ((ranks._compiles_while_process_1_waits, "# process 0"), (target, "# 1")):
        source, first = inspect.getsourcelines(fn)
        line[mark] = first + next(i for i, t in enumerate(source) if t.rstrip().endswith(mark))
    file = r"\S*tests/ranks/programs\.py"
    expected = (
        r"meshkit: the processes wait at different agreements of their main thread, and none "
        rf"can go on: process 0 at {file}:{line['# process 0']} in "
        r"_compiles_while_process_1_waits \(the first compilation of jit\(<lambda>\) "
        rf"\(<lambda> at {file}:{line['# process 0']}\)\); process 1 at {file}:{line['# 1']} "
        rf"in verdict \({re.escape(call)}\)\."
    )
    for message, processes, field, waited in result.values:
        assert re.fullmatch(expected, message), (message, text)
        assert (processes, field) == ([0, 1], "order"), (processes, field)
        assert waited < 10, (waited, text)  # at the probes, not after the 20 s check timeout
    return text


def test_a_call_at_its_agreement_meets_a_compilation_at_the_same_one():
    # Process 0 waits at the first compilation of a program, process 1 at the agreement of a
    # global_array_from_local call: the same agreement of the main thread's sequence, at two
    # different sites, so both raise at once.
    result = launch_in_processes(ranks.waits_at_a_verdict, timeout=120, env=_FAST)
    text = _assert_verdict_cycle(
        result, ranks.waits_at_a_verdict, "meshkit.global_array_from_local"
    )
    assert result.returncode == 0, text


def test_a_debug_mode_check_meets_a_compilation_at_the_same_agreement():
    # As above, with debug mode's check of an spmd call, agreed on before the call runs.
    result = launch_in_processes(
        ranks.waits_at_a_debug_verdict, timeout=120, env={**_FAST, "MESHKIT_DEBUG": "1"}
    )
    _assert_verdict_cycle(result, ranks.waits_at_a_debug_verdict, "call #1 of <lambda>, debug mode")


def test_the_switch_turns_the_comparison_off():
    result = launch_in_processes(
        ranks.switched_off, env={"MESHKIT_PROGRAM_CHECK": "0"}, devices_per_process=1, timeout=90
    )
    assert result.returncode == 0, result.report
    assert result.values == [False, False]
