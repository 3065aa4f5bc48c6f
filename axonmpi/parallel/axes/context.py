"""Step 2 of the composer: context parallelism (each sequence's tokens split over the context group).

Every attention (``nn.CausalSelfAttention``, or step 1's head-split ``TensorParallelAttention``) becomes a
:class:`~axonmpi.parallel.context.ContextParallelAttention` holding the same ``qkv`` / ``proj`` layers, and every
``nn.GroupedQueryAttention`` a :class:`~axonmpi.parallel.context.ContextParallelGroupedQueryAttention` holding the
same ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (names, values, shards and placements kept); every parameter
records the context group as a replica.  ``pm.local_batch`` gives each rank its tokens of each sequence (ring:
chunks ``r`` and ``2P-1-r`` of ``2P``; Ulysses: the ``r``-th of ``P``).

[Note: positions]  A module whose ``forward`` takes ``positions=`` and is called without them is given them
(:func:`number_positions`): the model itself (or a pipeline's first layer, or an ``nn.Sequential``'s first layer)
the positions of the tokens of its input in the whole sequence -- this rank's tokens under context parallelism,
and its sequence shard's under sequence parallelism when the model declares no region (the GPT's embedding);
a later layer of an ``nn.Sequential`` or of a pipeline stage (a Llama block computing its rotary tables) the
positions of the sequence its attention sees -- this rank's tokens under context parallelism, whole over the
tensor group under sequence parallelism (the column layers gather the sequence before the attention).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, List

from ...nn.attention import GroupedQueryAttention
from ...nn.module import Module, Sequential
from ...nn.transformer import CausalSelfAttention
from ..swap import module_slots
from .record import Composition

__all__ = ["apply", "number_layer_positions", "number_positions", "takes_positions", "whole_sequences"]


def apply(module: Module, c: Composition) -> None:
    """Swap the attention layers and record the context group as every parameter's replica."""
    if not c.cp:
        return
    from ...distributed.placement import add_placement
    c.attention = _swap_attention(module, c) + _gather_whole_sequences(module, c)
    for p in module.parameters():
        add_placement(p, replica=c.grid.context_group)


def _swap_attention(module: Module, c: Composition) -> List[Any]:
    from ..context import ContextParallelAttention
    from ..context.layout import CPAlgo
    from ..tensor import TensorParallelAttention
    g, algo, r = c.grid.context_group, CPAlgo.coerce(c.context), c.rank
    layers = []
    for parent, name, child, qname in module_slots(module):
        if type(child) is GroupedQueryAttention:
            new = _grouped(child, qname, g, algo, r)
        elif type(child) in (CausalSelfAttention, TensorParallelAttention):
            if type(child) is CausalSelfAttention:
                n_embd, n_head, local, drop = child.n_embd, child.n_head, child.n_head, child.attn_dropout.p
            else:
                n_embd, n_head, local, drop = child.embed_dim, child.num_heads, child.local_heads, child.attn_dropout.p
            _no_dropout(qname, drop, r)
            if algo is CPAlgo.ULYSSES and local % g.size:
                raise ValueError(f"rank {r}: Ulysses splits {qname!r}'s {local} heads on this rank (of {n_head}) "
                                 f"over the {g.size} context ranks; {local} is not divisible by {g.size} (use ring, "
                                 "or heads that divide by tensor x context)")
            new = ContextParallelAttention(n_embd, n_head, group=g, algo=algo, dropout=child.resid_dropout.p,
                                           bias=child.qkv.bias is not None)
            new.qkv, new.proj = child.qkv, child.proj
        else:
            continue
        setattr(parent, name, new)
        layers.append(new)
    if not layers and not c.model_plan.whole_sequence:
        raise ValueError(f"rank {r}: context_parallel={algo.value!r} found no nn.CausalSelfAttention or "
                         "nn.GroupedQueryAttention in the model, and the model plan declares no whole_sequence "
                         "module (a token-mixing module of the user's own)")
    return layers


