"""JAX's persistent compilation cache through meshkit: init's argument, the variable, the flag.

The directory is checked before anything compiles; one that cannot be written is an error that
names it and where it came from. Several processes share one directory: the processes of one
program (only process 0 writes), and independent programs writing at the same time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_python, said

import meshkit
from meshkit import MeshkitError
from meshkit._src.core import events as _events
from meshkit._src.core.events import ENV_COMPILATION_CACHE, ENV_STATUS
from meshkit._src.launch.report import LaunchResult
from meshkit._src.launch.restarts import attempt_of, summary
from meshkit._src.runtime import compile_cache
from meshkit._src.runtime.compile_cache import writable
from meshkit.testing._forks import starter

RANK = Path(__file__).parent / "ranks" / "cached.py"


@pytest.fixture
def not_a_directory(tmp_path: Path) -> Path:
    """A path that cannot be created, whoever runs (root ignores permission bits)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "cache"


def test_an_unwritable_argument_is_an_error_naming_it_and_its_source(not_a_directory):
    with pytest.raises(MeshkitError) as caught:
        compile_cache.enable(not_a_directory)
    text = str(caught.value)
    assert text.startswith(
        f"meshkit.init(): the compilation cache directory {str(not_a_directory)!r} "
        "(from the argument compilation_cache) cannot be used: it cannot be created ("
    )
    assert "JAX's persistent compilation cache writes one file per compiled program" in text
    assert "\nConsider a directory writable by this user on every host" in text


def test_an_unwritable_variable_is_an_error_naming_the_variable(not_a_directory, monkeypatch):
    monkeypatch.setenv(ENV_COMPILATION_CACHE, str(not_a_directory))
    monkeypatch.delenv(ENV_STATUS, raising=False)
    with pytest.raises(
        MeshkitError,
        match=r"\(from the environment variable MESHKIT_COMPILATION_CACHE\) cannot be used: it "
        r"cannot be created",
    ):
        compile_cache.enable(None)
    monkeypatch.setenv(ENV_STATUS, "/somewhere")  # under meshkit launch: the flag is named too
    with pytest.raises(MeshkitError, match=r"set by meshkit launch --compilation-cache\)"):
        compile_cache.enable(None)


def test_nothing_given_sets_nothing(monkeypatch):
    monkeypatch.delenv(ENV_COMPILATION_CACHE, raising=False)
    assert compile_cache.enable(None) is None


