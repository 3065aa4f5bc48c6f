"""Collectives over process groups: all_reduce, broadcast, all_gather, reduce_scatter, ... on NumPy/CuPy arrays.

Conventions (shared by every function here):

* ``group=None`` means the current World's default group (all ranks).
* Out-of-place by default: the result is a new array. Pass ``out=`` to write into an
  existing array; ``out=x`` reduces in place (MPI_IN_PLACE when ``x`` is contiguous).
* Non-contiguous inputs are copied to contiguous buffers; 0-d and empty arrays work.
* Uneven sizes follow one rule, the :func:`chunk_sizes` rule (``numpy.array_split``'s):
  ``n`` rows over ``p`` ranks gives the first ``n % p`` ranks one extra row. No padding.
* ``async_op=True`` returns a :class:`Work` whose ``wait()`` returns the result.
* Every call goes through the group's :class:`~axonmpi.distributed.backends.Backend`. CuPy
  arrays go to NCCL when ``axonmpi.init(backend=...)`` gives it (``"auto"`` with CuPy's NCCL,
  or ``"nccl"``), else to MPI directly when it is CUDA-aware (``AXONMPI_CUDA_AWARE``), else
  they are staged through host memory, and ``async_op=True`` then completes before returning.
  Host arrays and objects go over MPI. The CPU path never imports CuPy.
* Any array: objects with ``__dlpack__``, ``__cuda_array_interface__`` or the buffer protocol
  (PyTorch tensors, JAX arrays, ``bytearray``...) are moved as zero-copy views where the producer
  allows, and results come back in the caller's type (:mod:`axonmpi.distributed.interop`).
"""
from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .. import backend as _be
from .backends.base import P2PBuffer
from .backends import device_backend, host_backend
from .backends.mpi import CudaAwareMPIBackend, MPIBackend, cuda_aware_mpi
from .group import ProcessGroup
from .interop import any_array, any_array_p2p, call_with_arrays, foreign
from .reduce_op import ReduceOp, mpi_op
from .work import Work
from . import world as _world_mod
from .world import resolve_group

__all__ = [
    "ReduceOp", "Work", "chunk_sizes", "chunk_bounds",
    "all_reduce", "all_reduce_sum", "all_reduce_mean", "all_reduce_min", "all_reduce_max",
    "all_reduce_product", "reduce", "broadcast", "all_gather", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_sum", "reduce_scatter_mean", "all_to_all", "barrier",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv",
    "broadcast_object", "all_gather_object", "gather_object",
]

_SUM = ReduceOp.SUM
_MEAN = ReduceOp.MEAN
_ND = np.ndarray


# -- the one split rule (defined in sharding.py) ------------------------------------------
from .sharding import chunk_bounds, chunk_sizes  # noqa: E402


# -- plumbing (written once) ----------------------------------------------------------------
def _group(group):
    """Fast :func:`resolve_group` for the common ``group=None`` case."""
    if group is None:
        w = _world_mod._WORLD
        if w is not None and not w._destroyed:
            return w.default_group
    return resolve_group(group)


def _host_backend(g: ProcessGroup) -> MPIBackend:
    """The group's backend for host arrays and picklable objects (created once per group).

    MPI, except on the test stand-in with ``init(backend="nccl")``, where it is the NCCL
    backend (whose object calls go over MPI).
    """
    be = g._host
    if be is None:
        be = g._host = host_backend(g)
        g._backends[be.name] = be
    return be


class _MPIServesDevice:
    """``g._backends["device"]`` when MPI serves the group's CuPy arrays (the choice is made once)."""

    name = "mpi"

    def close(self) -> None:
        """Nothing to release."""


_NO_DEVICE_BACKEND = _MPIServesDevice()


def _backend(g: ProcessGroup, arr) -> MPIBackend:
    """The backend serving ``arr`` on group ``g`` (cached per group).

    CuPy arrays: the group's NCCL backend when the World's backend choice gives NCCL (see
    :func:`~axonmpi.distributed.backends.device_backend`), else the CUDA-aware MPI backend,
    else the host backend (arrays staged through host memory).
    """
    if type(arr) is _ND:
        return g._host or _host_backend(g)
    if _be.is_cupy_array(arr):
        d = g._backends.get("device")
        if d is None:
            d = g._backends["device"] = device_backend(g) or _NO_DEVICE_BACKEND
        if d is not _NO_DEVICE_BACKEND:
            return d
        if cuda_aware_mpi():
            b = g._backends.get("mpi-cuda")
            if b is None:
                b = g._backends["mpi-cuda"] = CudaAwareMPIBackend(g)
            return b
    return g._host or _host_backend(g)   # device arrays are staged through the host for it


