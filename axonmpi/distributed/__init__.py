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
from .placement import Cut, Placement, Shard, ShardKind, add_placement, placement_of, set_placement
from .world import World, destroy, get_grid, get_world, init, is_initialized, resolve_group, role_group
# torch.distributed's names; the collectives below take torch's in-place form on Tensors and keep
# axonmpi's array form on arrays (they replace the array-only names imported above)
from .torch_api import (
    Backend, GroupMember, all_gather, all_gather_into_tensor, all_gather_object, all_reduce, all_to_all,
    all_to_all_single, barrier, broadcast, broadcast_object_list, destroy_process_group, gather, gather_object,
    get_backend, get_global_rank, get_group_rank, get_process_group_ranks, get_rank, get_world_size,
    init_process_group, irecv, is_available, is_gloo_available, is_mpi_available, is_nccl_available,
    is_torchelastic_launched, isend, monitored_barrier, new_group, recv, reduce, reduce_scatter,
    reduce_scatter_tensor, scatter, scatter_object_list, send,
)

__all__ = [
    "World", "ProcessGroup", "GroupMembershipError", "CollectiveMismatchError", "CollectiveTimeoutError",
    "ProcessGrid", "GridCoords", "get_grid",
    "init", "get_world", "is_initialized", "destroy", "resolve_group", "role_group",
    "Cut", "Placement", "Shard", "ShardKind", "placement_of", "set_placement", "add_placement",
    "rank", "world_size", "is_main_process",
    "ReduceOp", "Work", "chunk_sizes", "chunk_bounds",
    "all_reduce", "all_reduce_sum", "all_reduce_mean", "all_reduce_min", "all_reduce_max",
    "all_reduce_product", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_sum", "reduce_scatter_mean", "all_to_all", "barrier", "send", "recv", "isend",
    "irecv", "broadcast_object", "all_gather_object", "gather_object",
    "P2POp", "batch_isend_irecv",
    # torch.distributed's names (torch_api.py)
    "Backend", "GroupMember", "init_process_group", "destroy_process_group", "get_rank",
    "get_world_size", "get_backend", "new_group", "get_process_group_ranks", "get_global_rank",
    "get_group_rank", "monitored_barrier", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "broadcast_object_list", "scatter_object_list", "is_available",
    "is_mpi_available", "is_nccl_available", "is_gloo_available", "is_torchelastic_launched",
]

# MPI is up (mpi4py initialises it on import, and MPICH then installs a C-level SIGUSR1 handler that
# would swallow Slurm's warning): from here a SIGTERM/SIGUSR1 is recorded for the first
# PreemptionHandler. Only under a launcher: a command-line tool keeps the default actions.
from . import signals as _signals   # noqa: E402
if _signals.launched():
    _signals.record_early_signals()
    _signals.mark_ready()


def rank() -> int:
    """This process's rank in the World (initializes it on first use)."""
    return get_world().rank


def world_size() -> int:
    """Number of ranks in the World."""
    return get_world().world_size


def is_main_process() -> bool:
    """True on world rank 0."""
    return get_world().rank == 0


_TORCH_PATHS = frozenset({"device_mesh", "fsdp", "tensor"})


def __getattr__(name: str):
    # torch.distributed.fsdp / .device_mesh / .tensor (docs/porting.md): they name axonmpi.parallel's classes,
    # a layer above this one, so they load on first use
    if name in _TORCH_PATHS:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
