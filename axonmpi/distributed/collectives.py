"""Collectives over process groups: all_reduce, broadcast, all_gather, reduce_scatter, ... on NumPy/CuPy arrays.

Conventions (shared by every function here):

* ``group=None`` means the current World's default group (all ranks).
* Out-of-place by default: the result is a new array. Pass ``out=`` to write into an
  existing array; ``out=x`` reduces in place (MPI_IN_PLACE when ``x`` is contiguous).
* Non-contiguous inputs are copied to contiguous buffers; 0-d and empty arrays work.
* Uneven sizes follow one rule, the :func:`chunk_sizes` rule (``numpy.array_split``'s):
  ``n`` rows over ``p`` ranks gives the first ``n % p`` ranks one extra row. No padding.
* ``async_op=True`` returns a :class:`Work` whose ``wait()`` returns the result.
* CuPy arrays go to the backend directly when it can take device memory (NCCL, or MPI
  declared CUDA-aware with ``AXONMPI_CUDA_AWARE_MPI=1``); otherwise they are staged
  through host memory. The CPU path never imports CuPy.
"""
from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import backend as _be
from .backends.mpi import MPIBackend, cuda_aware_mpi
from .group import ProcessGroup
from .reduce_op import ReduceOp, mpi_op
from .work import Work
from . import world as _world_mod
from .world import resolve_group

__all__ = [
    "ReduceOp", "Work", "chunk_sizes", "chunk_bounds",
    "all_reduce", "all_reduce_sum", "all_reduce_mean", "all_reduce_min", "all_reduce_max",
    "all_reduce_product", "reduce", "broadcast", "all_gather", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_sum", "reduce_scatter_mean", "all_to_all", "barrier",
    "send", "recv", "isend", "irecv",
    "broadcast_object", "all_gather_object", "gather_object",
]

_SUM = ReduceOp.SUM
_MEAN = ReduceOp.MEAN
_ND = np.ndarray
_IN_PLACE = MPI.IN_PLACE
_FAST_OPS = {}  # (op name, dtype.num) -> MPI.Op, filled once a pair has passed the checks


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


def _backend(g: ProcessGroup, arr) -> MPIBackend:
    """The backend serving ``arr`` on group ``g`` (cached per group)."""
    if type(arr) is _ND:
        b = g._backends.get("mpi")
        if b is None:
            b = g._backends["mpi"] = MPIBackend(g)
        return b
    if _be.is_cupy_array(arr):
        b = g._backends.get("device")
        if b is None:
            b = g._backends["device"] = _device_backend(g)
        return b
    return _backend(g, np.asarray(arr))


def _device_backend(g: ProcessGroup):
    return MPIBackend(g, device_buffers=cuda_aware_mpi())


