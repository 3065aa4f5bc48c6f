"""Step 6, the last transform: the pipeline.  It cuts the model that went through steps 1-3 into the schedule's
stages, each chunk on the pipeline rank the schedule runs it on (``schedule.stage_ranks``: ZBV's V, never a
permuted model), and gives each stage the same unit transforms a model without a pipeline gets: the sequence
region at its ends, activation checkpointing, and the data-parallel axis (its FSDP flat shard, or the
Pipeline's reduction over its data group); the model's finalize step then sums tied copies, partial gradients
and FSDP segments ([Note: the finalize step]).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Tuple

from ...nn.module import Module
from . import checkpointing, context as context_axis
from .record import Composition

__all__ = ["apply", "build_stages"]


def build_stages(builder, grid, plan):
    """A :class:`~axonmpi.parallel.pipeline.LayerBuilder` -> the model as this rank holds it (its stages' layers
    only) and the plan with the cut it was built for; no pipeline: the whole model."""
    from ..plan import PipelinePlan
    from ..pipeline import make_schedule
    if grid.G_inter == 1 or not isinstance(plan, PipelinePlan):
        return builder.build(), plan
    sched = make_schedule(plan.schedule, grid.G_inter, plan.num_microbatches, plan.virtual_stages)
    model, starts = builder.build_stage(grid.G_inter, sched.virtual_stages, grid.inter_group.rank,
                                        stage_ranks=sched.stage_ranks, by=plan.split_by, boundaries=plan.boundaries)
    return model, replace(plan, boundaries=tuple(starts[1:]))


def apply(module: Module, c: Composition):
    """Cut, stage, and run: returns the :class:`~axonmpi.parallel.module.PipelinedModule`."""
    from ...nn import functional as F
    from ..finalize import UnusedCheck, pipeline_entries
    from ..grad_sync import data_reduction_group
    from ..module import PipelinedModule
    from ..pipeline import Pipeline, make_schedule, split_module
    grid, plan = c.grid, c.pipeline
    sched = make_schedule(plan.schedule, grid.G_inter, plan.num_microbatches, plan.virtual_stages)
    chunks = split_module(module, grid.G_inter, sched.virtual_stages, by=plan.split_by, boundaries=plan.boundaries,
                          group=grid.inter_group, stage_ranks=sched.stage_ranks, tied=True)
    tied, shared = _tied_weights(module, grid, sched, plan)
    aux = plan.aux_loss if plan.aux_loss is not None else c.model_plan.aux_loss
    if aux is not None and c.checkpointing is True:
        raise NotImplementedError(
            f"rank {c.rank}: auxiliary (router) losses with activation_checkpointing=True in a pipeline are not "
            "built: a recomputed chunk's forward keeps no graph, so its router losses could not join the backward; "
            "checkpoint the blocks without MoE layers (patterns), or set the router losses' coefficients to 0")
    stages, replicate = _stages(chunks, c, shared)
    # a Megatron tensor group holds the same boundary activations: each rank sends 1/t ([Note: scatter / gather
    # between stages]); AxoNN's tensor block reads other rows, so its ranks send their own whole
    pipe = Pipeline(stages, sched, loss_fn=plan.loss_fn or F.cross_entropy, group=grid.inter_group,
                    data_group=data_reduction_group(grid), track_memory=False, ignore_index=plan.ignore_index,
                    scatter_group=None if c.axonn or not _boundaries_whole(chunks, grid) else grid.intra_group,
                    aux_loss=None if aux is None else lambda st: aux(st.body))
    pipe.overlap_buckets = c.checkpointing in (None, False)    # a recomputation's hook may fire before the end
    pm = PipelinedModule(module, c, pipe, stages)
    flats = pm._flats()
    mine = {id(q) for st in stages for q in st.body.parameters()}
    for q in module.parameters():     # another stage's: an optimizer that partitions its parameters (ZeRO-1) refuses
        if id(q) not in mine:         # it at its first step (a plain one skips it: it never gets a gradient here)
            q.__dict__["_other_stage"] = (
                f"rank {c.rank}: this parameter (serial shape {tuple(q.shape)}) is on another pipeline stage; an "
                "optimizer that partitions its parameters over the data group must hold this rank's stages' only: "
                "build the optimizer from pm.parameters() after parallelize (param groups: from "
                "pm.named_parameters())")
    pm.grad_reducer.before_run(UnusedCheck([(n, q) for n, q in module.named_parameters() if id(q) in mine], grid))
    if flats or tied:
        pm.grad_reducer.before_run(lambda: _before_entries(flats, tied, replicate, pm._mixed_precision))
    pipeline_entries(pm.grad_reducer, pm.parameters(), flats, c)
    return pm


def _stages(chunks: List[Module], c: Composition, shared) -> Tuple[List[Any], Any]:
    """Each chunk through the unit transforms: the position numbering of its layers (context / sequence parallel),
    checkpointing, the data axis (FSDP's flat shard over data x context, or hybrid shard's groups)."""
    from ..grad_sync import data_reduction_group
    from ..module import Stage
    from .data import stage_shard
    shard, replicate, dgroup = None, None, data_reduction_group(c.grid)
    if c.data == "fsdp":
        shard, replicate = _fsdp_groups(c, dgroup)
    stages = []
    for chunk in chunks:
        # the first stage's first layer numbers the model's input; any other layer taking positions= (a Llama
        # block's rotary tables) the sequence its attention sees ([Note: positions] in axes/context.py)
        context_axis.number_layer_positions(list(chunk), c, first_is_input=getattr(chunk, "stage_index", None) == 0)
        flat, experts, whole = (stage_shard(chunk, shard, shared, data=dgroup) if shard is not None
                                else (None, [], []))
        st = Stage(chunk, c, flat=flat, extra=experts + whole)
        if c.checkpointing is True:
            checkpointing.apply(st, True, c.rank, whole=True)
        stages.append(st)
    return stages, replicate


def _fsdp_groups(c: Composition, dgroup):
    """``(shard group, replicate group or None)`` of FSDP's strategy over data x context.  Hybrid shard's groups
    hold the dense parameters only: an expert split over its expert group (which may span several shard groups)
    stays whole, reduced over its own expert-data group ([Note: FSDP in a pipeline])."""
    from ..fsdp import ShardingStrategy
    from ..fsdp.runtime import resolve_groups
    strategy = ShardingStrategy.coerce(c.sharding_strategy or "full_shard")
    if strategy is not ShardingStrategy.HYBRID_SHARD:
        return dgroup, None
    return resolve_groups(dgroup, strategy, c.strategy_options.get("hybrid_shard_size"))


def _before_entries(flats, tied, replicate, mp) -> None:
    """Before the entries: every tied copy has a gradient (every rank of its group takes part), and each
    stage's flat shard is reduce-scattered (the mean over data x context; hybrid shard: and its replicas)."""
    from ...autograd.tensor import Tensor
    from ...distributed import ReduceOp, all_reduce
    for p in tied:
        if p.grad is None:
            p.grad = Tensor(p.data * 0)
    for f in flats:
        f.reduce_grad(reduce_dtype=None if mp is None else (mp.reduce_dtype or mp.param_dtype))
        if replicate is not None and replicate.size > 1:
            all_reduce(f.grad.data, ReduceOp.MEAN, replicate, out=f.grad.data)