class _WholeSequenceState:
    """What :func:`whole_sequences` and ``pm.local_tokens`` set on every context-parallel layer, for the declared
    whole-sequence modules: whether context parallelism is on, and the whole sequence's length."""

    def __init__(self):
        self.context_enabled, self.seq_len = True, None


def _gather_whole_sequences(module: Module, c: Composition) -> List[Any]:
    """[Note: a declared whole-sequence module under context parallelism]  Each module the plan declares
    ``whole_sequence`` (the user's own attention) gets its first argument all-gathered along the sequence over the
    context group and put in sequence order (ring: each rank's chunks ``r`` and ``2P-1-r``), runs on the whole
    sequence, and returns this rank's tokens of its output.  The gather's backward sums the gradients every rank's
    tokens sent back (reduce-scatter: each rank's loss reaches every token through the module); the module's
    parameters' gradients are this rank's loss's, averaged over data x context with every other parameter's."""
    from .regions import describe, whole_sequence_modules
    mods = whole_sequence_modules(module, c)
    if not mods:
        return []
    state = _WholeSequenceState()
    for q, m in mods:
        object.__setattr__(m, "forward", _whole(m.forward, describe(q, m), c, state))
    return [state]


def _whole(forward, what: str, c: Composition, state: _WholeSequenceState):
    import numpy as np
    from ...autograd.tensor import Tensor
    from ..context.layout import ContextLayout, CPAlgo
    from ..tensor import gather_from_sequence_parallel_region
    g, algo, d = c.grid.context_group, CPAlgo.coerce(c.context), int(c.sequence_dim)

    def whole(x, *args, **kwargs):
        if not state.context_enabled:
            return forward(x, *args, **kwargs)
        x = x if isinstance(x, Tensor) else Tensor(x)
        t = int(x.shape[d])
        layout = ContextLayout(int(state.seq_len or t * g.size), g.size, algo)
        if any(layout.local_len(r) != t for r in range(g.size)):
            raise ValueError(f"rank {c.rank}: {what} is declared whole_sequence under context_parallel="
                             f"{algo.value!r}: it gathers every rank's {t} tokens, so the sequence ({layout.seq_len} "
                             f"tokens) must split evenly over the {g.size} context ranks (a multiple of "
                             f"{2 * g.size if algo is CPAlgo.RING else g.size})")
        full = gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=True, dim=d)
        order = np.argsort(np.concatenate([layout.positions(r) for r in range(g.size)]), kind="stable")
        lead = (slice(None),) * d
        y = forward(full[lead + (order,)], *args, **kwargs)
        if not isinstance(y, Tensor) or y.ndim <= d or y.shape[d] != layout.seq_len:
            raise ValueError(f"rank {c.rank}: {what} is declared whole_sequence: it received {layout.seq_len} "
                             f"tokens along dimension {d} and must return one Tensor of the same length there, got "
                             f"{getattr(y, 'shape', type(y).__name__)}")
        return y[lead + (layout.positions(g.rank),)]
    return whole


def _no_dropout(qname: str, drop: float, r: int) -> None:
    if drop:
        raise NotImplementedError(f"rank {r}: {qname!r} has attention dropout {drop}; context parallelism "
                                  "computes attention blockwise and draws no attention-weight mask: use 0")


def _grouped(child: GroupedQueryAttention, qname: str, g, algo, r: int):
    """The context-parallel form of a grouped-query attention, holding its (maybe tensor-parallel) projections."""
    from ..context.gqa import ContextParallelGroupedQueryAttention
    from ..context.layout import CPAlgo
    _no_dropout(qname, child.attn_dropout.p, r)
    if algo is CPAlgo.ULYSSES:
        hd = child.head_dim
        local_q = _out_features(child.q_proj) // hd
        local_kv = _out_features(child.k_proj) // hd
        if local_q % g.size or (local_kv % g.size and g.size % local_kv):
            raise ValueError(f"rank {r}: Ulysses splits {qname!r}'s {local_q} query heads and {local_kv} key/value "
                             f"heads on this rank (of {child.n_head} and {child.n_kv_head}) over the {g.size} context "
                             f"ranks: the query heads must divide by {g.size}, the key/value heads divide by it or "
                             "divide it (use ring, or heads that divide by tensor x context)")
    new = ContextParallelGroupedQueryAttention(child.n_embd, child.n_head, child.n_kv_head, child.head_dim, group=g,
                                               algo=algo, bias=child.q_proj.bias is not None)
    new.q_proj, new.k_proj, new.v_proj, new.o_proj = child.q_proj, child.k_proj, child.v_proj, child.o_proj
    return new


