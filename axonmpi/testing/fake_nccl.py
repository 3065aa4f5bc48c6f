"""A CPU stand-in for ``cupy.cuda.nccl`` over MPI on host arrays, so the NCCL backend runs in CI (tests only).

Importing it registers it with the NCCL backend (``backends.nccl.register_stand_in``; production
code never imports ``axonmpi.testing``). It is used only when asked: ``AXONMPI_FAKE_NCCL=1`` (or
:func:`enabled`, which sets it), and
``axonmpi.init(backend="nccl")`` then routes host (NumPy) arrays through
:class:`~axonmpi.distributed.backends.nccl.NcclBackend` too. Never set it in production:
the stand-in moves host memory over MPI and has none of NCCL's speed.

What it models, and checks:

* ``get_unique_id()`` returns 128 signed chars like NCCL's; they encode the calling process's
  ``MPI.COMM_WORLD`` rank (as NCCL's id encodes the root's address) and a counter.
* ``NcclCommunicator(ndev, uid, rank)`` is collective over the ``ndev`` processes that pass
  the same id: each member reports to the id's root, which hands back the member list, and
  all build an MPI communicator with ``Comm.Create_group`` (collective over members only).
  A wrong rank, a size mismatch or a foreign id raises :class:`NcclError`.
* Collectives take addresses (``a.ctypes.data``) and counts like NCCL and run at once over
  MPI. ``send``/``recv`` must sit between ``groupStart()`` and ``groupEnd()`` (stricter
  than NCCL, to prove the backend groups its point-to-point calls); they post non-blocking
  MPI requests on the stream, completed by the events recorded after them.
* Stream order: a call, or a group's first call, first completes the NCCL work queued earlier
  on its stream (blocking the host: stricter than a GPU), so point-to-point orders that would
  hang a GPU's in-order stream hang the stand-in too.
* ``cuda``: ``Stream``, ``Event``, ``get_current_stream`` with the methods the backend uses.

Example:
    >>> from axonmpi.testing import fake_nccl
    >>> with fake_nccl.enabled():
    ...     world = axonmpi.init(backend="nccl")
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import types
import weakref
from typing import Iterator, List

import numpy as np
from mpi4py import MPI

__all__ = ["available", "NcclError", "NcclCommunicator", "get_unique_id", "get_version",
           "get_build_version", "groupStart", "groupEnd", "cuda", "enabled", "active", "uid_root",
           "NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64",
           "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_SUM", "NCCL_PROD", "NCCL_MAX",
           "NCCL_MIN", "NCCL_AVG"]

available = True

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_DTYPES = {NCCL_INT8: np.dtype(np.int8), NCCL_UINT8: np.dtype(np.uint8), NCCL_INT32: np.dtype(np.int32),
           NCCL_UINT32: np.dtype(np.uint32), NCCL_INT64: np.dtype(np.int64),
           NCCL_UINT64: np.dtype(np.uint64), NCCL_FLOAT16: np.dtype(np.float16),
           NCCL_FLOAT32: np.dtype(np.float32), NCCL_FLOAT64: np.dtype(np.float64)}
_MPI_OPS = {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN,
            NCCL_AVG: MPI.SUM}
_STREAMS: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()  # ptr -> stream
_ERRORS = {3: "internal error", 4: "invalid argument", 5: "invalid usage"}
_MAGIC = b"AXFAKE"
_TAG_BASE = 20000


class NcclError(RuntimeError):
    """Raised like ``cupy.cuda.nccl.NcclError``: ``status`` and the error string of NCCL."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        super().__init__(f"NCCL_ERROR_{_ERRORS.get(status, 'internal error').upper().replace(' ', '_')}: "
                         f"{_ERRORS.get(status, 'internal error')}" + (f" ({detail})" if detail else ""))


def get_version() -> int:
    """The NCCL version the stand-in imitates (2.18.5: ``ncclAvg`` exists)."""
    return 21805


def get_build_version() -> int:
    return get_version()


# -- the fake CUDA runtime: streams hold pending MPI requests, events complete them -----------
class Stream:
    """A stream: the MPI requests posted on it that no event has completed yet."""

    def __init__(self, non_blocking: bool = False, null: bool = False):
        self.pending: List[MPI.Request] = []
        self.ptr = 0 if null else id(self)
        _STREAMS[self.ptr] = self

    def wait_event(self, event: "Event") -> None:
        """Order this stream after ``event`` (on the host: complete its requests)."""
        event.synchronize()

    def synchronize(self) -> None:
        reqs, self.pending = self.pending, []
        MPI.Request.Waitall(reqs)


class Event:
    """Marks the requests pending on a stream when :meth:`record` is called."""

    def __init__(self, disable_timing: bool = False):
        self.reqs: List[MPI.Request] = []

    def record(self, stream: Stream = None) -> None:
        stream = _NULL if stream is None else stream
        stream.pending = [r for r in stream.pending if r != MPI.REQUEST_NULL]
        self.reqs = list(stream.pending)

    @property
    def done(self) -> bool:
        return bool(MPI.Request.Testall(self.reqs))

    def synchronize(self) -> None:
        MPI.Request.Waitall(self.reqs)