def _as_array(x, name: str = "x"):
    if type(x) is _ND or _be.is_cupy_array(x):
        return x
    if hasattr(x, "data") and (type(x.data) is _ND or _be.is_cupy_array(x.data)):
        raise TypeError(
            f"{name} is a {type(x).__name__}; collectives move arrays — pass {name}.data "
            "(differentiable collectives are planned in axonmpi.parallel.tensor)"
        )
    try:
        return np.asarray(x)
    except Exception:
        raise TypeError(f"{name} must be a NumPy/CuPy array or array-like, got {type(x).__name__}") from None


def _contig(a):
    return a if a.flags.c_contiguous else a.copy()


def _flat(a):
    """A 1-D contiguous view (copy only if ``a`` is not contiguous)."""
    return _contig(a).reshape(-1)


def _check_dtype(g, dtype, what):
    """Arrays of Python objects cannot be moved as buffers; everything else can."""
    if dtype.hasobject:
        raise TypeError(
            f"rank {g.world.rank}: {what} moves numeric arrays, got dtype {dtype}; "
            "use the *_object collectives for Python objects"
        )


@functools.lru_cache(maxsize=None)
def _note_blocking_async() -> None:
    """Say once (rank 0, info) that async_op on CuPy arrays blocks without a CUDA-aware MPI."""
    w = _world_mod._WORLD
    if w is not None and w.rank == 0:
        from ..log import get_logger
        get_logger("axonmpi.distributed").info(
            "async_op=True on CuPy arrays completes before returning: without a CUDA-aware MPI "
            "(AXONMPI_CUDA_AWARE_MPI=1) device arrays are staged through host memory, so "
            "communication does not overlap computation (DDP overlap included)"
        )


class _Staged:
    """Stage device arrays through the host for a backend that only moves host memory.

    ``dev``: staged through host copies; ``direct``: device arrays handed to the backend
    (which orders itself after the current stream, see the Backend contract).
    """

    __slots__ = ("dev", "direct")

    def __init__(self, be, arr):
        on_gpu = type(arr) is not _ND and _be.is_cupy_array(arr)
        self.dev = on_gpu and be.host_only
        self.direct = on_gpu and not be.host_only

    def host(self, a):
        """``a`` as the backend takes it (a pinned host copy when staged)."""
        return _be.to_host_pinned(a) if (self.dev and a is not None) else a

    def empty(self, like, n, dtype=None):
        """A new 1-D buffer of ``n`` elements the backend can write (pinned host memory when staged)."""
        dtype = like.dtype if dtype is None else dtype
        if self.dev:
            return _be.empty_pinned(n, dtype)
        return _be.get_array_module(like).empty(n, dtype)

    def back(self, res, like):
        """``res`` on the device of ``like`` (the caller's array) when staged."""
        return _be.to_device(res, _be.device_of(like)) if self.dev else res

    def fill(self, x, buf):
        """Copy the received flat ``buf`` into the caller's array ``x`` (any layout, any device)."""
        if self.dev:
            x[...] = _be.get_cupy().asarray(buf.reshape(x.shape))
        else:
            x[...] = buf.reshape(x.shape)


def _check_root(g: ProcessGroup, root: int, what: str) -> int:
    if isinstance(root, (bool,)) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"rank {g.world.rank}: {what} must be an int group rank, got {root!r}")
    if not 0 <= root < g.size:
        raise ValueError(
            f"rank {g.world.rank}: {what}={root} is out of range for {g.name} of size {g.size} "
            f"(valid: 0..{g.size - 1}; ranks are group-relative)"
        )
    return int(root)


def _check_out(g, out, shape, dtype, what):
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"rank {g.world.rank}: out= for {what} must have shape {tuple(shape)} and dtype {dtype}, "
            f"got shape {out.shape} and dtype {out.dtype}"
        )


def _debug(g, name, **fields):
    if g.world.debug:
        from .debug import check_collective
        check_collective(g, name, **fields)


def _complete(g, async_op, stage, send, recv, start, run, finish):
    """Run a prepared collective: a copy at size 1, a non-blocking :class:`Work` when asked (and
    the backend moves the caller's memory), else blocking; ``finish`` makes the result."""
    if g.size == 1:
        if send is not recv:
            recv[...] = send
    elif async_op and not stage.dev:
        return Work(start(), finish=finish, keep=(send, recv))
    else:
        if async_op:
            _note_blocking_async()
        run()
    res = finish()
    return Work(result=res) if async_op else res


