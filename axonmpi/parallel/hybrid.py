"""Hybrid DP x TP x PP training of the GPT on the 5-D grid: the composition rules, implemented once.

[Note: composition rules]  One rank of the grid ``(data, inter, depth, row, col)``:

* **Model.** Every rank builds the GPT from the same seed (so initial values equal the serial
  model's): ``tp_style="megatron"`` swaps attention/MLP/embedding/head for the 1-D layers over
  ``intra_group`` (needs ``G_intra_r == G_intra_d == 1``); ``tp_style="axonn"`` builds it inside
  ``auto_parallelize`` (every Linear split over row x column x depth).  With ``G_inter > 1`` the
  model is cut by :func:`split_module` into ``G_inter * v`` chunks (``v = 2`` for the interleaved
  schedule) and a rank builds only its stage's layers (:class:`_StagedBuild`: the random stream is
  replayed layer by layer, so the values are the serial model's; the other layers are zero-stride
  stand-ins that keep the names and shapes checkpoints need).
* **Rows.** The global batch is cut into equal contiguous slices, one per *batch shard*:
  Megatron and pure data parallel: the ``G_data`` replicas (tensor-parallel ranks of one block
  read the same rows); AxoNN easy mode: every rank of a stage, ``G_data*G_intra_r*G_intra_c*G_intra_d``
  slices (rank index ``data * |intra| + intra rank``).  Pipeline ranks of one replica read the same rows.
* **Gradients.** Megatron / pure DP: each gradient is averaged over ``data_group`` (DDP without a
  pipeline, :class:`Pipeline` ``data_group`` with one); sharded TP weights are never reduced over
  the tensor group, replicated ones (LayerNorm, ``wpe``) get identical gradients there already.
  AxoNN: :func:`intra_layer.sync_gradients` with ``mean=True`` -- 3-D weights (already
  reduce-scattered over depth) all-reduced over data, depth-replicated biases over data and depth,
  every other parameter over the stage's replica ranks (data x intra), all divided by that count.
  Pipeline stages hold disjoint parameters: nothing is reduced over ``inter_group``.
* **Loss.** Computed on the last pipeline stage (the whole model without a pipeline) as the mean
  over the rank's rows (micro-batches weighted by their size), summed over ``inter_group`` (only
  the last stage contributes), then averaged over the batch shards: every rank reports the mean over
  the *whole global batch*, the same number under every layout.
* **Clipping.** :meth:`HybridGPT.clip_grad_norm_` is :func:`axonmpi.optim.clip_grad_norm_` on the
  stage's parameters: their placements (TP shards, the pipeline's stage) give one global norm.
* **Checkpoints.** :meth:`HybridGPT.sharded_state_dict` gives serial PyTorch names; TP shards are
  ``ShardedArray`` blocks of the full arrays, and each pipeline stage contributes only its own
  parameters, so a checkpoint saved under one layout loads under any other.
* **FSDP.** ``fsdp=`` a sharding strategy (pure data parallel, or data parallel x tensor parallel of
  either style with ``G_inter = 1``; :func:`fsdp_refusal` names what is not built): the (TP-local) GPT
  is wrapped in :class:`~axonmpi.parallel.FSDP` over ``data_group`` instead of DDP; the optimizer
  runs on the flat shards.  Pure DP: clipping uses FSDP's norm (each element once), and checkpoints
  hold each parameter flattened under its serial name (1-D blocks); templates reshape between the
  two forms: the other layouts read a flattened entry whole, FSDP reads the whole rows of a
  full-shape entry covering its elements.  With Megatron TP: FSDP's reduce-scatter over data is
  the whole gradient reduction (replicated parameters get identical gradients on the TP ranks);
  with AxoNN TP the rest of ``sync_gradients`` follows on the flat shards' segments (depth biases
  over depth, replicated parameters over ``intra_group``, all / tensor size) and the loss is
  averaged over data x intra; clipping sums the squares of the flat shards' segments over the
  shard group, each TP-sharded part also over its sharding group (replicated ones once); checkpoints keep the TP form (each
  TP-local array gathered over data, written as its TP block), and loading keeps the elements of
  this rank's FSDP chunk of its TP shard.
* **Dropout.** :meth:`HybridGPT.dropout_seed`: one random stream per row slice, so Megatron's
  tensor-parallel ranks draw identical masks and data-parallel replicas distinct ones.
"""
from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from .. import nn
from ..distributed import ReduceOp, all_gather_object, all_reduce
from ..distributed.grid import ProcessGrid
from ..distributed.world import get_grid
from ..models.gpt import GPT, GPTConfig
from ..nn import functional as F
from ..optim.clip import clip_grad_norm_
from ..enums import coerce_enum

__all__ = ["HybridGPT", "Layout", "TPStyle", "check_layout", "fsdp_refusal"]


class TPStyle(enum.Enum):
    """How the tensor dimensions of the grid split the GPT."""
    MEGATRON = "megatron"   # 1-D: heads / MLP columns / vocabulary over intra_group (G_intra_c only)
    AXONN = "axonn"         # 3-D: every Linear over row x column x depth (auto_parallelize)


@dataclass(frozen=True)
class Layout:
    """AxoNN's five sizes of a run.

    Example:
        >>> Layout(G_data=2, G_inter=2).world_size
        4
    """
    G_data: int = 1
    G_inter: int = 1
    G_intra_r: int = 1
    G_intra_c: int = 1
    G_intra_d: int = 1
    G_context: int = 1

    @classmethod
    def from_grid(cls, grid: ProcessGrid) -> "Layout":
        """The sizes of ``grid``."""
        return cls(grid.G_data, grid.G_inter, grid.G_intra_r, grid.G_intra_c, grid.G_intra_d,
                   getattr(grid, "G_context", 1))

    @property
    def world_size(self) -> int:
        """The product of the sizes."""
        return self.G_data * self.G_inter * self.tensor_size * self.G_context

    @property
    def tensor_size(self) -> int:
        """``G_intra_r * G_intra_c * G_intra_d``."""
        return self.G_intra_r * self.G_intra_c * self.G_intra_d

    def as_dict(self) -> Dict[str, int]:
        """``{"G_data": .., "G_inter": .., "G_intra_r": .., "G_intra_c": .., "G_intra_d": ..}``."""
        out = {"G_data": self.G_data, "G_inter": self.G_inter, "G_intra_r": self.G_intra_r,
               "G_intra_c": self.G_intra_c, "G_intra_d": self.G_intra_d}
        if self.G_context != 1:
            out["G_context"] = self.G_context
        return out

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())


