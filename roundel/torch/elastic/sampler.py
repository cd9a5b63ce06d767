"""``ElasticSampler``: a distributed sampler that survives changes in the number of ranks."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

from roundel.common.basics import is_initialized, rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler):
    """Shards a dataset across the current ranks and remembers what the job has processed this epoch.

    After a reset (new number of ranks) only the samples not yet recorded as
    processed are re-partitioned. ``record_batch(i, batch_size)`` marks batch
    ``i`` (counted since the last reset) of *every* rank as processed, which
    each rank can work out alone, so a commit on any rank covers the whole
    job's progress. ``set_epoch(e)`` starts epoch ``e`` afresh; calling it
    again with the current epoch (as a loop resumed after a reset does)
    keeps the epoch's progress. Like ``DistributedSampler``, ranks' shards
    are padded to equal length by repeating samples. Made after
    ``hvd.init()``; while the job re-forms (no runtime) it keeps its last
    partition until the next ``reset()``.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order; a different epoch than the current one forgets the processed samples."""
        if epoch != self.epoch:
            self.processed_indices = set()
        self.epoch = epoch
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` of size ``batch_size`` of every rank as processed."""
        start, end = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for r in range(self.num_replicas):
            self.processed_indices.update(self._shard(r)[start:end])

    def record_indices(self, indices) -> None:
        """Mark dataset ``indices`` as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-partition the samples not yet processed among the current ranks (the last known ranks while
        the job re-forms: a rollback after a failed reset comes before the runtime is up)."""
        if is_initialized() or not hasattr(self, "num_replicas"):
            self.num_replicas, self.rank = size(), rank()
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        padding = self.num_samples * self.num_replicas - len(remaining)
        self._indices = remaining + (remaining * math.ceil(padding / max(len(remaining), 1)))[:padding]

    def _shard(self, r: int) -> list[int]:
        return self._indices[r::self.num_replicas]

    def __iter__(self):
        return iter(self._shard(self.rank))

    def __len__(self) -> int:
        return self.num_samples
