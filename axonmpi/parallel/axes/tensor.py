"""Step 1 of the composer: tensor parallelism (a Megatron plan or AxoNN 3-D) and sequence parallelism.

The plan's modules are swapped for column / row / vocab / attention layers holding this rank's shard of the
serial weights (each with its :class:`~axonmpi.distributed.Placement`; ``"column_kv"``: a grouped-query
attention's key/value heads, split or, when fewer than the tensor size, replicated -- [Note: replicated
key/value heads] in ``parallel/tensor/kv.py``); AxoNN swaps every ``nn.Linear`` whose
sizes divide over the grid.  Under sequence parallelism every parameter used on sequence shards (LayerNorms,
row-parallel biases, any replicated layer) records the tensor group as a ``partial`` group of its placement: the
finalize step sums its gradient there ([Note: partial gradients under sequence parallelism]).
"""
from __future__ import annotations

import fnmatch
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...nn import layers as nn_layers
from ...nn.attention import GroupedQueryAttention
from ...nn.layers import Dropout
from ...nn.module import Module
from ...nn.transformer import CausalSelfAttention
from ..swap import hand_over, keep_class, keep_parameters, module_slots
from .record import Composition
from .regions import describe, qualname, whole_sequence_modules

__all__ = ["apply", "STYLES"]

STYLES = ("column", "column_gather", "column_kv", "row", "vocab", "attention")
_TYPES = {"column": nn_layers.Linear, "column_gather": nn_layers.Linear, "column_kv": nn_layers.Linear,
          "row": nn_layers.Linear, "vocab": nn_layers.Embedding, "attention": CausalSelfAttention}


def apply(module: Module, c: Composition) -> None:
    """Swap the tensor-parallel layers in, re-tie shared weights, then lay sequence parallelism over the rest."""
    tied = _tied_slots(module)         # a swap copies weights into new Parameters: ties are re-made after
    mods = dict(module.named_modules())
    shared = [getattr(mods[q], name) for q, name in (slots[0] for slots in tied)]
    c_tied = {id(p) for p in shared}   # kept by the tie, after it is re-made (not by one of its swaps)
    if c.axonn:
        _axonn(module, c, c_tied)
    elif c.megatron:
        if _megatron(module, c, c_tied) == 0:
            raise ValueError(f"rank {c.rank}: no module of the model matches the plan {c.tensor}; names: "
                             f"{[n for n, _ in module.named_modules() if n][:20]}")
    if c.sp:
        _refuse_whole_sequence_layers(module, c)
        _enter_declared_region(module, c)
        _gather_whole_sequences(module, c)
    _retie(module, tied, c.rank, shared)
    if c.sp:
        c.partial = _sequence_parallel(module, c)


def _refuse_whole_sequence_layers(module: Module, c: Composition) -> None:
    """Under sequence parallelism each rank runs the region on its tokens: an attention the plan leaves whole
    would attend within this rank's tokens only.  Refused, naming it and the fix."""
    whole = [q for q, _ in whole_sequence_modules(module, c)]
    for q, m in module.named_modules():
        if any(q == w or q.startswith(w + ".") for w in whole):
            continue                        # declared: sees whole sequences
        if type(m) is GroupedQueryAttention and type(m.q_proj) is nn_layers.Linear:
            raise ValueError(
                f"rank {c.rank}: sequence_parallel=True runs {q!r} ({m.n_head} query heads) on this rank's tokens of "
                f"each sequence, but its projections are not in the tensor-parallel plan, so it would attend within "
                f"them only: make q_proj 'column', k_proj / v_proj 'column_kv' and o_proj 'row' (the query heads "
                f"must divide by the tensor size, {c.grid.intra_group.size}) or drop sequence_parallel")
        if type(m) is CausalSelfAttention:
            raise ValueError(
                f"rank {c.rank}: sequence_parallel=True runs {q!r} ({m.n_head} heads) on this rank's tokens of each "
                f"sequence, but it is not in the tensor-parallel plan, so it would attend within them only: add it as "
                f"'attention' (its heads must divide by the tensor size, {c.grid.intra_group.size}) or drop "
                "sequence_parallel")


