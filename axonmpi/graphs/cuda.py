"""A training step captured into a CUDA graph with CuPy: stream capture, a private memory pool, static inputs.

[Note: the CUDA path of axonmpi.compile]
After the eager warm-up (cuBLAS handles made, NCCL communicators bootstrapped, the optimizer's state allocated),
the step runs once under ``cupy.cuda.Stream.begin_capture`` on a side stream: nothing executes, every kernel
and every NCCL call is recorded into one graph.  Allocations during the capture come from a memory pool of
the graph's own (``cupy.cuda.using_allocator(pool.malloc)``), never used by anything else, so the addresses
the graph holds stay the graph's: torch's ``graph_pool_handle``.  cuBLAS gets a workspace of its own before
the capture (cuBLAS may not allocate inside one).  The inputs are copied into the captured step's input
buffers before each replay; the outputs are the captured step's (overwritten by each replay: copy what you
keep).  A collective over MPI, a host sync (``float(loss)``, ``.get()``, ``.item()``) or a host value that
changes per step (an optimizer that is not ``capturable``) cannot be captured: :func:`decide_capture` refuses
the first and last before the capture; the capture itself fails on a sync, and the step then runs eagerly,
with the error as its reason.  Dropout under a graph replays the captured random stream: capture a step
without dropout.

This module imports without CuPy; it needs CuPy only when a step is captured.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .. import backend as _be

__all__ = ["CudaGraphStep", "CaptureFailed", "cupy_can_capture"]

_CUBLAS_WORKSPACE = 32 * 2 ** 20      # bytes, as torch's CUBLAS_WORKSPACE_CONFIG=:4096:8 on Hopper


class CaptureFailed(RuntimeError):
    """The capture did not complete (a host sync, an MPI call or an allocation outside the pool inside it)."""


def cupy_can_capture() -> bool:
    """True when CuPy imports, sees a GPU and can capture a stream."""
    cp = _be.get_cupy()
    return cp is not None and _be.cupy_available() and hasattr(cp.cuda.Stream, "begin_capture")


def _static_copy(obj, cp):
    """A copy of ``obj``'s CuPy arrays (and Tensors' arrays) in fresh buffers: the graph's input buffers."""
    from ..autograd.tensor import Tensor
    if isinstance(obj, Tensor):
        t = Tensor._wrap(cp.array(obj.data, copy=True))
        t._rg = obj._rg
        return t
    if _be.is_cupy_array(obj):
        return cp.array(obj, copy=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_static_copy(o, cp) for o in obj)
    if isinstance(obj, dict):
        return {k: _static_copy(v, cp) for k, v in obj.items()}
    return obj


def _refill(static, new, cp) -> None:
    """Copy the new inputs into the graph's input buffers (shapes must match the captured ones)."""
    from ..autograd.tensor import Tensor
    if isinstance(static, Tensor):
        static, new = static.data, (new.data if isinstance(new, Tensor) else new)
    if _be.is_cupy_array(static):
        if tuple(new.shape) != tuple(static.shape):
            raise ValueError(f"CUDA graph replay: an input of shape {tuple(new.shape)}; the graph was captured "
                             f"with {tuple(static.shape)} (inputs of a captured step keep their shapes)")
        static[...] = new
    elif isinstance(static, (list, tuple)):
        for s, n in zip(static, new):
            _refill(s, n, cp)
    elif isinstance(static, dict):
        for k in static:
            _refill(static[k], new[k], cp)


def _set_cublas_workspace(cp, pool) -> Optional[Any]:
    """Give the current cuBLAS handle a workspace from ``pool`` (cuBLAS must not allocate inside a capture)."""
    try:
        from cupy_backends.cuda.libs import cublas
    except Exception:
        return None
    if not hasattr(cublas, "setWorkspace"):
        return None
    mem = pool.malloc(_CUBLAS_WORKSPACE)
    cublas.setWorkspace(cp.cuda.device.get_cublas_handle(), mem.ptr, _CUBLAS_WORKSPACE)
    return mem


class CudaGraphStep:
    """``fn(*args, **kwargs)`` captured once into a CUDA graph and replayed.

    Example:
        >>> g = CudaGraphStep(step)
        >>> loss = g(x, y)        # first call: capture, then one replay; later calls: copy inputs, replay
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.graph = None
        self.replays = 0

    def capture(self, args, kwargs):
        cp = _be.get_cupy()
        if cp is None:
            raise CaptureFailed("CuPy is not installed: a CUDA graph needs CuPy")
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.static_args = _static_copy(args, cp)
        self.static_kwargs = _static_copy(kwargs, cp)
        cp.cuda.get_current_stream().synchronize()
        with cp.cuda.using_allocator(self.pool.malloc):
            self._workspace = _set_cublas_workspace(cp, self.pool)
            with self.stream:
                self.stream.begin_capture()
                try:
                    out = self.fn(*self.static_args, **self.static_kwargs)
                except Exception as e:
                    try:
                        self.stream.end_capture()
                    except Exception:
                        pass
                    raise CaptureFailed(f"the capture failed ({type(e).__name__}: {e}); a host sync "
                                        "(float(), .item(), .get()) or an MPI call inside the step?") from e
                self.graph = self.stream.end_capture()
        self.static_out = out
        return out

    def __call__(self, *args, **kwargs):
        cp = _be.get_cupy()
        if self.graph is None:
            self.capture(args, kwargs)
        else:
            with self.stream:
                _refill(self.static_args, args, cp)
                _refill(self.static_kwargs, kwargs, cp)
        self.graph.launch(self.stream)
        self.replays += 1
        cp.cuda.get_current_stream().wait_event(self.stream.record())
        return self.static_out
