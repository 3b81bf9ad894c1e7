"""The implementation of `meshkit.loaders`: which rows each process loads, per loader."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import MeshkitError
from ..core.frames import public
from ..sharding.layout import ProcessSlice


@dataclass(frozen=True)
class _Rows:
    """This process's positions in a global order of ``num_rows`` rows."""

    num_rows: int
    global_batch: int
    ranges: tuple[tuple[int, int], ...]  # this process's rows of one full global batch
    offsets: tuple[int, ...]  # the same, one by one, in order
    tail_start: int  # its rows of the last, short global batch
    tail_size: int

    @property
    def full_batches(self) -> int:
        return self.num_rows // self.global_batch

    def __len__(self) -> int:
        return self.full_batches * len(self.offsets) + self.tail_size

    def position(self, j: int) -> int:
        """The position in the global order of this process's ``j``-th row (0 <= j < len)."""
        k, o = divmod(j, len(self.offsets))
        if k < self.full_batches:
            return k * self.global_batch + self.offsets[o]
        return self.full_batches * self.global_batch + self.tail_start + o

    def batch(self, t: int) -> np.ndarray:
        """The positions of this process's rows of global batch ``t`` of an epoch."""
        if t < self.full_batches:
            return t * self.global_batch + np.asarray(self.offsets, np.int64)
        start = self.full_batches * self.global_batch + self.tail_start
        return np.arange(start, start + self.tail_size, dtype=np.int64)

    def positions(self) -> np.ndarray:
        starts = np.arange(self.full_batches, dtype=np.int64)[:, None] * self.global_batch
        body = (starts + np.asarray(self.offsets, np.int64)[None, :]).reshape(-1)
        return np.concatenate([body, self.batch(self.full_batches)])


def _whole(value: Any, name: str, least: int, what: str) -> int:
    """``value`` as an int >= ``least``; a `MeshkitError` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise MeshkitError(f"{what}: {name} must be an int >= {least}; got {value!r}.")
    return int(value)


def _seed(seed: Any, what: str) -> int | None:
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32
    ):
        raise MeshkitError(
            f"{what}: seed must be None (no shuffle) or an int in [0, 2**32), the same on every "
            f"process; got {seed!r}."
        )
    return None if seed is None else int(seed)


def _map_dataset(dataset: Any, what: str, fix: str) -> Any:
    """The grain module, once ``dataset`` is checked to be a ``grain.MapDataset``."""
    import grain

    if not isinstance(dataset, grain.MapDataset):
        raise MeshkitError(
            f"{what}: expected a grain.MapDataset (random access); got "
            f"{type(dataset).__name__}.\nConsider {fix}"
        )
    return grain


def _rows(part: Any, num_rows: Any, what: str) -> _Rows:
    if not isinstance(part, ProcessSlice):
        raise MeshkitError(
            f"{what}: part must be a meshkit.ProcessSlice; got {type(part).__name__}.\n"
            "Consider part = meshkit.process_slice(mesh, spec, (global_batch,)), the layout of "
            "one global batch."
        )
    rows = _whole(num_rows, "the number of rows", 0, what)
    if not part.global_shape or part.global_shape[0] == 0:
        raise MeshkitError(
            f"{what}: part describes a global array of shape {part.global_shape}, which has no "
            "rows to split.\nConsider part = meshkit.process_slice(mesh, spec, "
            "(global_batch,)) with a global batch of at least one row."
        )
    global_batch = part.global_shape[0]
    offsets = tuple(i for a, b in part.ranges[0] for i in range(a, b))
    # The last, short global batch: split between the shards as evenly as possible.
    short, shards = rows % global_batch, part.shard_count
    each, extra = divmod(short, shards)
    i = part.shard_index
    return _Rows(
        rows, global_batch, part.ranges[0], offsets, i * each + min(i, extra), each + (i < extra)
    )


@public
def process_rows(part: ProcessSlice, num_rows: int) -> np.ndarray:
    """The rows of one epoch this process loads, in the order it loads them.

    Each ``part.local_shape[0]`` consecutive indices are this process's rows of one global batch
    (fewer for the last); indices are positions in the dataset's global order.

    Args:
        part: ``meshkit.process_slice(mesh, spec, (global_batch, ...))`` for this process.
        num_rows: the number of rows in the dataset (one epoch).

    Returns:
        An int64 numpy array of row indices, each in ``range(num_rows)``.

    Raises:
        MeshkitError: an invalid ``part`` or ``num_rows``.

    Examples:
        >>> import meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> meshkit.loaders.process_rows(part, 10)  # one process: every row, in order
        array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """
    return _rows(part, num_rows, "meshkit.loaders.process_rows").positions()


@public
def grain_dataset(dataset: Any, part: ProcessSlice) -> Any:
    """This process's part of a ``grain.MapDataset`` in global order, read lazily.

    Batch it by ``part.local_shape[0]``: each batch is this process's part of one global batch.

    Args:
        dataset: a ``grain.MapDataset`` of finite length, the same on every process.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.

    Returns:
        A ``grain.MapDataset`` of ``len(process_rows(part, len(dataset)))`` elements.

    Raises:
        MeshkitError: ``dataset`` is not a ``grain.MapDataset``, or an invalid ``part``.

    Examples:
        >>> import grain, meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> ds = meshkit.loaders.grain_dataset(grain.MapDataset.range(20), part)
        >>> [len(b) for b in ds.batch(part.local_shape[0])]
        [8, 8, 4]
    """
    what = "meshkit.loaders.grain_dataset"
    _map_dataset(
        dataset, what, "taking the part of the MapDataset before .to_iter_dataset(), or, for a "
        "pipeline without random access, grain's own sharding with "
        "meshkit.loaders.grain_shard_options(part).",
    )  # fmt: skip
    return _grain_part_class()(dataset, _rows(part, len(dataset), what))


@functools.cache
def _grain_part_class() -> type:
    """The ``grain.MapDataset`` subclass of `grain_dataset`, made once grain is imported."""
    import grain

    class ProcessPartMapDataset(grain.MapDataset):
        """A process's part of its parent, in load order (`meshkit.loaders.grain_dataset`)."""

        def __init__(self, parent: Any, rows: _Rows) -> None:
            super().__init__(parent)
            self._rows = rows

        def __len__(self) -> int:
            return len(self._rows)

        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, slice):
                return self.slice(index)
            if len(self._rows) == 0:
                raise IndexError(f"{self} is empty; got index {index}.")
            epoch, j = divmod(index, len(self._rows))
            return self._parent[epoch * self._rows.num_rows + self._rows.position(j)]

        def __str__(self) -> str:
            return f"ProcessPartMapDataset(rows={len(self._rows)} of {self._rows.num_rows})"

    return ProcessPartMapDataset


