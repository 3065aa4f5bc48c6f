"""Build only one pipeline rank's layers of a model, with the values the serial model would have."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from ...nn.module import Module, Sequential
from ...random import get_rng_state, set_rng_state
from .split import split_points

__all__ = ["build_stage_layers", "stand_in"]


def stand_in(layer: Module) -> Module:
    """``layer`` with every parameter's data a zero-stride view of its shape (no memory): it keeps the
    names, shapes and dtypes that checkpoints and :func:`split_points` need."""
    for p in layer.parameters():
        p.data = np.broadcast_to(np.zeros((), p.data.dtype), p.data.shape)
    return layer


def build_stage_layers(construct: Callable[[int], Module], init: Callable[[Module, int], None],
                       tp_form: Callable[[Module, int], Module], num_layers: int, num_stages: int,
                       virtual_stages: int, stage_rank: int, *,
                       stage_ranks: Optional[Sequence[int]] = None) -> List[Module]:
    """The ``num_layers`` pipeline layers of a model as pipeline rank ``stage_rank`` holds them: its
    own chunks' layers built (the serial model's values), every other layer a :func:`stand_in`.

    [Note: staged build, same init as the serial model]  The serial model draws from one random
    stream: first each layer's constructor (``construct(i)``, in order), then one init pass over all
    layers (``init(layer, i)``, in order).  The stream cannot be skipped ahead (normal draws reject
    a variable number of bits), so the draws are replayed, one layer at a time, never holding more
    than one foreign layer: (A) with the stream saved and restored, each layer is built in its
    tensor-parallel form (``tp_form``) and turned into its stand-in: their sizes give the split
    points (as ``split_module`` balances them) and so this rank's layers; (B) each layer is
    constructed in order, foreign ones dropped at once; (C) the init pass, layer by layer: this
    rank's layers in place, a foreign one on a temporary copy (constructed with the stream saved and
    restored), dropped after.  This rank's layers then take their tensor-parallel form.

    Args:
        construct: ``i -> layer i`` as the serial model's constructor builds it.
        init: the serial model's init pass on one layer.
        tp_form: ``(layer, i) -> layer`` in its tensor-parallel form (weights kept), or the identity.
        num_layers: the model's pipeline layers.
        num_stages, virtual_stages: the pipeline's ranks and chunks per rank.
        stage_rank: this rank's index in the pipeline group.
        stage_ranks: the pipeline rank of each chunk when not round-robin (ZBV's V:
            ``make_schedule("zbv", p, m).stage_ranks``; cut with ``split_module(..., stage_ranks=)`` too).

    Example:
        >>> layers = build_stage_layers(lambda i: GPT.build_pipeline_layer(cfg, i),
        ...                             lambda m, i: init_gpt_weights(m, cfg.n_layer),
        ...                             lambda m, i: m, cfg.n_layer + 2, 2, 1, grid.inter_group.rank)
    """
    n = num_layers
    start = get_rng_state()
    stand_ins = [stand_in(tp_form(construct(i), i)) for i in range(n)]                          # (A)
    set_rng_state(start)
    k = num_stages * virtual_stages
    starts = split_points(Sequential(*stand_ins), num_stages, virtual_stages) + [n]
    placed = range(stage_rank, k, num_stages) if stage_ranks is None else \
        [c for c in range(k) if int(stage_ranks[c]) == stage_rank]
    mine = {i for c in placed for i in range(starts[c], starts[c + 1])}
    layers = []
    for i in range(n):                                                                          # (B)
        layer = construct(i)
        layers.append(layer if i in mine else None)
        del layer
    for i in range(n):                                                                          # (C)
        if i in mine:
            init(layers[i], i)
        else:
            state = get_rng_state()
            tmp = construct(i)
            set_rng_state(state)
            init(tmp, i)
            del tmp
    return [tp_form(layer, i) if i in mine else stand_ins[i] for i, layer in enumerate(layers)]