_NULL = Stream(null=True)


def get_current_stream() -> Stream:
    return _NULL


cuda = types.SimpleNamespace(Stream=Stream, Event=Event, get_current_stream=get_current_stream)


# -- unique ids and groups ---------------------------------------------------------------------
class _State:
    """Per-process bookkeeping of the stand-in: id counter and group nesting."""

    counter = itertools.count(1)
    depth = 0
    started = False   # the open group has issued its first call (and so waited for its stream)


def get_unique_id() -> tuple:
    """128 signed chars naming this process (its COMM_WORLD rank) as the id's root."""
    raw = bytearray(os.urandom(128))
    raw[:6] = _MAGIC
    raw[6:10] = MPI.COMM_WORLD.Get_rank().to_bytes(4, "little")
    raw[10:14] = (next(_State.counter) % (1 << 31)).to_bytes(4, "little")
    return tuple(b - 256 if b > 127 else b for b in raw)


def uid_root(uid) -> int:
    """The COMM_WORLD rank that created ``uid`` (raises :class:`NcclError` for a foreign id)."""
    raw = bytes(b & 0xFF for b in uid)
    if len(raw) != 128 or raw[:6] != _MAGIC:
        raise NcclError(4, "the unique id was not made by fake_nccl.get_unique_id()")
    return int.from_bytes(raw[6:10], "little")


def _uid_counter(uid) -> int:
    return int.from_bytes(bytes(b & 0xFF for b in uid)[10:14], "little")


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Use the stand-in while the block runs (sets ``AXONMPI_FAKE_NCCL=1``, restores it after).

    Example:
        >>> with fake_nccl.enabled():
        ...     be = NcclBackend(group)          # built on the stand-in
    """
    old = os.environ.get("AXONMPI_FAKE_NCCL")
    os.environ["AXONMPI_FAKE_NCCL"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("AXONMPI_FAKE_NCCL", None)
        else:
            os.environ["AXONMPI_FAKE_NCCL"] = old


def _reset_backends(world) -> None:
    """Drop every group's cached backends (closing NCCL communicators, in the same order everywhere)."""
    groups = [world.default_group, *world._groups, *getattr(world.grid, "_groups", {}).values()]
    for g in groups:
        if g.comm is None:
            continue
        for b in list(g._backends.values()):
            if getattr(b, "name", "") == "nccl":
                b.close()
        g._backends.clear()
        g._host = None


@contextlib.contextmanager
def active(world) -> Iterator:
    """Serve ``world``'s groups with the NCCL backend on the stand-in while the block runs.

    Like ``axonmpi.init(backend="nccl")`` with ``AXONMPI_FAKE_NCCL=1`` on an existing World
    (the test suite's session World): host arrays go through
    :class:`~axonmpi.distributed.backends.nccl.NcclBackend`; after the block the groups'
    communicators are destroyed and the World's backend choice restored. Collective: every
    rank enters and leaves it together.

    Example:
        >>> with fake_nccl.active(world):
        ...     axonmpi.all_reduce(np.ones(3))       # NcclBackend -> fake_nccl -> MPI
    """
    from ..distributed.backends.nccl import BackendKind
    old = world.backend
    with enabled():
        _reset_backends(world)
        world.backend = BackendKind.NCCL
        try:
            yield world
        finally:
            _reset_backends(world)
            world.backend = old


def groupStart() -> None:  # noqa: N802 - cupy's names
    if _State.depth == 0:
        _State.started = False
    _State.depth += 1


def _in_order(stream) -> None:
    """Kernels on a stream start in order: before a call (or a group's first call) runs, the
    stream's earlier NCCL work completes. On the host this blocks, which is stricter than a GPU;
    so a receive queued ahead of a send its peer needs first hangs here as it would on a GPU."""
    if _State.depth and _State.started:
        return
    _State.started = bool(_State.depth)
    st = _STREAMS.get(stream) if stream else _NULL
    if st is not None:
        st.synchronize()


def groupEnd() -> None:  # noqa: N802
    if _State.depth == 0:
        raise NcclError(5, "groupEnd() without groupStart()")
    _State.depth -= 1


def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
    dt = _DTYPES.get(datatype)
    if dt is None:
        raise NcclError(4, f"unknown datatype {datatype}")
    if count == 0:
        return np.empty(0, dt)
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dt)


