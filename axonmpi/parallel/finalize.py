"""The one finalize step after backward: every sum a parameter's placement asks for (Megatron's ``finalize_model_grads``).

[Note: the finalize step]  After a backward (a pipeline: after the step's last micro-batch) each gradient is
summed over the groups the placements give, read here and nowhere else:

* the data replicas (data x context; AxoNN's easy mode: and the tensor block), as the mean of the global batch --
  by DDP's buckets overlapped with backward or FSDP's reduce-scatter where the model is wrapped in them (their
  own executors, parts of the model's :class:`~axonmpi.parallel.grad_sync.GradReducer`), by the pipeline's
  reduction of each stage, or by an entry here (AxoNN's table, the experts' expert-data groups);
* ``placement.partial``: the tensor group of a parameter run on sequence shards ([Note: partial gradients under
  sequence parallelism]);
* ``placement.tied``: the ranks holding copies of one tied weight (the first and last pipeline stage);
* FSDP flat chunks of tensor-parallel shards: each segment over its parameter's groups.

The entries are bucketed by (groups, scale, dtype) and run in one pass: without a pipeline at the end of the
backward pass (queued from the gradient hooks), with one by :meth:`PipelinedModule.step`.  ``no_sync`` turns the
whole step off; the first finalize outside sums what accumulated (every sum is linear).
"""
from __future__ import annotations

from typing import Any, Iterable, List, Sequence

from ..distributed.placement import placement_of
from .grad_sync import GradReducer, data_reduction_group, reduction_groups

__all__ = ["UnusedCheck", "UnusedParameterError", "finalize_entries", "finalize_grads", "pipeline_entries", "segment_entries"]


def finalize_grads(model: Any) -> None:
    """Run ``model``'s finalize step now (collective over its groups): a pipelined model calls it after its
    step's last backward; a model without a pipeline runs it at the end of each backward by itself."""
    model.grad_reducer.run()


def _batch_groups(c) -> tuple:
    return (c.grid.intra_group,) if c.axonn else ()


def _shards(c) -> int:
    """The number of batch shards the loss is the mean over (data x context; AxoNN: x the tensor block)."""
    g = c.grid
    return g.G_data * (g.G_intra if c.axonn else 1) * getattr(g, "G_context", 1)


def _live(groups: Sequence[Any]) -> tuple:
    out: List[Any] = []
    for grp in groups:
        if grp is not None and grp.size > 1 and not any(grp is h or getattr(h, "ranks", 0) == grp.ranks for h in out):
            out.append(grp)
    return tuple(out)


def finalize_entries(reducer: GradReducer, module, c, wrapped) -> None:
    """A model without a pipeline: the entries of every parameter its wrapper (DDP / FSDP) does not reduce in
    full, and the hooks that run them at the end of each backward."""
    g = c.grid
    data = data_reduction_group(g) if c.data is not None else None
    experts = {id(p) for p in c.experts}
    in_flat = {id(q) for f in getattr(wrapped, "parameters", lambda: [])() for q in getattr(f, "params", ())}
    wrapper_reduces = c.data == "fsdp" or (c.data == "ddp" and not c.axonn)
    # the table's data / batch sums here (a pipeline you build over these stages reduces them itself)
    table = c.data is not None or (c.axonn and g.G_inter == 1)
    scale = 1.0 / _shards(c)
    entries = []
    for p in module.parameters():
        if not p.requires_grad or id(p) in in_flat:
            continue
        partial = placement_of(p).partial_groups
        if (wrapper_reduces and id(p) not in experts) or not table:
            groups, s = partial, 1.0             # the wrapper took the data mean (or nobody here does)
        else:
            groups, s = partial + tuple(reduction_groups(p, data, _batch_groups(c), g.depth_group)), scale
        if _live(groups) or s != 1.0:
            entries.append((p, _live(groups), s))
    for p, groups, s in entries:
        reducer.after_backward([p], lambda q, groups=groups: groups, s)
    reducer.before_run(UnusedCheck(module.named_parameters(), g))
    reducer.defer = c.checkpointing not in (None, False)     # a hook may fire before its gradient is final
    if g.G_inter == 1:        # on a pipeline grid the Pipeline you build runs it after the step's last backward
        # buckets launch during backward only where no wrapper reduces in it too (DDP rebinds .grad to its buckets)
        reducer.arm([p for p in module.parameters() if p.requires_grad], as_ready=wrapped is module)


def segment_entries(reducer: GradReducer, flats: Iterable[Any], c) -> None:
    """FSDP chunks of a tensor-parallel layout, after the reduce-scatter over data: AxoNN's table on each segment
    (3-D biases over depth, replicated parameters over the tensor block, all divided by the block's size); a
    Megatron layout's partial parameters over their groups (sequence parallelism's tensor group, replicated
    key/value heads' replicas)."""
    g = c.grid
    flats = list(flats)
    if c.axonn:
        reducer.after_backward_segments(flats, lambda q: reduction_groups(q, None, (g.intra_group,), g.depth_group),
                                        1.0 / g.G_intra)
    else:
        reducer.after_backward_segments(flats, lambda q: placement_of(q).partial_groups)


def pipeline_entries(reducer: GradReducer, params: Iterable[Any], flats: Sequence[Any], c) -> None:
    """A pipelined model (the pipeline reduces each stage over its data groups): tied copies over their group,
    partial gradients over the tensor group, and the stages' FSDP segments."""
    in_flat = {id(q) for f in flats for q in f.params}
    for p in params:
        if not p.requires_grad or id(p) in in_flat:
            continue
        pl = placement_of(p)
        groups = _live(pl.partial_groups + ((pl.tied,) if pl.tied is not None else ()))
        if groups:
            reducer.after_backward([p], lambda q, groups=groups: groups)
    segment_entries(reducer, flats, c)


class UnusedParameterError(RuntimeError):
    """A trainable parameter received no gradient in a step under ``parallelize`` ([Note: unused parameters])."""


class UnusedCheck:
    """[Note: unused parameters]  A trainable parameter no forward of a step uses has no gradient in the serial
    model, so its optimizer skips it (no update, no weight decay).  Flat shards (FSDP) step it as part of one
    tensor and cannot skip it, so ``parallelize`` refuses such a parameter under every layout, with one message,
    at the end of the first step's backward (collective over the world: every rank raises, naming every rank's
    unused parameters).  Freeze it (``p.requires_grad_(False)``) or remove it."""

    def __init__(self, named_params, grid):
        self.grid = grid
        self.params = [(n, p) for n, p in named_params if p.requires_grad]
        self.used = set()
        self.done = False
        self.handles = [p.register_post_accumulate_grad_hook(self._mark) for _, p in self.params]

    def _mark(self, p) -> None:
        self.used.add(id(p))

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        for h in self.handles:
            h.remove()
        import numpy as np
        from ..distributed import ReduceOp, all_gather_object, all_reduce
        mine = [n for n, p in self.params if id(p) not in self.used]
        world = self.grid.world.default_group
        if not int(all_reduce(np.array([len(mine)], np.int64), ReduceOp.SUM, world)[0]):
            return
        found = sorted({n for part in all_gather_object(mine, group=world) for n in part})
        raise UnusedParameterError(
            f"rank {self.grid.rank}: parameters {found} received no gradient in this step (no forward used them). "
            "The serial model's optimizer would skip them (no update, no weight decay), which flat shards cannot "
            "do, so parallelize refuses unused parameters under every layout: freeze them "
            "(p.requires_grad_(False)) or remove them from the model")
