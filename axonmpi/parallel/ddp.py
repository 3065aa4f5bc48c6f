"""DistributedDataParallel: replicate a module, average gradients over a group in flat buckets, overlapped with backward.

[Note: DDP gradient flow]
Parameters are packed, in reverse registration order (roughly the order backward produces
their gradients), into flat contiguous buckets of at most ``bucket_size_mb``, one per dtype
and device. A post-accumulate-grad hook on every parameter fires as soon as its gradient of
this backward is final; it copies the gradient into the parameter's slice of its bucket,
pre-scaled by 1/size (so a SUM all-reduce yields the mean and no extra pass is needed), and
rebinds ``param.grad`` to that slice. When every parameter of bucket ``i`` is ready and all
buckets before it have been launched, bucket ``i``'s all-reduce is launched (non-blocking
with ``GradSyncStrategy.OVERLAP``), so every rank issues the same collectives in the same
order. When the last parameter is ready, all reductions are waited on, so ``loss.backward()``
returns with averaged gradients. ``sync_gradients()`` does the same explicitly and is
idempotent. With ``find_unused_parameters=True`` the forward pass walks the autograd graph
from the outputs and marks parameters that cannot receive a gradient as ready up front;
parameters unused on every rank keep ``grad=None``.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..autograd import Tensor, no_grad
from ..backend import get_array_module
from ..distributed import ReduceOp, Work, all_reduce, broadcast, resolve_group
from ..nn import Module

__all__ = [
    "DistributedDataParallel", "DDP", "GradSyncStrategy", "GradientBucket", "GradientSynchronizer",
    "allreduce_hook", "fp16_compress_hook",
]


class GradSyncStrategy(enum.Enum):
    """When gradient buckets are all-reduced.

    OVERLAP: each bucket's non-blocking all-reduce starts during backward, as soon as the
        bucket is full (default; hides communication behind the rest of backward).
    AFTER_BACKWARD: all buckets are reduced, one blocking call each, once backward has
        produced every gradient.
    """

    OVERLAP = "overlap"
    AFTER_BACKWARD = "after_backward"


# -- communication hooks ------------------------------------------------------------------------
def allreduce_hook(bucket: "GradientBucket", group) -> Work:
    """Default hook: sum the (pre-scaled) bucket in place with one non-blocking all-reduce."""
    return all_reduce(bucket.buffer, ReduceOp.SUM, group, out=bucket.buffer, async_op=True)


def fp16_compress_hook(bucket: "GradientBucket", group) -> Work:
    """Halve the bytes on the wire: all-reduce a float16 copy, then upcast into the bucket.

    The bucket is already scaled by 1/size, which keeps the float16 sum in range; the upcast
    back to the bucket's dtype is exact, so the only error is float16 rounding of the terms.
    """
    xp = get_array_module(bucket.buffer)
    half = bucket.buffer.astype(xp.float16)
    work = all_reduce(half, ReduceOp.SUM, group, out=half, async_op=True)
    buf = bucket.buffer

    def finish():
        work.wait()
        buf[...] = half
        return buf

    return _ChainedWork(work, finish)


class _ChainedWork(Work):
    """A Work that completes an inner Work, then runs a finishing step."""

    __slots__ = ("_inner", "_then")

    def __init__(self, inner: Work, then: Callable[[], Any]):
        super().__init__(result=None)
        self._done = False
        self._inner, self._then = inner, then

    def wait(self):
        if not self._done:
            self._result = self._then()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        if not self._done and self._inner.is_completed():
            self.wait()
        return self._done


_HOOKS = {None: allreduce_hook, "allreduce": allreduce_hook, "fp16": fp16_compress_hook}


# -- buckets --------------------------------------------------------------------------------------
class GradientBucket:
    """A flat contiguous buffer holding the gradients of several parameters (one MPI call).

    Attributes:
        index: position in launch order.
        params: the parameters, in the order their slices lie in ``buffer``.
        names: their qualified names (for messages).
        buffer: the flat array (parameters' dtype and device).
        views: per parameter, its slice of ``buffer`` reshaped to the parameter's shape.
    """

    def __init__(self, index: int, params: Sequence[Tensor], names: Sequence[str]):
        self.index = index
        self.params = list(params)
        self.names = list(names)
        first = self.params[0].data
        xp = get_array_module(first)
        total = sum(int(p.data.size) for p in self.params)
        self.buffer = xp.zeros(total, dtype=first.dtype)
        self.views = []
        off = 0
        for p in self.params:
            n = int(p.data.size)
            self.views.append(self.buffer[off:off + n].reshape(p.data.shape))
            off += n
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.work: Optional[Work] = None
        self.launched = False

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.work = None
        self.launched = False

    def __repr__(self) -> str:
        return f"GradientBucket(index={self.index}, params={len(self.params)}, bytes={self.nbytes})"


class GradientSynchronizer:
    """Average the gradients of ``named_params`` over ``group`` in flat buckets.

    Used by :class:`DistributedDataParallel`; public for finer control (custom training
    loops, several models sharing one synchronizer, inspecting buckets).

    Args:
        named_params: ``(name, parameter)`` pairs in registration order.
        group: the data-parallel process group (default: all ranks).
        bucket_size_mb: cap of one bucket in MiB (a bigger parameter gets a bucket of its own).
        strategy: a :class:`GradSyncStrategy`.
        comm_hook: ``None``/``"allreduce"``, ``"fp16"``, or ``callable(bucket, group) -> Work``.
        reduce_op: ``ReduceOp.MEAN`` (average, default) or ``ReduceOp.SUM``.
        find_unused_parameters: accept parameters that receive no gradient (see the module note).
        record_events: keep ``events`` (``("ready", name)`` and ``("launch", bucket_index)``)
            for inspection and tests.
    """

    def __init__(self, named_params: Sequence[Tuple[str, Tensor]], group=None, *, bucket_size_mb: float = 25.0,
                 strategy: GradSyncStrategy = GradSyncStrategy.OVERLAP, comm_hook=None,
                 reduce_op: ReduceOp = ReduceOp.MEAN, find_unused_parameters: bool = False,
                 record_events: bool = False):
        self.group = resolve_group(group)
        if not isinstance(strategy, GradSyncStrategy):
            try:
                strategy = GradSyncStrategy(strategy)
            except ValueError:
                raise ValueError(f"unknown grad_sync {strategy!r}; expected one of "
                                 f"{[s.name for s in GradSyncStrategy]}") from None
        self.strategy = strategy
        if comm_hook is None or isinstance(comm_hook, str):
            if comm_hook not in _HOOKS:
                raise ValueError(f"unknown comm_hook {comm_hook!r}; expected 'allreduce', 'fp16' or a callable")
            comm_hook = _HOOKS[comm_hook]
        elif not callable(comm_hook):
            raise TypeError(f"comm_hook must be a name or a callable(bucket, group) -> Work, got {comm_hook!r}")
        self.comm_hook = comm_hook
        reduce_op = ReduceOp.coerce(reduce_op)
        if reduce_op not in (ReduceOp.MEAN, ReduceOp.SUM):
            raise ValueError(f"reduce_op must be MEAN or SUM for gradients, got {reduce_op.name}")
        self.reduce_op = reduce_op
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.bucket_cap = int(bucket_size_mb * (1 << 20))
        self.find_unused_parameters = bool(find_unused_parameters)
        self.events: Optional[List[Tuple[str, Any]]] = [] if record_events else None
        self.enabled = True          # False inside no_sync()
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        if not self.named_params:
            raise ValueError("DDP: the module has no parameter that requires a gradient")
        self.buckets = self._make_buckets()
        self._where = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._next_launch = 0
        self._n_ready = 0
        self._total = len(self.named_params)
        self._active = False         # a backward of a synced step is in progress
        self._local_used: Optional[np.ndarray] = None
        self._finishing = False
        self._flat_index = {id(p): k for k, p in enumerate(p for b in self.buckets for p in b.params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in self.named_params]
        self._scale = 1.0 / self.group.size if reduce_op is ReduceOp.MEAN else 1.0

    # -- layout ------------------------------------------------------------------------------
    def _make_buckets(self) -> List[GradientBucket]:
        buckets: List[GradientBucket] = []
        open_: Dict[Any, Tuple[List, List, int]] = {}
        for name, p in reversed(self.named_params):
            key = (str(p.data.dtype), str(p.device))
            params, names, size = open_.get(key, ([], [], 0))
            nbytes = int(p.data.nbytes)
            if params and size + nbytes > self.bucket_cap:
                buckets.append(GradientBucket(len(buckets), params, names))
                params, names, size = [], [], 0
            params.append(p)
            names.append(name)
            open_[key] = (params, names, size + nbytes)
        for params, names, _ in open_.values():
            if params:
                buckets.append(GradientBucket(len(buckets), params, names))
        return buckets

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the synchronizer stops acting)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the per-step protocol ------------------------------------------------------------------------
    def prepare_forward(self, outputs: Any = None) -> None:
        """Start a step: check the previous one finished; find unused parameters if asked."""
        if self._active and self._n_ready:
            self._raise_unfinished()
        self._reset()
        if self._active and self.find_unused_parameters and outputs is not None:
            reachable = _reachable_leaves(outputs)
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    if id(p) not in reachable:
                        self._mark_unused(b, i)

    def _reset(self) -> None:
        for b in self.buckets:
            b.reset()
        self._next_launch = 0
        self._n_ready = 0
        self._active = self.enabled and self.group.size > 1
        self._local_used = np.ones(self._total, np.uint8) if self.find_unused_parameters else None

    def _raise_unfinished(self) -> None:
        missing = []
        for name, p in self.named_params:
            b, i = self._where[id(p)]
            if not b.ready[i]:
                missing.append(name)
        raise RuntimeError(
            f"rank {self.group.world.rank}: DDP expected every parameter to receive a gradient in the "
            f"previous backward, but these did not: {missing}. Pass find_unused_parameters=True to "
            "DistributedDataParallel if parts of the model are skipped on purpose, or make sure every "
            "parameter takes part in the loss."
        )

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self._active:
            return
        b, i = self._where[id(p)]
        if b.ready[i]:
            return  # a second backward through the same graph (retain_graph) in one step
        view = b.views[i]
        g = p.grad.data
        if g is view:
            if self._scale != 1.0:
                view *= self._scale
        elif self._scale != 1.0:  # copy and pre-scale in one pass
            get_array_module(view).multiply(g, self._scale, out=view)
        else:
            view[...] = g
        p.grad.data = view
        if self.events is not None:
            self.events.append(("ready", b.names[i]))
        self._mark_ready(b, i)

    def _mark_ready(self, b: GradientBucket, i: int) -> None:
        b.ready[i] = True
        b.n_ready += 1
        self._n_ready += 1
        if b.n_ready == len(b.params) and self.strategy is GradSyncStrategy.OVERLAP:
            self._launch_ready_buckets()
        elif self.strategy is GradSyncStrategy.OVERLAP:
            self._poke()
        if self._n_ready == self._total:
            self.finish()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.n_ready < len(b.params):
                break
            self._launch(b)
            self._next_launch += 1
        self._poke()

    def _launch(self, b: GradientBucket) -> None:
        if self.events is not None:
            self.events.append(("launch", b.index))
        b.launched = True
        b.work = self.comm_hook(b, self.group)

    def _poke(self) -> None:
        """Drive MPI progress of in-flight reductions (MPI progresses only inside MPI calls)."""
        for b in self.buckets[: self._next_launch]:
            if b.work is not None and not b.work.is_completed():
                return

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and leave averaged gradients in ``.grad``."""
        if not self._active or self._finishing:
            return
        if self._n_ready < self._total:
            if not self.find_unused_parameters:
                self._raise_unfinished()
            self._finishing = True
            try:
                self._fill_unused()
            finally:
                self._finishing = False
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
                if self.strategy is GradSyncStrategy.AFTER_BACKWARD:
                    b.work.wait()
        for b in self.buckets:
            b.work.wait()
        if self.find_unused_parameters:
            self._apply_global_unused()
        self._active = False
        self._n_ready = 0

    def _mark_unused(self, b: GradientBucket, i: int) -> None:
        """Parameter ``i`` of ``b`` gets no gradient here: contribute zeros, remember it."""
        b.views[i][...] = 0
        self._local_used[self._flat_index[id(b.params[i])]] = 0
        if self.events is not None:
            self.events.append(("unused", b.names[i]))
        self._mark_ready(b, i)

    def _fill_unused(self) -> None:
        for b in self.buckets:
            for i in range(len(b.params)):
                if not b.ready[i] and self._active:
                    self._mark_unused(b, i)

    def _apply_global_unused(self) -> None:
        """Parameters unused on every rank keep ``grad=None``; the others get the averaged slice."""
        glob = all_reduce(self._local_used, ReduceOp.MAX, self.group)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if glob[self._flat_index[id(p)]]:
                    if p.grad is None:
                        p.grad = Tensor(b.views[i])
                    else:
                        p.grad.data = b.views[i]
                else:
                    p.grad = None


def _reachable_leaves(outputs: Any) -> set:
    """ids of the leaf tensors the autograd graph of ``outputs`` reaches."""
    stack, seen, leaves = [], set(), set()
    for t in _tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            leaves.add(id(t))
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for e in getattr(fn, "_edges", ()) or ():
            if e is None:
                continue
            if e[1] < 0:
                leaves.add(id(e[0]))
            elif id(e[0]) not in seen:
                stack.append(e[0])
    return leaves


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o)


