"""The backend interface under the collectives: moves contiguous buffers within one group."""
from __future__ import annotations

import abc
from typing import Any, Sequence

__all__ = ["Backend"]


class Backend(abc.ABC):
    """Moves contiguous 1-D buffers among the members of one :class:`ProcessGroup`.

    The collectives in :mod:`axonmpi.distributed.collectives` validate arguments, make
    buffers contiguous, split uneven sizes and stage device arrays; a backend only moves
    bytes. ``send is recv`` means in place. Counts are in elements. Non-blocking methods
    return an object with ``Wait()`` and ``Test()`` (an MPI request, or an equivalent), or
    ``None`` when the operation already completed.

    Attributes:
        name: short name (``"mpi"``, ``"nccl"``).
        host_only: True when the backend can only move host (NumPy) memory; the collectives
            then stage device arrays through the host.
    """

    name = "abstract"
    host_only = True

    def __init__(self, group) -> None:
        self.group = group

    @abc.abstractmethod
    def allreduce(self, send: Any, recv: Any, op) -> None: ...

    @abc.abstractmethod
    def iallreduce(self, send: Any, recv: Any, op) -> Any: ...

    @abc.abstractmethod
    def broadcast(self, buf: Any, root: int) -> None: ...

    @abc.abstractmethod
    def allgather(self, send: Any, recv: Any) -> None: ...

    @abc.abstractmethod
    def iallgather(self, send: Any, recv: Any) -> Any: ...

    @abc.abstractmethod
    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op) -> None: ...

    @abc.abstractmethod
    def ireduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op) -> Any: ...

    @abc.abstractmethod
    def reduce(self, send: Any, recv: Any, op, root: int) -> None: ...

    @abc.abstractmethod
    def gatherv(self, send: Any, recv: Any, counts: Sequence[int], root: int) -> None: ...

    @abc.abstractmethod
    def scatterv(self, send: Any, counts: Sequence[int], recv: Any, root: int) -> None: ...

    @abc.abstractmethod
    def alltoallv(self, send: Any, scounts: Sequence[int], recv: Any, rcounts: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def send(self, buf: Any, dst: int, tag: int) -> None: ...

    @abc.abstractmethod
    def recv(self, buf: Any, src: int, tag: int) -> None: ...

    @abc.abstractmethod
    def isend(self, buf: Any, dst: int, tag: int) -> Any: ...

    @abc.abstractmethod
    def irecv(self, buf: Any, src: int, tag: int) -> Any: ...

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:
        """Release backend resources (called when the group is freed)."""
