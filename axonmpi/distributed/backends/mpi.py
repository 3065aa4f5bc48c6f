"""MPI backend: the Backend contract on an mpi4py communicator (host buffers, or device buffers if CUDA-aware)."""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Sequence

import numpy as np
from mpi4py import MPI

from ... import backend as _be
from ... import env as _env
from ..reduce_op import ReduceOp, mpi_op
from .base import Backend, P2PBuffer

__all__ = ["MPIBackend", "CudaAwareMPIBackend", "cuda_aware_mpi", "query_cuda_support", "mpi_has_float16"]

_IN_PLACE = MPI.IN_PLACE
_MEAN = ReduceOp.MEAN
_HALF = np.dtype(np.float16)
# dtype chars mpi4py maps to an MPI type every MPI library has (float16, 'e', is probed)
_NATIVE = frozenset("?bBhHiIlLqQfdgFDG")
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def cuda_aware_mpi() -> bool:
    """True when CuPy buffers may go to MPI directly (no staging through host memory).

    ``AXONMPI_CUDA_AWARE=1/0`` decides (its older name ``AXONMPI_CUDA_AWARE_MPI`` is used when
    it is unset); left at ``auto``, the MPI library is asked (:func:`query_cuda_support`), and
    an MPI that cannot say counts as not CUDA-aware. Without it CuPy arrays are staged through
    host memory (correct everywhere, slower, and blocking: ``async_op=True`` on a CuPy array
    then completes before it returns).
    """
    v = _env.get_tribool("AXONMPI_CUDA_AWARE")
    if v is None:
        v = _env.get_tribool("AXONMPI_CUDA_AWARE_MPI")
    if v is None:
        v = query_cuda_support()
    return bool(v)


@functools.lru_cache(maxsize=None)
def query_cuda_support():
    """What the MPI library says about CUDA support: True, False, or None when it cannot say.

    Asks mpi4py's ``MPI.Query_cuda_support()`` where it exists, else the library's
    ``MPIX_Query_cuda_support()`` (Open MPI, MPICH) through ctypes. Asked once per process.
    """
    q = getattr(MPI, "Query_cuda_support", None)
    if q is not None:
        try:
            return bool(q())
        except Exception:
            return None
    try:
        import ctypes
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    try:
        return bool(fn())
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _probe_float16() -> bool:
    try:
        a = np.ones(1, np.float16)
        b = np.zeros(1, np.float16)
        MPI.COMM_SELF.Allreduce(a, b, MPI.SUM)
        return bool(b[0] == 1)
    except Exception:
        return False


def mpi_has_float16() -> bool:
    """True when the MPI library reduces float16 natively.

    Probed once. ``AXONMPI_MPI_FLOAT16=0`` forces the fallback used where the library has no
    half type (float16 moved as 16-bit words, reduced in float32), e.g. to test that path.
    """
    if not _env.get_bool("AXONMPI_MPI_FLOAT16"):
        return False
    return _probe_float16()


def _displs(counts):
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _wire(a):
    """``a`` as MPI can move it, element for element (counts unchanged).

    float16 without an MPI half type, and dtypes MPI has no type for, travel as unsigned words
    of the same item size. Only data movement uses this; reductions need the real type.
    """
    if a is None:
        return a
    t = a.dtype
    if t.char in _NATIVE or (t is _HALF or t == _HALF) and mpi_has_float16():
        return a
    word = _WORDS.get(t.itemsize)
    if word is None:
        raise TypeError(f"cannot move dtype {t} over MPI (item size {t.itemsize} bytes; expected 1, 2, 4 or 8)")
    return a.view(word)


def _inner(op):
    """The op to run on float32 copies: MEAN is summed there and scaled when cast back."""
    return ReduceOp.SUM if op is _MEAN else op


def _scale(buf, size):
    """``buf /= size`` in place (MEAN after a SUM), with the array's own module."""
    if type(buf) is np.ndarray:
        np.true_divide(buf, size, out=buf)
    else:
        buf /= size


class _Then:
    """A request that runs ``fn`` once after ``req`` completes (MEAN scaling, float16 cast back).

    Keeps ``keep`` (temporary buffers) alive until then.
    """

    __slots__ = ("req", "fn", "keep")

    def __init__(self, req, fn: Callable[[], None], keep: Any = None):
        self.req, self.fn, self.keep = req, fn, keep

    def _done(self):
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
        self.keep = None

    def Wait(self):  # noqa: N802 - mpi4py's request protocol
        self.req.Wait()
        self._done()

    def Test(self) -> bool:  # noqa: N802
        if self.fn is None:
            return True
        if self.req.Test():
            self._done()
            return True
        return False


