"""Context parallelism: a sequence split over the grid's context group, attention by ring (Megatron CP) or Ulysses all-to-all."""
from .attention import ContextParallelAttention
from .gqa import ContextParallelGroupedQueryAttention, grouped_causal_attention
from .layout import CPAlgo, ContextLayout
from .ring import format_ring_schedule, ring_attention
from .ulysses import head_to_seq, seq_to_head

__all__ = ["ContextParallelAttention", "ContextParallelGroupedQueryAttention", "grouped_causal_attention", "CPAlgo", "ContextLayout", "ring_attention", "format_ring_schedule", "seq_to_head", "head_to_seq"]

_GONE = ("context_parallel_gpt", "ContextParallelism", "ContextParallelModel", "ContextParallelEmbedding",
         "context_parallel_embedding")


def __getattr__(name: str):
    if name in _GONE:
        raise AttributeError(f"axonmpi.parallel.context.{name} is gone: parallelize is the one composer; use "
                             "axonmpi.parallel.parallelize(model, context_parallel='ring' | 'ulysses') on a grid with "
                             "G_context > 1 (pm.local_batch gives this rank's tokens; docs/context_parallel.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
