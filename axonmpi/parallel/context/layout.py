"""Which tokens of a sequence each rank of a context-parallel group holds (ring: causal load balancing; Ulysses: contiguous)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from ...distributed.sharding import chunk_sizes
from ...enums import coerce_enum

__all__ = ["CPAlgo", "ContextLayout", "local_layout"]


class CPAlgo(enum.Enum):
    """Context-parallel attention algorithm.

    ``RING``: K/V blocks travel around the group (point-to-point, overlapped with each block's
    attention); the sequence is cut into ``2P`` chunks and rank ``i`` holds chunks ``i`` and
    ``2P-1-i`` so that every rank does the same causal work (Megatron CP's load balancing).
    ``ULYSSES``: DeepSpeed-Ulysses: an all-to-all turns sequence shards into head shards, attention
    runs on whole sequences for ``heads/P`` heads, and a second all-to-all turns it back.
    """

    RING = "ring"
    ULYSSES = "ulysses"

    @classmethod
    def coerce(cls, value) -> "CPAlgo":
        """``CPAlgo`` from a member or its name (``"ring"``, ``"ulysses"``)."""
        return coerce_enum(cls, value, "context-parallel algorithm")


@dataclass(frozen=True)
class ContextLayout:
    """The tokens rank ``r`` of a ``size``-rank context group holds, for a sequence of ``seq_len`` tokens.

    ``RING``: ``seq_len`` is cut into ``2*size`` chunks by the uneven chunk rule (the first
    ``seq_len % (2*size)`` chunks one token longer) and rank ``r`` holds chunks ``r`` and
    ``2*size-1-r``, in that order.  ``ULYSSES``: ``size`` contiguous chunks, rank ``r`` the ``r``-th.

    Example (``seq_len=10``, 2 ranks, ring: chunks 3, 3, 2, 2)::

        >>> ContextLayout(10, 2, "ring").positions(0), ContextLayout(10, 2, "ring").positions(1)
        (array([0, 1, 2, 8, 9]), array([3, 4, 5, 6, 7]))
    """

    seq_len: int
    size: int
    algo: CPAlgo = CPAlgo.RING

    def __post_init__(self):
        object.__setattr__(self, "algo", CPAlgo.coerce(self.algo))
        if int(self.size) < 1:
            raise ValueError(f"ContextLayout: size must be >= 1, got {self.size}")
        n = 2 * self.size if self.algo is CPAlgo.RING else self.size
        if int(self.seq_len) < n:
            raise ValueError(
                f"ContextLayout: a sequence of {self.seq_len} tokens cannot be cut into the {n} chunks "
                f"{self.algo.value} attention over {self.size} ranks needs (at least one token each); use "
                f"sequences of at least {n} tokens or fewer context-parallel ranks")

    def _bounds(self) -> List[Tuple[int, int]]:
        n = 2 * self.size if self.algo is CPAlgo.RING else self.size
        sizes = chunk_sizes(int(self.seq_len), n)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        return [(int(starts[i]), int(starts[i + 1])) for i in range(n)]

    def ranges(self, rank: int) -> List[Tuple[int, int]]:
        """The ``[start, stop)`` token ranges rank ``rank`` holds, in its local order."""
        b = self._bounds()
        if self.algo is CPAlgo.RING:
            return [b[rank], b[2 * self.size - 1 - rank]]
        return [b[rank]]

    def positions(self, rank: int) -> np.ndarray:
        """The global token positions rank ``rank`` holds, in its local order (ascending)."""
        return np.concatenate([np.arange(a, b) for a, b in self.ranges(rank)])

    def local_len(self, rank: int) -> int:
        """Number of tokens on ``rank``."""
        return sum(b - a for a, b in self.ranges(rank))

    def split(self, x, rank: int, axis: int = 1):
        """Rank ``rank``'s tokens of the full array ``x`` (sequence on ``axis``), a new array."""
        from ...backend import get_array_module
        xp = get_array_module(x)
        parts = [xp.take(x, xp.arange(a, b), axis=axis) for a, b in self.ranges(rank)]
        return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=axis)

    def merge(self, parts, axis: int = 1):
        """The full array from every rank's part (``parts[r]`` as :meth:`split` gave it)."""
        from ...backend import get_array_module
        xp = get_array_module(parts[0])
        out = [None] * (2 * self.size if self.algo is CPAlgo.RING else self.size)
        for r, p in enumerate(parts):
            rs = self.ranges(r)
            n0 = rs[0][1] - rs[0][0]
            if self.algo is CPAlgo.RING:
                out[r] = xp.take(p, xp.arange(0, n0), axis=axis)
                out[2 * self.size - 1 - r] = xp.take(p, xp.arange(n0, p.shape[axis]), axis=axis)
            else:
                out[r] = p
        return xp.concatenate(out, axis=axis)


def local_layout(group, algo, T: int, seq_len: "int | None") -> ContextLayout:
    """The layout of the whole sequence (``seq_len`` tokens, else ``T * group.size``: an even split) whose
    share on this rank of ``group`` is the ``T`` tokens an attention forward received; raises otherwise."""
    P = group.size
    lay = ContextLayout(int(seq_len) if seq_len is not None else T * P, P, algo)
    if lay.local_len(group.rank) != T:
        raise ValueError(f"rank {group.world.rank}: a {lay.seq_len}-token sequence over {P} context ranks "
                         f"({lay.algo.value}) puts {lay.local_len(group.rank)} tokens on context rank "
                         f"{group.rank}, got {T}; split it with ContextLayout.split or pass seq_len")
    return lay
