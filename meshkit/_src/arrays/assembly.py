"""The assembly protocol (prepare -> agree -> transfer -> assemble) and `global_array_from_local`.

`Assembly` also serves `meshkit.spmd`'s host arguments and each step of `global_batches`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh, NamedSharding

from ..coord import agree as _agree
from ..coord import channel as _channel
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.frames import public, user_stacklevel
from ..runtime import dispatch as _dispatch
from ..sharding.specs import SpecLike
from .blocks import (
    Prepared,
    block_rows,
    describe,
    plan_leaves,
    prepare,
    replica_digests,
    warn_notes,
)
from .records import WHAT, PartRecord, compare, raise_absent, raise_failures, summary

Check = bool | Literal["data", "deferred"]  # global_array_from_local's check=

# Processes may hold different numbers of rows (pad=True): the debug fingerprint leaves the
# leading dimension out.
_SITE = _dispatch.CallSite(
    "global_array_from_local",
    "meshkit.global_array_from_local",
    info={"ragged": True, "params": ("local",)},
)


def exchange_records(
    tag: str, record: dict[str, Any], what: str = WHAT, *, said: str | None = None
) -> dict[int, dict[str, Any]]:
    """Agree on ``record`` (by ``said`` or its `summary`): this process's if all equal, else all.

    An exchange (``meet=False``): records that differ, as uneven batches' rows, are no error.
    """
    timeout = _env.check_timeout()
    said = summary(record) if said is None else said
    outcome = _agree.agree(tag, said, json.dumps(record), timeout=timeout, what=what, meet=False)
    return _records(outcome, timeout, what)


_later_calls: dict[str, int] = {}  # calls checked after they returned, per tag (for messages)


def _read(records: dict[int, dict[str, Any]]) -> dict[int, PartRecord]:
    return {p: PartRecord.read(r) for p, r in records.items()}


def _records(outcome: _agree.Outcome, timeout: float, what: str) -> dict[int, dict[str, Any]]:
    raise_absent(outcome, what, timeout)
    return {p: json.loads(v) for p, v in outcome.records.items()}


def publish_failure(tag: str, error: BaseException, *, channel: str | None = None) -> None:
    """Tell the processes waiting under ``tag`` that this one failed, so they stop now."""
    text = str(error) or "(no message)"
    text = text if len(text) <= 2000 else text[:2000] + " ..."
    message = f"{type(error).__name__}: " + text.replace("\n", "\n    ")
    record = json.dumps(PartRecord(status="error", message=message).wire())
    _agree.leave(tag, record, channel=channel)


def check_tag(tag: str, *, later: bool = False) -> str:
    """The tag of an `Assembly`'s checks at the transfer (``tag`` names its `agree_sizes`)."""
    return tag + ("/later" if later else "/check")


