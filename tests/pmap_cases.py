"""Differential cases: the same legacy pmap code run with `jax.pmap` and with `pmap_compat`.

Each case takes the pmap to use (``jax.pmap`` or ``meshkit.pmap_compat``) and returns what a
legacy program would observe: values read on the host, shapes, where outputs live. The tests run
every case with both, in one process (8 CPU devices) and in 2 processes x 4 CPU devices, and
require equal observations. Data depends on the process index, as each process of a pmap
program feeds its own devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Pmap = Callable[..., Any]


def _local(shape: tuple[int, ...] = (3,), dtype: Any = np.float32) -> np.ndarray:
    """This process's per-device batch: one entry per local device, distinct across processes."""
    n = jax.local_device_count()
    start = jax.process_index() * n * int(np.prod(shape))
    return (np.arange(n * int(np.prod(shape))) + start).reshape(n, *shape).astype(dtype)


def _seen(x: Any) -> dict[str, Any]:
    """What host code sees of an output: its value, shape, dtype, and how it is laid out."""
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return {
        "value": np.asarray(x).tolist(),
        "shape": tuple(x.shape),
        "dtype": str(x.dtype),
        "spec": tuple(spec) if spec is not None else None,
        "devices": sorted(d.id for d in sharding.device_set) if sharding is not None else None,
    }


def host_reads(pmap: Pmap) -> dict[str, Any]:
    """The reads every pmap-era loop does on outputs, with default arguments."""
    step = pmap(lambda x: x - jax.lax.pmean(x, "i"), "i")
    out = step(_local())
    state = {"params": out, "count": step(_local((1,)))}
    return {
        "out": _seen(out),
        "asarray": np.asarray(out).tolist(),
        "device_get": np.asarray(jax.device_get(out)).tolist(),
        "index0": np.asarray(out[0]).tolist(),
        "tree_map_first": jax.tree_util.tree_map(lambda a: np.asarray(a[0]).tolist(), state),
        "mean": float(out.mean()),
        "float_sum": float(jnp.sum(out)),
    }


def replicated_output(pmap: Pmap) -> dict[str, Any]:
    """out_axes=None on a reduced value: every process sees the global sum."""
    total = pmap(lambda x: jax.lax.psum(x, "i"), "i", out_axes=None)(_local())
    return {"total": _seen(total)}


def chained_steps(pmap: Pmap) -> dict[str, Any]:
    """Outputs fed back as inputs for a few steps (the training-loop shape)."""
    step = pmap(lambda x, y: (x * 0.5 + jax.lax.psum(y, "i"), y + 1), "i")
    x, y = _local(), _local()
    for _ in range(3):
        x, y = step(x, y)
    return {"x": _seen(x), "y": _seen(y)}


def under_jit(pmap: Pmap) -> dict[str, Any]:
    f = pmap(lambda x: x * 2 + jax.lax.psum(x, "i"), "i")
    return {"jit": np.asarray(jax.jit(f)(_local())).tolist()}


def under_grad(pmap: Pmap) -> dict[str, Any]:
    f = pmap(lambda x: jnp.sin(x) * jax.lax.psum(x, "i"), "i")
    g = jax.grad(lambda x: f(x).sum())(_local())
    return {"grad": np.round(np.asarray(g), 4).tolist()}


def under_make_jaxpr(pmap: Pmap) -> dict[str, Any]:
    f = pmap(lambda x: x + jax.lax.psum(x, "i"), "i")
    closed = jax.make_jaxpr(f)(_local())
    return {"outs": [(tuple(a.shape), str(a.dtype)) for a in closed.out_avals]}


def local_devices_numpy(pmap: Pmap) -> dict[str, Any]:
    """devices=jax.local_devices(): each process maps over its own devices only."""
    f = pmap(lambda x: x + jax.lax.psum(x, "i"), "i", devices=jax.local_devices())
    return {"out": _seen(f(_local()))}


def float0_input(pmap: Pmap) -> dict[str, Any]:
    """A float0 argument (a tangent of integer data) next to a float one."""
    n = jax.local_device_count()
    zero = np.zeros((n, 2), dtype=jax.dtypes.float0)
    f = pmap(lambda x, t: x * 2, "i")
    return {"out": _seen(f(_local((2,)), zero))}