def _style(tp_style) -> TPStyle:
    return coerce_enum(TPStyle, tp_style, "tp_style")


def _schedule(schedule):
    from .pipeline import PipelineSchedule
    return coerce_enum(PipelineSchedule, schedule, "schedule")


def batch_shards(layout: Layout, tp_style="axonn") -> int:
    """Into how many equal row slices the global batch is cut (see the module's note).

    Example:
        >>> batch_shards(Layout(G_data=2, G_intra_c=2), "megatron"), batch_shards(Layout(G_data=2, G_intra_c=2))
        (2, 4)
    """
    if layout.tensor_size > 1 and _style(tp_style) is TPStyle.AXONN:
        return layout.G_data * layout.tensor_size
    return layout.G_data


def check_layout(config: GPTConfig, layout: Layout, *, global_batch: int, num_microbatches: int = 1,
                 schedule="1f1b", tp_style="axonn", world_size: Optional[int] = None) -> None:
    """Refuse a layout the GPT cannot run on, before any work, naming every size that does not fit.

    Args:
        config: the model.
        layout: the five sizes.
        global_batch: sequences per optimizer step over all ranks.
        num_microbatches: pipeline micro-batches per step.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        tp_style: ``"megatron"`` or ``"axonn"``.
        world_size: the number of ranks (checked against the product when given).

    Raises:
        ValueError: listing every problem, e.g. ``n_head=4 does not divide by G_intra_c=3``.

    Example:
        >>> check_layout(GPTConfig(vocab_size=16, n_layer=1), Layout(G_inter=4), global_batch=8)
        Traceback (most recent call last):
        ValueError: ...the GPT has 3 pipeline layers (embedding, 1 blocks, head) but G_inter=4 ...
    """
    style, sched = _style(tp_style), _schedule(schedule)
    errs: List[str] = []
    if world_size is not None and layout.world_size != world_size:
        errs.append(f"G_data*G_context*G_inter*G_intra_r*G_intra_c*G_intra_d = {layout.world_size} but there are "
                    f"{world_size} ranks")
    for k, v in layout.as_dict().items():
        if v < 1:
            errs.append(f"{k}={v} must be >= 1")
    if errs:
        raise ValueError(f"impossible layout {layout}: " + "; ".join(errs))
    tp = layout.tensor_size
    if tp > 1 and style is TPStyle.MEGATRON:
        if layout.G_intra_r > 1 or layout.G_intra_d > 1:
            errs.append(f"--tp-style megatron splits over one dimension (G_intra_c); got G_intra_r={layout.G_intra_r}, "
                        f"G_intra_d={layout.G_intra_d} (use --tp-style axonn)")
        c = layout.G_intra_c
        for what, n in (("n_head", config.n_head), ("4*n_embd (MLP width)", 4 * config.n_embd),
                        ("vocab_size", config.vocab_size)):
            if n % c:
                errs.append(f"{what}={n} does not divide by G_intra_c={c}")
    n_layers = config.n_layer + 2
    v = 2 if sched.name == "INTERLEAVED_ONE_F_ONE_B" else 1
    if layout.G_inter * v > n_layers:
        errs.append(f"the GPT has {n_layers} pipeline layers (embedding, {config.n_layer} blocks, head) but "
                    f"G_inter={layout.G_inter}" + (f" x {v} virtual stages" if v > 1 else "")
                    + " needs at least one each")
    if num_microbatches < 1:
        errs.append(f"num_microbatches={num_microbatches} must be >= 1")
    elif v > 1 and num_microbatches % layout.G_inter:
        errs.append(f"the interleaved schedule needs num_microbatches={num_microbatches} to be a multiple of "
                    f"G_inter={layout.G_inter}")
    shards = batch_shards(layout, style)
    if global_batch % shards:
        errs.append(f"global batch {global_batch} does not divide into {shards} equal row slices "
                    f"({'G_data*G_intra_r*G_intra_c*G_intra_d' if shards != layout.G_data else 'G_data'} = {shards})")
    elif global_batch // shards < num_microbatches:
        errs.append(f"{global_batch // shards} rows per rank cannot make num_microbatches={num_microbatches}")
    if errs:
        raise ValueError(f"impossible layout {layout} (tp_style={style.value}, schedule={schedule}): "
                         + "; ".join(errs))


def fsdp_refusal(layout: Layout, tp_style="axonn", activation_checkpointing: bool = False) -> Optional[str]:
    """Why FSDP over the data dimension cannot run on ``layout`` (``None`` when it can).

    Built: pure data parallel, and data parallel x tensor parallel (Megatron or AxoNN, ``G_inter = 1``).
    Not built: pipelines (``G_inter > 1``), activation checkpointing.

    Example:
        >>> fsdp_refusal(Layout(G_data=2, G_intra_c=2), "megatron") is None
        True
    """
    if layout.G_inter == 1 and not activation_checkpointing:
        return None
    what = "pipeline parallelism" if layout.G_inter > 1 else "activation checkpointing"
    tp = layout.tensor_size > 1
    return (f"is built for pure data parallel and for data parallel x tensor parallel (G_inter = 1, no "
            f"activation checkpointing); got {layout}" + (f" tp-style {_style(tp_style).value}" if tp else "")
            + (" with activation checkpointing" if activation_checkpointing else "")
            + f": FSDP combined with {what} is not built")


