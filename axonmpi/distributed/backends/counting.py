"""Count the bytes every call moves through the MPI backend, per group and kind, inside a ``with`` block.

The convention of ``bench/_backend_count.py`` and :mod:`axonmpi.plan`: all-reduce, reduce,
reduce-scatter and all-to-all count their send buffer; all-gather(v) and broadcast the whole
buffer; point-to-point counts what is sent (``"send"``) and what is received (``"recv"``) apart.
Object collectives and barriers count calls only.  Used by tests and ``bench/context_parallel.py``.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Iterator

__all__ = ["ByteCounts", "count_bytes"]

_KIND = {"allreduce": "allreduce", "iallreduce": "allreduce", "reduce": "reduce",
         "reduce_scatter": "reduce_scatter", "ireduce_scatter": "reduce_scatter", "alltoallv": "alltoall",
         "allgather": "allgather", "iallgather": "allgather", "allgatherv": "allgather", "broadcast": "broadcast",
         "send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class ByteCounts:
    """``bytes[group name][kind]`` and ``calls[group name][kind]``, filled by :func:`count_bytes`."""

    def __init__(self):
        self.bytes: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, group: str, kind: str, nbytes: int) -> None:
        self.bytes[group][kind] += int(nbytes)
        self.calls[group][kind] += 1

    def total(self, kind: str, group: str = None) -> int:
        """Bytes of ``kind`` (``"send"``, ``"alltoall"``, ...) over ``group`` (default: every group)."""
        names = [group] if group is not None else list(self.bytes)
        return sum(self.bytes[n].get(kind, 0) for n in names)


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounts]:
    """Count the bytes of every backend call made inside the block (this process only).

    Example:
        >>> with count_bytes() as c:
        ...     y = ring_attention(q, k, v, cp)
        >>> c.total("send")
    """
    from . import mpi as M
    counts = ByteCounts()
    depth = [0]
    saved = {}

    def size_of(name, a):
        if name in ("allgather", "iallgather", "allgatherv"):
            return a[1].nbytes
        return a[0].nbytes

    def wrap(name):
        fn = getattr(M.MPIBackend, name)
        saved[name] = fn

        def inner(self, *a, **kw):
            if depth[0] == 0:           # a float16 call re-enters on float32 copies: count the outer call once
                counts.add(self.group.name, _KIND[name], size_of(name, a))
            depth[0] += 1
            try:
                return fn(self, *a, **kw)
            finally:
                depth[0] -= 1
        setattr(M.MPIBackend, name, inner)

    for name in _KIND:
        wrap(name)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(M.MPIBackend, name, fn)