class _Model:
    """A method pmapped with ``self`` static, as pmap-era trainers do."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __hash__(self) -> int:
        return hash(self.scale)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Model) and other.scale == self.scale


def method_decorator(pmap: Pmap) -> dict[str, Any]:
    class Model(_Model):
        @functools.partial(pmap, axis_name="i", static_broadcasted_argnums=(0,))
        def step(self, x: Any) -> Any:
            return x * self.scale + jax.lax.psum(x, "i")

    return {"out": _seen(Model(3.0).step(_local()))}


def lower_compile(pmap: Pmap) -> dict[str, Any]:
    """The compiled function takes the pmapped function's arguments and gives its outputs."""
    f = pmap(lambda x, y: x * y + jax.lax.psum(x, "i"), "i")
    x, y = _local(), _local() + 1
    compiled = f.lower(x, y).compile()
    return {"compiled": np.asarray(compiled(x, y)).tolist(), "call": np.asarray(f(x, y)).tolist()}


def device_varying_carry(pmap: Pmap) -> dict[str, Any]:
    """A loop carry that starts equal on every device and becomes device-dependent."""

    def f(x: Any) -> Any:
        def body(i: Any, c: Any) -> Any:
            return c + jax.lax.axis_index("i").astype(c.dtype) * i

        looped = jax.lax.fori_loop(0, 3, body, jnp.zeros((), x.dtype))
        scanned, _ = jax.lax.scan(
            lambda c, _: (c * 2 + jax.lax.axis_index("i").astype(c.dtype), None),
            jnp.zeros((), x.dtype),
            None,
            length=3,
        )
        return x + looped + scanned

    return {"out": _seen(pmap(f, "i")(_local()))}


def unmapped_input_out_axes0(pmap: Pmap) -> dict[str, Any]:
    """An unmapped input returned with out_axes=0: still split over the devices."""
    y = np.arange(3, dtype=np.float32)
    out = pmap(lambda x, y: y, "i", in_axes=(0, None))(_local(), y)
    return {"out": _seen(out)}


# jax.pmap's error contract: (case, key phrase). The same exception class as jax.pmap raises
# (meshkit's errors subclass it too) and jax.pmap's key phrase in the message.
JAX_ERRORS = {
    "non-hashable static": (
        lambda pmap: pmap(lambda x, s: x, static_broadcasted_argnums=1)(
            np.ones(jax.local_device_count()), [1]
        ),
        "Non-hashable static arguments are not supported",
    ),
    "in_axes prefix": (
        lambda pmap: pmap(lambda x: x, in_axes=((0,),))(np.ones(jax.local_device_count())),
        "pmap in_axes[0][0]",
    ),
    "keywords": (
        lambda pmap: pmap(lambda x, y: x, in_axes=(0, None))(
            np.ones(jax.local_device_count()), y=np.ones(3)
        ),
        "each argument passed by keyword is mapped",
    ),
    "unbound axis": (
        lambda pmap: pmap(lambda x: jax.lax.psum(x, "j"), "i")(np.ones(jax.local_device_count())),
        "Found an unbound axis name: j",
    ),
    "devices empty": (
        lambda pmap: pmap(lambda x: x, devices=[]),
        "'devices' argument to pmap must be non-empty, or None.",
    ),
    "in_axes type": (
        lambda pmap: pmap(lambda x: x, in_axes="a"),
        "pmap in_axes must be an int, None, or (nested) container with those types as leaves",
    ),
    "static positional": (
        lambda pmap: pmap(lambda x, s: x, static_broadcasted_argnums=1)(
            np.ones(jax.local_device_count()), s=1
        ),
        "static_broadcasted_argnums=(1,) but was called with only 1 positional argument",
    ),
    "nothing mapped": (
        lambda pmap: pmap(lambda x: x, in_axes=None)(np.ones(jax.local_device_count())),
        "pmap requires at least one argument with a mapped axis.",
    ),
    "in_axes beyond rank": (
        lambda pmap: pmap(lambda x: x, in_axes=2)(np.ones((jax.local_device_count(), 3))),
        "",
    ),
    "not callable": (lambda pmap: pmap(3), "Expected a callable value, got 3"),
}


def errors(pmap: Pmap) -> dict[str, Any]:
    """Each bad call of JAX_ERRORS: the built-in class it raises, and whether JAX's phrase is in."""
    seen = {}
    for name, (call, phrase) in JAX_ERRORS.items():
        try:
            call(pmap)
        except (ValueError, TypeError, IndexError, NameError) as e:
            kind = next(
                k for k in (NameError, IndexError, TypeError, ValueError) if isinstance(e, k)
            )
            seen[name] = (kind.__name__, phrase in str(e))
    return seen


