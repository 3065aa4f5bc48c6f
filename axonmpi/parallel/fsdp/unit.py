"""One FSDP unit: its FlatParameter's gather/free/reduce lifecycle and the unit-boundary Functions.

[Note: FULL_SHARD unit boundary]
NumPy cannot shrink an array that views still point at, so a unit whose forward recorded a
graph would keep its gathered weights alive (every saved input of a matmul is a view of the
gathered buffer) until backward, and dropping our reference would free nothing. Two ways out:

* NumPy (``mode="remap"``): each unit gathers into one buffer of its own, an anonymous memory
  mapping. The forward records its graph as usual (saved arrays view the buffer); "free" drops
  the parameters' views and returns the buffer's pages to the OS (``madvise(MADV_DONTNEED)``:
  the mapping stays, its memory is released, reads would give zeros). :class:`_PreBackward`, an
  identity Function on the unit's outputs, runs in backward before any node of the unit: it
  gathers the unit again into the same buffer (so every saved view sees the parameters again)
  and issues the prefetch of the unit before it. When the unit's last parameter gradient is
  final (post-accumulate-grad hooks) its reduce-scatter is launched, non-blocking, and the
  pages are released again. This is PyTorch's "resize the storage to 0" in NumPy terms.
* Other array modules (``mode="recompute"``): the unit runs inside :class:`_UnitCall`, a
  Function whose forward computes the unit under ``no_grad`` with the gathered parameters and
  frees them right after, keeping only the unit's inputs; its backward gathers the parameters
  again (the backward prefetch of the unit before it is issued first), recomputes the unit's
  forward with the RNG state of the first pass, back-propagates the incoming gradient through
  it, frees the parameters and hands the unit to the runtime, which launches its
  reduce-scatter at once, non-blocking. The price is one extra forward of each unit (as
  activation checkpointing); the gain is that no gathered unit outlives its compute, so the
  peak is the sharded state plus the unit(s) in flight.

[Note: FSDP hot path]
What a step costs beyond DDP's compute, and how it is kept small:

* A shard group of one (1 rank, NO_SHARD, HYBRID_SHARD with shards of one) has nothing to
  gather: the shard is the whole unit. Such a unit's gather is ``unshard(alias=True)``, which
  binds the parameters to views of the shard itself (:meth:`FSDPUnit.aliases_shard`): no
  copy, no buffer, no communication, and "free" only unbinds the views (the optimizer's
  in-place step is what the next forward sees). The unit keeps its mode (a remap unit's
  graph views the shard; a recompute unit still recomputes). Only a compute-dtype cast
  (mixed precision) or a device move still copies.
* Gradients are not pre-bound to a zeroed flat buffer: the engine stores each parameter's
  gradient as the array backward made (no copy), and the unit's reduction packs them into
  the flat (padded) buffer once, then drops them (one copy instead of zero-fill plus an
  accumulate pass). Over a group of one the packed buffer is ``.grad`` itself (the mean over
  one rank); otherwise it is reduce-scattered, non-blocking.
* With NumPy every sharded unit (any mode) gathers into one buffer of its own, allocated once
  on a 2 MiB boundary with transparent huge pages, and "free" returns its pages with
  ``MADV_DONTNEED``. Re-faulting 4K pages after each free cost about three times the copy
  itself (the kernel zeroes and maps 512 times more pages); huge pages make it close to a copy.
* In-flight gathers and reductions are tested at unit boundaries (MPI progress without a
  progress thread); events are recorded only with ``record_events=True``.
"""
from __future__ import annotations

import mmap
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ...autograd import Function, Tensor, backward, enable_grad, no_grad
from ...backend import device_of, get_array_module
from ...distributed import ReduceOp, Work, all_reduce
from ... import random as _random
from .._flat import FlatParameter

__all__ = ["FSDPUnit"]