def _boundaries_whole(chunks, grid) -> bool:
    """Whether every stage boundary carries an activation each Megatron tensor rank holds whole, so that each
    may send ``1/t`` of it ([Note: scatter / gather between stages]): no cut between a column-parallel layer
    (its output split over the tensor group) and the row-parallel layer that reads it.  Each rank tells its
    chunks' effect (opens / closes such a region, or neither); every rank decides on the same list."""
    from ...distributed.object_collectives import all_gather_object
    from ..tensor.layers import ColumnParallelLinear, RowParallelLinear
    mine = []
    for ch in chunks:
        last = None
        for m in ch.modules():
            if isinstance(m, ColumnParallelLinear):
                last = "closes" if m.gather_output else "opens"
            elif isinstance(m, RowParallelLinear):
                last = "closes"
        mine.append((ch.stage_index, last))
    effects = dict(e for got in all_gather_object(mine, group=grid.inter_group) for e in got)
    split = False
    for s in sorted(effects)[:-1]:
        split = {"opens": True, "closes": False}.get(effects[s], split)
        if split:
            return False
    return True


def _tied_weights(module: Module, grid, sched, plan):
    """[Note: a weight tied across stages]  A parameter used by chunks on two pipeline ranks (a head tied to its
    embedding) is held by both, as Megatron holds the word embeddings on the first and last stage: its placement
    records the ranks holding it (their "embedding group", made here over the pipeline group) as ``tied``, and
    the finalize step sums its gradient there, so both copies see the serial gradient and stay equal under the
    same optimizer.  The copies on the later stages are not ``counted`` (clipping counts the weight once); state
    dicts name it under its serial names.  Under FSDP such a weight stays whole, out of the stages' flat shards.
    Returns this rank's tied parameters and the ids of those used by two chunks."""
    from ...distributed.placement import add_placement
    from ..pipeline import split_module
    p = grid.G_inter
    holders: Dict[int, Tuple[Any, Dict[int, int]]] = {}       # id -> (param, {pipeline rank: first stage})
    uses: Dict[int, int] = {}
    for q in range(p):
        for ch in split_module(module, p, sched.virtual_stages, by=plan.split_by, boundaries=plan.boundaries,
                               rank=q, stage_ranks=sched.stage_ranks, tied=True):
            for prm in ch.parameters():
                ranks = holders.setdefault(id(prm), (prm, {}))[1]
                ranks[q] = min(ranks.get(q, ch.stage_index), ch.stage_index)
                uses[id(prm)] = uses.get(id(prm), 0) + 1
    out = []
    me = grid.inter_group.rank
    for prm, ranks in holders.values():
        if len(ranks) < 2:
            continue
        order = sorted(ranks, key=ranks.get)           # the earliest stage's rank first
        g = grid.world.new_group([grid.inter_group.ranks[q] for q in order], parent=grid.inter_group,
                                 name="embedding")
        if me in ranks:
            add_placement(prm, tied=g, counted=me == order[0])
            out.append(prm)
    return out, frozenset(k for k, n in uses.items() if n > 1)
