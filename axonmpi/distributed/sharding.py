"""How an array is cut into per-rank blocks: the one uneven-chunk rule and ``ShardedArray``.

One rule everywhere (collectives, sharded strategies, checkpoints): ``n`` items over ``parts``
ranks give the first ``n % parts`` ranks one item more (NumPy's ``array_split``), no padding.
A :class:`ShardedArray` is one rank's block of a global array; strategies hand them to
:mod:`axonmpi.checkpoint`, which writes each distinct block once and reshards on load.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..backend import to_host

__all__ = ["chunk_sizes", "chunk_bounds", "ShardedArray", "FlatLayout", "FlatSegment", "compact_slots", "expand_slots"]


# -- the one split rule ----------------------------------------------------------------------
def _check_parts(parts: int) -> int:
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    return int(parts)


def chunk_sizes(n: int, parts: int) -> List[int]:
    """Sizes of ``n`` items split over ``parts`` ranks: the first ``n % parts`` get one more.

    Args:
        n: number of items (rows), >= 0.
        parts: number of chunks, >= 1.

    Returns:
        ``parts`` ints summing to ``n``.

    Example:
        >>> chunk_sizes(10, 4)
        [3, 3, 2, 2]
    """
    parts = _check_parts(parts)
    if int(n) < 0:
        raise ValueError(f"chunk_sizes: n must be >= 0, got {n}")
    q, r = divmod(int(n), parts)
    return [q + 1 if i < r else q for i in range(parts)]


def chunk_bounds(n: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, stop)`` of chunk ``index`` under the :func:`chunk_sizes` rule.

    Example:
        >>> [chunk_bounds(10, 4, i) for i in range(4)]
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    parts = _check_parts(parts)
    if not 0 <= int(index) < parts:
        raise ValueError(f"chunk_bounds: index {index} out of range for {parts} parts (valid: 0..{parts - 1})")
    if int(n) < 0:
        raise ValueError(f"chunk_bounds: n must be >= 0, got {n}")
    q, r = divmod(int(n), parts)
    index = int(index)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


# -- ShardedArray ----------------------------------------------------------------------------
def _as_shape(x: Any, what: str) -> Tuple[int, ...]:
    try:
        t = tuple(int(v) for v in x)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {x!r}") from None
    if any(v < 0 for v in t):
        raise ValueError(f"{what} must be non-negative, got {t}")
    return t


def _rank_parts(group, rank, parts) -> Tuple[int, int]:
    if rank is None or parts is None:
        from .world import resolve_group
        g = resolve_group(group)
        rank = g.rank if rank is None else rank
        parts = g.size if parts is None else parts
    if not 0 <= rank < parts:
        raise ValueError(f"ShardedArray: rank {rank} out of range for {parts} parts (valid: 0..{parts - 1})")
    return int(rank), int(parts)


def _axis(axis: int, ndim: int, what: str, gs) -> int:
    ax = axis + ndim if axis < 0 else axis
    if not 0 <= ax < ndim:
        raise ValueError(f"ShardedArray.{what}: axis {axis} out of range for global shape {tuple(gs)}")
    return ax


class ShardedArray:
    """This rank's block ``local`` of a global array of shape ``global_shape`` starting at ``offsets``.

    The block covers ``global[offsets[0]:offsets[0]+local.shape[0], offsets[1]:..., ...]``.
    Blocks of all ranks of a group must tile the global array; the same block may be held by
    several ranks (replicas, e.g. hybrid sharding) — a checkpoint writes it once, by the lowest
    group rank holding it. ``local`` may be a NumPy or CuPy array;
    :func:`axonmpi.checkpoint.load` fills it in place.

    Args:
        local: the block (NumPy or CuPy array).
        global_shape: shape of the whole array.
        offsets: index of the block's first element in the global array (one int per axis).
        view_shape: the array's logical shape when the global array is its flattened values
            (FSDP and ZeRO shard parameters as 1-D ``(numel,)`` arrays; this records the
            parameter's own shape, so checkpoints can give it back). ``None``: ``global_shape``.

    Example (4 ranks, a (10, 6) weight split along axis 0 → rows 3, 3, 2, 2):
        >>> sa = ShardedArray.from_chunks(local_rows, (10, 6), axis=0)
        >>> sa.offsets        # rank 2: (6, 0)
    """

    __slots__ = ("local", "global_shape", "offsets", "view_shape")

    def __init__(self, local: Any, global_shape: Sequence[int], offsets: Sequence[int], *,
                 view_shape: Optional[Sequence[int]] = None):
        if not hasattr(local, "shape") or not hasattr(local, "dtype"):
            local = np.asarray(local)
        gs = _as_shape(global_shape, "global_shape")
        off = _as_shape(offsets, "offsets")
        ls = tuple(int(v) for v in local.shape)
        if not gs and not off and ls == (0,):
            ls = ()                     # a 0-d array's empty block (see ``empty``): holds none of it
        elif not (len(gs) == len(off) == len(ls)):
            raise ValueError(
                f"ShardedArray: local.ndim={len(ls)}, len(global_shape)={len(gs)} and "
                f"len(offsets)={len(off)} must agree (local shape {ls}, global {gs}, offsets {off})"
            )
        bad = [i for i in range(len(gs)) if off[i] + ls[i] > gs[i]] if ls or gs else []
        if bad:
            raise ValueError(
                f"ShardedArray: block of shape {ls} at offsets {off} does not fit in global shape {gs} "
                f"(axes {bad})"
            )
        vs = None if view_shape is None else _as_shape(view_shape, "view_shape")
        if vs is not None and int(np.prod(vs, dtype=np.int64)) != int(np.prod(gs, dtype=np.int64)):
            raise ValueError(f"ShardedArray: view_shape {vs} has {int(np.prod(vs, dtype=np.int64))} elements, "
                             f"global shape {gs} has {int(np.prod(gs, dtype=np.int64))}; they must agree")
        self.local = local
        self.global_shape = gs
        self.offsets = off
        self.view_shape = vs

    @classmethod
    def from_chunks(cls, local: Any, global_shape: Sequence[int], axis: int = 0, group=None, *,
                    rank: Optional[int] = None, parts: Optional[int] = None) -> "ShardedArray":
        """Wrap ``local`` as chunk ``rank`` of ``parts`` along ``axis`` by the :func:`chunk_sizes` rule.

        Args:
            local: this rank's chunk.
            global_shape: shape of the whole array.
            axis: the split axis (negative counts from the end).
            group: ``rank``/``parts`` default to this process's rank and size in it (default: all ranks).
            rank, parts: which chunk of how many (override the group's).

        Returns:
            The ShardedArray; ValueError if ``local`` does not have the chunk's shape.

        Example:
            >>> ShardedArray.from_chunks(np.zeros((2, 6)), (10, 6), axis=0, rank=2, parts=4).offsets
            (6, 0)
        """
        gs = _as_shape(global_shape, "global_shape")
        if not gs:
            raise ValueError("ShardedArray.from_chunks: a 0-d array has no axis to split; use ShardedArray(a, (), ())")
        ax = _axis(axis, len(gs), "from_chunks", gs)
        rank, parts = _rank_parts(group, rank, parts)
        start, stop = chunk_bounds(gs[ax], parts, rank)
        want = gs[:ax] + (stop - start,) + gs[ax + 1:]
        shape = tuple(int(v) for v in getattr(local, "shape", np.shape(local)))
        if shape != want:
            raise ValueError(
                f"ShardedArray.from_chunks: chunk {rank} of {parts} along axis {ax} of {gs} has shape "
                f"{want}, got local shape {shape}"
            )
        off = [0] * len(gs)
        off[ax] = start
        return cls(local, gs, off)

    @classmethod
    def from_global(cls, full: Any, axis: int = 0, group=None, *, rank: Optional[int] = None,
                    parts: Optional[int] = None, copy: bool = True) -> "ShardedArray":
        """Take this rank's chunk (:func:`chunk_sizes` rule along ``axis``) of a full array.

        Example:
            >>> ShardedArray.from_global(np.arange(10.0), rank=1, parts=4).local
            array([3., 4., 5.])
        """
        rank, parts = _rank_parts(group, rank, parts)
        ax = _axis(axis, full.ndim, "from_global", full.shape)
        start, stop = chunk_bounds(full.shape[ax], parts, rank)
        local = full[(slice(None),) * ax + (slice(start, stop),)]
        if copy:
            local = local.copy()
        return cls.from_chunks(local, full.shape, ax, rank=rank, parts=parts)

    @classmethod
    def empty(cls, global_shape: Sequence[int], dtype: Any = np.float32) -> "ShardedArray":
        """A block holding none of an array of ``global_shape`` (a rank that owns no piece of it, e.g. another
        pipeline stage's parameter): its ``local`` has no element; for a 0-d array it is of shape ``(0,)``.

        Example:
            >>> ShardedArray.empty((), np.float64).is_empty, ShardedArray.empty((4, 3)).local.shape
            (True, (0, 3))
        """
        gs = _as_shape(global_shape, "global_shape")
        return cls(np.empty((0,) + gs[1:], dtype), gs, (0,) * len(gs))

    @property
    def is_empty(self) -> bool:
        """True when this rank's block holds no element (nothing to write or read)."""
        return int(self.local.size) == 0

    @classmethod
    def zeros(cls, global_shape: Sequence[int], dtype: Any = np.float32, axis: int = 0, group=None, *,
              rank: Optional[int] = None, parts: Optional[int] = None) -> "ShardedArray":
        """A zero-filled chunk of ``global_shape`` along ``axis`` for this rank (e.g. a load template).

        Example:
            >>> ShardedArray.zeros((10, 6), np.float64, axis=1, rank=0, parts=4).local_shape
            (10, 2)
        """
        rank, parts = _rank_parts(group, rank, parts)
        gs = _as_shape(global_shape, "global_shape")
        if not gs:
            raise ValueError("ShardedArray.zeros: a 0-d array has no axis to split; use ShardedArray(a, (), ())")
        ax = _axis(axis, len(gs), "zeros", gs)
        start, stop = chunk_bounds(gs[ax], parts, rank)
        local = np.zeros(gs[:ax] + (stop - start,) + gs[ax + 1:], dtype)
        return cls.from_chunks(local, gs, ax, rank=rank, parts=parts)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The global shape."""
        return self.global_shape

    @property
    def local_shape(self) -> Tuple[int, ...]:
        """The shape of this rank's block (a 0-d array's empty block: ``(0,)``)."""
        return tuple(int(v) for v in self.local.shape)

    @property
    def dtype(self):
        """The dtype of the block."""
        return self.local.dtype

    @property
    def ndim(self) -> int:
        """Number of axes of the global array."""
        return len(self.global_shape)

    @property
    def slices(self) -> Tuple[slice, ...]:
        """The block's place in the global array: ``full[sa.slices] == sa.local``."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))

    def __repr__(self) -> str:
        return (f"ShardedArray(local_shape={self.local_shape}, global_shape={self.global_shape}, "
                f"offsets={self.offsets}, dtype={self.dtype})")


# -- many arrays in one flat buffer, and the padded slot layout of its chunks ---------------------
class FlatSegment(NamedTuple):
    """Part of one parameter inside a range of the flat buffer.

    Attributes:
        index: position of the parameter in the FlatParameter.
        name: its name.
        param_start, param_stop: the range of its flattened elements.
        offset: where that range starts inside the queried flat range.
    """

    index: int
    name: str
    param_start: int
    param_stop: int
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the parameter in this segment."""
        return self.param_stop - self.param_start

    def in_chunk(self, chunk):
        """This segment's elements in ``chunk`` (an array over the queried flat range): a view."""
        return chunk[self.offset:self.offset + self.param_stop - self.param_start]

    def in_param(self, values, start: int = 0):
        """This segment's elements of the parameter's flattened ``values`` that begin at element ``start``."""
        return values[self.param_start - start:self.param_stop - start]


class FlatLayout:
    """Where each of several arrays lies in one flat 1-D buffer (back to back, in order).

    Args:
        shapes: the arrays' shapes (``()`` for 0-d).

    Attributes:
        shapes, numels, offsets: per array; ``numel``: the total.

    Example:
        >>> lay = FlatLayout([(2, 3), (3,)])
        >>> lay.offsets, lay.numel
        ((0, 6), 9)
        >>> w, b = lay.views(np.arange(9.0))       # w is a (2, 3) view, b a (3,) view
    """

    __slots__ = ("shapes", "numels", "offsets", "numel")

    def __init__(self, shapes: Sequence[Tuple[int, ...]]):
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.numels = tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)
        offs, acc = [], 0
        for c in self.numels:
            offs.append(acc)
            acc += c
        self.offsets = tuple(offs)
        self.numel = acc

    def views(self, flat) -> List[Any]:
        """Views of ``flat`` (1-D, at least ``numel`` long), one per array, in its shape."""
        return [flat[o:o + c].reshape(s) for o, c, s in zip(self.offsets, self.numels, self.shapes)]

    def pack(self, arrays: Sequence[Any], out) -> Any:
        """Copy ``arrays`` into their slices of ``out``; ``None`` entries become zeros."""
        for a, o, c in zip(arrays, self.offsets, self.numels):
            if a is None:
                out[o:o + c] = 0
            else:
                out[o:o + c] = a.reshape(-1)
        return out

    def segments(self, start: int, stop: int, names: Sequence[str]) -> List[FlatSegment]:
        """The parts of every array that fall inside flat range ``[start, stop)``."""
        out = []
        for i, (o, c) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, o), min(stop, o + c)
            if lo < hi:
                out.append(FlatSegment(i, names[i], lo - o, hi - o, lo - start))
        return out

    def shard_blocks(self, segments: Sequence["FlatSegment"], chunk) -> List["ShardedArray"]:
        """One 1-D host :class:`ShardedArray` per array, holding the elements of ``chunk``.

        ``chunk`` is shaped like this rank's range of the flat buffer and ``segments`` says which
        parts of which arrays it covers (:meth:`segments`); an array it does not touch gets an
        empty block. Used for sharded state dicts (FSDP parameters, ZeRO/FSDP optimizer state).
        """
        segs = {s.index: s for s in segments}
        out = []
        for i, numel in enumerate(self.numels):
            s = segs.get(i)
            if s is None:
                out.append(ShardedArray(to_host(chunk[:0]).copy(), (numel,), (0,), view_shape=self.shapes[i]))
            else:
                piece = s.in_chunk(chunk)
                out.append(ShardedArray(to_host(piece).copy(), (numel,), (s.param_start,),
                                        view_shape=self.shapes[i]))
        return out

    def __repr__(self) -> str:
        return f"FlatLayout(arrays={len(self.shapes)}, numel={self.numel})"


def compact_slots(padded, n: int, k: int, size: int) -> None:
    """Slot layout (chunk ``i`` at ``i * size``) -> contiguous layout, in place."""
    for i in range(k):
        lo, hi = chunk_bounds(n, k, i)
        src = i * size
        if src != lo and hi > lo:
            padded[lo:hi] = padded[src:src + hi - lo]


def expand_slots(padded, n: int, k: int, size: int) -> None:
    """Contiguous layout -> slot layout with zero padding, in place (inverse of :func:`compact_slots`)."""
    for i in reversed(range(k)):
        lo, hi = chunk_bounds(n, k, i)
        dst = i * size
        if dst != lo and hi > lo:
            padded[dst:dst + hi - lo] = padded[lo:hi]
    for i in range(k):
        lo, hi = chunk_bounds(n, k, i)
        if hi - lo < size:
            padded[i * size + hi - lo:(i + 1) * size] = 0
