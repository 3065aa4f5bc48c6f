"""Step 5 of the composer: data parallelism over each parameter's replica group (DDP, FSDP, or the finalize step).

The data-parallel group of a layout is data x context (``grid.data_context_group``).  Without a pipeline the
model is wrapped: DDP (bucketed all-reduce overlapped with backward; the experts left to their own groups) or
FSDP (flat shards over data x context, a tensor-parallel layout's shards flattened as they are); with a pipeline
each stage is a unit of its own: its FSDP flat shard (:func:`stage_shard`) or the Pipeline's reduction.  Every
other sum -- sequence-parallel partial gradients, AxoNN's table, experts, tied copies -- is an entry of the
model's finalize step (:mod:`axonmpi.parallel.finalize`), read from the placements.
"""
from __future__ import annotations

import contextlib
from typing import Any, List, Tuple

from ...nn.module import Module
from .record import Composition

__all__ = ["apply", "stage_shard"]


def apply(module: Module, c: Composition) -> Tuple[Module, Any]:
    """``(the model as wrapped, its reducer)``: DDP / FSDP around ``module`` and the model's finalize entries."""
    from ..finalize import finalize_entries
    from ..grad_sync import GradReducer, data_reduction_group
    reducer = GradReducer("parallelize")
    dgroup = data_reduction_group(c.grid)
    wrapped = module
    if c.data == "ddp" and not c.axonn:
        from ..ddp import DistributedDataParallel
        opts = dict(c.strategy_options)
        if c.experts:
            opts["ignored_parameters"] = c.experts
        wrapped = DistributedDataParallel(module, group=dgroup, **opts)
        # [Note: DDP and activation checkpointing]: a checkpointed module's parameters are ready at the pass's end
        wrapped.synchronizer.defer_to_end = c.checkpointing not in (None, False)
    elif c.data == "ddp" and c.strategy_options:
        raise ValueError(f"rank {c.rank}: AxoNN layouts reduce through the gradient-sync table; DDP options "
                         f"{sorted(c.strategy_options)} do not apply")
    elif c.data == "fsdp":
        wrapped = _fsdp(module, c, dgroup)
    finalize_entries(reducer, module, c, wrapped)
    return wrapped, reducer


def _fsdp(module: Module, c: Composition, dgroup) -> Module:
    """FSDP over data x context; the experts (split over the expert group) stay outside its flat shards; a
    tensor-parallel layout's segments are summed over the groups of the table after FSDP's reduce-scatter."""
    from ..fsdp import FSDP
    opts = dict(c.strategy_options)
    if c.sharding_strategy is not None:
        opts["sharding_strategy"] = c.sharding_strategy
    with _hidden(module, c.experts):     # [Note: FSDP with expert parallelism]
        wrapped = FSDP(module, group=dgroup, **opts)
    wrapped.defer_to_end = c.checkpointing not in (None, False)
    if c.tensor is not None:
        from ..finalize import segment_entries
        segment_entries(wrapped.grad_reducer, list(wrapped.parameters()), c)
    return wrapped


@contextlib.contextmanager
def _hidden(module: Module, params):
    """``params`` left out of ``module``'s parameters while inside (their slots hold ``None``), put back after."""
    ids = {id(p) for p in params}
    slots = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None and id(p) in ids]
    for m, n, _ in slots:
        m._parameters[n] = None
    try:
        yield
    finally:
        for m, n, p in slots:
            m._parameters[n] = p


def stage_shard(chunk: Module, group, shared, data=None) -> Tuple[Any, List[Any], List[Any]]:
    """[Note: FSDP in a pipeline]  A pipeline stage's parameters as one
    :class:`~axonmpi.parallel.FlatParameter` sharded over ``group`` (data x context, or hybrid shard's shard
    group): the optimizer holds this rank's chunk.  A step all-gathers it once before the first micro-batch
    and reduce-scatters the accumulated gradient once after the last (FSDP2's behaviour under a pipeline
    schedule, ``reshard_after_forward=False``), then frees the full copy.  Left out, whole: the experts (split
    over a subgroup of ``data``, default ``group``: their own replica groups reduce them; hybrid shard's ``group``
    is one node's part of ``data``, which an expert group may span), a weight ``shared`` with another chunk
    (summed between the stages by the tie), and frozen parameters (never reduced).

    Returns:
        ``(flat or None, experts, shared parameters)`` of the chunk.
    """
    from ...distributed.placement import set_placement
    from .._flat import FlatParameter
    from ..grad_sync import sharded_within
    named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
    data = group if data is None else data
    inside = [(n, p) for n, p in named if not sharded_within(p, data) and id(p) not in shared]
    flat = None
    if inside:
        flat = FlatParameter([p for _, p in inside], [n for n, _ in inside]).shard(group)
        set_placement(flat, flat.placement)     # its own (a flat chunk over ``group``)
    experts = [p for _, p in named if sharded_within(p, data)]
    tied = [p for _, p in named if id(p) in shared]
    return flat, experts, tied
