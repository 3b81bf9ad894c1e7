"""meshkit.checkpoint with 2 processes x 4 CPU devices: save, restore anywhere, kill mid-save.

Functions starting with an underscore run inside the launched processes (each imports this file
again); the checkpoint directory comes through MESHKIT_TEST_CKPT. Every process builds the same
numpy references from a shared seed. The tests that kill a rank start `meshkit launch`
themselves, watch orbax's temporary directory appear, SIGKILL the rank, and then read what is
left in this (single, 8-device) process.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ranks.preloads import ECOSYSTEM

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.waits,
    pytest.mark.warm_cluster(preload=ECOSYSTEM),
]

_CKPT = "MESHKIT_TEST_CKPT"
_KILLED = "MESHKIT_TEST_KILLED"  # the rank a test kills mid-save


def require(module, why):
    """conftest's `require`, imported here only: conftest sets 8 CPU devices, which the launched
    processes (each importing this file) must not get."""
    from conftest import require as required

    return required(module, why)


@pytest.fixture(autouse=True)
def _leave_no_process(marker, monkeypatch):
    require("orbax.checkpoint", "orbax")
    monkeypatch.setenv("MESHKIT_TEST_MARKER", marker)


def _reference():
    rng = np.random.default_rng(0)
    return {
        "a": rng.standard_normal((16, 8)).astype(np.float32),
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "rows": rng.standard_normal((8, 3)).astype(np.float32),
    }


def _expected():
    """What the saved tree holds, as numpy: the leaves of `_saved_tree`."""
    ref = _reference()
    return {
        "a": ref["a"],
        "p": ref["rows"] * 2,
        "r": {"w": np.broadcast_to(ref["w"], (8, 3, 5))},
        "step": 5,
    }


# Per target mesh: the spec of every array (None: the one it was saved with).
LAYOUTS = {
    "2x4": ({"data": 2, "model": 4}, {"a": None, "p": "(data model)", "r": {"w": "data"}}),
    "1x8": ({"data": 1, "model": 8}, {"a": None, "p": "model", "r": {"w": "model"}}),
    "8x1": ({"data": 8, "model": 1}, {"a": None, "p": "data", "r": {"w": "data _ _"}}),
}


def _saved_tree(ref):
    import jax

    import meshkit

    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    part = meshkit.process_slice(mesh, "data model", ref["a"].shape)
    n, p = jax.local_device_count(), jax.process_index()
    double = meshkit.pmap_compat(lambda x: x * 2, "i", global_outputs=True)
    return {
        "a": meshkit.global_array_from_local(part.take(ref["a"]), mesh, "data model"),
        "r": meshkit.replicate({"w": ref["w"]}),
        "p": double(ref["rows"][p * n : (p + 1) * n]),  # this process's entries, a global output
        "step": 5,
    }


def _check_restored(out, expected):
    """Every shard this process holds equals the reference's block; the gathered values too."""
    import jax

    import meshkit

    for (path, x), want in zip(
        jax.tree_util.tree_flatten_with_path(out)[0], jax.tree_util.tree_leaves(expected),
        strict=True,
    ):  # fmt: skip
        if not isinstance(x, jax.Array):
            assert x == want, (path, x, want)
            continue
        assert x.shape == want.shape, (path, x.shape)
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
        np.testing.assert_array_equal(meshkit.gather(x), want)


def _errors_of(call):
    import meshkit

    try:
        call()
    except meshkit.MeshkitError as e:
        return str(e)
    return None