def test_a_directory_is_created_and_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert writable("a/b", called="f()", source="x") == str(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the write check leaves nothing
    with pytest.raises(
        MeshkitError, match=r"f\(\): the compilation cache directory .* the path is empty"
    ):
        writable("", called="f()", source="x")


def test_the_launcher_flag_is_checked_before_any_rank_starts(not_a_directory, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "meshkit", "launch", "-n", "2", "--compilation-cache",
         str(not_a_directory), "never_started.py"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        f"meshkit launch: the compilation cache directory {str(not_a_directory)!r} (from the "
        "flag --compilation-cache) cannot be used: it cannot be created"
    ) in proc.stderr


def test_init_refuses_an_unwritable_directory_before_joining(not_a_directory, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    program = tmp_path / "p.py"
    program.write_text(
        "import meshkit\n"
        "try:\n"
        f"    meshkit.init(compilation_cache={str(not_a_directory)!r})\n"
        "except meshkit.MeshkitError as e:\n"
        "    print('REFUSED', str(e).splitlines()[0])\n"
    )
    proc = run_python([str(program)], env, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED meshkit.init(): the compilation cache directory" in proc.stdout
    assert "(from the argument compilation_cache) cannot be used" in proc.stdout


def _totals(stdout: str) -> dict[str, float]:
    line = said(stdout, "TOTALS ")[0]  # past Gloo's unended pieces
    return json.loads(line.removeprefix("TOTALS "))


def _sum(stdout: str) -> str:
    return said(stdout, "SUM ")[0]


@pytest.mark.multiprocess
def test_two_processes_share_one_directory_and_a_second_run_reads_it(tmp_path):
    cache = tmp_path / "cache"

    def run() -> meshkit.LaunchResult:
        return meshkit.launch(
            [str(RANK)], num_processes=2, devices_per_process=2, platform="cpu", timeout=120,
            stream=False, keep_output=True, grace=1.0,
            env={ENV_COMPILATION_CACHE: str(cache)},
            starter=starter(None, "tests/test_compile_cache.py"),
        )  # fmt: skip

    first = run()
    assert first.returncode == 0, first.report
    entries = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit_step-") for name in entries), entries
    second = run()
    assert second.returncode == 0, second.report
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new: all were there
    for a, b in zip(first.ranks, second.ranks, strict=True):
        assert _sum(a.stdout) == _sum(b.stdout)
        assert "persistent compilation cache" not in a.stderr + b.stderr  # no read/write error
    was, now = _totals(first.ranks[0].stdout), _totals(second.ranks[0].stdout)
    # Process 0 wrote every program in the first run and reads every one in the second. (On CPU
    # the other process's key holds its own devices, so it reads none; see docs/multi-host.md.)
    assert now["hits"] == now["programs"] == was["programs"] > 0
    assert now["seconds"] < was["seconds"]
    # The launcher's report of the run has each rank's totals.
    (attempt,) = second.attempts
    assert [c[0] for c in attempt.compiled] == [0, 1]
    assert attempt.compiled[0][3] == now["hits"]


@pytest.mark.multiprocess
def test_independent_programs_writing_one_directory_at_once_both_run(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    env[ENV_COMPILATION_CACHE] = str(cache)
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, str(RANK)]
    both = [
        subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in both]
    finally:
        for p in both:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
    for p, (_, err) in zip(both, outs, strict=True):
        assert p.returncode == 0, err
        assert "persistent compilation cache" not in err
    assert _sum(outs[0][0]) == _sum(outs[1][0])
    third = run_python([str(RANK)], env, tmp_path, timeout=120)
    assert third.returncode == 0, third.stderr
    totals = _totals(third.stdout)
    assert totals["hits"] == totals["programs"] > 0


def _event(rank: int, kind: str, time: float = 0.0, **fields) -> _events.Event:
    return _events.Event(rank, kind, time, fields)


def test_the_restart_report_shows_each_attempts_compile_time():
    def attempt(number: int, *records: _events.Event):
        result = LaunchResult(0, [], None, False, [], 1.0, "")
        return attempt_of(number, result, records, ranks=[0, 1], started_at=0.0,
                          stopped_s=None, restartable=False)  # fmt: skip

    first = attempt(
        0,
        _event(0, _events.COMPILED, seconds=0.5, programs=1, hits=0),
        _event(0, _events.COMPILED, seconds=2.0, programs=4, hits=0),  # the last totals count
        _event(1, _events.COMPILED, seconds=2.5, programs=4, hits=0),
    )
    assert first.compiled == ((0, 2.0, 4, 0), (1, 2.5, 4, 0))
    second = attempt(1, _event(0, _events.COMPILED, seconds=0.1, programs=4, hits=4))
    lines = summary([first, second], 2).splitlines()
    assert (
        "; rank 0 compiled 4 programs in 2.00 s (0 from the cache), rank 1 in 2.50 s (0 from "
        "the cache); finished" in lines[1]
    )
    assert "; rank 0 compiled 4 programs in 0.10 s (4 from the cache); finished" in lines[2]
    assert "compiled" not in summary([attempt(0)], 1)


def test_the_launcher_flag_sets_the_variable_as_an_absolute_path(tmp_path, monkeypatch):
    from meshkit.cli import _join_options, _parser

    monkeypatch.chdir(tmp_path)
    args = _parser().parse_args(["launch", "--compilation-cache", "jax-cache", "prog.py"])
    assert _join_options(args) == {ENV_COMPILATION_CACHE: str(tmp_path / "jax-cache")}
