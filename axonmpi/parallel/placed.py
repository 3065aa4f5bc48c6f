"""One parameter's arrays by its placement alone: cut the full array, gather the pieces, checkpoint blocks.

A :class:`~axonmpi.distributed.Placement` with a ``full_shape`` and its :attr:`~Placement.layout`
(the :class:`~axonmpi.distributed.Cut` steps from the full array to a rank's local one) says
everything these need; no layer is asked.  The sharded state (:mod:`axonmpi.parallel.state`),
the tensor-parallel layers' ``tp_*`` methods and the checkpoints all go through here.

[Note: a piece as a checkpoint block]  A sharded checkpoint stores ``ShardedArray`` blocks:
rectangles of the full array.  Walking the cuts in order, a cut of one dim keeps the piece a
rectangle (its offset moves by the chunk's start); a flattened cut does when every chunk is a
band of whole rows of the piece (the same for every rank of the group, so all ranks decide
alike); a ``parts`` cut (q/k/v) never does.  :func:`block` gathers the cuts from the first one
that breaks the rectangle on (collective over their groups) and writes that rectangle;
:func:`unblock` cuts them again from the rectangle a load filled.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from ..backend import to_host
from ..distributed import all_gather
from ..distributed.placement import Cut, Placement
from ..distributed.sharding import ShardedArray, chunk_bounds

__all__ = ["is_complete", "local_shape", "cut", "gather", "block", "unblock"]


def is_complete(pl: Placement) -> bool:
    """True when ``pl`` alone locates this rank's elements: a full shape, and cuts for its dim / block shards."""
    return pl.full_shape is not None


def _full(pl: Placement) -> Tuple[int, ...]:
    if pl.full_shape is None:
        raise ValueError(f"the placement {pl.describe()} has no full_shape: the strategy that set it must record "
                         "the serial shape (set_placement(p, Placement(..., full_shape=...)))")
    return tuple(int(n) for n in pl.full_shape)


def _step(shape: Tuple[int, ...], c: Cut, rank: int) -> Tuple[Tuple[int, ...], int, int, int]:
    """``(shape, dim, start, stop)`` of one cut at ``rank``: the shape it cuts (the flattened one for
    ``dim=None``), the dim it cuts, and this rank's ``[start, stop)`` of that dim (within each part)."""
    d = 0 if c.dim is None else c.dim % len(shape)
    if c.dim is None:
        shape = (int(np.prod(shape)),)
    a, b = chunk_bounds(shape[d] // c.parts, c.group.size, rank)
    return shape, d, a, b


def _shapes(pl: Placement, start: int = 0, shape=None) -> List[Tuple[int, ...]]:
    """The array's shape before each cut from ``start`` on, and after the last (this rank's local shape)."""
    shape = _full(pl) if shape is None else tuple(shape)
    out = [shape]
    for c in pl.layout[start:]:
        shape, d, a, b = _step(shape, c, c.group.rank)
        shape = shape[:d] + ((b - a) * c.parts,) + shape[d + 1:]
        out.append(shape)
    return out


def local_shape(pl: Placement) -> Tuple[int, ...]:
    """This rank's local shape by the cuts (the full shape when nothing cuts it)."""
    return _shapes(pl)[-1]


def cut(full, pl: Placement, start: int = 0):
    """This rank's piece of ``full`` (a host array of the full shape, or with ``start`` the piece before
    cut ``start``): every cut from ``start`` on, each keeping this rank's chunk.  No communication."""
    a_ = np.asarray(to_host(full))
    for c in pl.layout[start:]:
        shape, d, a, b = _step(a_.shape, c, c.group.rank)
        a_ = a_.reshape(shape[:d] + (c.parts, shape[d] // c.parts) + shape[d + 1:])
        idx = (slice(None),) * (d + 1) + (slice(a, b),)
        a_ = a_[idx].reshape(shape[:d] + ((b - a) * c.parts,) + shape[d + 1:])
    return np.ascontiguousarray(a_)


def gather(local, pl: Placement, start: int = 0):
    """The full array (or with ``start`` the piece before cut ``start``) from every rank's ``local``
    piece: the cuts undone last to first, each an all-gather over its group (collective)."""
    shapes = _shapes(pl)
    x = np.asarray(to_host(local)).reshape(shapes[-1])
    cuts = pl.layout
    for i in range(len(cuts) - 1, start - 1, -1):
        c, before = cuts[i], shapes[i]
        if c.group.size > 1:
            shape, d, _, _ = _step(before, c, c.group.rank)
            n = shape[d] // c.parts
            x = x.reshape(x.shape[:d] + (c.parts, x.shape[d] // c.parts) + x.shape[d + 1:])
            x = all_gather(np.ascontiguousarray(x), axis=d + 1, group=c.group, uneven=n % c.group.size != 0)
        x = np.asarray(x).reshape(before)
    return x


def _rect(pl: Placement):
    """``(k, offsets, shape)``: the first ``k`` cuts keep the piece a rectangle of the full array at ``offsets``
    of ``shape`` (see [Note: a piece as a checkpoint block])."""
    shape = _full(pl)
    offsets = [0] * len(shape)
    piece = list(shape)
    for k, c in enumerate(pl.layout):
        if (c.parts != 1 and c.group.size > 1) or any(x.dim is None for x in pl.layout[:k]):
            return k, tuple(offsets), tuple(piece)      # past a flattened cut, dims are the 1-D array's
        if c.dim is None:
            numel, row = int(np.prod(piece)), int(np.prod(piece[1:]))
            if c.group.size > 1 and (numel % c.group.size or row == 0 or (numel // c.group.size) % row):
                return k, tuple(offsets), tuple(piece)
            a, b = chunk_bounds(numel, c.group.size, c.group.rank)
            offsets[0] += a // max(row, 1)
            piece[0] = (b - a) // max(row, 1)
            continue
        d = c.dim % len(piece)
        a, b = chunk_bounds(piece[d], c.group.size, c.group.rank)
        offsets[d] += a
        piece[d] = b - a
    return len(pl.layout), tuple(offsets), tuple(piece)


def block(local, pl: Placement) -> ShardedArray:
    """``local`` (this rank's piece, or an array shaped like it) as a ``ShardedArray`` of the full array: a
    view where the piece is a rectangle, else the smallest gathered rectangle holding it (collective over
    the gathered cuts' groups)."""
    k, offsets, piece = _rect(pl)
    host = np.asarray(to_host(local))
    if k < len(pl.layout):
        host = gather(host, pl, start=k)
    return ShardedArray(host.reshape(piece), _full(pl), offsets)


def unblock(block_local, pl: Placement):
    """This rank's piece (its local shape) from the rectangle a load filled in :func:`block`'s form."""
    k, _, _ = _rect(pl)
    shapes = _shapes(pl)
    return cut(np.asarray(to_host(block_local)).reshape(shapes[k]), pl, start=k).reshape(shapes[-1])
