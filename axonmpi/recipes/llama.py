"""The Llama recipe: the Llama's plan for the composer (``parallelize``), as the GPT's is in ``recipes/gpt.py``.

[Note: the Llama recipe]  What only the Llama knows, as data:

* :func:`llama_plan`: Megatron's split -- ``q_proj`` and ``gate_proj`` / ``up_proj`` column-parallel (heads and
  MLP columns), ``k_proj`` / ``v_proj`` ``"column_kv"`` (key/value heads split over the tensor group, or, when
  there are fewer than its ranks, each rank's head replicated over the ranks sharing it: Megatron's rule,
  [Note: replicated key/value heads]), ``o_proj`` / ``down_proj`` row-parallel; the embedding
  vocabulary-parallel and ``lm_head`` gathered where the vocabulary (its padded rows,
  ``LlamaConfig.padded_vocab_size``) divides (always under sequence parallelism);
* :func:`llama_model_plan`: the sequence-parallel region starts at the embedding's output (scattered over the
  tensor group; the embedding itself runs on whole sequences, outside) and ends at the gathered ``lm_head``;
  the RMSNorms run inside on sequence shards.  The rotary tables cover the whole sequence (the attention's
  column layers gather it), numbered from the token ids, never from the scattered hidden states;
* :func:`llama_layers`: the Llama layer by layer for a pipeline (embedding, decoder blocks each with its own
  rotary tables, head), each rank building only its stages' layers with the serial model's values.

Context parallelism needs nothing declared: ``parallelize`` swaps each ``nn.GroupedQueryAttention`` for its
context-parallel form and gives the model (a pipeline's blocks) each token's global position.
"""
from __future__ import annotations

from typing import Dict, List

from ..models.llama import Llama, LlamaConfig, init_llama_weights
from ..parallel.parallelize import ModelPlan, SequenceRegion
from ..parallel.pipeline import LayerBuilder

__all__ = ["llama_layers", "llama_layout_errors", "llama_model_plan", "llama_plan"]


def llama_plan(config: LlamaConfig, tp: int, sequence_parallel: bool = False) -> Dict[str, str]:
    """The Llama's Megatron plan over a tensor group of ``tp`` ranks ([Note: the Llama recipe]).

    Example:
        >>> plan = llama_plan(cfg, 4, sequence_parallel=True)
        >>> pm = parallelize(Llama(cfg), tensor_parallel=plan, sequence_parallel=True, model_plan=llama_model_plan(cfg))
    """
    layer = "model.layers.*."
    plan = {layer + "self_attn.q_proj": "column", layer + "self_attn.k_proj": "column_kv",
            layer + "self_attn.v_proj": "column_kv", layer + "self_attn.o_proj": "row",
            layer + "mlp.gate_proj": "column", layer + "mlp.up_proj": "column", layer + "mlp.down_proj": "row"}
    if config.vocab_rows % int(tp) == 0 or sequence_parallel:
        # tied: one Parameter of this rank's vocabulary rows (Megatron's tied embedding)
        plan.update({"model.embed_tokens": "vocab", "lm_head": "column_gather"})
    return plan


def llama_model_plan(config: LlamaConfig) -> ModelPlan:
    """What the Llama declares to the composer: its sequence-parallel region, entered at the embedding's output
    and left at the gathered ``lm_head`` ([Note: the Llama recipe])."""
    return ModelPlan(sequence_region=SequenceRegion(enter="model.embed_tokens", leave="lm_head",
                                                    outside=("model.embed_tokens",)))


def llama_layers(config: LlamaConfig, dtype=None) -> LayerBuilder:
    """The Llama layer by layer (:class:`~axonmpi.models.llama.LlamaEmbedding`, ``n_layer``
    :class:`~axonmpi.models.llama.LlamaBlock` s, :class:`~axonmpi.models.llama.LlamaHead`; tied as ``Llama`` ties):
    with a pipeline, ``parallelize`` builds only this rank's stages' layers, with the serial Llama's values.

    Example:
        >>> pm = parallelize(llama_layers(cfg, "float64"), pipeline=PipelinePlan(2, "zb-h1"),
        ...                  model_plan=llama_model_plan(cfg))
    """
    def tie(model):
        model.lm_head.weight = model.model.embed_tokens.weight
    return LayerBuilder(config.n_layer + 2, lambda i: Llama.build_pipeline_layer(config, i, dtype),
                        lambda layer, i: init_llama_weights(layer, config.initializer_range),
                        lambda layers: Llama.from_pipeline_layers(config, layers),
                        tie if config.tie_word_embeddings else None)


def llama_layout_errors(config: LlamaConfig, tp: int, sequence_parallel: bool = False) -> List[str]:
    """The sizes of ``config`` a Megatron tensor group of ``tp`` ranks cannot split, one line each (empty: fits)."""
    c, errs = int(tp), []
    if config.n_head % c:
        errs.append(f"n_head={config.n_head} does not divide by G_intra_c={c}")
    kv = config.n_kv_head
    if kv % c and c % kv:
        errs.append(f"n_kv_head={kv} neither divides by G_intra_c={c} (heads split) nor divides it (each head "
                    f"replicated over G_intra_c / n_kv_head ranks, Megatron's rule)")
    if config.intermediate_size % c:
        errs.append(f"intermediate_size={config.intermediate_size} (the SwiGLU width) does not divide by G_intra_c={c}")
    if sequence_parallel and config.vocab_rows % c:
        errs.append(f"vocab_size={config.vocab_rows} does not divide by G_intra_c={c}: sequence parallelism leaves its "
                    f"region at the vocabulary-parallel lm_head; pad it with --make-vocab-size-divisible-by N "
                    f"(N=1 gives {-(-config.vocab_rows // c) * c} rows; LlamaConfig(padded_vocab_size=...))")
    return errs
