"""Distributed data loading: DistributedSampler and create_dataloader (global batch semantics)."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Optional, Tuple

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

    The one departure: the permutation comes from ``numpy.random.default_rng((seed, epoch))``
    (PyTorch draws ``torch.randperm`` from ``seed + epoch``), so shuffled orders differ from
    PyTorch's; unshuffled ones, padding, trimming and the rank stride are identical.

    Call :meth:`set_epoch` before each epoch for a fresh order. Resuming mid-epoch: call
    :meth:`advance` with the samples of each local batch the training loop consumed;
    :meth:`state_dict` holds the epoch and the samples consumed so far this epoch (counted
    in global samples, so a resume on another number of replicas continues at the same place);
    :meth:`load_state_dict` restores them, and the next pass starts after them. The count
    keeps growing across any number of save/resume cycles until :meth:`set_epoch` moves to
    another epoch.

    Args:
        dataset: anything with ``__len__``.
        num_replicas, rank: the data-parallel size and this rank. Default: from ``group``, or
            with no group from the process grid: AxoNN's ``G_data*G_intra_d`` replicas and rank
            ``G_intra_d*data + depth`` (pure data parallel: every rank).
        shuffle: permute each epoch (else the natural order).
        seed: shuffle seed, identical on all ranks.
        drop_last: trim to a multiple of ``num_replicas`` instead of padding.
        group: the data-parallel process group (default: the grid's data x depth replicas).

    Example:
        >>> s = DistributedSampler(range(10), num_replicas=4, rank=1, shuffle=False)
        >>> list(s)                        # padded to 12 with the head: 0..9, 0, 1
        [1, 5, 9]
    """

    def __init__(self, dataset: Any, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, group=None):
        if num_replicas is None or rank is None:
            n_default, r_default = _replicas(group)
            num_replicas = n_default if num_replicas is None else num_replicas
            rank = r_default if rank is None else rank
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
        # [Note: resume position] local samples of this epoch consumed so far: restored by
        # load_state_dict, grown by advance(), cleared only by set_epoch(another epoch). A pass
        # (__iter__) starts after them and does not reset them, so a second save after a resume
        # still counts the samples consumed before the first one.
        self._consumed = 0
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
        """Use the permutation of ``epoch`` for the next pass; another epoch starts at its first sample."""
        if epoch != self.epoch:
            self._consumed = 0
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
        return iter(self.indices()[self._consumed:].tolist())

    def __len__(self) -> int:
        return self.num_samples - self._consumed

    @property
    def consumed(self) -> int:
        """Local samples of the current epoch consumed so far (across resumes)."""
        return self._consumed

    def state_dict(self) -> Dict[str, Any]:
        """Position to resume from: epoch, seed and global samples consumed this epoch."""
        return {"epoch": self.epoch, "seed": self.seed, "consumed_global": self._consumed * self.num_replicas}

    def load_state_dict(self, state: Dict[str, Any], consumed_local: Optional[int] = None) -> None:
        """Resume at ``state``'s epoch, after the samples consumed then (any replica count).

        Raises:
            ValueError: the consumed global count does not divide by ``num_replicas`` (the ranks
                could not all resume at the same local position without repeating or skipping).
        """
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        consumed = int(state.get("consumed_global", 0)) if consumed_local is None else consumed_local * self.num_replicas
        if consumed < 0 or consumed % self.num_replicas:
            raise ValueError(
                f"rank {self.rank}: cannot resume at global sample {consumed} on "
                f"num_replicas={self.num_replicas}: expected a non-negative multiple of {self.num_replicas} "
                "(keep the global batch size a multiple of the data-parallel size)")
        self._consumed = min(consumed // self.num_replicas, self.num_samples)

    def advance(self, local_samples: int) -> None:
        """Record that ``local_samples`` more samples of this epoch were consumed (for :meth:`state_dict`)."""
        if isinstance(local_samples, bool) or not isinstance(local_samples, (int, np.integer)) \
                or local_samples < 0:
            raise ValueError(f"rank {self.rank}: advance() needs a non-negative int, got {local_samples!r}")
        self._consumed = min(self._consumed + int(local_samples), self.num_samples)

    def __repr__(self) -> str:
        return (f"DistributedSampler(n={len(self.dataset)}, num_replicas={self.num_replicas}, rank={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, drop_last={self.drop_last})")


def _replicas(group) -> Tuple[int, int]:
    """``(num_replicas, replica rank)`` from ``group``, or from the grid for ``None``."""
    from ..distributed import get_grid, resolve_group

    if group is None:
        return get_grid().data_replicas
    g = resolve_group(group)
    return g.size, g.rank


def create_dataloader(dataset: Any, global_batch_size: int, micro_batch_size: Optional[int] = None,
                      num_workers: int = 0, group=None, *, shuffle: bool = True, seed: int = 0,
                      drop_last: bool = True, collate_fn=None, **loader_options) -> DataLoader:
    """A DataLoader whose batches, over all data-parallel replicas together, form ``global_batch_size``.

    The replicas: with ``group=None``, the process grid's data x depth ranks, as AxoNN does —
    ``num_replicas = G_data*G_intra_d`` and ``rank = G_intra_d*data + depth``, so the ranks of
    a tensor-parallel block that differ only in row or column (and the pipeline stages) read
    the same samples; pure data parallel: every rank. An explicit ``group`` uses its size and
    rank. Each replica loads ``global_batch_size // num_replicas`` samples per step from its
    :class:`DistributedSampler` share (the batch size you give is the global one). The sampler
    is available as ``loader.sampler``.

    AxoNN's positional order ``create_dataloader(dataset, global_batch_size, micro_batch_size,
    num_workers)``: ``micro_batch_size`` (default: the whole per-replica batch) is the size of
    the micro-batches each replica's batch is cut into, for gradient accumulation or for the
    pipeline; it must divide the per-replica batch. It is kept as ``loader.micro_batch_size``
    and ``loader.micro_batches`` (per-replica batch // micro_batch_size). ``num_workers`` and
    the other DataLoader options (``pin_memory``, ``prefetch_factor``, ``persistent_workers``)
    go to the :class:`DataLoader`.

    Raises:
        ValueError: if ``global_batch_size`` does not divide by the number of replicas.

    Example:
        >>> loader = create_dataloader(ds, global_batch_size=64)   # 16 per rank on 4 ranks
        >>> for epoch in range(3):
        ...     loader.set_epoch(epoch)
        ...     for x, y in loader: ...
    """
    from ..distributed import get_world

    n, r = _replicas(group)
    me = get_world().rank
    what = ("the data-parallel size" if group is not None
            else "the number of data replicas G_data*G_intra_d")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)) \
            or global_batch_size < 1:
        raise ValueError(f"rank {me}: global_batch_size must be a positive int, got {global_batch_size!r}")
    if global_batch_size % n:
        lo = global_batch_size // n * n
        raise ValueError(
            f"rank {me}: global_batch_size={global_batch_size} does not divide by {what} {n}; "
            f"use a multiple of {n} such as {max(lo, n)} or {lo + n}"
        )
    per = global_batch_size // n
    mb = per if micro_batch_size is None else micro_batch_size
    if isinstance(mb, bool) or not isinstance(mb, (int, np.integer)) or mb < 1 or per % mb:
        raise ValueError(f"rank {me}: micro_batch_size={micro_batch_size!r} must be a positive int dividing the "
                         f"per-replica batch {per} (global_batch_size={global_batch_size} over {what} {n})")
    sampler = DistributedSampler(dataset, num_replicas=n, rank=r, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=per, sampler=sampler, drop_last=drop_last,
                        collate_fn=collate_fn, num_workers=num_workers, **loader_options)
    loader.micro_batch_size, loader.micro_batches = int(mb), per // int(mb)
    return loader
