"""A model given layer by layer (:class:`LayerBuilder`): one pipeline rank builds only its stages' layers, with the values the serial model would have."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ...backend import get_array_module
from ...nn.module import Module, Sequential
from ...random import get_rng_state, set_rng_state
from .split import split_points

__all__ = ["LayerBuilder", "is_stand_in", "stand_in", "stand_in_param"]


def stand_in(layer: Module) -> Module:
    """``layer`` with every parameter's data a zero-stride view of its shape (no memory): it keeps the
    names, shapes and dtypes that checkpoints and :func:`split_points` need."""
    for p in layer.parameters():
        stand_in_param(p)
    return layer


def stand_in_param(p) -> None:
    """One parameter as a :func:`stand_in`'s."""
    xp = get_array_module(p.data)
    p.data = xp.broadcast_to(xp.zeros((), p.data.dtype), p.data.shape)


def is_stand_in(p) -> bool:
    """Whether parameter ``p`` is a :func:`stand_in`'s (a read-only zero-stride view: no storage of its own)."""
    d = getattr(p, "data", p)
    return d.ndim > 0 and d.size > 0 and not any(d.strides) and not getattr(d.flags, "writeable", False)


def _seq(layers: List[Module]) -> Module:
    return Sequential(*layers)


@dataclass(frozen=True)
class LayerBuilder:
    """A model given layer by layer, so that a pipeline rank builds only its stages' layers.

    ``parallelize(LayerBuilder(...), pipeline=PipelinePlan(...))`` builds, on each pipeline rank, the
    layers of the chunks the schedule runs there with the values the serial model has (the others are
    :func:`stand_in` s: their shapes, no memory), then composes the model as it composes a whole one.

    [Note: staged build, same init as the serial model]  The serial model draws from one random stream:
    first each layer's constructor (``construct(i)``, in order), then one init pass over all layers
    (``init(layer, i)``, in order).  The stream cannot be skipped ahead (normal draws reject a variable
    number of bits), so the draws are replayed, one layer at a time, never holding more than one foreign
    layer: (A) with the stream saved and restored, each layer is built and turned into its stand-in: their
    sizes give the split points (as ``split_module`` balances them) and so this rank's layers; (B) each
    layer is constructed in order, foreign ones dropped at once; (C) the init pass, layer by layer: this
    rank's layers in place, a foreign one on a temporary copy (constructed with the stream saved and
    restored), dropped after.  A weight ``tie`` shares between one of this rank's layers and a foreign one
    (a GPT's head and embedding) is built on this rank too: the foreign layer is built, and every parameter
    of it but the shared ones becomes a stand-in.

    Args:
        num_layers: the model's pipeline layers.
        construct: ``i -> layer i`` as the serial model's constructor builds it.
        init: the serial model's init pass on one layer (``None``: ``construct`` initializes).
        assemble: ``layers -> model`` sharing their parameters (default: an ``nn.Sequential``); what
            ``split_module`` cuts back into the same layers.
        tie: ``model -> None``, the serial model's weight tying after its init (a GPT's
            ``lm_head.weight = wte.weight``); the pipeline then keeps the two stages' copies equal.

    Example:
        >>> b = LayerBuilder(cfg.n_layer + 2, lambda i: GPT.build_pipeline_layer(cfg, i),
        ...                  lambda m, i: init_gpt_weights(m, cfg.n_layer), lambda ls: GPT.from_pipeline_layers(cfg, ls))
        >>> pm = parallelize(b, pipeline=PipelinePlan(4, "1f1b"))     # G_inter > 1: this rank's layers only
    """

    num_layers: int
    construct: Callable[[int], Module]
    init: Optional[Callable[[Module, int], None]] = None
    assemble: Callable[[List[Module]], Module] = _seq
    tie: Optional[Callable[[Module], None]] = None

    def build(self) -> Module:
        """The whole serial model (every layer built and initialized, then tied)."""
        layers = [self.construct(i) for i in range(self.num_layers)]
        for i, layer in enumerate(layers):
            if self.init is not None:
                self.init(layer, i)
        return self._assembled(layers)

    def _assembled(self, layers: List[Module]) -> Module:
        model = self.assemble(layers)
        if self.tie is not None:
            self.tie(model)
        return model

    def build_stage(self, num_stages: int, virtual_stages: int, stage_rank: int, *,
                    stage_ranks: Optional[Sequence[int]] = None, by="params",
                    boundaries: Optional[Sequence[int]] = None) -> Tuple[Module, List[int]]:
        """The model as pipeline rank ``stage_rank`` holds it, and the chunks' start indices.

        Args:
            num_stages, virtual_stages: the pipeline's ranks and chunks per rank.
            stage_rank: this rank's index in the pipeline group.
            stage_ranks: the pipeline rank of each chunk when not round-robin (ZBV's V).
            by, boundaries: how the chunks are cut (as :func:`split_module`).
        """
        n = self.num_layers
        start = get_rng_state()
        stand_ins = [stand_in(self.construct(i)) for i in range(n)]                               # (A)
        set_rng_state(start)
        k = num_stages * virtual_stages
        starts = split_points(_seq(stand_ins), num_stages, virtual_stages, by, boundaries)
        bounds = starts + [n]
        placed = range(stage_rank, k, num_stages) if stage_ranks is None else \
            [c for c in range(k) if int(stage_ranks[c]) == stage_rank]
        mine = {i for c in placed for i in range(bounds[c], bounds[c + 1])}
        keep = self._tied_with(stand_ins, mine)
        layers: List[Optional[Module]] = []
        for i in range(n):                                                                        # (B)
            layer = self.construct(i)
            layers.append(layer if i in mine or i in keep else None)
            del layer
        for i in range(n):                                                                        # (C)
            if layers[i] is not None:
                if self.init is not None:
                    self.init(layers[i], i)
            elif self.init is not None:
                state = get_rng_state()
                tmp = self.construct(i)
                set_rng_state(state)
                self.init(tmp, i)
                del tmp
        for i, names in keep.items():      # a foreign layer built for its tied weights: the rest stands in
            for name, p in layers[i].named_parameters():
                if name not in names:
                    stand_in_param(p)
        return self._assembled([layer if layer is not None else stand_ins[i] for i, layer in enumerate(layers)]), starts

    def _tied_with(self, stand_ins: List[Module], mine: Set[int]) -> Dict[int, Set[str]]:
        """``{foreign layer: names of its parameters that one of this rank's layers shares after tie}``."""
        if self.tie is None:
            return {}
        owner = {id(p): (i, name) for i, layer in enumerate(stand_ins) for name, p in layer.named_parameters()}
        self._assembled(stand_ins)            # ties the stand-ins as the serial model ties its layers
        keep: Dict[int, Set[str]] = {}
        for i in mine:
            for p in stand_ins[i].parameters():
                j, name = owner[id(p)]        # the layer that constructed it (a tie rebinds the user's name)
                if j not in mine:
                    keep.setdefault(j, set()).add(name)
        return keep
