"""A `jax.profiler` trace of the same steps of `meshkit.global_batches` in every process.

Asked for by ``meshkit launch --profile-steps A:B`` (``MESHKIT_PROFILE_STEPS``, read by
`meshkit.init`) or by `profile_steps`. A process starts its trace when it takes step A (the
iterator's ``steps``) and stops it when it takes step B+1, else when its data ends or the
process ends; each step is marked with a `jax.profiler.StepTraceAnnotation`, so the viewers
count steps.

JAX writes a trace to ``<dir>/plugins/profile/<timestamp>/<hostname>.xplane.pb``: the timestamp
is each process's own, and the processes of one machine share a hostname. So each process traces
into a scratch directory of its own, then moves its file to
``<dir>/plugins/profile/<run>/<hostname>-rank<k>.xplane.pb``, where ``<run>`` is ``steps_A-B``
(``steps_A-B_attempt<n>`` after a restart): the same in every process without a word between
them. TensorBoard's profile plugin and XProf show the files of one run directory as its hosts,
side by side.

Off, a step costs one test of a module global (`active`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jax import profiler as _jax_profiler

from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.events import DEFAULT_PROFILE_DIR, ENV_PROFILE_DIR, ENV_PROFILE_STEPS
from ..core.frames import public
from ..core.log import logger, say
from . import exit as _exit

_LOG = logger("profiles")
_WHAT = "meshkit.profile_steps"
_MARK = "meshkit.global_batches"  # the steps' name in the trace

_BAD_STEPS = """\
meshkit.profile_steps(start={start!r}, stop={stop!r}): not a range of steps.
start and stop are the first and last step of meshkit.global_batches to trace (the iterator's
steps, counted from 1), whole numbers with 1 <= start <= stop.
Consider e.g. meshkit.profile_steps(10, 12, directory): a few steps after the first, which
compiles."""


class _Profile:
    """The steps to trace in this process, and where the trace goes."""

    def __init__(self, first: int, last: int, directory: str | os.PathLike[str]) -> None:
        self.first, self.last = first, last
        self.directory = Path(directory).absolute()
        attempt = _env.attempt()
        self.run = self.directory / "plugins" / "profile" / f"steps_{first}-{last}"
        if attempt:
            self.run = self.run.with_name(f"{self.run.name}_attempt{attempt}")
        self.state = "waiting"  # then "tracing", then "done"
        self.seen = 0  # the last step taken
        self.mark: Any = None  # the open annotation of the step being traced
        self.scratch: Path | None = None

    def step(self, n: int) -> None:
        """In the program's thread: step ``n`` was taken."""
        self.seen = n
        if self.state == "tracing":
            self._unmark()
            if n > self.last:
                self._stop()
                return
        elif not self.first <= n <= self.last or not self._start():
            return
        self.mark = _jax_profiler.StepTraceAnnotation(_MARK, step_num=n)
        self.mark.__enter__()

    def _unmark(self) -> None:
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None

    def _start(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.scratch = Path(tempfile.mkdtemp(prefix=".meshkit-trace-", dir=self.directory))
            _jax_profiler.start_trace(self.scratch)
        except (OSError, RuntimeError) as e:  # no directory, or a trace of the program's own
            self._end()
            say(_LOG, logging.WARNING, f"meshkit: no profile of {self}: {e}\n")
            return False
        self.state = "tracing"
        return True

    def _end(self) -> None:
        global active
        self.state = "done"
        if active is self:
            active = None  # the steps after cost nothing
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _stop(self) -> Path | None:
        """Stop the trace and move its file into the run directory; the file, or None."""
        self._unmark()
        try:
            _jax_profiler.stop_trace()
            assert self.scratch is not None
            (written,) = self.scratch.glob("plugins/profile/*/*.xplane.pb")
            _, me, n = _compat.distributed_state()
            host = written.name.removesuffix(".xplane.pb")  # the hostname JAX chose
            kept = self.run / f"{host}-rank{me:0{len(str(n - 1))}d}.xplane.pb"
            self.run.mkdir(parents=True, exist_ok=True)
            os.replace(written, kept)
        except (OSError, RuntimeError, ValueError) as e:
            say(_LOG, logging.WARNING, f"meshkit: the trace of {self} was lost: {e!r}\n")
            return None
        finally:
            self._end()
        if me == 0:
            say(
                _LOG,
                logging.INFO,
                f"meshkit: profile of {self}: {self.run} (a trace per process; open it with "
                f"`tensorboard --logdir {self.directory}` or `xprof --logdir {self.directory}`)\n",
            )
        return kept

    def finish(self, *, exiting: bool = True) -> None:
        """The data ended, or the process (``exiting``): stop a trace still running.

        Says when the trace stops short of the last step; at exit, that no step was reached.
        """
        if self.state == "tracing":
            kept = self._stop()
            if kept is not None and self.seen < self.last:
                say(
                    _LOG,
                    logging.WARNING,
                    f"meshkit: the last step was {self.seen}, before step {self.last}: the "
                    f"profile of {self} covers steps {self.first} to {self.seen} ({kept}).\n",
                )
        elif self.state == "waiting" and exiting:
            self._end()
            say(
                _LOG,
                logging.WARNING,
                f"meshkit: no profile of {self} was taken: this process took no step from "
                f"{self.first} to {self.last} (the last step it took: {self.seen or 'none'}).\n",
            )

    def __str__(self) -> str:
        return f"steps {self.first}:{self.last} of {_MARK}"


active: _Profile | None = None  # the steps to trace, until the trace is taken


def take(first: int, last: int, directory: str | os.PathLike[str]) -> str:
    """Trace steps ``first`` to ``last`` into ``directory`` (checked); the run directory."""
    global active
    if active is not None and active.state == "tracing":
        raise MeshkitError(
            f"{_WHAT}: a trace of {active} is being taken; one range of steps at a time.\n"
            "Consider calling it again after that trace has stopped."
        )
    profile = active = _Profile(first, last, directory)
    _exit.on_exit("profile: stop the trace", profile.finish, order=_exit.STOP)
    return str(profile.run)


def from_environment(*, where: str) -> tuple[int, int, str] | None:
    """``MESHKIT_PROFILE_STEPS`` and ``MESHKIT_PROFILE_DIR``; a bad range is refused here."""
    found = _env.steps(ENV_PROFILE_STEPS, where=where)
    if found is None:
        return None
    return (*found, _env.raw(ENV_PROFILE_DIR) or DEFAULT_PROFILE_DIR)


@public
def profile_steps(
    start: int, stop: int, directory: str | os.PathLike[str] = DEFAULT_PROFILE_DIR
) -> str:
    """Take a `jax.profiler` trace of steps ``start`` to ``stop`` of `meshkit.global_batches`.

    What ``meshkit launch --profile-steps A:B --profile-dir D`` asks of every rank, for programs
    started otherwise (srun, mpirun, Ray, by hand): call it in every process with the same
    arguments. A process starts its trace when it takes step ``start`` (the iterator's
    ``steps``, which count on after a resume) and stops it when it takes step ``stop + 1``, or
    when its data ends or the process ends; each step is marked in the trace (a
    `jax.profiler.StepTraceAnnotation`). The traces land in one run directory,
    ``<directory>/plugins/profile/steps_<start>-<stop>`` (``..._attempt<n>`` after a restart),
    one ``<hostname>-rank<k>.xplane.pb`` per process: ``tensorboard --logdir directory`` (with
    its profile plugin) or ``xprof --logdir directory`` shows them side by side. Data that ends
    before ``stop`` keeps the trace taken and says so (a warning under ``meshkit.profiles``); a
    process that ends without reaching ``start`` says that no profile was taken.

    Args:
        start: the first step to trace, from 1.
        stop: the last step to trace, ``start`` or later.
        directory: the directory for the viewers (created when the trace starts); give each
            run its own: a later run replaces the files of the ranks it shares.

    Returns:
        The run directory the traces go to.

    Raises:
        MeshkitError: ``start`` and ``stop`` are not whole numbers with ``1 <= start <= stop``,
            or a trace of other steps is being taken.

    Examples:
        >>> import pathlib, tempfile, numpy as np, meshkit
        >>> run = meshkit.profile_steps(2, 3, tempfile.mkdtemp())
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> loader = ({"x": np.full((8, 2), i, np.float32)} for i in range(5))
        >>> for batch in meshkit.global_batches(loader, mesh, "data"):
        ...     pass  # the trace starts at step 2, stops when step 4 is taken
        >>> [p.name.endswith("-rank0.xplane.pb") for p in pathlib.Path(run).iterdir()]
        [True]
    """
    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
    if not (whole and 1 <= start <= stop):
        raise MeshkitError(_BAD_STEPS.format(start=start, stop=stop))
    if not os.fspath(directory):
        raise MeshkitError(
            f"{_WHAT}: directory is empty.\nConsider a directory for the traces, such as "
            f"{DEFAULT_PROFILE_DIR!r} (the default)."
        )
    return take(start, stop, directory)
