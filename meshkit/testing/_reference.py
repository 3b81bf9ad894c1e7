"""A naive single-device reference for per-device code, and assertions against it.

`reference_spmd` runs the per-device function once per mesh coordinate, on that device's block
of each argument, on one device, one device at a time. The collectives of `meshkit.collectives`
are replaced by numpy references that see the blocks of all devices: each simulated device runs
(in its own thread, strictly taking turns) until it reaches a collective, and the last device to
arrive computes every device's result. Devices that disagree about the next collective (or one
returns while another still communicates) raise an error naming both, where real devices would
hang. The outputs are reassembled per ``out_specs``.

It is slow and simple on purpose: there is little in it that could share a bug with XLA.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._src.core.errors import MeshkitError
from .._src.sharding.layout import process_slice
from .._src.sharding.specs import (
    align_specs,
    check_spec_for_mesh,
    dim_axes,
    is_spec_leaf,
    map_specs,
    plain_specs,
)
from .._src.spmd import axis_collectives as _axis_collectives

__all__ = ["assert_spmd_matches_reference", "reference_spmd"]

_TIMEOUT_S = 120.0


def _linear(coord: Mapping[str, int], names: Sequence[str], sizes: Mapping[str, int]) -> int:
    """Row-major index of ``coord`` over ``names`` (the first name outermost)."""
    index = 0
    for name in names:
        index = index * sizes[name] + coord[name]
    return index


def _block(
    value: np.ndarray, spec: PartitionSpec, coord: Mapping[str, int], sizes: Mapping[str, int]
) -> np.ndarray:
    index = []
    for d, axes in enumerate(dim_axes(spec, value.ndim)):
        count = math.prod(sizes[a] for a in axes)
        step = value.shape[d] // count
        k = _linear(coord, axes, sizes)
        index.append(slice(k * step, (k + 1) * step))
    return value[tuple(index)]


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, Tracer):
        raise MeshkitError(
            "meshkit.testing.reference_spmd: a collective received a traced value. The reference "
            "runs per-device code eagerly; do not wrap collectives in jax.jit or jax.vmap inside "
            "the function under test."
        )
    return np.asarray(x)


def _sum(values: list[np.ndarray]) -> np.ndarray:
    dtype = values[0].dtype
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
        return np.sum([v.astype(np.float64) for v in values], axis=0).astype(dtype)
    return np.sum(values, axis=0, dtype=dtype)


def _mean(values: list[np.ndarray]) -> np.ndarray:
    dtype = values[0].dtype
    total = np.sum([v.astype(np.float64) for v in values], axis=0) / len(values)
    exact = np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"
    return total.astype(dtype if exact else jax.dtypes.canonicalize_dtype(np.float64))


def _group_result(
    op: str, values: list[np.ndarray], me: int, params: Mapping[str, Any]
) -> np.ndarray:
    """The numpy reference of collective ``op`` for member ``me`` of a group of ``values``."""
    n = len(values)
    if op == "psum":
        return _sum(values)
    if op == "pmean":
        return _mean(values)
    if op in ("pmax", "pmin"):
        return (np.max if op == "pmax" else np.min)(np.stack(values), axis=0)
    if op == "all_gather":
        join = np.concatenate if params["tiled"] else np.stack
        return join(values, axis=params["axis"])
    if op == "psum_scatter":
        total = _sum(values)
        dim = params["scatter_dimension"] % total.ndim
        if params["tiled"]:
            return np.split(total, n, axis=dim)[me]
        return np.take(total, me, axis=dim)
    if op == "all_to_all":
        split = params["split_axis"] % values[0].ndim
        concat = params["concat_axis"] % values[0].ndim
        chunks = [np.split(v, n, axis=split)[me] for v in values]
        if params["tiled"]:
            return np.concatenate(chunks, axis=concat)
        return np.stack([np.squeeze(c, axis=split) for c in chunks], axis=concat)
    if op == "ppermute":
        sources = {dst: src for src, dst in params["perm"]}
        if me in sources:
            return values[sources[me]]
        return np.zeros_like(values[me])
    raise AssertionError(f"no reference for {op}")


class _Aborted(Exception):
    """Raised in simulated devices when another one failed."""


class _Device:
    """The view of one simulated device: what `meshkit.collectives` sees while it runs."""

    def __init__(self, sim: _Simulation, index: int, coord: dict[str, int]) -> None:
        self.sim = sim
        self.index = index
        self.coord = coord

    def axis_sizes(self) -> Mapping[str, int]:
        return self.sim.sizes

    def run(self, op: str, x: Any, names: tuple[str, ...], **params: Any) -> Any:
        if op == "axis_index":
            return jnp.int32(_linear(self.coord, names, self.sim.sizes))
        leaves, treedef = jax.tree_util.tree_flatten(x)
        arrays = [_to_numpy(leaf) for leaf in leaves]
        results = self.sim.rendezvous(self.index, (op, names, _frozen(params)), arrays)
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(r) for r in results])


def _frozen(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


class _Simulation:
    """Runs the per-device function on every coordinate of a mesh, strictly one at a time."""

    def __init__(self, mesh: Mesh) -> None:
        self.sizes: dict[str, int] = {str(k): int(v) for k, v in mesh.shape.items()}
        self.names = list(self.sizes)
        self.coords = [
            dict(zip(self.names, c, strict=True))
            for c in np.ndindex(*[self.sizes[n] for n in self.names])
        ]
        self.n = len(self.coords)
        self.cond = threading.Condition()
        self.turn = 0
        self.calls: list[Any] = [None] * self.n
        self.inputs: list[list[np.ndarray]] = [[] for _ in range(self.n)]
        self.results: list[list[np.ndarray]] = [[] for _ in range(self.n)]
        self.error: BaseException | None = None

    def where(self, i: int) -> str:
        return "device " + ", ".join(f"{k}={v}" for k, v in self.coords[i].items())

    def _wait_turn(self, i: int) -> None:
        ok = self.cond.wait_for(lambda: self.turn == i or self.error is not None, _TIMEOUT_S)
        if self.error is not None:
            raise _Aborted
        if not ok:
            self.error = MeshkitError(
                f"meshkit.testing.reference_spmd: {self.where(i)} waited {_TIMEOUT_S:.0f} s "
                "for its turn."
            )
            self.cond.notify_all()
            raise _Aborted

    def rendezvous(self, i: int, call: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Hand this device's operands in; come back with its results once all have arrived."""
        with self.cond:
            self.calls[i] = call
            self.inputs[i] = arrays
            if i == self.n - 1:
                self._compute()
            self.turn = (i + 1) % self.n
            self.cond.notify_all()
            self._wait_turn(i)
            return self.results[i]

    def _describe(self, call: Any) -> str:
        if call == "return":
            return "returned"
        op, names, _ = call
        return f"called {op} over {names if len(names) > 1 else names[0]!r}"

    def _compute(self) -> None:
        first = self.calls[0]
        for j in range(1, self.n):
            if self.calls[j] != first:
                raise MeshkitError(
                    "meshkit.testing.reference_spmd: the devices diverged: "
                    f"{self.where(0)} {self._describe(first)} while {self.where(j)} "
                    f"{self._describe(self.calls[j])}. On real devices this hangs; every device "
                    "must make the same collective calls in the same order."
                )
        if first == "return":
            return
        op, names, params = first
        kwargs = dict(params)
        groups: dict[tuple[int, ...], list[int]] = {}
        for j, c in enumerate(self.coords):
            groups.setdefault(tuple(c[a] for a in self.names if a not in names), []).append(j)
        for members in groups.values():
            members.sort(key=lambda j: _linear(self.coords[j], names, self.sizes))
            for k, leaves in enumerate(zip(*[self.inputs[j] for j in members], strict=True)):
                shapes = {v.shape for v in leaves}
                if len(shapes) != 1:
                    raise MeshkitError(
                        f"meshkit.testing.reference_spmd: {op} over {names!r} got operands of "
                        f"different shapes on different devices: {sorted(shapes)} (leaf {k})."
                    )
            for me, j in enumerate(members):
                self.results[j] = [
                    _group_result(op, [self.inputs[m][k] for m in members], me, kwargs)
                    for k in range(len(self.inputs[j]))
                ]

    def finish(self, i: int) -> None:
        with self.cond:
            self.calls[i] = "return"
            if i == self.n - 1:
                self._compute()
            self.turn = (i + 1) % self.n
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def run(self, f: Callable[..., Any], blocks: list[tuple[Any, ...]]) -> list[Any]:
        outputs: list[Any] = [None] * self.n

        def device(i: int) -> None:
            token = _axis_collectives.interceptor.set(_Device(self, i, self.coords[i]))
            try:
                with self.cond:
                    self._wait_turn(i)
                out = f(*blocks[i])
                outputs[i] = jax.tree_util.tree_map(np.asarray, out)
                self.finish(i)
            except _Aborted:
                pass
            except BaseException as e:  # re-raised by the caller, with the device named
                if not isinstance(e, MeshkitError):
                    e.add_note(f"(raised in meshkit.testing.reference_spmd, {self.where(i)})")
                self.fail(e)
            finally:
                _axis_collectives.interceptor.reset(token)

        threads = [threading.Thread(target=device, args=(i,), daemon=True) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_TIMEOUT_S * 2)
        if self.error is not None:
            raise self.error
        if any(t.is_alive() for t in threads):
            raise MeshkitError("meshkit.testing.reference_spmd: a simulated device did not finish.")
        return outputs


