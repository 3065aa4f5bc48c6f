"""``parallelize``: the one composer -- tensor, sequence, context and expert parallel, activation checkpointing,
DDP / FSDP and the pipeline -- on any model built from the library's layers.

[Note: the composer's order]  One call per axis, each a transform in its own module of
:mod:`axonmpi.parallel.axes` that swaps modules and sets placements (torchtitan's ``parallelize_llama`` over one
device mesh, with our grid in place of the mesh):

  1. ``tensor``: a Megatron plan or AxoNN 3-D, and sequence parallelism;
  2. ``context``: attention swapped; every parameter replicated over the context group;
  3. ``experts``: ``nn.MoE`` experts over the expert group carved from data;
  4. ``checkpointing``: the modules named recompute their forward in backward;
  5. ``data``: DDP / FSDP over each parameter's replica group (data x context), FSDP chunking the TP shards;
  6. ``pipeline`` (last): cuts the model into the schedule's stages and runs the unit transforms of 4 and 5 --
     and the sequence region -- on each stage, the same functions a model without a pipeline goes through.

Every parameter carries its :class:`~axonmpi.distributed.Placement` (cuts, replicas, partial and tied groups,
frozen), so the finalize step (:mod:`axonmpi.parallel.finalize`), clipping, state dicts and checkpoints need no
per-model rule.  What only the model knows it declares in a :class:`~axonmpi.parallel.plan.ModelPlan`; this
package imports no model.  See ``docs/parallelize.md``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Dict, Optional, Union

import numpy as np

from ..distributed import get_grid
from ..distributed.grid import ProcessGrid
from ..nn.module import Module
from .axes import checkpointing, context, data, experts, pipeline as pipeline_axis, regions, tensor
from .axes.record import Composition
from .module import ParallelModule, PipelinedModule
from .plan import ModelPlan, PipelinePlan, SequenceRegion
from .state import ShardedState
from .swap import mark_replaced

__all__ = ["ModelPlan", "ParallelModule", "PipelinePlan", "PipelinedModule", "SequenceRegion", "full_state_dict",
           "parallelize"]

_DATA = ("ddp", "fsdp", None)


def parallelize(module: Module, *, grid: Optional[ProcessGrid] = None,
                tensor_parallel: Union[None, str, Dict[str, str]] = None,
                data_parallel: Optional[str] = "ddp", sharding_strategy=None, sequence_parallel: bool = False,
                sequence_dim: int = 1, context_parallel: Optional[str] = None, expert_parallel: Optional[int] = None,
                expert_tensor_parallel: bool = False, activation_checkpointing=None,
                pipeline: Optional[PipelinePlan] = None, model_plan: Optional[ModelPlan] = None,
                **strategy_options) -> ParallelModule:
    """Lay ``module`` out over every axis of the grid: the one composer ([Note: the composer's order]).

    Args:
        module: any ``nn.Module`` built from the library's layers (changed in place; build it the same way on
            every rank).  With ``pipeline`` an ``nn.Sequential`` (or a model with ``pipeline_layers()``) that
            ``split_module`` cuts, or a :class:`~axonmpi.parallel.pipeline.LayerBuilder`: each pipeline rank then
            builds only its stages' layers (the serial model's values; the others hold no memory).
        grid: the :class:`ProcessGrid` (default: the current World's, ``axonmpi.init(...)``).
        tensor_parallel: ``None``; ``"axonn"``: every ``nn.Linear`` becomes a 3-D ``intra_layer.Linear`` over the
            grid's row x column x depth, in easy mode (each rank of the tensor block reads its own rows; a Linear
            whose sizes do not divide over the grid stays replicated, AxoNN's ``auto_parallelize`` rule); or
            ``{"<fnmatch pattern on named_modules()>": "column" | "column_gather" | "row" | "vocab" |
            "attention"}``: Megatron 1-D over the grid's tensor group (every rank of it reads the same rows;
            ``"attention"``: an ``nn.CausalSelfAttention`` with its heads split); modules matching no pattern stay
            replicated.  ``"column_gather"`` all-gathers the layer's output (PyTorch's
            ``ColwiseParallel(output_layouts=Replicate())``); a ``"column"`` layer whose output reaches the
            model's output with no ``"row"`` layer after it raises ``ValueError`` at the first forward, naming it.
        data_parallel: ``"ddp"`` (default), ``"fsdp"``, or ``None`` (no data-parallel reduction).  With a
            pipeline, ``"ddp"`` and ``None`` mean the Pipeline reduces each stage over data x context.
        sharding_strategy: FSDP's :class:`~axonmpi.parallel.ShardingStrategy` (FSDP only).
        sequence_parallel: Megatron's sequence parallelism (with a Megatron plan): ``pm(x)`` keeps this rank's
            ``1/p`` of ``x`` along ``sequence_dim``, the plan's column / row layers all-gather / reduce-scatter
            it, every ``nn.LayerNorm`` becomes a ``SequenceParallelLayerNorm``, every other parameter not split
            over the tensor group has its gradient summed over it, and the output is all-gathered back; with a
            pipeline each stage enters and leaves the region.  A model declares another region in ``model_plan``.
        sequence_dim: the sequence dimension of the model's input and output (default 1).
        context_parallel: ``"ring"`` or ``"ulysses"`` on a grid with ``G_context > 1``: every attention becomes
            a :class:`~axonmpi.parallel.context.ContextParallelAttention`; ``local_batch`` gives this rank's
            tokens of each sequence (a module whose ``forward`` takes ``positions=`` is given their positions),
            and gradients are reduced over data x context (``grid.data_context_group``).
        expert_parallel: EP for the model's ``nn.MoE`` layers: the grid's, fixed at init
            (``axonmpi.init(..., expert_parallel=EP)``).  ``None``: the grid's; another value raises naming the fix.
        expert_tensor_parallel: split the experts' hidden width over the tensor group instead (AxoNN style;
            needs ``tensor_parallel="axonn"``, whose batch split it shares).
        activation_checkpointing: ``None``; ``True`` (every child of the model, or every pipeline chunk as one
            unit); or fnmatch patterns on ``named_modules()``: those modules recompute their forward in backward.
        pipeline: a :class:`PipelinePlan` on a grid with ``G_inter > 1``: returns a :class:`PipelinedModule`.
        model_plan: what the model declares (:class:`ModelPlan`: its sequence region, an auxiliary loss).
        **strategy_options: keyword options of DDP or FSDP (``bucket_size_mb``, ``mixed_precision``, ...).

    Returns:
        A :class:`ParallelModule` ``pm``; ``pm.local_batch(x, y)`` gives this rank's rows (and tokens), and after
        ``loss.backward()`` (``loss`` the mean over those rows, or ``pm.token_mean``) every gradient is that of
        the mean loss over the global batch.  With ``pipeline``: ``pm.step(xb, yb)``.

    Raises:
        ValueError / TypeError: an unknown option, a grid whose sizes do not fit the options.
        NotImplementedError: the refusals listed in ``docs/parallelize.md`` (each with its reason).

    Example:
        >>> axonmpi.init(G_intra_c=2, G_inter=2, G_context=2)              # 16 ranks: 2 data x ...
        >>> pm = parallelize(model, tensor_parallel={"*.attn": "attention", "*.mlp.fc": "column",
        ...                  "*.mlp.proj": "row"}, sequence_parallel=True, context_parallel="ring",
        ...                  pipeline=PipelinePlan(num_microbatches=2, schedule="zb-h1"))
        >>> xb, yb = pm.local_batch(x, y); loss = pm.step(xb, yb)
    """
    from .pipeline.staged import LayerBuilder
    grid = get_grid() if grid is None else grid
    if isinstance(module, LayerBuilder):
        module, pipeline = pipeline_axis.build_stages(module, grid, pipeline)
    c = Composition(grid=grid, tensor=tensor_parallel, sequence_parallel=bool(sequence_parallel),
                    sequence_dim=int(sequence_dim), context=context_parallel, expert_tensor_parallel=expert_tensor_parallel,
                    data=data_parallel, sharding_strategy=sharding_strategy, strategy_options=dict(strategy_options),
                    checkpointing=activation_checkpointing, pipeline=pipeline,
                    model_plan=ModelPlan() if model_plan is None else model_plan)
    _check(module, c, expert_parallel)
    regions.check(module, c)                                  # every module of a region known or declared
    before = list(module.parameters())
    tensor.apply(module, c)                                   # 1
    context.apply(module, c)                                  # 2
    experts.apply(module, c)                                  # 3
    mark_replaced(before, module, "a layer parallelize swapped in")   # an optimizer holding one raises at step
    _record(module)
    if c.checkpointing not in (None, False) and not (c.pipeline is not None and c.checkpointing is True):
        checkpointing.apply(module, c.checkpointing, c.rank)  # 4 (a pipeline's True: each stage, in step 6)
    if c.pipeline is not None:
        return pipeline_axis.apply(module, c)                 # 6: 4 and 5 on each stage
    wrapped, reducer = data.apply(module, c)                  # 5
    context.number_positions(module, c)
    return ParallelModule(module, c, wrapped, reducer)


def _record(module: Module) -> None:
    """Every parameter's placement carries its serial shape (a parameter no transform cut is whole here) and
    whether it is frozen: the sharded state, the checkpoints and the planner read the placement, never the layer."""
    from ..distributed.placement import placement_of
    for p in module.parameters():
        pl = placement_of(p)
        full = pl.full_shape if pl.full_shape is not None else tuple(p.shape)
        p.placement = replace(pl, full_shape=full, frozen=not p.requires_grad)


def _check(module: Module, c: Composition, expert_parallel) -> None:
    """Refuse options that do not fit each other or the grid, naming the value, the rank and the fix; resolve
    the expert-parallel size (the grid's)."""
    g, r = c.grid, c.rank
    if not isinstance(module, Module):
        raise TypeError(f"parallelize needs an axonmpi.nn.Module or a LayerBuilder, got {type(module).__name__}")
    if c.data not in _DATA:
        raise ValueError(f"rank {r}: data_parallel={c.data!r}; expected 'ddp', 'fsdp' or None")
    if not (c.tensor is None or c.axonn or c.megatron):
        raise ValueError(f"rank {r}: tensor_parallel={c.tensor!r}; expected None, 'axonn' or a dict "
                         "{pattern: 'column' | 'column_gather' | 'row' | 'vocab' | 'attention'}")
    if not isinstance(c.model_plan, ModelPlan):
        raise TypeError(f"rank {r}: model_plan={c.model_plan!r}; expected an axonmpi.parallel.ModelPlan")
    if c.sharding_strategy is not None and c.data != "fsdp":
        raise ValueError(f"rank {r}: sharding_strategy={c.sharding_strategy!r} needs data_parallel='fsdp'")
    if c.tensor is None and g.G_intra > 1:
        raise ValueError(f"rank {r}: the grid has a tensor block of {g.G_intra} ranks but tensor_parallel "
                         "is None; pass 'axonn' or a Megatron plan")
    if c.megatron and (g.G_intra_r > 1 or g.G_intra_d > 1):
        raise ValueError(f"rank {r}: a Megatron plan is 1-D over the grid's tensor group; the grid has "
                         f"G_intra_r={g.G_intra_r}, G_intra_d={g.G_intra_d} (use G_intra_c or 'axonn')")
    if c.pipeline is not None:
        _check_pipeline(c)
    elif g.G_inter > 1 and c.data is not None:
        raise ValueError(f"rank {r}: on a pipeline grid (G_inter={g.G_inter}) pass pipeline=PipelinePlan(...), "
                         "or parallelize each stage with data_parallel=None for a Pipeline you build")
    if c.strategy_options and c.data is None:
        raise ValueError(f"rank {r}: options {sorted(c.strategy_options)} need data_parallel='ddp' or 'fsdp'")
    if c.sequence_parallel and not c.megatron:
        raise ValueError(f"rank {r}: sequence_parallel=True needs a Megatron plan (tensor_parallel={{pattern: "
                         f"'column' | 'row'}}), got tensor_parallel={c.tensor!r}")
    cp = getattr(g, "G_context", 1)
    if c.context is not None and cp == 1:
        raise ValueError(f"rank {r}: context_parallel={c.context!r} needs a grid with G_context > 1 "
                         "(axonmpi.init(G_context=N))")
    if cp > 1 and c.context is None:
        raise ValueError(f"rank {r}: the grid has G_context={cp}; pass context_parallel='ring' | 'ulysses'")
    if c.expert_tensor_parallel and not c.axonn:
        raise ValueError(f"rank {r}: expert_tensor_parallel=True splits the batch over the tensor block as "
                         f"AxoNN's easy mode does; pass tensor_parallel='axonn' (got {c.tensor!r})")
    moe = experts.has_moe(module)
    if (expert_parallel or 1) > 1 and not moe:
        raise ValueError(f"rank {r}: expert_parallel={expert_parallel} but the model has no nn.MoE layer")
    c.expert_parallel = g.check_expert_parallel(g.expert_parallel if expert_parallel is None
                                                else expert_parallel) if moe else 1


def _check_pipeline(c: Composition) -> None:
    from .fsdp import ShardingStrategy
    g, r, plan = c.grid, c.rank, c.pipeline
    if not isinstance(plan, PipelinePlan):
        raise TypeError(f"rank {r}: pipeline={plan!r}; expected a PipelinePlan(num_microbatches, schedule)")
    if g.G_inter == 1:
        raise ValueError(f"rank {r}: pipeline={plan} needs a grid with G_inter > 1 (axonmpi.init(G_inter=p))")
    strategy = ShardingStrategy.coerce(c.sharding_strategy) if c.sharding_strategy is not None else None
    if strategy is ShardingStrategy.NO_SHARD:
        raise ValueError(f"rank {r}: sharding_strategy={c.sharding_strategy!r} with pipeline=: no_shard is "
                         "DDP (data_parallel='ddp')")
    allowed = ({"hybrid_shard_size"} if strategy is ShardingStrategy.HYBRID_SHARD else set()) | \
        ({"mixed_precision"} if c.data == "fsdp" else set())
    if set(c.strategy_options) - allowed:
        raise ValueError(f"rank {r}: options {sorted(c.strategy_options)} are DDP's / FSDP's; with pipeline= the "
                         "Pipeline reduces each stage (no options but FSDP's mixed_precision and hybrid_shard's "
                         "hybrid_shard_size)")


def full_state_dict(pm: Module) -> "OrderedDict[str, np.ndarray]":
    """The serial state dict of a parallelized model (collective): serial names, full shapes, every rank.

    Works on a :class:`ParallelModule`, an FSDP model, a model holding tensor-parallel layers, or a plain module.

    Example:
        >>> sd = axonmpi.parallel.full_state_dict(pm)
        >>> serial.load_state_dict(sd)
    """
    from .fsdp import FSDP
    if isinstance(pm, ParallelModule):
        return pm.state_dict()
    if isinstance(pm, FSDP):
        return pm.state_dict()
    return ShardedState(pm).full_state_dict()
