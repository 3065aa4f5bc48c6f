"""Process groups and collectives on MPI: the World, ProcessGroup, all_reduce, broadcast, ..."""
from .collectives import (
    ReduceOp, Work, all_gather, all_gather_object, all_reduce, all_reduce_max, all_reduce_mean,
    all_reduce_min, all_reduce_product, all_reduce_sum, all_to_all, barrier, broadcast,
    broadcast_object, chunk_bounds, chunk_sizes, gather, gather_object, irecv, isend, recv, reduce,
    reduce_scatter, reduce_scatter_mean, reduce_scatter_sum, scatter, send,
)
from .collectives import P2POp, batch_isend_irecv
from .debug import CollectiveMismatchError, CollectiveTimeoutError
from .grid import GridCoords, ProcessGrid
from .group import GroupMembershipError, ProcessGroup
from .placement import Placement, Shard, ShardKind, add_placement, placement_of, set_placement
from .world import World, destroy, get_grid, get_world, init, is_initialized, resolve_group, role_group

__all__ = [
    "World", "ProcessGroup", "GroupMembershipError", "CollectiveMismatchError", "CollectiveTimeoutError",
    "ProcessGrid", "GridCoords", "get_grid",
    "init", "get_world", "is_initialized", "destroy", "resolve_group", "role_group",
    "Placement", "Shard", "ShardKind", "placement_of", "set_placement", "add_placement",
    "rank", "world_size", "is_main_process",
    "ReduceOp", "Work", "chunk_sizes", "chunk_bounds",
    "all_reduce", "all_reduce_sum", "all_reduce_mean", "all_reduce_min", "all_reduce_max",
    "all_reduce_product", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_sum", "reduce_scatter_mean", "all_to_all", "barrier", "send", "recv", "isend",
    "irecv", "broadcast_object", "all_gather_object", "gather_object",
    "P2POp", "batch_isend_irecv",
]


def rank() -> int:
    """This process's rank in the World (initializes it on first use)."""
    return get_world().rank


def world_size() -> int:
    """Number of ranks in the World."""
    return get_world().world_size


def is_main_process() -> bool:
    """True on world rank 0."""
    return get_world().rank == 0