def copy_serial(new: Module, old: Module, adopted: Optional[set] = None) -> None:
    """Load the serial layer's weights into its tensor-parallel replacement (each rank keeps its shard), which
    then holds the serial Parameter objects (:func:`~axonmpi.parallel.swap.keep_parameters`; ``adopted``: the ids
    kept so far in this transform); a :class:`~axonmpi.parallel.pipeline.LayerBuilder`'s stand-in (another
    pipeline rank's layer) stays one."""
    from ..pipeline.staged import is_stand_in, stand_in
    from ..tensor.state import load_full_state_dict
    if any(is_stand_in(p) for p in old.parameters()):
        stand_in(new)
        return
    load_full_state_dict(new, {k: np.asarray(v) for k, v in old.state_dict().items()})
    frozen = {n for n, p in old.named_parameters() if not p.requires_grad}
    for n, p in new.named_parameters():          # a frozen parameter stays frozen in its replacement
        if n in frozen:
            p.requires_grad = False
    keep_parameters(new, old, set() if adopted is None else adopted)
    if isinstance(old, (nn_layers.Linear, nn_layers.Embedding)):    # still an nn.Linear / nn.Embedding
        keep_class(new, old)
    subs = dict(new.named_modules())
    for name, sub in old.named_modules():       # an attention's qkv / proj: still nn.Linear (minGPT's groups)
        if name and name in subs and isinstance(sub, (nn_layers.Linear, nn_layers.Embedding)):
            keep_class(subs[name], sub)


def _users(module: Module) -> Dict[int, int]:
    users: Dict[int, int] = {}
    for m in module.modules():
        for q in m._parameters.values():
            if q is not None:
                users[id(q)] = users.get(id(q), 0) + 1
    return users


def _axonn(module: Module, c: Composition, tied_ids=()) -> int:
    """Every ``nn.Linear`` whose sizes divide over the grid (AxoNN's ``is_parallelizable_linear``) -> a 3-D
    ``intra_layer.Linear`` (easy mode); the others stay replicated, and so does a Linear whose weight another
    module shares (a head tied to the embedding: one Parameter, so its gradient keeps both uses)."""
    from ..auto_parallelize import is_parallelizable_linear
    from ..intra_layer import Linear as Linear3D
    from ..tensor.groups import TensorParallelGroups
    groups = TensorParallelGroups.from_grid(c.grid)
    users, n, adopted = _users(module), 0, set(tied_ids)
    for parent, name, child, _ in module_slots(module):
        if (type(child) is nn_layers.Linear and users.get(id(child.weight), 0) == 1
                and is_parallelizable_linear(child.in_features, child.out_features, groups.sizes)):
            new = Linear3D(child.in_features, child.out_features, bias=child.bias is not None,
                           dtype=child.weight.dtype, groups=groups)
            copy_serial(new, child, adopted)
            setattr(parent, name, new)
            n += 1
    return n


def _style_of(plan: Dict[str, str], qname: str):
    return next((s for pat, s in plan.items() if fnmatch.fnmatchcase(qname, pat)), None)


def _check_plan(module: Module, c: Composition) -> None:
    for pattern, style in c.tensor.items():
        if style not in STYLES:
            raise ValueError(f"rank {c.rank}: tensor_parallel[{pattern!r}] = {style!r}; expected one of {STYLES}")
    for parent, name, child, qname in module_slots(module):
        style = _style_of(c.tensor, qname)
        if style is not None and type(child) is not _TYPES[style]:
            raise TypeError(f"rank {c.rank}: {describe(qname, child)} matches the tensor-parallel plan's {style!r} "
                            f"pattern, which takes an nn.{_TYPES[style].__name__} ({qualname(_TYPES[style])}); "
                            f"{_style_fix(style)}")
        if style == "column_kv" and not (isinstance(parent, GroupedQueryAttention) and name in ("k_proj", "v_proj")):
            raise TypeError(f"rank {c.rank}: {qname!r} matches a 'column_kv' pattern, which splits the key/value heads "
                            f"of an nn.GroupedQueryAttention (its k_proj / v_proj); it is a {type(parent).__name__}'s "
                            f"{name!r}: use 'column'")


