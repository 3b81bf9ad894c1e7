"""Failures that end in JAX's own cross-process timeouts get meshkit's explanation.

The texts below are what JAX 0.10 and 0.12 print on CPU (gloo) when a computation is run by one
process only, and what the other process prints when the coordination service goes away.
"""

from __future__ import annotations

import time

import pytest

import meshkit
from meshkit._src.core import events as _events
from meshkit._src.core.events import Event
from meshkit._src.launch import rank_events
from meshkit._src.launch import report as _report
from meshkit._src.launch.report import RankResult, Told
from meshkit.testing._forks import starter

GLOO = (
    "jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: "
    "GetKeyValue() timed out with key: cpu:gloo/0,1,2,3,2048,2049,2050,2051/4 and duration: "
    "29.99999997s [type.googleapis.com/tensorflow.CoordinationServiceError='']"
)
FATAL = (
    "F1124 09:25:54.339734   14804 client.h:86] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died; see the "
    "other task logs for more details."
)
STREAM = "JaxRuntimeError: UNAVAILABLE: Stream removed (Socket closed)"


@pytest.mark.parametrize(
    ("text", "kind", "system"),
    [
        (GLOO, "timeout", "gloo"),
        (FATAL, "lost", "the coordination service"),
        (STREAM, "lost", "the coordination service"),
        ("Barrier timed out. Id: shutdown", "timeout", "the coordination service"),
        ("NCCL operation ncclAllReduce timed out after 600 s", "timeout", "NCCL"),
        ("NCCL error: remote process exited or there was a network error", "lost", "NCCL"),
    ],
)
def test_known_failures_are_recognised(text, kind, system):
    found = _events.diagnose("Traceback (most recent call last):\n  ...\n" + text)
    assert found is not None
    assert (found.kind, found.system, found.line) == (kind, system, text)


def test_meshkits_own_notice_names_the_process():
    # What meshkit's failure watch knows is a `failed` event, not its sentence.
    found = rank_events.from_event(
        {"cause": "peer", "process": 3, "system": "meshkit", "error": "KeyError"}
    )
    assert found is not None
    assert (found.kind, found.system, found.process) == ("lost", "meshkit", 3)


@pytest.mark.parametrize(
    ("text", "process"),
    [
        ("meshkit.barrier('x'): process 1 did not arrive within 8 s (use #1 of this barrier)", 1),
        ("DivergenceError: meshkit debug: call #3 of step (spmd at t.py:9): processes 2,5 did "
         "not arrive within 8 s (its last call was #2 of step)", 2),
        ("meshkit.global_batches: process 0 did not ask for step 3 within 120 s", 0),
        ("meshkit.gather: process 3 did not call gather within 120 s", 3),
    ],
)  # fmt: skip
def test_meshkits_own_checks_name_the_process_they_waited_for(text, process):
    # The rank records whom it waited for; its message is for people and is not read.
    found = rank_events.from_event({"cause": "timeout", "system": "meshkit", "process": process})
    assert found is not None
    assert (found.kind, found.system, found.process) == ("timeout", "meshkit", process)
    assert _events.diagnose(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "meshkit: process 3 failed: KeyError: 'shard-17'\nProcess 1 stops",
        "meshkit: lost the coordination service, which process 0 hosts.",
    ],
)
def test_meshkits_own_sentences_are_not_read(text):
    # Only JAX's, gloo's and NCCL's words are: meshkit's own findings come as events.
    assert _events.diagnose(text) is None


def test_an_event_of_an_error_of_its_own_is_no_diagnosis():
    assert rank_events.from_event({"cause": "exception", "error": "ValueError"}) is None
    assert rank_events.from_event({"cause": "signal", "error": "SIGTERM"}) is None
    gloo = rank_events.from_event(
        {"cause": "timeout", "system": "gloo", "error": "JaxRuntimeError"}
    )
    assert gloo is not None
    assert (gloo.kind, gloo.system, gloo.process) == ("timeout", "gloo", None)


def test_other_errors_are_not():
    assert _events.diagnose("ValueError: shapes (3,) and (4,) do not match") is None


def test_the_explanation_names_the_usual_causes_and_the_next_step():
    text = _events.explain(_events.diagnose(GLOO))
    assert text.startswith(
        "meshkit: this error is a timeout of gloo: this process waited for another process "
        "that never joined.\nUsual causes: a computation or collective run by only some "
        "processes"
    )
    assert "MESHKIT_DEBUG=1" in text