class FSDPUnit:
    """A module whose parameters FSDP gathers, frees and reduces together (one FlatParameter).

    Attributes:
        name: qualified name of the module (``""`` for the root unit).
        module: the module.
        flat: its :class:`FlatParameter` (``None`` when it holds no parameters).
        mode: ``"keep"`` (gathered from forward until its gradients are complete: root unit,
            SHARD_GRAD_OP, NO_SHARD), ``"remap"`` or ``"recompute"`` (FULL_SHARD / HYBRID_SHARD
            child units; see the module notes).
    """

    def __init__(self, name: str, module, flat: Optional[FlatParameter], runtime, *, mode: str):
        self.name = name
        self.module = module
        self.flat = flat
        self.rt = runtime
        self.replicate_group = runtime.replicate_group    # its own FSDP instance's (nested FSDP keeps it)
        self.mode = mode
        self.recompute = mode == "recompute"
        self._map = None            # the mmap behind the gather buffer (NumPy, sharded units)
        self._alias: Optional[bool] = None      # aliases_shard(), once known
        self._replicas_done = True
        self._buf = None
        self.n_params = 0 if flat is None else len(flat.params)
        self.n_ready = 0            # parameters whose gradient of this backward is final
        self._deferred: dict = {}   # parameters ready inside a recomputation pass, counted at the pass's end
        self.n_fwd = 0              # forward calls this step
        self.n_bwd = 0              # backward calls completed this step
        self.complete = False
        self.work: Optional[Work] = None
        self._orig_forward: Optional[Callable] = None

    def aliases_shard(self) -> bool:
        """True when gathering this unit copies nothing: its shard group has one rank and it
        computes in the shard's own dtype on the shard's device (the shard is the whole unit)."""
        if self._alias is None:
            f = self.flat
            self._alias = (f is not None and f.world_size == 1
                           and np.dtype(self.rt.param_dtype or f.data.dtype) == f.data.dtype
                           and self.rt.compute_device == device_of(f.data))
        return self._alias

    @property
    def label(self) -> str:
        return self.name or "<root>"

    # -- parameters ----------------------------------------------------------------------------
    def _gather_args(self):
        f = self.flat
        kw = dict(dtype=self.rt.param_dtype, device=self.rt.compute_device)
        if self.aliases_shard():
            kw["alias"] = True      # the parameters view the shard: no buffer, no copy (any mode)
        elif self.mode == "remap" or (f.world_size > 1 and get_array_module(f.data) is np
                                    and hasattr(mmap, "MADV_DONTNEED")):
            # one buffer per unit for every gather (no allocation, no 4K faults; freeing returns
            # its pages to the OS)
            if self._buf is None:
                self._map, self._buf = _gather_buffer(f.world_size * f.padded_size,
                                                      np.dtype(self.rt.param_dtype or f.data.dtype))
            kw["out"] = self._buf
        return kw

    def prefetch(self) -> None:
        """Start the all-gather of this unit, non-blocking (no-op when gathered or in flight)."""
        f = self.flat
        if f is None or f.full is not None or f._gather is not None:
            return
        self.rt._event("prefetch", self.name)
        work = f.unshard(async_op=True, **self._gather_args())
        self.rt._note_gathered()
        work.is_completed()         # drive MPI progress once: the handshake starts before we compute

    def gather(self) -> None:
        """Make the parameters whole (waits for a prefetch in flight)."""
        if self.flat is None:
            return
        self.rt._event("gather", self.name)
        self.flat.unshard(**self._gather_args())
        self.rt._note_gathered()

    def free(self) -> None:
        """Free the gathered parameters (the shard stays)."""
        if self.flat is not None and (self.flat.full is not None or self.flat._gather is not None):
            self.flat.reshard()
            if self._map is not None:
                self._map.madvise(mmap.MADV_DONTNEED)
            self.rt._event("free", self.name)

    # -- gradients -----------------------------------------------------------------------------
    def reset(self) -> None:
        self.n_ready = self.n_fwd = self.n_bwd = 0
        self._deferred = {}
        self.complete = self.flat is None or not self.flat.requires_grad
        self.work = None

    def on_param_ready(self, param) -> None:
        from ...autograd.function import backward_depth, queue_callback
        if backward_depth() > 1 or self.rt.defer_to_end:
            # [Note: DDP and activation checkpointing] (ddp.py): inside a recomputation pass a parameter may get more
            # contributions later in the outer pass; the unit counts it once, at the end of the outermost pass
            if not self._deferred:
                queue_callback(self._ready_deferred)
            self._deferred[id(param)] = param
            return
        self._count()

    def _ready_deferred(self) -> None:
        n, self._deferred = len(self._deferred), {}
        for _ in range(n):
            self._count()

    def _count(self) -> None:
        self.n_ready += 1
        if self.n_ready == self.n_params:
            self.rt._unit_complete(self)

    def launch_reduce(self) -> None:
        """Reduce-scatter the unit's gradients over its shard group, non-blocking."""
        self.rt._event("reduce", self.name)
        self.work = self.flat.reduce_grad(ReduceOp.MEAN, async_op=True, reduce_dtype=self.rt.reduce_dtype)
        rep = self.replicate_group
        self._replicas_done = rep is None or rep.size == 1
        if not self._replicas_done and self.flat.world_size == 1:     # NO_SHARD: overlap the all-reduce too
            self.work.wait()
            g = self.flat.grad.data
            self.work = all_reduce(g, ReduceOp.MEAN, rep, out=g, async_op=True)
            self._replicas_done = True

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter; average the shard's gradient over the replicas (HYBRID / NO_SHARD)."""
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        if not self._replicas_done:
            g = self.flat.grad.data
            all_reduce(g, ReduceOp.MEAN, self.replicate_group, out=g)

    # -- the FULL_SHARD boundary ---------------------------------------------------------------
    def call(self, *args, **kwargs):
        """The unit's forward as the wrapped model calls it."""
        rt = self.rt
        rt._check_active(self)
        pos = rt._enter_forward(self)
        self.gather()
        rt._prefetch_after(pos)
        training = self.flat is not None and self.flat.requires_grad and _grad_on()
        rt._event("forward_start", self.name)
        try:
            if not training or self.mode == "keep":
                out = self._orig_forward(*args, **kwargs)
                if self.mode != "keep":
                    self.free()
            elif self.mode == "remap":
                out = self._orig_forward(*args, **kwargs)
                outs = _outputs(self, out)
                if any(o.requires_grad for o in outs):
                    res = _PreBackward.apply(self, pos, rt._anchor, *outs)
                    out = res if isinstance(out, Tensor) else tuple(res)
                self.free()
            else:
                for k, v in kwargs.items():
                    if isinstance(v, Tensor) and v.requires_grad:
                        raise NotImplementedError(
                            f"FSDP unit {self.label}: keyword argument {k!r} is a Tensor that requires grad; "
                            "pass differentiable inputs positionally")
                self.n_fwd += 1
                call = _Call(self, args, kwargs, pos)
                tensors = [a for a in args if isinstance(a, Tensor)]
                res = _UnitCall.apply(call, rt._anchor, *tensors)
                out = res if call.out_kind == "tensor" else tuple(res)
        finally:
            rt._event("forward_end", self.name)
        return out