def _style_fix(style: str) -> str:
    if style == "attention":
        return ("name its own projections instead ('column' for the query/key/value layer, 'row' for the output "
                "one, if its code reads its head count from their widths), or leave it out of the plan; under "
                "sequence parallelism declare it ModelPlan(whole_sequence=(...,)) (docs/parallelize.md)")
    return f"match only nn.{_TYPES[style].__name__} modules with this pattern"


def _megatron(module: Module, c: Composition, tied_ids=()) -> int:
    """The modules the plan names -> Megatron column / row / vocab-parallel / head-split attention layers over
    the grid's tensor group; ``"column_gather"``: a column layer whose output is all-gathered (the serial width;
    under sequence parallelism cut back to this rank's sequence shard, unless it is the declared region's
    ``leave``).  A ``"column"`` layer whose output reaches the model's output unpaired raises at the first
    forward ([Note: the output keeps the serial shape] in ``split_output.py``)."""
    from ..split_output import refuse_split_outputs
    _check_plan(module, c)
    group, region = c.grid.intra_group, c.model_plan.sequence_region if c.sp else None
    whole = [q for q, _ in whole_sequence_modules(module, c)] if c.sp else []
    columns, rows, n, kv_groups, adopted = {}, [], 0, {}, set(tied_ids)
    for parent, name, child, qname in module_slots(module):
        style = _style_of(c.tensor, qname)
        if style is None:
            continue
        outside = (region is not None and any(fnmatch.fnmatchcase(qname, p) for p in region.outside)) or \
            any(qname == w or qname.startswith(w + ".") for w in whole)
        try:
            if style == "column_kv":
                new = _kv_layer(parent, child, c, kv_groups, outside=outside)
            else:
                new = _layer(child, style, c, whole_out=region is not None and qname == region.leave, outside=outside)
        except ValueError as e:             # a size the tensor group cannot split: name the layer (issue 48 item 8)
            raise ValueError(f"{e} (layer {qname!r}, a {type(child).__module__}.{type(child).__qualname__} made "
                             f"{style!r}: change its size, e.g. pad a vocabulary to a multiple of {group.size}, or "
                             "leave it out of the tensor-parallel plan)") from e
        if style in ("column", "column_kv"):
            columns[qname] = new
        if style in ("row", "vocab", "attention"):      # outputs whole over the tensor group
            rows.append(new)
        copy_serial(new, child, adopted)
        setattr(parent, name, new)
        n += 1
    refuse_split_outputs(module, columns, rows, group)
    return n


def _layer(child: Module, style: str, c: Composition, *, whole_out: bool, outside: bool) -> Module:
    """The tensor-parallel layer of ``style`` for ``child`` (not yet holding its weights)."""
    from ..tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention, VocabParallelEmbedding,
                          scatter_to_sequence_parallel_region)
    group = c.grid.intra_group
    sp = int(c.sequence_dim) if c.sequence_parallel else None
    seq = {} if sp is None or outside else {"sequence_parallel": True, "sequence_dim": sp}
    if style == "attention":
        return TensorParallelAttention(child.n_embd, child.n_head, group=group, causal=True,
                                       dropout=child.attn_dropout.p, bias=child.qkv.bias is not None,
                                       dtype=child.qkv.weight.dtype, sequence_parallel=sp is not None,
                                       partial_grads=True)
    if style == "vocab":
        return VocabParallelEmbedding(child.num_embeddings, child.embedding_dim, group=group,
                                      dtype=child.weight.dtype, padding_idx=getattr(child, "padding_idx", None),
                                      **seq)
    if style == "row":
        return RowParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                 input_is_parallel=True, group=group, dtype=child.weight.dtype, partial_grads=True,
                                 **seq)
    new = ColumnParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                               gather_output=style == "column_gather", group=group, dtype=child.weight.dtype, **seq)
    if style == "column_gather" and sp is not None and not whole_out:
        # gathered over features: back to this rank's sequence shard (the region goes on after it)
        new.register_forward_hook(lambda m, a, y, d=sp: scatter_to_sequence_parallel_region(y, group, dim=d))
    return new


