"""DistributedDataParallel: replicate a module, average gradients over a group in flat buckets, overlapped with backward.

[Note: DDP gradient flow]
Parameters are packed, in reverse registration order (roughly the order backward produces
their gradients), into flat contiguous buckets of at most ``bucket_size_mb`` (a
:class:`~axonmpi.parallel._flat.FlatLayout` of views), one per dtype and device. A
post-accumulate-grad hook on every parameter fires as soon as its gradient of this backward
is final; it copies the gradient into the parameter's slice of its bucket, pre-scaled by
1/size (so a SUM all-reduce yields the mean and no extra pass is needed), and rebinds
``param.grad`` to that slice. When every parameter of bucket ``i`` is ready and all buckets
before it have been launched, bucket ``i``'s all-reduce is launched (non-blocking with
``GradSyncStrategy.OVERLAP``). When the last parameter is ready, all reductions are waited on,
so ``loss.backward()`` returns with averaged gradients. ``sync_gradients()`` does the same
explicitly and is idempotent.

[Note: one collective order on every rank]
MPI matches collectives on a communicator by their order, so every rank must issue the same
collectives in the same order, whatever its local graph looks like. Hence: nothing is ever
launched in ``forward()`` (a collective the user issues between forward and backward then
meets the same collective everywhere); during backward, buckets are launched strictly in
index order; with ``find_unused_parameters=True`` one small all-reduce of "has a gradient"
flags follows the last bucket. Parameters that the forward's graph cannot reach on this rank
are found in ``forward()`` but only *marked* there; they are filled into their buckets (their
current ``.grad``, or zeros) when this rank's backward starts (the first hook on an output or a
parameter). A parameter gets ``grad=None`` only if no rank had a gradient for it.

[Note: a second backward in one step]
After a step's reduction has finished, another backward before the next ``forward()`` (e.g.
``loss.backward(retain_graph=True)`` then ``loss2.backward()``) starts a new round: every
bucket is reduced again. The first round left the same averaged gradient ``A`` on every rank,
and the engine adds the new local gradient ``g`` onto it, so the new average is
``mean(A + g) = A + mean(g)``: the correct accumulated gradient, identical on all ranks. (PyTorch's
DDP silently skips the second reduction.) Each backward must reach every parameter the forward
used, as the first one must.

[Note: no request is dropped]
A started non-blocking reduction is always waited on: if a backward stops part way (an
exception), the next ``forward()`` (or ``remove_hooks()``) launches the remaining buckets in
order and waits for all of them on every rank, then discards the round and raises, naming the
parameters that got no gradient. Dropping a pending MPI request would free it
(``MPI_Request_free``) while a late rank may still write into its buffer.
"""
from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..autograd import Tensor, no_grad
from ..autograd.graph import reachable_leaves, tensors_in
from ..backend import get_array_module
from ..distributed import ReduceOp, Work, add_placement, all_reduce, resolve_group, role_group
from .grad_sync import GradReducer, check_group, no_sync
from ..nn import Module
from ._flat import FlatLayout, broadcast_flat
from .ddp_comm_hooks import _HOOKS, allreduce_hook, fp16_compress_hook
from ..enums import coerce_enum

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


class _Phase(enum.Enum):
    """Where the synchronizer is in a step."""

    IDLE = "idle"          # no reduction expected (before a forward, inside no_sync, size 1)
    ARMED = "armed"        # forward ran; waiting for backward to start
    RUNNING = "running"    # backward started: buckets fill and launch
    SYNCED = "synced"      # reduced; a further backward before forward starts a new round


