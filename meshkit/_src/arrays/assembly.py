"""The assembly protocol, and `global_array_from_local` built on it.

`Assembly` owns the order of the steps, prepare -> agree -> transfer -> assemble, for
`global_array_from_local`, the host arguments of `meshkit.spmd` / `meshkit.pmap_compat` and each
step of `meshkit.global_batches`. The modules below it never call back up:

- `meshkit._src.arrays.templates` / `meshkit._src.arrays.blocks`: this process's part, checked,
  cast and planned (from a template when the layout repeats);
- `meshkit._src.arrays.records`: the `PartRecord` each process tells the others, and the comparison
  that names who differs;
- `meshkit._src.coord.agree`: the agreement itself (through the coordination service);
- `meshkit._src.arrays.transfer`: the blocks onto the devices, and the global arrays.
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
from ..coord import missing as _missing
from ..core import compat as _compat
from ..core import env as _env
from ..core.errors import MeshkitError
from ..core.frames import user_stacklevel
from ..core.tracebacks import public
from ..runtime import dispatch as _dispatch
from ..sharding import layout as _layout
from ..sharding.specs import SpecLike
from .blocks import Prepared, block_rows, describe, finish_padding, plan_leaves, replica_digests
from .dtypes import warn_notes
from .entry_point import WHAT
from .records import PartRecord, compare, raise_failures, summary
from .templates import prepare
from .transfer import assemble, transfer

__all__ = ["Assembly", "Check", "Verify", "global_array_from_local"]

Check = bool | Literal["data", "deferred"]  # global_array_from_local's check=
# When an `Assembly`'s check at the transfer is verified: before the call returns ("now"), or
# after it returns, raised by a later call ("later", only for check="deferred").
Verify = Literal["now", "later"]
_CHECKS: dict[Any, Verify] = {True: "now", "deferred": "later", "data": "now", False: "now"}


# Processes may hold different numbers of rows (pad=True): the debug fingerprint leaves the
# leading dimension out.
_SITE = _dispatch.CallSite(
    "global_array_from_local",
    "meshkit.global_array_from_local",
    info={"ragged": True, "params": ("local",)},
)


def exchange_records(
    tag: str,
    record: dict[str, Any],
    what: str = WHAT,
    *,
    replicas: dict[str, tuple[int, str]] | None = None,
    channel: str | None = None,
) -> dict[int, dict[str, Any]]:
    """Agree with every process on ``record`` (all of it but local shapes; see `summary`).

    Returns this process's record alone when every process's is equal (and the ``replicas``
    digests of each block equal its reference's); otherwise every process's record, for the
    caller to compare, to name who differs, or to take a maximum. Missing processes, and
    processes that stopped waiting, are an error. ``channel``: `_agree.agree`'s.
    """
    timeout = _env.check_timeout()
    record = _with_replicas(record, replicas)
    outcome = _agree.agree(
        tag, summary(record), json.dumps(record), timeout=timeout, groups=replicas, what=what,
        channel=channel,
    )  # fmt: skip
    return _records(outcome, timeout, what)


def exchange_records_later(
    tag: str,
    record: PartRecord,
    what: str,
    *,
    replicas: dict[str, tuple[int, str]],
    summarized: str | None = None,
) -> None:
    """`exchange_records` of a `PartRecord`, verified after the call returns (`_agree.agree_later`).

    A difference is named by `compare` there and raised by this process's next meshkit call
    (``check="deferred"``). ``summarized``: the record's `summary`, when the caller has it
    already (a layout seen before). The record's JSON is only made if it is shown.
    """
    timeout = _env.check_timeout()
    wire = _with_replicas(record.wire(), replicas)
    number = _later_calls[tag] = _later_calls.get(tag, 0) + 1
    caller = contextvars.copy_context()  # what the call's messages advise depends on its caller

    def on_outcome(outcome: _agree.Outcome) -> None:
        named = f"{what} (call #{number}, checked after it returned)"
        caller.run(lambda: compare(_read(_records(outcome, timeout, named)), named))

    _agree.agree_later(
        tag,
        summary(wire) if summarized is None else summarized,
        lambda: json.dumps(wire),
        timeout=timeout,
        groups=replicas,
        on_outcome=on_outcome,
    )


_later_calls: dict[str, int] = {}  # checks verified after the call returns, per tag (for messages)


def _with_replicas(
    record: dict[str, Any], replicas: dict[str, tuple[int, str]] | None
) -> dict[str, Any]:
    """``record`` with the replica digests, which phase 3 shows to name who differs."""
    return {**record, "replicas": replicas} if replicas else record


def _read(records: dict[int, dict[str, Any]]) -> dict[int, PartRecord]:
    return {p: PartRecord.read(r) for p, r in records.items()}


def _records(outcome: _agree.Outcome, timeout: float, what: str) -> dict[int, dict[str, Any]]:
    gone = outcome.missing or outcome.gave_up
    if gone:
        late = not outcome.missing
        raise MeshkitError(
            f"{what}: "
            + (
                f"{_missing.stopped_waiting(gone)} for this process (their {timeout:g} s ran out "
                "before it arrived)"
                if late
                else f"{_missing.did_not(gone, timeout=timeout)}; the others did"
            )
            + ".\nEvery process must make the same calls in the same order (a process that "
            "stopped, crashed, or took another branch never arrives).\n"
            f"Consider looking at those processes' output; {_env.ENV_CHECK_TIMEOUT} sets the "
            "wait."
        )
    return {p: json.loads(v) for p, v in outcome.records.items()}


def publish_record(
    tag: str, record: PartRecord, *, later: bool = False, channel: str | None = None
) -> None:
    """Post this process's record of the next agreement under ``tag`` without waiting for others.

    Used when this process leaves a sequence of agreements (a failure, an iterator closed
    early), so that the others, waiting for it, stop at once instead of timing out. ``later``:
    the tag is verified after the call returns (`exchange_records_later`). ``channel``: the channel
    whose next agreement it is, when another thread's (default the caller's).
    """
    _agree.leave(tag, json.dumps(record.wire()), later=later, channel=channel)


def publish_failure(
    tag: str, error: BaseException, *, later: bool = False, channel: str | None = None
) -> None:
    """Tell the other processes that this one failed, so they stop now instead of timing out."""
    text = str(error) or "(no message)"
    text = text if len(text) <= 2000 else text[:2000] + " ..."
    message = f"{type(error).__name__}: " + text.replace("\n", "\n    ")
    publish_record(tag, PartRecord(status="error", message=message), later=later, channel=channel)


def check_tag(tag: str, *, later: bool = False) -> str:
    """The tag of an `Assembly`'s checks at the transfer (``tag`` names its `agree_sizes`)."""
    return tag + ("/later" if later else "/check")