def _kv_layer(attn: GroupedQueryAttention, child: Module, c: Composition, kv_groups, *, outside: bool) -> Module:
    """``"column_kv"``: a grouped-query attention's ``k_proj`` / ``v_proj`` over the tensor group, its key/value heads
    split when the tensor size divides them, else each rank's head replicated over the ranks that share it
    (:class:`~axonmpi.parallel.tensor.ColumnParallelKVLinear`, [Note: replicated key/value heads]); one pair of
    groups per head count for the whole model (``kv_groups``, filled here)."""
    from ..tensor import ColumnParallelKVLinear, kv_head_groups
    group, heads = c.grid.intra_group, attn.n_kv_head
    p = group.size
    if attn.n_head % p:
        raise ValueError(f"rank {c.rank}: tensor parallelism splits {attn.n_head} query heads over {p} ranks; "
                         f"{attn.n_head} is not divisible by {p}: use a tensor size that divides n_head")
    shared = None
    if heads < p and p % heads == 0:
        if heads not in kv_groups:
            kv_groups[heads] = kv_head_groups(group, heads)
        shared = kv_groups[heads]
    sp = c.sequence_parallel and not outside
    seq = {"sequence_parallel": True, "sequence_dim": int(c.sequence_dim)} if sp else {}
    return ColumnParallelKVLinear(child.in_features, heads, attn.head_dim, bias=child.bias is not None, group=group,
                                  dtype=child.weight.dtype, kv_groups=shared, **seq)


def _tied_slots(module: Module) -> List[List[Tuple[str, str]]]:
    """The parameters held by more than one module (a head tied to its embedding), each as its
    ``[(module name, attribute), ...]``."""
    slots: Dict[int, List[Tuple[str, str]]] = {}
    for q, m in module.named_modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((q, name))
    return [v for v in slots.values() if len(v) > 1]


def _retie(module: Module, tied, r: int, serial=None) -> None:
    """A weight the plan's layers hold twice (a ``"vocab"`` embedding and its ``"column_gather"`` head, both this
    rank's vocabulary rows) is one Parameter again (Megatron's tied embedding); a tie between a split and a
    replicated use raises, naming both."""
    from ...distributed.placement import placement_of
    mods = dict(module.named_modules())
    for slots in tied:
        params = [getattr(mods[q], name) for q, name in slots]
        first = params[0]
        if all(p is first for p in params):
            continue
        shards = [tuple((s.kind, getattr(s, "dim", None)) for s in placement_of(p).shards) for p in params]
        if any(tuple(p.data.shape) != tuple(first.data.shape) or sh != shards[0] for p, sh in zip(params, shards)):
            names = [f"{q}.{name}" if q else name for q, name in slots]
            raise ValueError(f"rank {r}: {names} are one tied weight but the tensor-parallel plan lays them out "
                             f"differently (local shapes {[tuple(p.data.shape) for p in params]}): split both the same "
                             "way (an embedding 'vocab' and its head 'column_gather') or neither")
        for (q, name), p in zip(slots[1:], params[1:]):
            setattr(mods[q], name, first)
    for slots, w in zip(tied, serial or ()):     # the serial object takes the tied one's place
        p = getattr(mods[slots[0][0]], slots[0][1])
        if p is not w and all(getattr(mods[q], name) is p for q, name in slots):
            hand_over(p, w)
            for q, name in slots:
                setattr(mods[q], name, w)


def _enter_declared_region(module: Module, c: Composition) -> None:
    """A model that declares its sequence region (:class:`~axonmpi.parallel.plan.SequenceRegion`) enters it at
    ``enter`` (a dropout swapped for a scatter-then-dropout; any other module's output scattered) and leaves it at
    ``leave``, a gathered column layer."""
    region = c.model_plan.sequence_region
    if region is None:
        return
    from ..tensor import ColumnParallelLinear, SequenceParallelDropout
    mods = dict(module.named_modules())
    for what, name in (("enter", region.enter), ("leave", region.leave)):
        if name not in mods:
            raise ValueError(f"rank {c.rank}: the model plan's sequence region {what}s at {name!r}, which is not "
                             f"a module of the model (names: {[n for n in mods if n][:12]})")
    leave = mods[region.leave]
    if not (isinstance(leave, ColumnParallelLinear) and leave.gather_output):
        raise ValueError(f"rank {c.rank}: sequence parallelism leaves the region at {region.leave!r}: make it "
                         f"'column_gather' in the tensor-parallel plan (it is a {type(leave).__name__}; a tied head "
                         "with a 'vocab' embedding: split both)")
    old = mods[region.enter]
    if isinstance(old, Dropout):           # the embedding dropout: scatter, then its dropout on the shard
        new = SequenceParallelDropout(getattr(old, "p", 0.0), c.grid.intra_group)
        parent, _, attr = region.enter.rpartition(".")
        setattr(mods[parent] if parent else module, attr, new)
    else:                                   # any other module (an embedding): its output scattered
        from ..tensor import scatter_to_sequence_parallel_region
        g, d = c.grid.intra_group, int(c.sequence_dim)
        old.register_forward_hook(lambda m, a, y: scatter_to_sequence_parallel_region(y, g, dim=d))
        new = old
    c.enter, c.leave = new, leave


