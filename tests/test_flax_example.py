"""examples/flax_nnx_training.py in 2 processes: both ways match the single-device run."""

from __future__ import annotations

import re

import pytest
from conftest import EXAMPLES, require
from ranks.preloads import ECOSYSTEM

import meshkit
from meshkit.testing._forks import starter

pytestmark = pytest.mark.multiprocess

_DIFF = re.compile(r"\((a|b)\) vs single device: max \|loss diff\| (\S+), max \|param diff\| (\S+)")
_STEP = re.compile(r"step +(\d+): loss single device (\S+) +\(a\) spmd (\S+) +\(b\) jit (\S+)")


def test_both_ways_of_training_match_one_device_in_two_processes(marker):
    require("flax")
    require("optax", "flax")
    # As `meshkit launch -n 2 --devices-per-process 4` runs it (`nox -s examples` runs it so),
    # with the processes forked from a server that imported flax and optax once.
    result = meshkit.launch(
        [str(EXAMPLES / "flax_nnx_training.py")], num_processes=2, devices_per_process=4,
        platform="cpu", timeout=400, env={"MESHKIT_TEST_MARKER": marker}, stream=False,
        keep_output=True, starter=starter(None, "tests/test_flax_example.py", ECOSYSTEM),
    )  # fmt: skip
    out = result.ranks[0].stdout
    assert result.returncode == 0, result.report
    assert "Mesh {'data': 4, 'model': 2}: 8 devices on 2 processes" in out
    steps = [m.groups() for m in _STEP.finditer(out)]
    assert [int(s[0]) for s in steps] == list(range(12))
    for _, ref, a, b in steps:
        assert abs(float(a) - float(ref)) < 1e-5
        assert abs(float(b) - float(ref)) < 1e-5
    assert float(steps[-1][2]) < float(steps[0][2])  # it trains
    diffs = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in _DIFF.finditer(out)}
    assert set(diffs) == {"a", "b"}
    assert all(d < 1e-5 for pair in diffs.values() for d in pair), diffs
    # Both ways: the optimizer state is laid out like the parameters it belongs to.
    for way in "ab":
        line = f"({way}) l1.kernel P(None, 'model') (8, 16), its adamw mu P(None, 'model') (8, 16)"
        assert f"{line}, count P()" in out
    for rank in (0, 1):
        assert f"process {rank}/2: OK" in result.ranks[rank].stdout