CASES: dict[str, Callable[[Pmap], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        host_reads,
        replicated_output,
        chained_steps,
        under_jit,
        under_grad,
        under_make_jaxpr,
        local_devices_numpy,
        float0_input,
        method_decorator,
        lower_compile,
        device_varying_carry,
        unmapped_input_out_axes0,
        errors,
    )
}


# Cases jax.pmap itself fails in multi-process runs (JAX 0.10 and 0.12): its compiled object
# has no host-local to global conversion ("Argument types differ from the types for which this
# computation was compiled"). pmap_compat's result is compared with its own direct call there.
JAX_FAILS_ACROSS_PROCESSES = {"lower_compile"}


def compare_all() -> dict[str, Any]:
    """Every case with jax.pmap and with pmap_compat: ``{case: None | (theirs, ours)}``."""
    import meshkit

    result: dict[str, Any] = {}
    for name, case in CASES.items():
        ours = case(meshkit.pmap_compat)
        if jax.process_count() > 1 and name in JAX_FAILS_ACROSS_PROCESSES:
            same = ours["compiled"] == ours["call"]
            result[name] = None if same else ("compiled == call", ours)
            continue
        theirs = case(jax.pmap)
        result[name] = None if theirs == ours else (theirs, ours)
    return result


# ---- property test: random in_axes / out_axes / static arguments, against jax.pmap ----------

OPS: dict[str, Callable[[Any], Any]] = {
    "scale": lambda x: x * 2,
    "shift": lambda x: x + 1,
    "psum": lambda x: jax.lax.psum(x, "i"),
    "pmax": lambda x: jax.lax.pmax(x, "i"),
    "index": lambda x: x * jax.lax.axis_index("i").astype(x.dtype),
    "centre": lambda x: x - jax.lax.pmin(x, "i"),
}
SAME_ON_EVERY_DEVICE = {"psum", "pmax"}  # out_axes=None is allowed on these


def programs() -> Any:
    """A hypothesis strategy of pmap programs: arguments, in_axes, ops, out_axes, a static."""
    from hypothesis import strategies as st

    @st.composite
    def draw_program(draw: Any) -> dict[str, Any]:
        args = []
        for k in range(draw(st.integers(1, 3))):
            shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
            mapped = k == 0 or draw(st.booleans())
            axis = draw(st.integers(0, len(shape))) if mapped else None
            op = draw(st.sampled_from(sorted(OPS)))
            out_choices: list[int | None] = list(range(len(shape) + 1))
            if op in SAME_ON_EVERY_DEVICE or (not mapped and op in {"scale", "shift"}):
                out_choices.append(None)
            args.append(
                {
                    "shape": shape,
                    "axis": axis,
                    "dtype": draw(st.sampled_from(["float32", "int32", "float16"])),
                    "op": op,
                    "out": draw(st.sampled_from(out_choices)),
                }
            )
        return {"args": args, "scale": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 99))}

    return draw_program()


def run_program(pmap: Pmap, program: dict[str, Any]) -> list[dict[str, Any]]:
    """Run a drawn program with ``pmap``; what host code sees of each output, and its reads."""
    n, me = jax.local_device_count(), jax.process_index()
    rng = np.random.default_rng(program["seed"] * 10 + me)  # each process its own entries
    specs = program["args"]
    values = []
    for a in specs:
        shape = list(a["shape"])
        if a["axis"] is not None:
            shape.insert(a["axis"], n)
        else:  # an unmapped argument is the same in every process
            rng_all = np.random.default_rng(program["seed"])
            values.append(rng_all.integers(-4, 5, shape).astype(a["dtype"]))
            continue
        values.append(rng.integers(-4, 5, shape).astype(a["dtype"]))

    def f(*xs: Any) -> Any:
        *xs, scale = xs
        return tuple(OPS[a["op"]](x) * scale for a, x in zip(specs, xs, strict=True))

    fn = pmap(
        f,
        "i",
        in_axes=(*[a["axis"] for a in specs], None),
        out_axes=tuple(a["out"] for a in specs),
        static_broadcasted_argnums=len(specs),
    )
    outs = fn(*values, program["scale"])
    seen = []
    for out in outs:
        row = _seen(out)
        row["device_get"] = np.asarray(jax.device_get(out)).tolist()
        row["first"] = np.asarray(out[0]).tolist() if out.ndim else None
        seen.append(row)
    return seen