def _watched(group):
    """The group's communicator as the backend uses it: through the World's watchdog (deadlines,
    flight recorder; one :class:`~axonmpi.distributed.watchdog.WatchedComm` per group) unless
    both are off."""
    wd = getattr(group.world, "watchdog", None)
    if wd is None:
        return group.comm
    if group._watched is None:
        group._watched = wd.watched(group)
    return group._watched


class MPIBackend(Backend):
    """The Backend contract over ``group.comm`` with mpi4py's buffer (upper-case) methods.

    Moves host (NumPy) buffers; :class:`CudaAwareMPIBackend` also takes CuPy arrays.

    float16 is handled here, once: where the MPI library has no half type
    (:func:`mpi_has_float16` is False) it is moved as 16-bit words and reduced in float32.
    """

    name = "mpi"

    def __init__(self, group) -> None:
        super().__init__(group)
        self.comm = _watched(group)
        self.rank = group.rank
        self.size = group.size
        self._ops = {}  # (ReduceOp value, dtype.num) -> MPI.Op, for pairs that reduce natively

    # -- helpers -----------------------------------------------------------------------------
    def _mop(self, op, dtype):
        """The MPI.Op for ``op`` on ``dtype``, or None to reduce in float32: bfloat16 (no MPI type),
        float16 MEAN (a float16 SUM of two 65504s is inf before the division) and float16
        without an MPI half type."""
        mop = self._ops.get((op._value_, dtype.num))
        if mop is None:
            if dtype.name == "bfloat16" or (dtype == _HALF and op is _MEAN):
                return None
            mop = mpi_op(op, dtype, self.rank)
            if dtype == _HALF and not mpi_has_float16():
                return None
            if dtype != _HALF:  # float16 is looked up each time: the fallback switch may change
                self._ops[(op._value_, dtype.num)] = mop
        return mop

    def _in_float32(self, send, recv, start, op):
        """Reduce float16 in float32 (no MPI half type): ``start(send32, recv32)`` runs the MPI
        call and returns a request or None; the result is cast back into ``recv``."""
        in_place = send is recv
        send32 = send.astype(np.float32)
        recv32 = send32 if in_place else (None if recv is None else send32.copy())

        def back():
            if recv is not None:
                if op is _MEAN:
                    _scale(recv32, self.size)
                recv[...] = recv32

        req = start(send32, recv32)
        if req is None:
            back()
            return None
        return _Then(req, back, keep=(send32, recv32))

    # -- reductions --------------------------------------------------------------------------
    def allreduce(self, send, recv, op):
        mop = self._ops.get((op._value_, recv.dtype.num))
        if mop is None:
            mop = self._mop(op, recv.dtype)
        if mop is None:  # the nested call on the float32 copies synchronizes
            self._in_float32(send, recv, lambda s, r: self.allreduce(s, r, _inner(op)), op)
            return
        self.comm.Allreduce(_IN_PLACE if send is recv else send, recv, mop)
        if op is _MEAN:
            _scale(recv, self.size)

    def iallreduce(self, send, recv, op):
        mop = self._mop(op, recv.dtype)
        if mop is None:
            return self._in_float32(send, recv, lambda s, r: self.iallreduce(s, r, _inner(op)), op)
        req = self.comm.Iallreduce(_IN_PLACE if send is recv else send, recv, mop)
        if op is _MEAN:
            return _Then(req, lambda: _scale(recv, self.size))
        return req

    def reduce(self, send, recv, op, root):
        mop = self._mop(op, send.dtype)
        mine = self.rank == root
        if mop is None:
            self._in_float32(send, recv if mine else None,
                             lambda s, r: self.reduce(s, r, _inner(op), root), op)
            return
        if mine and send is recv:
            self.comm.Reduce(_IN_PLACE, recv, mop, root=root)
        else:
            self.comm.Reduce(send, recv if mine else None, mop, root=root)
        if mine and op is _MEAN:
            _scale(recv, self.size)

    def reduce_scatter(self, send, recv, counts, op):
        mop = self._ops.get((op._value_, send.dtype.num))
        if mop is None:
            mop = self._mop(op, send.dtype)
        if mop is None:
            self._rs_float32(send, recv, counts, op, self.reduce_scatter)
            return
        if counts is None or counts.count(counts[0]) == len(counts):
            self.comm.Reduce_scatter_block(send, recv, mop)
        else:
            self.comm.Reduce_scatter(send, recv, list(counts), mop)
        if op is _MEAN:
            _scale(recv, self.size)

    def ireduce_scatter(self, send, recv, counts, op):
        mop = self._mop(op, send.dtype)
        if mop is None:
            return self._rs_float32(send, recv, counts, op, self.ireduce_scatter)
        if counts is None or counts.count(counts[0]) == len(counts):
            req = self.comm.Ireduce_scatter_block(send, recv, mop)
        else:
            req = self.comm.Ireduce_scatter(send, recv, list(counts), mop)
        return _Then(req, lambda: _scale(recv, self.size)) if op is _MEAN else req

    def _rs_float32(self, send, recv, counts, op, run):
        """float16 reduce-scatter in float32 (no MPI half type); ``run`` is the (i)reduce_scatter."""
        send32 = send.astype(np.float32)
        n = send.size // self.size if counts is None else counts[self.rank]
        recv32 = _be.get_array_module(send32).empty(n, np.float32)

        def back():
            if op is _MEAN:
                _scale(recv32, self.size)
            recv[...] = recv32

        req = run(send32, recv32, counts, _inner(op))
        if req is None:
            back()
            return None
        return _Then(req, back, keep=(send32, recv32))

    # -- data movement ----------------------------------------------------------------------------
    def broadcast(self, buf, root):
        if buf.dtype.char not in _NATIVE:
            buf = _wire(buf)
        self.comm.Bcast(buf, root=root)

    def allgather(self, send, recv):
        if send.dtype.char not in _NATIVE:
            send, recv = _wire(send), _wire(recv)
        self.comm.Allgather(send, recv)

    def iallgather(self, send, recv):
        return self.comm.Iallgather(_wire(send), _wire(recv))

    def allgatherv(self, send, recv, counts):
        self.comm.Allgatherv(_wire(send), [_wire(recv), (list(counts), _displs(counts))])

    def gatherv(self, send, recv, counts, root):
        rbuf = [_wire(recv), (list(counts), _displs(counts))] if self.rank == root else None
        self.comm.Gatherv(_wire(send), rbuf, root=root)

    def scatterv(self, send, counts, recv, root):
        sbuf = [_wire(send), (list(counts), _displs(counts))] if self.rank == root else None
        self.comm.Scatterv(sbuf, _wire(recv), root=root)

    def alltoallv(self, send, scounts, recv, rcounts):
        self.comm.Alltoallv([_wire(send), (list(scounts), _displs(scounts))],
                            [_wire(recv), (list(rcounts), _displs(rcounts))])

    # -- point-to-point ---------------------------------------------------------------------------
    def send(self, buf, dst, tag):
        self.comm.Send(_wire(buf), dest=dst, tag=tag)

    def recv(self, buf, src, tag):
        self.comm.Recv(_wire(buf), source=src, tag=tag)

    def isend(self, buf, dst, tag):
        return self.comm.Isend(_wire(buf), dest=dst, tag=tag)

    def irecv(self, buf, src, tag):
        return self.comm.Irecv(_wire(buf), source=src, tag=tag)

    def batch_isend_irecv(self, ops: Sequence[P2PBuffer]) -> List[Any]:
        """Post every receive, then every send, all non-blocking; one request per op, in order."""
        reqs: List[Any] = [None] * len(ops)
        for i, o in enumerate(ops):
            if not o.is_send:
                reqs[i] = self.comm.Irecv(_wire(o.buf), source=o.peer, tag=o.tag)
        for i, o in enumerate(ops):
            if o.is_send:
                reqs[i] = self.comm.Isend(_wire(o.buf), dest=o.peer, tag=o.tag)
        return reqs

    def barrier(self):
        self.comm.Barrier()

    # -- objects ----------------------------------------------------------------------------------
    def broadcast_object(self, obj, root):
        return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def gather_object(self, obj, root):
        return self.comm.gather(obj, root=root)

    def alltoall_object(self, objs):
        return self.comm.alltoall(list(objs))


def _stream_synced(method):
    """``method`` preceded by a sync of the current CUDA stream (kernels queued on it may still
    be writing the send buffer or reading the receive buffer)."""
    @functools.wraps(method)
    def run(self, *args):
        _be.get_cupy().cuda.get_current_stream().synchronize()
        return method(self, *args)
    return run


class CudaAwareMPIBackend(MPIBackend):
    """:class:`MPIBackend` handing CuPy arrays to a CUDA-aware MPI (see :func:`cuda_aware_mpi`).

    Every call first synchronizes the caller's current CUDA stream, so MPI reads device memory
    after the kernels that wrote it and writes it after the kernels that still read it; when
    a call (or its request) completes, later work on any stream sees the data.
    """

    host_only = False


for _name in ("allreduce", "iallreduce", "reduce", "reduce_scatter", "ireduce_scatter", "broadcast",
              "allgather", "iallgather", "allgatherv", "gatherv", "scatterv", "alltoallv", "send",
              "recv", "isend", "irecv", "batch_isend_irecv"):
    setattr(CudaAwareMPIBackend, _name, _stream_synced(getattr(MPIBackend, _name)))
del _name
