"""The fork server's own process: import JAX once, then fork each rank from here.

Usage (`meshkit.testing._forks.ForkServer` starts it): ``python -c CODE FD MODULE...``, where
``CODE`` loads this file by its path (not through ``meshkit.testing``, which imports JAX) and
calls `main`, ``FD`` is its end of a ``SOCK_SEQPACKET`` pair with the test process, and the
modules are imported before any fork.

Messages are JSON, one per packet. The server says ``{"ready": true}`` once it has imported
the modules. The test process then sends ``{"id", "argv", "env", "cwd"}``
with two file descriptors attached (the rank's stdout and stderr); the server answers ``{"id",
"pid"}`` once the rank is forked, and ``{"exit": pid, "code": returncode}`` when it ends
(``returncode`` as `subprocess.Popen` gives it: negative for a signal). The server ends when the
test process closes its end.

Each rank is a child forked from this process after JAX, numpy and meshkit were imported, and
before anything started: no backend, no thread but OpenBLAS's pool (which prepares itself for
``fork``). The child then becomes what ``python ARGV`` would have been: its own session, its
stdio on the given pipes, the given environment (``os.environ`` replaced, so that ``getenv``
in XLA reads it too), working directory, ``sys.argv`` and ``sys.path[0]``, and numpy's global
random state seeded afresh. It runs the program as ``__main__`` and exits as the interpreter
would: ``SystemExit``'s code, or 1 after ``sys.excepthook`` printed the traceback (from the
program's first frame, as ``python`` prints it). One difference is wanted: the objects the
imports made are frozen (`gc.freeze`), so the rank's garbage collections never walk them.

What a fork cannot give is only what Python and the libraries read from the environment while
they import: `forks.import_environment` names those variables, and the test process uses a
server whose start-up environment has the rank's values of them (or starts the rank fresh).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import warnings
from types import TracebackType
from typing import Any

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1
_MAX_PACKET = 1 << 20


def _send(sock: socket.socket, message: dict[str, Any]) -> bool:
    """Send one message; False when the test process is gone."""
    try:
        sock.sendall(json.dumps(message).encode())
    except OSError:
        return False
    return True


def _reap(sock: socket.socket) -> bool:
    """Tell the test process about every child that has ended; False when it is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if not _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)}):
            return False


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork a rank for each request; in a child, return its request; None when told to end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    me = os.getpid()
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    if not _reap(sock):
                        return None
                    continue
                data, fds, _, _ = socket.recv_fds(sock, _MAX_PACKET, 2)
                if not data:
                    return None  # the test process is gone; the ranks die with us
                request = json.loads(data)
                with warnings.catch_warnings():
                    # Python 3.12 warns of any thread at fork; the one here is OpenBLAS's, whose
                    # own fork handlers make it safe.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    selector.close()
                    _become(request, fds, sock, me)
                    return request
                for fd in fds:
                    os.close(fd)
                if not _send(sock, {"id": request["id"], "pid": pid}):
                    return None


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket, parent: int) -> None:
    """In a new child: take the rank's session, stdio, environment and place."""
    os.setsid()  # its own group, killed as a whole, as a fresh rank
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)  # the server is already gone
    sock.close()
    out, err = fds
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    os.chdir(request["cwd"] or os.getcwd())
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh process draws its own seed; forked ones would share one
        numpy.random.seed()


def _program_traceback(tb: TracebackType | None, skip: tuple[str, ...]) -> TracebackType | None:
    """``tb`` from the first frame ``python`` itself would show (those in ``skip`` left out)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return tb


def _run(request: dict[str, Any]) -> None:
    """Run the rank's program as ``python ARGV`` would (a ``SystemExit`` goes on up)."""
    argv: list[str] = request["argv"]
    sys.orig_argv = [sys.orig_argv[0], *argv]  # a rank that starts itself again runs itself
    skip: tuple[str, ...] = (__file__,)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            # What ``python -m`` calls: its frames show in a traceback there too.
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            skip = (__file__, runpy.__file__, "<frozen runpy>")  # python runs a script itself
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # the interpreter's top level: print it, exit 1
        tb = _program_traceback(e.__traceback__, skip)
        # As the interpreter does before its excepthook (exit handlers read them).
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = e
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):
            # As python does: finish, then die of the signal (the exit status says SIGINT).
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def main() -> None:
    """The server's main: preload, serve; in each forked rank, run its program and exit."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:]:
        __import__(name)
    # What the preload made lives as long as the rank: moved out of the collector's reach, a
    # rank's full collections walk only its own objects.
    gc.freeze()
    if not _send(sock, {"ready": True}):
        return
    request = _serve(sock)
    if request is not None:
        _run(request)