class Assembly:
    """The assembly protocol: prepare -> agree -> transfer -> assemble, in one place.

    `global_array_from_local` (`run`), the host arguments of `meshkit.spmd` and
    `meshkit.pmap_compat`, and each step of `meshkit.global_batches` go through it. The
    agreement (`meshkit._src.coord.agree`) costs O(1) coordination-service round trips per process:

    - the sizes of an uneven batch (``pad=True`` without a global shape) are agreed before
      anything is placed (the padded size depends on every process);
    - the structure, dtypes, global shapes and a digest of the replicas (blocks that several
      processes hold) are agreed once the copy of the blocks is under way (``verify="now"``):
      a disagreement raises before the call returns, so no computation on the arrays starts;
      or, for ``check="deferred"`` alone, after the call returns: a
      disagreement is then raised by this process's next meshkit call.

    Args:
        tag: names the sequence of agreements (one per caller, the same in every process).
        what: the public function messages name.
        pad: pad the leading dimension to the largest process's batch (a mask marks rows).
        check: `global_array_from_local`'s ``check``.
        sizes_known: with ``pad``, the padded size is known (a global shape was given).
        verify: when the check at the transfer is verified (`Verify`).
        stepwise: the processes agree at every call whatever ``check`` (`global_batches`
            agrees on the end of data at each step).
        check_channel: the channel whose sequence holds the checks at the transfer (default the
            caller's). `global_batches` keeps them apart: its helper places a step (and checks
            its replicas) or agrees on the next window first as its caller takes steps, an order
            that may differ between processes.
    """

    def __init__(
        self,
        tag: str,
        what: str,
        *,
        pad: bool,
        check: Check,
        sizes_known: bool = False,
        verify: Verify = "now",
        stepwise: bool = False,
        check_channel: str | None = None,
    ) -> None:
        self.tag, self.what = tag, what
        self.pad, self.check, self.sizes_known, self.verify = pad, check, sizes_known, verify
        self.stepwise, self.check_channel = stepwise, check_channel
        self.multi = _compat.distributed_state()[2] > 1
        self.later = verify != "now"
        # The checks made at the transfer form a sequence of their own, never mixed with
        # `agree_sizes`'s; those verified after the call returns (agreed in windows) another.
        self.check_tag = check_tag(tag, later=self.later)

    @property
    def exchanges_sizes(self) -> bool:
        """Whether the processes agree on sizes before placing anything (an uneven batch)."""
        return self.multi and self.pad and not self.sizes_known

    def prepare(self, make: Callable[[], Prepared]) -> Prepared:
        """``make()``; its failure is published to the processes that will wait for this one."""
        try:
            return make()
        except Exception as e:
            # Told where the others wait first: `agree_sizes` (an uneven batch, each step of
            # global_batches), else the check at the transfer.
            if self.exchanges_sizes or (self.multi and self.stepwise):
                publish_failure(self.tag, e)
            elif self.multi and self.check:
                publish_failure(self.check_tag, e, later=self.later)
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
        """Agree (and wait) on ``status`` and, with data, the record; every record if any differs.

        With ``check`` the records are compared (a `MeshkitError` names who differs); without,
        only failures are raised. ``prepared`` None: this process has no data (``status``).
        ``rows``: the data's rows, compared too (`PartRecord.rows`). ``what``: the
        caller as messages name it (default the assembly's). ``explain``: runs on the records
        before they are compared, to raise a message of the caller's own for a difference it
        knows better.
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

    def agree_window(
        self, summary: str, record: dict[str, Any], *, what: str
    ) -> dict[int, dict[str, Any]]:
        """One agreement in ``tag``'s sequence for several steps (`meshkit._src.arrays.prefetch`).

        ``summary`` stands for the steps' records; returns this process's ``record`` alone
        when every summary is equal, else every process's, among them the records of
        processes that left the sequence (`publish_record`). Missing processes, and processes
        that stopped waiting, are an error.
        """
        timeout = _env.check_timeout()
        outcome = _agree.agree(self.tag, summary, json.dumps(record), timeout=timeout, what=what)
        return _records(outcome, timeout, what)

    def place(self, prepared: Prepared, records: dict[int, PartRecord] | None) -> None:
        """Final plans: padded to the largest process's batch (``records`` from `agree_sizes`)."""
        if not self.pad:
            plan_leaves(prepared)
            return
        first = prepared.leaves[0]
        rows = first.global_shape[0] // _layout.block_counts(first.sharding, first.value.ndim)[0]
        if not self.sizes_known:
            rows = block_rows(prepared)
            if records is not None:
                rows = max(
                    [rows, *(r.block_rows for r in records.values() if r.block_rows is not None)]
                )
        finish_padding(prepared, rows)

    def transfer(self, prepared: Prepared, *, agreed: bool) -> tuple[Any, jax.Array | None]:
        """Place the blocks and assemble; unless ``agreed`` already, agree while they copy.

        The copy is started first (JAX dispatches it without waiting), so the agreement's round
        trip overlaps it; the arrays are returned only once the processes agreed.
        """
        try:
            arrays = transfer(prepared)
        except Exception as e:  # the others wait for this process at the check: tell them
            if self.multi and self.check and not agreed:
                publish_failure(self.check_tag, e, later=self.later, channel=self.check_channel)
            raise
        self._check(prepared, agreed=agreed)
        return assemble(prepared, arrays)

    def _check(self, prepared: Prepared, *, agreed: bool) -> None:
        """The agreement made at the transfer, in the caller's thread (or beside it, deferred)."""
        if not (self.multi and self.check):
            return
        replicas = replica_digests(prepared, full=self.check == "data")
        if agreed and not replicas:
            return  # agreed before placing, and no replicas to compare
        record = PartRecord() if agreed else describe(prepared, pad=self.pad)
        if self.later:
            template = prepared.template
            known = template.summary if template is not None and record is template.record else None
            exchange_records_later(
                self.check_tag,
                record,
                self.what,
                replicas=replicas,
                summarized=known,
            )
            return
        records = exchange_records(
            self.check_tag, record.wire(), self.what, replicas=replicas, channel=self.check_channel
        )
        compare(_read(records), self.what)

    def run(self, make: Callable[[], Prepared]) -> tuple[Any, jax.Array | None]:
        """The whole protocol for one assembly: ``(tree, mask)``."""
        prepared = self.prepare(make)
        if prepared.notes:
            warn_notes(prepared.notes, user_stacklevel())
        records = self.agree_sizes(prepared) if self.exchanges_sizes else None
        self.place(prepared, records)
        return self.transfer(prepared, agreed=records is not None)