class _StagedBuild:
    """The GPT of one pipeline rank with only its stage's layers built (a pipeline layer is the embedding,
    a block or the head, as :func:`split_module` cuts the GPT); every other layer is a stand-in of the
    same modules whose parameters are zero-stride views (their shapes and dtypes, one element of memory).

    [Note: staged build, same init as the serial GPT]  The serial GPT draws from one random stream:
    first each layer's constructor (PyTorch's default init), in order, then ``GPT._init_weights``
    over all modules (GPT-2's N(0, 0.02)).  The stream cannot be skipped ahead (normal draws reject a
    variable number of bits), so the draws are replayed, one layer at a time, never holding more than
    one foreign layer: (A) with the stream saved and restored, each layer is built in its tensor-parallel
    form, turned into its stand-in and kept: their sizes give the split points (as ``split_module``
    balances them) and so this rank's layers; (B) each layer is constructed in order, foreign ones
    dropped at once; (C) ``GPT._init_weights``'s pass, layer by layer: this rank's layers in place,
    a foreign one on a temporary copy (constructed with the stream saved and restored), dropped after.
    Megatron then swaps this rank's layers for their tensor-parallel form (as ``parallelize_gpt``).
    So the stage's parameters equal the serial model's; the parity tests check it.
    """

    def __init__(self, hyb: "HybridGPT", config: GPTConfig, dtype):
        from ..random import get_rng_state, set_rng_state
        from .pipeline.split import split_points
        self.hyb, self.config, self.dtype = hyb, config, dtype
        n = config.n_layer + 2
        start = get_rng_state()
        stand_ins = [self._stand_in(self._tp_form(self._construct(i), i)) for i in range(n)]      # (A)
        set_rng_state(start)
        g = hyb.grid
        k = g.G_inter * hyb._v
        starts = split_points(nn.Sequential(*stand_ins), g.G_inter, hyb._v) + [n]
        mine = {i for c in range(g.inter_group.rank, k, g.G_inter) for i in range(starts[c], starts[c + 1])}
        layers = []
        for i in range(n):                                                                      # (B)
            layer = self._construct(i)
            layers.append(layer if i in mine else None)
            del layer
        for i in range(n):                                                                      # (C)
            if i in mine:
                self._init(layers[i], i)
            else:
                state = get_rng_state()
                tmp = self._construct(i)
                set_rng_state(state)
                self._init(tmp, i)
                del tmp
        layers = [self._tp_form(layer, i) if i in mine else stand_ins[i] for i, layer in enumerate(layers)]
        model = GPT.__new__(GPT)
        nn.Module.__init__(model)
        model.config = config
        emb, head = layers[0], layers[-1]
        model.wte, model.wpe, model.drop = emb.wte, emb.wpe, emb.drop
        model.blocks = nn.ModuleList(layers[1:-1])
        model.ln_f, model.lm_head = head.ln_f, head.lm_head
        self.model = model

    def _construct(self, i: int):
        """Pipeline layer ``i`` as ``GPT.__init__`` constructs it (inside ``auto_parallelize`` for AxoNN)."""
        import contextlib
        from ..nn.layers import Dropout, Embedding, LayerNorm, Linear
        from ..nn.transformer import TransformerBlock
        from ..models.gpt import GPTEmbedding, GPTHead
        c, dt, hyb = self.config, self.dtype, self.hyb
        ctx = contextlib.nullcontext()
        if hyb.style is TPStyle.AXONN:
            from .auto_parallelize import auto_parallelize
            ctx = auto_parallelize(groups=hyb.groups)
        with ctx:
            if i == 0:
                return GPTEmbedding(Embedding(c.vocab_size, c.n_embd, dtype=dt),
                                    Embedding(c.block_size, c.n_embd, dtype=dt), Dropout(c.dropout))
            if i <= c.n_layer:
                return TransformerBlock(c.n_embd, c.n_head, c.dropout, c.bias, dtype=dt)
            return GPTHead(LayerNorm(c.n_embd, bias=c.bias, dtype=dt),
                           Linear(c.n_embd, c.vocab_size, bias=False, dtype=dt))

    def _init(self, layer, i: int) -> None:
        """``GPT._init_weights`` on layer ``i`` alone (the same module names' suffixes, in the same order)."""
        holder = nn.Module()
        holder.config = self.config
        holder.add_module("layer", layer)
        GPT._init_weights(holder)

    def _tp_form(self, layer, i: int):
        """Megatron: the layer with attention / MLP / vocabulary split over ``intra_group`` (weights kept)."""
        if self.hyb.style is TPStyle.MEGATRON:
            from .tensor import parallelize_gpt
            parallelize_gpt(layer, group=self.hyb.grid.intra_group)
        return layer

    @staticmethod
    def _stand_in(layer):
        """``layer`` with every parameter's data a zero-stride view of its shape (no memory)."""
        for p in layer.parameters():
            p.data = np.broadcast_to(np.zeros((), p.data.dtype), p.data.shape)
        return layer