def _rank(rank, code, stderr="", *, stopped=False, ended=False):
    return RankResult(rank, code, "", stderr, stopped, stderr, 0, ended)


def _event(rank, kind, **fields):
    return Event(rank, kind, 0.0, fields)


def test_the_launcher_names_the_rank_that_waited_in_a_computation_the_others_never_joined():
    # Rank 1 ended its program and died when the coordinator went away, before rank 0's
    # timeout was seen: the first to fail is not the cause.
    results = [_rank(0, 1, GLOO), _rank(1, -6, FATAL, ended=True)]
    report = _report.root_cause(results[1], results, 31.0, Told.of([_event(1, "ended")]))
    assert report.startswith(
        "meshkit launch: rank 1 failed first (killed by SIGABRT) after 31.0 s.\n"
        "Its error is a lost connection reported by the coordination service (another rank is "
        "gone); it failed because of another rank.\n"
        "The evidence points to rank 0: it waited for other ranks in gloo until a timeout, in "
        "a computation or collective they never joined.\n"
        "Rank 1 reached the end of the program meanwhile.\n"
        "Usual causes:"
    ), report
    assert "--- root cause: rank 0 ---" in report
    assert "--- first to fail: rank 1 ---" in report


def test_an_error_of_its_own_outranks_a_timeout():
    results = [_rank(0, 1, GLOO), _rank(1, 1, "KeyError: 'shard-17'"), _rank(2, 0)]
    report = _report.root_cause(results[0], results, 12.0, Told.of([_event(2, "ended")]))
    assert "The evidence points to rank 1: it failed with its own error." in report
    assert "Rank 2 reached the end of the program meanwhile." in report
    assert "--- root cause: rank 1 ---\n  | KeyError: 'shard-17'" in report


def test_a_rank_that_a_meshkit_check_waited_for_is_the_root_cause():
    missing = "meshkit.barrier('x'): process 1 did not arrive within 8 s (use #1 of this barrier)"
    results = [_rank(0, 1, missing), _rank(1, -15, "", stopped=True)]
    told = Told.of(
        [_event(0, "failed", cause="timeout", system="meshkit", process=1, error="MeshkitError")]
    )
    report = _report.root_cause(results[0], results, 9.0, told)
    assert report.startswith(
        "meshkit launch: rank 0 failed first (exit code 1) after 9.0 s.\n"
        "Its error is a meshkit check that waited for rank 1 in vain; it failed because of "
        "another rank.\n"
        "The evidence points to rank 1: a meshkit check of the others waited for it in vain.\n"
        "Stopped the other ranks: 1.\n"
    ), report
    assert "--- root cause: rank 1 ---" in report, report
    assert "--- first to fail: rank 0 ---" in report, report


def test_a_rank_stalled_outside_meshkit_outranks_one_that_waited_inside():
    # Rank 0's watchdog ended it first; it was waiting at a meshkit call for rank 1, whose
    # main thread slept in the program's own code.
    results = [
        _rank(0, 1, "meshkit watchdog: process 0 still made no progress after 11 s; exiting"),
        _rank(1, -15, "", stopped=True),
    ]
    told = Told.of(
        [
            _event(0, "stalled", inside=True, idle=3.0, last="call #3 of step (spmd)",
                   frame="in wait (threading.py:331), called from train (train.py:80)"),
            _event(1, "stalled", inside=False, idle=3.0, frame="in load (data.py:31)",
                   last="call #2 of step (spmd)"),
        ]
    )  # fmt: skip
    report = _report.root_cause(results[0], results, 11.0, told)
    assert report.startswith(
        "meshkit launch: rank 0 failed first (exit code 1) after 11.0 s.\n"
        "The evidence points to rank 1: the stall watchdog found it outside meshkit (in load "
        "(data.py:31)) while rank 0 waited inside a meshkit call.\n"
    ), report
    assert "--- root cause: rank 1 ---" in report


def test_an_error_of_its_own_first_is_the_root_cause_as_before():
    results = [_rank(0, 1, "ValueError: bad"), _rank(1, -15, "", stopped=True)]
    report = _report.root_cause(results[0], results, 2.0)
    assert report.startswith("meshkit launch: rank 0 failed first (exit code 1) after 2.0 s.\n")
    assert "evidence" not in report