def run(
    local: Any,
    mesh_or_sharding: Any,
    spec: Any,
    *,
    global_shape: Any,
    dtype: Any,
    pad: bool,
    check: Check,
    tag: str,
    what: str = WHAT,
    verify: Verify = "now",
) -> tuple[Any, jax.Array | None]:
    """`global_array_from_local` with the exchange tag chosen by the caller (on its channel)."""
    assembly = Assembly(
        _channel.scoped(tag, what),
        what,
        pad=pad,
        check=check,
        sizes_known=global_shape is not None,
        verify=verify,
    )
    return assembly.run(
        lambda: prepare(
            local, mesh_or_sharding, spec, global_shape=global_shape, dtype=dtype, pad=pad
        )
    )


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

    Each process passes its own part: along each dimension the array is split across processes,
    the rows its devices hold (`meshkit.process_slice` says which); dimensions split only inside
    a process, or not split, are passed whole. Processes whose devices hold the same blocks (a
    mesh axis across processes that the spec does not use) must pass the same data. With one
    process, ``local`` is the whole array.

    On CPU, as with `jax.device_put`, a numpy block that XLA can use in place (64-byte aligned,
    no cast) is not copied: the result reads ``local``'s memory, so do not write into ``local``
    afterwards.

    Args:
        local: this process's data: an array or a pytree (dict, list, tuple, NamedTuple,
            registered dataclass) of numpy arrays, array-likes, scalars or single-process
            ``jax.Array`` s.
        mesh_or_sharding: a `jax.sharding.Mesh` over every process's devices (with ``spec``),
            or a `jax.sharding.NamedSharding` (without ``spec``).
        spec: how the global array is split: a `jax.sharding.PartitionSpec`, a spec string
            (``"data"``, ``"batch seq -> data _"``), or a pytree of them that is a prefix of
            ``local``.
        global_shape: the global shape (a shape, or a pytree of shapes like ``local``).
            Inferred when left out; when given it is checked against the local data, and with
            ``pad=True`` it fixes the padded leading size (no exchange of sizes).
        dtype: cast every array to this dtype.
        pad: pad the leading (batch) dimension with zeros to a size every process agrees on, so
            that uneven batches (the last one of an epoch) still assemble; the result is then
            ``(arrays, mask)`` with a boolean ``mask`` over the global batch (sharded like it),
            True for real rows.
        check: compare the processes' pytree structure, dtypes and shapes through the
            coordination service. ``True``: every process agrees before the call returns (two
            requests to the coordination service in a loop whose layouts repeat a pattern for
            `meshkit.debug.PERIOD` calls, three otherwise), replicas (blocks that several
            processes pass) compared by sampled digests; a mismatch raises in this call on
            every process, so no computation on mismatched arrays starts. ``"data"``: the
            same, with every replicated block hashed whole (costly, for debugging).
            ``"deferred"``: every call returns at once and is verified after the call returns; a
            mismatch is raised by the process's next meshkit call (or ends it), after up to
            ``2 * 512`` unverified calls, so computations on the arrays may run first.
            ``False`` skips the comparison (``pad=True`` still exchanges batch sizes unless
            ``global_shape`` is given).

    Returns:
        The global arrays, in ``local``'s pytree structure; with ``pad=True``, the pair
        ``(arrays, mask)``.

    Raises:
        MeshkitError: a local dimension does not split over this process's blocks (for the
            leading one, consider ``pad=True``); processes disagree on structure, shapes or
            dtypes, or one of them failed or did not arrive within ``MESHKIT_CHECK_TIMEOUT``
            seconds; the spec names an axis the mesh lacks or has more entries than the array
            has dimensions; the mesh does not span every process; a leaf is not an array;
            ``global_shape`` does not fit the local data; ``check`` is not one of its values.

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
    if not isinstance(check, bool | str) or check not in _CHECKS:
        raise MeshkitError(
            f"meshkit.global_array_from_local: check must be True, False, 'data' or 'deferred'; "
            f"got {check!r}."
        )
    _dispatch.enter(_SITE, (local,))
    tree, mask = run(
        local,
        mesh_or_sharding,
        spec,
        global_shape=global_shape,
        dtype=dtype,
        pad=pad,
        check=check,
        tag="global_array_from_local",
        verify=_CHECKS[check],
    )
    return (tree, mask) if pad else tree
