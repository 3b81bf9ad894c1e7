"""Which values of a per-device jaxpr can differ between the devices of one mapped axis.

`pmap_compat` checks ``out_axes=None`` outputs here: shard_map's ``check_vma`` would refuse
programs `jax.pmap` traces (a scan carry made device-dependent, ``axis_index_groups``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jex

from ..core import compat as _compat


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
    return max(values, key=lambda v: v.level, default=INVARIANT)


# Collectives whose result is the same on every device of the axes they reduce over.
_REDUCING = {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "all_gather_invariant"}
# Collectives (and axis_index) whose result differs between devices.
_SPREADING = {"axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter"}


def _axes_of(params: dict[str, Any]) -> tuple[Hashable, ...]:
    value = params.get("axes", params.get("axis_name", ()))
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr  # a ClosedJaxpr's Jaxpr


@dataclass(frozen=True)
class _Analysis:
    axis: Hashable

    def run(self, jaxpr: Any, inputs: Sequence[Variance]) -> list[Variance]:
        """The variance of ``jaxpr``'s outputs given its inputs' (constvars invariant)."""
        inner = _open(jaxpr)
        env: dict[Any, Variance] = dict(zip(inner.invars, inputs, strict=True))

        def read(atom: Any) -> Variance:
            return INVARIANT if isinstance(atom, jex.Literal) else env.get(atom, INVARIANT)

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
        if name == "io_callback":  # JAX does not tie its results to its inputs
            return [join([*ins, _unknown(f"it comes from jax.experimental.{name}")])] * n_out
        loop = {"scan": self.scan, "while": self.while_loop, "cond": self.cond}.get(name)
        if loop is not None:
            return loop(eqn, ins)
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
        found = [v for sub in subs for v in self.run(sub, [worst] * len(_open(sub).invars))]
        return [join([worst, *found])] * n_out

    def _fixpoint(self, carry: list[Variance], step: Any) -> tuple[list[Variance], list[Variance]]:
        """Join ``step(carry)``'s leading outputs into ``carry`` until it stops changing."""
        while True:
            outs = step(carry)
            new = [join([a, b]) for a, b in zip(carry, outs[: len(carry)], strict=True)]
            if new == carry:
                return carry, outs
            carry = new

    def scan(self, eqn: Any, ins: list[Variance]) -> list[Variance]:
        body = eqn.params["jaxpr"]
        nc, n_carry = _compat.scan_counts(eqn.params)
        consts, carry, xs = ins[:nc], ins[nc : nc + n_carry], ins[nc + n_carry :]
        carry, outs = self._fixpoint(carry, lambda c: self.run(body, [*consts, *c, *xs]))
        return [*carry, *outs[n_carry:]]

    def while_loop(self, eqn: Any, ins: list[Variance]) -> list[Variance]:
        params = eqn.params
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        body = params["body_jaxpr"]
        carry, _ = self._fixpoint(carry, lambda c: self.run(body, [*body_consts, *c]))
        (pred,) = self.run(params["cond_jaxpr"], [*cond_consts, *carry])
        if pred.level:  # devices may run different numbers of iterations
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
    """The variance over ``axis`` of the outputs of the first shard_map in ``jaxpr`` (or None)."""
    for eqn in _open(jaxpr).eqns:
        if eqn.primitive.name == "shard_map":
            inputs = [VARYING if m else INVARIANT for m in mapped_inputs]
            return _Analysis(axis).run(eqn.params["jaxpr"], inputs)
    return None
