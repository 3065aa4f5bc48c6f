"""Megatron-style 1-D tensor parallelism: differentiable region mappings and column/row/vocab/attention layers."""
from .layers import (
    ColumnParallelLinear, RowParallelLinear, SequenceParallelLayerNorm, TensorParallelAttention, TensorParallelMLP, VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .kv import ColumnParallelKVLinear, kv_head_groups
from .groups import TensorParallelGroups, default_groups, one_d_group
from .mappings import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region,
)
from .state import full_state_dict, load_full_state_dict, load_sharded_state_dict, sharded_state_dict
from .transformer import SequenceParallelDropout

__all__ = [
    "ColumnParallelLinear", "ColumnParallelKVLinear", "kv_head_groups", "RowParallelLinear", "TensorParallelAttention", "TensorParallelMLP",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "SequenceParallelLayerNorm", "SequenceParallelDropout",
    "TensorParallelGroups", "default_groups", "one_d_group",
    "full_state_dict", "load_full_state_dict", "load_sharded_state_dict", "sharded_state_dict",
]

_GONE = {"parallelize_gpt": "axonmpi.parallel.parallelize(model, tensor_parallel=axonmpi.recipes.gpt.gpt_plan(config), "
                            "sequence_parallel=..., model_plan=axonmpi.recipes.gpt.gpt_model_plan(config)), or the "
                            "recipe axonmpi.recipes.HybridGPT"}


def __getattr__(name: str):
    if name in _GONE:
        raise AttributeError(f"axonmpi.parallel.tensor.{name} is gone: parallelize is the one composer; "
                             f"use {_GONE[name]} (docs/tensor_parallel.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
