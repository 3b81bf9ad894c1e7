"""Where the data ends in `meshkit.global_batches`: the short-batch rule, decided from records.

`meshkit._src.arrays.ends.short_batch` decides from the records every process holds at a step;
the multi-process behaviour is in `tests/test_global_multiprocess.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshkit
from meshkit._src.arrays import ends
from meshkit._src.arrays.records import LeafRecord, PartRecord


def _record(rows: int | None, last: bool | None, status: str = "data") -> PartRecord:
    leaf = LeafRecord("['x']", "float32", [["data"], []], ["?", 2], [rows or 0, 2])
    return PartRecord(
        status=status, tree="PyTreeDef({'x': *})", leaves=(leaf,), rows=rows, last=last
    )


def _message(records: dict[int, PartRecord], step: int, *, pad: bool) -> str | None:
    error = ends.short_batch(records, step, pad=pad)
    return None if error is None else str(error)


@given(
    rows=st.lists(st.sampled_from([0, 4, 7, 8]), min_size=2, max_size=6),
    last=st.lists(st.booleans(), min_size=6, max_size=6),
    pad=st.booleans(),
    step=st.integers(1, 1000),
)
def test_only_a_last_batch_may_be_short(rows, last, pad, step):
    records = {p: _record(n, last[p]) for p, n in enumerate(rows)}
    message = _message(records, step, pad=pad)
    short = [p for p, n in enumerate(rows) if n < max(rows)]
    assert ends.short(records) == short
    midstream = [p for p in short if not last[p]]
    allowed = not short or (pad and not midstream)
    assert (message is None) == allowed, message
    if message is not None:
        assert message.startswith(f"meshkit.global_batches: at step {step}, ")
        if midstream:
            # Every process with its rows; no padding offered, which would hide the bug.
            held = {p: n for p, n in enumerate(rows)}
            for n in set(rows):
                ps = [p for p, m in held.items() if m == n]
                assert ends._rows_text(ps, held) in message, message
            loaders = f"the loaders of {ends._processes(midstream)} have"
            if len(midstream) == 1:
                loaders = f"the loader of {ends._processes(midstream)} has"
            assert f"{loaders} more batches after it" in message, message
            assert "ragged" not in message, message
            assert "pad=True" not in message.split("\nConsider", 1)[1], message
        else:  # pad=False, the short batches are the last ones
            # The short processes, all of them and only them, are named before "where".
            named = message.split(" where ", 1)[0]
            assert ends._processes(short) in named, message
            assert "last batch" in message
            assert "Consider pad=True" in message


def test_processes_that_ended_are_not_short():
    records = {0: _record(8, False), 1: _record(0, True, status="end"), 2: _record(8, False)}
    assert _message(records, 5, pad=True) is None


def test_a_process_that_could_not_read_ahead_is_not_named():
    # Its loader failed when read ahead: that failure is raised at the next step instead.
    records = {0: _record(8, None), 1: _record(4, None)}
    assert _message(records, 2, pad=True) is None
    message = _message(records, 2, pad=False)
    assert message is not None
    assert "its loader's last batch" not in message, message
    assert "the loader's last batch" not in message, message
    assert "more batches" not in message, message
    assert "With pad=False every step needs batches of one size" in message


def test_records_without_rows_name_no_short_process():
    # pad="ragged" sends no rows: nothing is short.
    records = {0: _record(None, None), 1: _record(None, None)}
    assert ends.short(records) == []
    assert _message(records, 1, pad=True) is None


def test_several_short_processes_are_each_named_with_their_rows():
    records = {0: _record(8, False), 1: _record(4, False), 2: _record(6, True)}
    message = _message(records, 3, pad=True)
    assert message is not None
    assert message.startswith(
        "meshkit.global_batches: at step 3, the processes' batches differ in rows before the "
        "end of their data: process 0's batch has 8 rows; process 1's batch has 4 rows; "
        "process 2's batch has 6 rows; the loader of process 1 has more batches after it."
    ), message
    assert "the batches alone do not tell which process's loader is wrong" in message, message


@pytest.mark.parametrize("pad", ["yes", 1, None, "Ragged"])
def test_pad_must_be_true_false_or_ragged(pad):
    mesh = meshkit.make_mesh({"data": -1})
    with pytest.raises(meshkit.MeshkitError) as e:
        meshkit.global_batches([np.ones((8, 2), np.float32)], mesh, "data", pad=pad)
    assert str(e.value) == (
        "meshkit.global_batches: pad must be True (pad where each loader's data ends), 'ragged' "
        f"(pad short batches at every step) or False; got {pad!r}."
    )


def test_ragged_pads_like_true_in_one_process():
    mesh = meshkit.make_mesh({"data": -1})
    loader = [np.ones((8, 2), np.float32), np.ones((5, 2), np.float32)]
    got = [
        (b.shape, int(m.sum()))
        for b, m in meshkit.global_batches(iter(loader), mesh, "data", pad="ragged")
    ]
    want = [
        (b.shape, int(m.sum()))
        for b, m in meshkit.global_batches(iter(loader), mesh, "data", pad=True)
    ]
    assert got == want == [((8, 2), 8), ((8, 2), 5)]
