"""``axonmpi.compile``: a training step recorded once after warm-up and replayed (static schedule, or a CUDA graph).

[Note: what compile does] (torch.compile(mode="reduce-overhead")'s idea, Chainer's static_graph, for our engine.)
The step (a function that runs forward, backward, clipping and the optimizer) runs eagerly ``warmup`` times,
then once recorded, then replayed.  On CPU the replay is :mod:`axonmpi.autograd.replay`'s: the step's Python
runs again, checked op by op against the record, and its backward passes run from static plans: bitwise the
eager step (on CuPy arrays too).  With ``cuda_graph=True`` a GPU step is captured into a CUDA graph
(:mod:`axonmpi.graphs.cuda`).  A step that cannot
be captured (a pipeline schedule, MPI collectives under a CUDA graph, ops that differ from the record:
data-dependent shapes or control flow) runs eagerly; the reason is logged once and kept in ``.reason``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..autograd.replay import RECORD, REPLAY, Tape, use_tape
from ..log import get_logger
from .decide import CaptureDecision, CaptureKind, decide_capture

__all__ = ["compile", "CompiledStep", "CaptureDecision", "CaptureKind", "decide_capture"]

_MODES = (None, "default", "reduce-overhead")


def _device_type(args, kwargs) -> str:
    from .. import backend
    from ..autograd.tensor import Tensor
    for a in list(args) + list(kwargs.values()):
        a = a.data if isinstance(a, Tensor) else a
        if backend.is_cupy_array(a):
            return "cuda"
    return "cpu"


class CompiledStep:
    """A step function that is recorded once after ``warmup`` eager calls and replayed after (:func:`compile`).

    Attributes:
        status: ``"warmup"``, ``"replaying"`` or ``"eager"``.
        reason: why the step runs eagerly (None while it is captured).
        kind: the :class:`CaptureKind` chosen at the first capture (None before).
        replays: how many calls ran as replays.
    """

    def __init__(self, fn: Callable, warmup: int = 1, cuda_graph: bool = False):
        if not callable(fn):
            raise TypeError(f"axonmpi.compile: expected a callable step function, got {type(fn).__name__}")
        if int(warmup) < 0:
            raise ValueError(f"axonmpi.compile: warmup must be >= 0, got {warmup}")
        self.fn, self.warmup, self.cuda_graph = fn, int(warmup), bool(cuda_graph)
        self.calls = self.replays = 0
        self.kind: Optional[CaptureKind] = None
        self.reason: Optional[str] = None
        self.tape = Tape()
        self._cuda = None
        self.__wrapped__ = fn

    @property
    def status(self) -> str:
        if self.reason is not None:
            return "eager"
        return "replaying" if self.replays else "warmup"

    def _eager(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            get_logger("axonmpi.compile").warning("%s runs eagerly: %s", getattr(self.fn, "__qualname__",
                                                                              repr(self.fn)), reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.reason is not None or self.calls <= self.warmup:
            return self.fn(*args, **kwargs)
        if self.kind is None:
            self._decide(args, kwargs)
            if self.kind is CaptureKind.EAGER:
                return self.fn(*args, **kwargs)
        if self.kind is CaptureKind.CUDA_GRAPH:
            return self._cuda_call(args, kwargs)
        mode = REPLAY if self.tape.sig and self.tape.reason is None else RECORD
        with use_tape(self.tape, mode):
            out = self.fn(*args, **kwargs)
        if self.tape.reason is not None:
            self._eager(self.tape.reason)
        elif mode == REPLAY:
            self.replays += 1
        return out

    def _decide(self, args, kwargs) -> None:
        device = _device_type(args, kwargs)
        backends, cupy_graphs = (), False
        if device == "cuda":
            from .cuda import cupy_can_capture
            from ..distributed import get_world, is_initialized
            cupy_graphs = cupy_can_capture()
            if is_initialized():
                w = get_world()
                backends = ("nccl",) if getattr(w, "device", None) is not None and \
                    getattr(w.device, "type", "cpu") == "cuda" and _nccl_on(w) else ("mpi",)
        d = decide_capture(self.fn, device_type=device, cuda_graph=self.cuda_graph, collective_backends=backends,
                           cupy_graphs=cupy_graphs)
        self.kind = d.kind
        if d.kind is CaptureKind.EAGER:
            self._eager(d.reason)

    def _cuda_call(self, args, kwargs):
        from .cuda import CaptureFailed, CudaGraphStep
        if self._cuda is None:
            self._cuda = CudaGraphStep(self.fn)
        try:
            out = self._cuda(*args, **kwargs)
        except CaptureFailed as e:
            self.kind = CaptureKind.EAGER
            self._eager(str(e))
            return self.fn(*args, **kwargs)
        self.replays += 1
        return out


def _nccl_on(world) -> bool:
    try:
        from ..distributed.backends import nccl_available
        return bool(nccl_available())
    except Exception:
        return False


def compile(model: Optional[Callable] = None, *, mode: Optional[str] = None, warmup: int = 1,
            cuda_graph: bool = False, fullgraph: bool = False, dynamic: Optional[bool] = None, backend: Any = None,
            options: Any = None, disable: bool = False):
    """Record a training step once after warm-up and replay it (``torch.compile(mode="reduce-overhead")``-like).

    Compile the *step* (forward, backward, clipping, optimizer): on CPU its backward passes then run from a
    static plan without the autograd engine's bookkeeping, bitwise equal to the eager step, and so on a GPU by
    default; with ``cuda_graph=True`` the GPU step becomes one CUDA graph.  A step that cannot be captured runs
    eagerly and says why once (logged, and in ``.reason``).  A :class:`~axonmpi.nn.Module` passed here
    (nanoGPT's ``model = torch.compile(model)``) is returned as it is: its forward alone has no backward to replay.

    Args:
        model: the step function (or a Module, returned unchanged); left out, a decorator is returned.
        mode: ``None``, ``"default"`` or ``"reduce-overhead"`` (the same here); others raise NotImplementedError.
        warmup: eager calls before the capture (lazy state: optimizer moments, NCCL communicators).
        cuda_graph: on CuPy arrays, capture a CUDA graph (:mod:`axonmpi.graphs.cuda`): only for a step that reads
            no host value that changes per step (an optimizer whose step count and learning rate live on the
            device); the graph replays the captured kernels with the captured scalars.
        fullgraph, dynamic, backend, options: torch's; accepted for ported code, not used.
        disable: True returns ``model`` unchanged.

    Returns:
        A :class:`CompiledStep` (or the Module).

    Example:
        >>> @axonmpi.compile
        ... def train_step(x, y):
        ...     opt.zero_grad(); _, loss = model(x, y); loss.backward()
        ...     clip_grad_norm_(model.parameters(), 1.0); opt.step()
        ...     return loss
        >>> for x, y in batches:
        ...     loss = train_step(x, y)          # read loss.item() only when you log it
    """
    if mode not in _MODES:
        raise NotImplementedError(f"axonmpi.compile(mode={mode!r}) is not built: modes {_MODES} record the step "
                                  "once and replay it (no kernel autotuning)")
    if model is None:
        return lambda fn: compile(fn, mode=mode, warmup=warmup, cuda_graph=cuda_graph, disable=disable)
    from ..nn.module import Module
    if disable or isinstance(model, Module):
        return model
    return CompiledStep(model, warmup=warmup, cuda_graph=cuda_graph)
