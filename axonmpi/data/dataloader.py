"""``DataLoader``: deterministic (seed, epoch) shuffling and batching of map-style datasets."""
from __future__ import annotations

import numbers
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from ..backend import get_array_module, is_cupy_array

__all__ = ["DataLoader", "default_collate"]


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch, recursing into tuples, lists and dicts.

    Arrays and numbers are stacked along a new first axis (NumPy, or CuPy for CuPy
    samples), ``axonmpi.Tensor`` samples into a Tensor (as torch's ``default_collate``);
    tuples/lists give a tuple of batches; dicts give a dict of batches; anything else
    (strings, objects) is returned as a list.

    Example:
        >>> default_collate([(np.zeros(2), 1), (np.ones(2), 0)])[1]
        array([1, 0])
    """
    first = samples[0]
    from ..autograd import Tensor
    if isinstance(first, Tensor):              # torch's rule: Tensors stack into a Tensor
        return Tensor._wrap(get_array_module(first.data).stack([s.data for s in samples]))
    if isinstance(first, np.ndarray) or is_cupy_array(first):
        return get_array_module(first).stack(samples)
    if isinstance(first, (numbers.Number, np.generic)) and not isinstance(first, bool):
        return np.asarray(samples)
    if isinstance(first, bool):
        return np.asarray(samples, dtype=bool)
    if isinstance(first, dict):
        return {k: default_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise ValueError(f"default_collate: samples have different lengths {[len(s) for s in samples]}")
        return tuple(default_collate(field) for field in zip(*samples))
    return list(samples)


class DataLoader:
    """Batches of a map-style dataset in a deterministic order.

    With ``shuffle=True`` the order of a pass is a permutation drawn from
    ``numpy.random.default_rng((seed, epoch))``: the same (seed, epoch) gives the
    same order on every run and every rank. ``set_epoch(e)`` picks the epoch of the
    next pass; without it the epoch advances by one after each pass, so successive
    passes differ but stay reproducible.

    Args:
        dataset: object with ``__len__`` and ``__getitem__``; if it also has
            ``get_batch(indices)`` (``TensorDataset``, ``CharDataset``, a ``Subset``
            of those) and ``collate_fn`` is None, batches are gathered by fancy
            indexing instead of per-sample stacking.
        batch_size: samples per batch (>= 1).
        shuffle: draw a fresh permutation each epoch (not allowed with ``sampler``).
        seed: the shuffle seed.
        drop_last: drop the final batch when it is smaller than ``batch_size``.
        collate_fn: turns a list of samples into a batch (default: :func:`default_collate`).
        sampler: iterable of indices that fixes the order (e.g. a distributed
            sampler); its ``set_epoch`` is called by :meth:`set_epoch`.
        num_workers: background threads that fetch and collate batches ahead of the loop
            (0: in the calling thread). Batches come in the same order with the same contents
            as with 0 workers; NumPy indexing, file reads and decompression release the GIL,
            so loading overlaps the step. A Python-heavy ``__getitem__`` gains less than with
            PyTorch's worker processes.
        pin_memory: accepted for PyTorch code; NumPy batches are already in host memory that
            the MPI and CuPy copies read directly, so it changes nothing.
        prefetch_factor: batches fetched ahead per worker (default 2; only with workers).
        persistent_workers: keep the worker threads between passes (only with workers).
        generator: torch's ``generator=``: an :class:`axonmpi.Generator` each shuffled pass draws
            its order from (then ``seed`` and the epoch are not used).

    Example:
        >>> dl = DataLoader(TensorDataset(np.arange(10)), batch_size=4, shuffle=True)
        >>> [len(b[0]) for b in dl]
        [4, 4, 2]
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Optional[Callable[[list], Any]] = None,
        sampler: Optional[Iterable[int]] = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        generator: Any = None,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if sampler is not None and shuffle:
            raise ValueError("shuffle=True cannot be combined with a sampler; the sampler fixes the order")
        if not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
            raise ValueError(f"prefetch_factor={prefetch_factor!r} and persistent_workers={persistent_workers!r} "
                             "need num_workers > 0 (as in PyTorch); leave them out for in-thread loading")
        if prefetch_factor is not None and (not isinstance(prefetch_factor, numbers.Integral) or prefetch_factor < 1):
            raise ValueError(f"prefetch_factor must be a positive integer, got {prefetch_factor!r}")
        self.num_workers = int(num_workers)
        self.pin_memory = bool(pin_memory)
        self.prefetch_factor = 2 if prefetch_factor is None and num_workers else prefetch_factor
        self.persistent_workers = bool(persistent_workers)
        self._pool: Optional[ThreadPoolExecutor] = None
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        self.sampler = sampler
        self.epoch = 0
        if generator is not None:
            from ..random import host_generator
            host_generator(generator)          # a TypeError naming it when it is not a Generator
        self.generator = generator

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (and pass it to the sampler's ``set_epoch``)."""
        if not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _num_samples(self) -> int:
        return len(self.sampler) if self.sampler is not None else len(self.dataset)

    def __len__(self) -> int:
        n = self._num_samples()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self) -> np.ndarray:
        if self.sampler is not None:
            return np.fromiter(iter(self.sampler), dtype=np.int64)
        n = len(self.dataset)
        if self.shuffle and self.generator is not None:
            from ..random import host_generator
            return host_generator(self.generator).permutation(n)   # torch's: each pass draws from it
        if self.shuffle:
            return np.random.default_rng((self.seed, self.epoch)).permutation(n)
        return np.arange(n, dtype=np.int64)

    def __iter__(self) -> Iterator[Any]:
        order = self._order()  # drawn now, so iter() fixes the pass's epoch
        if self.sampler is None:
            self.epoch += 1  # the next pass differs unless set_epoch() says otherwise
        return self._batches(order)

    def _batches(self, order: np.ndarray) -> Iterator[Any]:
        fetch = getattr(self.dataset, "get_batch", None) if self.collate_fn is None else None
        collate = self.collate_fn or default_collate
        n, bs = len(order), self.batch_size
        stop = n - n % bs if self.drop_last else n

        def load(idx):
            return fetch(idx) if fetch is not None else collate([self.dataset[int(i)] for i in idx])

        if not self.num_workers:
            for start in range(0, stop, bs):
                yield load(order[start:start + bs])
            return
        yield from self._background(load, [order[s:s + bs] for s in range(0, stop, bs)])

    def _background(self, load, chunks) -> Iterator[Any]:
        """Batches from worker threads, in order, at most ``num_workers * prefetch_factor`` ahead."""
        pool = self._pool or ThreadPoolExecutor(self.num_workers, thread_name_prefix="axonmpi-loader")
        if self.persistent_workers:
            self._pool = pool
        ahead, pending = self.num_workers * self.prefetch_factor, deque()
        it = iter(chunks)
        try:
            for idx in it:
                pending.append(pool.submit(load, idx))
                if len(pending) >= ahead:
                    break
            while pending:
                batch = pending.popleft().result()   # a worker's exception is raised here
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(pool.submit(load, nxt))
                yield batch
        finally:
            for f in pending:
                f.cancel()
            if not self.persistent_workers:
                pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return (f"DataLoader(dataset={type(self.dataset).__name__}(len={len(self.dataset)}), "
                f"batch_size={self.batch_size}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, epoch={self.epoch}, num_workers={self.num_workers})")
