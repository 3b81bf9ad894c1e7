"""Developer sessions: `nox -s tests lint examples docs bench`.

Interpreters are found on PATH. Where pyenv manages Python, the newest installed 3.11 and 3.12
are added to PYENV_VERSION unless it already names those lines, so `nox -s tests` works on a
fresh machine. Each session installs meshkit itself (not editable) into its own venv, so
tests exercise the installed package.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "tests", "examples"]
nox.options.error_on_missing_interpreters = True


def _expose_pyenv_interpreters(minors: list[str]) -> None:
    """Let pyenv's shims resolve python3.11 and python3.12 for this nox run.

    PYENV_VERSION is kept and extended: run through a pyenv shim, nox already sees it set to the
    one version that shim resolved, which would hide the other line.
    """
    if shutil.which("pyenv") is None:
        return
    listed = subprocess.run(
        ["pyenv", "versions", "--bare"], capture_output=True, text=True, check=False
    ).stdout.split()
    current = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    for minor in minors:
        if any(v == minor or v.startswith(minor + ".") for v in current):
            continue
        found = [v for v in listed if re.fullmatch(rf"{re.escape(minor)}\.\d+", v)]
        if found:
            current.append(max(found, key=lambda v: int(v.rsplit(".", 1)[1])))
    if current:
        os.environ["PYENV_VERSION"] = ":".join(current)


PYPROJECT = nox.project.load_toml("pyproject.toml")
# Python 3.11 gets the newest JAX it can install (0.10.x); Python 3.12 the newest (0.12.x).
PYTHONS = ["3.11", "3.12"]
ROOT = Path(__file__).parent
_expose_pyenv_interpreters(PYTHONS)
# Bytecode is cached as Python caches it by default: each module when it is first imported.
# Where PYTHONDONTWRITEBYTECODE is set, nothing would be cached and every test subprocess would
# compile JAX from source again; compiling every installed package up front costs more than
# caching what is imported.
os.environ["PYTHONDONTWRITEBYTECODE"] = ""
LAUNCH_HEADER = re.compile(r"^# meshkit-launch:(.*)$", re.MULTILINE)


def install(session: nox.Session, *groups: str) -> None:
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    session.install(".", *deps)
    session.run(
        "python", "-P", "-c", "import jax, jaxlib, numpy; print('jax', jax.__version__, "
        "'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__)"
    )  # fmt: skip


# Six pytest workers, a module to each at a time (a module's warm cluster starts once), handed
# out in collection order: tests/conftest.py puts the modules that mostly wait first. Much of
# the suite's time is waiting (timeouts, watchdogs, paced soaks), so on 2 cores workers beyond
# two still help. Later options win: `nox -s tests -- -n 0` runs in this process, `-- -n 8` in
# eight.
PARALLEL = ["-n", "6", "--dist", "loadfile", "--no-loadscope-reorder"]
# The plugins the suite uses, named instead of found: pytest rewrites the asserts of every
# package that declares a plugin (all of hypothesis, and anyio, which the suite does not use), in
# each pytest process.
PLUGINS = ["-p", "xdist.plugin", "-p", "pytest_timeout", "-p", "_hypothesis_pytestplugin"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Unit, property and multi-process tests against the installed package."""
    install(session, "test")
    env = {
        "MESHKIT_EXPECT_INSTALLED": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        # meshkit.testing forks its ranks from a process that imported JAX once (a second of
        # CPU less per rank than a fresh interpreter).
        "MESHKIT_TESTING_FORK": "1",
    }
    # The slowest tests close the log: the suite has a budget of 6 minutes per Python line.
    session.run("pytest", *PLUGINS, *PARALLEL, "--durations=20", *session.posargs, env=env)


@nox.session(python="3.12")
def lint(session: nox.Session) -> None:
    """ruff format --check, ruff check, pyright."""
    install(session, "lint")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("pyright")


# Examples run two at a time: one that waits (a launcher forming its cluster, a restart) leaves
# the second core to the other.
EXAMPLES_AT_ONCE = 2
EXAMPLE_LIMIT_S = 300  # each example's own limit, as `meshkit launch --timeout` gives it


def _example_command(path: Path) -> list[str]:
    """An example's command: under `meshkit launch` when it has a `# meshkit-launch: ARGS` line."""
    match = LAUNCH_HEADER.search(path.read_text())
    if match:
        args = shlex.split(match.group(1))
        return ["meshkit", "launch", "--timeout", str(EXAMPLE_LIMIT_S), *args, str(path)]
    return ["python", str(path)]


@nox.session(python=PYTHONS)
def examples(session: nox.Session) -> None:
    """Run every example; those with a `# meshkit-launch: ARGS` line under `meshkit launch`.

    Two run at once; each one's output is printed whole, in the examples' order, after its
    command line. Every example runs, and the session fails after naming each that failed.
    """
    install(session, "examples")
    commands = [_example_command(p) for p in sorted((ROOT / "examples").glob("*.py"))]
    bin_dir = session.bin  # the session's venv: its python, and its meshkit
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "VIRTUAL_ENV": str(session.virtualenv.location),
    }
    env.pop("PYTHONHOME", None)

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        argv = [os.path.join(bin_dir, command[0]), *command[1:]]
        try:
            return subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=env, timeout=EXAMPLE_LIMIT_S + 60, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:  # the child was killed
            out = e.output if isinstance(e.output, str) else (e.output or b"").decode()
            return subprocess.CompletedProcess(argv, -9, out + f"\n(killed after {e.timeout} s)")

    failed = []
    with concurrent.futures.ThreadPoolExecutor(EXAMPLES_AT_ONCE) as pool:
        for command, done in zip(commands, pool.map(run, commands), strict=True):
            session.log(shlex.join(command))
            print(done.stdout, end="", flush=True)
            if done.returncode != 0:
                session.warn(f"{shlex.join(command)} failed with exit code {done.returncode}")
                failed.append(Path(command[-1]).name)
    if failed:
        session.error(f"examples failed: {', '.join(failed)}")


@nox.session(python="3.12")
def docs(session: nox.Session) -> None:
    """Build the docs with mkdocs --strict (to build/site)."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", "-d", str(ROOT / "build" / "site"))


@nox.session(python="3.12")
def bench(session: nox.Session) -> None:
    """Benchmarks, side by side in one run; prints ratio tables."""
    install(session, "bench")
    env = {"PYTHONHASHSEED": "0", **{k: v for k, v in os.environ.items() if k == "BENCH_REPEATS"}}
    session.run("python", str(ROOT / "benchmarks" / "run.py"), *session.posargs, env=env)
