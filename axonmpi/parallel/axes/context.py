"""Step 2 of the composer: context parallelism (each sequence's tokens split over the context group).

Every attention (``nn.CausalSelfAttention``, or step 1's head-split ``TensorParallelAttention``) becomes a
:class:`~axonmpi.parallel.context.ContextParallelAttention` holding the same ``qkv`` / ``proj`` layers (names,
values, shards and placements kept), and every parameter records the context group as a replica.
``pm.local_batch`` gives each rank its tokens of each sequence (ring: chunks ``r`` and ``2P-1-r`` of ``2P``;
Ulysses: the ``r``-th of ``P``).  A module whose ``forward`` takes ``positions=`` (the model, or a pipeline's
first layer: a GPT's embedding) is given those tokens' positions in the whole sequence (:func:`number_positions`).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, List

from ...nn.module import Module
from ...nn.transformer import CausalSelfAttention
from ..swap import module_slots
from .record import Composition

__all__ = ["apply", "number_positions", "takes_positions", "whole_sequences"]


def apply(module: Module, c: Composition) -> None:
    """Swap the attention layers and record the context group as every parameter's replica."""
    if not c.cp:
        return
    from ...distributed.placement import add_placement
    c.attention = _swap_attention(module, c)
    for p in module.parameters():
        add_placement(p, replica=c.grid.context_group)


def _swap_attention(module: Module, c: Composition) -> List[Any]:
    from ..context import ContextParallelAttention
    from ..context.layout import CPAlgo
    from ..tensor import TensorParallelAttention
    g, algo, r = c.grid.context_group, CPAlgo.coerce(c.context), c.rank
    layers = []
    for parent, name, child, qname in module_slots(module):
        if type(child) is CausalSelfAttention:
            n_embd, n_head, local, drop = child.n_embd, child.n_head, child.n_head, child.attn_dropout.p
        elif type(child) is TensorParallelAttention:
            n_embd, n_head, local, drop = child.embed_dim, child.num_heads, child.local_heads, child.attn_dropout.p
        else:
            continue
        if drop:
            raise NotImplementedError(f"rank {r}: {qname!r} has attention dropout {drop}; context parallelism "
                                      "computes attention blockwise and draws no attention-weight mask: use 0")
        if algo is CPAlgo.ULYSSES and local % g.size:
            raise ValueError(f"rank {r}: Ulysses splits {qname!r}'s {local} heads on this rank (of {n_head}) "
                             f"over the {g.size} context ranks; {local} is not divisible by {g.size} (use ring, "
                             "or heads that divide by tensor x context)")
        new = ContextParallelAttention(n_embd, n_head, group=g, algo=algo, dropout=child.resid_dropout.p,
                                       bias=child.qkv.bias is not None)
        new.qkv, new.proj = child.qkv, child.proj
        setattr(parent, name, new)
        layers.append(new)
    if not layers:
        raise ValueError(f"rank {r}: context_parallel={algo.value!r} found no nn.CausalSelfAttention in the model")
    return layers


def takes_positions(m: Module) -> bool:
    """Whether ``m.forward`` takes ``positions=`` (the protocol a position-numbering module follows)."""
    try:
        return "positions" in inspect.signature(type(m).forward).parameters
    except (TypeError, ValueError):
        return False


def number_positions(m: Module, c: Composition) -> bool:
    """If ``m`` takes ``positions=``: its forward, given this rank's tokens of each sequence (``T_local`` of
    them), numbers them at their positions in the whole ``T_local * P``-token sequence.  Returns whether it did."""
    if not (c.cp and takes_positions(m)):
        return False
    import numpy as np
    from ...autograd.tensor import Tensor
    from ..context.layout import ContextLayout, CPAlgo
    g, algo, attention = c.grid.context_group, CPAlgo.coerce(c.context), c.attention
    forward = m.forward

    def numbered(idx, *args, **kwargs):
        on = all(a.context_enabled for a in attention)
        if on and kwargs.get("positions") is None:
            t = int(np.shape(idx.data if isinstance(idx, Tensor) else idx)[1])
            whole = attention[0].seq_len or t * g.size       # pm.local_batch records the whole length
            pos = ContextLayout(int(whole), g.size, algo).positions(g.rank)
            if len(pos) != t:
                raise ValueError(f"rank {c.rank}: {type(m).__name__} got {t} tokens of each sequence, but this rank's "
                                 f"share of a {whole}-token sequence is {len(pos)}: split the batch with "
                                 "pm.local_batch (or pm.local_tokens) first")
            kwargs["positions"] = pos
        return forward(idx, *args, **kwargs)
    object.__setattr__(m, "forward", numbered)
    return True


@contextlib.contextmanager
def whole_sequences(attention: List[Any]):
    """Inside, the context-parallel attention layers run whole sequences on this rank alone (generation)."""
    for a in attention:
        a.context_enabled = False
    try:
        yield
    finally:
        for a in attention:
            a.context_enabled = True
