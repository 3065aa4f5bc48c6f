"""Context parallelism: a sequence split over the grid's context group, attention by ring (Megatron CP) or Ulysses all-to-all."""
from .attention import ContextParallelAttention
from .gqa import ContextParallelGroupedQueryAttention, grouped_causal_attention
from .gpt import ContextParallelism, context_parallel_gpt
from .layout import CPAlgo, ContextLayout
from .ring import format_ring_schedule, ring_attention
from .ulysses import head_to_seq, seq_to_head

__all__ = ["ContextParallelAttention", "ContextParallelGroupedQueryAttention", "grouped_causal_attention", "ContextParallelism", "context_parallel_gpt", "CPAlgo", "ContextLayout", "ring_attention", "format_ring_schedule", "seq_to_head", "head_to_seq"]