# -- all_reduce ------------------------------------------------------------------------------
def all_reduce(x, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None, *, out=None,
               async_op: bool = False):
    """Reduce ``x`` over the group; every rank gets the result.

    Args:
        x: NumPy/CuPy array (any numeric dtype, any shape incl. 0-d/empty).
        op: a :class:`ReduceOp` (SUM, MEAN/AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR) or its name.
        group: the process group (default: all ranks).
        out: where to write the result; ``out=x`` is in place. Default: a new array.
        async_op: return a :class:`Work` instead of the result.

    Returns:
        The reduced array (or a Work whose ``wait()`` returns it).

    Example:
        >>> s = axonmpi.all_reduce(np.array([world.rank]))        # [0 + 1 + ... + (n-1)]
        >>> axonmpi.all_reduce(grad, op="mean", out=grad)           # in place average
    """
    w = _world_mod._WORLD                                        # inline _group(None): hot path
    g = w.default_group if group is None and w is not None and not w._destroyed else _group(group)
    if type(op) is not ReduceOp:
        op = ReduceOp.coerce(op)
    if type(x) is _ND and not async_op and g.size > 1 and not g.world.debug and x.flags.c_contiguous:
        if out is x:                                         # hot path: one backend call, no staging
            recv = x
        elif out is None:
            recv = np.empty_like(x)
        else:
            recv = None
        if recv is not None:
            (g._host or _host_backend(g)).allreduce(x, recv, op)
            return recv
    if foreign(x, out):                  # torch, JAX, buffers...: interop.py
        return call_with_arrays(all_reduce, x, op, group, out=out, async_op=async_op)
    x = _as_array(x)
    if g.world.debug:
        _debug(g, "all_reduce", shape=x.shape, dtype=x.dtype, op=op)
    be = _backend(g, x)
    mpi_op(op, x.dtype, g.world.rank)  # dtype/op check on every rank, even at size 1
    if out is not None and out is not x:
        _check_out(g, out, x.shape, x.dtype, "all_reduce")
    target = out
    stage = _Staged(be, x)
    direct = False  # True when the backend writes straight into the caller's array
    if target is x and x.flags.c_contiguous and not stage.dev:
        send = recv = x.reshape(-1)
        direct = True
    else:
        send = stage.host(_flat(x))
        if target is not None and target.flags.c_contiguous and not stage.dev:
            recv, direct = target.reshape(-1), True
        else:
            recv = stage.empty(send, send.size)

    def finish():
        if direct:
            return target
        res = stage.back(recv.reshape(x.shape), x)
        if target is None:
            return res
        target[...] = res
        return target

    return _complete(g, async_op, stage, send, recv, lambda: be.iallreduce(send, recv, op),
                     lambda: be.allreduce(send, recv, op), finish)


def all_reduce_sum(x, group=None, **kw):
    """:func:`all_reduce` with ``op=SUM``."""
    return all_reduce(x, _SUM, group, **kw)


def all_reduce_mean(x, group=None, **kw):
    """:func:`all_reduce` with ``op=MEAN`` (floating dtypes)."""
    return all_reduce(x, _MEAN, group, **kw)


def all_reduce_min(x, group=None, **kw):
    """:func:`all_reduce` with ``op=MIN``."""
    return all_reduce(x, ReduceOp.MIN, group, **kw)


def all_reduce_max(x, group=None, **kw):
    """:func:`all_reduce` with ``op=MAX``."""
    return all_reduce(x, ReduceOp.MAX, group, **kw)


def all_reduce_product(x, group=None, **kw):
    """:func:`all_reduce` with ``op=PRODUCT``."""
    return all_reduce(x, ReduceOp.PRODUCT, group, **kw)


@any_array
def reduce(x, dst: int = 0, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None):
    """Reduce ``x`` onto group rank ``dst``; returns the result there and ``None`` elsewhere."""
    g = _group(group)
    op = ReduceOp.coerce(op)
    x = _as_array(x)
    dst = _check_root(g, dst, "dst")
    _debug(g, "reduce", shape=x.shape, dtype=x.dtype, op=op, dst=dst)
    be = _backend(g, x)
    mpi_op(op, x.dtype, g.world.rank)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    recv = stage.empty(send, send.size) if g.rank == dst else None
    if g.size == 1:
        recv[...] = send
    else:
        be.reduce(send, recv, op, dst)
    if g.rank != dst:
        return None
    return stage.back(recv.reshape(x.shape), x)


