"""examples/flax_nnx_training.py in 2 processes: both ways match the single-device run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import EXAMPLES, require

pytestmark = pytest.mark.multiprocess

_DIFF = re.compile(
    r"\[rank0\] \((a|b)\) vs single device: max \|loss diff\| (\S+), max \|param diff\| (\S+)"
)
_STEP = re.compile(
    r"\[rank0\] step +(\d+): loss single device (\S+) +\(a\) spmd (\S+) +\(b\) jit (\S+)"
)


def test_both_ways_of_training_match_one_device_in_two_processes(marker):
    require("flax")
    require("optax", "flax")
    out = subprocess.run(
        [sys.executable, "-m", "meshkit", "launch", "-n", "2", "--devices-per-process", "4",
         "--timeout", "400", str(EXAMPLES / "flax_nnx_training.py")],
        env={**os.environ, "MESHKIT_TEST_MARKER": marker},
        capture_output=True, text=True, timeout=450, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "[rank0] Mesh {'data': 4, 'model': 2}: 8 devices on 2 processes" in out.stdout
    steps = [m.groups() for m in _STEP.finditer(out.stdout)]
    assert [int(s[0]) for s in steps] == list(range(12))
    for _, ref, a, b in steps:
        assert abs(float(a) - float(ref)) < 1e-5
        assert abs(float(b) - float(ref)) < 1e-5
    assert float(steps[-1][2]) < float(steps[0][2])  # it trains
    diffs = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in _DIFF.finditer(out.stdout)}
    assert set(diffs) == {"a", "b"}
    assert all(d < 1e-5 for pair in diffs.values() for d in pair), diffs
    # Both ways: the optimizer state is laid out like the parameters it belongs to.
    for way in "ab":
        line = f"({way}) l1.kernel P(None, 'model') (8, 16), its adamw mu P(None, 'model') (8, 16)"
        assert f"{line}, count P()" in out.stdout
    for rank in (0, 1):
        assert f"[rank{rank}] process {rank}/2: OK" in out.stdout
