"""``torch.distributed.fsdp``'s path: ``FullyShardedDataParallel`` with torch's constructor and torch's
configuration names (``ShardingStrategy``, ``MixedPrecision``, ``CPUOffload``, ``BackwardPrefetch``); the
wrap policies in ``axonmpi.distributed.fsdp.wrap``. FSDP2's ``fully_shard`` is not served (docs/porting.md).

Under ``distributed/`` by torch's name only: it imports the parallel layer, and nothing in the library
imports it (``import axonmpi`` does, last, so that ``torch.distributed.fsdp`` resolves as an attribute).
"""
from . import fully_sharded_data_parallel, wrap
from .fully_sharded_data_parallel import (FSDP, BackwardPrefetch, CPUOffload, FullyShardedDataParallel,
                                          MixedPrecision, ShardingStrategy)

__all__ = ["FullyShardedDataParallel", "FSDP", "CPUOffload", "BackwardPrefetch", "MixedPrecision", "ShardingStrategy",
           "fully_sharded_data_parallel", "wrap"]
