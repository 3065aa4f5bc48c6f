"""Host staging and the plumbing every collective shares: group and backend choice, contiguous 1-D
buffers, device arrays staged through host memory (:class:`_Staged`), argument checks, completion.

The public collectives live in :mod:`.array_collectives`, :mod:`.p2p` and :mod:`.object_collectives`
(all re-exported by :mod:`axonmpi.distributed.collectives`); this module's helpers are theirs.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import backend as _be
from .backends import device_backend, host_backend
from .backends.mpi import CudaAwareMPIBackend, MPIBackend, cuda_aware_mpi
from .group import ProcessGroup
from .reduce_op import ReduceOp
from .work import Work
from . import world as _world_mod
from .world import resolve_group

__all__: list = []   # helpers of the collectives' modules only

_SUM = ReduceOp.SUM
_MEAN = ReduceOp.MEAN
_ND = np.ndarray


# -- plumbing (written once) ----------------------------------------------------------------
def _group(group):
    """:func:`resolve_group` with a fast path for the common ``group=None`` case (the grid's ``"world"`` role)."""
    if group is None:
        w = _world_mod._WORLD
        if w is not None and not w._destroyed:
            return w.grid.group_for("world")
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


def _note_shape(g, be, shape) -> None:
    """Tell the always-on check the shape the caller passed: the backend gets a flat buffer, and the check
    compares shapes, not only element counts. Only for the MPI backends (their watched communicator takes
    it at the next call on the group); call it right before that call."""
    w = g._watched
    if w is not None and w.ck is not None and g.size > 1 and isinstance(be, MPIBackend):
        g._sig_shape = tuple(shape)


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
