"""Profiles of every process for the same steps (`meshkit._src.lifecycle.profiles`): the range
parsed and refused (launcher flag, environment, `meshkit.profile_steps`), a real trace in one
process and in two, a range past the end of the run, and nothing written when off."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from jax.profiler import ProfileData
from ranks import profiles as ranks
from ranks.profiles import STEPS

import meshkit
from meshkit._src.core import env
from meshkit._src.core.events import ENV_PROFILE_DIR, ENV_PROFILE_STEPS
from meshkit._src.lifecycle import profiles as _profiles
from meshkit.cli import _parser, _profile_options, main
from meshkit.testing import launch_in_processes

MARK = "meshkit.global_batches"


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    if _profiles.active is not None and _profiles.active.state == "tracing":
        _profiles.active._stop()
    _profiles.active = None


def _steps_in(trace: Path) -> set[int]:
    """The steps marked in a trace (`StepTraceAnnotation`'s ``step_num``)."""
    found = set()
    data = ProfileData.from_file(str(trace))  # held: its planes point into it
    with warnings.catch_warnings():
        # jaxlib's stats iterator type has no __module__ (a DeprecationWarning on Python 3.12)
        warnings.simplefilter("ignore", DeprecationWarning)
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    if event.name == MARK:
                        found.add(int(dict(event.stats)["step_num"]))
    return found


def _loop(steps: int) -> None:
    mesh = meshkit.make_mesh({"data": -1})
    loader = ({"x": np.full((8, 2), k, np.float32)} for k in range(steps))
    for _ in meshkit.global_batches(loader, mesh, "data"):
        pass


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2:3", (2, 3)), (" 10 : 12 ", (10, 12)), ("7:7", (7, 7)), ("5:3", None), ("x", None),
     ("-1:2", None), ("0:2", None), ("3", None), ("2:", None), ("", None), ("1.5:2", None),
     ("²:3", None)],
)  # fmt: skip
def test_a_range_of_steps_is_two_whole_numbers_from_1_first_not_after_last(text, expected):
    assert env.step_range(text) == expected


@pytest.mark.parametrize("given", ["5:3", "x", "-2:4"])
def test_meshkit_launch_refuses_a_bad_range_before_any_rank_starts(given, capsys, tmp_path):
    program = tmp_path / "never_run.py"
    program.write_text("raise SystemExit('a rank started')\n")
    assert main(["launch", f"--profile-steps={given}", str(program)]) == 2
    err = capsys.readouterr().err
    assert f"meshkit launch: --profile-steps {given!r} is not a range of steps A:B" in err
    assert "whole numbers with 1 <= A <= B" in err
    assert "Consider e.g. --profile-steps 10:12" in err
    assert "a rank started" not in err


def test_meshkit_launch_refuses_a_profile_dir_without_steps(capsys, tmp_path):
    assert main(["launch", "--profile-dir", str(tmp_path), "x.py"]) == 2
    err = capsys.readouterr().err
    assert f"--profile-dir {str(tmp_path)!r} was given without --profile-steps" in err
    assert "Consider adding --profile-steps A:B" in err


def test_meshkit_launch_passes_the_range_and_an_absolute_directory(tmp_path):
    def options(*flags):
        return _profile_options(_parser().parse_args(["launch", *flags, "x.py"]))

    assert options() == {}  # off: nothing for the ranks
    assert options("--profile-steps", "2:3") == {
        ENV_PROFILE_STEPS: "2:3", ENV_PROFILE_DIR: os.path.abspath("meshkit-profile")
    }  # fmt: skip
    logs = options("--profile-steps", " 4:9", "--log-dir", str(tmp_path))
    assert logs == {ENV_PROFILE_STEPS: "4:9", ENV_PROFILE_DIR: str(tmp_path / "profile")}
    given = options("--profile-steps", "4:9", "--profile-dir", "rel", "--log-dir", "L")
    assert given[ENV_PROFILE_DIR] == os.path.abspath("rel")


@pytest.mark.parametrize("given", ["5:3", "soon", "0:1"])
def test_init_refuses_a_bad_range_in_the_environment_naming_the_variable(given, monkeypatch):
    monkeypatch.setenv(ENV_PROFILE_STEPS, given)
    with pytest.raises(meshkit.MeshkitError) as caught:
        meshkit.init()
    message = str(caught.value)
    assert message.startswith(f"meshkit.init(): environment variable {ENV_PROFILE_STEPS}=")
    assert f"={given!r} is not a range of steps A:B" in message
    assert "(e.g. 10:12)" in message


