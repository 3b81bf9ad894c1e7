"""Debug mode: find processes that diverge, and stalls, before they become silent hangs.

In a multi-process JAX program every process must make the same SPMD calls, in the same order,
with the same shapes. When they do not, JAX's collectives hang or return wrong values, with no
error. With debug mode on (``MESHKIT_DEBUG=1`` in the environment, or `enable`), every meshkit
SPMD entry (`meshkit.spmd` functions, `meshkit.pmap_compat` functions,
`meshkit.global_array_from_local`, `meshkit.make_mesh`) and every call of this module's
`process_allgather`, `broadcast_one_to_all`, `sync_global_devices` and `assert_equal` (JAX's
``jax.experimental.multihost_utils`` functions of those names, which meshkit leaves unchanged:
call these instead to have them checked) compares a fingerprint of the call with the other
processes' through the coordination service (never through a device collective: those are what
hang). The fingerprint holds the entry and function, the call's number in this process, the
arguments' pytree structure, shapes, dtypes and shardings, and static arguments.

Every process agrees on each call's fingerprint before the call runs (one agreement of the
caller's channel, `meshkit._src.coord.agree`): at the first call where processes diverge, every
process raises `meshkit.DivergenceError` from that call, naming the processes that differ and the
first field that differs, and none runs it. A process that does not arrive within the timeout is
named as missing, with the last call it made; one that ended or failed, by how it left.
`meshkit.spmd` also compares, in debug mode, the data of the parts of its host arguments that
several processes pass (which must be equal; a CRC-32 per block).

Debug mode says once (logged under ``meshkit.debug``) that it is on, with its settings
(``meshkit debug: on in process 0 of 2: timeout 120 s, watchdog 60 s, exit_on_stall True``).
It also runs a stall watchdog (`meshkit._src.lifecycle.watchdog`): when this process has made
no progress for ``watchdog`` seconds (its main thread waiting in one place, no device work
completing, no meshkit call) it logs where it is (one ``meshkit watchdog:`` message under
``meshkit.guards``; ``meshkit launch`` puts it in its closing summary) and writes the Python
stacks of all its threads to stderr.
If it still makes no progress for another ``timeout`` seconds it exits with status 1, so that
the launcher's (or mpirun's) fail-fast ends the group instead of a hang.

`barrier` is always available: a named meeting point with a timeout whose error names the
processes that did not come.

Off, the cost is one counter increment and one emptiness test per SPMD call. On, a call costs
its fingerprint (microseconds) and one agreement: two requests to the coordination service (an
increment, a read of the verdict) when the calls repeat a pattern for `PERIOD` (12) calls, three
otherwise.
See ``nox -s bench``.
"""

from ._src.core.errors import DivergenceError as DivergenceError
from ._src.debug.barrier import barrier as barrier
from ._src.debug.mode import ENV_DEBUG as ENV_DEBUG
from ._src.debug.mode import ENV_DEBUG_TIMEOUT as ENV_DEBUG_TIMEOUT
from ._src.debug.mode import ENV_WATCHDOG as ENV_WATCHDOG
from ._src.debug.mode import debugging as debugging
from ._src.debug.mode import disable as disable
from ._src.debug.mode import enable as enable
from ._src.debug.mode import enable_from_environment as enable_from_environment
from ._src.debug.mode import enabled as enabled
from ._src.debug.mode import settings as settings
from ._src.debug.multihost import assert_equal as assert_equal
from ._src.debug.multihost import broadcast_one_to_all as broadcast_one_to_all
from ._src.debug.multihost import process_allgather as process_allgather
from ._src.debug.multihost import sync_global_devices as sync_global_devices
from ._src.debug.state import PERIOD as PERIOD
from ._src.debug.state import Settings as Settings

__all__ = [
    "ENV_DEBUG",
    "ENV_DEBUG_TIMEOUT",
    "ENV_WATCHDOG",
    "PERIOD",
    "DivergenceError",
    "Settings",
    "assert_equal",
    "barrier",
    "broadcast_one_to_all",
    "debugging",
    "disable",
    "enable",
    "enable_from_environment",
    "enabled",
    "process_allgather",
    "settings",
    "sync_global_devices",
]
