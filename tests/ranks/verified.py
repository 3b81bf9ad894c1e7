"""What the processes of `tests/test_verified.py` run: each function is one program's body.

The launched processes import this module, not the test module: they need meshkit, JAX and
numpy, not pytest.
"""

from __future__ import annotations

import os

STEPS = 20
CHANGE = 15  # after PERIOD steps of one layout

# rows per process and step, by case: (process 0's, process 1's) from the step on
CASES = {
    "one": {CHANGE: (8, 4)},  # process 1 alone changes
    "both": {CHANGE: (16, 4)},  # both change, differently
    "back": {CHANGE: (16, 16), CHANGE + 1: (8, 16)},  # a change together, then 0 goes back
}


def rows_of(case: str, process: int, step: int) -> int:
    rows = 8
    for start, pair in sorted(CASES[case].items()):
        if step >= start:
            rows = pair[process]
    return rows


def steps():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import meshkit

    case = os.environ["VERIFIED_CASE"]
    mesh = meshkit.make_mesh({"data": -1})
    total = jax.jit(jnp.sum)
    me = jax.process_index()
    for step in range(1, STEPS + 1):
        local = np.ones((rows_of(case, me, step), 3), np.float32)
        x = meshkit.global_array_from_local(local, mesh, "data")
        print(f"returned {step} {list(x.shape)}", flush=True)
        print(f"computed {step} {float(total(x))}", flush=True)


def caught():
    """Process 1 changes its layout at `CHANGE`, catches the error, and goes on (values by step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    total = jax.jit(jnp.sum)
    me = jax.process_index()
    for step in range(1, STEPS + 1):
        rows = 4 if (me, step) == (1, CHANGE) else 8
        local = np.full((rows, 3), float(step), np.float32)
        try:
            x = meshkit.global_array_from_local(local, mesh, "data")
        except meshkit.MeshkitError as e:
            print(f"raised {step} {' '.join(str(e).split())}", flush=True)
            continue
        print(f"returned {step} {list(x.shape)}", flush=True)
        print(f"computed {step} {float(total(x))}", flush=True)


def caught_in_debug_mode():
    """`caught`, with `meshkit.spmd` steps under debug mode (each call checked before it runs)."""
    import jax
    import numpy as np

    import meshkit
    from meshkit import collectives as C

    mesh = meshkit.make_mesh({"data": -1})
    total = meshkit.spmd(
        lambda x: C.psum(x.sum(), "data"), mesh=mesh, in_specs="data", out_specs=""
    )
    me = jax.process_index()
    for step in range(1, STEPS + 1):
        rows = 4 if (me, step) == (1, CHANGE) else 8
        try:
            value = total(np.full((rows, 3), float(step), np.float32))
        except meshkit.MeshkitError as e:
            print(f"raised {step} {' '.join(str(e).split())}", flush=True)
            continue
        print(f"computed {step} {float(value)}", flush=True)


def threads():
    import json
    import threading

    import jax
    import numpy as np

    import meshkit

    mesh = meshkit.make_mesh({"data": -1})
    me = jax.process_index()
    lock = threading.Lock()

    def say(**fields) -> None:
        with lock:
            print(json.dumps(fields), flush=True)

    def work(name: str) -> None:
        with meshkit.channel(name):
            for step in range(1, STEPS + 1):
                rows = 4 if (name, me) == ("b", 1) and step >= CHANGE else 8
                try:
                    meshkit.global_array_from_local(np.ones((rows, 3), np.float32), mesh, "data")
                except meshkit.MeshkitError as e:
                    say(thread=name, error=str(e))
                    return
                say(thread=name, returned=step)

    threads = [threading.Thread(target=work, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meshkit.barrier("end")  # raises what was found beside the caller, if nothing did yet
