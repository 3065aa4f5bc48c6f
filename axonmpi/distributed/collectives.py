"""Collectives over process groups: all_reduce, broadcast, all_gather, reduce_scatter, ... on NumPy/CuPy arrays.

Conventions (shared by every function here):

* ``group=None`` means the current World's default group (all ranks).
* Out-of-place by default: the result is a new array. Pass ``out=`` to write into an
  existing array; ``out=x`` reduces in place (MPI_IN_PLACE when ``x`` is contiguous).
* Non-contiguous inputs are copied to contiguous buffers; 0-d and empty arrays work.
* Uneven sizes follow one rule, the :func:`chunk_sizes` rule (``numpy.array_split``'s):
  ``n`` rows over ``p`` ranks gives the first ``n % p`` ranks one extra row. No padding.
* ``async_op=True`` returns a :class:`Work` whose ``wait()`` returns the result.
* Every call goes through the group's :class:`~axonmpi.distributed.backends.Backend`. CuPy
  arrays go to NCCL when ``axonmpi.init(backend=...)`` gives it (``"auto"`` with CuPy's NCCL,
  or ``"nccl"``), else to MPI directly when it is CUDA-aware (``AXONMPI_CUDA_AWARE``), else
  they are staged through host memory, and ``async_op=True`` then completes before returning.
  Host arrays and objects go over MPI. The CPU path never imports CuPy.
* Any array: objects with ``__dlpack__``, ``__cuda_array_interface__`` or the buffer protocol
  (PyTorch tensors, JAX arrays, ``bytearray``...) are moved as zero-copy views where the producer
  allows, and results come back in the caller's type (:mod:`axonmpi.distributed.interop`).

The functions live in one module per topic and are re-exported here: :mod:`.array_collectives`
(collectives on arrays), :mod:`.p2p` (point-to-point), :mod:`.object_collectives` (picklable
objects), :mod:`.host_staging` (the plumbing they share: backends, host staging, checks).
"""
from __future__ import annotations

from .reduce_op import ReduceOp
from .work import Work
from .sharding import chunk_bounds, chunk_sizes
from .array_collectives import (all_gather, all_reduce, all_reduce_max, all_reduce_mean, all_reduce_min,
                                all_reduce_product, all_reduce_sum, all_to_all, barrier, broadcast, gather, reduce,
                                reduce_scatter, reduce_scatter_mean, reduce_scatter_sum, scatter)
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .object_collectives import all_gather_object, broadcast_object, gather_object
from .host_staging import _note_blocking_async  # noqa: F401  (tests clear its cache)

__all__ = [
    "ReduceOp", "Work", "chunk_sizes", "chunk_bounds",
    "all_reduce", "all_reduce_sum", "all_reduce_mean", "all_reduce_min", "all_reduce_max",
    "all_reduce_product", "reduce", "broadcast", "all_gather", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_sum", "reduce_scatter_mean", "all_to_all", "barrier",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv",
    "broadcast_object", "all_gather_object", "gather_object",
]
