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
sequence-parallel (``sequence_parallel``)  also the tensor group, inside backward
=========================================  ==========================================

Context parallelism (``G_context > 1``): the ranks of a context group see different tokens of the
same samples, so every gradient's ``data`` group is data x context (:func:`data_reduction_group`,
Megatron's ``dp_cp`` group); the parameters record the context group as a replica.  Sequence
parallelism: a parameter used on sequence shards (LayerNorm, a row-parallel bias; tag
``sequence_parallel``) has its gradient summed over the tensor group in backward (the layer takes it
through ``copy_to_tensor_parallel_region``, or ``parallelize`` hooks it), so the rest of the table
sees the full gradient.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Sequence, Tuple

import numpy as np

from ..distributed import ReduceOp, all_gather_object, all_reduce
from ..distributed.placement import ShardKind, check_group, placement_of

__all__ = ["check_axonn_fsdp_shapes", "check_group", "data_reduction_group", "finish_axonn_fsdp", "mean_over",
           "reduce_gradient", "reduction_groups", "sharded_within"]


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
        param: a parameter (its :func:`placement_of` is read, and AxoNN's
            ``needs_depth_parallel_gradient_sync`` tag of 3-D biases).
        data: the data-parallel group.
        batch: the extra groups that split the batch rows inside a tensor-parallel block.
        depth: the depth group of AxoNN's layers (for their biases).

    Example:
        >>> [g.name for g in reduction_groups(layernorm.weight, grid.data_group, [grid.intra_group])]
        ['data_group', 'intra_group']
    """
    pl = placement_of(param)
    if getattr(param, "needs_depth_parallel_gradient_sync", False):
        out = [data, depth]
    elif sharded_within(param, data):       # an expert: its expert-data replicas, and the batch groups (its
        split = {getattr(s.group, "ranks", None) for s in pl.shards}          # gradient is of this rank's rows;
        out = [r for r in pl.replica_groups if _inside(r, data)] + \
            [b for b in batch if getattr(b, "ranks", 0) not in split]         # not one that splits it)
    elif any(s.kind is not ShardKind.STAGE for s in pl.shards) or getattr(param, "is_tensor_parallel", False):
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


def finish_axonn_fsdp(fsdp: Any, grid: Any) -> None:
    """FSDP x AxoNN 3-D layers, after FSDP averaged every flat chunk over the data group: the rest of
    the table on each segment (3-D biases over depth, replicated parameters over the tensor block) and
    the division by the tensor block's size (each of its ranks read its own rows).  The ranks of one
    tensor block hold chunks over the same elements (same data rank, same local shapes), so they
    reduce together."""
    scale = 1.0 / grid.G_intra
    for f in fsdp.parameters():
        if f.grad is None:
            continue
        grad = f.grad.data
        for seg in f.segments():
            reduce_gradient(seg.in_chunk(grad), reduction_groups(f.params[seg.index], None, (grid.intra_group,),
                                                                 grid.depth_group), scale)


def check_axonn_fsdp_shapes(named_shapes: Sequence[Tuple[str, Tuple[int, ...]]], grid: Any) -> None:
    """Refuse FSDP x AxoNN when the ranks of a tensor block pack different TP-local shapes: the
    replicated parameters' gradients are summed over ``intra_group`` segment by segment of the flat
    shards (:func:`finish_axonn_fsdp`), so every rank of the block must hold the same shape of each
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