# -- buckets --------------------------------------------------------------------------------------
class GradientBucket:
    """A flat contiguous buffer holding the gradients of several parameters (one MPI call).

    Attributes:
        index: position in launch order.
        params: the parameters, in the order their slices lie in ``buffer``.
        names: their qualified names (for messages).
        layout: the :class:`~axonmpi.parallel._flat.FlatLayout` of the slices.
        buffer: the flat array (parameters' dtype and device).
        views: per parameter, its slice of ``buffer`` reshaped to the parameter's shape.
    """

    def __init__(self, index: int, params: Sequence[Tensor], names: Sequence[str]):
        self.index = index
        self.params = list(params)
        self.names = list(names)
        first = self.params[0].data
        xp = get_array_module(first)
        self.layout = FlatLayout([p.data.shape for p in self.params])
        self.buffer = xp.zeros(self.layout.numel, dtype=first.dtype)
        self.views = self.layout.views(self.buffer)
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.work: Optional[Work] = None
        self.launched = False

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def reset(self) -> None:
        """Forget this round; refuses while a launched reduction is still in flight."""
        if self.work is not None and not self.work.is_completed():
            raise RuntimeError(f"bucket {self.index}: reset while its reduction is in flight; wait() it first")
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
        find_unused_parameters: accept parameters that receive no gradient (see the module notes).
        record_events: keep ``events`` (``("ready", name)``, ``("unused", name)``,
            ``("launch", bucket_index)``) for inspection and tests.
    """

    def __init__(self, named_params: Sequence[Tuple[str, Tensor]], group=None, *, bucket_size_mb: float = 25.0,
                 strategy: GradSyncStrategy = GradSyncStrategy.OVERLAP, comm_hook=None,
                 reduce_op: ReduceOp = ReduceOp.MEAN, find_unused_parameters: bool = False,
                 record_events: bool = False):
        self.group = resolve_group(group)
        self.strategy = coerce_enum(GradSyncStrategy, strategy, "grad_sync")
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
        self._deferred = {}
        self.defer_to_end = False
        self._total = len(self.named_params)
        self._phase = _Phase.IDLE
        self._unused: List[Tuple[GradientBucket, int]] = []   # unreachable from this forward's outputs
        self._has_grad: Optional[np.ndarray] = None
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
        """Unregister the gradient hooks (the synchronizer stops acting); completes a round in flight."""
        if self._phase is _Phase.RUNNING:
            self._drain()
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the per-step protocol ------------------------------------------------------------------------
    def prepare_forward(self, outputs: Any = None) -> None:
        """Start a step: finish off an interrupted one; find unused parameters if asked.

        Raises:
            RuntimeError: the previous backward did not give every parameter a gradient (a
                parameter outside the loss without ``find_unused_parameters=True``, or a
                backward that raised). The round is completed and discarded first, so the
                next step works.
        """
        if self._phase is _Phase.RUNNING:
            missing = self._missing()
            self._drain()
            self._raise_unfinished(missing)
        self._reset()
        self._unused = []
        if self._phase is _Phase.ARMED and self.find_unused_parameters and outputs is not None:
            reachable = reachable_leaves(outputs)
            self._unused = [(b, i) for b in self.buckets for i, p in enumerate(b.params) if id(p) not in reachable]
            if self._unused:
                for t in tensors_in(outputs):
                    if t.grad_fn is not None:
                        t.register_hook(self._on_output_grad)

    def _reset(self) -> None:
        for b in self.buckets:
            b.reset()
        self._next_launch = 0
        self._n_ready = 0
        self._phase = _Phase.ARMED if (self.enabled and self.group.size > 1) else _Phase.IDLE
        self._has_grad = np.ones(self._total, np.uint8) if self.find_unused_parameters else None

    def _drain(self) -> None:
        """Complete an interrupted round: launch what is left in order, wait for everything."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            for p, v in zip(b.params, b.views):   # partly reduced: meaningless, drop them
                if p.grad is not None and p.grad.data is v:
                    p.grad = None
        self._phase = _Phase.IDLE

    def _missing(self) -> List[str]:
        out = []
        for name, p in self.named_params:
            b, i = self._where[id(p)]
            if not b.ready[i]:
                out.append(name)
        return out

    def _raise_unfinished(self, missing: Optional[List[str]] = None) -> None:
        drained = missing is not None
        missing = self._missing() if missing is None else missing
        hint = ("" if self.find_unused_parameters else
                " Pass find_unused_parameters=True to DistributedDataParallel if parts of the model are "
                "skipped on purpose, or make sure every parameter takes part in the loss.")
        raise RuntimeError(
            f"rank {self.group.world.rank}: DDP expected every parameter to receive a gradient in the "
            f"previous backward, but these did not: {missing}.{hint}"
            + (" (If that backward raised: its reduction has been completed on every rank and discarded, "
               "with the gradients it held; the next step starts clean.)" if drained else "")
        )

    def _begin_round(self) -> None:
        """This rank's backward has started: fill the unused parameters (no collective yet)."""
        if self._phase is _Phase.SYNCED:
            self._reset()                      # a further backward in the same step (see the note)
        self._phase = _Phase.RUNNING
        for b, i in self._unused:
            self._fill_unused(b, i)
        if self.strategy is GradSyncStrategy.OVERLAP:
            self._launch_ready_buckets()

    def _on_output_grad(self, grad: Tensor) -> None:
        if self._phase is _Phase.ARMED or (self._phase is _Phase.SYNCED and self.enabled):
            self._begin_round()
            if self._n_ready == self._total:
                self.finish()

    def _on_grad_ready(self, p: Tensor) -> None:
        from ..autograd.function import backward_depth, queue_callback
        if self.defer_to_end or backward_depth() > 1:
            # [Note: DDP and activation checkpointing]  a checkpoint's recomputation runs a backward pass inside the
            # outer one, and a parameter's hook there may be followed by more contributions later in the outer
            # pass (a weight shared by a checkpointed block and another layer): such a round marks its parameters
            # ready at the end of the outermost pass (``defer_to_end``: every round, for a model with checkpointed
            # modules; parallelize sets it), in bucket order, so no bucket is launched before its last gradient
            if not self._deferred:
                queue_callback(self._ready_deferred)
            self._deferred[id(p)] = p
            return
        self._ready(p)

    def _ready_deferred(self) -> None:
        deferred, self._deferred = self._deferred, {}
        for b in self.buckets:
            for p in b.params:
                if id(p) in deferred and p.grad is not None:
                    self._ready(p)

    def _ready(self, p: Tensor) -> None:
        phase = self._phase
        if phase is not _Phase.RUNNING:
            if phase is _Phase.IDLE or (phase is _Phase.SYNCED and not self.enabled):
                return
            self._begin_round()
        b, i = self._where[id(p)]
        if b.ready[i]:
            raise RuntimeError(
                f"rank {self.group.world.rank}: DDP parameter {b.names[i]!r} received a second gradient in "
                "one reduction round: either it was found unused in forward() yet used afterwards, or a "
                "backward started before the previous one reduced every parameter")
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

    def _mark_ready(self, b: GradientBucket, i: int, launch: bool = True) -> None:
        b.ready[i] = True
        b.n_ready += 1
        self._n_ready += 1
        if not launch:
            return
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
        self._poke()

    def _launch(self, b: GradientBucket) -> None:
        if self.events is not None:
            self.events.append(("launch", b.index))
        b.launched = True
        b.work = self.comm_hook(b, self.group)
        self._next_launch = b.index + 1

    def _poke(self) -> None:
        """Drive MPI progress of in-flight reductions (MPI progresses only inside MPI calls)."""
        for b in self.buckets[: self._next_launch]:
            if b.work is not None and not b.work.is_completed():
                return

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and leave averaged gradients in ``.grad``."""
        if self._phase is _Phase.ARMED and self.find_unused_parameters:
            self._begin_round()                # this rank's backward reached nothing
        if self._phase is _Phase.ARMED:
            self._raise_unfinished()
        if self._phase is not _Phase.RUNNING:
            return
        if self._n_ready < self._total:
            if not self.find_unused_parameters:
                self._raise_unfinished()
            for b in self.buckets:             # reachable, but this backward did not reach them
                for i in range(len(b.params)):
                    if not b.ready[i]:
                        self._fill_unused(b, i)
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
                if self.strategy is GradSyncStrategy.AFTER_BACKWARD:
                    b.work.wait()
        for b in self.buckets:
            b.work.wait()
        if self.find_unused_parameters:
            self._apply_global_unused()
        self._phase = _Phase.SYNCED

    def _fill_unused(self, b: GradientBucket, i: int) -> None:
        """Parameter ``i`` of ``b`` gets no gradient from this backward: contribute its current
        ``.grad`` (e.g. accumulated under ``no_sync``), or zeros when it has none."""
        p, view = b.params[i], b.views[i]
        if p.grad is None:
            view[...] = 0
            self._has_grad[self._flat_index[id(p)]] = 0
        else:
            if p.grad.data is not view:
                get_array_module(view).multiply(p.grad.data, self._scale, out=view)
                p.grad.data = view
            elif self._scale != 1.0:
                view *= self._scale
        if self.events is not None:
            self.events.append(("unused", b.names[i]))
        self._mark_ready(b, i, launch=False)

    def _apply_global_unused(self) -> None:
        """Parameters without a gradient on every rank keep ``grad=None``; the others get the average."""
        glob = all_reduce(self._has_grad, ReduceOp.MAX, self.group)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if glob[self._flat_index[id(p)]]:
                    if p.grad is None:
                        p.grad = Tensor(b.views[i])
                    else:
                        p.grad.data = b.views[i]
                else:
                    p.grad = None


# -- the public strategy --------------------------------------------------------------------------------
class DistributedDataParallel(Module):
    """Data parallelism: every rank holds the whole model and trains on its share of the batch.

    After ``loss.backward()`` returns, every parameter's ``.grad`` holds the gradient
    averaged over the group (the gradient of the mean loss over the global batch when all
    local batches have the same size), so ``optimizer.step()`` keeps the replicas equal.

    Args:
        module: the model (an :class:`axonmpi.nn.Module`).
        group: the data-parallel process group (default: the grid's data group, which is all
            ranks on the trivial grid). A group two of whose ranks hold different parts of a
            parameter (tensor-parallel shards, pipeline stages) raises ``ValueError``.
        bucket_size_mb: cap of one gradient bucket in MiB (default 25, as PyTorch).
        broadcast_buffers: broadcast buffers from group rank 0 at every forward.
        grad_sync: :class:`GradSyncStrategy` (OVERLAP or AFTER_BACKWARD).
        find_unused_parameters: allow parameters that get no gradient in a step (found from the
            forward's graph; no collective in forward, the same collective order on every rank).
        comm_hook: ``None`` (all-reduce), ``"fp16"`` (float16 compression) or a callable
            ``(bucket, group) -> Work`` that reduces ``bucket.buffer`` in place.
        reduce_op: ``ReduceOp.MEAN`` (default) or ``ReduceOp.SUM`` (for unequal local batches:
            scale the loss by local/global batch size yourself and sum).
        sync_params: broadcast parameters and buffers from group rank 0 at construction.
        record_events: keep an event log of hook/launch order in ``ddp.synchronizer.events``.
        ignored_parameters: parameters DDP neither broadcasts nor reduces (their owner reduces them:
            expert parameters of ``parallelize(expert_parallel=)`` go over the expert-data group).
        device_ids, output_device, process_group, bucket_cap_mb, dim, check_reduction,
            gradient_as_bucket_view, static_graph: PyTorch's names. ``device_ids=[rank]`` moves the
            module to that device (GPU ``rank`` where there are GPUs, the CPU on a host without one);
            ``process_group`` is ``group``, ``bucket_cap_mb`` is ``bucket_size_mb``; the others are
            accepted (gradients always live in their own arrays; the graph is walked each step).

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
    A further backward before the next forward is reduced again (see the module notes).
    """

    def __init__(self, module: Module, group=None, bucket_size_mb: float = 25.0, broadcast_buffers: bool = True,
                 grad_sync: GradSyncStrategy = GradSyncStrategy.OVERLAP, *, find_unused_parameters: bool = False,
                 comm_hook=None, reduce_op: ReduceOp = ReduceOp.MEAN, sync_params: bool = True,
                 record_events: bool = False, ignored_parameters=(), device_ids=None, output_device=None,
                 dim: int = 0, process_group=None, bucket_cap_mb: Optional[float] = None,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False):
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an axonmpi.nn.Module, got {type(module).__name__}")
        if isinstance(group, (list, tuple)):          # torch's positional order: DDP(module, device_ids)
            group, device_ids = None, group
        if process_group is not None:                 # torch's name for group=
            if group is not None and group is not process_group:
                raise ValueError("DDP: pass group= or torch's process_group=, not both")
            group = process_group
        if bucket_cap_mb is not None:                 # torch's name for bucket_size_mb=
            bucket_size_mb = bucket_cap_mb
        if dim != 0:
            raise ValueError(f"DDP: dim={dim}: inputs are never scattered here (each rank feeds its own batch); "
                             "leave dim at 0")
        if device_ids is not None:                    # torch: the one device this replica runs on
            ids = list(device_ids)
            if len(ids) > 1:
                raise ValueError(f"DDP: device_ids={ids}: one device per process (as torch's DDP); "
                                 "pass [local_rank] or None")
            if ids:
                from ..backend import index_device
                module.to(index_device(ids[0]) if isinstance(ids[0], (int, np.integer)) else ids[0])
        self.module = module
        self.group = role_group("data", group)
        ignored = {id(p) for p in ignored_parameters}     # reduced elsewhere (expert parameters)
        named = [(n, p) for n, p in module.named_parameters() if id(p) not in ignored]
        self.named_params = named
        check_group(named, self.group, "DDP")
        for _, p in named:
            add_placement(p, replica=self.group)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.synchronizer = GradientSynchronizer(
            named, self.group, bucket_size_mb=bucket_size_mb, strategy=grad_sync,
            comm_hook=comm_hook, reduce_op=reduce_op, find_unused_parameters=find_unused_parameters,
            record_events=record_events)
        self.grad_reducer = GradReducer("ddp", parts=[self.synchronizer])   # the no_sync switch (grad_sync)
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
            tensors = [p for _, p in self.named_params] + [b for _, b in self.module.named_buffers()]
            broadcast_flat([t for t in tensors], self.group)

    def _sync_buffers(self) -> None:
        bufs = [b for _, b in self.module.named_buffers()]
        if bufs:
            broadcast_flat(bufs, self.group)

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

    def no_sync(self):
        """Skip gradient reduction for backwards run inside (gradients accumulate locally):
        :func:`axonmpi.parallel.no_sync` of this model."""
        return no_sync(self)

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch's DDP attribute (nanoGPT sets it per micro-step): False is :meth:`no_sync` until set True again."""
        return self.grad_reducer.enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, on: bool) -> None:
        self.grad_reducer.enabled = bool(on)

    def extra_repr(self) -> str:
        s = self.synchronizer
        return (f"group={self.group.name}(size={self.group.size}), buckets={len(s.buckets)}, "
                f"grad_sync={s.strategy.name}, find_unused_parameters={s.find_unused_parameters}")


DDP = DistributedDataParallel
