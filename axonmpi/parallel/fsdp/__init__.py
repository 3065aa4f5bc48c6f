"""Sharded data parallel (ZeRO-2/3, hybrid shard, CPU offload, mixed precision): ``FullyShardedDataParallel``."""
from .api import CPUOffload, FSDPMemoryStats, MixedPrecision, ShardingStrategy
from .memory import MemoryEstimate, estimate_memory
from .runtime import FSDP, FullyShardedDataParallel
from .unit import FSDPUnit
from .wrap import (ModuleWrapPolicy, SizeWrapPolicy, find_units, size_based_auto_wrap_policy,
                   transformer_auto_wrap_policy)

__all__ = [
    "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
    "CPUOffload", "FSDP", "FSDPMemoryStats", "FSDPUnit", "FullyShardedDataParallel", "MemoryEstimate",
    "MixedPrecision", "ModuleWrapPolicy", "ShardingStrategy", "SizeWrapPolicy", "estimate_memory", "find_units",
]
