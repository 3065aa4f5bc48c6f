"""Parallel strategies: data parallel (DDP) now; sharded, pipeline and tensor parallel build here."""
from .ddp import (
    DDP, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy, allreduce_hook,
    fp16_compress_hook,
)
from .pipeline import *  # noqa: F401,F403  (Pipeline, PipelineSchedule, make_schedule, split_module, ...)
from . import pipeline

__all__ = [
    "DDP", "DistributedDataParallel", "GradSyncStrategy", "GradientBucket", "GradientSynchronizer",
    "allreduce_hook", "fp16_compress_hook",
]
__all__ += pipeline.__all__