@public
def grain_sampler(
    num_records: int,
    part: ProcessSlice,
    *,
    shuffle: bool = False,
    seed: int | None = None,
    epoch: int = 0,
) -> Any:
    """A sampler for ``grain.DataLoader``: this process's records of one epoch.

    Use it with ``shard_options=grain.sharding.NoSharding()`` and a
    ``grain.transforms.Batch(part.local_shape[0])``: each batch is then this process's part of one
    global batch (with ``worker_count=0``; see docs/data-pipelines.md).

    Args:
        num_records: the number of records of the data source.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.
        shuffle: shuffle as grain's ``MapDataset.range(num_records).shuffle(seed)`` at ``epoch``.
        seed: the shuffle's seed (an int in [0, 2**32)); also seeds each record's ``rng``.
        epoch: which epoch's permutation to use.

    Returns:
        A sampler whose items are ``grain.RecordMetadata``.

    Raises:
        MeshkitError: ``shuffle`` without a seed, or an invalid argument.

    Examples:
        >>> import grain, meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> sampler = meshkit.loaders.grain_sampler(20, part, shuffle=True, seed=0)
        >>> len(sampler)
        20
    """
    what = "meshkit.loaders.grain_sampler"
    rows = _rows(part, num_records, what)
    if not isinstance(shuffle, bool):
        raise MeshkitError(f"{what}: shuffle must be True or False; got {shuffle!r}.")
    seed = _seed(seed, what)
    if shuffle and seed is None:
        raise MeshkitError(
            f"{what}: shuffle=True needs a seed, the same on every process.\n"
            "Consider seed=0 (any int in [0, 2**32))."
        )
    return _GrainSampler(rows, shuffle, seed, _whole(epoch, "epoch", 0, what))