@dataclasses.dataclass
class Assembly:
    """One caller's assembly protocol: prepare -> agree -> transfer -> assemble.

    Uneven batches (``pad`` without known sizes) agree on sizes before placing; the rest is
    agreed while the blocks copy (with ``check="deferred"``, by a later call). ``stepwise``:
    agree at every call whatever ``check`` (`global_batches`).
    """

    tag: str
    what: str
    _: dataclasses.KW_ONLY
    pad: bool
    check: Check
    sizes_known: bool = False
    stepwise: bool = False

    def __post_init__(self) -> None:
        # a step's check has a channel of its own, apart from the size agreements of later steps
        self.check_channel = self.tag + "/replicas" if self.stepwise else None
        self.multi = _compat.distributed_state()[2] > 1
        self.later = self.check == "deferred"  # the check is verified by a later call
        self.check_tag = check_tag(self.tag, later=self.later)  # apart from agree_sizes'
        # whether the processes agree on sizes before placing anything (an uneven batch)
        self.exchanges_sizes = self.multi and self.pad and not self.sizes_known

    def prepare(self, make: Callable[[], Prepared]) -> Prepared:
        """``make()``; its failure is published to the processes that will wait for this one."""
        try:
            return make()
        except Exception as e:
            if self.exchanges_sizes or (self.multi and self.stepwise):
                publish_failure(self.tag, e)
            elif self.multi and self.check:
                publish_failure(self.check_tag, e)
            raise

    def agree_sizes(
        self,
        prepared: Prepared | None,
        status: str = "data",
        *,
        rows: int | None = None,
        what: str | None = None,
        explain: Callable[[dict[int, PartRecord]], None] | None = None,
    ) -> dict[int, PartRecord]:
        """Agree on ``status`` and this process's record; every record if any differs.

        Failures are raised; with ``check`` the records are compared, after ``explain`` (a
        caller's own message for a difference it knows better).
        """
        what = self.what if what is None else what
        record = self.record(prepared, status, rows)
        records = _read(exchange_records(self.tag, record.wire(), what))
        raise_failures(records, what)
        if self.check and prepared is not None and {r.status for r in records.values()} == {status}:
            if explain is not None:
                explain(records)
            compare(records, what)
        return records

    def record(self, prepared: Prepared | None, status: str, rows: int | None) -> PartRecord:
        """This process's record for `agree_sizes`: the status, and what the checks compare."""
        if prepared is None or not (self.check or self.pad):
            return PartRecord(status=status)
        return dataclasses.replace(describe(prepared, pad=self.pad), status=status, rows=rows)

    def place(self, prepared: Prepared, records: dict[int, PartRecord] | None) -> None:
        """Final plans: padded to the largest process's batch (``records`` from `agree_sizes`)."""
        rows = None
        if self.pad and self.sizes_known:  # the leaves' plans are over one element per block
            first = prepared.leaves[0]
            rows = first.global_shape[0] // first.plan.global_shape[0]
        elif self.pad:
            held = [r.block_rows for r in (records or {}).values() if r.block_rows is not None]
            rows = max([block_rows(prepared), *held])
        plan_leaves(prepared, rows)

    def transfer(self, prepared: Prepared, *, agreed: bool) -> tuple[Any, jax.Array | None]:
        """Start the copy, agree while it runs (unless ``agreed``), then ``(tree, mask)``.

        Every local device's block goes from the host, in one put per array (the leaves', then
        the mask's), as in `jax.make_array_from_process_local_data` (on CPU aligned numpy is
        aliased, not copied).
        """
        jobs = [(leaf.value, leaf.plan, leaf.sharding) for leaf in prepared.leaves]
        if prepared.mask is not None:
            jobs.append(prepared.mask)
        arrays = []
        try:
            for value, plan, sharding in jobs:
                blocks = [value[pl.local_index] for pl in plan.placements]  # JAX's device order
                devices = [pl.device for pl in plan.placements]
                shape = plan.global_shape
                arrays.append(_compat.put_blocks(shape, value.dtype, sharding, blocks, devices))
        except Exception as e:  # the others wait for this process at the check: tell them
            if self.multi and self.check and not agreed:
                publish_failure(self.check_tag, e, channel=self.check_channel)
            raise
        self._check(prepared, agreed=agreed)
        n = len(prepared.leaves)
        tree = jax.tree_util.tree_unflatten(prepared.treedef, arrays[:n])
        return tree, (arrays[n] if len(arrays) > n else None)

    def _check(self, prepared: Prepared, *, agreed: bool) -> None:
        """The agreement at the transfer: records (unless agreed before) and replica digests."""
        if not (self.multi and self.check):
            return
        replicas = replica_digests(prepared, full=self.check == "data")
        if agreed and not replicas:
            return  # agreed before placing, and no replicas to compare
        record = PartRecord() if agreed else describe(prepared, pad=self.pad)
        wire = {**record.wire(), "replicas": replicas} if replicas else record.wire()
        template = prepared.template  # its summary spares a JSON text per call
        said = template.summary if template and record is template.record else summary(wire)
        tag, what, timeout = self.check_tag, self.what, _env.check_timeout()
        named = what
        if self.later:  # verified after the call returns: a later call raises a difference
            number = _later_calls[tag] = _later_calls.get(tag, 0) + 1
            named = f"{what} (call #{number}, checked after it returned)"
        caller = contextvars.copy_context()  # what the messages advise depends on the caller

        def report(outcome: _agree.Outcome) -> None:
            caller.run(lambda: compare(_read(_records(outcome, timeout, named)), named))

        outcome = _agree.agree(  # the record's text is made only past the barriers
            tag, said, lambda: json.dumps(wire), timeout=timeout, groups=replicas, what=what,
            channel=self.check_channel, later=report if self.later else None,
        )  # fmt: skip
        if not outcome.agreed:
            report(outcome)

    def run(self, make: Callable[[], Prepared]) -> tuple[Any, jax.Array | None]:
        """The whole protocol for one assembly: ``(tree, mask)``."""
        prepared = self.prepare(make)
        if prepared.notes:
            warn_notes(prepared.notes, user_stacklevel())
        records = self.agree_sizes(prepared) if self.exchanges_sizes else None
        self.place(prepared, records)
        return self.transfer(prepared, agreed=records is not None)