class _Checkpointed(nn.Module):
    """A pipeline chunk whose forward is recomputed in backward (activation checkpointing)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return nn.checkpoint(self.inner, x)


class _Params:
    """What ``intra_layer.sync_gradients`` needs from a model: ``parameters()``."""

    def __init__(self, params):
        self._params = params

    def parameters(self):
        return iter(self._params)


class HybridGPT:
    """The GPT on this rank under any layout of the grid, with one ``step``/``clip`` for all of them.

    Args:
        config: the model. A tied head (``tie_word_embeddings=True``, GPT-2) is built for the DDP, FSDP
            and Megatron layouts; with ``tp_style="axonn"`` or a pipeline it raises ``NotImplementedError``.
        grid: the process grid (default: ``axonmpi.get_grid()``).
        tp_style: ``"megatron"`` or ``"axonn"`` (ignored when the tensor dimensions are all 1).
        schedule: pipeline schedule ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (2 virtual stages).
        num_microbatches: micro-batches per step.
        activation_checkpointing: recompute each pipeline chunk's activations in backward.
        dtype: parameter dtype.
        global_batch: sequences per step (checked against the layout).
        fsdp: ``None``/``"none"`` (replicated parameters) or a
            :class:`~axonmpi.parallel.fsdp.ShardingStrategy` (or its name): wrap the GPT in
            :class:`~axonmpi.parallel.FSDP` over ``data_group`` instead of DDP. Built for the pure
            data-parallel layout and for data parallel x tensor parallel (``G_inter = 1``,
            no activation checkpointing); other layouts raise ``NotImplementedError`` at
            construction (:func:`fsdp_refusal`).
        cpu_offload: FSDP's :class:`~axonmpi.parallel.fsdp.CPUOffload` mode (with ``fsdp``).
        mixed_precision: FSDP's :class:`~axonmpi.parallel.fsdp.MixedPrecision` (with ``fsdp``).
        hybrid_shard_size: with ``fsdp="hybrid_shard"``: data ranks per shard group (default: the
            data ranks of one node); the shard groups are replicas of each other.

    Example:
        >>> grid = axonmpi.init(G_data=2, G_inter=2).grid
        >>> hyb = HybridGPT(cfg, global_batch=8, num_microbatches=2)
        >>> x, y = hyb.local_batch(x_global), hyb.local_batch(y_global)
        >>> opt = AdamW(hyb.parameters()); opt.zero_grad()
        >>> loss = hyb.forward_backward(x, y); norm = hyb.clip_grad_norm_(1.0); opt.step()
    """

    def __init__(self, config: GPTConfig, grid: Optional[ProcessGrid] = None, *, tp_style="axonn",
                 schedule="1f1b", num_microbatches: int = 1, activation_checkpointing: bool = False,
                 dtype="float32", global_batch: int, fsdp=None, cpu_offload=None, mixed_precision=None,
                 hybrid_shard_size: Optional[int] = None, cp_algo="ring", sequence_parallel: bool = False,
                 expert_parallel: int = 1):
        from ..random import manual_seed  # noqa: F401  (the caller seeds; documented)
        from .fsdp import ShardingStrategy
        self.grid = get_grid() if grid is None else grid
        self.layout = Layout.from_grid(self.grid)
        self.sharding = None if fsdp is None or fsdp == "none" else ShardingStrategy.coerce(fsdp)
        if self.sharding is None and (cpu_offload not in (None, False, "none") or mixed_precision is not None):
            raise ValueError(f"rank {self.grid.world.rank}: cpu_offload={cpu_offload!r} / mixed_precision="
                             f"{mixed_precision!r} need fsdp (a sharding strategy), got fsdp={fsdp!r}")
        if self.sharding is not None:
            why = fsdp_refusal(self.layout, tp_style, activation_checkpointing)
            if why:
                raise NotImplementedError(f"rank {self.grid.world.rank}: fsdp={self.sharding.value} {why}")
        self.config = config
        self.dtype = np.dtype(dtype)
        if self.layout.G_context > 1 and (self.layout.G_inter > 1 or self.layout.tensor_size > 1
                                          or self.sharding is not None or activation_checkpointing):
            raise NotImplementedError(
                f"rank {self.grid.world.rank}: context parallelism (G_context={self.layout.G_context}) is built "
                f"with data parallelism (DDP over data x context); not yet with {self.layout} with "
                f"fsdp={fsdp!r}, activation_checkpointing={activation_checkpointing}")
        self.style = _style(tp_style) if self.layout.tensor_size > 1 else None
        if sequence_parallel and (self.style is not TPStyle.MEGATRON or self.layout.G_inter > 1):
            raise NotImplementedError(
                f"rank {self.grid.world.rank}: sequence_parallel is built for tp_style='megatron' with "
                f"G_intra_c > 1 and no pipeline; got {self.layout} with tp_style={tp_style!r}")
        self.schedule = _schedule(schedule)
        self.num_microbatches = int(num_microbatches)
        self.global_batch = int(global_batch)
        check_layout(config, self.layout, global_batch=global_batch, num_microbatches=num_microbatches,
                     schedule=schedule, tp_style=tp_style, world_size=self.grid.world.world_size)
        self.shards = batch_shards(self.layout, self.style or "megatron")
        g = self.grid
        if config.tie_word_embeddings and (self.layout.G_inter > 1 or self.style is TPStyle.AXONN):
            where = "across pipeline stages (wte on the first, lm_head on the last)" if self.layout.G_inter > 1 \
                else "with tp_style='axonn' (a 3-D lm_head cannot share wte's Parameter)"
            raise NotImplementedError(
                f"rank {g.world.rank}: tie_word_embeddings=True {where} is not built: the head would train "
                f"apart from the embedding. Use the DDP/FSDP or Megatron layouts, parallelize(model, "
                f"tensor_parallel='axonn') (it keeps a tied head whole), or an untied GPTConfig")
        self.groups = None
        self._v = 2 if self.schedule.name == "INTERLEAVED_ONE_F_ONE_B" else 1
        if self.style is TPStyle.AXONN:
            from .tensor import TensorParallelGroups
            self.groups = TensorParallelGroups.from_grid(g)
            self.shard_index = g.coords.data * g.intra_group.size + g.intra_group.rank
        else:
            self.shard_index = g.coords.data
        if self.layout.G_inter > 1:       # build only this stage's layers (the others: shape-only stand-ins)
            self.model = _StagedBuild(self, config, self.dtype).model
        elif self.style is TPStyle.AXONN:
            from .auto_parallelize import auto_parallelize
            with auto_parallelize(groups=self.groups):
                self.model = GPT(config, dtype=dtype)
        else:
            self.model = GPT(config, dtype=dtype)
            if self.style is TPStyle.MEGATRON:
                from .tensor import parallelize_gpt
                parallelize_gpt(self.model, group=g.intra_group, sequence_parallel=sequence_parallel)
            if self.layout.G_context > 1:        # each rank its tokens; gradients over data x context
                from .context import context_parallel_gpt
                context_parallel_gpt(self.model, g.context_group, cp_algo)
        self._expert_parallel, experts = int(expert_parallel), []
        if config.moe_experts or self._expert_parallel > 1:   # MoE blocks: see axonmpi.parallel.moe
            from .moe import expert_parallel as _ep, expert_parameters
            if not config.moe_experts or self.layout.G_inter > 1 or self.layout.G_context > 1 or self.style is not None \
                    or self.sharding is not None or activation_checkpointing:
                raise NotImplementedError(f"rank {g.world.rank}: MoE GPTs run on data-parallel layouts (DDP; "
                                          f"expert_parallel divides G_data) here, not {self.layout}"
                                          f"{' with FSDP' if self.sharding else ''}; use axonmpi.parallel."
                                          "parallelize(gpt, expert_parallel=N) for tensor-parallel experts")
            _ep(self.model, self._expert_parallel, grid=g)
            experts = expert_parameters(self.model)
        self.ddp = None
        self.pipe = None
        self.fsdp = None
        self._shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}   # FSDP frees them
        if self.sharding is not None:
            from .fsdp import FSDP
            self.fsdp = FSDP(self.model, group=g.data_group, sharding_strategy=self.sharding,
                             cpu_offload=cpu_offload, mixed_precision=mixed_precision,
                             hybrid_shard_size=hybrid_shard_size)
            self._params = list(self.fsdp.parameters())
        elif self.layout.G_inter == 1 and self.style is None and not activation_checkpointing:
            from .ddp import DistributedDataParallel
            self.ddp = DistributedDataParallel(self.model, group=g.data_context_group, ignored_parameters=experts)
            self._params = list(self.model.parameters())
            if experts:
                from .moe import hook_expert_gradients
                self._expert_hooks = hook_expert_gradients(experts, g.data_group, g.G_data)
        else:
            from .pipeline import Pipeline, split_module
            v = self._v
            chunks = split_module(self.model, g.G_inter, v, group=g.inter_group)
            if activation_checkpointing:
                chunks = [_Checkpointed(c) for c in chunks]
            self.pipe = Pipeline(chunks, self.schedule, num_microbatches=self.num_microbatches,
                                 loss_fn=F.cross_entropy, group=g.inter_group, virtual_stages=v,
                                 data_group=None if self.style is TPStyle.AXONN else g.data_group,
                                 track_memory=False)
            self._params = self.pipe.parameters()
        mine = {id(p) for p in self._params}
        self.param_names = [n for n, p in self.model.named_parameters() if id(p) in mine or self.fsdp is not None]
        self._owned = set(self.param_names)
        # FSDP over data x TP: FSDP shards the TP-local parameters; checkpoints keep the TP form
        self._fsdp_tp = self.fsdp is not None and self.style is not None
        if self._fsdp_tp and self.style is TPStyle.AXONN:
            # the replicated parameters' gradients are summed over intra_group segment by segment of the
            # flat shards: every rank of the tensor block must pack the same TP-local shapes
            shapes = all_gather_object([self._shapes[n] for n in self.param_names], group=g.intra_group)
            for i, n in enumerate(self.param_names):
                if len({tuple(x[i]) for x in shapes}) > 1:
                    raise NotImplementedError(
                        f"rank {g.world.rank}: fsdp with tp_style='axonn' needs every tensor-parallel rank to hold "
                        f"the same shape of each parameter; {n!r} has shapes {[tuple(x[i]) for x in shapes]} over "
                        "intra_group (choose sizes that divide the GPT's dimensions evenly)")

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

    def forward_backward(self, x, y, *, scaler=None) -> float:
        """Forward and backward on this rank's rows; gradients reduced as the layout needs.

        Args:
            x, y: this rank's rows (:meth:`local_batch`).
            scaler: an :class:`axonmpi.amp.GradScaler` whose ``scale`` multiplies the loss before
                backward (DDP and FSDP layouts; ``None``: no scaling).

        Returns:
            The mean loss over the whole global batch (the same on every rank and every layout).
        """
        g = self.grid
        if self.ddp is not None or self.fsdp is not None:
            _, loss = (self.ddp or self.fsdp)(x, y)
            aux = self.model.moe_auxiliary_loss() if self.config.moe_experts else None
            total = loss if aux is None else loss + aux      # the returned value stays the LM loss
            (total if scaler is None else scaler.scale(total)).backward()
            value = float(loss.item())
            for grp in self._loss_groups():
                if grp.size > 1:
                    value = float(all_reduce(np.array([value]), ReduceOp.MEAN, grp)[0])
            if self._fsdp_tp and self.style is TPStyle.AXONN:
                self._sync_axonn_fsdp()
            return value
        if scaler is not None:
            raise NotImplementedError(f"rank {g.world.rank}: loss scaling is built for the DDP and FSDP layouts, "
                                      f"not {self.layout} with a pipeline or tensor parallelism")
        value = self.pipe.step(x, y)       # Megatron / pure PP: already averaged over data_group
        if self.style is TPStyle.AXONN:
            from .intra_layer import sync_gradients
            sync_gradients(_Params(self._params), mean=True, groups=self.groups)
            for grp in self.groups.replica:
                if grp.size > 1:
                    value = float(all_reduce(np.array([value]), ReduceOp.MEAN, grp)[0])
        return value

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip all gradients of the global model to ``max_norm``; return the global norm before clipping.

        :func:`axonmpi.optim.clip_grad_norm_` on this rank's parameters: their placements (TP shards,
        FSDP chunks split by their segments' placements, pipeline stages) count each element once."""
        return float(clip_grad_norm_(self._params, max_norm))

    def _loss_groups(self) -> list:
        """DDP / FSDP layouts: the groups the rank's mean loss is averaged over (its row slices)."""
        if self._fsdp_tp and self.style is TPStyle.AXONN:
            return [self.grid.data_group, self.grid.intra_group]
        return [self.grid.data_context_group]

    def _sync_axonn_fsdp(self) -> None:
        """FSDP x AxoNN TP, after FSDP's reduce-scatter averaged every gradient over ``data_group``: the
        rest of the gradient-sync table on each flat segment (as ``parallelize`` does)."""
        from .parallelize import _finish_axonn_fsdp
        _finish_axonn_fsdp(self.fsdp, self.grid)

    def eval_loss(self, x, y) -> float:
        """Mean loss over the global batch without gradients (``x``, ``y``: this rank's rows)."""
        from ..autograd import no_grad
        g = self.grid
        if self.ddp is not None or self.fsdp is not None:
            with no_grad():
                _, loss = (self.fsdp or self.model)(x, y)
            value = float(loss.item())
            groups = self._loss_groups()
        else:
            value = self.pipe.eval_step(x, y)
            groups = list(self.groups.replica) if self.style is TPStyle.AXONN else []
        for grp in groups:
            if grp.size > 1:
                value = float(all_reduce(np.array([value]), ReduceOp.MEAN, grp)[0])
        return value

    # -- state ------------------------------------------------------------------------------------------
    def _tp_map(self) -> Dict[str, Any]:
        if self.style is None and self._expert_parallel == 1:
            return {}
        from .tensor.state import _tp_entries
        return {key: (m, name) for key, m, name, _ in _tp_entries(self.model)}

    def _gather(self, local: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """``{name: {key: local shard}}`` of this rank's parameters -> full arrays of every stage's
        (collective: TP gathers in ``param_names`` order, then one all-gather over ``inter_group``)."""
        from ..backend import to_host
        tp = self._tp_map()
        own: Dict[str, Dict[str, Any]] = {}
        for n in self.param_names:
            ent = {}
            for k, v in local.get(n, {}).items():
                if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                    if n in tp:
                        m, name = tp[n]
                        v = m._tp_gather(name, v)
                    v = np.array(to_host(v), copy=True)
                ent[k] = v
            own[n] = ent
        inter = self.grid.inter_group
        merged: Dict[str, Dict[str, Any]] = {}
        for part in (all_gather_object(own, group=inter) if inter.size > 1 else [own]):
            merged.update(part)
        return merged

    def _shard(self, name: str, full) -> np.ndarray:
        """This rank's shard of parameter ``name`` from its full array, or from a loaded block of
        :meth:`_block` (a ``ShardedArray``: its TP block, or the whole array)."""
        tp = self._tp_map()
        shape = self._full_shape(name)
        if hasattr(full, "global_shape") and tuple(full.global_shape) != shape:   # FSDP's flattened save
            full = np.asarray(full.local).reshape(shape)
        elif not hasattr(full, "global_shape") and tuple(np.shape(full)) != shape \
                and int(np.prod(np.shape(full))) == int(np.prod(shape)):
            full = np.asarray(full).reshape(shape)
        if hasattr(full, "global_shape"):
            if name in tp:
                m, local = tp[name]
                return np.asarray(m._tp_unblock(local, full.local))
            return np.asarray(full.local)
        if name in tp:
            m, local = tp[name]
            return m._tp_shard(local, np.asarray(full))
        return np.asarray(full)

    def _full_shape(self, name: str) -> tuple:
        """The serial GPT's shape of parameter ``name``."""
        tp = self._tp_map()
        if name in tp:
            return tuple(tp[name][0]._tp_full_shape(tp[name][1]))
        return self._shapes[name]

    def _fsdp_ranges(self) -> Dict[str, tuple]:
        """``{name: (start, stop)}``: the elements of each flattened parameter this rank's FSDP shard holds."""
        return {n: (v.offsets[0], v.offsets[0] + v.local_shape[0])
                for n, v in self.fsdp.sharded_state_dict().items() if hasattr(v, "global_shape")}

    def _template_block(self, name: str, saved_shape, dtype, ranges=None):
        """A ``checkpoint.load`` template block of parameter ``name`` (or a moment shaped like it) for an
        entry saved with ``saved_shape``: the full shape (replicated / TP layouts) or ``(numel,)`` (FSDP's
        flattened save).  FSDP reads the whole rows covering its elements of a full-shape entry; the
        other layouts read the whole of a flattened entry they own."""
        from ..distributed.sharding import ShardedArray
        shape = self._full_shape(name)
        numel = int(np.prod(shape))
        saved_shape = tuple(saved_shape)
        if self.fsdp is not None and not self._fsdp_tp:
            a, b = ranges[name]
            if saved_shape == (numel,):
                return ShardedArray(np.zeros(b - a, dtype), (numel,), (a,))
            row = int(np.prod(shape[1:]))
            r0, r1 = (a // row, -(-b // row)) if b > a else (0, 0)
            return ShardedArray(np.zeros((r1 - r0,) + shape[1:], dtype), shape, (r0,) + (0,) * (len(shape) - 1))
        if saved_shape == shape or saved_shape != (numel,):
            return self._block(name, np.zeros(self._local_shape(name), dtype))
        n = numel if name in self._owned else 0
        return ShardedArray(np.zeros(n, dtype), (numel,), (0,))

    def _local_shape(self, name: str) -> tuple:
        return self._shapes[name]      # this rank's (TP-local) shape, kept from before FSDP flattened them

    def _tp_flat(self, name: str, v):
        """FSDP x TP: this rank's TP shard of a loaded value of ``name`` (any layout's save), flattened, as
        the 1-D ``ShardedArray`` FSDP's loaders take (they keep the elements of this rank's chunk)."""
        from ..distributed.sharding import ShardedArray
        local = np.ascontiguousarray(self._shard(name, v)).reshape(-1)
        if local.size != int(np.prod(self._shapes[name])):
            raise ValueError(f"rank {self.grid.world.rank}: {name!r} shard has {local.size} elements, the "
                             f"parameter {self._shapes[name]}")
        return ShardedArray(local, (local.size,), (0,))

    def _fsdp_local(self, optimizer=None) -> Dict[str, Any]:
        """FSDP x TP: this rank's whole TP-local arrays, gathered over FSDP's shard group (collective):
        ``{name: array}`` of the parameters, or with ``optimizer`` ``{name: {key: array or scalar}}`` of
        its state (moments gathered like the parameters, scalars such as ``step`` as they are)."""
        from ..backend import to_host
        from ..distributed import all_gather
        from ..distributed.sharding import compact_slots
        out: Dict[str, Any] = {}
        for f in self.fsdp.parameters():
            names = self.fsdp._param_names(f)
            k, size, n = f.world_size, f.padded_size, f.total_numel

            def gather(chunk):
                chunk = np.asarray(to_host(chunk))
                send = np.zeros(size, chunk.dtype)
                send[:chunk.size] = chunk
                buf = np.empty(k * size, chunk.dtype)
                if k > 1:
                    all_gather(send, group=f.group, out=buf)
                else:
                    buf[:] = send
                compact_slots(buf, n, k, size)
                return [np.array(v, copy=True) for v in f.layout.views(buf[:n])]

            if optimizer is None:
                for nm, v in zip(names, gather(f.data)):
                    out[nm] = v
                continue
            st = optimizer.state.get(f) or {}
            for nm in names:
                out[nm] = {}
            for key in sorted(st):
                v = st[key]
                if _is_array(v):
                    for nm, a in zip(names, gather(v)):
                        out[nm][key] = a
                else:
                    for nm in names:
                        out[nm][key] = v
        return out

    def _flat_block(self, name: str, v):
        """A loaded value of parameter ``name`` (full array, a block of whole rows, or FSDP's flattened
        block) as the 1-D ``ShardedArray`` FSDP's loaders take."""
        from ..backend import to_host
        from ..distributed.sharding import ShardedArray
        shape = self._full_shape(name)
        numel = int(np.prod(shape))
        if hasattr(v, "global_shape"):
            if tuple(v.global_shape) == (numel,):
                return v
            row = int(np.prod(shape[1:]))
            return ShardedArray(np.asarray(v.local).reshape(-1), (numel,), (v.offsets[0] * row,))
        return ShardedArray(np.asarray(to_host(v)).reshape(-1), (numel,), (0,))

    def _block(self, name: str, local):
        """A ``ShardedArray`` of parameter ``name``'s full array holding ``local`` (this rank's shard of it,
        or of an array shaped like it); an empty block where another pipeline stage owns ``name``."""
        from ..backend import to_host
        from ..distributed.sharding import ShardedArray
        tp = self._tp_map()
        full = self._full_shape(name)
        if name not in self._owned:
            dt = dict(self.model.named_parameters())[name].dtype
            return ShardedArray(np.empty((0,) + full[1:], dtype=dt), full, (0,) * len(full))
        if name in tp:
            m, local_name = tp[name]
            return m._tp_block(local_name, local)
        return ShardedArray(np.asarray(to_host(local)), full, (0,) * len(full))

    def full_state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """The whole serial model's parameters (gathered over tensor and pipeline groups), on every rank.

        Collective over the grid.  Keys and shapes are the serial GPT's (PyTorch names).
        """
        named = dict(self.model.named_parameters())
        if self._fsdp_tp:
            local = self._fsdp_local()
            full = self._gather({n: {"v": local[n]} for n in self.param_names})
            return OrderedDict((n, full[n]["v"]) for n in named)
        if self.fsdp is not None:
            from ..backend import to_host
            sd = self.fsdp.state_dict()
            return OrderedDict((n, np.array(to_host(sd[n]), copy=True)) for n in named)
        full = self._gather({n: {"v": named[n].data} for n in self.param_names})
        return OrderedDict((n, full[n]["v"]) for n in named)

    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load a full (serial-named) state dict, or one read into :meth:`checkpoint_template`'s blocks:
        each rank copies in its shard of its stage's parameters."""
        named = dict(self.model.named_parameters())
        if strict:
            missing = sorted(set(named) - set(state_dict))
            if missing:
                raise KeyError(f"rank {self.grid.world.rank}: the state dict lacks {missing}")
        if self._fsdp_tp:     # this rank's TP shard, flattened: FSDP keeps the elements of its chunk
            self.fsdp.load_state_dict({n: self._tp_flat(n, v) for n, v in state_dict.items() if n in named},
                                      strict=strict)
            return
        if self.fsdp is not None:
            self.fsdp.load_state_dict({n: self._flat_block(n, v) for n, v in state_dict.items() if n in named},
                                      strict=strict)
            return
        for n in self.param_names:
            if n in state_dict:
                p = named[n]
                shard = self._shard(n, state_dict[n])
                if tuple(shard.shape) != tuple(p.shape):
                    raise ValueError(f"rank {self.grid.world.rank}: {n!r} shard has shape {tuple(shard.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
                from ..backend import get_array_module
                p.data[...] = get_array_module(p.data).asarray(shard, dtype=p.data.dtype)

    def checkpoint_template(self, path: Optional[str] = None) -> Dict[str, Any]:
        """A ``checkpoint.load`` template for a :func:`~axonmpi.checkpoint.training_state` saved by any
        layout: the model entries as this layout's blocks (each rank reads only its shard); with
        ``path`` (the checkpoint, to learn the optimizer's per-parameter keys) the optimizer's
        moments too; the rest (scheduler, sampler, RNG, meta, extra) as saved.  Collective.

        Example:
            >>> loaded = axonmpi.checkpoint.load(path, hyb.checkpoint_template())
            >>> restore_training_state(loaded, *hyb.checkpoint_state(opt), sched, sampler)
        """
        optimizer: Dict[str, Any] = {}
        model = _ModelState(self).state_dict()
        if path is not None:
            from ..distributed import broadcast_object
            keys = shapes = None
            if self.grid.world.rank == 0:
                from ..checkpoint import CheckpointReader
                keys, shapes = {}, {}
                reader = CheckpointReader(path, verify=False)
                for name in reader.names():
                    parts = name.split("/")
                    if len(parts) == 4 and parts[:2] == ["optimizer", "state"]:
                        keys.setdefault(parts[2], []).append(parts[3])
                    if parts[0] in ("model", "optimizer"):
                        e = reader.entry(name)
                        shapes[name] = tuple(e.shape) if e.kind == "array" else None
            keys, shapes = broadcast_object((keys, shapes), group=self.grid.world.default_group)
            named = dict(self.model.named_parameters())
            ranges = self._fsdp_ranges() if self.fsdp is not None and not self._fsdp_tp else None
            model = OrderedDict((n, self._template_block(n, shapes.get(f"model/{n}") or self._full_shape(n),
                                                         self.dtype, ranges)) for n in named)
            if keys and set(keys) == set(named):
                state = OrderedDict()
                for n in named:
                    state[n] = {k: (self._template_block(n, shapes.get(f"optimizer/state/{n}/{k}")
                                                         or self._full_shape(n), self.dtype, ranges)
                                    if k in _MOMENTS else None) for k in keys[n]}
                optimizer = {"state": state, "param_groups": None}
        return {"model": model, "optimizer": optimizer, "scheduler": {}, "sampler": {},
                "rng": None, "meta": {}, "extra": {}}

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """This rank's entries under serial names: TP shards as ``ShardedArray`` blocks, only its stage's."""
        from .tensor import sharded_state_dict
        if self._fsdp_tp:             # FSDP x TP: the TP blocks (gathered over data; replicas write once)
            return _ModelState(self).state_dict()
        if self.fsdp is not None:     # FSDP: 1-D blocks of the flattened parameters
            sd = self.fsdp.sharded_state_dict()
            return OrderedDict((n, sd[n]) for n in self.param_names)
        sd = sharded_state_dict(self.model) if self.style is not None else self.model.state_dict()
        return OrderedDict((n, sd[n]) for n in self.param_names)

    def checkpoint_state(self, optimizer) -> "tuple":
        """``(model_state, optimizer_state)``: objects with ``state_dict``/``load_state_dict`` for
        :func:`axonmpi.checkpoint.training_state`.  They save serial-named ``ShardedArray`` blocks
        (no gather: TP shards as blocks, each pipeline stage its own parameters) and load full
        arrays, so a checkpoint saved under one layout loads under any other and into the serial GPT."""
        return _ModelState(self), _OptimizerState(self, optimizer)

    def dropout_seed(self, seed: int) -> int:
        """The seed of this rank's random stream (dropout): ranks holding the same rows share it.

        Megatron tensor-parallel ranks must draw the same masks on their replicated activations,
        so the stream follows the row slice (``seed * 1000 + shard_index``), not the world rank;
        data-parallel replicas (and AxoNN's per-rank rows) get distinct masks.  The pipeline
        derives each stage's per-micro-batch stream from this seed.
        """
        return int(seed) * 1000 + self.shard_index

    def layout_record(self) -> Dict[str, Any]:
        """The five sizes, the TP style, the schedule and the micro-batches (stored in checkpoints)."""
        return {**self.layout.as_dict(), "tp_style": self.style.value if self.style else "none",
                "schedule": ("fsdp" if self.fsdp is not None else "ddp" if self.ddp is not None
                             else self.schedule.name.lower()), "fsdp": self.sharding.value if self.sharding else "none",
                "microbatches": self.num_microbatches}

    def _how(self) -> str:
        if self.fsdp is not None:
            rep = self.fsdp.replicate_group.size if self.fsdp.replicate_group is not None else 1
            return f"FSDP {self.sharding.name} (shards over {self.fsdp.shard_group.size} ranks x {rep} replicas)"
        return "DDP" if self.ddp is not None else f"pipeline {self.schedule.name.lower()} m={self.num_microbatches}"

    def describe(self) -> str:
        """One line: the layout, the TP style, the schedule and what this rank holds."""
        style = self.style.value if self.style else "none"
        how = self._how()
        return (f"{self.layout} | tp-style {style} | {how} | batch in {self.shards} row slices | "
                f"rank {self.grid.world.rank} holds {len(self.param_names)} parameter tensors")


# optimizer state entries shaped like their parameter (read block-wise on resume); others are read whole
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum")


def _is_array(v) -> bool:
    return hasattr(v, "global_shape") or (hasattr(v, "shape") and getattr(v, "ndim", 0) > 0)


def _dtype(v):
    return v.local.dtype if hasattr(v, "global_shape") else np.asarray(v).dtype


class _ModelState:
    """The hybrid model's parameters under serial names as ``ShardedArray`` blocks of the full arrays.

    Every rank lists every parameter (the checkpoint's rule: the same keys everywhere): its own
    stage's as its TP block (or the whole array, written once over replicas), other stages' as
    an empty block.  Loading takes full arrays (any layout's checkpoint) and keeps the shard.
    """

    def __init__(self, hyb: HybridGPT):
        self.hyb = hyb

    def state_dict(self):
        if self.hyb._fsdp_tp:
            local = self.hyb._fsdp_local()
            return OrderedDict((n, self.hyb._block(n, local[n])) for n, _ in self.hyb.model.named_parameters())
        if self.hyb.fsdp is not None:
            return self.hyb.sharded_state_dict()
        return OrderedDict((n, self.hyb._block(n, p.data)) for n, p in self.hyb.model.named_parameters())

    def load_state_dict(self, state_dict, strict: bool = True):
        self.hyb.load_full_state_dict(state_dict, strict=strict)


class _OptimizerState:
    """An optimizer's per-parameter state keyed by serial parameter names, as blocks like the parameters'."""

    def __init__(self, hyb: HybridGPT, optimizer):
        self.hyb, self.opt = hyb, optimizer

    def state_dict(self):
        hyb = self.hyb
        named = dict(hyb.model.named_parameters())
        if hyb._fsdp_tp:             # FSDP x TP: the moments gathered over data, saved as TP blocks
            local = hyb._fsdp_local(self.opt)
            state = OrderedDict((n, {k: (hyb._block(n, v) if _is_array(v) else v) for k, v in local[n].items()})
                                for n in named if local.get(n))
            return {"state": state,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]}
        if hyb.fsdp is not None:     # FSDP: keyed by serial names, moments as 1-D blocks of the flattened arrays
            osd = hyb.fsdp.optim_state_dict(self.opt)
            return {"state": OrderedDict((n, osd["state"][n]) for n in named if n in osd["state"]),
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]}
        own = [n for n in hyb.param_names if self.opt.state.get(named[n])]
        # the per-parameter keys (and scalar values such as AdamW's step) are the same for every parameter
        sample = {k: (None if _is_array(v) else v) for k, v in self.opt.state[named[own[0]]].items()} if own else None
        inter = hyb.grid.inter_group
        samples = [x for x in (all_gather_object(sample, group=inter) if inter.size > 1 else [sample]) if x]
        state = OrderedDict()
        if samples:
            keys = samples[0]
            for n, p in named.items():
                st = self.opt.state.get(p, {}) if n in hyb.param_names else {}
                state[n] = {k: (hyb._block(n, st.get(k)) if v is None else v) for k, v in keys.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict, strict: bool = True):
        from ..backend import get_array_module
        named = dict(self.hyb.model.named_parameters())
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.opt.param_groups):
            raise ValueError(f"rank {self.hyb.grid.world.rank}: the checkpoint has {len(saved_groups)} parameter "
                             f"groups, the optimizer {len(self.opt.param_groups)}")
        for g, saved in zip(self.opt.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        if self.hyb._fsdp_tp:
            state = {n: {k: (self.hyb._tp_flat(n, v) if _is_array(v) else v) for k, v in st.items()}
                     for n, st in state_dict["state"].items() if st}
            self.hyb.fsdp.load_optim_state_dict(self.opt, {"state": state, "param_groups": saved_groups})
            return
        if self.hyb.fsdp is not None:
            state = {n: {k: (self.hyb._flat_block(n, v) if _is_array(v) else v) for k, v in st.items()}
                     for n, st in state_dict["state"].items() if st}
            self.hyb.fsdp.load_optim_state_dict(self.opt, {"state": state, "param_groups": saved_groups})
            return
        for n in self.hyb.param_names:
            saved = state_dict["state"].get(n)
            if not saved:
                continue
            p = named[n]
            xp = get_array_module(p.data)
            self.opt.state[p] = {k: (xp.asarray(self.hyb._shard(n, v), dtype=_dtype(v)) if _is_array(v) else v)
                                 for k, v in saved.items()}