def _save_restore_and_refuse():
    import jax
    from jax.sharding import Mesh

    import meshkit

    root = Path(os.environ[_CKPT])
    ref = _reference()
    tree = _saved_tree(ref)
    specs_saved = {k: str(tree[k].sharding.spec) for k in ("a", "p")}
    meshkit.checkpoint.save(root / "c", tree)
    restored = {}
    for name, (axes, specs) in LAYOUTS.items():
        mesh = meshkit.make_mesh(axes)
        out = meshkit.checkpoint.restore(root / "c", mesh, {**specs, "step": None})
        _check_restored(out, _expected())
        restored[name] = {k: str(out[k].sharding.spec) for k in ("a", "p")}
    # Bad inputs: every process raises the same error, none is left inside orbax.
    by_process = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    six = Mesh(np.array(by_process[0][:3] + by_process[1][:3]).reshape(3, 2), ("data", "model"))
    half = Mesh(np.array(by_process[0]), ("x",))
    rows = ref["rows"][jax.process_index() * 4 : jax.process_index() * 4 + 4]
    local = meshkit.pmap_compat(lambda x: x * 2, "i")(rows)  # global_outputs=False: per process
    errors = {
        "six devices": _errors_of(lambda: meshkit.checkpoint.restore(root / "c", six)),
        "one process's mesh": _errors_of(lambda: meshkit.checkpoint.restore(root / "c", half, "")),
        "process-local": _errors_of(lambda: meshkit.checkpoint.save(root / "local", {"p": local})),
        "host values differ": _errors_of(
            lambda: meshkit.checkpoint.save(
                root / "differ", {"a": tree["a"], "seed": np.array([jax.process_index()])}
            )
        ),
        "directories differ": _errors_of(
            lambda: meshkit.checkpoint.save(root / f"p{jax.process_index()}", {"a": tree["a"]})
        ),
        "specs differ": _errors_of(
            lambda: meshkit.checkpoint.restore(
                root / "c",
                meshkit.make_mesh({"data": 2, "model": 4}),
                {
                    "a": "data model" if jax.process_index() == 0 else "_ model",
                    "p": "data",
                    "r": "data",
                    "step": None,
                },
            )
        ),
    }
    # The fix the process-local message names: the same values, as a global array.
    fixed = meshkit.global_array_from_local(local, meshkit.make_mesh({"i": -1}), "i")
    meshkit.checkpoint.save(root / "fixed", {"p": fixed})
    back = meshkit.checkpoint.restore(root / "fixed", meshkit.make_mesh({"i": -1}))
    np.testing.assert_array_equal(meshkit.gather(back["p"]), ref["rows"] * 2)
    # A process that never comes (process 1 skips the call): named, after MESHKIT_CHECK_TIMEOUT.
    # Last in the body: process 1 is one agreement behind from here on (its next agreement would
    # meet process 0's check_savable and raise that the processes are at different
    # agreements); the next body starts every sequence again.
    os.environ["MESHKIT_CHECK_TIMEOUT"] = "5"
    if jax.process_index() == 0:
        errors["one process only"] = _errors_of(
            lambda: meshkit.checkpoint.check_savable({"a": tree["a"]})
        )
    else:
        time.sleep(6)
    os.environ["MESHKIT_CHECK_TIMEOUT"] = "60"
    return {
        "saved specs": specs_saved,
        "restored": restored,
        "errors": errors,
        "left": sorted(p.name for p in root.iterdir()),
    }


@pytest.mark.timeout(600)  # one launch of about a minute, 2 on a busy machine
def test_save_in_two_processes_restore_onto_other_meshes_and_refuse_bad_inputs(
    tmp_path, warm_cluster
):
    ocp = require("orbax.checkpoint", "orbax")
    results = warm_cluster.run(
        _save_restore_and_refuse,
        timeout=400,
        env={_CKPT: str(tmp_path), "MESHKIT_CHECK_TIMEOUT": "60"},
    )
    first, second = results
    assert first["restored"] == second["restored"]
    assert first["restored"]["1x8"]["a"] == first["saved specs"]["a"]  # the saved spec, reused
    assert "'i'" in first["saved specs"]["p"]  # pmap_compat's global output: its mapped axis
    errors = first["errors"]
    alone = errors.pop("one process only")
    assert alone.startswith(
        "meshkit.checkpoint.check_savable: process 1 did not reach this call within 5 s (the "
        "others did).\nEvery process must save the same tree, in the same order."
    ), alone
    assert errors == second["errors"]  # every process raised, with the same message
    assert (
        "array ['a'] (saved shape (16, 8), float32) cannot be restored with "
        in (errors["six devices"])
    )
    assert (
        "on the mesh {'data': 3, 'model': 2} (6 devices): dimension 0 (size 16) is split "
        in (errors["six devices"])
    )
    assert errors["one process's mesh"].startswith(
        "meshkit.checkpoint.restore: the mesh {'x': 4} (4 devices) has no device of process 1, "
        "in a program of 2 processes."
    ), errors["one process's mesh"]
    assert "Consider a mesh over every process's devices" in errors["one process's mesh"]
    local = errors["process-local"]
    assert local.startswith(
        "meshkit.checkpoint.save: the leaf ['p'] is a process-local array: shape (4, 3) on this "
        "process's 4 devices only, in a program of 2 processes."
    ), local
    assert "pmap_compat returns by default (global_outputs=False)" in local
    assert "Consider pmap_compat(..., global_outputs=True)" in local
    assert 'meshkit.global_array_from_local(x, meshkit.make_mesh({"i": -1}), "i")' in local
    differ = errors["host values differ"]
    assert re.match(
        r"meshkit.checkpoint.save: processes 0 and 1 differ at the leaf \['seed'\]: a host value "
        r"of shape \(1,\), int64, contents digest \w+ on process 0, a host value of shape \(1,\), "
        r"int64, contents digest \w+ on process 1.\nEvery process must save the same tree.",
        differ,
    ), differ
    assert errors["directories differ"].startswith(
        f"meshkit.checkpoint.save: processes 0 and 1 differ at the directory: {tmp_path}/p0 on "
        f"process 0, {tmp_path}/p1 on process 1.\nEvery process must save the same tree.\n"
        "Consider a path every process computes the same way, on a filesystem they all see"
    ), errors["directories differ"]
    assert errors["specs differ"].startswith(
        "meshkit.checkpoint.restore: processes 0 and 1 differ at the array ['a']: shape (16, 8), "
        "float32, restored with data model on process 0, shape (16, 8), float32, restored with "
        "_ model on process 1.\nEvery process must restore the same way."
    ), errors["specs differ"]
    # Nothing was written for the refused saves, not even orbax's temporary directory.
    assert first["left"] == ["c", "fixed"], first["left"]
    # One process with 8 devices reads what 2 processes wrote, onto each mesh shape.
    import meshkit

    for axes, specs in LAYOUTS.values():
        out = meshkit.checkpoint.restore(
            tmp_path / "c", meshkit.make_mesh(axes), specs | {"step": None}
        )
        _check_restored(out, _expected())
    del ocp


