"""Block checksums of checkpoint pieces: ``xxh3_64`` (xxhash) now, ``axonmpi.pagesum64`` for old checkpoints.

A piece (one stored block of an entry) is checksummed in blocks of whole rows along its axis 0,
at most :data:`BLOCK_BYTES` bytes each, so a rank reading a slice verifies only the blocks it
reads. The index records the algorithm (root attribute ``checksum_algorithm``); readers pick
the function by that name, so checkpoints written with the old ``axonmpi.pagesum64`` still load.

What ``xxh3_64`` detects: it is a 64-bit hash of the exact byte sequence (length included), so
any change of the bytes — flipped bits (any number, including flips that cancel in a sum),
reordered words, rows or pages, zeroed pages, truncation or extension — gives another value
except with probability about 2**-64 per block. It is not a cryptographic MAC: it guards
against storage and transfer faults, not against someone forging a checkpoint.
"""
from __future__ import annotations

import math
import struct
import zlib
from typing import Callable, Dict, List, Sequence

import numpy as np
import xxhash

__all__ = [
    "BLOCK_BYTES", "CHECKSUM_ALGORITHM", "LEGACY_ALGORITHM", "ALGORITHMS", "checksum_function",
    "xxh3_64", "pagesum64", "block_rows", "nblocks", "block_checksums",
]

BLOCK_BYTES = 4 << 20  # checksum granularity (and the smallest unit a sliced read fetches)
CHECKSUM_ALGORITHM = "xxh3_64"           # what save writes (index format version 2)
LEGACY_ALGORITHM = "axonmpi.pagesum64"   # format version 1: read only


def xxh3_64(u: np.ndarray) -> int:
    """XXH3 64-bit hash (seed 0) of the bytes of the contiguous array ``u``, as an int.

    Example:
        >>> xxh3_64(np.zeros(8, np.uint8)) != xxh3_64(np.zeros(9, np.uint8))
        True
    """
    return xxhash.xxh3_64_intdigest(u)


_PAGE_WORDS = 512  # 4 KiB pages of 64-bit words
_WEIGHTS = np.arange(1, 1 << 14, dtype=np.uint64)
_MASK64 = (1 << 64) - 1


def pagesum64(u: np.ndarray) -> int:
    """The format-1 checksum ``axonmpi.pagesum64`` (kept only to verify old checkpoints).

    Little-endian 64-bit words in 4 KiB pages; ``s1`` = sum of all words, ``s2`` = sum of the
    page sums weighted by page number (mod 2**64), folded with the length and the trailing
    bytes by CRC-32. It misses reorderings inside a page, flips that cancel in a sum and
    swapped pages of equal sum — which is why format 2 replaced it with :func:`xxh3_64`.
    """
    u = u.reshape(-1).view(np.uint8)
    n = u.nbytes
    nw = n // 8
    w = u[: nw * 8].view("<u8")
    k = nw // _PAGE_WORDS
    s1 = s2 = 0
    if k:
        pages = w[: k * _PAGE_WORDS].reshape(k, _PAGE_WORDS).sum(axis=1, dtype=np.uint64)
        s1 = int(pages.sum(dtype=np.uint64))
        wts = _WEIGHTS[:k] if k <= _WEIGHTS.size else np.arange(1, k + 1, dtype=np.uint64)
        s2 = int((pages * wts).sum(dtype=np.uint64))
    s1 = (s1 + int(w[k * _PAGE_WORDS:].sum(dtype=np.uint64))) & _MASK64
    return zlib.crc32(struct.pack("<QQQ", n, s1, s2) + u[nw * 8:].tobytes())


ALGORITHMS: Dict[str, Callable[[np.ndarray], int]] = {CHECKSUM_ALGORITHM: xxh3_64, LEGACY_ALGORITHM: pagesum64}


def checksum_function(name: str) -> Callable[[np.ndarray], int]:
    """The checksum function recorded as ``name`` in an index (ValueError naming the known ones)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {name!r}; this axonmpi knows {sorted(ALGORITHMS)}") from None


def block_rows(shape: Sequence[int], itemsize: int) -> int:
    """Rows (along axis 0) per checksum block of a piece of ``shape``."""
    if len(shape) == 0:
        return 1
    row = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    return max(1, BLOCK_BYTES // max(row, 1))


def nblocks(shape: Sequence[int], brows: int) -> int:
    """Number of checksum blocks of a piece of ``shape`` with ``brows`` rows per block."""
    if len(shape) == 0:
        return 1
    return max(1, math.ceil(shape[0] / brows))


def block_checksums(a: np.ndarray, brows: int, fn: Callable[[np.ndarray], int] = xxh3_64) -> List[int]:
    """``fn`` of each block of ``brows`` rows of the C-contiguous array ``a`` (one value for 0-d).

    Example:
        >>> len(block_checksums(np.zeros((10, 3)), 4))
        3
    """
    u = a.reshape(-1).view(np.uint8)
    if a.ndim == 0:
        return [fn(u)]
    step = brows * (u.nbytes // a.shape[0] if a.shape[0] else 0)
    return [fn(u[i * step:(i + 1) * step]) for i in range(nblocks(a.shape, brows))]
