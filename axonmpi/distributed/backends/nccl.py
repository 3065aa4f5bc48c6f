"""NCCL backend: the Backend contract with ``cupy.cuda.nccl``, one communicator per group bootstrapped over MPI.

[Note: how an NCCL communicator is bootstrapped]
Nothing NCCL-related happens when a group is made. On the group's first device collective
(any method below but the ``*_object`` ones and :meth:`NcclBackend.barrier`), every member
enters :meth:`NcclBackend.communicator`: group rank 0 calls ``nccl.get_unique_id()``, the id
is broadcast over the group's own MPI communicator, and each member builds
``NcclCommunicator(group.size, uid, group.rank)`` on its current GPU. That creation is
collective: **every member of the group must reach the group's first device collective**
(which, as for any collective, they do when all members call it). In debug mode
(``AXONMPI_DEBUG=1``) a debug check runs first, so a member that never arrives is named on
every rank that did (after ``AXONMPI_DEBUG_TIMEOUT`` seconds) instead of a silent hang in
``ncclCommInitRank``. Group ranks are NCCL ranks, so a sub-group of the grid gets its own id
and its own communicator with the rank mapping of its MPI communicator.

[Note: streams and completion]
Each group has one communication stream. A call records an event on the caller's current
stream and makes the communication stream wait on it (the buffers' producers run first),
then queues the NCCL kernels there and records a done-event. A blocking call makes the
caller's current stream wait on the done-event: the host never synchronizes, and work queued
afterwards on that stream sees the result. A non-blocking call returns a request whose
``Wait()`` does the same (``Test()`` polls the event); the request holds the buffers until
then. Point-to-point operations are recorded and posted together when needed
(``[Note: deferred point-to-point]``). MEAN uses ``ncclAvg`` where the NCCL library has it (2.10+), else a sum then a scale
queued on the caller's stream. Pairs NCCL has no reduction for (bitwise ops, bool, int16,
complex products) fall back to MPI on host copies, synchronously.
"""
from __future__ import annotations

import enum
from typing import Any, List, Optional, Sequence

import numpy as np

from ... import backend as _be
from ... import env as _env
from ..reduce_op import ReduceOp
from .base import Backend, P2PBuffer
from .mpi import MPIBackend
from ...enums import coerce_enum

__all__ = ["NcclBackend", "NcclBackendError", "BackendKind", "nccl_library", "nccl_available",
           "nccl_version", "register_stand_in"]


class BackendKind(enum.Enum):
    """Which backend moves device arrays: ``AUTO`` (NCCL when available, else MPI), ``MPI`` or ``NCCL``."""

    AUTO = "auto"
    MPI = "mpi"
    NCCL = "nccl"

    @classmethod
    def coerce(cls, value: "str | BackendKind") -> "BackendKind":
        return coerce_enum(cls, value, "backend")


class NcclBackendError(RuntimeError):
    """An NCCL call failed; the message holds NCCL's own error string, the rank and the group."""


def _fake_requested() -> bool:
    return _env.get_bool("AXONMPI_FAKE_NCCL")


# [Note: the NCCL stand-in registers itself]  Production code never imports ``axonmpi.testing``.
# A stand-in for ``cupy.cuda.nccl`` (the CPU one, ``axonmpi.testing.fake_nccl``, over MPI on host
# arrays) calls :func:`register_stand_in` when it is imported; ``AXONMPI_FAKE_NCCL=1`` selects it.
_STAND_IN: list = []     # the registered stand-in module (at most one)


def register_stand_in(module) -> None:
    """Register ``module`` (the part of ``cupy.cuda.nccl``'s API the backend uses) as the library that
    ``AXONMPI_FAKE_NCCL=1`` selects (tests only).  ``axonmpi.testing.fake_nccl`` registers itself.

    Example:
        >>> import axonmpi.testing.fake_nccl      # registers the CPU stand-in
    """
    _STAND_IN[:] = [module]


