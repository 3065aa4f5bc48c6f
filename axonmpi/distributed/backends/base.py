"""The backend contract under the collectives: how one group's members move contiguous buffers.

[Note: the Backend contract]
:mod:`axonmpi.distributed.collectives` validates arguments, makes buffers contiguous and 1-D,
splits uneven sizes into counts, stages device arrays through the host for a ``host_only``
backend and wraps requests in :class:`~axonmpi.distributed.work.Work`. A backend only moves
buffers among the members of its one :class:`ProcessGroup`. Every method is called by every
member of the group in the same order (point-to-point methods excepted), exactly as MPI
requires; ranks (``root``, ``dst``, ``src``, ``peer``) are group ranks.

Buffers
    1-D, C-contiguous NumPy arrays (or CuPy arrays when ``host_only`` is False), one dtype per
    call. ``counts`` are in elements, never bytes, and list one entry per group rank in
    group-rank order; displacements are their running sums (pieces lie back to back). A
    backend moves every dtype the collectives accept (the numeric kinds ``biufc``), including
    float16 where its library has no half type (the MPI backend then moves 16-bit words and
    reduces in float32 — one place, :class:`~axonmpi.distributed.backends.mpi.MPIBackend`).

In place
    ``send is recv`` means in place (``MPI_IN_PLACE``): the result overwrites the input.
    Only the reductions (:meth:`allreduce`, :meth:`iallreduce`, :meth:`reduce` on the root)
    accept it; the gathers and scatters always get distinct buffers.

Reductions
    ``op`` is a :class:`~axonmpi.distributed.reduce_op.ReduceOp`; the collectives have already
    checked it against the dtype on every rank. ``MEAN`` leaves the sum divided by the group
    size in ``recv`` (the MPI backend sums, then divides; the planned NCCL backend may use
    ``ncclAvg``).

Non-blocking calls
    ``i*`` methods and :meth:`batch_isend_irecv` start the operation and return a *request*:
    any object with ``Wait()`` (block until the buffers may be used: the result is in
    ``recv``, and ``send`` may be reused) and ``Test()`` (True once ``Wait()`` would not
    block; it drives progress). mpi4py's ``MPI.Request`` is one; a device backend may return
    an event-based one whose ``Wait()`` orders the caller's current stream after the
    operation instead of blocking the host. Every request a backend returns is waited on (the
    :class:`Work` wrapping it is waited on, or the job ends): a started non-blocking
    collective must never be dropped (``MPI_Request_free`` is not allowed for it).

Buffer lifetime
    A buffer handed to a non-blocking call stays alive and unmodified until its request
    completes: the caller keeps references (``Work`` holds them) and does not write the send
    buffer or read the receive buffer before then.

Device buffers and streams
    When ``host_only`` is False, buffers may be device arrays with kernels still queued on
    the caller's current CUDA stream. The backend orders its access after them (the
    CUDA-aware MPI backend synchronizes the current stream before handing a pointer to MPI;
    the planned NCCL backend makes its per-group communication stream wait on an event) and
    a completed request means the data is usable by work queued afterwards on that stream.

Point-to-point matching
    Messages between a pair of ranks are received in the order they were sent. The MPI
    backend additionally matches by ``tag``; the planned NCCL backend ignores tags, as
    PyTorch's does, so portable code posts the operations of a pair in the same order on both
    sides.

Objects
    ``*_object`` methods move picklable Python objects (small metadata: shapes, counts,
    signatures) over host memory; a device-only backend delegates them to the group's MPI
    communicator.
"""
from __future__ import annotations

import abc
from typing import Any, List, NamedTuple, Optional, Sequence

__all__ = ["Backend", "P2PBuffer"]


class P2PBuffer(NamedTuple):
    """One point-to-point operation of a batch, as a backend sees it.

    Attributes:
        is_send: True to send ``buf`` to ``peer``, False to receive into it from ``peer``.
        buf: a 1-D contiguous array (the whole array is sent, or filled).
        peer: a group rank; may be this rank itself (a batch pairs it with its own receive).
        tag: message tag (matched by the MPI backend; ignored by the planned NCCL backend).
    """

    is_send: bool
    buf: Any
    peer: int
    tag: int = 0


