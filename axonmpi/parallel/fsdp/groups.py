"""FSDP's process groups: the shard group and, under hybrid shard, the replicate group (collective over the data group)."""
from __future__ import annotations

from typing import Optional

from ...distributed import get_world, resolve_group, role_group
from .api import ShardingStrategy

__all__ = ["resolve_groups"]


def resolve_groups(group, strategy: ShardingStrategy, hybrid_shard_size: Optional[int]):
    """``(shard_group, replicate_group or None)`` for a strategy (collective over the data group)."""
    world = get_world()
    if strategy is ShardingStrategy.HYBRID_SHARD and isinstance(group, tuple):
        if len(group) != 2:
            raise ValueError(f"rank {world.rank}: HYBRID_SHARD group must be (shard_group, replicate_group), "
                             f"got a tuple of {len(group)}")
        if hybrid_shard_size is not None:
            raise ValueError(f"rank {world.rank}: give either group=(shard, replicate) or hybrid_shard_size, not both")
        return resolve_group(group[0]), resolve_group(group[1])
    if isinstance(group, tuple):
        raise ValueError(f"rank {world.rank}: a (shard_group, replicate_group) tuple needs "
                         f"sharding_strategy=HYBRID_SHARD, got {strategy.name}")
    if hybrid_shard_size is not None and strategy is not ShardingStrategy.HYBRID_SHARD:
        raise ValueError(f"rank {world.rank}: hybrid_shard_size needs HYBRID_SHARD, got {strategy.name}")
    data = role_group("data", group)
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return data, None
    if strategy is ShardingStrategy.NO_SHARD:
        return world.split(data.rank, parent=data, name="fsdp_self"), data
    if hybrid_shard_size is None:             # the data ranks of this node
        shard = world.split(world.node_rank, parent=data, name="fsdp_shard_node")
        sizes = data.comm.allgather(shard.size)
        if len(set(sizes)) != 1:
            raise ValueError(f"rank {world.rank}: HYBRID_SHARD needs the same number of data ranks on every "
                             f"node, got {sorted(set(sizes))}; pass hybrid_shard_size or group=(shard, replicate)")
    else:
        k = int(hybrid_shard_size)
        if k < 1 or data.size % k:
            raise ValueError(f"rank {world.rank}: HYBRID_SHARD hybrid_shard_size={k} does not divide the data "
                             f"group size {data.size}")
        shard = world.split(data.rank // k, parent=data, name=f"fsdp_shard{k}")
    rep = world.split(shard.rank, parent=data, name=f"fsdp_replicate{data.size // shard.size}")
    return shard, rep
