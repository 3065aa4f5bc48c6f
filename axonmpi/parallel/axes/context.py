"""Step 2 of the composer: context parallelism (each sequence's tokens split over the context group).

Every attention (``nn.CausalSelfAttention``, or step 1's head-split ``TensorParallelAttention``) becomes a
:class:`~axonmpi.parallel.context.ContextParallelAttention` holding the same ``qkv`` / ``proj`` layers (names,
values, shards and placements kept), and every parameter records the context group as a replica.
``pm.local_batch`` gives each rank its tokens of each sequence (ring: chunks ``r`` and ``2P-1-r`` of ``2P``;
Ulysses: the ``r``-th of ``P``).  A module whose ``forward`` takes ``positions=`` (the model, or a pipeline's
first layer: a GPT's embedding) is given those tokens' positions in the whole sequence (:func:`number_positions`;
so is one inside a sequence-parallel region, which sees its sequence shard).
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
    """If ``m`` takes ``positions=`` and sees part of each sequence -- this rank's tokens under context parallelism
    (``T_local`` of them), its sequence shard under sequence parallelism when the model declares no region (the
    model's input is scattered before ``m``) -- its forward numbers the tokens it is given at their positions in
    the whole sequence.  Returns whether it did."""
    sp_cut = c.sp and not c.region_declared
    if not ((c.cp or sp_cut) and takes_positions(m)):
        return False
    forward = m.forward

    def numbered(idx, *args, **kwargs):
        if kwargs.get("positions") is None:
            kwargs["positions"] = _positions(m, c, idx, sp_cut)
        return forward(idx, *args, **kwargs)
    object.__setattr__(m, "forward", numbered)
    return True


def _positions(m: Module, c: Composition, idx, sp_cut: bool):
    """The global positions of the ``t`` tokens per sequence ``idx`` holds (``None``: whole sequences, ``0 .. t-1``)."""
    import numpy as np
    from ...autograd.tensor import Tensor
    from ..context.layout import ContextLayout, CPAlgo
    t = int(np.shape(idx.data if isinstance(idx, Tensor) else idx)[1])
    tp = c.grid.intra_group
    local = t * tp.size if sp_cut else t                       # this rank's tokens before the sequence cut
    pos = np.arange(local)
    if c.cp and all(a.context_enabled for a in c.attention):
        g, algo = c.grid.context_group, CPAlgo.coerce(c.context)
        whole = c.attention[0].seq_len or local * g.size       # pm.local_batch records the whole length
        pos = np.asarray(ContextLayout(int(whole), g.size, algo).positions(g.rank))
        if len(pos) != local:
            raise ValueError(f"rank {c.rank}: {type(m).__name__} got {local} tokens of each sequence, but this rank's "
                             f"share of a {whole}-token sequence is {len(pos)}: split the batch with "
                             "pm.local_batch (or pm.local_tokens) first")
    elif not sp_cut:
        return None
    return pos[tp.rank * t:(tp.rank + 1) * t] if sp_cut else pos


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