# ---- a rank killed mid-save --------------------------------------------------------------------


def _big_tree(seed, rows):
    """16 arrays of ``rows`` x 8 float32 over "data" (every process makes the same values)."""
    import meshkit

    mesh = meshkit.make_mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(16):
        full = rng.standard_normal((rows, 8)).astype(np.float32)
        part = meshkit.process_slice(mesh, "data", full.shape)
        out[f"a{i}"] = meshkit.global_array_from_local(part.take(full), mesh, "data")
    return out


def _save_two_steps():
    import jax
    import orbax.checkpoint as ocp

    root = Path(os.environ[_CKPT])
    handler = ocp.StandardCheckpointHandler()
    with ocp.CheckpointManager(root, item_handlers=handler) as manager:
        manager.save(1, args=ocp.args.StandardSave(_big_tree(1, 1024)))
        manager.wait_until_finished()
        print("step 1 saved", flush=True)
        manager.save(2, args=ocp.args.StandardSave(_big_tree(2, 2**18)))  # 128 MiB
        if os.environ.get(_KILLED) == str(jax.process_index()):
            # The rank the test kills: its writes go on in orbax's threads while the main
            # thread waits here, so it is killed with step 2 unfinished however busy the
            # machine is (waiting in wait_until_finished, a fast save could end first).
            time.sleep(600)
        manager.wait_until_finished()
        print("step 2 saved", flush=True)


class _Run:
    """`meshkit launch` in the background, its output collected line by line."""

    def __init__(self, command, env, cwd):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshkit", "launch", "-n", "2", "-d", "4", "--grace", "1",
             "--timeout", "400", *command],
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, ready, what, timeout=300.0):
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {what}:\n" + "\n".join(self.lines))
            time.sleep(0.01)

    def rank_pid(self, marker, rank):
        from conftest import processes_with_marker

        for pid in processes_with_marker(marker):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"MESHKIT_PROCESS_ID={rank}".encode() in environ:
                return pid
        raise AssertionError(f"no rank {rank} among {processes_with_marker(marker)}")

    def finish(self, timeout=120.0):
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.reader.join(timeout=10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return self.proc.returncode, "\n".join(self.lines)


def _digests(directory):
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.timeout(900)  # 2 to 3 minutes on a busy 2-core machine
@pytest.mark.parametrize("killed", [1, 0], ids=["rank1", "rank0-the-primary"])
def test_a_rank_killed_mid_save_loses_nothing_of_the_previous_checkpoint(tmp_path, marker, killed):
    ocp = require("orbax.checkpoint", "orbax")
    import meshkit

    root = tmp_path / "run"
    command = [
        "-m",
        "meshkit.testing._worker",
        __file__,
        "_save_two_steps",
        str(tmp_path),
        "--init",
    ]
    env = {_CKPT: str(root), _KILLED: str(killed), "MESHKIT_INIT_TIMEOUT": "120"}
    run = _Run(command, env, tmp_path)
    try:
        run.wait_for(lambda: any("step 1 saved" in line for line in run.lines), "step 1 saved")
        before = _digests(root / "1")
        # Rank `killed` is writing step 2's shards: each process writes its own store there.
        writing = lambda: list(  # noqa: E731
            root.glob(f"2{_TMP}*/default{_TMP}*/ocdbt.process_{killed}")
        )
        run.wait_for(lambda: bool(writing()), "step 2's temporary directory being written")
        os.kill(run.rank_pid(marker, killed), signal.SIGKILL)
    finally:
        code, output = run.finish()
    assert code != 0, output
    assert f"rank {killed} failed first (killed by SIGKILL)" in output, output
    assert "step 2 saved" not in output
    names = sorted(p.name for p in root.iterdir())
    assert names == ["1", f"2{_TMP}"], names  # step 2 never committed: only its temporary dir
    assert _digests(root / "1") == before  # step 1: every file as it was
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True)) as m:
        assert m.all_steps() == [1]  # the unfinished step is not taken as a checkpoint
        assert m.latest_step() == 1
    expected = {k: np.asarray(meshkit.gather(v)) for k, v in _big_tree(1, 1024).items()}
    out = meshkit.checkpoint.restore(root / "1" / "default", meshkit.make_mesh({"data": 8}))
    for k, v in expected.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    with pytest.raises(meshkit.MeshkitError, match="never completed"):
        meshkit.checkpoint.restore(root / "2" / "default", meshkit.make_mesh({"x": 8}))


_TMP = ".orbax-checkpoint-tmp"