def _as_array(x, name: str = "x"):
    if type(x) is _ND or _be.is_cupy_array(x):
        return x
    if hasattr(x, "data") and (type(x.data) is _ND or _be.is_cupy_array(x.data)):
        raise TypeError(
            f"{name} is a {type(x).__name__}; collectives move arrays — pass {name}.data "
            "(differentiable collectives live in axonmpi.parallel.tensor)"
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


@functools.lru_cache(maxsize=None)
def _mpi_has_float16() -> bool:
    try:
        a = np.ones(1, np.float16)
        b = np.zeros(1, np.float16)
        MPI.COMM_SELF.Allreduce(a, b, MPI.SUM)
        return bool(b[0] == 1)
    except Exception:
        return False


def _movable(a):
    """A view MPI can move: float16 as raw bytes where the MPI lacks a half type."""
    if a.dtype.kind == "V" or (a.dtype == np.float16 and not _mpi_has_float16()):
        return a.view(np.uint8)
    return a


class _Staged:
    """Stage device arrays through the host for a backend that only moves host memory."""

    __slots__ = ("dev", "direct")

    def __init__(self, be, arr):
        on_gpu = type(arr) is not _ND and _be.is_cupy_array(arr)
        self.dev = on_gpu and be.host_only          # staged through host copies
        self.direct = on_gpu and not be.host_only   # device pointers handed to the backend

    def host(self, a):
        return a.get() if (self.dev and a is not None) else a

    def sync(self):
        """Before a backend reads device memory directly, finish the kernels that wrote it."""
        if self.direct:
            _be.get_cupy().cuda.get_current_stream().synchronize()


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
    """Run a prepared collective: a copy at size 1, a non-blocking :class:`Work` when asked (host
    buffers), else blocking; ``finish`` turns ``recv`` into the caller's result."""
    if g.size == 1:
        if send is not recv:
            recv[...] = send
    elif async_op and not stage.dev:
        return Work(start(), finish=finish, keep=(send, recv))
    else:
        run()
    res = finish()
    return Work(result=res) if async_op else res


def _via_float32(fn, x, out, async_op):
    """Reduce float16 in float32 where the MPI has no half type; cast back into ``out`` if given."""
    res = fn(x.astype(np.float32)).astype(np.float16)
    if out is not None:
        out[...] = res
        res = out
    return Work(result=res) if async_op else res


def _scale_mean(arr, size):
    if size != 1:
        xp = _be.get_array_module(arr)
        xp.true_divide(arr, size, out=arr)
    return arr


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
    g = _group(group)
    if type(op) is not ReduceOp:
        op = ReduceOp.coerce(op)
    if type(x) is _ND and not async_op and g.size > 1 and not g.world.debug and x.flags.c_contiguous:
        mop = _FAST_OPS.get((op._value_, x.dtype.num))          # hot path: one MPI call, no staging
        if mop is not None:
            if out is x:
                g.comm.Allreduce(_IN_PLACE, x, mop)
                recv = x
            elif out is None:
                recv = np.empty_like(x)
                g.comm.Allreduce(x, recv, mop)
            else:
                recv = None
            if recv is not None:
                if op is _MEAN:
                    np.true_divide(recv, g.size, out=recv)
                return recv
    x = _as_array(x)
    if g.world.debug:
        _debug(g, "all_reduce", shape=x.shape, dtype=x.dtype, op=op)
    be = _backend(g, x)
    mop = mpi_op(op, x.dtype, g.world.rank)  # dtype/op check on every rank, even at size 1
    if x.dtype != np.float16 or _mpi_has_float16():
        _FAST_OPS[(op._value_, x.dtype.num)] = mop
    if out is not None and out is not x:
        _check_out(g, out, x.shape, x.dtype, "all_reduce")
    target = out
    if x.dtype == np.float16 and not _mpi_has_float16():
        return _via_float32(lambda y: all_reduce(y, op, g), x, target, async_op)
    stage = _Staged(be, x)
    direct = False  # True when MPI writes straight into the caller's array
    if target is x and x.flags.c_contiguous and not stage.dev:
        send = recv = x.reshape(-1)
        direct = True
    else:
        send = stage.host(_flat(x))
        if target is not None and target.flags.c_contiguous and not stage.dev:
            recv, direct = target.reshape(-1), True
        else:
            recv = (np if stage.dev else _be.get_array_module(send)).empty(send.shape, send.dtype)
    stage.sync()

    def finish():
        if op is _MEAN:
            _scale_mean(recv, g.size)
        if direct:
            return target
        res = recv.reshape(x.shape)
        if stage.dev:
            res = _be.to_device(res, _be.device_of(x))
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
    stage.sync()
    if x.dtype == np.float16 and not _mpi_has_float16():
        r = reduce(x.astype(np.float32), dst, op, g)
        return None if r is None else r.astype(np.float16)
    recv = np.empty_like(send) if stage.dev else _be.get_array_module(send).empty_like(send)
    if g.size == 1:
        recv[...] = send
    else:
        be.reduce(send, recv, op, dst)
    if g.rank != dst:
        return None
    if op is _MEAN:
        _scale_mean(recv, g.size)
    res = recv.reshape(x.shape)
    return _be.to_device(res, _be.device_of(x)) if stage.dev else res


# -- broadcast ---------------------------------------------------------------------------------
def broadcast(x, src: int = 0, group: Optional[ProcessGroup] = None, *, async_op: bool = False):
    """Copy ``x`` from group rank ``src`` into ``x`` on every rank (in place); return ``x``.

    Every rank passes an array of the same shape and dtype; non-source ranks' contents are
    overwritten. Non-contiguous ``x`` is filled through a contiguous copy.

    Example:
        >>> w = np.empty(3) if world.rank else np.arange(3.0)
        >>> axonmpi.broadcast(w, src=0)        # now [0., 1., 2.] everywhere
    """
    g = _group(group)
    if (type(x) is _ND and type(src) is int and 0 <= src < g.size and not g.world.debug
            and x.flags.c_contiguous and x.flags.writeable and x.dtype.kind in "biufc"
            and x.dtype.char != "e"):
        if g.size > 1:
            g.comm.Bcast(x, root=src)
        return Work(result=x) if async_op else x
    x = _as_array(x)
    if type(x) is _ND and not x.flags.writeable:
        raise ValueError(f"rank {g.world.rank}: broadcast writes into x in place; x is read-only")
    src = _check_root(g, src, "src")
    _debug(g, "broadcast", shape=x.shape, dtype=x.dtype, src=src)
    if g.size > 1:
        be = _backend(g, x)
        stage = _Staged(be, x)
        buf = stage.host(_flat(x))
        stage.sync()
        be.broadcast(_movable(buf), src)
        if stage.dev:
            x[...] = _be.get_cupy().asarray(buf.reshape(x.shape))
        elif not np.shares_memory(buf, x):
            x[...] = buf.reshape(x.shape)
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
    g = _group(group)
    p = g.size
    if (type(x) is _ND and axis == 0 and not uneven and not async_op and p > 1 and not g.world.debug
            and x.ndim > 0 and x.flags.c_contiguous and x.dtype.kind in "biufc" and x.dtype.char != "e"):
        shape = (p * x.shape[0],) + x.shape[1:]
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not (type(out) is _ND and out.shape == shape and out.dtype == x.dtype and out.flags.c_contiguous):
            shape = None
        if shape is not None:
            g.comm.Allgather(x, out)
            return out
    x = _as_array(x)
    if x.ndim == 0:
        x = x.reshape(1)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"rank {g.world.rank}: axis {axis} out of range for a {x.ndim}-d array")
    axis %= x.ndim
    if g.world.debug:
        shape = list(x.shape)
        if uneven:
            shape[axis] = "*"
        _debug(g, "all_gather", shape=tuple(shape), dtype=x.dtype, axis=axis, uneven=uneven)
    be = _backend(g, x)
    stage = _Staged(be, x)
    xm = np.moveaxis(x, axis, 0) if axis else x
    send = stage.host(_flat(xm))
    stage.sync()
    xp = np if stage.dev else _be.get_array_module(send)
    rest = xm.shape[1:]
    if uneven:
        rows = np.empty(p, np.int64)
        g.comm.Allgather(np.array([xm.shape[0]], np.int64), rows) if p > 1 else rows.fill(xm.shape[0])
        rowsize = int(np.prod(rest, dtype=np.int64))
        counts = [int(r) * rowsize for r in rows]
        recv = xp.empty(sum(counts), send.dtype)
        if p > 1:
            be.allgatherv(_movable(send), _movable(recv), counts)
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
        recv = out.reshape(-1) if direct else xp.empty(p * send.size, send.dtype)

    def finish():
        if direct:
            return out
        res = recv.reshape(total)
        if axis:
            res = np.moveaxis(res, 0, axis)
            res = xp.ascontiguousarray(res)
        if stage.dev:
            res = _be.to_device(res, _be.device_of(x))
        if out is not None:
            out[...] = res
            return out
        return res

    if uneven:  # already exchanged above
        res = finish()
        return Work(result=res) if async_op else res
    ms, mr = _movable(send), _movable(recv)
    return _complete(g, async_op, stage, send, recv, lambda: be.iallgather(ms, mr),
                     lambda: be.allgather(ms, mr), finish)


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
    g = _group(group)
    if type(op) is not ReduceOp:
        op = ReduceOp.coerce(op)
    p = g.size
    if (type(x) is _ND and not async_op and p > 1 and not g.world.debug and x.ndim > 0
            and x.shape[0] % p == 0 and x.flags.c_contiguous):
        mop = _FAST_OPS.get((op._value_, x.dtype.num))
        shape = (x.shape[0] // p,) + x.shape[1:]
        if mop is not None and (out is None or (type(out) is _ND and out.shape == shape
                                                and out.dtype == x.dtype and out.flags.c_contiguous)):
            recv = np.empty(shape, x.dtype) if out is None else out
            g.comm.Reduce_scatter_block(x, recv, mop)
            if op is _MEAN:
                np.true_divide(recv, p, out=recv)
            return recv
    x = _as_array(x)
    if x.ndim == 0:
        raise ValueError(f"rank {g.world.rank}: reduce_scatter needs at least 1-d input, got a 0-d array")
    _debug(g, "reduce_scatter", shape=x.shape, dtype=x.dtype, op=op)
    mop = mpi_op(op, x.dtype, g.world.rank)
    if x.dtype != np.float16 or _mpi_has_float16():
        _FAST_OPS[(op._value_, x.dtype.num)] = mop
    if x.dtype == np.float16 and not _mpi_has_float16():
        return _via_float32(lambda y: reduce_scatter(y, op, g), x, out, async_op)
    rows = chunk_sizes(x.shape[0], p)
    rowsize = int(np.prod(x.shape[1:], dtype=np.int64))
    counts = [r * rowsize for r in rows]
    my_shape = (rows[g.rank],) + x.shape[1:]
    if out is not None:
        _check_out(g, out, my_shape, x.dtype, "reduce_scatter")
    be = _backend(g, x)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    stage.sync()
    xp = np if stage.dev else _be.get_array_module(send)
    if out is not None and out.flags.c_contiguous and not stage.dev:
        recv = out.reshape(-1)
    else:
        recv = xp.empty(counts[g.rank], send.dtype)

    def finish():
        if op is _MEAN:
            _scale_mean(recv, p)
        res = recv.reshape(my_shape)
        if stage.dev:
            res = _be.to_device(res, _be.device_of(x))
        if out is not None:
            if stage.dev or not np.shares_memory(res, out):
                out[...] = res
            return out
        return res

    return _complete(g, async_op, stage, send, recv, lambda: be.ireduce_scatter(send, recv, counts, op),
                     lambda: be.reduce_scatter(send, recv, counts, op), finish)


def reduce_scatter_sum(x, group=None, **kw):
    """:func:`reduce_scatter` with ``op=SUM``."""
    return reduce_scatter(x, _SUM, group, **kw)


def reduce_scatter_mean(x, group=None, **kw):
    """:func:`reduce_scatter` with ``op=MEAN``."""
    return reduce_scatter(x, _MEAN, group, **kw)


# -- gather / scatter --------------------------------------------------------------------------
def _exchange_meta(g, meta, root):
    """Gather small picklable metadata on ``root`` (list there, None elsewhere)."""
    return g.comm.gather(meta, root=root) if g.size > 1 else [meta]


def gather(x, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Collect every rank's ``x`` on group rank ``dst`` as a list (in group-rank order).

    Shapes may differ across ranks; dtypes must agree. Returns the list on ``dst`` and
    ``None`` elsewhere.
    """
    g = _group(group)
    x = _as_array(x)
    dst = _check_root(g, dst, "dst")
    _debug(g, "gather", dtype=x.dtype, dst=dst)
    be = _backend(g, x)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    stage.sync()
    shapes = _exchange_meta(g, x.shape, dst)
    recv = None
    counts = None
    if g.rank == dst:
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        xp = np if stage.dev else _be.get_array_module(send)
        recv = xp.empty(sum(counts), send.dtype)
    if g.size == 1:
        recv[...] = send
    else:
        be.gatherv(_movable(send), None if recv is None else _movable(recv), counts or [0] * g.size, dst)
    if g.rank != dst:
        return None
    out, o = [], 0
    for s, c in zip(shapes, counts):
        piece = recv[o:o + c].reshape(s)
        out.append(_be.to_device(piece, _be.device_of(x)) if stage.dev else piece)
        o += c
    return out


def scatter(chunks, src: int = 0, group: Optional[ProcessGroup] = None):
    """Send chunk ``i`` from group rank ``src`` to rank ``i``; return this rank's chunk.

    On ``src``, ``chunks`` is a list of ``size`` arrays of one dtype (shapes may differ), or
    one array split along axis 0 by the :func:`chunk_sizes` rule. Other ranks pass ``None``.
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
        meta = ([c.shape for c in chunks], chunks[0].dtype.str, _be.is_cupy_array(chunks[0]))
    if g.size > 1:
        meta = g.comm.bcast(meta, root=src)
    shapes, dtstr, on_dev = meta
    dtype = np.dtype(dtstr)
    counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    if g.size == 1:
        return chunks[0].copy()
    be = _backend(g, np.empty(0)) if not on_dev else _backend(g, chunks[0] if chunks else None)
    send = None
    if g.rank == src:
        xp = _be.get_array_module(chunks[0])
        send = xp.concatenate([xp.ravel(c) for c in chunks]) if chunks else None
        if on_dev and be.host_only:
            send = send.get()
    recv = np.empty(counts[g.rank], dtype)
    be.scatterv(None if send is None else _movable(send), counts, _movable(recv), src)
    res = recv.reshape(shapes[g.rank])
    if on_dev:
        res = _be.to_device(res, _be.Device("cuda", _be.get_cupy().cuda.Device().id))
    return res


# -- all_to_all ----------------------------------------------------------------------------------
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
        _debug(g, "all_to_all", dtype=dtype, form="list")
        shapes_in = g.comm.alltoall([c.shape for c in pieces]) if p > 1 else [pieces[0].shape]
        xp = _be.get_array_module(pieces[0])
        send = xp.concatenate([xp.ravel(c) for c in pieces]) if pieces else xp.empty(0, dtype)
        scounts = [int(c.size) for c in pieces]
        rcounts = [int(np.prod(s, dtype=np.int64)) for s in shapes_in]
        be = _backend(g, send)
        stage = _Staged(be, send)
        hsend = stage.host(send)
        stage.sync()
        recv = (np if stage.dev else xp).empty(sum(rcounts), dtype)
        if p == 1:
            recv[...] = hsend
        else:
            be.alltoallv(_movable(hsend), scounts, _movable(recv), rcounts)
        out, o = [], 0
        for s, c in zip(shapes_in, rcounts):
            piece = recv[o:o + c].reshape(s)
            out.append(_be.to_device(piece, _be.device_of(send)) if stage.dev else piece)
            o += c
        return out
    x = _as_array(x)
    if x.ndim == 0 or x.shape[0] % p:
        raise ValueError(
            f"rank {g.world.rank}: all_to_all on an array needs axis 0 divisible by the group size {p}, "
            f"got shape {x.shape}; pass a list of {p} pieces for uneven exchanges"
        )
    _debug(g, "all_to_all", shape=x.shape, dtype=x.dtype)
    be = _backend(g, x)
    stage = _Staged(be, x)
    send = stage.host(_flat(x))
    stage.sync()
    recv = (np if stage.dev else _be.get_array_module(send)).empty_like(send)
    if p == 1:
        recv[...] = send
    else:
        c = send.size // p
        be.alltoallv(_movable(send), [c] * p, _movable(recv), [c] * p)
    res = recv.reshape(x.shape)
    return _be.to_device(res, _be.device_of(x)) if stage.dev else res


# -- barrier and point-to-point ----------------------------------------------------------------------
def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank of the group reaches this call."""
    g = _group(group)
    _debug(g, "barrier")
    g.comm.Barrier()


def _check_peer(g, peer, what):
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise TypeError(f"rank {g.world.rank}: {what} must be an int group rank, got {peer!r}")
    if not 0 <= peer < g.size:
        raise ValueError(
            f"rank {g.world.rank}: {what}={peer} is out of range for {g.name} of size {g.size} "
            f"(valid: 0..{g.size - 1})"
        )
    if peer == g.rank:
        raise ValueError(f"rank {g.world.rank}: {what}={peer} is this rank itself; blocking self-send would hang")
    return int(peer)


def send(x, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
    """Send array ``x`` to group rank ``dst`` (blocking). The receiver needs a buffer of the same size."""
    g = _group(group)
    x = _as_array(x)
    dst = _check_peer(g, dst, "dst")
    be = _backend(g, x)
    stage = _Staged(be, x)
    buf = stage.host(_flat(x))
    stage.sync()
    be.send(_movable(buf), dst, tag)


def recv(x, src: int, group: Optional[ProcessGroup] = None, tag: int = 0):
    """Receive into array ``x`` (in place) from group rank ``src``; return ``x``."""
    g = _group(group)
    x = _as_array(x)
    src = _check_peer(g, src, "src")
    be = _backend(g, x)
    stage = _Staged(be, x)
    if not stage.dev and x.flags.c_contiguous:
        be.recv(_movable(x.reshape(-1)), src, tag)
        return x
    buf = np.empty(x.size, x.dtype) if stage.dev else np.empty_like(x).reshape(-1)
    be.recv(_movable(buf), src, tag)
    x[...] = _be.get_cupy().asarray(buf.reshape(x.shape)) if stage.dev else buf.reshape(x.shape)
    return x


def isend(x, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    """Non-blocking :func:`send`; returns a :class:`Work` (keep it and ``wait()`` on it)."""
    g = _group(group)
    x = _as_array(x)
    dst = _check_peer(g, dst, "dst")
    be = _backend(g, x)
    stage = _Staged(be, x)
    buf = stage.host(_flat(x))
    stage.sync()
    return Work(be.isend(_movable(buf), dst, tag), keep=buf)


def irecv(x, src: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    """Non-blocking :func:`recv` into ``x``; ``wait()`` returns ``x`` once filled."""
    g = _group(group)
    x = _as_array(x)
    src = _check_peer(g, src, "src")
    be = _backend(g, x)
    stage = _Staged(be, x)
    if not stage.dev and x.flags.c_contiguous:
        return Work(be.irecv(_movable(x.reshape(-1)), src, tag), result=x, keep=x)
    buf = np.empty(x.size, x.dtype)

    def finish():
        x[...] = _be.get_cupy().asarray(buf.reshape(x.shape)) if stage.dev else buf.reshape(x.shape)
        return x

    return Work(be.irecv(_movable(buf), src, tag), finish=finish, keep=buf)


# -- picklable objects ---------------------------------------------------------------------------
def broadcast_object(obj: Any, src: int = 0, group: Optional[ProcessGroup] = None) -> Any:
    """Broadcast any picklable object from group rank ``src``; every rank returns it."""
    g = _group(group)
    src = _check_root(g, src, "src")
    _debug(g, "broadcast_object", src=src)
    return g.comm.bcast(obj, root=src) if g.size > 1 else obj


def all_gather_object(obj: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Gather a picklable object from every rank onto every rank (list in group-rank order)."""
    g = _group(group)
    _debug(g, "all_gather_object")
    return g.comm.allgather(obj) if g.size > 1 else [obj]


def gather_object(obj: Any, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Gather a picklable object on group rank ``dst`` (list there, ``None`` elsewhere)."""
    g = _group(group)
    dst = _check_root(g, dst, "dst")
    _debug(g, "gather_object", dst=dst)
    return g.comm.gather(obj, root=dst) if g.size > 1 else [obj]