# -- broadcast ---------------------------------------------------------------------------------
def broadcast(x, src: int = 0, group: Optional[ProcessGroup] = None, *, async_op: bool = False):
    """Copy ``x`` from group rank ``src`` into ``x`` on every rank (in place); return ``x``.

    Every rank passes an array of the same shape and dtype; non-source ranks' contents are
    overwritten. Non-contiguous ``x`` is filled through a contiguous copy.

    Example:
        >>> w = np.empty(3) if world.rank else np.arange(3.0)
        >>> axonmpi.broadcast(w, src=0)        # now [0., 1., 2.] everywhere
    """
    w = _world_mod._WORLD                                        # inline _group(None): hot path
    g = w.default_group if group is None and w is not None and not w._destroyed else _group(group)
    if (type(x) is _ND and type(src) is int and 0 <= src < g.size and not g.world.debug
            and x.flags.c_contiguous and x.flags.writeable and x.dtype.kind in "biufc"):
        if g.size > 1:
            (g._host or _host_backend(g)).broadcast(x, src)
        return Work(result=x) if async_op else x
    if foreign(x):                       # torch, JAX, buffers...: interop.py
        return call_with_arrays(broadcast, x, src, group, async_op=async_op)
    x = _as_array(x)
    if type(x) is _ND and not x.flags.writeable:
        raise ValueError(f"rank {g.world.rank}: broadcast writes into x in place; x is read-only")
    src = _check_root(g, src, "src")
    _check_dtype(g, x.dtype, "broadcast")
    _debug(g, "broadcast", shape=x.shape, dtype=x.dtype, src=src)
    if g.size > 1:
        be = _backend(g, x)
        stage = _Staged(be, x)
        buf = stage.host(_flat(x))
        be.broadcast(buf, src)
        if stage.dev or not np.shares_memory(buf, x):
            stage.fill(x, buf)
    return Work(result=x) if async_op else x


# -- all_gather ---------------------------------------------------------------------------------
def all_gather(x, axis: int = 0, group: Optional[ProcessGroup] = None, *, uneven: bool = False,
               out=None, async_op: bool = False):
    """Concatenate every rank's ``x`` along ``axis`` (in group-rank order) on every rank.

    Args:
        x: array; same shape on all ranks unless ``uneven=True``.
        axis: concatenation axis (0-d inputs are gathered into shape ``(size,)``).
        uneven: allow ``x.shape[axis]`` to differ across ranks (one extra small exchange).
        out: optional output array of the concatenated shape.
        async_op: return a :class:`Work` (not with ``uneven`` or ``axis != 0``).

    Example (3 ranks):
        >>> axonmpi.all_gather(np.full(2, world.rank))     # [0 0 1 1 2 2]
    """
    w = _world_mod._WORLD                                        # inline _group(None): hot path
    g = w.default_group if group is None and w is not None and not w._destroyed else _group(group)
    p = g.size
    if (type(x) is _ND and axis == 0 and not uneven and not async_op and p > 1 and not g.world.debug
            and x.ndim > 0 and x.flags.c_contiguous and x.dtype.kind in "biufc"):
        shape = (p * x.shape[0],) + x.shape[1:]
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not (type(out) is _ND and out.shape == shape and out.dtype == x.dtype and out.flags.c_contiguous):
            shape = None
        if shape is not None:
            (g._host or _host_backend(g)).allgather(x, out)
            return out
    if foreign(x, out):                  # torch, JAX, buffers...: interop.py
        return call_with_arrays(all_gather, x, axis, group, uneven=uneven, out=out, async_op=async_op)
    x = _as_array(x)
    if x.ndim == 0:
        x = x.reshape(1)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"rank {g.world.rank}: axis {axis} out of range for a {x.ndim}-d array")
    axis %= x.ndim
    _check_dtype(g, x.dtype, "all_gather")
    if g.world.debug:
        shape = list(x.shape)
        if uneven:
            shape[axis] = "*"
        _debug(g, "all_gather", shape=tuple(shape), dtype=x.dtype, axis=axis, uneven=uneven)
    be = _backend(g, x)
    stage = _Staged(be, x)
    xm = np.moveaxis(x, axis, 0) if axis else x
    send = stage.host(_flat(xm))
    xp = np if stage.dev else _be.get_array_module(send)
    rest = xm.shape[1:]
    if uneven:
        rows = np.empty(p, np.int64)
        if p > 1:
            _host_backend(g).allgather(np.array([xm.shape[0]], np.int64), rows)
        else:
            rows.fill(xm.shape[0])
        rowsize = int(np.prod(rest, dtype=np.int64))
        counts = [int(r) * rowsize for r in rows]
        recv = stage.empty(send, sum(counts))
        if p > 1:
            be.allgatherv(send, recv, counts)
        else:
            recv[...] = send
        total = (int(rows.sum()),) + rest
    else:
        total = (p * xm.shape[0],) + rest
        recv = None
    full_shape = list(total)
    if axis:
        full_shape.insert(axis, full_shape.pop(0))
    if out is not None:
        _check_out(g, out, full_shape, x.dtype, "all_gather")
    direct = (recv is None and out is not None and not axis and not stage.dev
              and type(out) is type(send) and out.flags.c_contiguous)
    if recv is None:
        recv = out.reshape(-1) if direct else stage.empty(send, p * send.size)

    def finish():
        if direct:
            return out
        res = recv.reshape(total)
        if axis:
            res = np.moveaxis(res, 0, axis)
            res = xp.ascontiguousarray(res)
        res = stage.back(res, x)
        if out is not None:
            out[...] = res
            return out
        return res

    if uneven:  # already exchanged above
        res = finish()
        return Work(result=res) if async_op else res
    return _complete(g, async_op, stage, send, recv, lambda: be.iallgather(send, recv),
                     lambda: be.allgather(send, recv), finish)


