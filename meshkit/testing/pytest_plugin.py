"""A pytest plugin: the ``warm_cluster`` fixture, one `WarmCluster` per test module.

Enable it with ``pytest -p meshkit.testing.pytest_plugin`` (or ``addopts`` in your pytest
configuration). A module sets the cluster's options with the ``warm_cluster`` marker, and
may give every worker environment variables through a ``warm_cluster_env`` fixture:

```python
import pytest

pytestmark = pytest.mark.warm_cluster(num_processes=2, devices_per_process=4, timeout=120)

def body():
    import jax
    return jax.process_index(), jax.device_count()

def test_two_processes(warm_cluster):
    assert warm_cluster.run(body) == [(0, 8), (1, 8)]
```

The processes start when the first test of the module that uses the fixture sets it up, and
end with the module; a test whose body hangs ends them, and the next call starts fresh ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._warm import WarmCluster

__all__ = ["warm_cluster", "warm_cluster_env"]

_MARKER = (
    "warm_cluster(num_processes=2, devices_per_process=4, env=None, timeout=120.0, "
    "start_timeout=120.0, preload=()): options of the module's meshkit.testing.WarmCluster"
)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``warm_cluster`` marker (modules set the cluster's options with it)."""
    config.addinivalue_line("markers", _MARKER)


@pytest.fixture(scope="module")
def warm_cluster_env() -> dict[str, str]:
    """Extra environment variables for the workers; override it in a conftest to add some."""
    return {}


@pytest.fixture(scope="module")
def warm_cluster(
    request: pytest.FixtureRequest, warm_cluster_env: dict[str, str]
) -> Iterator[WarmCluster]:
    """A `WarmCluster` shared by the module's tests, with the module's marker's options."""
    marker = request.node.get_closest_marker("warm_cluster")
    options = dict(marker.kwargs) if marker is not None else {}
    options["env"] = {**warm_cluster_env, **(options.get("env") or {})}
    with WarmCluster(**options) as cluster:
        # Started here, before the test's own fixtures change the environment the launcher
        # passes on (a restart after a timeout starts at the next call instead).
        cluster.start()
        yield cluster