# -- the public strategy --------------------------------------------------------------------------------
class DistributedDataParallel(Module):
    """Data parallelism: every rank holds the whole model and trains on its share of the batch.

    After ``loss.backward()`` returns, every parameter's ``.grad`` holds the gradient
    averaged over the group (the gradient of the mean loss over the global batch when all
    local batches have the same size), so ``optimizer.step()`` keeps the replicas equal.

    Args:
        module: the model (an :class:`axonmpi.nn.Module`).
        group: the data-parallel process group (default: all ranks).
        bucket_size_mb: cap of one gradient bucket in MiB (default 25, as PyTorch).
        broadcast_buffers: broadcast buffers from group rank 0 at every forward.
        grad_sync: :class:`GradSyncStrategy` (OVERLAP or AFTER_BACKWARD).
        find_unused_parameters: allow parameters that get no gradient in a step.
        comm_hook: ``None`` (all-reduce), ``"fp16"`` (float16 compression) or a callable
            ``(bucket, group) -> Work`` that reduces ``bucket.buffer`` in place.
        reduce_op: ``ReduceOp.MEAN`` (default) or ``ReduceOp.SUM`` (for unequal local batches:
            scale the loss by local/global batch size yourself and sum).
        sync_params: broadcast parameters and buffers from group rank 0 at construction.
        record_events: keep an event log of hook/launch order in ``ddp.synchronizer.events``.

    Example:
        >>> world = axonmpi.init()
        >>> model = DistributedDataParallel(MLP())
        >>> opt = axonmpi.optim.Adam(model.parameters(), lr=1e-3)
        >>> for x, y in create_dataloader(ds, global_batch_size=256):
        ...     opt.zero_grad()
        ...     loss = F.cross_entropy(model(x), y)
        ...     loss.backward()            # gradients averaged over ranks on return
        ...     opt.step()

    Gradient accumulation: run the first ``k - 1`` micro-batches inside ``with model.no_sync():``
    and the last one outside; the reduction then carries the accumulated gradients once.
    """

    def __init__(self, module: Module, group=None, bucket_size_mb: float = 25.0, broadcast_buffers: bool = True,
                 grad_sync: GradSyncStrategy = GradSyncStrategy.OVERLAP, *, find_unused_parameters: bool = False,
                 comm_hook=None, reduce_op: ReduceOp = ReduceOp.MEAN, sync_params: bool = True,
                 record_events: bool = False):
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an axonmpi.nn.Module, got {type(module).__name__}")
        self.module = module
        self.group = resolve_group(group)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.synchronizer = GradientSynchronizer(
            list(module.named_parameters()), self.group, bucket_size_mb=bucket_size_mb, strategy=grad_sync,
            comm_hook=comm_hook, reduce_op=reduce_op, find_unused_parameters=find_unused_parameters,
            record_events=record_events)
        if sync_params:
            self.sync_parameters()

    # keep the wrapped module's names: state_dict() of a DDP model equals the module's
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        return self.module.parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    @property
    def buckets(self) -> List[GradientBucket]:
        """The gradient buckets, in launch order."""
        return self.synchronizer.buckets

    def sync_parameters(self) -> None:
        """Broadcast parameters and buffers from group rank 0 (one call per bucket-sized flat chunk)."""
        if self.group.size == 1:
            return
        with no_grad():
            tensors = [p for _, p in self.module.named_parameters()] + [b for _, b in self.module.named_buffers()]
            _broadcast_flat([t for t in tensors], self.group)

    def _sync_buffers(self) -> None:
        bufs = [b for _, b in self.module.named_buffers()]
        if bufs:
            _broadcast_flat(bufs, self.group)

    def forward(self, *args, **kwargs):
        sync = self.synchronizer
        if self.broadcast_buffers and self.group.size > 1 and sync.enabled:
            self._sync_buffers()
        out = self.module(*args, **kwargs)
        sync.prepare_forward(out if sync.find_unused_parameters else None)
        return out

    def sync_gradients(self) -> None:
        """Finish gradient reduction now (idempotent; backward already does it when every grad arrived)."""
        self.synchronizer.finish()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction for backwards run inside (gradients accumulate locally)."""
        sync = self.synchronizer
        prev = sync.enabled
        sync.enabled = False
        try:
            yield
        finally:
            sync.enabled = prev

    def extra_repr(self) -> str:
        s = self.synchronizer
        return (f"group={self.group.name}(size={self.group.size}), buckets={len(s.buckets)}, "
                f"grad_sync={s.strategy.name}, find_unused_parameters={s.find_unused_parameters}")


DDP = DistributedDataParallel


def _broadcast_flat(tensors: Sequence[Tensor], group, src: int = 0, cap_bytes: int = 64 << 20) -> None:
    """Broadcast many small arrays as few flat messages (grouped by dtype/device)."""
    groups: Dict[Any, List[Tensor]] = {}
    for t in tensors:
        groups.setdefault((str(t.data.dtype), str(t.device)), []).append(t)
    for ts in groups.values():
        xp = get_array_module(ts[0].data)
        start = 0
        while start < len(ts):
            chunk, size = [], 0
            while start < len(ts) and (not chunk or size + ts[start].data.nbytes <= cap_bytes):
                chunk.append(ts[start])
                size += ts[start].data.nbytes
                start += 1
            flat = xp.concatenate([xp.ravel(t.data) for t in chunk]) if len(chunk) > 1 else xp.ravel(
                chunk[0].data).copy()
            broadcast(flat, src=src, group=group)
            off = 0
            for t in chunk:
                n = int(t.data.size)
                t.data[...] = flat[off:off + n].reshape(t.data.shape)
                off += n
