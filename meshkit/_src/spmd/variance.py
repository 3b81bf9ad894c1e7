"""Which values of a per-device jaxpr can differ between the devices of one mapped axis.

`pmap_compat` promises, for an output with ``out_axes=None``, that it is the same on every
device. JAX's replication typing (``shard_map(check_vma=True)``) could check that, but it also
changes what programs trace: a ``lax.scan`` whose carry starts equal on every device and becomes
device-dependent (``lax.axis_index`` in the body) is a type error there, and collectives with
``axis_index_groups`` are refused. `jax.pmap` traces with the typing off. `pmap_compat` does the
same and checks ``out_axes=None`` outputs here instead, on the jaxpr it has already traced: a
forward pass over the equations that marks each value

* ``INVARIANT``: the same on every device of the axis (constants, unmapped inputs, the result of
  a reduction over the axis such as ``psum`` or ``all_gather``);
* ``VARYING``: may differ (mapped inputs, ``axis_index``, ``ppermute``, anything computed from
  a varying value); or
* unknown, with the reason: a value that the analysis cannot follow (a collective with
  ``axis_index_groups``, an ``io_callback``'s result, a primitive over the axis it has no rule
  for). The caller warns instead of raising for those.

The analysis is conservative towards ``VARYING`` for control flow: a loop whose trip count or a
``cond`` whose branch depends on a varying value makes its results varying.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jex

from ..core import compat as _compat

__all__ = ["INVARIANT", "VARYING", "Variance", "join", "shard_map_outputs"]


@dataclass(frozen=True)
class Variance:
    """How a value may differ over the devices of the axis; ``level`` orders the lattice."""

    level: int  # 0: invariant, 1: unknown, 2: varying
    reason: str = ""


INVARIANT = Variance(0)
VARYING = Variance(2)


def _unknown(reason: str) -> Variance:
    return Variance(1, reason)


def join(values: Sequence[Variance]) -> Variance:
    """The least upper bound: varying wins, then the first unknown (its reason kept)."""
    best = INVARIANT
    for v in values:
        if v.level > best.level:
            best = v
    return best


# Collectives whose result is the same on every device of the axes they reduce over.
_REDUCING = {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "all_gather_invariant"}
# Collectives (and axis_index) whose result differs between devices.
_SPREADING = {"axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter"}
# Callbacks whose results JAX does not tie to their inputs.
_IMPURE = {"io_callback"}


def _axes_of(params: dict[str, Any]) -> tuple[Hashable, ...]:
    """The named axes a collective's parameters name (``axes`` or ``axis_name``)."""
    for key in ("axes", "axis_name"):
        if key in params:
            value = params[key]
            return tuple(value) if isinstance(value, tuple | list) else (value,)
    return ()


def _open(jaxpr: Any) -> Any:
    """The `Jaxpr` of a Jaxpr or ClosedJaxpr (a closed one's constants are invariant)."""
    return jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr  # a ClosedJaxpr has consts


class _Analysis:
    def __init__(self, axis: Hashable) -> None:
        self.axis = axis

    def run(self, jaxpr: Any, inputs: Sequence[Variance]) -> list[Variance]:
        """The variance of ``jaxpr``'s outputs given its inputs' (constvars invariant)."""
        inner = _open(jaxpr)
        env: dict[Any, Variance] = {}
        for var in inner.constvars:
            env[var] = INVARIANT
        for var, v in zip(inner.invars, inputs, strict=True):
            env[var] = v

        def read(atom: Any) -> Variance:
            if isinstance(atom, jex.Literal):
                return INVARIANT
            return env.get(atom, INVARIANT)

        for eqn in inner.eqns:
            ins = [read(a) for a in eqn.invars]
            outs = self.equation(eqn, ins)
            for var, v in zip(eqn.outvars, outs, strict=True):
                env[var] = v
        return [read(a) for a in inner.outvars]

    def equation(self, eqn: Any, ins: list[Variance]) -> list[Variance]:
        name = eqn.primitive.name
        params = eqn.params
        n_out = len(eqn.outvars)
        axes = _axes_of(params)
        ours = self.axis in axes
        if ours and name in _REDUCING:
            if params.get("axis_index_groups") is not None:
                return [_unknown(f"it passes through {name} with axis_index_groups")] * n_out
            return [INVARIANT] * n_out
        if ours and name in _SPREADING:
            return [VARYING] * n_out
        if ours:
            return [join([*ins, _unknown(f"meshkit has no rule for {name}")])] * n_out
        if name in _IMPURE:
            return [join([*ins, _unknown(f"it comes from jax.experimental.{name}")])] * n_out
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "while":
            return self.while_loop(eqn, ins)
        if name == "cond":
            return self.cond(eqn, ins)
        subs = list(jex.jaxprs_in_params(params))
        if not subs:
            return [join(ins)] * n_out
        for sub in subs:
            inner = _open(sub)
            if len(inner.invars) == len(ins) and len(inner.outvars) == n_out:
                return self.run(sub, ins)  # jit, remat, custom_jvp/vjp calls: inputs 1:1
        # Another higher-order primitive: every output may depend on every input and on
        # whatever its bodies compute from them.
        worst = join(ins)
        found = [worst]
        for sub in subs:
            inner = _open(sub)
            found += self.run(sub, [worst] * len(inner.invars))
        return [join(found)] * n_out

    def scan(self, eqn: Any, ins: list[Variance]) -> list[Variance]:
        params = eqn.params
        body = params["jaxpr"]
        n_consts, n_carry = _compat.scan_counts(params)
        consts, rest = ins[:n_consts], ins[n_consts:]
        carry, xs = rest[:n_carry], rest[n_carry:]
        while True:
            outs = self.run(body, [*consts, *carry, *xs])
            new = [join([a, b]) for a, b in zip(carry, outs[:n_carry], strict=True)]
            if new == carry:
                return [*new, *outs[n_carry:]]
            carry = new

    def while_loop(self, eqn: Any, ins: list[Variance]) -> list[Variance]:
        params = eqn.params
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        while True:
            outs = self.run(params["body_jaxpr"], [*body_consts, *carry])
            new = [join([a, b]) for a, b in zip(carry, outs, strict=True)]
            if new == carry:
                break
            carry = new
        (pred,) = self.run(params["cond_jaxpr"], [*cond_consts, *carry])
        if pred.level:
            # Devices may run different numbers of iterations.
            return [join([c, pred]) for c in carry]
        return carry

    def cond(self, eqn: Any, ins: list[Variance]) -> list[Variance]:
        index, ops = ins[0], ins[1:]
        per_branch = [self.run(b, ops) for b in eqn.params["branches"]]
        outs = [join(list(vs)) for vs in zip(*per_branch, strict=True)]
        return [join([o, index]) for o in outs]


def shard_map_outputs(
    jaxpr: Any, axis: Hashable, mapped_inputs: Sequence[bool]
) -> list[Variance] | None:
    """The variance over ``axis`` of the outputs of the first shard_map in a traced function.

    ``jaxpr``: the function's jaxpr (a `Jaxpr` or `ClosedJaxpr`); ``mapped_inputs``: which of
    the shard_map's inputs are split over ``axis``. None when the jaxpr holds no shard_map.
    """
    inner = _open(jaxpr)
    for eqn in inner.eqns:
        if eqn.primitive.name == "shard_map":
            body = eqn.params["jaxpr"]
            inputs = [VARYING if m else INVARIANT for m in mapped_inputs]
            return _Analysis(axis).run(body, inputs)
    return None