def _specs_tuple(in_specs: Any, mesh: Mesh, n: int) -> tuple[Any, ...]:
    specs = map_specs(
        lambda s, w: check_spec_for_mesh(s, mesh, w),
        plain_specs(in_specs),
        "meshkit.testing: in_specs",
    )
    if isinstance(specs, PartitionSpec):
        return (specs,) * n
    specs = tuple(specs)
    if len(specs) != n:
        raise MeshkitError(
            f"meshkit.testing.reference_spmd: in_specs has {len(specs)} entries for {n} arguments."
        )
    return specs


def _global_numpy(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _map_under_specs(fn: Callable[[Any, Any], Any], specs: Any, tree: Any) -> Any:
    """Apply ``fn(spec, leaf)`` to each leaf of ``tree`` with the spec whose subtree holds it."""
    aligned = align_specs(plain_specs(specs), tree, where="specs")

    def under(s: Any, subtree: Any) -> Any:
        return jax.tree_util.tree_map(lambda leaf: fn(s, leaf), subtree)

    return jax.tree_util.tree_map(under, aligned, tree, is_leaf=is_spec_leaf)


def _local_part(mesh: Mesh, spec: PartitionSpec, leaf: Any) -> Any:
    """What this process passes to `meshkit.spmd` for the global value ``leaf``: its part."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return leaf  # already global: spmd takes it as it is
    if np.ndim(leaf) == 0:
        return leaf  # every process holds a scalar whole (and a Python scalar stays one)
    value = np.asarray(leaf)
    return process_slice(mesh, spec, value.shape).take(value)


def _local_parts(mesh: Mesh, in_specs: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments this process passes to `meshkit.spmd` for the global values ``args``.

    Single-process that is ``args`` itself; in a multi-process run each host leaf is cut down
    to this process's part (`meshkit.process_slice`), and global arrays are kept.
    """
    if not mesh.is_multi_process:
        return args
    specs = _specs_tuple(in_specs, mesh, len(args))
    return tuple(
        _map_under_specs(lambda spec, leaf: _local_part(mesh, spec, leaf), s, a)
        for s, a in zip(specs, args, strict=True)
    )


def reference_spmd(
    f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any, *args: Any
) -> Any:
    """Run per-device code the slow, obvious way: one mesh coordinate at a time, in numpy.

    Each argument is split per ``in_specs`` exactly as `meshkit.spmd` would split it; ``f``
    runs eagerly on each device's blocks (as jax arrays on the default device), with the
    `meshkit.collectives` it calls answered by numpy references over the blocks of every
    device in the group; the outputs are put back together per ``out_specs``.

    Args:
        f: the per-device function (it must call collectives through `meshkit.collectives`).
        mesh: the mesh whose coordinates are simulated (only its shape and names are used).
        in_specs: as for `meshkit.spmd` (PartitionSpecs, spec strings, pytrees of them).
        out_specs: as for `meshkit.spmd`.
        *args: the global values of the arguments (numpy, jax arrays, pytrees of them).

    Returns:
        The outputs as numpy arrays (same pytree as ``f`` returns), laid out globally.

    Raises:
        MeshkitError: if the simulated devices diverge (different collectives, or one returns
            early), or if an output that ``out_specs`` declares the same along a mesh axis
            differs between devices along it.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> from meshkit.testing import reference_spmd
        >>> mesh = meshkit.make_mesh({"x": 4, "y": 2})
        >>> reference_spmd(lambda a: C.psum(a, "y"), mesh, "x y", "x", np.ones((4, 2)))
        array([[2.],
               [2.],
               [2.],
               [2.]], dtype=float32)
    """
    sim = _Simulation(mesh)
    specs = _specs_tuple(in_specs, mesh, len(args))
    values = [jax.tree_util.tree_map(_global_numpy, a) for a in args]
    blocks = [
        tuple(
            _map_under_specs(
                lambda spec, leaf, c=coord: jnp.asarray(_block(leaf, spec, c, sim.sizes)), s, v
            )
            for s, v in zip(specs, values, strict=True)
        )
        for coord in sim.coords
    ]
    outputs = sim.run(f, blocks)
    out_parts = map_specs(
        lambda s, w: check_spec_for_mesh(s, mesh, w),
        plain_specs(out_specs),
        "meshkit.testing: out_specs",
    )
    if not is_spec_leaf(out_parts):  # matched to the outputs by keys, as spmd does
        out_parts = align_specs(out_parts, outputs[0], where="out_specs", noun="the output")
    return _assemble(sim, out_parts, outputs)


def _assemble(sim: _Simulation, out_specs: Any, outputs: list[Any]) -> Any:
    """Global outputs from every device's block, checking claimed replication."""

    def per_spec(spec: PartitionSpec, *subtrees: Any) -> Any:
        return jax.tree_util.tree_map(lambda *leaves: place(spec, list(leaves)), *subtrees)

    def place(spec: PartitionSpec, leaves: list[np.ndarray]) -> np.ndarray:
        block_shape = leaves[0].shape
        axes = dim_axes(spec, len(block_shape))
        shape = [
            b * math.prod(sim.sizes[a] for a in ax) for b, ax in zip(block_shape, axes, strict=True)
        ]
        out = np.zeros(shape, leaves[0].dtype)
        written: dict[tuple[int, ...], int] = {}
        for i, (coord, leaf) in enumerate(zip(sim.coords, leaves, strict=True)):
            key = tuple(_linear(coord, ax, sim.sizes) for ax in axes)
            index = tuple(slice(k * b, (k + 1) * b) for k, b in zip(key, block_shape, strict=True))
            if key in written:
                first = written[key]
                if not np.array_equal(out[index], leaf, equal_nan=leaf.dtype.kind in "fc"):
                    used = {a for ax in axes for a in ax}
                    free = [a for a in sim.names if a not in used]
                    raise MeshkitError(
                        f"meshkit.testing.reference_spmd: out_specs {spec} says this output is "
                        f"the same on every device along {free}, but {sim.where(first)} and "
                        f"{sim.where(i)} hold different values."
                    )
            else:
                out[index] = leaf
                written[key] = i
        return out

    if isinstance(out_specs, PartitionSpec):
        return per_spec(out_specs, *outputs)
    return jax.tree_util.tree_map(per_spec, out_specs, *outputs, is_leaf=is_spec_leaf)


def _default_tolerance(dtype: np.dtype) -> tuple[float, float]:
    if dtype.name == "bfloat16":
        return 2e-2, 2e-2
    if dtype == np.float16:
        return 2e-3, 2e-3
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        return 1e-5, 1e-6
    return 0.0, 0.0


def assert_spmd_matches_reference(
    f: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    eager: bool = False,
) -> Any:
    """Check that `meshkit.spmd` of ``f`` on ``args`` equals `reference_spmd` of the same call.

    ``args`` are the arguments' global values. Single-process they are passed to the spmd
    function as they are; in a multi-process run (every process passes the same global values
    here) each process passes its own part of each host leaf, as `meshkit.spmd` expects there
    (`meshkit.process_slice` cuts it out), and global arrays as they are.

    Args:
        f: the per-device function, as for `meshkit.spmd`.
        mesh: the mesh to run on.
        in_specs: as for `meshkit.spmd`.
        out_specs: as for `meshkit.spmd`.
        *args: the arguments' global values (numpy, scalars, jax arrays, pytrees of them).
        rtol: relative tolerance; by default 0 for integers, 1e-5 for float32 and 2e-2 for
            bfloat16 (whose sums XLA may order differently).
        atol: absolute tolerance, with the same defaults.
        eager: run ``jax.shard_map`` without ``jax.jit`` instead of `meshkit.spmd`.

    Returns:
        The outputs of the real run, as numpy arrays.

    Raises:
        AssertionError: naming the output leaf that differs.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import collectives as C
        >>> from meshkit.testing import assert_spmd_matches_reference
        >>> mesh = meshkit.make_mesh({"x": 8})
        >>> out = assert_spmd_matches_reference(
        ...     lambda a: C.all_gather(a, "x", tiled=True), mesh, "x", "_", np.arange(8.0))
    """
    from .._src.spmd.spmd import spmd

    if eager:
        in_parts = _specs_tuple(in_specs, mesh, len(args))
        out_parts = map_specs(lambda s, w: check_spec_for_mesh(s, mesh, w), out_specs, "out_specs")
        run = jax.shard_map(f, mesh=mesh, in_specs=in_parts, out_specs=out_parts)
        placed = [
            _map_under_specs(lambda s, leaf: jax.device_put(leaf, NamedSharding(mesh, s)), s, a)
            for s, a in zip(in_parts, args, strict=True)
        ]
        actual = run(*placed)
    else:
        run_spmd = spmd(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        actual = run_spmd(*_local_parts(mesh, in_specs, args))
    actual = jax.tree_util.tree_map(_global_numpy, actual)
    expected = reference_spmd(f, mesh, in_specs, out_specs, *args)
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
    flat_e, tree_e = jax.tree_util.tree_flatten(expected)
    assert tree_a == tree_e, f"output structure {tree_a} differs from the reference's {tree_e}"
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        where = f"output{jax.tree_util.keystr(path)}"
        assert a.shape == e.shape, f"{where}: shape {a.shape}, reference {e.shape}"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype}, reference {e.dtype}"
        r, t = _default_tolerance(a.dtype)
        np.testing.assert_allclose(
            a.astype(np.float64) if a.dtype.name == "bfloat16" else a,
            e.astype(np.float64) if e.dtype.name == "bfloat16" else e,
            rtol=r if rtol is None else rtol,
            atol=t if atol is None else atol,
            err_msg=where,
        )
    return actual
