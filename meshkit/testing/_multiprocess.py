"""Run a function, or a script, in N real processes through the meshkit launcher."""

from __future__ import annotations

import inspect
import os
import pickle
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._src.core.errors import LaunchError
from .._src.launch.launcher import LaunchResult, launch
from ._forks import starter

__all__ = ["launch_in_processes", "run_in_processes"]

Target = Callable[[], Any] | str | os.PathLike[str]


def function_location(fn: Callable[..., Any]) -> tuple[str, str]:
    """The file and qualified name from which another process imports ``fn`` again.

    Raises:
        LaunchError: ``fn`` is a lambda, a nested function, or has no source file.
    """
    qualname = getattr(fn, "__qualname__", "")
    source = inspect.getsourcefile(fn)
    if "<locals>" in qualname or "<lambda>" in qualname or source is None:
        raise LaunchError(
            f"meshkit.testing: {fn!r} cannot be run in other processes; each process "
            "imports it again from its file, so it must be a module-level function.\n"
            "Consider moving it to the top level of its module."
        )
    return source, qualname


def _command(target: Target, out_dir: str, init: bool, args: Sequence[str]) -> list[str]:
    if callable(target):
        source, qualname = function_location(target)
        flag = "--init" if init else "--no-init"
        return ["-m", "meshkit.testing._worker", source, qualname, out_dir, flag]
    return [os.fspath(Path(target).resolve()), *args]


def launch_in_processes(
    target: Target,
    *,
    num_processes: int = 2,
    devices_per_process: int | None = 4,
    timeout: float = 120.0,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    init: bool = True,
    stream: bool = False,
    fork: bool | None = None,
    preload: Sequence[str] = (),
) -> LaunchResult:
    """Launch ``target`` in ``num_processes`` processes; return the `LaunchResult`.

    Args:
        target: a module-level function taking no arguments (each process imports its module
            from its file, calls `meshkit.init` unless ``init=False``, then calls it), or
            the path of a script run with ``args``.
        num_processes: processes to start.
        devices_per_process: CPU devices per process (None: JAX's default).
        timeout: seconds before every process is killed; a test never hangs.
        args: command-line arguments for a script target.
        env: extra environment variables for every process.
        init: for function targets, whether to call `meshkit.init` first. For any target,
            False also accepts processes that never join one program (each then runs as a
            program of one process); with True such a run fails, as under ``meshkit launch``.
        stream: also print the processes' output as it comes.
        fork: start each process by forking one that imported JAX once (Linux; it saves
            about a second of CPU per process), instead of a fresh ``python`` each as
            ``meshkit launch`` starts them. Forked processes share one hash seed (the
            iteration order of sets of strings), so a test of what differs between fresh
            interpreters needs fresh ones. None: fork when ``MESHKIT_TESTING_FORK=1``.
            A target that cannot be forked starts fresh.
        preload: when forking, modules to import once before the processes are forked (they
            must import without starting anything): a target that uses flax, orbax or grain
            then skips their import in every process, e.g.
            ``preload=("orbax.checkpoint", "flax.nnx")``. Fresh processes import as usual.

    Returns:
        The launch result; for function targets, ``result.values`` holds what each rank
        returned (None for a rank that failed).
    """
    with tempfile.TemporaryDirectory(prefix="meshkit-mp-") as tmp:
        full_env = {"MESHKIT_INIT_TIMEOUT": str(max(5, int(timeout)))}
        full_env.update(env or {})
        result = launch(
            _command(target, tmp, init, args),
            num_processes=num_processes,
            devices_per_process=devices_per_process,
            timeout=timeout,
            platform="cpu",
            env=full_env,
            cwd=tmp,  # not the source tree: ranks must import the installed meshkit
            stream=stream,
            keep_output=True,
            grace=1.0,
            starter=starter(fork, "meshkit.testing.launch_in_processes", preload),
            allow_unjoined=not init,
        )
        values: list[Any] = []
        for r in range(num_processes):
            path = Path(tmp) / f"rank{r}.pkl"
            values.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    result.values = values
    return result


def run_in_processes(
    fn: Callable[[], Any],
    *,
    num_processes: int = 2,
    devices_per_process: int | None = 4,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    init: bool = True,
    fork: bool | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Call the module-level ``fn`` in ``num_processes`` processes; return each one's value.

    Each process runs through meshkit's launcher with ``devices_per_process`` CPU devices and
    calls `meshkit.init` before ``fn``. Return values must pickle (convert JAX arrays
    with ``np.asarray``).

    Args:
        fn: a function defined at the top level of an importable file.
        num_processes: processes to start.
        devices_per_process: CPU devices per process.
        timeout: seconds before every process is killed.
        env: extra environment variables.
        init: whether to call `meshkit.init` before ``fn``.
        fork: fork each process from one that imported JAX once (see `launch_in_processes`);
            None: when ``MESHKIT_TESTING_FORK=1``.
        preload: when forking, modules to import once before forking (see
            `launch_in_processes`).

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        LaunchError: a process failed or the run timed out; the message holds the root cause
            and every rank's output.

    Examples:
        ```python
        def body():
            import jax
            return jax.process_index(), jax.device_count()

        def test_two_processes():
            assert meshkit.testing.run_in_processes(body) == [(0, 8), (1, 8)]
        ```
    """
    result = launch_in_processes(
        fn,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        timeout=timeout,
        env=env,
        init=init,
        fork=fork,
        preload=preload,
    )
    if result.returncode != 0:
        outputs = "\n".join(
            f"--- rank {r.rank} (exit {r.returncode}) stdout ---\n{r.stdout}\n"
            f"--- rank {r.rank} stderr ---\n{r.stderr}"
            for r in result.ranks
        )
        raise LaunchError(f"{result.report}\n{outputs}")
    return result.values