@public
def global_array_from_local(
    local: Any,
    mesh_or_sharding: Mesh | NamedSharding,
    spec: SpecLike | Any = None,
    *,
    global_shape: Sequence[int] | Any = None,
    dtype: Any = None,
    pad: bool = False,
    check: Check = True,
) -> Any:
    """Assemble global `jax.Array`s from every process's local data.

    Each process passes its own part: along each dimension split across processes, the rows its
    devices hold (`meshkit.process_slice` says which); other dimensions whole. Processes whose
    devices hold the same blocks must pass the same data. With one process, ``local`` is the
    whole array. On CPU an aligned numpy block may be used in place, as by `jax.device_put`:
    do not write into ``local`` afterwards.

    Args:
        local: this process's data: an array or a pytree of numpy arrays, array-likes, scalars
            or single-process ``jax.Array`` s.
        mesh_or_sharding: a `jax.sharding.Mesh` over every process's devices (with ``spec``),
            or a `jax.sharding.NamedSharding` (without ``spec``).
        spec: a `jax.sharding.PartitionSpec`, a spec string (``"data"``,
            ``"batch seq -> data _"``), or a pytree of them that is a prefix of ``local``.
        global_shape: the global shape (or a pytree of shapes like ``local``); inferred when
            left out, checked when given. With ``pad=True`` it fixes the padded leading size.
        dtype: cast every array to this dtype.
        pad: pad the leading (batch) dimension with zeros to a size every process agrees on;
            the result is then ``(arrays, mask)``, ``mask`` True for real rows.
        check: ``True``: the processes agree on structure, dtypes, shapes and sampled digests
            of replicated blocks before the call returns; a mismatch raises in this call on
            every process. ``"data"``: replicated blocks hashed whole (costly). ``"deferred"``:
            returns at once; a mismatch is raised by a later call (every 64th call of the site,
            or the next meshkit call that waits for the others, verifies the calls before it),
            so computations on the arrays may run first. ``False``: no comparison.

    Returns:
        The global arrays, in ``local``'s pytree structure; with ``pad=True``, the pair
        ``(arrays, mask)``.

    Raises:
        MeshkitError: a local dimension does not split over this process's blocks (for the
            leading one, consider ``pad=True``); processes disagree, failed or did not arrive
            within ``MESHKIT_CHECK_TIMEOUT``; a bad spec, mesh, leaf, ``global_shape`` or
            ``check``.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> batch = {"x": np.ones((16, 3), np.float32), "y": np.arange(16, dtype=np.int32)}
        >>> g = meshkit.global_array_from_local(batch, mesh, "data")
        >>> g["x"].shape, g["x"].sharding.spec
        ((16, 3), P('data',))
        >>> x, mask = meshkit.global_array_from_local(np.ones((13, 3), np.float32), mesh, "data",
        ...                                           pad=True)
        >>> x.shape, int(mask.sum())
        ((16, 3), 13)
    """
    if not isinstance(check, bool | str) or check not in (True, False, "data", "deferred"):
        raise MeshkitError(
            f"meshkit.global_array_from_local: check must be True, False, 'data' or 'deferred'; "
            f"got {check!r}."
        )
    _dispatch.enter(_SITE, (local,))
    tag = _channel.scoped("global_array_from_local", WHAT)
    assembly = Assembly(tag, WHAT, pad=pad, check=check, sizes_known=global_shape is not None)
    tree, mask = assembly.run(
        lambda: prepare(
            local, mesh_or_sharding, spec, global_shape=global_shape, dtype=dtype, pad=pad
        )
    )
    return (tree, mask) if pad else tree