def _gather_whole_sequences(module: Module, c: Composition) -> None:
    """[Note: a declared whole-sequence module]  Each module the plan declares ``whole_sequence`` (a user's own
    attention) gets its first argument gathered along the sequence over the tensor group (in order: the
    sequence-parallel shards are contiguous) and returns this rank's shard of its output.  Every tensor rank runs
    it on the same whole sequence, so the gradient reaching its output is whole there (the all-gather of the
    shards' gradients) and its input's is split back (the gather's backward splits); its parameters' gradients
    are whole on every tensor rank: left out of the partial sums (:func:`_outside`)."""
    from ..tensor import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
    g, d = c.grid.intra_group, int(c.sequence_dim)
    for q, m in whole_sequence_modules(module, c):
        forward = m.forward

        def whole(x, *args, _forward=forward, _q=q, **kwargs):
            from ...autograd.tensor import Tensor
            full = gather_from_sequence_parallel_region(x if isinstance(x, Tensor) else Tensor(x), g,
                                                        tensor_parallel_output_grad=False, dim=d)
            y = _forward(full, *args, **kwargs)
            if not isinstance(y, Tensor) or y.ndim <= d or y.shape[d] != full.shape[d]:
                raise ValueError(f"rank {c.rank}: {describe(_q, m)} is declared whole_sequence: it received "
                                 f"{full.shape[d]} tokens along dimension {d} and must return one Tensor of the "
                                 f"same length there, got {getattr(y, 'shape', type(y).__name__)}")
            return scatter_to_sequence_parallel_region(y, g, dim=d)
        object.__setattr__(m, "forward", whole)


def _outside(module: Module, c: Composition) -> List[Module]:
    """The modules run on whole sequences: a declared sequence region's ``outside`` (before it) and the modules the
    plan declares ``whole_sequence`` (gathered for them)."""
    region = c.model_plan.sequence_region
    out = [m for _, m in whole_sequence_modules(module, c)]
    return out if region is None else out + [m for q, m in module.named_modules()
                                             if any(fnmatch.fnmatchcase(q, p) for p in region.outside)]


def _sequence_parallel(module: Module, c: Composition) -> List[object]:
    """[Note: partial gradients under sequence parallelism]  Each rank runs the region on its tokens, so a
    parameter not split over the tensor group (a LayerNorm's, a row layer's bias, any replicated layer's) gets
    this rank's part of its gradient: it records the tensor group as ``partial`` in its placement and is
    returned, and the finalize step sums them all there, bucketed (one collective per bucket, not one per
    parameter).  The declared region's ``outside`` modules run on whole sequences: left as they are."""
    from ...distributed.placement import add_placement, placement_of
    g = c.grid.intra_group
    skip = {id(q) for m in _outside(module, c) for q in m.parameters()}
    rest = []
    inside = set(g.ranks)
    for p in module.parameters():      # replicated, or split over another group (experts over the expert group)
        pl = placement_of(p)
        # a parameter cut over the tensor group or a part of it (replicated key/value heads: a tensor-parallel layer
        # that gathers the sequence, with its own partial groups) is the layer's
        if id(p) in skip or any(s.group is g or getattr(s.group, "ranks", None) == g.ranks
                                or (getattr(s.group, "size", 1) > 1 and set(s.group.ranks) <= inside)
                                for s in pl.shards) or getattr(p, "sequence_parallel", False):
            continue
        add_placement(p, replica=g, partial=g)
        rest.append(p)
    return rest
