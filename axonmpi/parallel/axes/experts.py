"""Step 3 of the composer: expert parallelism for the model's ``nn.MoE`` layers.

The experts of each MoE are split over the grid's expert group (carved from data) or their hidden width
over the tensor group (AxoNN style, ``expert_tensor_parallel``); the routing statistics (router losses,
a capacity's global queue) are counted over the ranks that hold other tokens of the global batch.
A capacity (``capacity_factor``) is refused where its serial equivalent is not kept
([Note: a MoE capacity's serial equivalent]).
"""
from __future__ import annotations

from ...nn.module import Module
from ...nn.moe import MoE
from .record import Composition

__all__ = ["apply", "has_moe"]


def has_moe(module: Module) -> bool:
    return any(isinstance(m, MoE) for m in module.modules())


def apply(module: Module, c: Composition) -> None:
    """Lay out the MoE layers over the grid; ``c.experts``: the parameters split over the expert group."""
    if not has_moe(module):
        return
    from ..grad_sync import data_reduction_group
    from ..moe import expert_parallel, expert_parameters
    _refuse_capacity(module, c)
    grid = c.grid
    dgroup = data_reduction_group(grid)
    before = _expert_placements(module)
    expert_parallel(module, c.expert_parallel, grid=grid, expert_tensor_parallel=c.expert_tensor_parallel,
                    stats_group=dgroup if c.cp and not c.expert_tensor_parallel else None)
    _carry(module, before)
    if grid.intra_group.size > 1 and (c.sequence_parallel or (c.axonn and not c.expert_tensor_parallel)):
        data = dgroup if c.cp else grid.group_for("data")
        for m in module.modules():
            if isinstance(m, MoE):
                if c.axonn:
                    m.stats_group = (data, grid.intra_group)
                else:
                    m.sequence_group = grid.intra_group
    c.experts = expert_parameters(module)


def _expert_tensors(module: Module):
    for i, m in enumerate(x for x in module.modules() if isinstance(x, MoE)):
        for name in ("fc", "proj"):
            layer = getattr(m.experts, name)
            for attr in ("weight", "bias"):
                p = getattr(layer, attr, None)
                if p is not None:
                    yield (i, name, attr), p


def _expert_placements(module: Module):
    from ...distributed.placement import placement_of
    return {k: placement_of(p) for k, p in _expert_tensors(module)}


def _carry(module: Module, before) -> None:
    """The experts' new (split) parameters keep what steps 1 and 2 recorded on the serial ones: their replica
    groups (the context group) and partial groups (the tensor group under sequence parallelism)."""
    from ...distributed.placement import add_placement
    for k, p in _expert_tensors(module):
        old = before.get(k)
        if old is None:
            continue
        for r in old.replicas:
            add_placement(p, replica=r)
        for g in old.partial:
            add_placement(p, partial=g)


def _refuse_capacity(module: Module, c: Composition) -> None:
    """[Note: a MoE capacity's serial equivalent]  With ``capacity_factor`` the serial model drops, per expert,
    the assignments beyond ``ceil(c * tokens * k / E)`` of the global batch in (choice, token) order.  Data
    parallelism keeps it (each rank's place in the queue comes from the lower data ranks').  Where a rank's
    tokens are not a contiguous run of that order the queue cannot be rebuilt, and a pipeline routes each
    micro-batch on its own (a capacity per micro-batch): those layouts are refused, naming the reason."""
    how = None
    if c.cp:
        how = (f"context parallelism ({c.context}): a rank holds tokens from every part of each sequence, so the "
               "global batch's queue order (token by token) is not a rank order")
    elif c.sp:
        how = "sequence_parallel: the tensor ranks hold other tokens of each sequence (not a rank order)"
    elif c.axonn and not c.expert_tensor_parallel and c.grid.intra_group.size > 1:
        how = "AxoNN's easy mode (rows over data x tensor): its global queue orders one group of batch slices only"
    elif c.pipeline is not None:
        how = "a pipeline: each micro-batch is routed alone, so the capacity would be per micro-batch, not per batch"
    if how is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, MoE) and m.capacity_factor is not None:
            raise NotImplementedError(
                f"rank {c.rank}: {name!r} has capacity_factor={m.capacity_factor} under {how}; the serial model's "
                "drops cannot be reproduced there: use a dropless MoE (capacity_factor=None), or a data / expert / "
                "Megatron tensor-parallel layout (docs/moe.md, 'Capacity')")