class _GrainSampler:
    """`grain_sampler`'s sampler (grain's ``Sampler`` protocol); picklable for grain workers."""

    def __init__(self, rows: _Rows, shuffle: bool, seed: int | None, epoch: int) -> None:
        self._rows, self._shuffle, self._seed, self._epoch = rows, shuffle, seed, epoch
        self._order: Any = None

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        # grain compares it with a checkpoint's to validate a restored iterator.
        r = self._rows
        return (
            f"meshkit.loaders.grain_sampler(num_records={r.num_rows}, "
            f"global_batch={r.global_batch}, ranges={list(r.ranges)}, "
            f"last_batch={r.tail_start}+{r.tail_size}, shuffle={self._shuffle}, "
            f"seed={self._seed}, epoch={self._epoch})"
        )

    def __getitem__(self, index: int) -> Any:
        import grain

        if not 0 <= index < len(self._rows):
            raise IndexError(f"{self!r}: index {index} is out of range(0, {len(self._rows)}).")
        position = self._epoch * self._rows.num_rows + self._rows.position(index)
        key = position % self._rows.num_rows
        if self._shuffle:
            if self._order is None:
                self._order = grain.MapDataset.range(self._rows.num_rows).shuffle(self._seed)
            key = int(self._order[position])
        rng = None
        if self._seed is not None:
            rng = np.random.Generator(np.random.Philox(key=self._seed + position))
        return grain.RecordMetadata(index=index, record_key=key, rng=rng)


@public
def grain_shard_options(part: ProcessSlice, *, drop_remainder: bool = False) -> Any:
    """The grain ``ShardOptions`` of this process: its ``shard_index`` and ``shard_count``.

    For pipelines that keep grain's own sharding; a replica group shares a shard (unlike
    ``ShardByJaxProcess``), but see docs/data-pipelines.md for what grain then does.

    Args:
        part: ``meshkit.process_slice(...)`` for this process.
        drop_remainder: grain's: give every shard the same number of records.

    Returns:
        A ``grain.sharding.ShardOptions``.

    Raises:
        MeshkitError: ``part`` is not a `meshkit.ProcessSlice`.

    Examples:
        >>> import meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> meshkit.loaders.grain_shard_options(part)
        ShardOptions(shard_index=0, shard_count=1, drop_remainder=False)
    """
    _rows(part, 0, "meshkit.loaders.grain_shard_options")
    import grain

    return grain.sharding.ShardOptions(
        shard_index=part.shard_index, shard_count=part.shard_count, drop_remainder=drop_remainder
    )


@public
def hf_dataset(dataset: Any, part: ProcessSlice) -> Any:
    """This process's part of a Hugging Face ``datasets`` dataset in global order.

    A ``datasets.Dataset`` gives ``dataset.select(process_rows(...))``; a streaming
    ``IterableDataset`` is split by ``split_dataset_by_node`` (processes may then end with
    different numbers of batches: use ``pad=True``).

    Args:
        dataset: a ``datasets.Dataset`` or ``IterableDataset``, the same on every process.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.

    Returns:
        A dataset of the same kind (``.with_format("numpy")`` for numpy batches).

    Raises:
        MeshkitError: ``dataset`` is neither (of a ``DatasetDict``, pass one split), or an
            invalid ``part``.

    Examples:
        >>> import datasets, meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> ds = datasets.Dataset.from_dict({"id": list(range(20))})
        >>> len(meshkit.loaders.hf_dataset(ds, part))
        20
    """
    what = "meshkit.loaders.hf_dataset"
    import datasets
    from datasets.distributed import split_dataset_by_node

    if isinstance(dataset, datasets.Dataset):
        return dataset.select(_rows(part, len(dataset), what).positions())
    if isinstance(dataset, datasets.IterableDataset):
        _rows(part, 0, what)
        return split_dataset_by_node(dataset, rank=part.shard_index, world_size=part.shard_count)
    fix = (
        "datasets.Dataset.from_dict(...) or load_dataset(...)[split]; for other loaders, "
        "meshkit.loaders.process_rows(part, num_rows)"
    )
    raise _not_hf(dataset, what, "a datasets.Dataset or datasets.IterableDataset", fix)


def _not_hf(dataset: Any, what: str, expected: str, fix: str) -> MeshkitError:
    """The error for a ``dataset`` of the wrong kind; a dict of splits is told to pick one."""
    import datasets

    given = type(dataset).__name__
    if isinstance(dataset, datasets.DatasetDict | datasets.IterableDatasetDict):
        splits = sorted(dataset)
        given += f", which holds the splits {splits}"
        fix = f"one split, such as dataset[{(splits or ['train'])[0]!r}]"
    return MeshkitError(f"{what}: expected {expected}; got {given}.\nConsider {fix}.")