class Backend(abc.ABC):
    """Moves contiguous 1-D buffers among the members of one :class:`ProcessGroup`.

    The rules every method follows (buffers, counts, in place, non-blocking requests, buffer
    lifetime, device streams) are in this module's ``[Note: the Backend contract]``. The MPI
    backend (:class:`~axonmpi.distributed.backends.mpi.MPIBackend`) implements it; an NCCL
    backend for CuPy arrays is planned.

    Attributes:
        group: the :class:`ProcessGroup` served.
        name: short name (``"mpi"``).
        host_only: True when the backend moves only host (NumPy) memory; the collectives then
            stage device arrays through the host.

    Example:
        >>> be = MPIBackend(world.default_group)
        >>> recv = np.empty(4)
        >>> be.allreduce(np.ones(4), recv, ReduceOp.SUM)      # recv == world_size everywhere
    """

    name = "abstract"
    host_only = True

    def __init__(self, group) -> None:
        self.group = group

    # -- reductions -------------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce(self, send: Any, recv: Any, op) -> None:
        """Reduce ``send`` (``send.size`` elements) over the group into ``recv`` on every rank.

        ``send is recv`` reduces in place. ``recv`` has ``send``'s size and dtype.
        """

    @abc.abstractmethod
    def iallreduce(self, send: Any, recv: Any, op) -> Any:
        """Start :meth:`allreduce`; return a request (``Wait()``/``Test()``)."""

    @abc.abstractmethod
    def reduce(self, send: Any, recv: Any, op, root: int) -> None:
        """Reduce ``send`` over the group into ``recv`` on group rank ``root``.

        ``recv`` is ignored (may be ``None``) on other ranks; on ``root`` ``send is recv``
        reduces in place.
        """

    @abc.abstractmethod
    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op) -> None:
        """Reduce ``send`` (``sum(counts)`` elements) and give rank ``i`` the ``i``-th piece.

        Piece ``i`` is ``counts[i]`` elements starting at ``sum(counts[:i])``; ``recv`` holds
        ``counts[rank]`` elements. Uneven ``counts`` are allowed; ``counts=None`` means equal
        pieces of ``recv.size`` elements (the common case, and NCCL's native one).
        """

    @abc.abstractmethod
    def ireduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op) -> Any:
        """Start :meth:`reduce_scatter`; return a request."""

    # -- data movement ------------------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, buf: Any, root: int) -> None:
        """Copy ``buf`` of group rank ``root`` into ``buf`` on every rank (same size everywhere)."""

    @abc.abstractmethod
    def allgather(self, send: Any, recv: Any) -> None:
        """Concatenate every rank's ``send`` (same size ``c`` everywhere) into ``recv``.

        ``recv`` holds ``size * c`` elements; rank ``i``'s piece starts at ``i * c``.
        """

    @abc.abstractmethod
    def iallgather(self, send: Any, recv: Any) -> Any:
        """Start :meth:`allgather`; return a request."""

    @abc.abstractmethod
    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[i]`` elements on rank ``i``) into ``recv``."""

    @abc.abstractmethod
    def gatherv(self, send: Any, recv: Any, counts: Sequence[int], root: int) -> None:
        """Concatenate every rank's ``send`` into ``recv`` on ``root`` (``counts`` as allgatherv).

        ``recv`` and ``counts`` matter on ``root`` only (``None`` allowed elsewhere).
        """

    @abc.abstractmethod
    def scatterv(self, send: Any, counts: Sequence[int], recv: Any, root: int) -> None:
        """Give rank ``i`` the ``i``-th piece (``counts[i]`` elements) of ``send`` on ``root``.

        ``send`` matters on ``root`` only; ``counts`` is known on every rank; ``recv`` holds
        ``counts[rank]`` elements.
        """

    @abc.abstractmethod
    def alltoallv(self, send: Any, scounts: Sequence[int], recv: Any, rcounts: Sequence[int]) -> None:
        """Send piece ``j`` of ``send`` (``scounts[j]`` elements) to rank ``j``; receive rank
        ``j``'s piece for this rank (``rcounts[j]`` elements) into piece ``j`` of ``recv``."""

    # -- point-to-point -------------------------------------------------------------------------
    @abc.abstractmethod
    def send(self, buf: Any, dst: int, tag: int) -> None:
        """Send all of ``buf`` to group rank ``dst`` (blocking until ``buf`` may be reused)."""

    @abc.abstractmethod
    def recv(self, buf: Any, src: int, tag: int) -> None:
        """Receive from group rank ``src`` into ``buf`` (a message of exactly ``buf.size`` elements)."""

    @abc.abstractmethod
    def isend(self, buf: Any, dst: int, tag: int) -> Any:
        """Start :meth:`send`; return a request."""

    @abc.abstractmethod
    def irecv(self, buf: Any, src: int, tag: int) -> Any:
        """Start :meth:`recv`; return a request."""

    @abc.abstractmethod
    def batch_isend_irecv(self, ops: Sequence[P2PBuffer]) -> List[Any]:
        """Start every operation of ``ops`` together; return one request per op, in order.

        The batch never deadlocks on the order of its operations: sends and receives may be
        listed in any order, including both ends of a message to this rank itself, as long as
        each peer posts the matching operations (in a batch or as single calls). The MPI
        backend posts all receives, then all sends, non-blocking (``Startall`` semantics); the
        planned NCCL backend wraps them in ``groupStart()``/``groupEnd()``.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has called it."""

    # -- picklable objects (host) ---------------------------------------------------------------
    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return ``root``'s ``obj`` on every rank."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> List[Any]:
        """Return every rank's ``obj`` in group-rank order, on every rank."""

    @abc.abstractmethod
    def gather_object(self, obj: Any, root: int) -> Optional[List[Any]]:
        """Return every rank's ``obj`` on ``root`` (``None`` elsewhere)."""

    @abc.abstractmethod
    def alltoall_object(self, objs: Sequence[Any]) -> List[Any]:
        """Send ``objs[j]`` to rank ``j``; return the objects received, one per source rank."""

    def close(self) -> None:
        """Release backend resources (called when the group is freed)."""
