"""The preflight at `meshkit.init`: processes agree on their software and settings first.

The unit tests hand `programs.preflight` the other processes' records through a stand-in for the
agreement; the multi-process tests start real processes whose settings differ.

What the launched processes run is in `ranks/preflight.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ranks import preflight as ranks

import meshkit
from meshkit._src.coord import missing
from meshkit._src.coord.node import Outcome
from meshkit._src.core import compat
from meshkit._src.runtime import programs
from meshkit.testing import launch_in_processes

BASE = programs.Facts(
    python="3.11.9",
    jax="0.10.2",
    jaxlib="0.10.2",
    meshkit="0.9.0",
    platform="cpu",
    device_kind="cpu",
    local_devices=4,
    settings={"jax_enable_x64": "False", "jax_default_matmul_precision": "None"},
    XLA_FLAGS="",
    program="ab12",
)


def _exchange(monkeypatch, records: dict[int, programs.Facts], missing=()):
    """Make `programs.preflight` see ``records`` (by process) as the exchange's outcome."""
    asked: list[str] = []

    def check(tag, summary, record, *, timeout, what=""):
        asked.append(tag)
        sent = {p: json.dumps(r.fields(), sort_keys=True) for p, r in records.items()}
        assert record == sent[0]  # this process's record is its facts' fields
        agreed = len(set(sent.values())) == 1 and not missing
        return Outcome(agreed, sent, tuple(missing))

    monkeypatch.setattr(programs._agree, "check", check)
    monkeypatch.setattr(programs, "facts", lambda: records[0])
    return asked


def _with(facts: programs.Facts, **changes: Any) -> programs.Facts:
    settings = {k: changes.pop(k) for k in list(changes) if k.startswith("jax_")}
    return dataclasses.replace(facts, **changes, settings={**facts.settings, **settings})


def test_facts_are_this_processs_software_and_devices():
    mine = programs.facts()
    assert (mine.jax, mine.jaxlib, mine.meshkit) == (
        jax.__version__,
        importlib.metadata.version("jaxlib"),
        meshkit.__version__,
    )
    assert (mine.platform, mine.local_devices) == ("cpu", jax.local_device_count())
    assert mine.settings["jax_enable_x64"] == str(jax.config.jax_enable_x64)
    assert tuple(mine.settings) == programs.settings()
    assert mine.fields()["jax_enable_x64"] == mine.settings["jax_enable_x64"]
    assert "settings" not in mine.fields()


def test_equal_processes_pass_in_one_exchange(monkeypatch):
    asked = _exchange(monkeypatch, {0: BASE, 1: BASE, 2: BASE})
    programs.preflight(0, 3, 5.0)
    assert asked == ["preflight"]


def test_a_setting_on_one_host_names_that_process_the_flag_and_both_values(monkeypatch):
    _exchange(monkeypatch, {0: BASE, 1: BASE, 2: _with(BASE, jax_enable_x64="True")})
    with pytest.raises(meshkit.DivergenceError) as caught:
        programs.preflight(0, 3, 5.0)
    assert str(caught.value).startswith(
        "meshkit.init(): the processes differ in their software or settings:\n"
        "  jax_enable_x64: processes 0,1: False; process 2: True\n"
    )
    assert "consider how process 2 sets jax_enable_x64 (a jax.config.update" in str(caught.value)
    assert "MESHKIT_PREFLIGHT=0 turns this check off" in str(caught.value)
    assert (caught.value.processes, caught.value.field) == ([2], "jax_enable_x64")


def test_two_processes_that_differ_are_both_named(monkeypatch):
    other = _with(BASE, jax="0.10.1", local_devices=2)
    _exchange(monkeypatch, {0: BASE, 1: other})
    with pytest.raises(meshkit.DivergenceError) as caught:
        programs.preflight(0, 2, 5.0)
    text = str(caught.value)
    assert "  jax: process 0: 0.10.2; process 1: 0.10.1\n" in text
    assert "  local_devices: process 0: 4; process 1: 2\n" in text
    assert "consider the installation of processes 0,1" in text
    assert caught.value.processes == [0, 1]  # no majority says which is wrong


def test_a_different_program_or_xla_flags_is_a_warning(monkeypatch):
    other = _with(BASE, program="cd34", XLA_FLAGS="--xla_dump_to=/tmp/a")
    _exchange(monkeypatch, {0: BASE, 1: BASE, 2: other})
    with pytest.warns(UserWarning, match="the processes run different") as seen:
        programs.preflight(0, 3, 5.0)
    texts = [str(w.message) for w in seen]
    assert texts == [
        "meshkit.init(): the processes run different XLA_FLAGSs (processes 0,1: ; process 2: "
        "--xla_dump_to=/tmp/a). That may be on purpose; if not, consider how each host got its "
        "copy of the program.",
        "meshkit.init(): the processes run different main program files (processes 0,1: ab12; "
        "process 2: cd34 by SHA-256). That may be on purpose; if not, consider how each host "
        "got its copy of the program.",
    ]


