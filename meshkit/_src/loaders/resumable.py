"""`grain_batches` and `hf_batches`: loaders whose global position resumes on any process count."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ..core.data_position import GlobalIterator, GlobalSource, LoaderIdentity
from ..core.errors import MeshkitError
from ..core.frames import public
from ..sharding.layout import ProcessSlice
from .rows import _map_dataset, _not_hf, _Rows, _rows, _seed, _whole

# The shuffled order: a keyed Feistel network over the smallest 4**k >= n, walked until it lands
# in range(n): no table of n entries, vectorized, and the same on every machine and numpy version
# (64-bit integer arithmetic), which a saved position needs.
_ROUNDS = 6
_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (xor-shift-multiply): every input bit reaches every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    """One key per round, from the seed and the epoch."""
    base = np.array([seed & _MASK, (epoch * 0x9E3779B97F4A7C15 + 1) & _MASK], np.uint64)
    keys = []
    for r in range(_ROUNDS):
        mixed = _mix(base + np.uint64(r * 0x632BE59BD9B4E019 & _MASK))
        keys.append(mixed[0] ^ _mix(mixed[1:])[0])
    return keys


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The rows read at ``positions`` of epoch ``epoch``: a bijection of ``range(n)``, as int64."""
    positions = np.asarray(positions, np.int64)
    if n <= 1 or positions.size == 0:
        return positions.copy()
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n
    keys = _round_keys(seed, epoch)
    with np.errstate(over="ignore"):  # the products wrap modulo 2**64, as they must
        out = _feistel(positions.astype(np.uint64), half, keys)
        outside = out >= np.uint64(n)
        while outside.any():
            out[outside] = _feistel(out[outside], half, keys)
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


class Batches(GlobalSource):
    """A meshkit loader: this process's part of each global batch, in a global order.

    Made by `grain_batches` or `hf_batches`, for `meshkit.global_batches`. ``len()`` is the number
    of global batches over all epochs.

    Attributes:
        identity: the loader's `LoaderIdentity`, which a resumed position must match.
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
        positions = self._rows.batch(step % self._steps)
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
        """The dataset indices of global batch ``step``: ``epoch * n + key``, as grain's repeat."""
        return (step // self._steps) * self._identity.num_rows + super()._keys(step)

    def _read(self, step: int) -> Any:
        elements = [self._dataset[int(k)] for k in self._keys(step)]
        if any(e is None for e in elements):
            raise MeshkitError(
                f"{self!r}: an element of the dataset is None (grain's filter leaves None in a "
                f"MapDataset), at global step {step}.\nConsider filtering before, into a "
                "dataset of its own (a list, an ArrayRecord file), so that every index has a row."
            )
        # No rows: an empty batch shaped like the dataset's elements.
        rows = elements or [self._dataset[0]]
        batch = jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows)
        return batch if elements else jax.tree_util.tree_map(lambda x: x[:0], batch)

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

    The global order is the dataset's, shuffled each epoch with ``seed``; pass the loader to
    `meshkit.global_batches`, whose position resumes on any number of processes.

    Args:
        dataset: a ``grain.MapDataset`` of finite length, the same on every process.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.
        seed: shuffle every epoch with this seed (an int in [0, 2**32)); None: no shuffle.
        epochs: passes over the dataset.
        drop_remainder: leave out each epoch's last global batch when it is short.
        read_options: a ``grain.ReadOptions``; default 2 threads, 4 batches ahead.

    Returns:
        A `meshkit.loaders.Batches` of ``epochs * ceil(len(dataset) / global_batch)`` batches
        (``floor`` with ``drop_remainder``).

    Raises:
        MeshkitError: ``dataset`` is not a ``grain.MapDataset``, or an invalid argument.

    Examples:
        >>> import grain, meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> [len(b) for b in meshkit.loaders.grain_batches(grain.MapDataset.range(20), part)]
        [8, 8, 4]
    """
    what = "meshkit.loaders.grain_batches"
    grain = _map_dataset(
        dataset, what, "grain.MapDataset.source(...) with the maps before .to_iter_dataset(); for "
        "a pipeline without random access, its iterator in meshkit.global_batches saves grain's "
        "own state (resumable on as many processes).",
    )  # fmt: skip
    identity, rows = _identity("grain", part, len(dataset), seed, epochs, drop_remainder, what)
    if read_options is None:
        # grain's default reads 500 elements ahead with 16 threads; an element here is a whole
        # batch, and `meshkit.global_batches` reads ahead of the caller too.
        read_options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
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
    """As `grain_batches`, for a map-style Hugging Face ``datasets.Dataset``.

    Each batch is one ``dataset[indices]`` (numpy columns when the dataset has no format).

    Args:
        dataset: a ``datasets.Dataset``, the same on every process.
        part: ``meshkit.process_slice(mesh, spec, (global_batch,))`` for this process.
        seed: shuffle every epoch with this seed (an int in [0, 2**32)); None: no shuffle.
        epochs: passes over the dataset.
        drop_remainder: leave out each epoch's last global batch when it is short.

    Returns:
        A `meshkit.loaders.Batches`.

    Raises:
        MeshkitError: ``dataset`` is not a ``datasets.Dataset`` (for a stream, see `hf_dataset`),
            or an invalid argument.

    Examples:
        >>> import datasets, meshkit
        >>> part = meshkit.process_slice(meshkit.make_mesh({"data": -1}), "data", (8,))
        >>> ds = datasets.Dataset.from_dict({"id": list(range(20))})
        >>> [b["id"].tolist() for b in meshkit.loaders.hf_batches(ds, part)][-1]
        [16, 17, 18, 19]
    """
    what = "meshkit.loaders.hf_batches"
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        fix = (
            "meshkit.loaders.hf_dataset(dataset, part) for a stream (its position is not saved), "
            "or a map-style datasets.Dataset (load_dataset without streaming=True)"
            if isinstance(dataset, datasets.IterableDataset)
            else "datasets.Dataset.from_dict(...) or load_dataset(...)[split]"
        )
        raise _not_hf(dataset, what, "a map-style datasets.Dataset", fix)
    identity, rows = _identity("datasets", part, len(dataset), seed, epochs, drop_remainder, what)
    if dataset.format["type"] is None:
        dataset = dataset.with_format("numpy")
    return _HfBatches(dataset, identity, rows)
