"""The GPT recipe: the GPT (or the Llama) on any layout of the 5-D grid (``HybridGPT``), as a plan for the composer.

[Note: the GPT recipe]  The recipe holds the GPT's plan -- which layers are column / row / vocab / attention
(:func:`gpt_plan`), where the pipeline cuts (the GPT layer by layer, :func:`gpt_layers`: each rank builds only its
stage's layers), the batch split -- and hands it to :func:`~axonmpi.parallel.parallelize` for every layout.
``HybridGPT`` runs any model family given its :class:`ModelRecipe` (:func:`recipe_for`: the GPT's, the Llama's of
``recipes/llama.py``); nothing else in it knows the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..distributed.grid import Layout, ProcessGrid
from ..distributed.world import get_grid
from ..models.gpt import GPT, GPTConfig, init_gpt_weights
from ..nn import functional as F
from ..optim.clip import clip_grad_norm_
from ..parallel.ddp import DistributedDataParallel
from ..parallel.fsdp import ShardingStrategy
from ..parallel.parallelize import ModelPlan, PipelinePlan, SequenceRegion, parallelize
from ..parallel.pipeline import LayerBuilder
from .gpt_layout import TPStyle, _schedule, _style, batch_shards, check_layout, virtual_stage_count

__all__ = ["HybridGPT", "Layout", "ModelRecipe", "TPStyle", "batch_shards", "check_layout", "gpt_layers",
           "gpt_model_plan", "gpt_plan", "recipe_for"]


@dataclass(frozen=True)
class ModelRecipe:
    """What :class:`HybridGPT` needs of a model family, as data and small functions.

    Attributes:
        name: the family's name in messages (``"GPT"``, ``"Llama"``).
        build: ``dtype -> model``, the whole serial model.
        layers: ``dtype -> LayerBuilder`` of the model layer by layer (a pipeline builds only its stages' layers);
            ``None``: built whole on every rank.
        plan: ``(tensor size, sequence_parallel) -> {pattern: style}``, the Megatron plan.
        model_plan: what the model declares to the composer (its sequence region, an auxiliary loss).
        blocks: the modules activation checkpointing recomputes without a pipeline.
        moe: the model has MoE layers (expert parallelism; ``model.moe_auxiliary_loss()`` joins the loss).
    """

    name: str
    build: Callable[[Any], Any]
    layers: Optional[Callable[[Any], LayerBuilder]]
    plan: Callable[[int, bool], Dict[str, str]]
    model_plan: ModelPlan
    blocks: List[str]
    moe: bool = False


def recipe_for(config) -> ModelRecipe:
    """The :class:`ModelRecipe` of a ``GPTConfig`` or a ``LlamaConfig``.

    Example:
        >>> recipe_for(LlamaConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4)).name
        'Llama'
    """
    from ..models.llama import Llama, LlamaConfig
    c = config
    if isinstance(c, GPTConfig):
        return ModelRecipe("GPT", lambda dtype: GPT(c, dtype=dtype),
                           None if c.moe_experts else (lambda dtype: gpt_layers(c, dtype)),
                           lambda tp, sp: gpt_plan(c, sp), gpt_model_plan(c),
                           [f"blocks.{i}" for i in range(c.n_layer)], bool(c.moe_experts))
    if isinstance(c, LlamaConfig):
        from .llama import llama_layers, llama_model_plan, llama_plan
        return ModelRecipe("Llama", lambda dtype: Llama(c, dtype=dtype), lambda dtype: llama_layers(c, dtype),
                           lambda tp, sp: llama_plan(c, tp, sp), llama_model_plan(c),
                           [f"model.layers.{i}" for i in range(c.n_layer)])
    raise TypeError(f"HybridGPT lays out a GPTConfig or a LlamaConfig, got {type(config).__name__}")


class HybridGPT:
    """The GPT (or the Llama) on this rank under any layout of the grid: ``self.pm``, :func:`parallelize` of the
    model's plan (:func:`recipe_for`), with one ``forward_backward`` / ``clip_grad_norm_``; its state is the
    composer's one form (``pm.sharded_state()``).

    Args:
        config: a ``GPTConfig`` (a tied head under any layout: whole under AxoNN, split over the vocabulary under
            sequence parallelism, across pipeline stages a copy on the first and last stage, their gradients
            summed), or a ``LlamaConfig`` (``recipes/llama.py``: key/value heads replicated when fewer than the
            tensor size, rotary tables at each token's global position).
        grid: the process grid (default: ``axonmpi.get_grid()``).  tp_style: ``"megatron"`` or ``"axonn"``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (``virtual_stages`` chunks per rank, default 2),
            ``"zb-h1"`` or ``"zbv"``.
        num_microbatches, global_batch: per step.  activation_checkpointing: each pipeline chunk (no pipeline:
            each block) recomputed in backward.  dtype: parameter dtype.
        fsdp: ``None``/``"none"`` or a ``ShardingStrategy`` (or its name): FSDP over data (x context) instead of
            DDP.  cpu_offload, mixed_precision, hybrid_shard_size: FSDP's options.
        cp_algo: ``"ring"`` or ``"ulysses"`` when ``G_context > 1`` (in a pipeline too: the embedding numbers this
            rank's tokens at their positions).  sequence_parallel: Megatron's (entered after the embeddings, left
            at the gathered ``lm_head``: :func:`gpt_model_plan`).
        expert_parallel: EP of a MoE GPT's experts (divides ``G_data``): the grid's by default (``None``; its
            groups are built at init, ``axonmpi.init(..., expert_parallel=EP)``).
            In a pipeline each stage adds its router losses of each micro-batch (weight
            1 / num_microbatches, Megatron's rule); under sequence parallelism over the global tokens.

    Example:
        >>> hyb = HybridGPT(cfg, axonmpi.init(G_data=2, G_inter=2).grid, global_batch=8, num_microbatches=2)
        >>> opt = AdamW(hyb.parameters()); opt.zero_grad()
        >>> loss = hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y)); hyb.clip_grad_norm_(1.0); opt.step()
    """

    def __init__(self, config: GPTConfig, grid: Optional[ProcessGrid] = None, *, tp_style="axonn",
                 schedule="1f1b", num_microbatches: int = 1, activation_checkpointing: bool = False,
                 dtype="float32", global_batch: int, fsdp=None, cpu_offload=None, mixed_precision=None,
                 hybrid_shard_size: Optional[int] = None, cp_algo="ring", sequence_parallel: bool = False,
                 expert_parallel: Optional[int] = None, virtual_stages: Optional[int] = None):
        g = self.grid = get_grid() if grid is None else grid
        self.layout, piped = Layout.from_grid(g), g.G_inter > 1
        self.sharding = None if fsdp is None or fsdp == "none" else ShardingStrategy.coerce(fsdp)
        opts = {k: v for k, v in (("cpu_offload", cpu_offload), ("mixed_precision", mixed_precision),
                                  ("hybrid_shard_size", hybrid_shard_size)) if v not in (None, False, "none")}
        if self.sharding is None and set(opts) - {"hybrid_shard_size"}:
            raise ValueError(f"rank {g.world.rank}: cpu_offload={cpu_offload!r} / mixed_precision="
                             f"{mixed_precision!r} need fsdp (a sharding strategy), got fsdp={fsdp!r}")
        self.recipe = recipe = recipe_for(config)
        self.config, self.dtype, self.schedule = config, np.dtype(dtype), _schedule(schedule)
        self._schedule_said = schedule if isinstance(schedule, str) else self.schedule.name.lower()   # logs: the user's word
        self.style = _style(tp_style) if self.layout.tensor_size > 1 else None
        self.sequence_parallel = bool(sequence_parallel)
        self._expert_parallel = int((g.expert_parallel if recipe.moe else 1) if expert_parallel is None
                                    else expert_parallel)
        if self.sequence_parallel and self.style is not TPStyle.MEGATRON:     # the composer's, named by the flag
            raise NotImplementedError(f"rank {g.world.rank}: sequence_parallel needs tp_style='megatron' (G_intra_c > 1): "
                                      f"the {recipe.name} leaves it at a gathered lm_head; got {self.layout} "
                                      f"tp_style={tp_style!r}")
        self.num_microbatches, self.global_batch = int(num_microbatches), int(global_batch)
        check_layout(config, self.layout, global_batch=global_batch, num_microbatches=num_microbatches,
                     schedule=schedule, tp_style=tp_style, world_size=g.world.world_size,
                     sequence_parallel=self.sequence_parallel, virtual_stages=virtual_stages)
        tp = {TPStyle.AXONN: "axonn",
              TPStyle.MEGATRON: recipe.plan(self.layout.G_intra_c, self.sequence_parallel)}.get(self.style)
        vs = virtual_stage_count(self.schedule, virtual_stages)
        self.pm = pm = parallelize(
            # a MoE GPT's constructor draws its experts after every block: built whole on every rank
            recipe.layers(self.dtype) if piped and recipe.layers is not None else recipe.build(self.dtype), grid=g,
            tensor_parallel=tp, data_parallel="fsdp" if self.sharding else "ddp", sharding_strategy=self.sharding,
            sequence_parallel=self.sequence_parallel, context_parallel=cp_algo if g.G_context > 1 else None,
            expert_parallel=self._expert_parallel if recipe.moe or self._expert_parallel > 1 else None,
            pipeline=PipelinePlan(self.num_microbatches, self.schedule, virtual_stages=vs) if piped else None,
            activation_checkpointing=(True if piped else recipe.blocks) if activation_checkpointing else None,
            model_plan=recipe.model_plan, **opts)
        self.shards, self.shard_index = pm.batch_shards
        self.model, self._params, self.pipe = pm.inner, list(pm.parameters()), pm.pipeline if piped else None
        self.local_loss = None     # this rank's loss sum of the last forward (None under a pipeline)
        # DDP: the model whole on every rank of its data (x context) group (train_gpt samples from it)
        self.ddp = pm.module if isinstance(pm.module, DistributedDataParallel) and tp is None else None
        self.fsdp = pm.module if self.sharding is not None and not piped else None
        self.param_names = list(pm.sharded_state().owned)      # this rank's (its stages' in a pipeline)

    def parameters(self) -> List[Any]:
        """The parameters this rank trains (its stage's; its shards of tensor-parallel ones)."""
        return list(self._params)

    def local_batch(self, batch):
        """This rank's rows (and, under context parallelism, tokens) of a global batch."""
        return self.pm.local_batch(batch)

    def _token_mean(self, x, y):
        """The one loss rule (``pm.token_mean``) on this rank's rows and tokens."""
        logits, _ = self.pm(x)
        lsum = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
        self.local_loss = lsum.data     # this rank's own, before the mean over ranks (axonmpi.finite names its rank)
        return self.pm.token_mean(lsum, int((y != -100).sum()))

    def forward_backward(self, x, y, *, scaler=None) -> float:
        """Forward and backward on this rank's rows (``scaler``: a ``GradScaler``; a pipeline's scales each
        micro-batch's loss); returns the serial model's mean loss over the global batch's counted targets, on
        every rank and layout."""
        if self.pipe is not None:      # the token mean over its micro-batches and token groups
            return self.pm.step(x, y, scaler=scaler)   # x, y: local_batch, this rank's tokens
        loss = self._token_mean(x, y)
        aux = self.model.moe_auxiliary_loss() if self.recipe.moe else None
        total = loss if aux is None else loss + aux      # the returned value stays the LM loss
        (total if scaler is None else scaler.scale(total)).backward()
        return float(loss.item())

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global model's gradients to ``max_norm`` (placements count each element once); the norm before."""
        return float(clip_grad_norm_(self._params, max_norm))

    def eval_loss(self, x, y) -> float:
        """Mean loss over the global batch without gradients (``x``, ``y``: this rank's rows)."""
        from ..autograd import no_grad
        if self.pipe is not None:
            return self.pm.eval_step(x, y)
        with no_grad():
            return float(self._token_mean(x, y).item())

    def generate(self, idx, max_new_tokens: int, **kwargs):
        """Sample from the whole model on this rank (context-parallel attention runs whole sequences here)."""
        with self.pm.whole_sequences():
            return self.model.generate(idx, max_new_tokens, **kwargs)

    def dropout_seed(self, seed: int) -> int:
        """``seed * 1000 + shard_index``: ranks holding the same rows draw the same masks, data replicas distinct ones."""
        return int(seed) * 1000 + self.shard_index

    # -- state: the composer's one form (pm.sharded_state()) ------------------------------------
    def full_state_dict(self):
        """The whole serial model's state on every rank (collective over the grid); the serial model's keys."""
        return self.pm.state_dict()

    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load a full (serial-named) state dict, or one read into :meth:`checkpoint_template`'s blocks.  A
        vocabulary array with fewer rows than this model's padded vocabulary (``GPTConfig(padded_vocab_size=...)``:
        Hugging Face weights, an unpadded export) gets zero padding rows, which the masked logits never use."""
        self.pm.load_state_dict(pad_vocab_rows(state_dict, self.config, self.full_shape), strict=strict)

    def full_shape(self, name: str) -> tuple:
        """The serial model's shape of parameter ``name`` (its placement's)."""
        return self.pm.sharded_state().full_shape(name)

    def full_shapes(self) -> Dict[str, tuple]:
        """``{name: serial shape}`` of every parameter this rank holds (:meth:`full_shape` of each, one state read
        for all: a model of n parameters reads its state once, not n times)."""
        state = self.pm.sharded_state()
        return {n: state.full_shape(n) for n in self.param_names}

    def checkpoint_state(self, optimizer) -> "tuple":
        """``(model, optimizer)`` for :func:`axonmpi.checkpoint.training_state` / ``restore_training_state``: the
        model saves serial-named ``ShardedArray`` blocks (each rank its pieces) and loads either form, so a
        checkpoint saved under one layout loads under any other and into the serial model."""
        return self.pm, optimizer

    def checkpoint_template(self, path: Optional[str] = None) -> Dict[str, Any]:
        """A ``checkpoint.load`` template: this layout's blocks (``ShardedState.checkpoint_template``)."""
        return self.pm.sharded_state().checkpoint_template(path, group=self.grid.world.default_group)

    def layout_record(self) -> Dict[str, Any]:
        """The five sizes, the TP style, the schedule and the micro-batches (stored in checkpoints)."""
        sched = "fsdp" if self.fsdp is not None else "ddp" if self.ddp is not None else self.schedule.name.lower()
        return {**self.layout.as_dict(), "tp_style": self.style.value if self.style else "none", "schedule": sched,
                "fsdp": self.sharding.value if self.sharding else "none", "microbatches": self.num_microbatches}

    def describe(self) -> str:
        """One line: the layout, the TP style, the schedule and what this rank holds."""
        f, how = self.fsdp, "DDP" if self.ddp is not None else "parallelize"
        if f is not None:
            rep = f.replicate_group.size if f.replicate_group is not None else 1
            how = f"FSDP {self.sharding.name} (shards over {f.shard_group.size} ranks x {rep} replicas)"
        elif self.pipe is not None:
            how = f"pipeline {self._schedule_said} m={self.num_microbatches}" + \
                (f" + FSDP {self.sharding.name} stage shards" if self.sharding is not None else "")
        return (f"{self.layout} | tp-style {self.style.value if self.style else 'none'} | {how} | batch in "
                f"{self.shards} row slices | rank {self.grid.world.rank} holds {len(self.param_names)} parameter tensors")


