"""``parallelize_gpt``: turn a serial transformer (``axonmpi.models.GPT`` or any model built from
``nn.CausalSelfAttention`` / ``nn.MLP`` blocks) into Megatron's 1-D layout, keeping its weights."""
from __future__ import annotations

from typing import Optional

from ...distributed import ProcessGroup
from ...nn import CausalSelfAttention, Dropout, Embedding, LayerNorm, Linear, MLP, Module
from .groups import one_d_group
from .layers import (ColumnParallelLinear, SequenceParallelLayerNorm, TensorParallelAttention, TensorParallelMLP,
                     VocabParallelEmbedding)
from .mappings import scatter_to_sequence_parallel_region
from .state import load_full_state_dict
from ..swap import swap_modules

__all__ = ["parallelize_gpt", "SequenceParallelDropout"]


class SequenceParallelDropout(Dropout):
    """Enter the sequence-parallel region: keep this rank's block of the sequence (dimension -2; backward:
    all-gather), then dropout on it.  Replaces a GPT's embedding dropout (``drop``)."""

    def __init__(self, p: float, group: ProcessGroup):
        super().__init__(p)
        self.group = group

    def forward(self, x):
        return super().forward(scatter_to_sequence_parallel_region(x, self.group, dim=-2))


def _loaded(new: Module, old: Module) -> Module:
    """``new`` holding ``old``'s (serial) weights, each rank its shard."""
    load_full_state_dict(new, Module.state_dict(old))
    return new


def parallelize_gpt(model: Module, group: Optional[ProcessGroup] = None, *, vocab_parallel: bool = True,
                    sequence_parallel: bool = False) -> Module:
    """Swap, in place, every attention for :class:`TensorParallelAttention` (heads split), every MLP for
    :class:`TensorParallelMLP`, and (``vocab_parallel``) ``wte`` for a :class:`VocabParallelEmbedding` and
    ``lm_head`` for a :class:`ColumnParallelLinear` gathering the logits.  Weights are kept (each rank
    keeps its shard); ``state_dict`` names and full shapes are unchanged (see ``full_state_dict``).

    Replicated parameters (LayerNorms, ``wpe``, row-parallel biases) get identical gradients on every
    rank of ``group``; reduce gradients over the data-parallel group only.

    Args:
        model: the serial model, built identically on every rank.
        group: the tensor-parallel group (default: the current grid's ``intra_group``).
        vocab_parallel: also split ``wte`` and ``lm_head`` over the vocabulary.
        sequence_parallel: Megatron's sequence parallelism: from the embedding dropout (``drop``, which
            keeps this rank's ``T/p`` tokens) to ``lm_head`` (which all-gathers them), LayerNorms,
            dropouts and residual adds run on sequence shards; the attention and MLP all-gather /
            reduce-scatter the sequence instead of all-reducing; every LayerNorm becomes a
            :class:`SequenceParallelLayerNorm` (gradients all-reduced over ``group``).  Needs
            ``vocab_parallel`` and sequences whose length divides by the group size.

    Returns:
        ``model`` itself.

    Example:
        >>> model = parallelize_gpt(GPT(cfg, dtype="float64"), group=tp)
        >>> logits, loss = model(idx, targets)          # same results as the serial model
    """
    g = one_d_group(group)
    sp = bool(sequence_parallel)
    if sp and not vocab_parallel:
        raise ValueError(f"rank {g.world.rank}: parallelize_gpt(sequence_parallel=True) needs vocab_parallel=True "
                         "(lm_head all-gathers the sequence shards)")
    if sp and type(getattr(model, "drop", None)) is not Dropout:
        raise ValueError(f"rank {g.world.rank}: parallelize_gpt(sequence_parallel=True) enters the sequence-parallel "
                         f"region at the model's embedding dropout 'drop', which {type(model).__name__} does not have")
    tied = getattr(model, "wte", None) is not None and getattr(getattr(model, "lm_head", None), "weight", None) \
        is getattr(model.wte, "weight", False)

    def swap(parent, name, child, _):
        dtype = next(iter(child.parameters())).dtype if any(True for _ in child.parameters()) else None
        if type(child) is CausalSelfAttention:
            return _loaded(TensorParallelAttention(child.n_embd, child.n_head, group=g, causal=True,
                                                   dropout=child.attn_dropout.p, bias=child.qkv.bias is not None,
                                                   dtype=dtype, sequence_parallel=sp), child)
        if type(child) is MLP:
            return _loaded(TensorParallelMLP(child.fc.in_features, child.fc.out_features,
                                             bias=child.fc.bias is not None, group=g,
                                             approximate=child.act.approximate, dropout=child.dropout.p,
                                             dtype=dtype, sequence_parallel=sp), child)
        if sp and type(child) is LayerNorm:
            return _loaded(SequenceParallelLayerNorm(child.normalized_shape, child.eps, child.elementwise_affine,
                                                     bias=child.bias is not None, group=g, dtype=dtype), child)
        if sp and parent is model and name == "drop" and type(child) is Dropout:
            return SequenceParallelDropout(child.p, g)
        if vocab_parallel and name == "wte" and type(child) is Embedding:
            return _loaded(VocabParallelEmbedding(child.num_embeddings, child.embedding_dim, group=g,
                                                  dtype=dtype, padding_idx=child.padding_idx), child)
        if vocab_parallel and name == "lm_head" and type(child) is Linear:
            return _loaded(ColumnParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                                gather_output=True, group=g, dtype=dtype, sequence_parallel=sp),
                           child)
        return None

    swap_modules(model, swap)
    if tied and vocab_parallel:     # both hold vocabulary rows chunk_bounds(V, p, rank): share one Parameter again
        if model.lm_head.weight.data.shape != model.wte.weight.data.shape:
            raise ValueError(f"rank {g.world.rank}: the tied head's shard {tuple(model.lm_head.weight.data.shape)} and the "
                             f"embedding's {tuple(model.wte.weight.data.shape)} differ; cannot keep them tied")
        model.lm_head.weight = model.wte.weight
    return model