def test_a_process_that_does_not_come_is_named(monkeypatch):
    _exchange(monkeypatch, {0: BASE, 1: BASE}, missing=(2,))
    with pytest.raises(meshkit.DivergenceError, match="process 2 did not arrive within 5 s"):
        programs.preflight(0, 3, 5.0)


def test_the_preflight_can_be_turned_off_and_its_setting_is_checked(monkeypatch):
    asked = _exchange(monkeypatch, {0: BASE, 1: _with(BASE, jax_enable_x64="True")})
    monkeypatch.setenv("MESHKIT_PREFLIGHT", "0")
    programs.preflight(0, 2, 5.0)
    assert asked == []
    monkeypatch.setenv("MESHKIT_PREFLIGHT", "sometimes")
    with pytest.raises(meshkit.MeshkitError, match="MESHKIT_PREFLIGHT='sometimes'"):
        programs.preflight(0, 2, 5.0)
    programs.preflight(0, 1, 5.0)  # one process: nothing to compare, nothing read


_FIELDS = ["python", "jax", "device_kind", "local_devices", "jax_enable_x64", "program"]


@given(
    st.lists(
        st.dictionaries(st.sampled_from(_FIELDS), st.sampled_from(["a", "b", "c"]), max_size=3),
        min_size=1,
        max_size=6,
    )
)
def test_differences_group_every_process_by_its_value(changes):
    records = {p: _with(BASE, **c) for p, c in enumerate(changes)}
    found = dict(missing.differences({p: r.fields().items() for p, r in records.items()}))
    for name in {*BASE.fields(), *(k for c in changes for k in c)}:
        values = {p: r.fields()[name] for p, r in records.items()}
        if len(set(values.values())) == 1:
            assert name not in found
            continue
        groups = found[name]
        assert {v: sorted(ps) for v, ps in groups.items()} == {
            v: sorted(p for p, x in values.items() if x == v) for v in set(values.values())
        }


# ---- which settings -----------------------------------------------------------------------

SNAPSHOT = Path(__file__).parent / "golden" / "preflight" / "settings.json"
JAX_LINE = ".".join(jax.__version__.split(".")[:2])

SNAPSHOT_CHANGED = """\
JAX {version} compares other settings than {snapshot} says for JAX {line}.
New here: {new}
Gone here: {gone}
A new name is an option JAX marks as part of every compiled program (include_in_jit_key or
include_in_trace_context in jax/_src/config.py), or one of programs.ALSO_COMPARED. Keep it
compared unless processes set it differently by design (a device, a directory, a log level of
their own); then add it to programs.NOT_COMPARED with the reason. A name gone is an option
JAX removed or renamed: where programs.ALSO_COMPARED or NOT_COMPARED names it, add the new
name with its reason (keep the old one while a supported JAX line has it). Then write the
entry of JAX {line} in {snapshot}:
  "{line}": {names}"""


def test_the_compared_settings_are_this_jax_lines_snapshot():
    snapshot = json.loads(SNAPSHOT.read_text())
    names = list(programs.settings())
    where = SNAPSHOT.relative_to(Path(__file__).parent.parent)
    assert JAX_LINE in snapshot, (
        f"{where} has no entry for JAX {JAX_LINE} (it has {', '.join(snapshot)}). Review the "
        f"settings this JAX compares, then add:\n  {json.dumps(JAX_LINE)}: {json.dumps(names)}"
    )
    expected = snapshot[JAX_LINE]
    assert names == expected, SNAPSHOT_CHANGED.format(
        version=jax.__version__,
        snapshot=where,
        line=JAX_LINE,
        new=", ".join(sorted(set(names) - set(expected))) or "none",
        gone=", ".join(sorted(set(expected) - set(names))) or "none",
        names=json.dumps(names),
    )


def test_what_jax_puts_in_the_trace_context_is_compared_or_excluded_by_name():
    traced = compat.trace_context_settings()
    if traced is None:
        pytest.skip(f"jaxlib {importlib.metadata.version('jaxlib')} cannot name them")
    assert traced, "jaxlib named no option of the trace context: has trace_context_names moved?"
    left = traced - set(programs.settings()) - programs.NOT_COMPARED.keys()
    assert not left, (
        f"compat.compiled_settings() misses {sorted(left)}: has jax/_src/config.py moved?"
    )


