"""Which dataset rows each process loads, for grain, Hugging Face `datasets` and any loader.

A `meshkit.ProcessSlice` of one global batch (``process_slice(mesh, spec, (global_batch,))``)
says which rows of every global batch this process provides. The functions here turn it into
what a loader needs, for a dataset of ``num_rows`` rows in a *global order* (the same on every
process: a dataset, or one shuffled with the same seed everywhere):

- global batch ``k`` is rows ``k * global_batch`` to ``(k + 1) * global_batch`` of that order,
  and this process loads, for each of them, the rows of its ranges; batching what it loads by
  ``part.local_shape[0]`` gives its part of each global batch;
- the last global batch of an epoch, when ``num_rows`` is not a multiple of the global batch,
  is split between the shards as evenly as possible, in shard order (a shard may get none).

So every row is loaded once per epoch (by every process of a replica group: processes with the
same ``shard_index`` load the same rows), and the global batches `meshkit.global_batches`
assembles (``pad=True`` for the last one) are the same whatever the number of processes: the
rows of one process running the same loader, in the same order (for the padded last batch, the
same rows; in the same order too where each process's rows are one range, as on meshes from
`meshkit.make_mesh`).

`grain_batches` (``grain.MapDataset``) and `hf_batches` (``datasets.Dataset``) are loaders of
their own on that plan, with shuffling per epoch: their position is global (an epoch and a
global step in it), so `meshkit.global_batches` records it with every step and resumes it on
any number of processes (``start=``; saved in a checkpoint with ``save(..., data=...)``).

`process_rows` is the plan itself (numpy indices, for any loader); `grain_dataset`
(``grain.MapDataset``), `grain_sampler` (``grain.DataLoader``) and `hf_dataset` (Hugging Face
``datasets.Dataset``) apply it. `grain_shard_options` and `hf_dataset` on a streaming
``datasets.IterableDataset`` keep those libraries' own sharding instead (see each function).
grain and datasets are imported only when these functions are called (``meshkit[grain]``,
``meshkit[datasets]``).
"""

from ._src.loaders.resumable import Batches as Batches
from ._src.loaders.resumable import grain_batches as grain_batches
from ._src.loaders.resumable import hf_batches as hf_batches
from ._src.loaders.rows import grain_dataset as grain_dataset
from ._src.loaders.rows import grain_sampler as grain_sampler
from ._src.loaders.rows import grain_shard_options as grain_shard_options
from ._src.loaders.rows import hf_dataset as hf_dataset
from ._src.loaders.rows import process_rows as process_rows

__all__ = [
    "Batches",
    "grain_batches",
    "grain_dataset",
    "grain_sampler",
    "grain_shard_options",
    "hf_batches",
    "hf_dataset",
    "process_rows",
]
