"""``ShardedArray`` as the checkpoint API names it; it lives in :mod:`axonmpi.distributed.sharding`."""
from ..distributed.sharding import ShardedArray, chunk_bounds, chunk_sizes

__all__ = ["ShardedArray", "chunk_sizes", "chunk_bounds"]
