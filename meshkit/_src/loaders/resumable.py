"""`grain_batches` and `hf_batches`: this process's part of each global batch, resumable anywhere.

A loader's position is global (an epoch and a global step in it), the same on every process
whatever their number, so ``global_batches(..., start=position)`` resumes it on any number of
processes at the global batch an uninterrupted run would have read next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ..core.data_position import GlobalIterator, GlobalSource, LoaderIdentity
from ..core.errors import MeshkitError
from ..core.tracebacks import public
from ..sharding.layout import ProcessSlice
from .order import permute
from .rows import _Rows, _rows, _seed, _whole

__all__ = ["Batches", "grain_batches", "hf_batches"]

# grain's default ReadOptions read 500 elements ahead with 16 threads; an element here is a
# whole batch, and `meshkit.global_batches` reads ahead of the caller too.
_READ_THREADS = 2
_READ_AHEAD = 4


class Batches(GlobalSource):
    """A meshkit loader: this process's part of each global batch, in a global order.

    Made by `grain_batches` or `hf_batches`; pass it to `meshkit.global_batches`. Iterating it
    gives numpy pytrees, each this process's rows of one global batch (``part.local_shape[0]``
    rows; the last global batch of an epoch is short, and a process's part of it may have no
    rows). ``len()`` is the number of global batches over all epochs.

    Attributes:
        identity: the loader's `LoaderIdentity` (kind, dataset length, global batch, seed,
            epochs), which a `meshkit.DataPosition` must match to resume it.
    """

    def __init__(self, identity: LoaderIdentity, rows: _Rows) -> None:
        self._identity = identity
        self._rows = rows
        self._steps = identity.steps_per_epoch

    @property
    def identity(self) -> LoaderIdentity:
        return self._identity

    def __repr__(self) -> str:
        return f"meshkit.loaders.{self._identity.describe()}"

    def _positions(self, step: int) -> np.ndarray:
        """This process's rows of global batch ``step`` (over all epochs), in its epoch's order."""
        rows = self._rows
        t = step % self._steps
        if t < rows.full_batches:
            return t * rows.global_batch + np.asarray(rows.offsets, np.int64)
        start = rows.full_batches * rows.global_batch + rows.tail_start
        return np.arange(start, start + rows.tail_size, dtype=np.int64)

    def iterate(self, step: int) -> GlobalIterator:
        """This process's part of each global batch from global step ``step`` (all epochs) on."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= len(self):
            raise MeshkitError(
                f"{self!r}.iterate: step must be an int in [0, {len(self)}]; got {step!r}."
            )
        return GlobalIterator(self._read_from(step), step, self)

    def _keys(self, step: int) -> np.ndarray:
        """The rows of this process's part of global batch ``step``, in the dataset."""
        n, seed = self._identity.num_rows, self._identity.seed
        positions = self._positions(step)
        return positions if seed is None else permute(positions, n, seed, step // self._steps)

    def _read_from(self, step: int) -> Iterator[Any]:
        return (self._read(s) for s in range(step, len(self)))

    def _read(self, step: int) -> Any:
        raise NotImplementedError


def _identity(
    kind: str, part: Any, num_rows: int, seed: Any, epochs: Any, drop: Any, what: str
) -> tuple[LoaderIdentity, _Rows]:
    """The loader's identity and this process's rows, its arguments checked."""
    rows = _rows(part, num_rows, what)
    seed, epochs = _seed(seed, what), _whole(epochs, "epochs", 1, what)
    if not isinstance(drop, bool):
        raise MeshkitError(f"{what}: drop_remainder must be True or False; got {drop!r}.")
    return LoaderIdentity(kind, rows.num_rows, rows.global_batch, seed, epochs, drop), rows


class _GrainBatches(Batches):
    def __init__(
        self, dataset: Any, identity: LoaderIdentity, rows: _Rows, read_options: Any
    ) -> None:
        super().__init__(identity, rows)
        self._dataset = dataset
        self._read_options = read_options

    def _keys(self, step: int) -> np.ndarray:
        """The dataset indices of this process's rows of global batch ``step``.

        The dataset is read at ``e * n + key`` in epoch ``e``, so that a shuffled or randomly
        mapped ``MapDataset`` sees the epoch, as with grain's own ``repeat``.
        """
        return (step // self._steps) * self._identity.num_rows + super()._keys(step)

    def _read(self, step: int) -> Any:
        elements = [self._dataset[int(k)] for k in self._keys(step)]
        if any(e is None for e in elements):
            raise MeshkitError(
                f"{self!r}: an element of the dataset is None (grain's filter leaves None in a "
                f"MapDataset), at global step {step}.\nConsider filtering before, into a "
                "dataset of its own (a list, an ArrayRecord file), so that every index has a row."
            )
        if not elements:  # no rows: an empty batch shaped like the dataset's elements
            return jax.tree_util.tree_map(
                lambda x: np.zeros((0, *np.shape(x)), np.asarray(x).dtype), self._dataset[0]
            )
        return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *elements)

    def _read_from(self, step: int) -> Iterator[Any]:
        import grain

        steps = grain.MapDataset.range(step, len(self)).map(self._read)
        return iter(steps.to_iter_dataset(self._read_options))


@public
def grain_batches(
    dataset: Any,
    part: ProcessSlice,
    *,
    seed: int | None = None,
    epochs: int = 1,
    drop_remainder: bool = False,
    read_options: Any = None,
) -> Batches:
    """This process's part of each global batch of a ``grain.MapDataset``, resumable anywhere.

    The global order is the dataset's, shuffled at each epoch with ``seed`` (a permutation of
    meshkit's own, computed per row from the seed and the epoch: no table of the rows, and the
    same on every process and in every run); global batch ``k`` of an epoch
    is rows ``k * global_batch`` to ``(k + 1) * global_batch`` of it, and each batch this
    loader yields is this process's part of one (`process_rows`). Pass it to
    `meshkit.global_batches`: the global batches are the same whatever the number of processes,
    and `meshkit.GlobalBatches.position` records where the run stands, which
    ``global_batches(..., start=position)`` resumes on any number of processes.

    Each epoch's last global batch is short when the dataset's length is not a multiple of the
    global batch (``pad=True`` pads it for one epoch, ``pad="ragged"`` for several), unless
    ``drop_remainder``. Batches are read by grain's threads (``read_options``), in order.

    Args:
        dataset: a ``grain.MapDataset`` of finite length, built the same way on every process
            (maps, random maps); read at index ``epoch * len(dataset) + key``.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.
        seed: shuffle every epoch with this seed (an int in [0, 2**32)); None: no shuffle.
        epochs: passes over the dataset.
        drop_remainder: leave out each epoch's last global batch when it is short.
        read_options: a ``grain.ReadOptions`` (threads reading batches, batches read ahead);
            default 2 threads, 4 batches ahead.

    Returns:
        A `meshkit.loaders.Batches` of ``epochs * ceil(len(dataset) / global_batch)`` global
        batches (``floor`` with ``drop_remainder``).

    Raises:
        MeshkitError: ``dataset`` is not a ``grain.MapDataset``; ``part`` is not a
            `meshkit.ProcessSlice` of an array with rows; ``seed``, ``epochs`` or
            ``drop_remainder`` is not valid.

    Examples:
        >>> import grain, meshkit
        >>> from meshkit import loaders
        >>> mesh = meshkit.make_mesh({"data": -1})
        >>> part = meshkit.process_slice(mesh, "data", (8,))
        >>> ds = grain.MapDataset.range(20)
        >>> [b.tolist() for b in loaders.grain_batches(ds, part)]
        [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18, 19]]
    """
    what = "meshkit.loaders.grain_batches"
    import grain

    if not isinstance(dataset, grain.MapDataset):
        raise MeshkitError(
            f"{what}: expected a grain.MapDataset (random access); got "
            f"{type(dataset).__name__}.\nConsider grain.MapDataset.source(...) with the maps "
            "before .to_iter_dataset(); for a pipeline without random access, its iterator in "
            "meshkit.global_batches saves grain's own state (resumable on as many processes)."
        )
    identity, rows = _identity("grain", part, len(dataset), seed, epochs, drop_remainder, what)
    if read_options is None:
        read_options = grain.ReadOptions(
            num_threads=_READ_THREADS, prefetch_buffer_size=_READ_AHEAD
        )
    elif not isinstance(read_options, grain.ReadOptions):
        raise MeshkitError(
            f"{what}: read_options must be a grain.ReadOptions; got {type(read_options).__name__}."
        )
    return _GrainBatches(dataset, identity, rows, read_options)


class _HfBatches(Batches):
    def __init__(self, dataset: Any, identity: LoaderIdentity, rows: _Rows) -> None:
        super().__init__(identity, rows)
        self._dataset = dataset

    def _read(self, step: int) -> Any:
        keys = self._keys(step)
        if len(keys):
            return self._dataset[keys.tolist()]
        return jax.tree_util.tree_map(lambda x: x[:0], self._dataset[[0]])


@public
def hf_batches(
    dataset: Any,
    part: ProcessSlice,
    *,
    seed: int | None = None,
    epochs: int = 1,
    drop_remainder: bool = False,
) -> Batches:
    """This process's part of each global batch of a Hugging Face ``datasets.Dataset``.

    As `grain_batches`, for a map-style ``datasets.Dataset``: the global order is the
    dataset's, shuffled at each epoch with ``seed`` (the same permutation as
    `grain_batches`'); each batch is this process's rows of
    one global batch, read with one ``dataset[indices]``, a dict of columns (numpy arrays when
    the dataset has no format of its own). The position `meshkit.global_batches` records
    resumes on any number of processes.

    Args:
        dataset: a ``datasets.Dataset``, the same on every process.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.
        seed: shuffle every epoch with this seed (an int in [0, 2**32)); None: no shuffle.
        epochs: passes over the dataset.
        drop_remainder: leave out each epoch's last global batch when it is short.

    Returns:
        A `meshkit.loaders.Batches`.

    Raises:
        MeshkitError: ``dataset`` is not a ``datasets.Dataset`` (a streaming
            ``IterableDataset`` has no random access: see `hf_dataset`; a ``DatasetDict``
            holds several splits); ``part``, ``seed``, ``epochs`` or ``drop_remainder`` is not
            valid.

    Examples:
        >>> import datasets, meshkit
        >>> from meshkit import loaders
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> ds = datasets.Dataset.from_dict({"id": list(range(20))})
        >>> [b["id"].tolist() for b in loaders.hf_batches(ds, part)][-1]
        [16, 17, 18, 19]
    """
    what = "meshkit.loaders.hf_batches"
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        given = type(dataset).__name__
        if isinstance(dataset, datasets.DatasetDict):
            fix = f"one split, such as dataset[{(sorted(dataset) or ['train'])[0]!r}]"
        elif isinstance(dataset, datasets.IterableDataset | datasets.IterableDatasetDict):
            fix = (
                "meshkit.loaders.hf_dataset(dataset, part) for a stream (its position is not "
                "saved), or a map-style datasets.Dataset (load_dataset without streaming=True)"
            )
        else:
            fix = "datasets.Dataset.from_dict(...) or load_dataset(...)[split]"
        raise MeshkitError(
            f"{what}: expected a map-style datasets.Dataset; got {given}.\nConsider {fix}."
        )
    identity, rows = _identity("datasets", part, len(dataset), seed, epochs, drop_remainder, what)
    if dataset.format["type"] is None:
        dataset = dataset.with_format("numpy")
    return _HfBatches(dataset, identity, rows)