def test_the_rank_a_divergence_names_is_the_root_cause_not_the_first_to_exit():
    # Every rank raised the same DivergenceError naming rank 2 (a setting on one host).
    results = [_rank(0, 1, "DivergenceError: a"), _rank(1, 1, "DivergenceError: a"),
               _rank(2, 1, "DivergenceError: a")]  # fmt: skip
    differ = {"cause": "divergence", "error": "DivergenceError", "field": "jax_enable_x64"}
    told = Told.of([_event(r, "failed", processes=[2], **differ) for r in (1, 0, 2)])
    report = _report.root_cause(results[0], results, 4.0, told)
    assert report.splitlines()[1:3] == [
        "Its error is meshkit's notice of a difference; another rank differs.",
        "The evidence points to rank 2: meshkit found that it differs from the others "
        "(jax_enable_x64).",
    ], report
    assert "--- root cause: rank 2 ---" in report
    assert "Also failed on their own: 1 (exit code 1)." in report
    # Two ranks that differ: no majority, so no root cause; the first to fail is shown.
    told = Told.of([_event(r, "failed", processes=[0, 1], **differ) for r in (0, 1)])
    report = _report.root_cause(results[0], results[:2], 4.0, told)
    assert report.splitlines()[1] == (
        "meshkit found that ranks 0, 1 differ (jax_enable_x64); no majority says which is "
        "wrong, so no rank is named as the cause."
    ), report
    assert "--- root cause:" not in report, report
    assert "--- first to fail: rank 0 ---" in report, report
    # A process that never came to a check is the one the others waited for.
    told = Told.of([_event(0, "failed", processes=[1], **{**differ, "field": "arrival"})])
    report = _report.root_cause(results[0], results[:2], 4.0, told)
    assert "The evidence points to rank 1: a meshkit check of the others waited for it in " in (
        report
    )


def test_a_rank_that_failed_first_and_told_the_others_is_the_cause_even_when_it_exits_first():
    # Rank 0 raised; its failure watch told rank 1, which stopped too. Either may exit first:
    # the verdict is the same, and rank 1 did not fail on its own.
    results = [
        _rank(0, 1, "RuntimeError: planted"),
        _rank(1, 1, "meshkit: process 0 failed: RuntimeError: planted"),
    ]
    told = Told.of(
        [
            _event(0, "failed", cause="exception", error="RuntimeError", where="prog.py:9"),
            _event(1, "failed", cause="peer", process=0, system="meshkit", error="RuntimeError"),
        ]
    )
    for bad in results:
        report = _report.root_cause(bad, results, 3.0, told)
        assert "The evidence points to rank 0: it failed first, and told the others" in report
        assert "--- root cause: rank 0 ---" in report, report
        assert "Also failed on their own" not in report, report
    # Its own error, and nobody told of it: the first to fail, as before.
    alone = Told.of([told.failed[0]])
    report = _report.root_cause(results[0], results, 3.0, alone)
    assert "evidence" not in report, report
    assert "Also failed on their own: 1 (exit code 1)." in report, report


def test_the_root_cause_is_not_listed_again_as_failed_on_its_own():
    # Rank 1 failed first, because of rank 0 (gloo timed out): rank 0 is the root cause, named
    # once with its output, not again under "also failed on their own"; rank 2 is.
    results = [_rank(0, 1, GLOO), _rank(1, -6, FATAL), _rank(2, 3, "OSError: disk full")]
    report = _report.root_cause(results[1], results, 31.0)
    assert "The evidence points to rank 2: it failed with its own error." in report, report
    assert "Also failed on their own: 0 (exit code 1).\n" in report, report
    results = [_rank(0, 1, GLOO), _rank(1, -6, FATAL), _rank(2, -15, stopped=True)]
    report = _report.root_cause(results[1], results, 31.0)
    assert "The evidence points to rank 0: it waited for other ranks in gloo" in report, report
    assert "Also failed on their own" not in report, report
    assert "Stopped the other ranks: 2.\n" in report, report


