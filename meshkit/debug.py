"""Debug mode: find processes that diverge, and stalls, before they become silent hangs.

On (``MESHKIT_DEBUG=1`` or `enable`), every meshkit SPMD entry and this module's versions of
JAX's ``multihost_utils`` functions compare a fingerprint of the call across processes through
the coordination service; the first divergence is a `meshkit.DivergenceError` on every process.
A stall watchdog dumps stacks, then exits. `barrier` is a named meeting point with a timeout.
See docs/hangs.md.
"""

from ._src.core.errors import DivergenceError as DivergenceError
from ._src.debug.divergence import PERIOD as PERIOD
from ._src.debug.divergence import Settings as Settings
from ._src.debug.divergence import enabled as enabled
from ._src.debug.mode import ENV_DEBUG as ENV_DEBUG
from ._src.debug.mode import ENV_DEBUG_TIMEOUT as ENV_DEBUG_TIMEOUT
from ._src.debug.mode import ENV_WATCHDOG as ENV_WATCHDOG
from ._src.debug.mode import debugging as debugging
from ._src.debug.mode import disable as disable
from ._src.debug.mode import enable as enable
from ._src.debug.mode import enable_from_environment as enable_from_environment
from ._src.debug.mode import settings as settings
from ._src.debug.multihost import assert_equal as assert_equal
from ._src.debug.multihost import barrier as barrier
from ._src.debug.multihost import broadcast_one_to_all as broadcast_one_to_all
from ._src.debug.multihost import process_allgather as process_allgather
from ._src.debug.multihost import sync_global_devices as sync_global_devices

__all__ = [
    "ENV_DEBUG", "ENV_DEBUG_TIMEOUT", "ENV_WATCHDOG", "PERIOD", "DivergenceError", "Settings",
    "assert_equal", "barrier", "broadcast_one_to_all", "debugging", "disable", "enable",
    "enable_from_environment", "enabled", "process_allgather", "settings",
    "sync_global_devices",
]  # fmt: skip