class NcclCommunicator:
    """``ncclCommInitRank`` over MPI: collective over the ``ndev`` processes holding ``commId``."""

    def __init__(self, ndev: int, commId: tuple, rank: int):  # noqa: N803 - cupy's names
        if not 0 <= rank < ndev:
            raise NcclError(4, f"rank {rank} out of range for {ndev} ranks")
        world = MPI.COMM_WORLD
        root, me = uid_root(commId), world.Get_rank()
        tag = _TAG_BASE + _uid_counter(commId) % 4096
        if rank == 0:
            if root != me:
                raise NcclError(4, f"rank 0 of the id must be its creator (world rank {root}), got world rank {me}")
            members = [me] + [None] * (ndev - 1)
            for _ in range(ndev - 1):
                uid, r, w = world.recv(source=MPI.ANY_SOURCE, tag=tag)
                if tuple(uid) != tuple(commId) or not 0 < r < ndev or members[r] is not None:
                    raise NcclError(4, f"world rank {w} joined with rank {r} or another id")
                members[r] = w
            for w in members[1:]:
                world.send(members, dest=w, tag=tag)
        else:
            world.send((tuple(commId), rank, me), dest=root, tag=tag)
            members = world.recv(source=root, tag=tag)
        self.world_ranks = tuple(members)
        self._comm = world.Create_group(world.Get_group().Incl(members), tag)
        self._rank, self._size = rank, ndev

    # -- cupy's NcclCommunicator methods ------------------------------------------------------
    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def device_id(self) -> int:
        return -1

    def destroy(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def abort(self) -> None:
        self.destroy()

    def _reduce_args(self, send, recv, count, datatype, op):
        s, r = _view(send, count, datatype), _view(recv, count, datatype)
        if op not in _MPI_OPS:
            raise NcclError(4, f"unknown reduction op {op}")
        return s, r, _MPI_OPS[op]

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        _in_order(stream)
        s, r, mop = self._reduce_args(sendbuf, recvbuf, count, datatype, op)
        self._reduce(s, r, mop, op, None, sendbuf == recvbuf)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        _in_order(stream)
        s, r, mop = self._reduce_args(sendbuf, recvbuf, count, datatype, op)
        self._reduce(s, r, mop, op, root, sendbuf == recvbuf)

    def _reduce(self, s, r, mop, op, root, in_place):
        s32 = s.astype(np.float32) if s.dtype == np.float16 else s   # reduce half in float32
        r32 = np.empty_like(s32) if s32 is not s else r
        mine = root is None or root == self._rank
        if root is None:
            self._comm.Allreduce(MPI.IN_PLACE if (in_place and s32 is s) else s32, r32, mop)
        elif mine and in_place and s32 is s:
            self._comm.Reduce(MPI.IN_PLACE, r32, mop, root=root)
        else:
            self._comm.Reduce(s32, r32 if mine else None, mop, root=root)
        if mine:
            if op == NCCL_AVG:
                r32 = r32 / self._size if r32.dtype.kind == "f" else r32 // self._size
            if r32 is not r:
                r[...] = r32

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        _in_order(stream)
        r = _view(recvbuff, count, datatype)
        if self._rank == root and sendbuff != recvbuff:
            r[...] = _view(sendbuff, count, datatype)
        self._comm.Bcast(r, root=root)

    def bcast(self, buff, count, datatype, root, stream):
        _in_order(stream)
        self._comm.Bcast(_view(buff, count, datatype), root=root)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        _in_order(stream)
        s = _view(sendbuf, recvcount * self._size, datatype)
        r = _view(recvbuf, recvcount, datatype)
        if op not in _MPI_OPS:
            raise NcclError(4, f"unknown reduction op {op}")
        s32 = s.astype(np.float32) if s.dtype == np.float16 else s
        r32 = np.empty(recvcount, s32.dtype)
        self._comm.Reduce_scatter_block(s32, r32, _MPI_OPS[op])
        if op == NCCL_AVG:
            r32 = r32 / self._size if r32.dtype.kind == "f" else r32 // self._size
        r[...] = r32

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        _in_order(stream)
        self._comm.Allgather(_view(sendbuf, count, datatype), _view(recvbuf, count * self._size, datatype))

    def _p2p(self, what, peer, stream):
        if _State.depth == 0:
            raise NcclError(5, f"{what} outside groupStart()/groupEnd() (the stand-in requires grouped point-to-point)")
        if not 0 <= peer < self._size:
            raise NcclError(4, f"{what} peer {peer} out of range for {self._size} ranks")
        st = _STREAMS.get(stream) if stream else _NULL
        if st is None:
            raise NcclError(4, f"{what} on unknown stream {stream:#x}")
        _in_order(stream)
        return st

    def send(self, sendbuf, count, datatype, peer, stream):
        st = self._p2p("send", peer, stream)
        st.pending.append(self._comm.Isend(_view(sendbuf, count, datatype), dest=peer, tag=0))

    def recv(self, recvbuf, count, datatype, peer, stream):
        st = self._p2p("recv", peer, stream)
        st.pending.append(self._comm.Irecv(_view(recvbuf, count, datatype), source=peer, tag=0))


def _register() -> None:
    """Register this module as the NCCL backend's stand-in (what ``AXONMPI_FAKE_NCCL=1`` selects)."""
    import sys
    from ..distributed.backends.nccl import register_stand_in
    register_stand_in(sys.modules[__name__])


_register()