def nccl_library():
    """The NCCL module in use, or ``None``: ``cupy.cuda.nccl`` when CuPy, a GPU and NCCL load.

    With ``AXONMPI_FAKE_NCCL=1`` (tests only) it is the registered stand-in (:func:`register_stand_in`;
    ``axonmpi.testing.fake_nccl``, over MPI on host arrays, registers itself when imported).

    Raises:
        RuntimeError: ``AXONMPI_FAKE_NCCL=1`` and no stand-in is registered.
    """
    if _fake_requested():
        if not _STAND_IN:
            raise RuntimeError("AXONMPI_FAKE_NCCL=1 selects the registered NCCL stand-in, but none is registered: "
                               "import axonmpi.testing.fake_nccl first (it registers itself), or unset it")
        return _STAND_IN[0]
    cp = _be.get_cupy()
    if cp is None:
        return None
    try:
        from cupy.cuda import nccl
    except Exception:
        return None
    return nccl if getattr(nccl, "available", False) else None


def nccl_available() -> bool:
    """True when an NCCL library (or the test stand-in) can serve device collectives."""
    return nccl_library() is not None


def nccl_version() -> Optional[str]:
    """The runtime NCCL version as ``"2.21.5"``, or ``None`` without NCCL."""
    lib = nccl_library()
    if lib is None:
        return None
    try:
        v = int(lib.get_version())
    except Exception:
        return None
    if v >= 10000:  # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def _cuda_runtime(lib):
    """The module with ``Stream``, ``Event`` and ``get_current_stream`` for ``lib``."""
    runtime = getattr(lib, "cuda", None)   # the stand-in carries its own fake runtime
    if runtime is not None:
        return runtime
    return _be.get_cupy().cuda


def _ptr(a) -> int:
    """The device (or, with the stand-in, host) address of array ``a``'s first element."""
    if type(a) is np.ndarray:
        return a.ctypes.data
    return a.data.ptr


_INT_KINDS = {("i", 1): "NCCL_INT8", ("u", 1): "NCCL_UINT8", ("i", 4): "NCCL_INT32",
              ("u", 4): "NCCL_UINT32", ("i", 8): "NCCL_INT64", ("u", 8): "NCCL_UINT64",
              ("f", 2): "NCCL_FLOAT16", ("f", 4): "NCCL_FLOAT32", ("f", 8): "NCCL_FLOAT64"}
_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PRODUCT: "NCCL_PROD", ReduceOp.MIN: "NCCL_MIN",
        ReduceOp.MAX: "NCCL_MAX"}


class _Request:
    """Completion of NCCL work: ``Wait()`` orders the caller's current stream after ``event``.

    ``then`` (MEAN scaling) is queued on the caller's stream after that; ``keep`` holds the
    buffers until the request completes.
    """

    __slots__ = ("event", "runtime", "then", "keep", "done")

    def __init__(self, event, runtime, then=None, keep=None):
        self.event, self.runtime, self.then, self.keep, self.done = event, runtime, then, keep, False

    def Wait(self):  # noqa: N802 - mpi4py's request protocol
        if self.done:
            return
        self.runtime.get_current_stream().wait_event(self.event)
        fn, self.then = self.then, None
        if fn is not None:
            fn()
        self.keep, self.done = None, True

    def Test(self) -> bool:  # noqa: N802
        if self.done:
            return True
        if self.event.done:
            self.Wait()
            return True
        return False

class _Deferred:
    """Point-to-point work recorded by the backend and handed to NCCL when needed
    (``[Note: deferred point-to-point]``): ``Wait()``/``Test()`` post what this request needs,
    then order the caller's current stream after the NCCL groups that carried its operations."""

    __slots__ = ("backend", "runtime", "keep", "left", "events", "has_send", "done")

    def __init__(self, backend, keep, has_send: bool):
        self.backend, self.runtime, self.keep, self.has_send = backend, backend.runtime, keep, has_send
        self.left, self.events, self.done = 0, [], False

    def Wait(self):  # noqa: N802 - mpi4py's request protocol
        if self.done:
            return
        if self.left:
            self.backend._flush_for(self, wait=True)
        cur = self.runtime.get_current_stream()
        for ev in self.events:
            cur.wait_event(ev)
        self.keep, self.events, self.done = None, [], True

    def Test(self) -> bool:  # noqa: N802
        if self.done:
            return True
        if self.left:
            self.backend._flush_for(self, wait=False)
        if all(ev.done for ev in self.events):
            self.Wait()
            return True
        return False


class _Done:
    """A request that has already completed (the synchronous MPI fallback)."""

    def Wait(self):  # noqa: N802
        return None

    def Test(self) -> bool:  # noqa: N802
        return True