def test_every_exception_has_its_reason_and_is_still_needed():
    marked = compat.compiled_settings()
    for name, reason in {**programs.ALSO_COMPARED, **programs.NOT_COMPARED}.items():
        assert reason.strip(), f"{name} needs its reason"
    redundant = marked & programs.ALSO_COMPARED.keys()
    assert not redundant, f"JAX marks {sorted(redundant)} itself: drop them from ALSO_COMPARED"
    stale = programs.NOT_COMPARED.keys() - marked
    assert not stale, f"JAX no longer marks {sorted(stale)}: drop them from NOT_COMPARED"
    snapshot = json.loads(SNAPSHOT.read_text())
    everywhere = {name for names in snapshot.values() for name in names}
    unknown = programs.ALSO_COMPARED.keys() - everywhere
    assert not unknown, f"no supported JAX has {sorted(unknown)}: drop them from ALSO_COMPARED"


def test_the_compile_effort_settings_of_the_running_jax_are_compared():
    effort = [
        "jax_optimization_level",
        "jax_memory_fitting_level",
        "jax_exec_time_optimization_effort",
        "jax_memory_fitting_effort",
    ]
    present = [name for name in effort if name in compat.settings_of_jax()]
    assert len(present) >= 2, present
    assert set(present) <= set(programs.settings())
    assert "jax_default_device" not in programs.settings()  # each process names its own


def test_setting_values_are_the_same_text_in_every_process():
    assert programs._text(frozenset({"x", "model", "data"})) == "frozenset(['data', 'model', 'x'])"
    assert programs._text(object()) == "builtins.object"  # never an address
    assert programs._text("O1") == "O1"
    assert programs._text(None) == "None"


def test_meshkit_info_shows_what_the_preflight_compares():
    from meshkit.cli import _compared

    text = _compared(BASE)
    assert text.splitlines()[:4] == [
        "compared by the processes at meshkit.init (the preflight):",
        "  python 3.11.9, jax 0.10.2, jaxlib 0.10.2, meshkit 0.9.0",
        "  cpu: 4 x cpu per process",
        "  2 jax.config settings:",
    ]
    assert "    jax_enable_x64=False  jax_default_matmul_precision=None" in text


def test_a_setting_without_the_jax_prefix_gets_the_settings_advice(monkeypatch):
    other = dataclasses.replace(BASE, settings={**BASE.settings, "check_vma": "False"})
    mine = dataclasses.replace(BASE, settings={**BASE.settings, "check_vma": "True"})
    _exchange(monkeypatch, {0: mine, 1: mine, 2: other})
    with pytest.raises(meshkit.DivergenceError, match="consider how process 2 sets check_vma"):
        programs.preflight(0, 3, 5.0)


# ---- real processes --------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_x64_on_one_process_fails_at_init_on_every_process_naming_it(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)
    result = launch_in_processes(ranks.x64_on_process_1, init=False, timeout=60)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    assert result.values == [None, None], text
    # A rank that raised says it (the other may be ended by its failure before it gets to).
    raised = [
        r.stderr for r in result.ranks if "meshkit.DivergenceError: meshkit.init()" in r.stderr
    ]
    assert raised, text
    assert "DivergenceError: meshkit.init(): the processes differ in their software" in raised[0]
    assert "jax_enable_x64: process 0: False; process 1: True" in raised[0], text
    assert "meshkit found that ranks 0, 1 differ (jax_enable_x64)" in result.report, text


@pytest.mark.multiprocess
def test_the_launcher_names_the_process_whose_settings_differ(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)
    result = launch_in_processes(
        ranks.x64_on_process_1_of_3, num_processes=3, devices_per_process=1, init=False, timeout=60
    )
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    raised = [
        r.stderr for r in result.ranks if "meshkit.DivergenceError: meshkit.init()" in r.stderr
    ]
    assert raised, text
    assert "jax_enable_x64: processes 0,2: False; process 1: True" in raised[0], text
    assert "The evidence points to rank 1: meshkit found that it differs" in result.report, text


@pytest.mark.multiprocess
def test_equal_processes_start_without_a_word(marker, monkeypatch):
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)
    result = launch_in_processes(ranks.same_everywhere, init=False, timeout=60)
    assert result.returncode == 0, result.report
    assert result.values == [(2, []), (2, [])], result.report


@pytest.mark.multiprocess
def test_an_optimization_level_on_one_process_is_named(marker, monkeypatch):
    if not hasattr(jax.config, "jax_optimization_level"):
        pytest.skip(f"JAX {jax.__version__} has no jax_optimization_level")
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)
    result = launch_in_processes(ranks.optimization_level_on_process_1, init=False, timeout=60)
    text = result.report + "\n".join(r.stderr for r in result.ranks)
    assert result.returncode != 0, text
    raised = [
        r.stderr for r in result.ranks if "meshkit.DivergenceError: meshkit.init()" in r.stderr
    ]
    assert raised, text  # a rank that raised says it; the other may be ended first
    assert "DivergenceError: meshkit.init(): the processes differ in their software" in raised[0]
    assert "jax_optimization_level: process 0: UNKNOWN; process 1: O1" in raised[0], text
    assert "meshkit found that ranks 0, 1 differ (jax_optimization_level)" in result.report, text
