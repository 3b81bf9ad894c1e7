"""meshkit.testing's fork server: a forked rank is what a fresh ``python`` would have been.

The reference is a fresh interpreter started the launcher's usual way (`start_fresh`): the same
command, environment and directory must give the same output, exit code and traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit import MeshkitError
from meshkit._src.launch.spawn import Process, Starter, start_fresh
from meshkit.testing import launch_in_processes, run_in_processes
from meshkit.testing._forks import ENV_FORK, Forks, forkable, import_environment

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the fork server needs Linux (PR_SET_PDEATHSIG)"
)

PROBE = textwrap.dedent(
    """\
    import json, os, sys

    def inner():
        raise ValueError("raised in the program")

    print(json.dumps({
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")},
        "leader": os.getsid(0) == os.getpid() == os.getpgid(0),
        "stdin": sys.stdin.read(),
        "name": __name__,
    }))
    print("to stderr", file=sys.stderr)
    what = sys.argv[1] if len(sys.argv) > 1 else "0"
    if what == "raise":
        import atexit  # exit handlers read the error as the interpreter left it
        atexit.register(lambda: print("last:", repr(sys.last_value), file=sys.stderr))
        inner()
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "hang":
        print("hanging", flush=True)
        import time
        time.sleep(120)
    if what == "x64":
        import jax
        print(jax.numpy.zeros(1).dtype)
    sys.exit(int(what) if what.isdigit() else what)
    """
)


@pytest.fixture(scope="module")
def forks() -> Iterator[Forks]:
    servers = Forks()
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.py").write_text(PROBE)
    return folder


def _line(text: str) -> int:
    return PROBE.splitlines().index(text) + 1


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROBE_", "MESHKIT_"))}
    return {**base, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **extra}


def _run(start: Starter, command: list[str], env: dict[str, str], cwd: str) -> tuple[int, str, str]:
    proc: Process = start(command, env, cwd)
    assert proc.stdout is not None
    assert proc.stderr is not None
    out = proc.stdout.read().decode()
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    return proc.wait(timeout=60), out, err


def _close(proc: Process) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _both(forks: Forks, command: list[str], env: dict[str, str], cwd: str):
    return _run(forks, command, env, cwd), _run(start_fresh, command, env, cwd)


def test_a_forked_script_is_what_a_fresh_one_is(forks, probe, tmp_path):
    env = _env(PROBE_A="1", PROBE_B="two words")
    forked, fresh = _both(forks, [str(probe / "probe.py"), "0", "more"], env, str(tmp_path))
    assert forked == fresh
    code, out, err = forked
    seen = json.loads(out)
    assert code == 0
    assert seen["argv"] == [str(probe / "probe.py"), "0", "more"]
    assert seen["path0"] == str(probe)
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == {"PROBE_A": "1", "PROBE_B": "two words"}
    assert seen["leader"]
    assert seen["stdin"] == ""
    assert seen["name"] == "__main__"
    assert err == "to stderr\n"


def test_a_forked_module_is_what_a_fresh_one_is(forks, probe):
    forked, fresh = _both(forks, ["-m", "probe", "5"], _env(), str(probe))
    assert forked == fresh
    code, out, _ = forked
    seen = json.loads(out)
    assert code == 5
    assert seen["argv"] == [str(probe / "probe.py"), "5"]
    assert seen["path0"] == str(probe)
    assert seen["name"] == "__main__"


@pytest.mark.parametrize(
    ("what", "code"), [("7", 7), ("a message", 1), ("raise", 1), ("interrupt", -signal.SIGINT)]
)
def test_exit_codes_and_tracebacks_match_a_fresh_process(forks, probe, tmp_path, what, code):
    forked, fresh = _both(forks, [str(probe / "probe.py"), what], _env(), str(tmp_path))
    assert forked == fresh
    assert forked[0] == code
    if what == "raise":
        # From the program's first frame, as python prints it: no fork server, no runpy.
        assert forked[2].splitlines()[1:3] == [
            "Traceback (most recent call last):",
            f'  File "{probe / "probe.py"}", line {_line("    inner()")}, in <module>',
        ]
        assert (
            forked[2]
            .rstrip()
            .endswith(
                "ValueError: raised in the program\nlast: ValueError('raised in the program')"
            )
        ), forked[2]
    if what == "a message":
        assert forked[2].endswith("a message\n")


_NAMES = st.from_regex(r"PROBE_[A-Z0-9_]{1,8}", fullmatch=True)
_VALUES = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=12)
_ARGS = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=8), max_size=3
)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(env=st.dictionaries(_NAMES, _VALUES, max_size=4), args=_ARGS, code=st.integers(0, 255))
def test_property_forked_equals_fresh(forks, probe, tmp_path, env, args, code):
    """Any environment, arguments and exit code: the forked rank and the fresh one agree."""
    command = [str(probe / "probe.py"), str(code), *args]
    forked, fresh = _both(forks, command, _env(**env), str(tmp_path))
    assert forked == fresh
    assert json.loads(forked[1])["env"] == env


def test_a_signal_ends_a_forked_rank_as_a_fresh_one(forks, probe, tmp_path):
    proc = forks([str(probe / "probe.py"), "hang"], _env(), str(tmp_path))
    assert proc.stdout is not None
    assert b"hanging" in proc.stdout.readline() + proc.stdout.readline()
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGTERM)  # as the launcher stops a rank: its whole group
    assert proc.wait(timeout=30) == -signal.SIGTERM
    _close(proc)


def test_ranks_die_with_their_server(probe, tmp_path):
    servers = Forks(preload=())
    proc = servers([str(probe / "probe.py"), "hang"], _env(), str(tmp_path))
    assert proc.stdout is not None
    assert b"hanging" in proc.stdout.readline() + proc.stdout.readline()
    servers.close()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _close(proc)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by the server before it went, or by init after
    assert not Path(f"/proc/{proc.pid}").exists()


def test_what_is_read_while_importing_gets_its_own_server(forks, probe, tmp_path):
    """JAX reads JAX_ENABLE_X64 as it imports: a rank that sets it is forked from a server
    that imported JAX with it, and sees what a fresh process sees."""
    command = [str(probe / "probe.py"), "x64"]
    plain, plain_fresh = _both(forks, command, _env(), str(tmp_path))
    wide, wide_fresh = _both(forks, command, _env(JAX_ENABLE_X64="1"), str(tmp_path))
    assert plain[1].splitlines()[-1] == "float32"
    assert plain[:2] == plain_fresh[:2]
    assert wide[1].splitlines()[-1] == "float64"
    assert wide[:2] == wide_fresh[:2]
    assert forks.server(_env()) is not forks.server(_env(JAX_ENABLE_X64="1"))
    assert forks.server(_env(PROBE_X="1")) is forks.server(_env())  # read later: one server


def test_import_environment_and_forkable():
    env = {"JAX_ENABLE_X64": "1", "PYTHONHASHSEED": "0", "MESHKIT_PROCESS_ID": "3", "HOME": "/r"}
    assert import_environment(env) == (("JAX_ENABLE_X64", "1"), ("PYTHONHASHSEED", "0"))
    assert forkable(["-m", "pkg.mod", "x"])
    assert forkable(["script.py"])
    assert not forkable(["-m"])
    assert not forkable(["-c", "print(1)"])
    assert not forkable([])


def test_idle_servers_beyond_the_limit_end_busy_ones_stay(probe, tmp_path):
    servers = Forks(max_servers=1, preload=())
    try:
        first = servers.server(_env())
        hang = servers([str(probe / "probe.py"), "hang"], _env(), str(tmp_path))
        second = servers.server(_env(PYTHONHASHSEED="1"))
        assert first.alive
        assert second.alive
        os.killpg(hang.pid, signal.SIGKILL)
        assert hang.wait(timeout=30) == -signal.SIGKILL
        _close(hang)
        servers.server(_env(PYTHONHASHSEED="1"))
        third = servers.server(_env(PYTHONHASHSEED="2"))
        assert not first.alive
        assert not second.alive
        assert third.alive
    finally:
        servers.close()


def where_am_i():
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    total = multihost_utils.process_allgather(jnp.ones(()) * (jax.process_index() + 1))
    return jax.process_index(), jax.device_count(), float(total.sum()), os.getppid()


def fails_on_rank_1():
    import jax

    if jax.process_index() == 1:
        raise ValueError("rank 1 gave up")
    return 0


def test_launched_ranks_are_forked_and_agree_with_fresh_ones():
    """2 processes x 4 CPU devices, forked and fresh: the same answers; forked ranks are the
    fork server's children, fresh ones the launcher's."""
    forked = run_in_processes(where_am_i, fork=True)
    fresh = run_in_processes(where_am_i, fork=False)
    assert [r[:3] for r in forked] == [r[:3] for r in fresh] == [(0, 8, 3.0), (1, 8, 3.0)]
    assert all(r[3] != os.getpid() for r in forked)
    assert all(r[3] == os.getpid() for r in fresh)


def _frames(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith('  File "')]


def test_a_forked_rank_that_fails_is_reported_as_a_fresh_one():
    forked = launch_in_processes(fails_on_rank_1, fork=True)
    fresh = launch_in_processes(fails_on_rank_1, fork=False)
    assert forked.returncode == fresh.returncode == 1
    assert forked.ranks[1].returncode == fresh.ranks[1].returncode == 1
    assert "ValueError: rank 1 gave up" in forked.ranks[1].stderr
    assert _frames(forked.ranks[1].stderr) == _frames(fresh.ranks[1].stderr)
    assert _frames(forked.ranks[1].stderr)[-1].endswith("in fails_on_rank_1")


def test_the_environment_says_when_calls_do_not(monkeypatch):
    monkeypatch.setenv(ENV_FORK, "1")
    assert all(r[3] != os.getpid() for r in run_in_processes(where_am_i))
    monkeypatch.setenv(ENV_FORK, "0")
    assert all(r[3] == os.getpid() for r in run_in_processes(where_am_i))
    monkeypatch.setenv(ENV_FORK, "sometimes")
    with pytest.raises(MeshkitError) as error:
        run_in_processes(where_am_i)
    assert str(error.value) == (
        "meshkit.testing.launch_in_processes: environment variable "
        "MESHKIT_TESTING_FORK='sometimes' is not one of 1, true, yes, on (fork) or empty, "
        "0, false, no, off (fresh, the default)."
    )


# A module that neither JAX nor meshkit imports, cheap to preload.
_EXTRA = "xml.dom.minidom"


def loaded_before_the_body():
    """Whether the rank had `_EXTRA` imported before this body ran (it imports nothing)."""
    return _EXTRA in sys.modules


def test_preloaded_modules_are_imported_before_the_ranks_are_forked():
    preloaded = run_in_processes(
        loaded_before_the_body, fork=True, preload=(_EXTRA, "no_such_package_here.sub")
    )
    assert preloaded == [True, True]
    assert run_in_processes(loaded_before_the_body, fork=True) == [False, False]
    # Fresh ranks import as usual: the preload is only for the fork server.
    assert run_in_processes(loaded_before_the_body, fork=False, preload=(_EXTRA,)) == [
        False,
        False,
    ]


def test_a_forked_ranks_collector_leaves_the_preload_alone(forks, tmp_path):
    # The server freezes what its imports made (gc.freeze): a rank's full collections walk
    # only the rank's own objects, where a fresh interpreter's walk every module's too.
    script = tmp_path / "collector.py"
    script.write_text("import gc, json\nprint(json.dumps(gc.get_freeze_count()))\n")
    forked, fresh = _both(forks, [str(script)], _env(), str(tmp_path))
    assert forked[0] == fresh[0] == 0, (forked, fresh)
    # JAX and numpy, imported once in the server (Python 3.12 freezes a few hundred at start).
    assert json.loads(forked[1]) > json.loads(fresh[1]) + 10_000


def test_the_starter_for_a_preload():
    from meshkit.testing._forks import FORKS, PRELOAD, starter

    more = starter(True, "here", (_EXTRA, "jax"))
    assert more is starter(True, "here", (_EXTRA,))  # one set of servers for each addition
    assert more is not FORKS
    assert isinstance(more, Forks)
    assert more.preload == (*PRELOAD, _EXTRA)
    assert starter(True, "here", ("jax", "numpy")) is FORKS  # nothing added
    assert starter(True, "here", ("no_such_package_here",)) is FORKS  # not installed: left out
    assert starter(False, "here", (_EXTRA,)) is start_fresh