def _out_features(layer) -> int:
    """The output width this rank computes (a column-parallel layer's local rows)."""
    return int(getattr(layer, "local_out_features", layer.out_features))


def takes_positions(m: Module) -> bool:
    """Whether ``m.forward`` takes ``positions=`` (the protocol a position-numbering module follows)."""
    try:
        return "positions" in inspect.signature(type(m).forward).parameters
    except (TypeError, ValueError):
        return False


def number_positions(m: Module, c: Composition) -> bool:
    """Number the positions of the model ``m`` ([Note: positions]): ``m`` itself when its ``forward`` takes
    ``positions=`` and it sees part of each sequence -- this rank's tokens under context parallelism (``T_local``
    of them), its sequence shard under sequence parallelism when the model declares no region (the model's input
    is scattered before ``m``) -- and, for an ``nn.Sequential``, its layers taking ``positions=`` (the first as the
    input's, the others as the attention's sequence).  Returns whether any was numbered."""
    done = _number(m, c, inner=False)
    if isinstance(m, Sequential):
        done = number_layer_positions(list(m), c, first_is_input=True) or done
    return done


def number_layer_positions(layers, c: Composition, *, first_is_input: bool) -> bool:
    """Number the positions of a model's (or a pipeline chunk's) top-level ``layers`` that take ``positions=``
    ([Note: positions]): the first one as the model's input when ``first_is_input`` (a pipeline's first chunk),
    every other one with the positions of the sequence its attention sees.  Returns whether any was numbered."""
    done = False
    for i, layer in enumerate(layers):
        done = _number(layer, c, inner=not (first_is_input and i == 0)) or done
    return done


def _number(m: Module, c: Composition, *, inner: bool) -> bool:
    sp_cut = c.sp and not c.region_declared and not inner
    whole = c.sp and inner                    # a shard whose attention gathers the sequence over the tensor group
    if not ((c.cp or sp_cut or whole) and takes_positions(m)):
        return False
    forward = m.forward

    def numbered(idx, *args, **kwargs):
        if kwargs.get("positions") is None:
            kwargs["positions"] = _positions(m, c, idx, sp_cut, whole)
        return forward(idx, *args, **kwargs)
    object.__setattr__(m, "forward", numbered)
    return True


def _positions(m: Module, c: Composition, idx, sp_cut: bool, whole: bool = False):
    """The global positions of the ``t`` tokens per sequence ``idx`` holds (``None``: whole sequences, ``0 .. t-1``);
    ``whole``: ``idx`` is a sequence shard and the positions are those of its sequence over the tensor group."""
    import numpy as np
    from ...autograd.tensor import Tensor
    from ..context.layout import ContextLayout, CPAlgo
    t = int(np.shape(idx.data if isinstance(idx, Tensor) else idx)[1])
    tp = c.grid.intra_group
    local = t * tp.size if (sp_cut or whole) else t            # this rank's tokens before the sequence cut
    pos = np.arange(local)
    if c.cp and all(a.context_enabled for a in c.attention):
        g, algo = c.grid.context_group, CPAlgo.coerce(c.context)
        whole_len = c.attention[0].seq_len or local * g.size   # pm.local_batch records the whole length
        pos = np.asarray(ContextLayout(int(whole_len), g.size, algo).positions(g.rank))
        if len(pos) != local:
            raise ValueError(f"rank {c.rank}: {type(m).__name__} got {local} tokens of each sequence, but this rank's "
                             f"share of a {whole_len}-token sequence is {len(pos)}: split the batch with "
                             "pm.local_batch (or pm.local_tokens) first")
    elif not (sp_cut or whole):
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
