"""ShardedArray: one rank's block of a global array, the unit sharded strategies hand to checkpoints."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

__all__ = ["ShardedArray"]


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
        from ..distributed import resolve_group
        g = resolve_group(group)
        rank = g.rank if rank is None else rank
        parts = g.size if parts is None else parts
    if not 0 <= rank < parts:
        raise ValueError(f"ShardedArray: rank {rank} out of range for {parts} parts")
    return int(rank), int(parts)


class ShardedArray:
    """This rank's block ``local`` of a global array of shape ``global_shape`` starting at ``offsets``.

    The block covers ``global[offsets[0]:offsets[0]+local.shape[0], offsets[1]:..., ...]``.
    Blocks of all ranks of the saving group must tile the global array; the same block may
    be held by several ranks (replicas, e.g. hybrid sharding) — it is written once, by the
    lowest group rank holding it. ``local`` may be a NumPy or CuPy array; :func:`load` fills
    it in place.

    Args:
        local: the block (NumPy or CuPy array).
        global_shape: shape of the whole array.
        offsets: index of the block's first element in the global array (one int per axis).

    Example (4 ranks, a (10, 6) weight split along axis 0 → rows 3, 3, 2, 2):
        >>> sa = ShardedArray.from_chunks(local_rows, (10, 6), axis=0)
        >>> sa.offsets        # rank 2: (6, 0)
    """

    __slots__ = ("local", "global_shape", "offsets")

    def __init__(self, local: Any, global_shape: Sequence[int], offsets: Sequence[int]):
        if not hasattr(local, "shape") or not hasattr(local, "dtype"):
            local = np.asarray(local)
        gs = _as_shape(global_shape, "global_shape")
        off = _as_shape(offsets, "offsets")
        ls = tuple(int(v) for v in local.shape)
        if not (len(gs) == len(off) == len(ls)):
            raise ValueError(
                f"ShardedArray: local.ndim={len(ls)}, len(global_shape)={len(gs)} and "
                f"len(offsets)={len(off)} must agree (local shape {ls}, global {gs}, offsets {off})"
            )
        bad = [i for i in range(len(gs)) if off[i] + ls[i] > gs[i]]
        if bad:
            raise ValueError(
                f"ShardedArray: block of shape {ls} at offsets {off} does not fit in global shape {gs} "
                f"(axes {bad})"
            )
        self.local = local
        self.global_shape = gs
        self.offsets = off

    @classmethod
    def from_chunks(cls, local: Any, global_shape: Sequence[int], axis: int = 0, group=None, *,
                    rank: Optional[int] = None, parts: Optional[int] = None) -> "ShardedArray":
        """Wrap ``local`` as chunk ``rank`` of ``parts`` along ``axis`` by the ``chunk_sizes`` rule.

        ``rank``/``parts`` default to this process's rank and size in ``group`` (default: all
        ranks). With 10 rows over 4 parts the chunks hold 3, 3, 2, 2 rows.
        """
        from ..distributed import chunk_bounds
        gs = _as_shape(global_shape, "global_shape")
        if not gs:
            raise ValueError("ShardedArray.from_chunks: a 0-d array has no axis to split; use ShardedArray(a, (), ())")
        ax = axis + len(gs) if axis < 0 else axis
        if not 0 <= ax < len(gs):
            raise ValueError(f"ShardedArray.from_chunks: axis {axis} out of range for global shape {gs}")
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
        """Take this rank's chunk (``chunk_sizes`` rule along ``axis``) of a full array."""
        from ..distributed import chunk_bounds
        rank, parts = _rank_parts(group, rank, parts)
        ax = axis + full.ndim if axis < 0 else axis
        start, stop = chunk_bounds(full.shape[ax], parts, rank)
        idx = (slice(None),) * ax + (slice(start, stop),)
        local = full[idx]
        if copy:
            local = local.copy()
        return cls.from_chunks(local, full.shape, ax, rank=rank, parts=parts)

    @classmethod
    def zeros(cls, global_shape: Sequence[int], dtype: Any = np.float32, axis: int = 0, group=None, *,
              rank: Optional[int] = None, parts: Optional[int] = None) -> "ShardedArray":
        """A zero-filled chunk of ``global_shape`` along ``axis`` for this rank (e.g. a load template)."""
        rank, parts = _rank_parts(group, rank, parts)
        gs = _as_shape(global_shape, "global_shape")
        ax = axis + len(gs) if axis < 0 else axis
        from ..distributed import chunk_bounds
        start, stop = chunk_bounds(gs[ax], parts, rank) if 0 <= ax < len(gs) else (0, 0)
        local = np.zeros(gs[:ax] + (stop - start,) + gs[ax + 1:], dtype)
        return cls.from_chunks(local, gs, ax, rank=rank, parts=parts)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The global shape."""
        return self.global_shape

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(int(v) for v in self.local.shape)

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def slices(self) -> Tuple[slice, ...]:
        """The block's place in the global array: ``full[sa.slices] == sa.local``."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))

    def __repr__(self) -> str:
        return (f"ShardedArray(local_shape={self.local_shape}, global_shape={self.global_shape}, "
                f"offsets={self.offsets}, dtype={self.dtype})")