class NcclBackend(Backend):
    """The Backend contract over an NCCL communicator, made lazily for the group.

    CuPy arrays stay on the device: NCCL reads and writes them on the group's communication
    stream, ordered after the caller's current stream (see ``[Note: streams and completion]``).
    The communicator is created on the first device collective, collectively over the group
    (``[Note: how an NCCL communicator is bootstrapped]``). Object collectives and
    :meth:`barrier` go over the group's MPI communicator. Tags of point-to-point calls are
    ignored (as in PyTorch's NCCL backend): post a pair's operations in the same order on both
    sides. Uneven sizes: ``allgatherv`` is grouped broadcasts, ``reduce_scatter`` with uneven
    counts grouped reduces, ``gatherv``/``scatterv``/``alltoallv`` grouped send/recv.

    Args:
        group: the :class:`ProcessGroup` served.
        lib: the NCCL module (default :func:`nccl_library`).

    Raises:
        RuntimeError: no NCCL library is available (names the rank and the fix).

    Example:
        >>> be = NcclBackend(world.default_group)          # nothing NCCL happens yet
        >>> x = cupy.ones(4); be.allreduce(x, x, ReduceOp.SUM)   # creates the communicator
    """

    name = "nccl"
    host_only = False

    def __init__(self, group, *, lib=None) -> None:
        super().__init__(group)
        lib = nccl_library() if lib is None else lib
        if lib is None:
            raise RuntimeError(
                f"rank {group.world.rank}: backend 'nccl' needs CuPy with NCCL and a GPU "
                "(pip install 'axonmpi[cuda12]'); use backend='mpi' or 'auto' otherwise")
        self.lib = lib
        self.runtime = _cuda_runtime(lib)
        self.rank, self.size = group.rank, group.size
        self.mpi = MPIBackend(group)     # objects, barrier, reductions NCCL lacks
        self.uid = None                  # the unique id this group's communicator was made from
        self._comm = None
        self._stream = None
        self._ready = self._done = None   # cached events of blocking calls (see _begin, _finish)
        self._avg = None
        self._pending: list = []   # point-to-point ops not yet posted: ((is_send, ptr, nbytes, peer), request, ready)

    # -- the communicator ----------------------------------------------------------------------
    def communicator(self):
        """The group's NCCL communicator, created on first use (collective over the group)."""
        comm = self._comm
        return comm if comm is not None else self._create()

    def _create(self):
        g = self.group
        if g.world.debug:
            from ..debug import check_collective
            check_collective(g, "nccl_communicator_init", size=g.size)
        made = None
        if self.rank == 0:
            try:
                made = (self.lib.get_unique_id(), None)
            except Exception as e:   # tell the other members too, so none waits for an id
                made = (None, f"{type(e).__name__}: {e}")
        uid, failed = g.comm.bcast(made, root=0)
        if failed is not None:
            raise self._error(f"get_unique_id (on group rank 0, world rank {g.ranks[0]})", failed)
        try:
            comm = self.lib.NcclCommunicator(self.size, uid, self.rank)
        except Exception as e:
            raise self._error(f"NcclCommunicator({self.size}, uid, {self.rank})", e) from e
        self.uid, self._comm = uid, comm
        self._stream = self.runtime.Stream(non_blocking=True)
        return comm

    def _error(self, what: str, exc) -> NcclBackendError:
        g = self.group
        return NcclBackendError(
            f"rank {g.world.rank}: NCCL {what} failed on {g.name} (group rank {self.rank} of "
            f"{self.size}, world ranks {list(g.ranks)}): {exc}")

    def close(self) -> None:
        self._pending = []
        self._ready = self._done = None
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:
                pass
        self._stream = None

    # -- helpers -----------------------------------------------------------------------------
    def _type(self, dtype) -> Optional[int]:
        name = _INT_KINDS.get((dtype.kind, dtype.itemsize))
        return None if name is None else getattr(self.lib, name, None)

    def _op(self, op):
        name = _OPS.get(op)
        return None if name is None else getattr(self.lib, name)

    def _has_avg(self) -> bool:
        if self._avg is None:
            try:
                self._avg = hasattr(self.lib, "NCCL_AVG") and int(self.lib.get_version()) >= 21000
            except Exception:
                self._avg = False
        return self._avg

    def _reduction(self, op, dtype):
        """(nccl op, nccl type, count factor, scale after) for ``op`` on ``dtype``, or None."""
        factor = 1
        if dtype.kind == "c":       # complex SUM/MEAN reduce the float pairs
            if op not in (ReduceOp.SUM, ReduceOp.MEAN):
                return None
            dtype, factor = np.dtype(f"f{dtype.itemsize // 2}"), 2
        t = self._type(dtype) if dtype.kind in "iuf" else None
        if t is None:
            return None
        if op is ReduceOp.MEAN:
            if dtype.kind == "f" and self._has_avg():
                return self.lib.NCCL_AVG, t, factor, False
            if dtype.itemsize < 4:  # a float16 SUM overflows before the scale: MPI reduces in float32
                return None
            return self.lib.NCCL_SUM, t, factor, True
        nop = self._op(op)
        return None if nop is None else (nop, t, factor, False)

    def _begin(self):
        """The communicator and its stream's pointer, the stream ordered after the caller's.

        Pending point-to-point operations are posted first, so NCCL sees every rank's calls in
        the order they were made.
        """
        comm = self.communicator()
        if self._pending:
            self.flush()
        rt = self.runtime
        ready = self._ready      # one event serves every call: a wait takes the record made before it
        if ready is None:
            ready = self._ready = rt.Event(disable_timing=True)
        ready.record(rt.get_current_stream())
        self._stream.wait_event(ready)
        return comm, self._stream.ptr

    def _finish(self, blocking: bool, then=None, keep=None):
        """Record the done-event; blocking: order the caller's stream after it now."""
        rt = self.runtime
        if blocking:             # waited on at once: the cached event can be recorded again next call
            done = self._done
            if done is None:
                done = self._done = rt.Event(disable_timing=True)
            done.record(self._stream)
            rt.get_current_stream().wait_event(done)
            if then is not None:
                then()
            return None
        done = rt.Event(disable_timing=True)
        done.record(self._stream)
        return _Request(done, rt, then, keep)

    def _scale(self, buf):
        """``buf /= size`` (MEAN after a SUM), queued on the caller's stream when it runs."""
        size = self.size

        def run():
            _be.get_array_module(buf).true_divide(buf, size, out=buf)
        return run

    def _fallback(self, name, send, recv, *args):
        """Run MPIBackend.<name> on host copies (pairs NCCL cannot reduce); synchronous."""
        if type(send) is np.ndarray and (recv is None or type(recv) is np.ndarray):
            getattr(self.mpi, name)(send, recv, *args)
            return
        hs = _be.to_host(send)
        hr = hs if recv is send else (None if recv is None else np.empty(recv.shape, recv.dtype))
        getattr(self.mpi, name)(hs, hr, *args)
        if recv is not None:
            recv[...] = _be.get_array_module(recv).asarray(hr)

    def _call(self, what, fn, *args):
        try:
            fn(*args)
        except Exception as e:
            raise self._error(what, e) from e

    def _group(self, body):
        """Run ``body()`` (which issues NCCL calls) between groupStart() and groupEnd()."""
        lib = self.lib
        self._call("groupStart", lib.groupStart)
        try:
            body()
        except BaseException:
            try:
                lib.groupEnd()
            except Exception:
                pass
            raise
        self._call("groupEnd", lib.groupEnd)

    # -- reductions --------------------------------------------------------------------------
    def _allreduce(self, send, recv, op, blocking):
        spec = self._reduction(op, send.dtype)
        if spec is None:
            self._fallback("allreduce", send, recv, op)
            return None if blocking else _Done()
        nop, t, f, scale = spec
        comm, s = self._begin()
        self._call(f"allReduce({op.name}, {send.dtype})", comm.allReduce, _ptr(send), _ptr(recv),
                   send.size * f, t, nop, s)
        return self._finish(blocking, self._scale(recv) if scale else None, (send, recv))

    def allreduce(self, send, recv, op):
        self._allreduce(send, recv, op, True)

    def iallreduce(self, send, recv, op):
        return self._allreduce(send, recv, op, False)

    def reduce(self, send, recv, op, root):
        mine = self.rank == root
        spec = self._reduction(op, send.dtype)
        if spec is None:
            self._fallback("reduce", send, recv if mine else None, op, root)
            return
        nop, t, f, scale = spec
        comm, s = self._begin()
        out = recv if mine else send   # NCCL ignores recvbuff off the root
        self._call(f"reduce({op.name}, root={root})", comm.reduce, _ptr(send), _ptr(out),
                   send.size * f, t, nop, root, s)
        self._finish(True, self._scale(recv) if (scale and mine) else None, (send, recv))

    def _reduce_scatter(self, send, recv, counts, op, blocking):
        spec = self._reduction(op, send.dtype)
        if spec is None:
            self._fallback("reduce_scatter", send, recv, counts, op)
            return None if blocking else _Done()
        nop, t, f, scale = spec
        comm, s = self._begin()
        if counts is None or counts.count(counts[0]) == len(counts):
            self._call(f"reduceScatter({op.name})", comm.reduceScatter, _ptr(send), _ptr(recv),
                       recv.size * f, t, nop, s)
        else:   # uneven pieces: one reduce per root, fused in a group
            base, item = _ptr(send), send.itemsize

            def body():
                off = 0
                for r, c in enumerate(counts):
                    if c:
                        dst = _ptr(recv) if r == self.rank else base + off * item
                        comm.reduce(base + off * item, dst, c * f, t, nop, r, s)
                    off += c
            self._group(body)
        return self._finish(blocking, self._scale(recv) if scale else None, (send, recv))

    def reduce_scatter(self, send, recv, counts, op):
        self._reduce_scatter(send, recv, counts, op, True)

    def ireduce_scatter(self, send, recv, counts, op):
        return self._reduce_scatter(send, recv, counts, op, False)

    # -- data movement (as bytes: every dtype moves) ----------------------------------------
    def _u8(self):
        return self.lib.NCCL_UINT8

    def broadcast(self, buf, root):
        comm, s = self._begin()
        p = _ptr(buf)
        self._call(f"broadcast(root={root})", comm.broadcast, p, p, buf.nbytes, self._u8(), root, s)
        self._finish(True, keep=buf)

    def _allgather(self, send, recv, blocking):
        comm, s = self._begin()
        self._call("allGather", comm.allGather, _ptr(send), _ptr(recv), send.nbytes, self._u8(), s)
        return self._finish(blocking, keep=(send, recv))

    def allgather(self, send, recv):
        self._allgather(send, recv, True)

    def iallgather(self, send, recv):
        return self._allgather(send, recv, False)

    def allgatherv(self, send, recv, counts):
        comm, s = self._begin()
        item, base, u8 = recv.itemsize, _ptr(recv), self._u8()
        sp = _ptr(send)

        def body():
            off = 0
            for r, c in enumerate(counts):
                if c:
                    comm.broadcast(sp if r == self.rank else base + off * item, base + off * item,
                                   c * item, u8, r, s)
                off += c
        self._group(body)
        self._finish(True, keep=(send, recv))

    def _p2p_group(self, ops):
        """Post ``(is_send, ptr, nbytes, peer)`` ops in one NCCL group on the comm stream."""
        comm, s = self._begin()
        u8 = self._u8()

        def body():
            for is_send, p, n, peer in ops:
                if n:
                    (comm.send if is_send else comm.recv)(p, n, u8, peer, s)
        self._group(body)

    def gatherv(self, send, recv, counts, root):
        item = send.itemsize
        ops = [(True, _ptr(send), send.nbytes, root)]
        if self.rank == root:
            off, base = 0, _ptr(recv)
            for r, c in enumerate(counts):
                ops.append((False, base + off * item, c * item, r))
                off += c
        self._p2p_group(ops)
        self._finish(True, keep=(send, recv))

    def scatterv(self, send, counts, recv, root):
        item = recv.itemsize
        ops = [(False, _ptr(recv), recv.nbytes, root)]
        if self.rank == root:
            off, base = 0, _ptr(send)
            for r, c in enumerate(counts):
                ops.append((True, base + off * item, c * item, r))
                off += c
        self._p2p_group(ops)
        self._finish(True, keep=(send, recv))

    def alltoallv(self, send, scounts, recv, rcounts):
        item = send.itemsize if send.size else recv.itemsize
        ops, sb, rb, so, ro = [], _ptr(send), _ptr(recv), 0, 0
        for j in range(self.size):
            ops.append((False, rb + ro * item, rcounts[j] * item, j))
            ops.append((True, sb + so * item, scounts[j] * item, j))
            so += scounts[j]
            ro += rcounts[j]
        self._p2p_group(ops)
        self._finish(True, keep=(send, recv))

    # -- point-to-point ---------------------------------------------------------------------------
    # [Note: deferred point-to-point]
    # NCCL runs a group's calls in order on one stream, and a receive kernel holds that stream
    # until its data arrives. Posted one by one, ``irecv(prev); send(next)`` on every rank of a
    # ring, or a receive posted ahead of need (a pipeline's next gradient) followed by a send
    # the peer waits for, would hold each rank's sends behind a receive its peer cannot yet
    # satisfy: a deadlock MPI, which progresses every posted operation, does not have. So
    # isend/irecv/batch_isend_irecv only record operations, and they are handed to NCCL in one
    # groupStart()/groupEnd() (where NCCL progresses sends and receives together) when needed:
    # the Wait() of a request with a send posts everything pending; Test() of it, and Wait() or
    # Test() of a receive, post every pending send plus the receives from the same peers up to
    # this request's (a receive posted far ahead stays pending until its own turn); blocking
    # send/recv are a post and a Wait(); the group's next collective or barrier posts all.
    # Sends keep their order, and receives their order per peer, so NCCL matches every pair.
    def _post(self, ops, keep) -> _Deferred:
        """Record point-to-point ``ops`` ``(is_send, ptr, nbytes, peer)``; their request."""
        self.communicator()
        rt = self.runtime
        ready = rt.Event(disable_timing=True)        # the buffers' producers, on the caller's stream
        ready.record(rt.get_current_stream())
        req = _Deferred(self, keep, any(o[0] for o in ops))
        for o in ops:
            self._pending.append((o, req, ready))
        req.left = len(ops)
        return req

    def _flush_for(self, req: _Deferred, wait: bool) -> None:
        """Post what ``req`` needs (see the note above) in one NCCL group."""
        pend = self._pending
        if wait and req.has_send:
            self._flush(list(range(len(pend))))
            return
        last = {}
        for i, (o, r, _) in enumerate(pend):
            if r is req and not o[0]:
                last[o[3]] = i
        self._flush([i for i, (o, r, _) in enumerate(pend)
                     if o[0] or r is req or (o[3] in last and i <= last[o[3]])])

    def flush(self) -> None:
        """Post every pending point-to-point operation of this group in one NCCL group."""
        if self._pending:
            self._flush(list(range(len(self._pending))))

    def _flush(self, idx) -> None:
        chosen = [self._pending[i] for i in idx]
        if not chosen:
            return
        keep = set(idx)
        self._pending = [e for i, e in enumerate(self._pending) if i not in keep]
        comm = self.communicator()
        seen = set()
        for _, _, ready in chosen:
            if id(ready) not in seen:
                seen.add(id(ready))
                self._stream.wait_event(ready)
        s, u8 = self._stream.ptr, self._u8()

        def body():
            for (is_send, p, n, peer), _, _ in chosen:
                if n:
                    (comm.send if is_send else comm.recv)(p, n, u8, peer, s)
        self._group(body)
        done = self.runtime.Event(disable_timing=True)
        done.record(self._stream)
        for _, r, _ in chosen:
            r.left -= 1
            if not r.events or r.events[-1] is not done:
                r.events.append(done)

    def send(self, buf, dst, tag):
        self._post([(True, _ptr(buf), buf.nbytes, dst)], buf).Wait()

    def recv(self, buf, src, tag):
        self._post([(False, _ptr(buf), buf.nbytes, src)], buf).Wait()

    def isend(self, buf, dst, tag):
        return self._post([(True, _ptr(buf), buf.nbytes, dst)], buf)

    def irecv(self, buf, src, tag):
        return self._post([(False, _ptr(buf), buf.nbytes, src)], buf)

    def batch_isend_irecv(self, ops: Sequence[P2PBuffer]) -> List[Any]:
        """Record every operation; they are posted in one ``groupStart()``/``groupEnd()`` with the
        group's other pending ones at the first wait (``[Note: deferred point-to-point]``)."""
        if not ops:
            return []
        req = self._post([(o.is_send, _ptr(o.buf), o.buf.nbytes, o.peer) for o in ops], [o.buf for o in ops])
        return [req] * len(ops)

    def barrier(self):
        if self._pending:
            self.flush()
        self.mpi.barrier()

    # -- objects (host, over MPI) -------------------------------------------------------------------
    def broadcast_object(self, obj, root):
        return self.mpi.broadcast_object(obj, root)

    def allgather_object(self, obj):
        return self.mpi.allgather_object(obj)

    def gather_object(self, obj, root):
        return self.mpi.gather_object(obj, root)

    def alltoall_object(self, objs):
        return self.mpi.alltoall_object(objs)