@pytest.mark.parametrize(
    ("start", "stop"), [(3, 2), (0, 1), (-1, 2), (True, 2), ("2", 3), (2.0, 3)]
)
def test_profile_steps_refuses_a_range_that_is_not_one(start, stop, tmp_path):
    with pytest.raises(meshkit.MeshkitError) as caught:
        meshkit.profile_steps(start, stop, tmp_path)
    message = str(caught.value)
    assert message.startswith(f"meshkit.profile_steps(start={start!r}, stop={stop!r})")
    assert "whole numbers with 1 <= start <= stop" in message
    assert "Consider e.g. meshkit.profile_steps(10, 12, directory)" in message
    assert _profiles.active is None
    with pytest.raises(meshkit.MeshkitError, match=r"profile_steps: directory is empty"):
        meshkit.profile_steps(1, 2, "")


def test_a_trace_in_one_process_covers_exactly_the_steps_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHKIT_ATTEMPT", raising=False)
    run = meshkit.profile_steps(2, 3, tmp_path)
    assert run == str(tmp_path / "plugins" / "profile" / "steps_2-3")
    _loop(5)
    assert _profiles.active is None  # stopped at step 4: the steps after cost nothing
    (trace,) = Path(run).iterdir()
    assert trace.name.endswith("-rank0.xplane.pb")
    assert _steps_in(trace) == {2, 3}
    # The scratch directory is gone: the viewers see one run.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plugins"]
    assert [p.name for p in (tmp_path / "plugins" / "profile").iterdir()] == ["steps_2-3"]


def test_off_a_loop_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _profiles.active is None
    _loop(3)
    assert list(tmp_path.iterdir()) == []


def test_a_range_past_the_end_keeps_the_trace_taken_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="meshkit")
    run = Path(meshkit.profile_steps(3, 9, tmp_path / "a"))
    _loop(4)
    assert _profiles.active is None  # stopped when the data ended
    (trace,) = run.iterdir()
    assert _steps_in(trace) == {3, 4}
    said = caplog.text
    assert "the last step was 4, before step 9" in said
    assert f"the profile of steps 3:9 of {MARK} covers steps 3 to 4" in said
    # Never reached: said, and nothing written.
    caplog.clear()
    meshkit.profile_steps(6, 9, tmp_path / "b")
    profile = _profiles.active
    assert profile is not None
    _loop(4)
    assert _profiles.active is profile  # still waiting: another loop may reach step 6
    profile.finish()  # what the exit handler does when the process ends
    assert "no profile of steps 6:9 of meshkit.global_batches was taken" in caplog.text
    assert "took no step from 6 to 9 (the last step it took: 4)" in caplog.text
    assert not (tmp_path / "b").exists()


def _run(steps: str, directory: Path):
    env = {ENV_PROFILE_STEPS: steps, ENV_PROFILE_DIR: str(directory)}
    return launch_in_processes(ranks.loop, timeout=90, env=env)


def test_two_processes_trace_the_same_steps_into_one_run_directory(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        inside = pool.submit(_run, "2:3", tmp_path / "inside")
        past = pool.submit(_run, f"4:{STEPS + 4}", tmp_path / "past")
        results = {"inside": inside.result(), "past": past.result()}
    for result in results.values():
        text = result.report + "".join(f"--- {r.rank}\n{r.stdout}{r.stderr}" for r in result.ranks)
        assert result.returncode == 0, text
        assert result.values == [STEPS, STEPS], text
    runs = list((tmp_path / "inside" / "plugins" / "profile").iterdir())
    assert [r.name for r in runs] == ["steps_2-3"]  # one run directory for both processes
    traces = sorted(runs[0].iterdir())
    assert [t.name.rsplit("-", 1)[1] for t in traces] == ["rank0.xplane.pb", "rank1.xplane.pb"]
    assert [_steps_in(t) for t in traces] == [{2, 3}, {2, 3}]
    told = results["inside"].ranks[0].stderr  # process 0 says where the run's traces are
    assert f"meshkit: profile of steps 2:3 of {MARK}: {runs[0]} (a trace per process" in told
    # Past the end: each process keeps steps 4 and 5 and says that the data ended before step 9.
    traces = sorted((tmp_path / "past" / "plugins" / "profile" / "steps_4-9").iterdir())
    assert [_steps_in(t) for t in traces] == [{4, 5}, {4, 5}]
    for rank in results["past"].ranks:
        assert "the last step was 5, before step 9" in rank.stderr, rank.stderr
