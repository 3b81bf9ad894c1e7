"""A loop that a preemption notice (SIGTERM) reaches mid-run, for the preemption tests.

    python preempted.py ROOT MODE [--victim P] [--at S] [--every K] [--again] [--kill-in-save]
                             [--restore] [--during-init]

Each step adds 1 to a replicated array ``x`` and sleeps 50 ms; process ``--victim`` (default 1)
sends itself SIGTERM after step ``--at`` (default 5). MODE says how the program checks:

- ``jax``: JAX's documented protocol, ``multihost_utils.reached_preemption_sync_point(step)``
  at every step, a save there, then the end of the loop; beside it, orbax's
  ``CheckpointManager`` (under ``ROOT/orbax``) saves when its ``should_save`` says so (orbax
  asks JAX's sync point too);
- ``should``: ``meshkit.checkpoint.should_save(step, every=K)`` and ``save`` (which ends the
  program after the preemption save);
- ``none``: never (meshkit's deadline ends it).

``--again``: the victim sends itself a second SIGTERM while the preemption save runs.
``--kill-in-save``: every save holds 32 MiB more, and the victim SIGKILLs itself once orbax's
temporary directory of the preemption save is there.
``--restore``: restore the latest step under ROOT first (the victim's SIGTERM then arrives
during that restore, instead of after step ``--at``). ``--during-init``: the victim's SIGTERM
arrives while ``meshkit.init`` joins. ``--ready DIR``: every process writes ``DIR/ready<p>``
after step 3 (for a test to send its signal from outside). Every process prints ``SAVED step`` after a save it made
and ``END step`` when its loop ends.
"""

import argparse
import os
import signal
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("root")
parser.add_argument("mode", choices=["jax", "should", "none"])
parser.add_argument("--victim", type=int, default=1)
parser.add_argument("--at", type=int, default=5)
parser.add_argument("--every", type=int, default=1000)
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--again", action="store_true")
parser.add_argument("--kill-in-save", action="store_true")
parser.add_argument("--restore", action="store_true")
parser.add_argument("--during-init", action="store_true")
parser.add_argument("--ready", default=None)
args = parser.parse_args()
args.root = os.path.abspath(args.root)
victim = int(os.environ.get("MESHKIT_PROCESS_ID", "0")) == args.victim


def signal_self(sig: int, after: float = 0.0) -> None:
    threading.Timer(after, os.kill, (os.getpid(), sig)).start()


import meshkit  # noqa: E402

init = meshkit.init  # imports JAX
if args.during_init:
    if victim:  # while it waits in init for process 0, which comes half a second later
        signal_self(signal.SIGTERM, 0.1)
    else:
        time.sleep(0.5)
init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

me = jax.process_index()
mesh = meshkit.make_mesh({"data": -1})
x = jax.jit(lambda: jnp.zeros(4, np.float32), out_shardings=NamedSharding(mesh, P()))()
start = 1
if args.restore:
    found = meshkit.checkpoint.latest(args.root)
    assert found is not None
    if victim:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs within the restore's first lines
    restored = meshkit.checkpoint.restore(found.path, mesh, like={"x": x, "step": 0})
    x, start = restored["x"], restored["step"] + 1
    print(f"RESTORED {found.step} {float(np.asarray(x.addressable_data(0))[0])}", flush=True)
step_fn = jax.jit(lambda a: a + 1)
manager = None
if args.mode == "jax":
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(save_interval_steps=args.every)
    manager = ocp.CheckpointManager(os.path.join(args.root, "orbax"), options=options)


def kill_when_written(step: int) -> None:
    """SIGKILL this process once orbax's temporary directory of ``step`` is there."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(p.startswith(f"step_{step}.orbax-checkpoint-tmp") for p in os.listdir(args.root)):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.001)


def save(step: int) -> None:
    """meshkit's save of this step, with the victim's second signal or crash during it."""
    tree = {"x": x, "step": step}
    if args.kill_in_save:  # 32 MiB, half from each process: the save takes a while
        tree["big"] = meshkit.global_array_from_local(
            np.full((8 // jax.process_count(), 1 << 20), step, np.float32), mesh, "data"
        )
    if victim and meshkit.preemption_notice() is not None:
        if args.again:
            signal_self(signal.SIGTERM, 0.02)
        if args.kill_in_save:
            threading.Thread(target=kill_when_written, args=(step,), daemon=True).start()
    meshkit.checkpoint.save(meshkit.checkpoint.step_path(args.root, step), tree)


step = start
for step in range(start, args.steps + 1):
    x = step_fn(x)
    if victim and step == args.at and not (args.restore or args.during_init):
        os.kill(os.getpid(), signal.SIGTERM)
    if args.ready and step == 3:
        open(os.path.join(args.ready, f"ready{me}"), "w").close()
    if args.mode == "jax":
        from jax.experimental import multihost_utils

        assert manager is not None
        if manager.should_save(step):  # every K steps, and at JAX's sync point
            manager.save(step, args=ocp.args.StandardSave({"x": x}))
            manager.wait_until_finished()
            print(f"ORBAX {step}", flush=True)
        if multihost_utils.reached_preemption_sync_point(step):
            save(step)
            print(f"SAVED {step}", flush=True)
            break
    elif args.mode == "should" and meshkit.checkpoint.should_save(step, every=args.every):
        print(f"SAVING {step}", flush=True)
        save(step)
        print(f"SAVED {step}", flush=True)
    time.sleep(0.05)
if manager is not None:
    manager.close()
print(f"END {step}", flush=True)
