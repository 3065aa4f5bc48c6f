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
from .transformer import SequenceParallelDropout, parallelize_gpt

__all__ = [
    "ColumnParallelLinear", "ColumnParallelKVLinear", "kv_head_groups", "RowParallelLinear", "TensorParallelAttention", "TensorParallelMLP",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "SequenceParallelLayerNorm", "SequenceParallelDropout",
    "TensorParallelGroups", "default_groups", "one_d_group",
    "full_state_dict", "load_full_state_dict", "load_sharded_state_dict", "sharded_state_dict", "parallelize_gpt",
]
