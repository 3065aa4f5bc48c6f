"""Parallel strategies: data parallel (DDP), the flat parameter the sharded strategies build on, tensor
parallel (Megatron 1-D in ``tensor``, AxoNN 3-D in ``intra_layer``, ``auto_parallelize``), pipeline parallel (``pipeline``),
expert parallelism for ``nn.MoE`` (``moe``); every layout's gradients go through one reducer
(``grad_sync.GradReducer``) with one switch, ``no_sync(model)``."""
from ._flat import FlatLayout, FlatParameter, FlatSegment
from .ddp import (
    DDP, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy, allreduce_hook,
    fp16_compress_hook,
)
from . import fsdp, intra_layer, tensor
from .fsdp import (
    FSDP, CPUOffload, FSDPMemoryStats, FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy, ShardingStrategy,
    SizeWrapPolicy,
)
from .auto_parallelize import auto_parallelize
from .parallelize import (ModelPlan, ParallelModule, PipelinePlan, PipelinedModule, SequenceRegion, full_state_dict,
                          parallelize)
from .finalize import UnusedParameterError, finalize_grads
from .state import ShardedState
from . import grad_sync
from .grad_sync import GradReducer, no_sync
from . import moe
from .moe import expert_parallel
from .tensor.groups import TensorParallelGroups
from .pipeline import *  # noqa: F401,F403  (Pipeline, PipelineSchedule, make_schedule, split_module, ...)
from . import pipeline

__all__ = [
    "DDP", "DistributedDataParallel", "GradSyncStrategy", "GradientBucket", "GradientSynchronizer",
    "TensorParallelGroups", "FlatLayout", "FlatParameter", "FlatSegment",
    "FSDP", "FullyShardedDataParallel", "ShardingStrategy", "CPUOffload", "MixedPrecision", "FSDPMemoryStats",
    "ModuleWrapPolicy", "SizeWrapPolicy", "fsdp",
    "ModelPlan", "ParallelModule", "PipelinePlan", "PipelinedModule", "SequenceRegion", "ShardedState", "parallelize",
    "UnusedParameterError", "finalize_grads", "full_state_dict", "grad_sync", "moe", "expert_parallel",
    "GradReducer", "no_sync", "allreduce_hook", "auto_parallelize", "fp16_compress_hook", "intra_layer", "tensor",
]
__all__ += pipeline.__all__
