"""Bytes each process group moves per step: the planner's volumes, in the byte counter's convention.

[Note: group bytes]  :func:`group_bytes` gives, for a GPT (:class:`TransformerConfig`), a batch and a
layout, the bytes one rank hands the backend per optimizer step in each group -- ``data`` (the replicas
that reduce a gradient: data x context), ``tensor``, ``pipeline``, ``context`` and ``expert`` -- the
busiest pipeline rank's, per group.  It counts what
:func:`axonmpi.distributed.backends.counting.count_traffic` counts: all-reduce, reduce-scatter and
all-to-all the send buffer, all-gather the gathered buffer, point-to-point every buffer sent *and*
received (so ``bench/nd_layouts.py`` sets it beside a measured step).  Scalars (the loss, the clip
norm) are left out.  ``m`` micro-batches of ``b`` sequences, ``n = b s / cp`` tokens of one
micro-batch on the rank, ``h`` the width, ``f`` the MLP's, ``t`` Megatron's tensor split, ``e`` bytes an
element; ``B`` blocks on the rank (``L / pp``):

* tensor (Megatron, per block and micro-batch): 2 all-reduces of ``n h e`` forward and 2 backward
  (``4 n h e``); with sequence parallelism 2 all-gathers + 2 reduce-scatters each way (``8 n h e``);
  ``recompute="full"`` runs the forward's again (x 1.5).  The ends of the model: a vocab-parallel
  embedding all-reduces (SP: reduce-scatters) its output, ``n h e`` on the first stage; a
  column-parallel head takes its input's gradient by an all-reduce (SP: all-gathers its input forward,
  reduce-scatters back), ``n h e`` (SP ``2 n h e``) and its cross-entropy 3 all-reduces of ``n`` floats,
  on the last.  With ``embeddings="replicated"`` (a plan that splits only the blocks) the ends move
  nothing without SP and ``n h e`` each with it (the gradient of the scatter into the sequence-parallel
  region on the first stage, the gather out of it on the last).  Sequence parallelism also all-reduces
  the gradients of the parameters it leaves whole inside that region (LayerNorms and the row-parallel
  biases: ``6 h e`` per block, once per step).  Without SP a pipeline boundary is Megatron's
  scatter/gather: ``1/t`` of the activation through the pipeline link and an all-gather (``n h e``)
  of it in the tensor group on the receiving side, each way.  AxoNN 3-D:
  :func:`axonmpi.planner.axonn.linear_volumes` per Linear.
* pipeline: each transfer of the schedule (``make_schedule``'s ``SEND``/``RECV`` actions of the busiest
  rank: 1F1B, GPipe, ZB-H1 ``2 (neighbours) m``; interleaved and ZBV more) moves one activation
  ``n h e`` (``/ t`` with Megatron's scatter/gather or SP); a tied embedding's gradient between the
  first and the last stage adds an all-reduce of ``V h e / t``.  ZBV's V puts the first and the last chunk
  (the embeddings and the head) on pipeline rank 0.
* context (per block and micro-batch): ring -- ``(cp - 1)`` K/V blocks (``kv = 2 n h e / t``) sent and as
  many received forward, ``(2 cp - 1)`` backward (the last hop brings ``dK, dV`` home), ``2 (3 cp - 2) kv``;
  Ulysses -- 4 all-to-alls of ``n h e / t`` each way (q, k, v and the output), ``8 n h e / t``;
  ``recompute="full"`` adds the forward's.
* expert (per MoE block and micro-batch): dispatch and combine all-to-alls each way of the ``k n h e``
  routed tokens, of which ``(ep - 1)/ep`` leave the rank (balanced routing): ``4 k n h e (ep-1)/ep``.
* data (gradients of the rank's ``P`` parameters, over ``dp x cp`` replicas): DDP ``P e``; ZeRO-1 ``2 P e``
  (DDP's all-reduce, then the all-gather of the updated chunks); FSDP ``3 P e`` (``zero=3``: all-gather
  forward and backward, reduce-scatter) or ``2 P e`` (``zero=2``: gathered once, kept for the backward) a
  micro-batch without a pipeline, and ``2 P e`` a step with one (a stage is gathered once before its
  first micro-batch and reduce-scatters once after its last: FSDP2's ``reshard_after_forward=False``);
  hybrid shard (``shard < dp``) adds the all-reduce of the shard's gradient over the replicas, ``P e / shard``
  each time it reduce-scatters.  (The AxoNN layouts of :mod:`.estimate` count theirs as HybridGPT moves them:
  ``PlanEstimate.volumes``.)
  Expert parameters are reduced over ``dp / ep``.  ``P`` counts what Megatron splits (``(4h^2 + 2hf +
  3h + f) / t`` a block) and what it keeps whole (LayerNorms, row-parallel biases: ``6 h``).

Example:
    >>> from axonmpi.planner import ParallelLayout, TrainConfig, TransformerConfig
    >>> cfg = TransformerConfig(layers=2, width=8, heads=2, seq=4, vocab=16, tied=False)
    >>> # 2 blocks x 4 n h e, both vocab-parallel ends n h e each, the loss's 3 n floats
    >>> group_bytes(cfg, TrainConfig(4, 2, "fp32"), ParallelLayout(tp=2, dp=2))["tensor"]
    2656.0
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict

from .axonn import linear_volumes
from .estimate import _block, check_layout
from .model import ParallelLayout, TrainConfig, TransformerConfig

__all__ = ["GROUP_NAMES", "group_bytes", "pipeline_transfers"]

GROUP_NAMES = ("data", "tensor", "pipeline", "context", "expert")


@lru_cache(maxsize=256)
def pipeline_transfers(kind: str, p: int, m: int, v: int = 1) -> int:
    """Point-to-point transfers (sends + receives, activations and gradients) of the busiest pipeline rank
    in one step of ``make_schedule(kind, p, m, v)``.

    Example:
        >>> [pipeline_transfers(*a) for a in (("1f1b", 2, 4), ("zbv", 2, 4), ("interleaved", 2, 4, 2))]
        [8, 16, 24]
    """
    if p == 1:
        return 0
    from ..parallel.pipeline.schedules import ActionKind, make_schedule
    s = make_schedule(kind, p, m, v if kind == "interleaved" else None)
    moves = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
    return max(sum(a.kind in moves for a in s.actions(r)) for r in range(p))


def group_bytes(cfg: TransformerConfig, train: TrainConfig, lay: ParallelLayout,
                embeddings: str = "vocab") -> Dict[str, float]:
    """Bytes one rank moves per step in each group of :data:`GROUP_NAMES` (see the module's note).

    ``embeddings``: ``"vocab"`` (Megatron: the word embedding and the head split over the tensor group,
    the position embedding whole) or ``"replicated"`` (a tensor-parallel plan of the blocks only; the
    embeddings, final LayerNorm and head whole on every tensor rank)."""
    if embeddings not in ("vocab", "replicated"):
        raise ValueError(f"embeddings={embeddings!r}; pick 'vocab' or 'replicated'")
    m = check_layout(cfg, train, lay)
    e = float(train.bytes)
    h, s, V = cfg.width, cfg.seq, cfg.vocab
    t, sp, cp, pp, T = lay.tp, bool(lay.sp), lay.cp, lay.pp, lay.tensor
    n = train.micro_batch * s / cp                                  # tokens of one micro-batch on the rank
    act = n * h * e
    blocks = math.ceil(cfg.layers / (pp * lay.chunks)) * lay.chunks
    redo = 1.5 if train.recompute == "full" else 1.0    # a full recomputation repeats the forward's collectives
    moe_frac = cfg.moe_layers / cfg.layers if cfg.experts else 0.0
    vocab_split = embeddings == "vocab"

    out = {g: 0.0 for g in GROUP_NAMES}
    per_stage = []
    last_rank = 0 if lay.pipeline_schedule == "zbv" else pp - 1     # ZBV's V: the last chunk on rank 0
    for stage in range(pp):
        first, last = stage == 0, stage == last_rank
        g = {k: 0.0 for k in GROUP_NAMES}
        # -- tensor ------------------------------------------------------------------------------------
        if t > 1:
            g["tensor"] += m * blocks * (8.0 if sp else 4.0) * act * redo
            ends = (first and (vocab_split or sp)) + (last and (vocab_split or sp)) * (2 if sp and vocab_split else 1)
            g["tensor"] += m * ends * act
            if last and vocab_split:
                g["tensor"] += m * 3 * n * 4.0                     # the vocab-parallel cross-entropy's max, sums
            if sp:                                                 # whole parameters inside the SP region
                g["tensor"] += blocks * 6 * h * e + (2 * h * e if last and vocab_split else 0.0)
            if pp > 1 and not sp:                                  # scatter/gather: an all-gather per receive
                g["tensor"] += pipeline_transfers(lay.pipeline_schedule, pp, m, lay.vp) / 2 * act
        if lay.axonn > 1:
            nrows = n
            for i, o in cfg.linears():
                for vols in linear_volumes(i, o, nrows, lay.row, lay.col, lay.depth).values():
                    g["tensor"] += m * blocks * sum(vols.values()) * e
        # -- pipeline ----------------------------------------------------------------------------------
        if pp > 1:
            g["pipeline"] += pipeline_transfers(lay.pipeline_schedule, pp, m, lay.vp) * act / (t if t > 1 else 1)
            if cfg.tied and (first or last) and last_rank != 0:
                g["pipeline"] += V * h * e / (t if vocab_split else 1)
        # -- context -----------------------------------------------------------------------------------
        if cp > 1:
            if lay.cp_kind == "ring":
                kv = 2.0 * n * h * e / t
                g["context"] += m * blocks * 2 * ((cp - 1) * (redo * 2 - 1) + (2 * cp - 1)) * kv
            else:
                g["context"] += m * blocks * 4 * n * h * e / t * (2 + (1 if train.recompute == "full" else 0))
        # -- expert ------------------------------------------------------------------------------------
        if cfg.experts and lay.ep > 1:
            g["expert"] += m * blocks * moe_frac * 4 * cfg.top_k * n * h * e * (lay.ep - 1) / lay.ep * redo
        # -- data --------------------------------------------------------------------------------------
        dense_block = _block(cfg, lay).local
        moe_block, expert_block = dense_block, 0.0
        if cfg.experts:        # the MLP becomes a router (whole) and E / ep experts (split over t)
            f = cfg.hidden
            mlp = (2 * h * f + f) / t + h if lay.axonn == 1 else cfg.expert_params / T
            moe_block = dense_block - mlp + h * cfg.experts
            expert_block = cfg.experts / lay.ep * cfg.expert_params / (t if lay.axonn == 1 else T)
        split = (t if lay.axonn == 1 else T) if vocab_split else 1
        params = blocks * ((1 - moe_frac) * dense_block + moe_frac * moe_block)
        if first:
            params += V * h / split + s * h
        if last:
            params += 2 * h + (0 if cfg.tied and pp == 1 else V * h / split)
        expert_params = blocks * moe_frac * expert_block
        gdp = lay.dp * cp
        times = m if pp == 1 else 1
        mult = {0: 1.0, 1: 2.0, 2: 2.0 * times, 3: (3.0 if pp == 1 else 2.0) * times}[lay.zero]
        if lay.zero >= 2 and lay.shard_size < lay.dp:
            mult += times / lay.shard_size
        if gdp > 1:
            g["data"] += mult * params * e
        if expert_params and lay.dp // lay.ep > 1:
            g["data"] += mult * expert_params * e
        per_stage.append(g)
    for g in per_stage:
        for k in GROUP_NAMES:
            out[k] = max(out[k], g[k])
    return out
