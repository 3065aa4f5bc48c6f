"""What :func:`~axonmpi.parallel.parallelize` is told beside its axes: the pipeline's plan and what a model declares.

``parallel/`` knows no model.  Where a transform needs something only the model knows -- where its
sequence-parallel region starts and ends, an auxiliary loss a pipeline stage adds to its backward -- the
model's plan says it (a recipe writes the plan; ``recipes/gpt.py`` holds the GPT's).  How a model numbers
positions is a protocol, not a declaration: a module whose ``forward`` takes ``positions=`` (the GPT, its
pipeline embedding) is given each token's global position under context parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple, Union

__all__ = ["ModelPlan", "PipelinePlan", "SequenceRegion"]


def _from_loss():
    from .token_mean import FROM_LOSS      # token_mean imports autograd: loaded when a plan is made
    return FROM_LOSS


@dataclass(frozen=True)
class SequenceRegion:
    """Where a model's sequence-parallel region is, when it is not the whole model.

    By default ``parallelize(sequence_parallel=True)`` scatters the model's input along the sequence and
    gathers its output (and a pipeline stage's, at each end): every module runs on sequence shards.  A
    model whose first modules must see whole sequences (an embedding that numbers positions by column)
    declares the region instead:

    Args:
        enter: the module (a name of ``named_modules()``) whose output enters the region: a dropout is swapped
            for a :class:`~axonmpi.parallel.tensor.SequenceParallelDropout` (scatter, then its dropout); any other
            module (an embedding) has its output scattered along the sequence.
        leave: the module whose output leaves it whole (a ``"column_gather"`` layer of the plan: its
            all-gather over the tensor group returns whole sequences).
        outside: modules run on whole sequences before ``enter`` (their parameters' gradients are whole on
            every tensor rank: not summed over the tensor group).

    Example (the GPT's, ``recipes/gpt.py``)::

        >>> SequenceRegion(enter="drop", leave="lm_head", outside=("wte", "wpe"))
    """

    enter: str
    leave: str
    outside: Tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelPlan:
    """What a model declares for the transforms (``parallelize(..., model_plan=ModelPlan(...))``).

    Args:
        sequence_region: see :class:`SequenceRegion` (``None``: the whole model is the region).
        aux_loss: ``aux_loss(chunk) -> Tensor | None``: a pipeline chunk's auxiliary loss of its last forward
            (a MoE's router losses), added to its backward per micro-batch with weight ``1 / num_microbatches``
            (the default of :attr:`PipelinePlan.aux_loss`).
        token_local: modules (classes, or fnmatch patterns on ``named_modules()``) in a sequence- or
            context-parallel region whose own code computes each token's output from that token alone (a block
            that calls its children, an MLP, a hand-written norm); their children are checked in turn.  Under
            sequence and context parallelism every module that is not one of the library's attention or
            token-local layers must be declared here or in ``whole_sequence``, or ``parallelize`` refuses it
            ([Note: modules in a region] in ``parallel/axes/regions.py``; docs/parallelize.md).
        whole_sequence: token-mixing modules (a user's own attention; classes or patterns): under sequence
            parallelism each receives the whole sequence, gathered over the tensor group in order (its first
            argument, the sequence on ``sequence_dim``), must return a tensor of the same sequence length, and
            each rank keeps its shard of it; it runs whole on every tensor rank (its tensor-parallel layers, if
            the plan names any inside it, see whole sequences; its parameters' gradients are whole there).  Not
            built for context parallelism (``NotImplementedError`` at construction).

    Example (a model written for PyTorch, its own ``CausalSelfAttention`` among its blocks)::

        >>> ModelPlan(token_local=(GPT, Block, MLP, LayerNorm), whole_sequence=(CausalSelfAttention,))
    """

    sequence_region: Optional[SequenceRegion] = None
    aux_loss: Optional[Callable[[Any], Any]] = None
    token_local: Tuple[Union[type, str], ...] = ()
    whole_sequence: Tuple[Union[type, str], ...] = ()

    def __post_init__(self):
        for name in ("token_local", "whole_sequence"):
            v = getattr(self, name)
            v = (v,) if isinstance(v, (str, type)) else tuple(v)
            bad = [e for e in v if not isinstance(e, (str, type))]
            if bad:
                raise TypeError(f"ModelPlan({name}=...): expected module classes or named_modules() patterns, "
                                f"got {bad!r}")
            object.__setattr__(self, name, v)


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline axis of :func:`parallelize`: how the model is cut and run.

    ``parallelize(model, ..., pipeline=PipelinePlan(num_microbatches=4, schedule="zbv"))`` cuts the model
    (an ``nn.Sequential``, a model with ``pipeline_layers()``, or a
    :class:`~axonmpi.parallel.pipeline.LayerBuilder`: each rank then builds only its stages' layers) into the
    schedule's stages, placing each chunk on the pipeline rank the schedule runs it on (ZBV's V included),
    after the model went through the tensor, sequence, context and expert transforms; each stage then goes
    through the same sequence-region, checkpointing and data-parallel transforms a model without a pipeline
    goes through (``[Note: the composer's order]``).

    Args:
        num_microbatches: micro-batches per step.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, ``"zbv"`` (or a :class:`PipelineSchedule`).
        virtual_stages: chunks per pipeline rank (interleaved: any; ZBV: 2, the default for it; else 1).
        loss_fn: ``loss_fn(output, target)`` the mean over a micro-batch (default ``F.cross_entropy``).
        boundaries: explicit start indices of chunks 1 .. p v - 1 (else balanced ``split_by``).
        split_by: ``"params"`` or ``"layers"``.
        ignore_index: targets not counted (the loss is the mean over the counted targets of the global batch).
            Default: the loss function's own (``nn.CrossEntropyLoss(ignore_index=-1)``, ``functools.partial(
            F.cross_entropy, ignore_index=-1)``, -100 for ``F.cross_entropy``); a value given here that disagrees
            with the loss function's is refused at construction (``Pipeline``'s ``ignore_index``).
        aux_loss: ``aux_loss(chunk) -> Tensor | None``, a chunk's auxiliary loss of its last forward, added to
            its backward per micro-batch (weight ``1 / num_microbatches``; :class:`~axonmpi.parallel.Pipeline`).
            Default: the model plan's (:attr:`ModelPlan.aux_loss`).

    Example:
        >>> pm = parallelize(model, tensor_parallel=plan, pipeline=PipelinePlan(4, "1f1b"))
        >>> xb, yb = pm.local_batch(x, y); loss = pm.step(xb, yb)
    """

    num_microbatches: int
    schedule: Any = "1f1b"
    virtual_stages: Optional[int] = None
    loss_fn: Optional[Callable] = None
    boundaries: Optional[Tuple[int, ...]] = None
    split_by: str = "params"
    ignore_index: Any = field(default_factory=lambda: _from_loss())
    aux_loss: Optional[Callable] = field(default=None)
