"""Who reduces which gradient: the one table, read from the parameters' placements.

Every path that sums gradients over ranks asks here which groups a parameter's gradient is
reduced over (:func:`reduction_groups`), and every strategy that is given a group checks it
against the placements first (:func:`check_group`), so that a group mixing different shards of a
parameter is refused instead of averaging them silently.

[Note: the table]  With ``data`` the data-parallel group and ``batch`` the extra groups whose
ranks see different rows of the batch inside one tensor-parallel block (AxoNN's easy mode: the
block's intra group; Megatron: none, every tensor rank sees the same rows):

=========================================  ==========================================
parameter (its placement)                  gradient summed over
=========================================  ==========================================
replicated (no shard group)                ``data`` and every ``batch`` group
Megatron 1-D ``DIM`` shard                 ``data`` (the tensor group computed its part)
AxoNN 3-D ``BLOCK`` weight                 ``data`` (the layer reduce-scattered over depth)
AxoNN 3-D bias (replicated over depth)     ``data`` and the layer's depth group
expert ``DIM`` shard over a subgroup of    its replica groups inside ``data`` (the expert-data
``data`` (expert parallelism)              group) and the ``batch`` groups that do not split it,
                                           never the expert group
FSDP ``FLAT`` chunk                        reduce-scattered by FSDP over its shard group
pipeline ``STAGE`` shard                   as above, over the stage's own groups
``partial`` over a group (sequence           also that group (the finalize step; a layer that
parallelism: the tensor group)             sums its own, ``sequence_parallel``, in backward)
``tied`` (copies across pipeline stages)   also the tied group (the finalize step)
=========================================  ==========================================

Context parallelism (``G_context > 1``): the ranks of a context group see different tokens of the
same samples, so every gradient's ``data`` group is data x context (:func:`data_reduction_group`,
Megatron's ``dp_cp`` group); the parameters record the context group as a replica.  Sequence
parallelism: a parameter used on sequence shards (LayerNorm, a row-parallel bias, any replicated layer)
records the tensor group as ``partial`` in its placement and the finalize step sums it there (a layer used
on its own, outside ``parallelize``, sums it in backward through ``copy_to_tensor_parallel_region``, Megatron's
attribute ``sequence_parallel``); the sums are linear, so their order with the data mean does not matter.

[Note: the reducer]  :class:`GradReducer` is the one executor of this table for every layout (Megatron's
``finalize_model_grads`` is the model): ``parallelize``, DDP, FSDP and the ``Pipeline`` each own one, and the
reductions they run are its entries or its parts.  An *entry* is a gradient array, the groups the table gives
for its parameter, and a scale (``1 / batch shards``); the entries run after backward, bucketed into one flat
array per (groups, scale, dtype): at the end of the backward pass (:meth:`GradReducer.arm`, queued with
``autograd.queue_callback``: ``loss.backward()`` returns reduced gradients; the buckets already launched during
the backward as they fill, [Note: buckets launched as they fill]), or when the owner calls
:meth:`GradReducer.run` (a pipeline after its last micro-batch; FSDP's chunk segments after its reduce-scatter).
``parallelize``'s one is the model's finalize step (:mod:`axonmpi.parallel.finalize`).  A *part* is an executor that keeps
its own collective: DDP's bucketed all-reduce overlapped with backward (``GradientSynchronizer``), FSDP's
reduce-scatter of flat shards, a pipeline's reducer under ``parallelize``'s.  :func:`no_sync` is the one
switch: it turns a model's reducer off, parts included, so every path accumulates local gradients, and the
first backward outside reduces the accumulated sum once (every reduction here is linear).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import numpy as np

from ..backend import get_array_module
from ..distributed import ReduceOp, all_gather_object, all_reduce
from ..distributed.placement import ShardKind, check_group, placement_of

__all__ = ["GradReducer", "check_axonn_fsdp_shapes", "check_group", "data_reduction_group", "mean_over",
           "no_sync", "reduce_gradient", "reduction_groups", "sharded_within"]


def data_reduction_group(grid: Any) -> Any:
    """The group replicated parameters' gradients are averaged over: data x context when the grid has a
    context dimension (``grid.data_context_group``), else the grid's data group.

    Example:
        >>> data_reduction_group(axonmpi.init(G_context=2).grid).ranks       # 4 ranks, on rank 0
        (0, 1, 2, 3)
    """
    return grid.group_for("data_context")


def reduction_groups(param: Any, data: Any, batch: Sequence[Any] = (), depth: Any = None) -> List[Any]:
    """The groups (of more than one rank) ``param``'s gradient is summed over, by the table above.

    Args:
        param: a parameter (its :func:`placement_of` is read, and nothing else: a 3-D bias is known by its
            placement's replica over ``depth``; AxoNN's tags are read only through :func:`placement_of`).
        data: the data-parallel group.
        batch: the extra groups that split the batch rows inside a tensor-parallel block.
        depth: the depth group of AxoNN's layers (for their biases).

    Example:
        >>> [g.name for g in reduction_groups(layernorm.weight, grid.data_group, [grid.intra_group])]
        ['data_group', 'intra_group']
    """
    pl = placement_of(param)
    if sharded_within(param, data):         # an expert: its expert-data replicas, and the batch groups (its
        split = {getattr(s.group, "ranks", None) for s in pl.shards}          # gradient is of this rank's rows;
        out = [r for r in pl.replica_groups if _inside(r, data)] + \
            [b for b in batch if getattr(b, "ranks", 0) not in split]         # not one that splits it)
    elif depth is not None and depth.size > 1 and any(r is depth or getattr(r, "ranks", None) == depth.ranks
                                                      for r in pl.replica_groups):
        out = [data, depth]                 # an AxoNN 3-D bias: its placement replicates it over depth
    elif any(s.kind is not ShardKind.STAGE for s in pl.shards):
        out = [data]
    else:
        out = [data, *batch]
    return [g for g in out if g is not None and g.size > 1]


def sharded_within(param: Any, data: Any) -> bool:
    """True when ``param`` is split over a subgroup of ``data`` (an expert over its expert group): the table
    reduces it over its replica groups inside ``data``, never over ``data`` itself."""
    return data is not None and any(s.kind is ShardKind.DIM and _inside(s.group, data)
                                    for s in placement_of(param).shards)


def _inside(group: Any, data: Any) -> bool:
    """True when ``group`` has more than one rank, all of them in ``data`` (an expert or expert-data group)."""
    ranks = getattr(group, "ranks", None)
    return ranks is not None and len(ranks) > 1 and set(ranks) <= set(getattr(data, "ranks", ()))


def mean_over(value: float, groups: Iterable[Any]) -> float:
    """A per-rank scalar (a loss) averaged over each group of more than one rank in turn: the mean over
    the batch shards when ``groups`` are the groups that split the batch rows (collective over them).

    Example:
        >>> loss = mean_over(loss.item(), [grid.data_group])     # the global batch's mean loss
    """
    for grp in groups:
        if grp is not None and grp.size > 1:
            value = float(all_reduce(np.array([value]), ReduceOp.MEAN, grp)[0])
    return value


def reduce_gradient(grad: Any, groups: Iterable[Any], scale: float = 1.0) -> None:
    """Sum the gradient array ``grad`` over each of ``groups`` in turn, in place, then multiply it by
    ``scale`` (``1 / batch shards``: the gradient of the mean loss).  Collective over the groups.

    Example:
        >>> reduce_gradient(p.grad.data, reduction_groups(p, grid.data_group), 1.0 / grid.G_data)
    """
    for grp in groups:
        all_reduce(grad, group=grp, out=grad)
    if scale != 1.0:
        grad *= scale


class GradReducer:
    """Every gradient reduction of one parallelized model, read from the placements (see [Note: the reducer]).

    Args:
        name: what the messages call it (``"ddp"``, ``"fsdp"``, ``"pipeline"``, ``"parallelize"``).
        parts: executors with their own collective and an ``enabled`` attribute (DDP's synchronizer,
            an FSDP root, another ``GradReducer``): the reducer's switch is theirs.

    Example:
        >>> red = GradReducer("axonn")
        >>> red.after_backward(model.parameters(), lambda p: reduction_groups(p, data, (grid.intra_group,)), 1 / shards)
        >>> red.arm(model.parameters())            # run at the end of every backward pass
        >>> with red.no_sync():
        ...     loss.backward()                    # gradients accumulate, nothing is reduced
    """

    def __init__(self, name: str = "", parts: Sequence[Any] = ()):
        self.name = name
        self.parts: List[Any] = []
        # (gradient, groups, scale, the parameter or None for an FSDP segment) of each entry
        self._after: List[Tuple[Callable[[], Any], Callable[[], Tuple[Any, ...]], float, Any]] = []
        self._first: List[Callable[[], None]] = []
        self._handles: List[Any] = []
        self._enabled = True
        self._queued = False
        self._pending: Any = None
        self._round: Any = None        # the buckets launched as they fill in this backward ([Note: buckets ...])
        self._listening = False
        self.defer = False             # True: nothing launches during backward (activation checkpointing)
        self._arm_listen = False
        for part in parts:
            self.add_part(part)

    @property
    def enabled(self) -> bool:
        """False inside :func:`no_sync`: no entry runs, and every part is switched off too."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = bool(on)
        for part in self.parts:
            part.enabled = self._enabled

    def add_part(self, part: Any) -> Any:
        """Own ``part`` (an object with an ``enabled`` attribute): :func:`no_sync` switches it with this reducer."""
        if not hasattr(part, "enabled"):
            raise TypeError(f"GradReducer {self.name!r}: a part needs an 'enabled' switch, got {type(part).__name__}")
        part.enabled = self._enabled
        self.parts.append(part)
        return part

    def after_backward(self, params: Iterable[Any], groups_of: Callable[[Any], Sequence[Any]],
                       scale: float = 1.0) -> None:
        """Reduce each of ``params``' gradients (those that have one) when :meth:`run` is called, bucketed."""
        for p in params:       # the groups are read at run time: placements may still be added after this
            if p.requires_grad:
                self._after.append((lambda p=p: None if p.grad is None else p.grad.data,
                                    lambda p=p: _live(groups_of(p)), scale, p))

    def after_backward_segments(self, flats: Iterable[Any], groups_of: Callable[[Any], Sequence[Any]],
                                scale: float = 1.0) -> None:
        """FSDP chunks of tensor-parallel parameters: each segment of each flat shard's gradient (its elements
        of one parameter ``q``) reduced over ``groups_of(q)`` when :meth:`run` is called.  The ranks of those
        groups hold chunks over the same elements (same data rank, same local shapes)."""
        for f in flats:
            for seg in f.segments():
                groups = _live(groups_of(f.params[seg.index]))
                if groups or scale != 1.0:
                    self._after.append((lambda f=f, seg=seg: None if f.grad is None else seg.in_chunk(f.grad.data),
                                        lambda groups=groups: groups, scale, None))

    def before_run(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` first in every :meth:`run` (a pipeline stage's FSDP reduce-scatter, before the entries
        that read its shard)."""
        self._first.append(fn)

    def arm(self, params: Iterable[Any], as_ready: bool = True) -> None:
        """Run :meth:`run` once at the end of every backward pass that gives one of ``params`` a gradient
        (``autograd.queue_callback`` from its post-accumulate-grad hook): ``loss.backward()`` returns with every
        entry reduced, as a model without after-backward entries does.  ``as_ready``: the buckets are launched
        during the backward as they fill ([Note: buckets launched as they fill]); False where another executor
        reduces the same gradients during backward (DDP rebinds ``.grad`` to its bucket, FSDP reduce-scatters):
        the entries then run after it, at the end of the pass."""
        self._arm_listen = bool(as_ready)
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._queue))

    def _queue(self, param) -> None:
        if not self._enabled:
            return
        if self._queued:
            self._ready(param)
            return
        from ..autograd import queue_callback
        self._queued = True
        if self._arm_listen:
            self.listen()
            self._ready(param)

        def finalize():
            self._queued = False
            self.run()
        queue_callback(finalize)

    def run(self) -> None:
        """Run the after-backward entries (nothing inside :func:`no_sync`): one flat array per (groups, scale,
        dtype), summed over each group, times the scale (one MEAN where that is all it is).  Collective over
        the groups, in the same order on every rank (the entries' order)."""
        self.start()
        self.wait()

    def start(self) -> None:
        """Launch :meth:`run`'s reductions without waiting (each bucket's first group non-blocking) and return:
        the caller computes on while they travel, then calls :meth:`wait` (a pipeline launches a stage's
        reduction when its last micro-batch's backward is done, [Note: overlapped stage reductions]).  The
        buckets a backward already launched as they filled ([Note: buckets launched as they fill]) are not
        launched again.  The gradients must not change until :meth:`wait`.  A second ``start`` before ``wait``
        does nothing."""
        rnd, self._round, self._listening = self._round, None, False
        if not self._enabled or self._pending is not None:
            if rnd is not None:                 # (switched off mid-round) complete what was launched
                for b in rnd.launched:
                    b.finish()
            return
        try:
            for fn in self._first:
                fn()
        except BaseException:
            for b in rnd.launched if rnd is not None else ():   # no request is dropped ([Note: no request ...])
                b.finish()
            raise
        if rnd is None:
            self._pending = [_Launched(groups, scale, grads) for groups, scale, grads in self._buckets()]
            return
        rnd.launch_all()
        rest = [e for i, e in enumerate(self._after) if i not in rnd.planned]
        self._pending = rnd.launched + [_Launched(groups, scale, grads) for groups, scale, grads in self._buckets(rest)]

    def wait(self) -> None:
        """Complete what :meth:`start` launched: the gradients hold the reduced values after it."""
        pending, self._pending = self._pending, None
        for b in pending or ():
            b.finish()

    def launch_as_ready(self, params: Iterable[Any]) -> None:
        """[Note: buckets launched as they fill]  Hook ``params`` (those among the entries) so that, in a backward
        this reducer listens to (:meth:`listen`; every backward under :meth:`arm`), the entries are bucketed as
        DDP buckets them -- reverse entry order (about the order backward finishes them), per (groups, scale,
        dtype), up to :attr:`bucket_bytes` each -- and each bucket's reduction is launched as soon as all its
        parameters' gradients of this backward are final and every bucket before it was launched (the same order
        on every rank of a group, whatever order the hooks fire in).  :meth:`start` launches the rest: buckets not
        filled, FSDP segments, parameters without a gradient."""
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._ready))

    bucket_bytes = 4 << 20
    """The largest bucket launched during backward (bytes); small buckets start sooner, large ones cost fewer calls."""

    def listen(self) -> None:
        """The next backward is the last before :meth:`start`: launch its buckets as they fill (nothing inside
        :func:`no_sync`, while a reduction is pending, or with :attr:`defer`)."""
        if self._enabled and self._pending is None and not self.defer and self._round is None:
            self._round = _Round(self._after, self.bucket_bytes)
            self._listening = True

    def _ready(self, p) -> None:
        if not self._listening:
            return
        self._round.ready(p)

    @property
    def started(self) -> bool:
        """True between :meth:`start` and :meth:`wait`."""
        return self._pending is not None

    def _buckets(self, entries=None) -> List[Tuple[Tuple[Any, ...], float, List[Any]]]:
        buckets: Dict[Tuple[Any, ...], Tuple[Tuple[Any, ...], float, List[Any]]] = {}
        for grad_of, groups_of, scale, _ in self._after if entries is None else entries:
            g = grad_of()
            groups = groups_of() if g is not None else ()
            if g is not None and (groups or scale != 1.0):
                key = (tuple(id(x) for x in groups), scale, str(g.dtype))
                buckets.setdefault(key, (groups, scale, []))[2].append(g)
        return list(buckets.values())

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backwards accumulate local gradients; the first reduction outside carries their sum once."""
        prev, self.enabled = self._enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks of :meth:`arm`."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (f"GradReducer({self.name!r}, hooked={len(self._handles)}, after_backward={len(self._after)}, "
                f"parts={[getattr(p, 'name', type(p).__name__) for p in self.parts]}, enabled={self._enabled})")


class _Round:
    """One backward's buckets launched as they fill ([Note: buckets launched as they fill])."""

    def __init__(self, entries, cap: int):
        self.planned = set()
        open_: Dict[Tuple[Any, ...], List[int]] = {}
        closed: List[Tuple[int, Tuple[Any, ...], float, List[int]]] = []     # (last position, groups, scale, entries)
        sizes: Dict[Tuple[Any, ...], int] = {}
        for pos, i in enumerate(reversed(range(len(entries)))):
            _, groups_of, scale, p = entries[i]
            if p is None:
                continue
            groups = groups_of()
            if not groups and scale == 1.0:
                continue
            key = (tuple(id(x) for x in groups), scale, str(p.data.dtype))
            open_.setdefault(key, []).append(i)
            sizes[key] = sizes.get(key, 0) + p.data.nbytes
            self.planned.add(i)
            if sizes[key] >= cap:
                closed.append((pos, groups, scale, open_.pop(key)))
                sizes[key] = 0
        n = len(entries)
        for key, idx in open_.items():
            closed.append((n + len(closed), entries[idx[0]][1](), entries[idx[0]][2], idx))
        closed.sort(key=lambda b: b[0])
        self.entries = entries
        self.buckets = [(groups, scale, idx) for _, groups, scale, idx in closed]
        self.where = {id(entries[i][3]): k for k, (_, _, idx) in enumerate(self.buckets) for i in idx}
        self.waiting = [len(idx) for _, _, idx in self.buckets]
        self.next = 0
        self.seen = set()
        self.launched: List[_Launched] = []

    def ready(self, p) -> None:
        k = self.where.get(id(p))
        if k is None:
            return
        if id(p) in self.seen:
            raise RuntimeError(
                f"parameter of shape {tuple(p.shape)} received a second gradient in one backward (an inner backward "
                "of activation checkpointing, or a hook fired early) after its bucket may have been launched; set "
                "the reducer's defer = True (parallelize does under activation checkpointing; a Pipeline: "
                "pipe.overlap_buckets = False)")
        self.seen.add(id(p))
        self.waiting[k] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] <= 0:
            self._launch(self.next)
        for b in self.launched:      # MPI moves a request along only inside MPI calls: test them (DDP's poke)
            if b.work is not None and not b.work.is_completed():
                break

    def _launch(self, k: int) -> None:
        groups, scale, idx = self.buckets[k]
        grads = [g for g in (self.entries[i][0]() for i in idx) if g is not None]
        if grads:
            self.launched.append(_Launched(groups, scale, grads))
        self.next = k + 1

    def launch_all(self) -> None:
        while self.next < len(self.buckets):
            self._launch(self.next)


class _Launched:
    """One bucket of :meth:`GradReducer.start`: its gradients copied into one flat array, the sum over its first
    group in flight; :meth:`finish` waits, runs the other groups, scales, and copies the result back."""

    __slots__ = ("groups", "scale", "grads", "flat", "work", "mean")

    def __init__(self, groups: Tuple[Any, ...], scale: float, grads: List[Any]):
        self.groups, self.scale, self.grads = groups, scale, grads
        self.flat = get_array_module(grads[0]).concatenate([x.reshape(-1) for x in grads])
        self.mean = len(groups) == 1 and scale == 1.0 / groups[0].size        # plain data parallel: one mean
        self.work = all_reduce(self.flat, ReduceOp.MEAN if self.mean else ReduceOp.SUM, groups[0],
                               out=self.flat, async_op=True) if groups else None

    def finish(self) -> None:
        flat = self.flat
        if self.work is not None:
            self.work.wait()
        if not self.mean:
            reduce_gradient(flat, self.groups[1:], self.scale)
        at = 0
        for x in self.grads:
            x[...] = flat[at:at + x.size].reshape(x.shape)
            at += x.size


def _live(groups: Sequence[Any]) -> Tuple[Any, ...]:
    return tuple(g for g in groups if g is not None and g.size > 1)


def no_sync(module: Any):
    """The one no-sync switch: inside ``with no_sync(model):`` no gradient of ``model`` is reduced by any
    path (DDP's buckets, FSDP's reduce-scatter, the pipeline's data-parallel reduction, ``parallelize``'s
    tensor / depth / expert / sequence-parallel reductions); gradients accumulate locally, and the first
    backward (or pipeline step) outside reduces the accumulated sum once: ``k`` micro-steps then equal the
    serial run's ``k`` accumulated backwards.

    Args:
        module: a model from ``parallelize``, a DDP / FSDP model or a ``Pipeline`` (its ``grad_reducer``).

    Example:
        >>> for k, (xb, yb) in enumerate(micro_batches):
        ...     with no_sync(pm) if k < len(micro_batches) - 1 else contextlib.nullcontext():
        ...         F.cross_entropy(pm(xb), yb).backward()
    """
    red = getattr(module, "grad_reducer", None)
    if not isinstance(red, GradReducer):
        raise TypeError(f"no_sync: {type(module).__name__} reduces no gradients (it has no grad_reducer); pass "
                        "the model parallelize, DistributedDataParallel, FullyShardedDataParallel or Pipeline "
                        "returned, not the module inside it")
    return red.no_sync()


def check_axonn_fsdp_shapes(named_shapes: Sequence[Tuple[str, Tuple[int, ...]]], grid: Any) -> None:
    """Refuse FSDP x AxoNN when the ranks of a tensor block pack different TP-local shapes: the
    replicated parameters' gradients are summed over ``intra_group`` segment by segment of the flat
    shards (``parallelize``'s :meth:`GradReducer.after_backward_segments`), so every rank of the block must hold the same shape of each
    parameter.  Collective over the grid's ``intra_group``.

    Raises:
        NotImplementedError: naming the parameter and its shapes over the block.
    """
    got = all_gather_object([tuple(s) for _, s in named_shapes], group=grid.intra_group)
    for i, (n, _) in enumerate(named_shapes):
        if len({tuple(x[i]) for x in got}) > 1:
            raise NotImplementedError(
                f"rank {grid.world.rank}: fsdp with tp_style='axonn' needs every tensor-parallel rank to hold "
                f"the same shape of each parameter; {n!r} has shapes {[tuple(x[i]) for x in got]} over "
                "intra_group (choose sizes that divide the GPT's dimensions evenly)")
