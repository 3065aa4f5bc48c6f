"""Count what the MPI backend moves: bytes and calls per group, method and dtype, inside a ``with`` block.

What one call counts (the convention of ``bench/_backend_count.py`` and :mod:`axonmpi.plan`):
all-reduce, reduce, reduce-scatter and all-to-all(v): the send buffer; all-gather(v) and
broadcast: the whole (gathered) buffer; point-to-point: every buffer sent or received. Object
collectives and barriers count calls only. ``all_to_all_v`` never hands a rank's own piece to the
backend, so for it the count is exactly the bytes that leave the rank. ``batch_isend_irecv`` is
counted op by op, as ``isend`` and ``irecv``.

Two views of one counter: :func:`count_traffic` (bytes and calls by group, method, dtype; MoE's
tests and ``bench/moe.py``) and :func:`count_bytes` (the same, read by kind: ``total("send")``,
``total("alltoall")``; context parallelism's tests and ``bench/context_parallel.py``).
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Dict, Iterator, Tuple

__all__ = ["TrafficCounter", "count_traffic", "count_bytes", "ByteCounts"]

_SEND = ("allreduce", "iallreduce", "reduce", "reduce_scatter", "ireduce_scatter", "alltoallv")
_WHOLE = ("allgather", "iallgather", "allgatherv")
_BUF = ("broadcast", "send", "recv", "isend", "irecv")
_NONE = ("barrier", "broadcast_object", "allgather_object", "gather_object", "alltoall_object")
_LOCK = threading.Lock()
# kinds read by TrafficCounter.total: a kind is the blocking method and its non-blocking twin
_KINDS = {"allreduce": ("allreduce", "iallreduce"), "reduce": ("reduce",),
          "reduce_scatter": ("reduce_scatter", "ireduce_scatter"), "alltoall": ("alltoallv",),
          "allgather": ("allgather", "iallgather", "allgatherv"), "broadcast": ("broadcast",),
          "send": ("send", "isend"), "recv": ("recv", "irecv")}


class TrafficCounter:
    """Bytes and calls per ``(group name, method, dtype)`` (dtype ``""`` for object calls).

    Example:
        >>> with count_traffic() as c:
        ...     loss.backward()
        >>> c.bytes(group="expert_group", method="alltoallv", dtype="float64")
    """

    def __init__(self) -> None:
        self.table: Dict[Tuple[str, str, str], list] = defaultdict(lambda: [0, 0])

    def add(self, group: str, method: str, dtype: str, nbytes: int) -> None:
        """Record one call."""
        e = self.table[(group, method, dtype)]
        e[0] += int(nbytes)
        e[1] += 1

    def bytes(self, group: str = None, method: str = None, dtype: str = None) -> int:
        """Bytes of the calls matching every given field."""
        return sum(v[0] for k, v in self.table.items() if _match(k, group, method, dtype))

    def calls(self, group: str = None, method: str = None, dtype: str = None) -> int:
        """Number of calls matching every given field."""
        return sum(v[1] for k, v in self.table.items() if _match(k, group, method, dtype))

    def total(self, kind: str, group: str = None) -> int:
        """Bytes of one kind of call (``"send"``, ``"recv"``, ``"alltoall"``, ``"allreduce"``, ...;
        a blocking method and its non-blocking twin count together), over ``group`` or every group."""
        if kind not in _KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_KINDS)}")
        return sum(self.bytes(group=group, method=m) for m in _KINDS[kind])

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.table.clear()


def _match(key, group, method, dtype) -> bool:
    return all(w is None or w == k for k, w in zip(key, (group, method, dtype)))


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficCounter]:
    """Wrap :class:`~axonmpi.distributed.backends.mpi.MPIBackend`'s methods for the block; yield the counter.

    Not reentrant (one counter at a time per process). A float16 call that re-enters on float32
    copies is counted once.
    """
    from . import mpi as M
    counter = TrafficCounter()
    saved = {}
    depth = [0]

    def wrap(name, size_of):
        fn = getattr(M.MPIBackend, name)
        saved[name] = fn

        def inner(self, *a, **kw):
            if depth[0] == 0:
                for method, nbytes, dtype in size_of(name, *a):
                    counter.add(getattr(self.group, "name", "?"), method, dtype, nbytes)
            depth[0] += 1
            try:
                return fn(self, *a, **kw)
            finally:
                depth[0] -= 1
        setattr(M.MPIBackend, name, inner)

    with _LOCK:
        if getattr(M.MPIBackend, "_axonmpi_counting", False):
            raise RuntimeError("count_traffic is already active in this process (it is not reentrant)")
        M.MPIBackend._axonmpi_counting = True
        try:
            for n in _SEND:
                wrap(n, lambda m, send, *a: [(m, send.nbytes, str(send.dtype))])
            for n in _WHOLE:
                wrap(n, lambda m, send, recv, *a: [(m, recv.nbytes, str(recv.dtype))])
            for n in _BUF:
                wrap(n, lambda m, buf, *a: [(m, buf.nbytes, str(buf.dtype))])
            wrap("batch_isend_irecv", lambda m, ops: [("isend" if o.is_send else "irecv", o.buf.nbytes,
                                                       str(o.buf.dtype)) for o in ops])
            for n in _NONE:
                wrap(n, lambda m, *a: [(m, 0, "")])
            yield counter
        finally:
            for n, fn in saved.items():
                setattr(M.MPIBackend, n, fn)
            M.MPIBackend._axonmpi_counting = False


count_bytes = count_traffic        # the same counter, read by kind: ``c.total("send")``
ByteCounts = TrafficCounter