# -- reduce_scatter --------------------------------------------------------------------------
def reduce_scatter(x, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None, *, out=None,
                   async_op: bool = False):
    """Reduce ``x`` over the group and give rank ``i`` the ``i``-th chunk of rows (axis 0).

    Rows are split by the :func:`chunk_sizes` rule, so ``x.shape[0]`` need not divide by
    the group size: with 10 rows over 4 ranks, ranks get 3, 3, 2, 2 rows. 0-d inputs are
    refused (there is nothing to scatter).

    Example (2 ranks):
        >>> axonmpi.reduce_scatter(np.arange(4.0))    # rank 0: [0, 2], rank 1: [4, 6]
    """
    w = _world_mod._WORLD                                        # inline _group(None): hot path
    g = w.default_group if group is None and w is not None and not w._destroyed else _group(group)
    if type(op) is not ReduceOp:
        op = ReduceOp.coerce(op)
    p = g.size
    if (type(x) is _ND and not async_op and p > 1 and not g.world.debug and x.ndim > 0
            and x.shape[0] % p == 0 and x.flags.c_contiguous):
        shape = (x.shape[0] // p,) + x.shape[1:]
        if out is None or (type(out) is _ND and out.shape == shape and out.dtype == x.dtype
                           and out.flags.c_contiguous):
            recv = np.empty(shape, x.dtype) if out is None else out
            (g._host or _host_backend(g)).reduce_scatter(x, recv, None, op)
            return recv
    if foreign(x, out):                  # torch, JAX, buffers...: interop.py
        return call_with_arrays(reduce_scatter, x, op, group, out=out, async_op=async_op)
    x = _as_array(x)
    if x.ndim == 0:
        raise ValueError(f"rank {g.world.rank}: reduce_scatter needs at least 1-d input, got a 0-d array")
    _debug(g, "reduce_scatter", shape=x.shape, dtype=x.dtype, op=op)
    mpi_op(op, x.dtype, g.world.rank)
    rows = chunk_sizes(x.shape[0], p)
    rowsize = int(np.prod(x.shape[1:], dtype=np.int64))
    counts = [r * rowsize for r in rows]
    my_shape = (rows[g.rank],) + x.shape[1:]
    if out is not None:
        _check_out(g, out, my_shape, x.dtype, "reduce_scatter")
    be = _backend(g, x)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    if out is not None and out.flags.c_contiguous and not stage.dev:
        recv = out.reshape(-1)
    else:
        recv = stage.empty(send, counts[g.rank])

    def finish():
        res = stage.back(recv.reshape(my_shape), x)
        if out is not None:
            if stage.dev or not np.shares_memory(res, out):
                out[...] = res
            return out
        return res

    if p == 1:
        send = send[:counts[0]]
    return _complete(g, async_op, stage, send, recv, lambda: be.ireduce_scatter(send, recv, counts, op),
                     lambda: be.reduce_scatter(send, recv, counts, op), finish)


def reduce_scatter_sum(x, group=None, **kw):
    """:func:`reduce_scatter` with ``op=SUM``."""
    return reduce_scatter(x, _SUM, group, **kw)


def reduce_scatter_mean(x, group=None, **kw):
    """:func:`reduce_scatter` with ``op=MEAN``."""
    return reduce_scatter(x, _MEAN, group, **kw)


# -- gather / scatter --------------------------------------------------------------------------
def _split_flat(recv, shapes, counts, stage, like):
    """The pieces of the flat ``recv``: ``counts[i]`` elements each, reshaped to ``shapes[i]``."""
    out, o = [], 0
    for s, c in zip(shapes, counts):
        out.append(stage.back(recv[o:o + c].reshape(s), like))
        o += c
    return out


@any_array
def gather(x, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Collect every rank's ``x`` on group rank ``dst`` as a list (in group-rank order).

    Shapes may differ across ranks; dtypes must agree. Returns the list on ``dst`` and
    ``None`` elsewhere.
    """
    g = _group(group)
    x = _as_array(x)
    dst = _check_root(g, dst, "dst")
    _check_dtype(g, x.dtype, "gather")
    _debug(g, "gather", dtype=x.dtype, dst=dst)
    be = _backend(g, x)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    shapes = _host_backend(g).gather_object(x.shape, dst) if g.size > 1 else [x.shape]
    recv = counts = None
    if g.rank == dst:
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        recv = stage.empty(send, sum(counts))
    if g.size == 1:
        recv[...] = send
    else:
        be.gatherv(send, recv, counts, dst)
    if g.rank != dst:
        return None
    return _split_flat(recv, shapes, counts, stage, x)


@any_array
def scatter(chunks, src: int = 0, group: Optional[ProcessGroup] = None):
    """Send chunk ``i`` from group rank ``src`` to rank ``i``; return this rank's chunk.

    On ``src``, ``chunks`` is a list of ``size`` arrays of one dtype (shapes may differ), or
    one array split along axis 0 by the :func:`chunk_sizes` rule. Other ranks pass ``None``.
    The result is a NumPy array, or a CuPy array on the current device when ``src`` passed
    CuPy arrays.
    """
    g = _group(group)
    src = _check_root(g, src, "src")
    meta = None
    if g.rank == src:
        if chunks is None:
            raise ValueError(f"rank {g.world.rank}: scatter source must pass chunks, got None")
        if isinstance(chunks, (list, tuple)):
            chunks = [_as_array(c, "chunks[i]") for c in chunks]
            if len(chunks) != g.size:
                raise ValueError(
                    f"rank {g.world.rank}: scatter needs {g.size} chunks (one per rank of {g.name}), "
                    f"got {len(chunks)}"
                )
            dts = {str(c.dtype) for c in chunks}
            if len(dts) > 1:
                raise TypeError(f"rank {g.world.rank}: scatter chunks must share one dtype, got {sorted(dts)}")
        else:
            arr = _as_array(chunks, "chunks")
            if arr.ndim == 0:
                raise ValueError(f"rank {g.world.rank}: cannot scatter a 0-d array; pass a list of chunks")
            sizes = chunk_sizes(arr.shape[0], g.size)
            bounds = np.cumsum([0] + sizes)
            chunks = [arr[bounds[i]:bounds[i + 1]] for i in range(g.size)]
        _check_dtype(g, chunks[0].dtype, "scatter")
        meta = ([c.shape for c in chunks], chunks[0].dtype, _be.is_cupy_array(chunks[0]))  # the dtype, not .str: bfloat16's is "<V2"
    if g.size > 1:
        meta = _host_backend(g).broadcast_object(meta, src)
    shapes, dtstr, on_dev = meta
    if g.size == 1:
        return chunks[0].copy()
    dtype = np.dtype(dtstr)
    counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    if on_dev:  # every rank builds the device backend, also those that pass no chunks
        cp = _be.get_cupy()
        like = chunks[0] if g.rank == src else cp.empty(0, dtype)
    else:
        like = chunks[0] if g.rank == src else np.empty(0, dtype)
    be = _backend(g, like)
    stage = _Staged(be, like)
    send = None
    if g.rank == src:
        xp = _be.get_array_module(chunks[0])
        send = stage.host(xp.concatenate([xp.ravel(c) for c in chunks]))
    recv = stage.empty(like, counts[g.rank], dtype)
    be.scatterv(send, counts, recv, src)
    return stage.back(recv.reshape(shapes[g.rank]), like)


# -- all_to_all ----------------------------------------------------------------------------------
@any_array
def all_to_all(x, group: Optional[ProcessGroup] = None):
    """Personalized exchange: rank ``i`` sends its ``j``-th piece to rank ``j``.

    ``x`` is either a list of ``size`` arrays (one per destination; shapes may differ, one
    dtype) — the result is the list of pieces received, one per source — or one array whose
    axis 0 divides by the group size — the result is an array of the same shape whose
    ``j``-th block came from rank ``j``.
    """
    g = _group(group)
    p = g.size
    if isinstance(x, (list, tuple)):
        pieces = [_as_array(c, "x[i]") for c in x]
        if len(pieces) != p:
            raise ValueError(f"rank {g.world.rank}: all_to_all needs {p} pieces (one per rank), got {len(pieces)}")
        dtypes = {c.dtype for c in pieces}
        if len(dtypes) > 1:
            raise TypeError(f"rank {g.world.rank}: all_to_all pieces must share one dtype, got {sorted(map(str, dtypes))}")
        dtype = pieces[0].dtype
        _check_dtype(g, dtype, "all_to_all")
        _debug(g, "all_to_all", dtype=dtype, form="list")
        shapes_in = _host_backend(g).alltoall_object([c.shape for c in pieces]) if p > 1 else [pieces[0].shape]
        xp = _be.get_array_module(pieces[0])
        send = xp.concatenate([xp.ravel(c) for c in pieces])
        scounts = [int(c.size) for c in pieces]
        rcounts = [int(np.prod(s, dtype=np.int64)) for s in shapes_in]
        be = _backend(g, send)
        stage = _Staged(be, send)
        hsend = stage.host(send)
        recv = stage.empty(hsend, sum(rcounts))
        if p == 1:
            recv[...] = hsend
        else:
            be.alltoallv(hsend, scounts, recv, rcounts)
        return _split_flat(recv, shapes_in, rcounts, stage, send)
    x = _as_array(x)
    if x.ndim == 0 or x.shape[0] % p:
        raise ValueError(
            f"rank {g.world.rank}: all_to_all on an array needs axis 0 divisible by the group size {p}, "
            f"got shape {x.shape}; pass a list of {p} pieces for uneven exchanges"
        )
    _check_dtype(g, x.dtype, "all_to_all")
    _debug(g, "all_to_all", shape=x.shape, dtype=x.dtype)
    be = _backend(g, x)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    recv = stage.empty(send, send.size)
    if p == 1:
        recv[...] = send
    else:
        c = send.size // p
        be.alltoallv(send, [c] * p, recv, [c] * p)
    return stage.back(recv.reshape(x.shape), x)


# -- barrier and point-to-point ----------------------------------------------------------------------
def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank of the group reaches this call."""
    g = _group(group)
    _debug(g, "barrier")
    _host_backend(g).barrier()


def _check_peer(g, peer, what, allow_self=False):
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise TypeError(f"rank {g.world.rank}: {what} must be an int group rank, got {peer!r}")
    if not 0 <= peer < g.size:
        raise ValueError(
            f"rank {g.world.rank}: {what}={peer} is out of range for {g.name} of size {g.size} "
            f"(valid: 0..{g.size - 1}; ranks are group-relative)"
        )
    if peer == g.rank and not allow_self:
        raise ValueError(
            f"rank {g.world.rank}: {what}={peer} is this rank itself; a self-send would hang "
            "(pair it with its receive in one batch_isend_irecv)"
        )
    return int(peer)


def _check_tag(g, tag, what="tag"):
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= g.max_tag:
        raise ValueError(f"rank {g.world.rank}: {what}={tag!r} must be an int in 0..{g.max_tag}")
    return int(tag)


def _send_buf(g, x, what):
    """(backend, the contiguous buffer to send) for array ``x``."""
    x = _as_array(x, what)
    _check_dtype(g, x.dtype, what)
    be = _backend(g, x)
    return be, _Staged(be, x).host(_flat(x))


def _recv_buf(g, x, what):
    """(x, backend, buffer the backend fills, finish) for receiving into array ``x``.

    The backend writes straight into ``x`` when it can (contiguous, memory it moves);
    otherwise into a temporary that ``finish()`` copies into ``x``.
    """
    x = _as_array(x, what)
    _check_dtype(g, x.dtype, what)
    if type(x) is _ND and not x.flags.writeable:
        raise ValueError(f"rank {g.world.rank}: {what} is read-only; a receive writes into it")
    be = _backend(g, x)
    stage = _Staged(be, x)
    if not stage.dev and x.flags.c_contiguous:
        return x, be, x.reshape(-1), None
    buf = stage.empty(x, x.size)

    def finish():
        stage.fill(x, buf)
        return x

    return x, be, buf, finish


@any_array
def send(x, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
    """Send array ``x`` to group rank ``dst`` (blocking). The receiver needs a buffer of the same size."""
    g = _group(group)
    dst = _check_peer(g, dst, "dst")
    tag = _check_tag(g, tag)
    be, buf = _send_buf(g, x, "x")
    be.send(buf, dst, tag)


@any_array
def recv(x, src: int, group: Optional[ProcessGroup] = None, tag: int = 0):
    """Receive into array ``x`` (in place) from group rank ``src``; return ``x``."""
    g = _group(group)
    src = _check_peer(g, src, "src")
    tag = _check_tag(g, tag)
    x, be, buf, finish = _recv_buf(g, x, "x")
    be.recv(buf, src, tag)
    return x if finish is None else finish()


@any_array
def isend(x, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    """Non-blocking :func:`send`; returns a :class:`Work` (keep it and ``wait()`` on it).

    ``x`` must stay unmodified until the Work completes (it may be sent from in place).
    """
    g = _group(group)
    dst = _check_peer(g, dst, "dst")
    tag = _check_tag(g, tag)
    be, buf = _send_buf(g, x, "x")
    return Work(be.isend(buf, dst, tag), keep=buf)


@any_array
def irecv(x, src: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    """Non-blocking :func:`recv` into ``x``; ``wait()`` returns ``x`` once filled."""
    g = _group(group)
    src = _check_peer(g, src, "src")
    tag = _check_tag(g, tag)
    x, be, buf, finish = _recv_buf(g, x, "x")
    if finish is None:
        return Work(be.irecv(buf, src, tag), result=x, keep=x)
    return Work(be.irecv(buf, src, tag), finish=finish, keep=buf)


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (PyTorch's ``P2POp``).

    Args:
        op: :func:`axonmpi.isend` or :func:`axonmpi.irecv`.
        tensor: the NumPy/CuPy array to send, or to receive into (in place).
        peer: the group rank to send to or receive from (with ``group=None``, the world rank,
            as in PyTorch). May be this rank itself when the batch also holds the other end.
        group: the process group (default: all ranks). Every op of a batch uses one group.
        tag: message tag, an int in ``0..group.max_tag`` (matched by the MPI backend).

    Example:
        >>> ops = [P2POp(axonmpi.isend, x, (r + 1) % n), P2POp(axonmpi.irecv, y, (r - 1) % n)]
        >>> for work in axonmpi.batch_isend_irecv(ops):
        ...     work.wait()
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag")

    def __init__(self, op, tensor, peer: int, group: Optional[ProcessGroup] = None, tag: int = 0):
        if op is not isend and op is not irecv:
            name = getattr(op, "__name__", repr(op))
            raise ValueError(f"P2POp op must be axonmpi.isend or axonmpi.irecv, got {name}")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag

    def __repr__(self) -> str:
        shape = getattr(self.tensor, "shape", "?")
        return f"P2POp({self.op.__name__}, shape={shape}, peer={self.peer}, tag={self.tag})"


@any_array_p2p
def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> List[Work]:
    """Start a batch of sends and receives together; return one :class:`Work` per op, in order.

    PyTorch's ``batch_isend_irecv``. The operations may be listed in any order — all sends
    before all receives included — without deadlock, as long as each peer posts the matching
    operations; a rank may send to itself within a batch. Every argument is checked on every
    op before anything starts. Arrays must stay alive and unmodified (sends) or unread
    (receives) until their Work completes; ``wait()`` on a receive returns its array.

    Args:
        p2p_op_list: a non-empty list of :class:`P2POp`, all on one group.

    Returns:
        A list of :class:`Work`, one per op.

    Example (a ring over all ranks):
        >>> r, n = axonmpi.rank(), axonmpi.world_size()
        >>> got = np.empty(3)
        >>> works = axonmpi.batch_isend_irecv([
        ...     P2POp(axonmpi.irecv, got, (r - 1) % n), P2POp(axonmpi.isend, np.full(3, r), (r + 1) % n)])
        >>> [w.wait() for w in works]              # got == rank r - 1's values
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"batch_isend_irecv needs a non-empty list of P2POp, got {p2p_op_list!r}")
    for i, o in enumerate(p2p_op_list):
        if not isinstance(o, P2POp):
            raise TypeError(f"batch_isend_irecv op {i} must be a P2POp, got {type(o).__name__}")
    g = _group(p2p_op_list[0].group)
    plans = []
    for i, o in enumerate(p2p_op_list):
        if o.group is not p2p_op_list[0].group and _group(o.group) is not g:
            raise ValueError(
                f"rank {g.world.rank}: batch_isend_irecv op {i} is on {_group(o.group).name}, op 0 on "
                f"{g.name}; all ops of one batch use one group"
            )
        what = f"batch_isend_irecv op {i} ({o.op.__name__}) peer"
        peer = _check_peer(g, o.peer, what, allow_self=True)
        tag = _check_tag(g, o.tag, f"batch_isend_irecv op {i} tag")
        if o.op is isend:
            be, buf = _send_buf(g, o.tensor, f"op {i} tensor")
            plans.append((be, P2PBuffer(True, buf, peer, tag), None, buf))
        else:
            x, be, buf, finish = _recv_buf(g, o.tensor, f"op {i} tensor")
            plans.append((be, P2PBuffer(False, buf, peer, tag), finish, x))
    reqs: List[Any] = [None] * len(plans)
    by_backend = {}
    for i, (be, pb, _, _) in enumerate(plans):
        by_backend.setdefault(id(be), (be, []))[1].append(i)
    for be, idx in by_backend.values():
        for i, req in zip(idx, be.batch_isend_irecv([plans[i][1] for i in idx])):
            reqs[i] = req
    works = []
    for (be, pb, finish, x), req in zip(plans, reqs):
        if pb.is_send:
            works.append(Work(req, keep=pb.buf))
        elif finish is None:
            works.append(Work(req, result=x, keep=x))
        else:
            works.append(Work(req, finish=finish, keep=pb.buf))
    return works


# -- picklable objects ---------------------------------------------------------------------------
def broadcast_object(obj: Any, src: int = 0, group: Optional[ProcessGroup] = None) -> Any:
    """Broadcast any picklable object from group rank ``src``; every rank returns it."""
    g = _group(group)
    src = _check_root(g, src, "src")
    _debug(g, "broadcast_object", src=src)
    return _host_backend(g).broadcast_object(obj, src) if g.size > 1 else obj


def all_gather_object(obj: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Gather a picklable object from every rank onto every rank (list in group-rank order)."""
    g = _group(group)
    _debug(g, "all_gather_object")
    return _host_backend(g).allgather_object(obj) if g.size > 1 else [obj]


def gather_object(obj: Any, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Gather a picklable object on group rank ``dst`` (list there, ``None`` elsewhere)."""
    g = _group(group)
    dst = _check_root(g, dst, "dst")
    _debug(g, "gather_object", dst=dst)
    return _host_backend(g).gather_object(obj, dst) if g.size > 1 else [obj]
