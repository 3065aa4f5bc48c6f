"""Distributed data loading: DistributedSampler and create_dataloader (global batch semantics)."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Optional

import numpy as np

from .dataloader import DataLoader

__all__ = ["DistributedSampler", "create_dataloader"]


class DistributedSampler:
    """Give each data-parallel rank a disjoint, equally sized share of a dataset's indices.

    PyTorch's semantics: each epoch draws one permutation of ``range(len(dataset))`` from
    ``(seed, epoch)`` (the same on every rank), pads it by repeating its head (or, with
    ``drop_last``, trims its tail) to a multiple of ``num_replicas``, and rank ``r`` takes
    ``perm[r::num_replicas]``. So local batch ``j`` of every rank together is exactly
    ``perm[j*B*n:(j+1)*B*n]``: the global batch a single process would read.

    Call :meth:`set_epoch` before each epoch for a fresh order. For resuming mid-epoch,
    :meth:`state_dict` holds the epoch and how many local samples were consumed;
    :meth:`load_state_dict` restores them (also on a different number of replicas: the
    position is kept in global samples).

    Args:
        dataset: anything with ``__len__``.
        num_replicas, rank: the data-parallel size and this rank (default: from ``group``).
        shuffle: permute each epoch (else the natural order).
        seed: shuffle seed, identical on all ranks.
        drop_last: trim to a multiple of ``num_replicas`` instead of padding.
        group: the data-parallel process group (default: all ranks).
    """

    def __init__(self, dataset: Any, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, group=None):
        if num_replicas is None or rank is None:
            from ..distributed import resolve_group

            g = resolve_group(group)
            num_replicas = g.size if num_replicas is None else num_replicas
            rank = g.rank if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for num_replicas={num_replicas} (valid: 0..{num_replicas - 1})")
        self.dataset = dataset
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._start = 0  # local samples to skip at the start of the current epoch (resume)
        n = len(dataset)
        if self.drop_last:
            self.num_samples = n // self.num_replicas
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        if self.num_samples == 0:
            raise ValueError(
                f"rank {self.rank}: dataset of {n} samples gives no sample per rank with "
                f"num_replicas={self.num_replicas} and drop_last=True"
            )

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` for the next pass (and forget any resume offset)."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, in order (before any resume offset)."""
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(n)
        else:
            order = np.arange(n)
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > n:
            reps = math.ceil((self.total_size - n) / n)
            order = np.concatenate([order] + [order] * reps)[: self.total_size]
        return order[self.rank: self.total_size: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        idx = self.indices()[self._start:]
        self._start = 0
        return iter(idx.tolist())

    def __len__(self) -> int:
        return self.num_samples - self._start

    def state_dict(self) -> Dict[str, Any]:
        """Position to resume from: epoch, seed and global samples consumed this epoch."""
        return {"epoch": self.epoch, "seed": self.seed, "consumed_global": self._start * self.num_replicas}

    def load_state_dict(self, state: Dict[str, Any], consumed_local: Optional[int] = None) -> None:
        """Resume at ``state``'s epoch, skipping the samples consumed then (any replica count)."""
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        consumed = int(state.get("consumed_global", 0)) if consumed_local is None else consumed_local * self.num_replicas
        self._start = min(consumed // self.num_replicas, self.num_samples)

    def advance(self, local_samples: int) -> None:
        """Record that ``local_samples`` of this epoch were consumed (for :meth:`state_dict`)."""
        self._start = min(self._start + int(local_samples), self.num_samples)

    def __repr__(self) -> str:
        return (f"DistributedSampler(n={len(self.dataset)}, num_replicas={self.num_replicas}, rank={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, drop_last={self.drop_last})")


def create_dataloader(dataset: Any, global_batch_size: int, group=None, *, shuffle: bool = True, seed: int = 0,
                      drop_last: bool = True, collate_fn=None) -> DataLoader:
    """A DataLoader whose batches, over all data-parallel ranks together, form ``global_batch_size``.

    Each rank loads ``global_batch_size // group.size`` samples per step from its
    :class:`DistributedSampler` share (AxoNN's convention: the batch size you give is the
    global one). The sampler is available as ``loader.sampler``.

    Raises:
        ValueError: if ``global_batch_size`` does not divide by the data-parallel size.

    Example:
        >>> loader = create_dataloader(ds, global_batch_size=64)   # 16 per rank on 4 ranks
        >>> for epoch in range(3):
        ...     loader.set_epoch(epoch)
        ...     for x, y in loader: ...
    """
    from ..distributed import resolve_group

    g = resolve_group(group)
    if not isinstance(global_batch_size, (int, np.integer)) or global_batch_size < 1:
        raise ValueError(f"rank {g.world.rank}: global_batch_size must be a positive int, got {global_batch_size!r}")
    if global_batch_size % g.size:
        lo = global_batch_size // g.size * g.size
        raise ValueError(
            f"rank {g.world.rank}: global_batch_size={global_batch_size} does not divide by the data-parallel "
            f"size {g.size}; use a multiple of {g.size} such as {max(lo, g.size)} or {lo + g.size}"
        )
    sampler = DistributedSampler(dataset, num_replicas=g.size, rank=g.rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=global_batch_size // g.size, sampler=sampler, drop_last=drop_last,
                      collate_fn=collate_fn)
