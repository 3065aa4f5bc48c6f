"""Parallel strategies: data parallel (DDP) now; sharded, pipeline and tensor parallel build here."""
from .ddp import (
    DDP, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy, allreduce_hook,
    fp16_compress_hook,
)

__all__ = [
    "DDP", "DistributedDataParallel", "GradSyncStrategy", "GradientBucket", "GradientSynchronizer",
    "allreduce_hook", "fp16_compress_hook",
]