def test_the_stall_summary_is_built_from_the_events():
    told = Told.of(
        [
            _event(0, "stalled", inside=True, idle=3.2, frame="in wait (threading.py:331)"),
            _event(0, "stalled", inside=False, state="device", idle=9.0, frame="x.py:1 in f"),
            _event(2, "stalled", inside=False, idle=9.0, frame="y.py:7 in g"),  # no state
        ]
    )  # fmt: skip
    summary = _report.stall_summary([0, 1, 2], told)
    head, rank0, rank2, quiet = summary.splitlines()
    assert head == "Where each rank was when the run stalled:"
    assert rank0.startswith("  rank 0: no progress for 9 s;"), rank0  # the last event counts
    assert "at x.py:1 in f" in rank0, rank0
    assert rank0.endswith("waiting for device results"), rank0
    assert rank2.endswith("y.py:7 in g, outside meshkit"), rank2
    assert quiet == "  (no stall report from rank 1)"
    assert _report.stall_summary([0, 1], Told()) == ""


def test_the_report_of_a_stalled_run_names_the_rank_the_verdict_names():
    results = [_rank(0, 1, "meshkit: no progress"), _rank(1, 1, "Process 1's main thread")]
    held = Told.of([_event(r, "failed", cause="stall", processes=[1]) for r in (0, 1)])
    report = _report.root_cause(results[0], results, 310.0, held)
    assert "rank 0 failed first (exit code 1)" in report, report
    assert "The evidence points to rank 1: the run stalled" in report, report
    assert "--- root cause: rank 1 ---\n  | Process 1's main thread" in report, report
    nobody = Told.of([_event(r, "failed", cause="stall", processes=[]) for r in (0, 1)])
    report = _report.root_cause(results[0], results, 310.0, nobody)
    assert "The run stalled, and no rank held it" in report, report
    assert "root cause" not in report, report
    assert "--- first to fail: rank 0 ---" in report, report


def test_events_read_back_into_verdicts(tmp_path, monkeypatch):
    from meshkit._src.core import events

    monkeypatch.setenv("MESHKIT_LAUNCH_STATUS", str(tmp_path))
    for rank, kind, fields in [
        (0, "failed", dict(cause="peer", process=1, system="meshkit")),
        (2, "ended", {}),
        (0, "failed", dict(cause="signal", error="SIGTERM")),
    ]:
        monkeypatch.setenv("MESHKIT_PROCESS_ID", str(rank))
        events.emit(kind, **fields)
    (tmp_path / "events-1.jsonl").write_text('{"rank": 1, "kind": "stalled", "ti')  # cut short
    told = Told.of(rank_events.read(tmp_path, 3))
    assert told.failed[0].fields["cause"] == "peer"  # the first word of a rank is its verdict
    assert told.ended == {2}
    assert not told.stalled


_ONLY_PROCESS_0 = """
import jax, numpy as np
import meshkit
from jax.sharding import NamedSharding, PartitionSpec as P

meshkit.init()
mesh = meshkit.make_mesh({"data": -1})
x = jax.make_array_from_callback(
    (8, 4), NamedSharding(mesh, P("data")), lambda idx: np.ones((8, 4))[idx]
)
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
# Compiled by both (the programs are compared at compilation), run by one: its first collective
# waits for the other process in gloo's rendezvous, which gives up after 30 s.
compiled = total.lower(x).compile()
if jax.process_index() == 0:  # a computation over every process's devices, run by one
    print(float(compiled(x)))
"""


@pytest.mark.multiprocess
@pytest.mark.waits  # gloo's own 30 s timeout
def test_a_computation_run_by_one_process_is_explained(tmp_path):
    script = tmp_path / "only0.py"
    script.write_text(_ONLY_PROCESS_0)
    start = time.monotonic()
    result = meshkit.launch(
        [str(script)], num_processes=2, devices_per_process=4, platform="cpu", timeout=150,
        stream=False, env={"MESHKIT_INIT_TIMEOUT": "60"},
        starter=starter(None, "tests/test_events.py"),
    )  # fmt: skip
    assert time.monotonic() - start < 120
    assert result.returncode != 0, result.report
    # JAX's gloo gives up after 30 s; rank 1 had reached the end of its program.
    assert (
        "The evidence points to rank 0: it waited for other ranks in gloo until a timeout"
        in result.report
    ), result.report
    assert "Rank 1 reached the end of the program meanwhile." in result.report, result.report
    assert "meshkit: this error is a timeout of gloo" in result.ranks[0].stderr
    assert result.ranks[1].reached_end, result.ranks[1].stderr
