"""The GPT recipe: the GPT on any layout of the 5-D grid (``HybridGPT``), as a plan for the composer.

[Note: the GPT recipe]  The recipe holds the GPT's plan -- which layers are column / row / vocab / attention
(:func:`gpt_plan`), where the pipeline cuts (the schedule's stages), the batch split (:func:`batch_shards`) --
and hands it to :func:`~axonmpi.parallel.parallelize` (the one composer) for every layout but one it still
builds itself (``docs/hybrid.md``): a pipeline of DDP stages, where each rank builds only its stage's layers
(``build_stage_layers``), which the composer, taking a whole model, does not.  Loss: the global batch's token
mean on every rank (``pm.token_mean``).  Clipping: the placements.  State: ``parallel.state.LayoutState``, so a
checkpoint of any layout loads under any other and into the plain GPT.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import numpy as np

from ..distributed.grid import Layout, ProcessGrid
from ..distributed.world import get_grid
from ..models.gpt import GPT, GPTConfig, init_gpt_weights
from ..nn import Checkpointed
from ..nn import functional as F
from ..optim.clip import clip_grad_norm_
from ..parallel.auto_parallelize import auto_parallelize
from ..parallel.ddp import DistributedDataParallel
from ..parallel.fsdp import ShardingStrategy
from ..parallel.pipeline import Pipeline, make_schedule, split_module
from ..parallel.pipeline.staged import build_stage_layers
from ..parallel.state import LayoutState
from ..parallel.tensor import TensorParallelGroups, parallelize_gpt
from .gpt_layout import TPStyle, _schedule, _style, batch_shards, check_layout

__all__ = ["HybridGPT", "Layout", "TPStyle", "batch_shards", "check_layout", "gpt_plan"]


class HybridGPT(LayoutState):
    """The GPT on this rank under any layout of the grid, with one ``forward_backward``/``clip`` for all;
    its state (``full_state_dict``, ``checkpoint_state``, ``checkpoint_template``, ...) is the
    :class:`~axonmpi.parallel.state.LayoutState` of its layers.

    Args:
        config: the model (a tied head, GPT-2's, under any layout without a pipeline: the composer keeps it
            one Parameter, whole under AxoNN; with a pipeline ``NotImplementedError``).
        grid: the process grid (default: ``axonmpi.get_grid()``).
        tp_style: ``"megatron"`` or ``"axonn"`` (ignored when the tensor dimensions are all 1).
        schedule: pipeline schedule ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (2 virtual stages), ``"zb-h1"`` or
            ``"zbv"`` (zero bubble; ZBV: 2 chunks per rank in a V).
        num_microbatches: micro-batches per step.  activation_checkpointing: recompute each pipeline
            chunk's (no pipeline: each block's) activations in backward.  dtype: parameter dtype.
            global_batch: sequences per step.
        fsdp: ``None``/``"none"`` or a ``ShardingStrategy`` (or its name): FSDP over data (x context) instead
            of DDP; with a pipeline each stage's flat shard.
        cpu_offload, mixed_precision, hybrid_shard_size: FSDP's options (with ``fsdp``).
        cp_algo: ``"ring"`` or ``"ulysses"`` on a grid with ``G_context > 1`` (with data, tensor, FSDP, MoE;
            not with a pipeline: the composer's refusal).
        sequence_parallel: Megatron's sequence parallelism (``tp_style="megatron"``, an untied head): entered
            after the embeddings, left at the gathered ``lm_head``; with pipelines, context, MoE and FSDP.
        expert_parallel: EP of a MoE GPT's experts (``config.moe_experts``; divides ``G_data``); with tensor,
            context, FSDP with a pipeline; in a pipeline with the router losses' coefficients 0.

    Example:
        >>> hyb = HybridGPT(cfg, axonmpi.init(G_data=2, G_inter=2).grid, global_batch=8, num_microbatches=2)
        >>> opt = AdamW(hyb.parameters()); opt.zero_grad()
        >>> loss = hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y)); hyb.clip_grad_norm_(1.0); opt.step()
    """

    def __init__(self, config: GPTConfig, grid: Optional[ProcessGrid] = None, *, tp_style="axonn",
                 schedule="1f1b", num_microbatches: int = 1, activation_checkpointing: bool = False,
                 dtype="float32", global_batch: int, fsdp=None, cpu_offload=None, mixed_precision=None,
                 hybrid_shard_size: Optional[int] = None, cp_algo="ring", sequence_parallel: bool = False,
                 expert_parallel: int = 1):
        g = self.grid = get_grid() if grid is None else grid
        self.layout = Layout.from_grid(g)
        self.sharding = None if fsdp is None or fsdp == "none" else ShardingStrategy.coerce(fsdp)
        if self.sharding is None and (cpu_offload not in (None, False, "none") or mixed_precision is not None):
            raise ValueError(f"rank {g.world.rank}: cpu_offload={cpu_offload!r} / mixed_precision="
                             f"{mixed_precision!r} need fsdp (a sharding strategy), got fsdp={fsdp!r}")
        self.config, self.dtype, self.schedule = config, np.dtype(dtype), _schedule(schedule)
        self.style = _style(tp_style) if self.layout.tensor_size > 1 else None
        self.cp_algo, self.sequence_parallel, self._expert_parallel = cp_algo, bool(sequence_parallel), int(expert_parallel)
        _refuse(self, config, fsdp, activation_checkpointing)
        self.num_microbatches, self.global_batch = int(num_microbatches), int(global_batch)
        check_layout(config, self.layout, global_batch=global_batch, num_microbatches=num_microbatches,
                     schedule=schedule, tp_style=tp_style, world_size=g.world.world_size)
        self.shards = batch_shards(self.layout, self.style or "megatron")
        self._v = 2 if self.schedule.name in ("INTERLEAVED_ONE_F_ONE_B", "ZBV") else 1
        # each chunk on the pipeline rank its schedule runs it on (ZBV's V; round-robin for the others)
        self._stage_ranks = make_schedule(self.schedule, g.G_inter, self.num_microbatches, self._v).stage_ranks \
            if g.G_inter > 1 else None
        axonn = self.style is TPStyle.AXONN
        self.groups = TensorParallelGroups.from_grid(g) if axonn else None
        self.shard_index = g.coords.data * g.intra_group.size + g.intra_group.rank if axonn else g.coords.data
        self.pm = None
        if _composed(self, config, activation_checkpointing):     # the layouts the composer lays out
            return self._compose(activation_checkpointing, cpu_offload, mixed_precision, hybrid_shard_size)
        # the recipe's own build: a pipeline of DDP stages, each rank building only its stage's layers
        self.model, self.ddp, self.fsdp = self._build(), None, None
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        chunks = split_module(self.model, g.G_inter, self._v, group=g.inter_group, stage_ranks=self._stage_ranks)
        self.pipe = Pipeline([Checkpointed(c) for c in chunks] if activation_checkpointing else chunks, self.schedule,
                             num_microbatches=self.num_microbatches, loss_fn=F.cross_entropy, group=g.inter_group,
                             virtual_stages=self._v, data_group=None if axonn else g.data_group,
                             token_groups=self.groups.replica if axonn else (), track_memory=False)
        self._params = self.pipe.parameters()
        mine = {id(p) for p in self._params}
        self.param_names = [n for n, p in self.model.named_parameters() if id(p) in mine]
        LayoutState.__init__(self, self.model, param_names=self.param_names, shapes=shapes, fsdp=None,
                             tensor_parallel=self.style is not None, grid=g, dtype=self.dtype)

    def _compose(self, activation_checkpointing, cpu_offload, mixed_precision, hybrid_shard_size) -> None:
        """The GPT's plan handed to :func:`~axonmpi.parallel.parallelize` (the one composer): which layers are
        column / row / vocab / attention, where the pipeline cuts (its schedule's stages), the batch split."""
        from ..parallel.parallelize import PipelinePlan, parallelize
        c, g = self.config, self.grid
        tp = "axonn" if self.style is TPStyle.AXONN else gpt_plan(c) if self.style is TPStyle.MEGATRON else None
        opts = {k: v for k, v in (("cpu_offload", cpu_offload), ("mixed_precision", mixed_precision),
                                  ("hybrid_shard_size", hybrid_shard_size)) if v is not None}
        pipe = PipelinePlan(self.num_microbatches, self.schedule, virtual_stages=self._v) if g.G_inter > 1 else None
        self.pm = pm = parallelize(
            GPT(c, dtype=self.dtype), grid=g, tensor_parallel=tp, data_parallel="fsdp" if self.sharding else "ddp",
            sharding_strategy=self.sharding, sequence_parallel=self.sequence_parallel,
            context_parallel=self.cp_algo if g.G_context > 1 else None,
            expert_parallel=self._expert_parallel if c.moe_experts else None, pipeline=pipe,
            activation_checkpointing=(True if pipe is not None else [f"blocks.{i}" for i in range(c.n_layer)])
            if activation_checkpointing else None, **opts)
        self.model, self._params = pm.inner, list(pm.parameters())
        # DDP: the model whole on every rank of its data (x context) group (train_gpt samples from it)
        self.ddp = pm.module if isinstance(pm.module, DistributedDataParallel) and tp is None else None
        self.fsdp = pm.module if self.sharding is not None and pipe is None else None
        self.pipe = pm.pipeline if pipe is not None else None
        mine = {id(p) for p in (pm.pipeline.parameters() if pipe is not None else self.model.parameters())}
        self.param_names = [n for n, p in self.model.named_parameters() if id(p) in mine or self.fsdp is not None]
        if self.fsdp is not None:      # FSDP freed them: the TP-local shapes from its flat layouts
            shapes = {n: s for f in self.fsdp.parameters() for n, s in zip(self.fsdp.param_names(f), f.layout.shapes)}
        else:
            shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        LayoutState.__init__(self, self.model, param_names=self.param_names, shapes=shapes, fsdp=self.fsdp,
                             tensor_parallel=tp is not None or self._expert_parallel > 1, grid=g, dtype=self.dtype,
                             flats=pm._flats() if self.pipe is not None else ())

    def _build(self):
        """This rank's pipeline GPT: only its stage's layers, TP layers in place (the others: stand-ins)."""
        c, g = self.config, self.grid
        axonn, megatron = self.style is TPStyle.AXONN, self.style is TPStyle.MEGATRON

        def construct(i):
            with auto_parallelize(groups=self.groups) if axonn else contextlib.nullcontext():
                return GPT.build_pipeline_layer(c, i, self.dtype)

        def tp_form(layer, i=None):
            return parallelize_gpt(layer, group=g.intra_group) if megatron else layer

        layers = build_stage_layers(construct, lambda layer, i: init_gpt_weights(layer, c.n_layer), tp_form,
                                    c.n_layer + 2, g.G_inter, self._v, g.inter_group.rank, stage_ranks=self._stage_ranks)
        return GPT.from_pipeline_layers(c, layers)

    # -- training -----------------------------------------------------------------------------------
    def parameters(self) -> List[Any]:
        """The parameters this rank trains (its stage's; its shards of tensor-parallel ones)."""
        return list(self._params)

    def local_batch(self, batch):
        """This rank's rows of a global batch (the slice ``shard_index`` of ``shards`` equal slices)."""
        n = len(batch)
        if n % self.shards:
            raise ValueError(f"rank {self.grid.world.rank}: a batch of {n} rows does not divide into "
                             f"{self.shards} equal slices")
        b = n // self.shards
        return batch[self.shard_index * b:(self.shard_index + 1) * b]

    def _token_mean(self, x, y):
        """The one loss rule (``pm.token_mean``): this rank's loss sum over its counted targets (its tokens of
        each sequence under context parallelism) -> the global batch's token mean."""
        logits, _ = self.pm(x)
        cp = getattr(self.model, "context_parallel", None)
        if cp is not None and cp.active:
            y = y[:, cp.positions(y.shape[1])]
        return self.pm.token_mean(F.cross_entropy(logits, y, ignore_index=-100, reduction="sum"), int((y != -100).sum()))

    def forward_backward(self, x, y, *, scaler=None) -> float:
        """Forward and backward on this rank's rows (:meth:`local_batch`); gradients reduced as the layout
        needs; ``scaler`` (an :class:`axonmpi.amp.GradScaler`; not with a pipeline) scales the loss.
        Returns the mean loss over the global batch's counted targets (the serial model's, the same on
        every rank and every layout, ignored targets anywhere)."""
        if self.pipe is None:
            loss = self._token_mean(x, y)
            aux = self.model.moe_auxiliary_loss() if self.config.moe_experts else None
            total = loss if aux is None else loss + aux      # the returned value stays the LM loss
            (total if scaler is None else scaler.scale(total)).backward()
            return float(loss.item())
        if scaler is not None:
            raise NotImplementedError(f"rank {self.grid.world.rank}: loss scaling scales one loss per step; a "
                                      f"pipeline's runtime runs one per micro-batch: not {self.layout}")
        if self.pm is not None:
            return self.pm.step(x, y)      # the composer's pipeline: its stages reduced by its runtime
        value = self.pipe.step(x, y)       # the token mean over its micro-batches and token groups
        if self.style is TPStyle.AXONN:
            from ..parallel.intra_layer import sync_gradients
            sync_gradients(self._params, mean=True, groups=self.groups)
        return value

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global model's gradients to ``max_norm`` (their placements count each element once);
        return the global norm before clipping."""
        return float(clip_grad_norm_(self._params, max_norm))

    def eval_loss(self, x, y) -> float:
        """Mean loss over the global batch without gradients (``x``, ``y``: this rank's rows)."""
        from ..autograd import no_grad
        if self.pipe is not None:
            return (self.pm or self.pipe).eval_step(x, y)
        with no_grad():
            return float(self._token_mean(x, y).item())

    def dropout_seed(self, seed: int) -> int:
        """The seed of this rank's random stream: ``seed * 1000 + shard_index``, so ranks holding the same
        rows (Megatron's tensor ranks) draw the same masks and data replicas distinct ones."""
        return int(seed) * 1000 + self.shard_index

    def layout_record(self) -> Dict[str, Any]:
        """The five sizes, the TP style, the schedule and the micro-batches (stored in checkpoints)."""
        return {**self.layout.as_dict(), "tp_style": self.style.value if self.style else "none",
                "schedule": ("fsdp" if self.fsdp is not None else "ddp" if self.ddp is not None
                             else self.schedule.name.lower()), "fsdp": self.sharding.value if self.sharding else "none",
                "microbatches": self.num_microbatches}

    def describe(self) -> str:
        """One line: the layout, the TP style, the schedule and what this rank holds."""
        if self.fsdp is not None:
            rep = self.fsdp.replicate_group.size if self.fsdp.replicate_group is not None else 1
            how = f"FSDP {self.sharding.name} (shards over {self.fsdp.shard_group.size} ranks x {rep} replicas)"
        else:
            how = "DDP" if self.ddp is not None else f"pipeline {self.schedule.name.lower()} m={self.num_microbatches}" \
                if self.pipe is not None else "parallelize"
            how += f" + FSDP {self.sharding.name} stage shards" if self.sharding is not None else ""
        style = self.style.value if self.style else "none"
        return (f"{self.layout} | tp-style {style} | {how} | batch in {self.shards} "
                f"row slices | rank {self.grid.world.rank} holds {len(self.param_names)} parameter tensors")


def gpt_plan(config: GPTConfig) -> Dict[str, str]:
    """The GPT's Megatron plan: heads split, MLP column then row, vocabulary-parallel ``wte`` and a gathered
    ``lm_head`` (both replicated when tied: one Parameter keeps both uses)."""
    plan = {"blocks.*.attn": "attention", "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"}
    return plan if config.tie_word_embeddings else {**plan, "wte": "vocab", "lm_head": "column_gather"}


def _composed(h: "HybridGPT", config: GPTConfig, activation_checkpointing: bool) -> bool:
    """Whether ``parallelize`` builds this layout: all but pipelines of DDP stages (no MoE, context or sequence
    parallelism), where each rank builds only its stage's layers."""
    lay = h.layout
    return bool(lay.G_inter == 1 or lay.G_context > 1 or h.sharding is not None or config.moe_experts
                or h.sequence_parallel)


def _refuse(h: "HybridGPT", config: GPTConfig, fsdp, activation_checkpointing: bool) -> None:
    """``NotImplementedError`` for what neither the recipe nor the composer builds, naming why and what to use."""
    lay, r = h.layout, h.grid.world.rank
    if h.sequence_parallel and (h.style is not TPStyle.MEGATRON or config.tie_word_embeddings):
        raise NotImplementedError(
            f"rank {r}: sequence_parallel needs tp_style='megatron' (G_intra_c > 1) and an untied head (the GPT leaves "
            f"the sequence-parallel region at a gathered, vocabulary-parallel lm_head); got {lay} "
            f"tp_style={h.style and h.style.value!r}, tie_word_embeddings={config.tie_word_embeddings}")
    if config.tie_word_embeddings and lay.G_inter > 1:
        raise NotImplementedError(
            f"rank {r}: tie_word_embeddings=True across pipeline stages (wte on the first, lm_head on the last) is "
            f"not built: the two stages would train two copies of one weight apart (no tied-weight all-reduce "
            f"between stages); use an untied GPTConfig or a layout without a pipeline")
    if config.moe_experts and (lay.G_inter > 1 or h.sequence_parallel) and (config.moe_aux_loss_coeff
                                                                            or config.moe_z_loss_coeff):
        why = ("in a pipeline each stage's router losses do not reach the last stage's loss" if lay.G_inter > 1 else
               "under sequence parallelism each tensor rank routes its sequence shard, so the router losses' "
               "statistics are the shard's, not the global batch's")
        raise NotImplementedError(
            f"rank {r}: a MoE GPT with router losses (moe_aux_loss_coeff={config.moe_aux_loss_coeff}, moe_z_loss_coeff="
            f"{config.moe_z_loss_coeff}) on {lay}: {why}; set both to 0 (--moe-aux-loss-coeff 0 --moe-z-loss-coeff 0)")
    if h._expert_parallel > 1 and not config.moe_experts:
        raise ValueError(f"rank {r}: expert_parallel={h._expert_parallel} needs a MoE GPT (config.moe_experts > 0)")
