"""One worker of a `meshkit.testing.WarmCluster`: join the cluster once, then run test bodies.

Usage (the cluster starts it through meshkit's launcher):
``python -m meshkit.testing._warm_worker HOST PORT TOKEN``.

The worker calls `meshkit.init`, connects to the test process at ``HOST:PORT``, and runs each
`Call` it receives in its main thread, answering with a `Reply`. It ends when the test process
says so or goes away.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
import socket
import sys
import threading
import traceback
from types import ModuleType

from .._src.core.events import ENV_PROCESS_ID
from ._wire import Call, Hello, Reply, receive, send
from ._worker import attribute, load_module

# A body still running when the test process has gone would hold this rank, and the cluster's
# other ranks with it, until the launcher's own timeout: end at once instead.
_ORPHANED_EXIT_CODE = 70


def _listen(
    sock: socket.socket, calls: queue.SimpleQueue[Call | None], busy: threading.Event
) -> None:
    while True:
        message = receive(sock)
        if not isinstance(message, Call):  # closed, or told to stop
            calls.put(None)
            if message is None and busy.is_set():
                os._exit(_ORPHANED_EXIT_CODE)
            return
        calls.put(message)


def _run(call: Call, modules: dict[str, ModuleType]) -> Reply:
    from .._src.coord import agree, agreement  # imported by meshkit.init before the first call

    # Every rank returned from the body before (the test process waits for all of them): every
    # channel's sequence starts again, under new keys. Device work it dispatched may still be
    # pending; `WarmCluster`'s docstring says which bodies to avoid.
    node = agree._node
    if node is not None:
        with node.lock:
            for name, state in list(node.sequences.items()):
                node.sequences[name] = agreement.Sequence(epoch=state.epoch + 1, later=state.later)
    saved = {name: os.environ.get(name) for name in call.env}
    os.environ.update(call.env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            if call.file not in modules:  # imported once: bodies share its module state
                modules[call.file] = load_module(call.file)
            value = attribute(modules[call.file], call.qualname)(*call.args)
            data = pickle.dumps(value)
    except BaseException:
        return Reply(None, out.getvalue(), traceback.format_exc())
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
    return Reply(data, out.getvalue(), None)


def main(argv: list[str]) -> None:
    """Join the cluster, connect to the test process, run calls until told to stop."""
    host, port, token = argv
    # Say who we are before joining, so that the test process can end a rank stuck in init.
    sock = socket.create_connection((host, int(port)))
    send(sock, Hello(token, int(os.environ.get(ENV_PROCESS_ID, "0")), os.getpid()))
    import meshkit

    meshkit.init()
    send(sock, Reply(None, "", None))  # joined: ready for calls
    calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
    busy = threading.Event()
    listener = threading.Thread(
        target=_listen, args=(sock, calls, busy), name="meshkit-warm-listen", daemon=True
    )
    listener.start()
    modules: dict[str, ModuleType] = {}
    while (call := calls.get()) is not None:
        busy.set()
        reply = _run(call, modules)
        busy.clear()
        with contextlib.suppress(OSError):  # the test process stopped waiting and closed
            send(sock, reply)
    sock.close()


if __name__ == "__main__":
    main(sys.argv[1:])
