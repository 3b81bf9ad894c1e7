"""A training loop written the flax-imagenet way runs on meshkit with only its imports changed.

examples/pmap_migration.py holds the loop (`legacy_training`, parameterised by what old code
imports) and `compare`, which runs it with jax.pmap and flax-like helpers and with
meshkit.pmap_compat and meshkit's helpers, and checks every step's loss and the final
parameters agree. Here it runs in one process (8 CPU devices) and in 2 processes x 4.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "pmap_migration.py"
UNMODIFIED = EXAMPLES / "pmap_unmodified_loop.py"


def _example(path=EXAMPLE):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _compare_in_process():
    import jax

    losses = _example().compare()
    return jax.process_index(), [float(x) for x in losses]


def test_legacy_loop_gives_jax_pmaps_numbers_in_one_process():
    example = _example()
    losses = example.compare()
    assert losses.shape == (example.STEPS,)
    assert losses[-1] < 0.5 * losses[0]  # it trains


@pytest.mark.multiprocess
def test_legacy_loop_gives_jax_pmaps_numbers_in_two_processes(warm_cluster):
    (p0, l0), (p1, l1) = warm_cluster.run(_compare_in_process, timeout=240)
    assert (p0, p1) == (0, 1)
    assert l0 == l1  # the loss is averaged over every device of both processes
    assert l0[-1] < 0.5 * l0[0]


def _unmodified_in_process():
    """The unmodified loop's printed lines (compare() raises if jax.pmap printed others)."""
    import jax

    return jax.process_index(), _example(UNMODIFIED).compare()


def test_unmodified_loop_prints_jax_pmaps_lines_in_one_process():
    lines = _example(UNMODIFIED).compare()
    assert len(lines) == 6
    assert lines[3].startswith("eval: ")
    assert lines[4].startswith("checkpoint: step 12, |w| ")


@pytest.mark.multiprocess
def test_unmodified_loop_prints_jax_pmaps_lines_in_two_processes(warm_cluster):
    (p0, lines0), (p1, lines1) = warm_cluster.run(_unmodified_in_process, timeout=240)
    assert (p0, p1) == (0, 1)
    # The global loss and the replicated state agree; per-device losses and eval counts are
    # each process's own, as with jax.pmap.
    for a, b in zip(lines0[:3], lines1[:3], strict=True):
        assert a.split(", on this")[0] == b.split(", on this")[0]
        assert a != b
    assert lines0[4:] == lines1[4:]
    assert [len(line.split()) for line in lines0[:3]] == [12] * 3  # 8 words and 4 local devices
