"""Which dataset rows each process loads, for grain, Hugging Face `datasets` and any loader.

Given ``part = meshkit.process_slice(mesh, spec, (global_batch,))``, `process_rows` gives this
process's rows of a dataset in a global order (the same on every process); `grain_dataset`,
`grain_sampler` and `hf_dataset` apply it, and `grain_batches` and `hf_batches` are loaders
whose position resumes on any number of processes. grain and datasets are imported only when
called. See docs/data-pipelines.md.
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
    "Batches", "grain_batches", "grain_dataset", "grain_sampler", "grain_shard_options",
    "hf_batches", "hf_dataset", "process_rows",
]  # fmt: skip
