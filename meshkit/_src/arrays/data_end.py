"""Where the processes' data ends, in `meshkit.global_batches`: its messages, decided from records.

Each step's records (`meshkit._src.arrays.records.PartRecord`) say, for every process, whether its
loader has ended and how many rows its batch has. Where the rows differ, the processes with
fewer (`short`) read their loaders one batch ahead and say, in a second exchange, whether theirs
is the last batch. From the same records every process decides the same thing at the same step:
loaders that end at different steps (`uneven_end`), or a batch short before the end of its data
(`short_batch`). The common step (every batch of one size) costs no second exchange, and no
loader is read ahead of its step.
"""

from __future__ import annotations

from ..coord import missing as _missing
from .records import PartRecord

__all__ = ["short", "short_batch", "uneven_end"]

_WHAT = "meshkit.global_batches"


def short(records: dict[int, PartRecord]) -> list[int]:
    """The processes whose batch at this step has fewer rows than another's (none: one size)."""
    rows = _leading_rows(records)
    if rows is None:
        return []
    most = max(rows.values())
    return sorted(p for p, n in rows.items() if n < most)


def short_batch(records: dict[int, PartRecord], step: int, *, pad: bool) -> str | None:
    """The error for a batch at ``step`` shorter than another process's, or None if allowed.

    Only a loader's last batch may be short: with ``pad=True`` it is padded, and with
    ``pad=False`` the message says it is the last one. Batches of different sizes before the
    end of the data are rows one loader lost (a filter, an uneven shard) or another added (its
    own padding): padding them would hide that, and with no majority the records cannot tell
    which, so the message says what each process passed and names no culprit. The records
    carry the second exchange's `PartRecord.last`; a process that could not tell (its loader failed
    when read ahead: the failure is raised at the next step) is not named.
    """
    rows = _leading_rows(records)
    if rows is None or len(set(rows.values())) == 1:
        return None
    most = max(rows.values())
    fewer = sorted(p for p, n in rows.items() if n < most)
    full = sorted(p for p, n in rows.items() if n == most)
    midstream = [p for p in fewer if records[p].last is False]
    if pad and not midstream:
        return None  # short last batches: padded
    if not midstream:  # pad=False, the short batches their loaders' last (or not known)
        head = f"{_WHAT}: at step {step}, {_rows_text(fewer, rows)} where {_rows_text(full, rows)}"
        said = (
            f"; {'each is its loader' if len(fewer) > 1 else 'it is the loader'}'s last batch"
            if all(records[p].last for p in fewer)
            else ""
        )
        return (
            f"{head}{said}.\nWith pad=False every step needs batches of one size from every "
            "process.\nConsider pad=True (the last step is padded; the mask marks the real "
            "rows), or dropping the short last batch on every process (drop_remainder)."
        )
    return _MIDSTREAM.format(
        what=_WHAT,
        step=step,
        each="; ".join(_rows_text(ps, rows) for ps in _missing.by_value(_as_text(rows)).values()),
        more=_loaders(midstream),
        which=_which(rows),
    )


# Batches of different sizes while a loader still has data: a loader lost rows or added some.
# Padding (pad=True, pad="ragged") would hide that, so it is not offered.
_MIDSTREAM = (
    "{what}: at step {step}, the processes' batches differ in rows before the end of their "
    "data: {each}; {more} more batches after it.\n"
    "Every process's loader must give batches of one size at every step but its last (a "
    "batch may be short only where its data ends: pad=True pads it there).\n"
    "A batch of another size before the end of the data comes from a loader that lost rows "
    "(a filter, an uneven shard, a skipped file) or added some (padding of its own, another "
    "batch size); {which}.\n"
    "Consider checking that the loaders make batches of one size on every process "
    "(meshkit.process_slice(mesh, axis, global_shape).local_shape[0] rows each) and pad none "
    "of their own."
)


def _as_text(rows: dict[int, int]) -> dict[int, str]:
    return {p: str(n) for p, n in rows.items()}


def _which(rows: dict[int, int]) -> str:
    """Who differs, where most processes agree on the rows; else that the records cannot tell."""
    odd = _outside_majority(rows)
    if len(odd) == len(rows):
        return "the batches alone do not tell which process's loader is wrong"
    return f"{_processes(odd)} differ{'s' if len(odd) == 1 else ''} from the others"


def _processes(ps: list[int]) -> str:
    return f"process{'es' if len(ps) > 1 else ''} {_and([str(p) for p in ps])}"


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _loaders(ps: list[int]) -> str:
    """``the loader of process 1 has`` / ``the loaders of processes 0 and 1 have``."""
    return (
        f"the loader of {_processes(ps)} has"
        if len(ps) == 1
        else f"the loaders of {_processes(ps)} have"
    )


def _rows_text(ps: list[int], rows: dict[int, int]) -> str:
    """``process 1's batch has 56 rows`` / ``processes 0 and 2 have 64 rows`` (rows by process)."""
    counts = [rows[p] for p in ps]
    if len(ps) == 1:
        return f"{_processes(ps)}'s batch has {counts[0]} rows"
    if len(set(counts)) == 1:
        return f"{_processes(ps)} have {counts[0]} rows"
    return f"the batches of {_processes(ps)} have {_and([str(n) for n in counts])} rows"


def rows_outliers(records: dict[int, PartRecord]) -> list[int]:
    """The processes whose batch rows differ from a majority's; every one without a majority."""
    rows = _leading_rows(records)
    return _outside_majority(rows) if rows else sorted(records)


def _outside_majority(rows: dict[int, int]) -> list[int]:
    return _missing.outside_majority(_missing.by_value(_as_text(rows)).values())


def _leading_rows(records: dict[int, PartRecord]) -> dict[int, int] | None:
    """Rows of each process that has data at this step (`PartRecord.rows`).

    None when fewer than two have data, or a record does not say its rows.
    """
    rows = {}
    for p, r in records.items():
        if r.status != "data":
            continue  # ended: padding only
        if r.rows is None:
            return None
        rows[p] = r.rows
    return rows if len(rows) > 1 else None


def uneven_end(ended: list[int], going: list[int], step: int, pad: bool) -> str:
    """The message for loaders that yielded different numbers of batches (see `_check_end`)."""
    had = f"after {step - 1} batch{'es' if step != 2 else ''}" if step > 1 else "without a batch"
    more = f"a {_missing.ordinal(step)}" if step > 1 else "one"
    ended_text = (
        f"the loaders of {_processes(ended)}" if len(ended) > 1 else f"{_processes(ended)}'s loader"
    )
    going_text = f"those of {_processes(going)}" if len(going) > 1 else f"{_processes(going)}'s"
    head = (
        f"{_WHAT}: the processes' loaders yielded different numbers of batches: {ended_text} "
        f"ended {had}, while {going_text} yielded {more}.\n"
    )
    if pad:
        return head + (
            "With pad=True a process whose loader has ended contributes padding, shaped like "
            "its earlier batches; a loader that yielded no batch has none to copy.\n"
            "Consider giving every process at least one row, or a loader that yields a batch "
            "of 0 rows (same keys and dtypes) when its shard is empty."
        )
    return head + (
        "With pad=False every step needs a batch from every process, and the batches the "
        "longer loaders still hold would be dropped unseen.\n"
        "Consider pad=True (the processes whose loaders ended contribute padding, which the "
        "mask marks, until every loader has ended), or loaders that yield the same number of "
        "batches (drop the last, short batch everywhere, or stop after a fixed number of steps "
        "with itertools.islice)."
    )
