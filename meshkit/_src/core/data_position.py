"""The data position: where a stream of global batches stands, to resume it at the same batch.

In core because `arrays` (which takes positions) and `checkpoint` (which saves them) both use
it; `GlobalSource` is the meshkit loader interface `arrays` reads without importing `loaders`.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import MeshkitError, shorten

VERSION = 1  # of `DataPosition.to_json`'s format; a reader refuses newer ones
_WHAT = "meshkit.DataPosition.from_json"
_IDENTITY = ("kind", "num_rows", "global_batch", "seed", "drop_remainder")  # what must match


@dataclass(frozen=True)
class LoaderIdentity:
    """What makes a meshkit loader's global batches what they are (and its position valid)."""

    kind: str
    num_rows: int
    global_batch: int
    seed: int | None
    epochs: int
    drop_remainder: bool = False

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch."""
        full, short = divmod(self.num_rows, self.global_batch)
        return full + (1 if short and not self.drop_remainder else 0)

    def differences(self, other: LoaderIdentity) -> list[str]:
        """What differs from ``other`` among what must match: ``"seed 3 (here 4)"``, ..."""
        return [
            f"{name} {getattr(other, name)!r} (this loader: {getattr(self, name)!r})"
            for name in _IDENTITY
            if getattr(self, name) != getattr(other, name)
        ]

    def describe(self) -> str:
        """``grain_batches(num_rows=45, global_batch=16, seed=7, epochs=2)``."""
        name = "grain_batches" if self.kind == "grain" else "hf_batches"
        drop = ", drop_remainder=True" if self.drop_remainder else ""
        return (
            f"{name}(num_rows={self.num_rows}, global_batch={self.global_batch}, "
            f"seed={self.seed}, epochs={self.epochs}{drop})"
        )


@dataclass(frozen=True)
class DataPosition:
    """Where a `meshkit.global_batches` iterator stands: the batches its caller took.

    From `meshkit.GlobalBatches.position`, saved by ``meshkit.checkpoint.save(..., data=...)``,
    resumed by ``meshkit.global_batches(..., start=position)`` at the batch an uninterrupted run
    would take next.

    Attributes:
        step: global batches the caller took over the whole run.
        loader: the meshkit loader's identity; None for other sources.
        epoch: the loader's epoch of the next batch (None for other sources).
        epoch_step: the global batches of that epoch already taken (None for other sources).
        processes: the number of processes of the run the position comes from.
        states: a stateful source's ``get_state()`` (JSON text) by process id, else None.
        version: the format's version.

    Examples:
        >>> import meshkit
        >>> p = meshkit.DataPosition(step=3)
        >>> meshkit.DataPosition.from_json(p.to_json()) == p
        True
    """

    step: int
    loader: LoaderIdentity | None = None
    epoch: int | None = None
    epoch_step: int | None = None
    processes: int = 1
    states: Mapping[int, str] | None = None
    version: int = VERSION

    @property
    def kind(self) -> str:
        """``"loader"`` (a meshkit loader), ``"states"`` (per-process states) or ``"steps"``."""
        if self.loader is not None:
            return "loader"
        return "states" if self.states is not None else "steps"

    @property
    def loader_step(self) -> int | None:
        """Global batches taken from the meshkit loader since its start (None: no loader)."""
        if self.loader is None or self.epoch is None or self.epoch_step is None:
            return None
        return self.epoch * self.loader.steps_per_epoch + self.epoch_step

    def describe(self) -> str:
        """The position in words, without per-process states (equal on every process)."""
        text = f"step {self.step}"
        if self.loader is not None:
            where = f"epoch {self.epoch} at its step {self.epoch_step}"
            text += f" of {self.loader.describe()}, {where}"
        elif self.states is not None:
            text += f" with per-process states of {self.processes} processes"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The position as plain JSON values (`to_json` writes them)."""
        value = dataclasses.asdict(dataclasses.replace(self, states=None))
        if self.states is not None:  # any mapping, its keys as JSON's strings
            value["states"] = {str(p): s for p, s in sorted(self.states.items())}
        return value

    def to_json(self) -> str:
        """The position as JSON text (small: under 1 KiB per process for grain's states)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, value: Any) -> DataPosition:
        """The position `to_dict` gave; a `MeshkitError` if it is none (or of a newer format)."""
        return cls._read(value, "meshkit.DataPosition.from_dict")

    @classmethod
    def _read(cls, value: Any, what: str) -> DataPosition:
        """`from_dict`, its messages naming ``what`` (the call that read ``value``)."""
        if not isinstance(value, Mapping):
            raise MeshkitError(f"{what}: expected a JSON object; got {type(value).__name__}.")
        version = value.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise MeshkitError(f"{what}: no valid format version in {_short(value)}.")
        if version > VERSION:
            raise MeshkitError(
                f"{what}: the data position is of format version {version}; this meshkit "
                f"reads versions up to {VERSION}.\nConsider the meshkit version that saved it, "
                "or a newer one."
            )
        try:
            loader = value.get("loader")
            states = value.get("states")
            return cls(
                step=_int(value["step"]),
                loader=None if loader is None else _identity(loader),
                epoch=_int_or_none(value.get("epoch")),
                epoch_step=_int_or_none(value.get("epoch_step")),
                processes=_int(value.get("processes", 1)),
                states=None if states is None else {int(p): str(s) for p, s in states.items()},
                version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MeshkitError(f"{what}: not a data position ({e!r}): {_short(value)}.") from None

    @classmethod
    def from_json(cls, text: str) -> DataPosition:
        """The position `to_json` wrote; a `MeshkitError` if it is none (or of a newer format)."""
        try:
            value = json.loads(text)
        except (TypeError, ValueError) as e:
            raise MeshkitError(f"{_WHAT}: not JSON ({e}): {str(text)[:80]!r}.") from None
        return cls._read(value, _WHAT)


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"expected an int >= 0, got {x!r}")
    return x


def _int_or_none(x: Any) -> int | None:
    return None if x is None else _int(x)


def _identity(value: Any) -> LoaderIdentity:
    kind, rows, batch = str(value["kind"]), _int(value["num_rows"]), _int(value["global_batch"])
    seed, epochs = _int_or_none(value["seed"]), _int(value["epochs"])
    return LoaderIdentity(kind, rows, batch, seed, epochs, bool(value.get("drop_remainder", False)))


def _short(value: Any) -> str:
    return shorten(json.dumps(value, default=repr), 120)


def encode_state(state: Any) -> str:
    """A source's ``get_state()`` as JSON text: bytes (grain's ``DataLoader``) or JSON values."""
    if isinstance(state, bytes | bytearray):
        return json.dumps({"bytes": base64.b64encode(bytes(state)).decode("ascii")})
    try:
        return json.dumps({"json": state}, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        raise TypeError(
            f"a state of type {type(state).__name__} is neither bytes nor JSON values"
        ) from None


def decode_state(text: str) -> Any:
    """The state `encode_state` encoded."""
    value = json.loads(text)
    if "bytes" in value:
        return base64.b64decode(value["bytes"])
    return value["json"]


class GlobalIterator(Iterator[Any]):
    """A meshkit loader's iterator: its batches, and the global step of the next one."""

    def __init__(self, batches: Iterator[Any], step: int, source: GlobalSource) -> None:
        self._batches = batches
        self.step = step
        self.source = source

    def __next__(self) -> Any:
        batch = next(self._batches)
        self.step += 1
        return batch


class GlobalSource(abc.ABC):
    """A meshkit loader: its global batches in an order every process shares."""

    @property
    @abc.abstractmethod
    def identity(self) -> LoaderIdentity:
        """What a position of this loader must match."""

    @abc.abstractmethod
    def iterate(self, step: int) -> GlobalIterator:
        """This process's part of each global batch from global step ``step`` on."""

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(0)

    def __len__(self) -> int:
        """Global batches over all epochs."""
        identity = self.identity
        return identity.epochs * identity.steps_per_epoch
