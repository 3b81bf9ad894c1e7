"""Test configuration: 8 CPU devices for this process, hypothesis profiles, process helpers."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, settings
from ranks.preloads import ECOSYSTEM

# Before any backend use: every in-process test sees 8 CPU devices.
jax.config.update("jax_num_cpu_devices", 8)


def _compilation_cache() -> None:
    """A JAX compilation cache of this test process's own, empty at its start, removed at exit.

    Many in-process tests compile the same small programs again (a new function object, a new
    `pmap_compat`, the same hypothesis draw); with the cache the second compilation is a read.
    Every program is kept (no minimum compile time). Each process has its own directory, so none can
    read an entry another is still writing; processes the tests launch get none.
    """
    path = tempfile.mkdtemp(prefix="meshkit-tests-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_compilation_cache()

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("MESHKIT_HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run first the modules marked ``long``, then those marked ``waits``; keep the order
    otherwise.

    ``nox -s tests`` runs the suite in 6 workers, a module to a worker (``--dist loadfile``),
    handed out in this order. A module that keeps its worker busy for minutes of computing
    starts at once, so that it never runs alone at the suite's end; so do the modules that spend
    tens of seconds waiting (soaks, timeouts, watchdogs): their waiting overlaps the rest.
    """

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("long"):
            return 0
        return 1 if item.get_closest_marker("waits") else 2

    items.sort(key=rank)
    # What collection imported (JAX, the test modules and theirs) lives as long as the worker:
    # out of the collector's reach, each full collection walks only the tests' own objects.
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_global_batches_left() -> Iterator[None]:
    """Close what a test left of `meshkit.global_batches`: an iterator never closed keeps its
    helper thread waiting for a prefetch slot, and a later test of this worker that counts the
    helpers alive would see it."""
    yield
    module = sys.modules.get("meshkit._src.arrays.batches")
    for batches in list(getattr(module, "_live", ())):
        with contextlib.suppress(Exception):  # its own error belongs to the test that made it
            batches.close()


def require(module: str, why: str = "") -> object:
    """Import ``module`` for a test, or skip it with the reason printed (``-ra`` lists it).

    Where ``MESHKIT_REQUIRE_EXTRAS=1`` (CI sets it, and installs every extra through the test
    dependency group) a missing package fails the test instead: the ecosystem tests run there
    against the real libraries, never silently skipped.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} is not installed ({exc}); pip install 'meshkit[{why or module}]'"
        if os.environ.get("MESHKIT_REQUIRE_EXTRAS") == "1":
            pytest.fail(f"{reason}, but MESHKIT_REQUIRE_EXTRAS=1")
        pytest.skip(reason)


def said(text: str, word: str) -> list[str]:
    """Each line of ``text`` that begins with ``word``, from ``word`` on.

    Gloo (JAX's CPU collectives) prints "[Gloo] Rank N is connected to ..." on stdout in
    pieces, without ending its line, so a program's line may follow such a piece ("[Gloo] Rank
    START at step 4"): the piece is passed over.
    """
    line_of = re.compile(rf"^(?:\[Gloo\].*?)?({re.escape(word)}.*)$")
    return [m.group(1) for line in text.splitlines() if (m := line_of.match(line))]


def processes_with_marker(marker: str) -> list[int]:
    """Pids of live processes whose environment holds MESHKIT_TEST_MARKER=marker."""
    needle = f"MESHKIT_TEST_MARKER={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if needle in environ.split(b"\0") and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return found


@pytest.fixture
def marker() -> str:
    """A unique value for MESHKIT_TEST_MARKER; the test checks no process keeps it."""
    value = uuid.uuid4().hex
    yield value
    left = processes_with_marker(value)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def warm_cluster_env() -> dict[str, str]:
    """The warm cluster's workers carry a marker of their own; none may outlive the module.

    (Overrides `meshkit.testing.pytest_plugin`'s fixture.) A per-test marker would not do: the
    workers outlive each test, and a cluster restarted inside a test would take its marker.
    """
    value = uuid.uuid4().hex
    yield {"MESHKIT_TEST_MARKER": value}
    left = processes_with_marker(value)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"warm cluster processes left behind: {left}"


def run_python(
    argv: list[str],
    env: dict[str, str],
    cwd: str | Path,
    timeout: float = 180,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` (a script and its arguments) with exactly ``env``, its output captured.

    Started as `meshkit.testing` starts its processes: forked from a server that imported JAX
    and started nothing under ``MESHKIT_TESTING_FORK=1`` (nox; about a second of CPU less
    each), else a fresh interpreter. A test of what a fresh interpreter imports must use
    ``subprocess`` itself. After ``timeout`` seconds the process's session is killed and
    `subprocess.TimeoutExpired` raised. ``preload``: modules the script imports, for the fork
    server to import first (`meshkit.testing._forks.starter`'s).
    """
    from meshkit.testing._forks import starter

    proc = starter(None, "tests/conftest.py run_python", preload)(argv, env, str(cwd))
    out: dict[str, bytes] = {}
    readers = [
        threading.Thread(target=lambda n=n, f=f: out.__setitem__(n, f.read()), daemon=True)
        for n, f in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    if any(reader.is_alive() for reader in readers):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: it and whatever it started
        proc.wait(30)
        raise subprocess.TimeoutExpired(argv, timeout)
    code = proc.wait(max(1.0, deadline - time.monotonic()))
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    return subprocess.CompletedProcess(
        argv, code, out["stdout"].decode(errors="replace"), out["stderr"].decode(errors="replace")
    )


@pytest.fixture(scope="session")
def preemptible_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The uninterrupted run of ``examples/preemptible_training.py``, 2 processes x 4 CPU devices.

    Returns its FINAL line (loss and parameter digest) and its ``final.npz``. Made once per
    suite run: pytest-xdist's workers share it through their common base directory, the first
    to ask runs it while the others wait on a lock (test_resume and test_slurm compare against
    it, so the example runs once).
    """
    import fcntl

    for module, why in (("orbax.checkpoint", "orbax"), ("grain", "grain"), ("flax.nnx", "flax")):
        require(module, why)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this run's only
    root, final = shared / "preemptible-reference", shared / "preemptible-reference.final"
    with open(shared / "preemptible-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not final.exists():
            import meshkit
            from meshkit.testing._forks import starter

            shutil.rmtree(root, ignore_errors=True)  # a worker that failed before
            result = meshkit.launch(
                [str(EXAMPLES / "preemptible_training.py"), "train", str(root)],
                num_processes=2, devices_per_process=4, platform="cpu", timeout=240,
                stream=False, keep_output=True,
                starter=starter(None, "tests/conftest.py", ECOSYSTEM),
            )  # fmt: skip
            assert result.returncode == 0, result.report
            (line,) = said(result.ranks[0].stdout, "FINAL ")
            final.write_text(line)
    return final.read_text(), root / "final.npz"


@pytest.fixture(autouse=True)
def _simulated_hosts(request: pytest.FixtureRequest) -> None:
    """A test marked ``hosts`` skips (the reason printed) where simulated hosts cannot be made,
    and fails instead under ``MESHKIT_REQUIRE_HOSTS=1`` (CI, as root)."""
    if request.node.get_closest_marker("hosts") is not None:
        from host_runs import require_hosts

        require_hosts()
