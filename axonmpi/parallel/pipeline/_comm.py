"""The pipeline's batched point-to-point transfers (its group defaults to ``role_group("pipeline")``).

[Note: scatter / gather between stages]
Under a Megatron tensor group every rank of the group holds the same activation at a stage boundary
(and the same gradient coming back), so sending it whole from each of them moves ``t`` copies.  With
``Pipeline(scatter_group=tensor_group)`` (Megatron's ``scatter_gather_tensors_in_pipeline``) each rank
sends only its ``1/t`` piece of the flattened array (padded to ``t`` equal pieces) to its peer of the
next (or previous) stage, which all-gathers the pieces over its own tensor group: the pipeline's bytes
drop ``t``-fold, for one all-gather of the whole array inside the tensor group.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ...backend import get_array_module
from ...distributed.collectives import P2POp, all_gather, batch_isend_irecv, irecv, isend
from ...distributed.group import ProcessGroup
from ...distributed.work import Work

__all__: List[str] = []

_DTYPES = (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_,
           np.complex64, np.complex128)
_MAX_DIMS = 13
HEADER_SIZE = _MAX_DIMS + 2


def _communicate(sends: Sequence[Tuple[object, int, int]], recvs: Sequence[Tuple[object, int, int]],
                 group: ProcessGroup) -> List[Work]:
    """Start every receive ``(buffer, peer, tag)`` and every send ``(array, peer, tag)`` as one
    :func:`batch_isend_irecv`; peers are group ranks. Returns their :class:`Work` handles
    (receives first); the caller waits.

    Every activation, gradient and shape header of the pipeline goes through here.
    """
    ops = [P2POp(irecv, buf, peer, group, tag) for buf, peer, tag in recvs]
    ops += [P2POp(isend, arr, peer, group, tag) for arr, peer, tag in sends]
    return batch_isend_irecv(ops) if ops else []


def encode_header(trailing_shape: Tuple[int, ...], dtype) -> np.ndarray:
    """A fixed-size int64 array describing an activation: dtype code, ndim, trailing dims."""
    dtype = np.dtype(dtype)
    codes = [np.dtype(d) for d in _DTYPES]
    if dtype not in codes:
        raise TypeError(f"pipeline activations of dtype {dtype} cannot be sent; supported: {[str(c) for c in codes]}")
    if len(trailing_shape) > _MAX_DIMS:
        raise ValueError(f"pipeline activations may have at most {_MAX_DIMS + 1} dimensions, "
                         f"got trailing shape {trailing_shape}")
    h = np.zeros(HEADER_SIZE, np.int64)
    h[0], h[1] = codes.index(dtype), len(trailing_shape)
    h[2:2 + len(trailing_shape)] = trailing_shape
    return h


def decode_header(h: np.ndarray) -> Tuple[Tuple[int, ...], np.dtype]:
    """Inverse of :func:`encode_header`: ``(trailing_shape, dtype)``."""
    n = int(h[1])
    return tuple(int(d) for d in h[2:2 + n]), np.dtype(_DTYPES[int(h[0])])


def piece_size(numel: int, group: Optional[ProcessGroup]) -> int:
    """Elements of each rank's piece of a ``numel``-element array split over ``group`` (padded to equal pieces)."""
    return numel if group is None or group.size == 1 else -(-numel // group.size)


def scatter_piece(arr, group: Optional[ProcessGroup]):
    """This rank's piece of ``arr`` flattened (``[Note: scatter / gather between stages]``); ``arr`` when the
    group has one rank."""
    if group is None or group.size == 1:
        return arr
    xp = get_array_module(arr)
    k = piece_size(arr.size, group)
    out = xp.zeros(k, arr.dtype)
    flat = arr.reshape(-1)[group.rank * k:(group.rank + 1) * k]
    out[:flat.size] = flat
    return out


def gather_pieces(piece, shape: Tuple[int, ...], group: Optional[ProcessGroup]):
    """The whole array of ``shape`` from every rank's piece (collective over ``group``)."""
    if group is None or group.size == 1:
        return piece
    n = int(np.prod(shape))
    return all_gather(piece, group=group)[:n].reshape(shape)
