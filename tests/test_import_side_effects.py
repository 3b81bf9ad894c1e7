"""Importing meshkit, or any of its faces, changes nothing in the process.

A fresh interpreter notes what a library could install (signal handlers, hooks, threads,
``atexit`` callbacks, logging handlers, JAX's settings and the functions meshkit touches), then
imports the faces one by one, comparing after each: whatever a module does at import shows
after the first face that imports it. Then meshkit's own lists of hooks are checked to hold only
what they hold before anything registers. Debug mode, fail-fast and the rest start at
`meshkit.init`, `meshkit.debug.enable` or a first call (see ``docs/what-init-installs.md``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = """
import atexit, faulthandler, json, logging, signal, sys, threading
import jax
import jax.experimental.multihost_utils as mu
from jax._src.interpreters import pxla

SIGNALS = [s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                       "SIGALRM", "SIGCHLD") if hasattr(signal, s)]

def snapshot():
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    return {
        "signals": {s: repr(signal.getsignal(getattr(signal, s))) for s in SIGNALS},
        "wakeup fd": wakeup,
        "sys.excepthook": repr(sys.excepthook),
        "threading.excepthook": repr(threading.excepthook),
        "sys.unraisablehook": repr(sys.unraisablehook),
        "faulthandler": faulthandler.is_enabled(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "atexit callbacks": atexit._ncallbacks(),
        "logging": {name or "root": [repr(h) for h in logging.getLogger(name).handlers]
                    + [logging.getLogger(name).level] for name in ("", "meshkit", "jax")},
        "jax.config": {k: repr(v) for k, v in jax.config.values.items()},
        "multihost_utils": {n: id(getattr(mu, n)) for n in dir(mu) if not n.startswith("_")},
        "MeshComputation.compile": id(pxla.MeshComputation.compile),
    }

changed = {}
before = snapshot()
for face, code in json.loads(sys.argv[1]).items():
    exec(code, {})
    after = snapshot()
    changed[face] = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
    before = after

# meshkit's own hook lists hold only what they are born with.
from meshkit._src.debug import divergence as debug_state
from meshkit._src.lifecycle import exit as exit_, preemption, failfast
from meshkit._src.runtime import dispatch, programs, init
own = {
    "dispatch observers": [o.__name__ for o in dispatch.observers],
    "exit handlers": sorted(exit_._registry.exit),
    "exception handler": exit_._registry.exception is not None,
    "atexit installed": exit_._registry.atexit_installed,
    "sigterm taken": exit_._registry.sigterm_wakeup is not None,
    "preemption installed": preemption._state.installed,
    "programs compared": programs.installed(),
    "debug mode": debug_state.enabled(),
    "joined": init.runtime_info() is not None,
}
print(json.dumps({"changed": changed, "own": own}))
"""

_BORN = {
    "dispatch observers": ["_first_call_step"],
    "exit handlers": [],
    "exception handler": False,
    "atexit installed": False,
    "sigterm taken": False,
    "preemption installed": False,
    "programs compared": False,
    "debug mode": False,
    "joined": False,
}

FACES = {
    "meshkit": "import meshkit",
    "meshkit.debug": "import meshkit.debug",
    "meshkit.checkpoint": "import meshkit.checkpoint",
    "meshkit.loaders": "import meshkit.loaders",
    "meshkit.collectives": "import meshkit.collectives",
    "meshkit.testing": "import meshkit.testing",
    "meshkit.cli": "import meshkit.cli",
    # Every public name of the lazy face, loaded: its modules import nothing that acts.
    "every public name": "import meshkit\nfrom meshkit import *",
}


def _probe(faces: dict[str, str], env: dict[str, str]) -> dict:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}, **env}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(faces)],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_a_face_installs_nothing():
    found = _probe(FACES, {"MESHKIT_DEBUG": "1"})  # read at init, not at import
    assert found["changed"] == {face: {} for face in FACES}, found["changed"]
    assert found["own"] == _BORN


def test_the_probe_sees_what_init_installs():
    """The same probe after `meshkit.init` in debug mode: what it checks can fail."""
    env = {"MESHKIT_DEBUG": "1", "MESHKIT_WATCHDOG": "0"}
    found = _probe({"init": "import meshkit\nmeshkit.init()"}, env)
    assert set(found["changed"]["init"]) >= {"signals", "atexit callbacks"}, found
    assert found["own"]["debug mode"], found
    assert found["own"]["preemption installed"], found
    assert "preemption: record how this process ended" in found["own"]["exit handlers"], found
