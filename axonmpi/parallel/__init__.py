"""Parallel strategies: data parallel (DDP) and the flat parameter the sharded strategies build on."""
from ._flat import FlatLayout, FlatParameter, FlatSegment
from .ddp import (
    DDP, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy, allreduce_hook,
    fp16_compress_hook,
)

__all__ = [
    "DDP", "DistributedDataParallel", "GradSyncStrategy", "GradientBucket", "GradientSynchronizer",
    "allreduce_hook", "fp16_compress_hook", "FlatLayout", "FlatParameter", "FlatSegment",
]
