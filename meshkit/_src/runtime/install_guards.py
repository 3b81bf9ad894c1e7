"""What `meshkit.init` wires the lifecycle to: fail-fast and preemption over coordination."""

from __future__ import annotations

from ..coord import agree as _agree
from ..coord import failures as _failures
from ..coord import save_step as _coord_preemption
from ..core import compat as _compat
from ..lifecycle import failfast as _failfast
from ..lifecycle import preemption as _preemption

__all__ = ["alone", "before_joining", "joined"]


def before_joining(fail_fast: float | None, grace: float) -> None:
    """Take SIGTERM as a notice while the processes join (not if the program joined itself)."""
    if fail_fast is not None and _compat.distributed_state()[0] is None:
        _preemption.install(None, seconds=grace, tell=None, sync=None)


def alone(fail_fast: float | None, grace: float, me: int) -> None:
    """A process that runs alone: SIGTERM is a notice, the sync step its own."""
    if fail_fast is not None:
        _preemption.install(me, seconds=grace, tell=None, sync=_preemption.alone)


def joined(fail_fast: float | None, grace: float, me: int, n: int) -> None:
    """Process ``me`` of ``n`` joined: fail-fast's watch, and notices told and agreed on."""
    _failfast.install(
        fail_fast,
        me,
        n,
        post=_failures.poster(me),
        poll=_failures.watcher(me),
        wait=_failures.waiter(me),
        nudge=_failures.nudger(me),
        kept=_agree.take_unraised,
        read=_failures.reader(),
    )
    if fail_fast is not None:  # the failure watch relays the others' notices
        sync = _coord_preemption.syncer(me)
        _preemption.install(me, seconds=grace, tell=_failures.teller(), sync=sync)