_HUGE = 2 << 20     # a transparent huge page (x86-64, arm64 with 4K pages)


def _gather_buffer(count: int, dtype):
    """``(mmap, array)``: an anonymous mapping holding ``count`` elements, for a "remap" unit.

    Every gather after a free faults the buffer's pages in again (the kernel hands out zeroed
    pages); with 4K pages that costs several times the copy itself. A buffer of at least one
    huge page therefore starts on a 2 MiB boundary (the mapping is 2 MiB longer; the unused head
    is never touched, so never resident) and asks for transparent huge pages
    (``MADV_HUGEPAGE``): 512 times fewer faults. Where THP is off this is a no-op.
    """
    nbytes = max(1, count * dtype.itemsize)
    huge = nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE")
    m = mmap.mmap(-1, nbytes + (_HUGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = 0
    if huge:
        addr = np.frombuffer(m, np.uint8, count=1).ctypes.data
        off = -addr % _HUGE
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:         # THP unsupported here: 4K pages, still correct
            pass
    return m, np.frombuffer(m, dtype=dtype, count=count, offset=off)


def _outputs(unit: FSDPUnit, out) -> List[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, tuple) and out and all(isinstance(o, Tensor) for o in out):
        return list(out)
    raise NotImplementedError(
        f"FSDP unit {unit.label} returned {type(out).__name__}; a FULL_SHARD unit must return a "
        "Tensor or a tuple of Tensors")


class _PreBackward(Function):
    """Identity on a unit's outputs; in backward, re-gathers the unit before any of its nodes runs."""

    @staticmethod
    def forward(ctx, unit, pos, anchor, *arrays):
        ctx.unit, ctx.pos = unit, pos
        return arrays[0] if len(arrays) == 1 else tuple(arrays)

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        if not unit.complete:
            unit.gather()
            unit.rt._prefetch_before(ctx.pos)
        return (None, None, None, *grads)


def _grad_on() -> bool:
    from ...autograd import is_grad_enabled
    return is_grad_enabled()


class _Call:
    """One forward call of a FULL_SHARD unit: what its backward needs to recompute it."""

    def __init__(self, unit: FSDPUnit, args: Sequence[Any], kwargs, pos: int):
        self.unit = unit
        self.args = list(args)
        self.kwargs = kwargs
        self.pos = pos
        self.tensor_pos = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        self.rng = _random.get_rng_state()
        self.out_kind = "tensor"

    def _rebuild(self, arrays, needs):
        args = list(self.args)
        for i, a, n in zip(self.tensor_pos, arrays, needs):
            args[i] = Tensor(a, requires_grad=n)
        return args

    def _outputs(self, out) -> List[Tensor]:
        if isinstance(out, Tensor):
            self.out_kind = "tensor"
            return [out]
        if isinstance(out, tuple) and out and all(isinstance(o, Tensor) for o in out):
            self.out_kind = "tuple"
            return list(out)
        raise NotImplementedError(
            f"FSDP unit {self.unit.label} returned {type(out).__name__}; a FULL_SHARD unit must return a "
            "Tensor or a tuple of Tensors")

    def forward(self, arrays):
        with no_grad():
            outs = self._outputs(self.unit._orig_forward(*self._rebuild(arrays, [False] * len(arrays)),
                                                         **self.kwargs))
        self.unit.free()
        data = [o.data for o in outs]
        return data[0] if self.out_kind == "tensor" else tuple(data)

    def backward(self, arrays, needs, grads):
        unit, rt = self.unit, self.unit.rt
        unit.gather()
        rt._prefetch_before(self.pos)
        now = _random.get_rng_state()
        _random.set_rng_state(self.rng)
        try:
            with enable_grad():
                inputs = self._rebuild(arrays, needs)
                outs = self._outputs(unit._orig_forward(*inputs, **self.kwargs))
            roots, gs = [], []
            for o, g in zip(outs, grads):
                if g is not None and o.requires_grad:
                    roots.append(o)
                    gs.append(g)
            if roots:
                backward(roots, gs)
        finally:
            _random.set_rng_state(now)
        unit.free()
        unit.n_bwd += 1
        if unit.n_bwd == unit.n_fwd:
            rt._unit_complete(unit)
        return [None if t.grad is None else t.grad.data for t in (inputs[i] for i in self.tensor_pos)]


class _UnitCall(Function):
    """Forward: the unit under ``no_grad`` on gathered parameters. Backward: re-gather, recompute, backprop."""

    @staticmethod
    def forward(ctx, call: _Call, anchor, *arrays):
        ctx.call = call
        ctx.arrays = arrays
        return call.forward(arrays)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        return (None, None, *ctx.call.backward(ctx.arrays, needs, grads))