VOCAB_KEYS = ("wte.weight", "lm_head.weight", "model.embed_tokens.weight")


def pad_vocab_rows(state_dict, config, full_shape) -> Dict[str, Any]:
    """``state_dict`` with each vocabulary array (``wte`` / ``lm_head`` / ``embed_tokens``) of ``config.vocab_size``
    rows padded with zero rows to ``full_shape(name)`` (the padded vocabulary); other entries as they are."""
    out = dict(state_dict)
    for k in VOCAB_KEYS:
        v = out.get(k)
        if v is None or hasattr(v, "global_shape") or not hasattr(v, "shape"):
            continue
        try:
            want = tuple(full_shape(k))
        except KeyError:             # not on this rank's pipeline stage
            continue
        if tuple(v.shape) != want and v.shape[0] == config.vocab_size and tuple(v.shape[1:]) == want[1:] \
                and want[0] > v.shape[0]:
            v = np.asarray(v)
            out[k] = np.concatenate([v, np.zeros((want[0] - v.shape[0],) + v.shape[1:], v.dtype)])
    return out


def gpt_model_plan(config: GPTConfig) -> ModelPlan:
    """What the GPT declares to the composer: its sequence-parallel region starts after the embeddings (they number
    positions by column) at ``drop`` and ends at the gathered ``lm_head``; a MoE GPT's router losses are each
    pipeline chunk's auxiliary loss (``moe_aux_loss_coeff * aux + moe_z_loss_coeff * z``)."""
    aux = None
    if config.moe_experts and (config.moe_aux_loss_coeff or config.moe_z_loss_coeff):
        from ..nn.moe import moe_loss

        def aux(chunk):
            return moe_loss(chunk, config.moe_aux_loss_coeff, config.moe_z_loss_coeff)
    return ModelPlan(sequence_region=SequenceRegion(enter="drop", leave="lm_head", outside=("wte", "wpe")),
                     aux_loss=aux)


def gpt_plan(config: GPTConfig, sequence_parallel: bool = False) -> Dict[str, str]:
    """The GPT's Megatron plan: heads split, MLP column then row, vocabulary-parallel ``wte`` and a gathered
    ``lm_head`` (a tied head: both replicated, one Parameter; under sequence parallelism both split, one
    Parameter of this rank's vocabulary rows, Megatron's tied embedding)."""
    plan = {"blocks.*.attn": "attention", "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"}
    if config.tie_word_embeddings and not sequence_parallel:
        return plan
    return {**plan, "wte": "vocab", "lm_head": "column_gather"}


def gpt_layers(config: GPTConfig, dtype=None) -> LayerBuilder:
    """The dense GPT layer by layer (embedding, blocks, head; tied as ``GPT`` ties): with a pipeline,
    ``parallelize`` builds only this rank's stages' layers, with the serial GPT's values."""
    def tie(model):
        model.lm_head.weight = model.wte.weight
    return LayerBuilder(config.n_layer + 2, lambda i: GPT.build_pipeline_layer(config, i, dtype),
                        lambda layer, i: init_gpt_weights(layer, config.n_layer),
                        lambda layers: GPT.from_pipeline_layers(config, layers),
                        tie if config.tie_word_embeddings else None)

