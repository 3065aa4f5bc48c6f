"""Megatron-style 1-D tensor-parallel layers: column/row-parallel Linear, vocab-parallel embedding
and cross-entropy, an MLP block and multi-head attention with heads split over the group.

Weights keep the serial (PyTorch) names and are cut from the serial shapes: a column-parallel
``weight`` (out, in) keeps rows ``[r*out/p, (r+1)*out/p)``, a row-parallel one keeps columns
``[r*in/p, (r+1)*in/p)``; ``load_state_dict`` takes either the full or the sharded arrays and
``state_dict(full=True)`` gathers.  Every size that is split must divide by the group size.

[Note: sequence parallelism]  Megatron's sequence parallelism (``sequence_parallel=True``): outside
the matmuls (LayerNorm, dropout, residual adds) the activations are split along the sequence over
the tensor group, so they take ``1/p`` of the bytes.  A column-parallel layer all-gathers its input
along the sequence (backward: reduce-scatter of the input gradient) where it would copy it; a
row-parallel one reduce-scatters its partial output along the sequence where it would all-reduce it
(backward: all-gather).  The same bytes as the all-reduce they replace (a ring all-reduce *is* a
reduce-scatter then an all-gather).  Parameters used on sequence shards (LayerNorm weight and bias,
a row-parallel bias) get partial gradients on each tensor rank: they take them through
``copy_to_tensor_parallel_region`` (identity forward, all-reduce over the tensor group backward),
so their ``.grad`` is the full gradient before any data-parallel reduction sees it, and they are
tagged ``sequence_parallel = True`` (Megatron's attribute) with a placement replicated over the group.
"""
from __future__ import annotations
from ...distributed.placement import Cut, Placement, Shard, ShardKind, set_placement

import math
from typing import Callable, Optional

import numpy as np

from ...autograd import ops, ops_nn
from ...autograd.function import Function
from ...autograd.ops_nn import _check_targets
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...distributed import ProcessGroup, ReduceOp, all_gather, all_reduce
from ...nn import Dropout, GELU, LayerNorm, init
from ...nn.parameter import Parameter
from .groups import one_d_group
from .mappings import (
    copy_to_tensor_parallel_region, divide, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region,
)
from .. import placed
from .state import _TensorParallelModule, init_full

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "SequenceParallelLayerNorm", "TensorParallelAttention", "TensorParallelMLP",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
]


def _kaiming(w):
    return init.kaiming_uniform_(w, a=math.sqrt(5))


def _bias_init(in_features):
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    return lambda b: init.uniform_(b, -bound, bound)


def _replicate(p: Parameter, group: ProcessGroup) -> None:
    """Record the placement of a whole parameter held identically by every rank of ``group``."""
    set_placement(p, Placement(replicas=(group,), full_shape=tuple(p.shape)))


def _split(full, group: ProcessGroup, dim: int, parts: int = 1) -> Parameter:
    """A parameter holding this rank's piece of ``full`` (cut along ``dim`` over ``group``; with ``parts``, each
    of ``parts`` equal pieces of the dim cut so), its placement recorded: the dim, the cut, the serial shape."""
    pl = Placement(shards=(Shard(group, ShardKind.DIM, dim),), full_shape=tuple(full.shape),
                   cuts=(Cut(group, dim, parts),))
    return set_placement(Parameter(placed.cut(full, pl)), pl)


def _tag_sequence_parallel(p: Parameter, group: ProcessGroup) -> None:
    """``p`` is used on sequence shards: replicated over ``group``, gradient summed over it in backward."""
    _replicate(p, group)
    p.sequence_parallel = True


def _sp_param(p: Optional[Parameter], group: ProcessGroup):
    """``p`` as used on this rank's sequence shard: backward all-reduces its gradient over ``group``."""
    return None if p is None else copy_to_tensor_parallel_region(p, group)


class SequenceParallelLayerNorm(LayerNorm):
    """:class:`~axonmpi.nn.LayerNorm` on sequence shards: same names and values, weight and bias gradients
    all-reduced over ``group`` in backward (each rank normalises its own tokens).

    Example:
        >>> ln = SequenceParallelLayerNorm(64, group=tp, dtype="float64")
        >>> y_seq = ln(x_seq)                        # (b, s / p, 64)
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 group: Optional[ProcessGroup] = None, dtype=None, device=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias=bias, dtype=dtype, device=device)
        self.group = one_d_group(group)
        for p in (self.weight, self.bias):
            if p is not None:
                _tag_sequence_parallel(p, self.group)

    def forward(self, x: Tensor) -> Tensor:
        return ops_nn.LayerNorm.apply(x, _sp_param(self.weight, self.group), _sp_param(self.bias, self.group),
                                      len(self.normalized_shape), self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sequence parallel over group size={self.group.size}"


class _AxisSharded(_TensorParallelModule):
    """Parameters cut along one dim each over ``self.group`` (their placements say which; see ``_split``)."""

    def _tp_init_groups(self):
        return [self.group]


class ColumnParallelLinear(_AxisSharded):
    """``y = x @ W.T + b`` with ``W`` (out, in) split by rows (output features) over ``group``.

    Args:
        in_features, out_features: the full (serial) sizes; ``out_features`` must divide by the group size.
        bias: add a bias (split like the output).
        gather_output: all-gather the output to (..., out); otherwise each rank returns (..., out/p).
        group: the tensor-parallel group (default: the current grid's ``intra_group``).
        init_method: initializer of the full weight (default: PyTorch's kaiming-uniform a=sqrt(5)).
        dtype: parameter dtype (default float32).
        sequence_parallel: the input is this rank's sequence shard: all-gather it along
            ``sequence_dim`` (backward: reduce-scatter) instead of copying it (see the module's
            note).  The sequence length must divide by the group size.
        sequence_dim: the sequence dimension of the input (default -2: ``(b, s, h)`` or ``(s, h)``).

    Example:
        >>> fc = ColumnParallelLinear(16, 32, group=tp, dtype="float64")   # weight (32/p, 16)
        >>> h = fc(x)                                                       # (..., 32/p)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: Optional[ProcessGroup] = None, init_method: Optional[Callable] = None, dtype=None, *,
                 sequence_parallel: bool = False, sequence_dim: int = -2):
        super().__init__()
        self.group = one_d_group(group)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.gather_output = bool(gather_output)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        local_out = divide(self.out_features, self.group, "out_features")
        full = init_full((self.out_features, self.in_features), dtype, init_method or _kaiming, [self.group])
        self.weight = _split(full, self.group, 0)
        if bias:
            fb = init_full((self.out_features,), dtype, _bias_init(self.in_features), [self.group])
            self.bias = _split(fb, self.group, 0)
        else:
            self.register_parameter("bias", None)
        self.local_out_features = local_out

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group, dim=self.sequence_dim)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        y = ops_nn.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.local_out_features}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, group size={self.group.size}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class RowParallelLinear(_AxisSharded):
    """``y = x @ W.T + b`` with ``W`` (out, in) split by columns (input features) over ``group``.

    Each rank multiplies its input slice (..., in/p) and the partial sums are all-reduced; the
    bias is replicated and added once after the reduction.

    Args:
        in_features, out_features: the full sizes; ``in_features`` must divide by the group size.
        bias: add a (replicated) bias.
        input_is_parallel: the input is already split (..., in/p), e.g. a column-parallel output;
            otherwise the full input is given and each rank keeps its slice.
        group: the tensor-parallel group (default: the current grid's ``intra_group``).
        dtype: parameter dtype.
        init_method: initializer of the full weight (keyword only).
        sequence_parallel: reduce-scatter the partial output along ``sequence_dim`` (each rank
            keeps its sequence shard; backward: all-gather) instead of all-reducing it; the bias is
            added on the shard and its gradient all-reduced over the group (see the module's note).
        sequence_dim: the sequence dimension of the output (default -2).
        partial_grads: under ``sequence_parallel`` leave the bias's gradient this rank's part (its placement
            ``partial`` over the group) for the owner's finalize step to sum, bucketed with the others
            (``parallelize`` does); default: summed over the group in backward, by the layer.

    Example:
        >>> proj = RowParallelLinear(32, 16, group=tp)
        >>> y = proj(fc(x))                       # (..., 16), identical on every rank
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: Optional[ProcessGroup] = None, dtype=None, *, init_method: Optional[Callable] = None,
                 sequence_parallel: bool = False, sequence_dim: int = -2, partial_grads: bool = False):
        super().__init__()
        self.group = one_d_group(group)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.input_is_parallel = bool(input_is_parallel)
        self.partial_grads = bool(partial_grads)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        if self.sequence_parallel and not self.input_is_parallel:
            raise ValueError(f"rank {self.group.world.rank}: RowParallelLinear(sequence_parallel=True) needs "
                             "input_is_parallel=True (the input of a column-parallel layer)")
        self.local_in_features = divide(self.in_features, self.group, "in_features")
        full = init_full((self.out_features, self.in_features), dtype, init_method or _kaiming, [self.group])
        self.weight = _split(full, self.group, 1)
        if bias:
            self.bias = Parameter(init_full((self.out_features,), dtype, _bias_init(self.in_features),
                                            [self.group]))
            if self.sequence_parallel and not self.partial_grads:
                _tag_sequence_parallel(self.bias, self.group)
            else:
                _replicate(self.bias, self.group)     # partial_grads: the owner's finalize step sums it
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(ops_nn.linear(x, self.weight), self.group,
                                                           dim=self.sequence_dim)
            if self.bias is None:
                return y
            return y + (self.bias if self.partial_grads else _sp_param(self.bias, self.group))
        y = reduce_from_tensor_parallel_region(ops_nn.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.local_in_features}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, group size={self.group.size}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class _MaskRows(Function):
    """``x * keep[..., None]`` with the (constant) row mask ``keep``."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep[..., None].astype(x.dtype)
        return x * ctx.keep

    @staticmethod
    def backward(ctx, g):
        return g * ctx.keep, None


class VocabParallelEmbedding(_AxisSharded):
    """An embedding table (num_embeddings, embedding_dim) split by rows (vocabulary) over ``group``.

    Rank ``r`` owns ids ``[r*V/p, (r+1)*V/p)``; ids elsewhere give zero rows there, and the
    all-reduce over the group completes every lookup.  ``padding_idx`` (a global id) is as in
    :class:`~axonmpi.nn.Embedding`: its row starts at zero and receives no gradient on the rank
    that owns it.

    ``sequence_parallel=True``: the ids are this rank's sequence shard (dimension ``sequence_dim`` of the
    output; the ids' own when it is not negative); they are all-gathered over the group, every rank looks up
    its vocabulary rows for the whole sequences, and the partial rows are reduce-scattered back to this
    rank's shard (Megatron's ``VocabParallelEmbedding`` with ``sequence_parallel``; backward: all-gather).

    Example:
        >>> emb = VocabParallelEmbedding(1000, 64, group=tp)
        >>> h = emb(ids)                                   # (..., 64), identical on every rank
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Optional[ProcessGroup] = None,
                 init_method: Optional[Callable] = None, dtype=None, padding_idx: Optional[int] = None, *,
                 sequence_parallel: bool = False, sequence_dim: int = -2):
        super().__init__()
        self.group = one_d_group(group)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        if self.sequence_parallel and self.sequence_dim == -1:
            raise ValueError(f"rank {self.group.world.rank}: VocabParallelEmbedding sequence_dim=-1 is the embedding "
                             "dimension of the output; pass the sequence dimension (-2 for (b, s, h))")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= int(padding_idx) < self.num_embeddings:
                raise ValueError(f"rank {self.group.world.rank}: VocabParallelEmbedding padding_idx={padding_idx} "
                                 f"must be within [-{self.num_embeddings}, {self.num_embeddings})")
            padding_idx = int(padding_idx) % self.num_embeddings
        self.padding_idx = padding_idx
        local = divide(self.num_embeddings, self.group, "num_embeddings")
        self.vocab_start, self.vocab_end = self.group.rank * local, (self.group.rank + 1) * local
        owned = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding = padding_idx - self.vocab_start if owned else None
        full = init_full((self.num_embeddings, self.embedding_dim), dtype, init_method or init.normal_, [self.group])
        if padding_idx is not None:
            full[padding_idx] = 0
        self.weight = _split(full, self.group, 0)

    def forward(self, idx) -> Tensor:
        idx = idx.data if isinstance(idx, Tensor) else idx
        if idx.dtype.kind not in "iu":
            raise TypeError(f"embedding indices must be integers, got dtype {idx.dtype}")
        if self.group.size == 1:
            return ops_nn.embedding(idx, self.weight, self.padding_idx)
        d = self.sequence_dim
        if self.sequence_parallel:        # the ids of the whole sequences (integers: no gradient)
            idx = gather_from_sequence_parallel_region(Tensor(idx), self.group, dim=d if d >= 0 else d + 1).data
        xp = get_array_module(idx)
        keep = (idx >= self.vocab_start) & (idx < self.vocab_end)
        local = xp.where(keep, idx - self.vocab_start, 0)
        h = _MaskRows.apply(ops_nn.embedding(local, self.weight, self._local_padding), keep)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(h, self.group, dim=d)
        return reduce_from_tensor_parallel_region(h, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, vocab [{self.vocab_start}, {self.vocab_end}) "
                f"on this rank, group size={self.group.size}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, group, reduction, ignore_index=-100, label_smoothing=0.0):
        xp = get_array_module(logits)
        v = logits.shape[-1]
        z = logits.reshape(-1, v)
        t = targets.reshape(-1)
        m = z.max(axis=1) if z.shape[0] else xp.zeros(0, z.dtype)
        if group.size > 1:  # the row maxima, and the widths (max v, max -v) to refuse uneven shards
            both = all_reduce(xp.concatenate([m, xp.asarray([v, -v], dtype=m.dtype)]), op=ReduceOp.MAX,
                              group=group)
            m, widest, narrowest = both[:-2], int(both[-2]), -int(both[-1])
            if widest != narrowest:
                raise ValueError(
                    f"rank {group.world.rank}: vocab_parallel_cross_entropy needs equal vocabulary shards, "
                    f"got widths from {narrowest} to {widest} over the group (this rank: {v}); pad the "
                    f"vocabulary to a multiple of the group size {group.size} (Megatron's "
                    "make-vocab-size-divisible-by)")
        vocab = v * group.size
        bad = None
        if ops_nn.checks_on_device(xp):  # no host read: an out-of-range target gives a NaN loss (as cross_entropy)
            bad = ((t < 0) | (t >= vocab)) & (t != ignore_index)
        else:
            _check_targets(t, vocab, ignore_index, "vocab_parallel_cross_entropy", f"rank {group.world.rank}: ")
        start = group.rank * v
        valid = t != ignore_index
        z = z - m[:, None]
        mine = (t >= start) & (t < start + v)
        rows = xp.arange(z.shape[0])
        zt = z[rows, xp.where(mine, t - start, 0)] * mine
        eps = float(label_smoothing)
        parts = [None, zt] + ([z.sum(axis=1)] if eps else [])
        xp.exp(z, out=z)
        parts[0] = z.sum(axis=1)
        sums = xp.stack(parts)
        if group.size > 1:
            sums = all_reduce(sums, group=group)
        s, zt = sums[0], sums[1]
        lse = xp.log(s)
        loss = lse - zt
        if eps:  # torch: (1-e) * nll + e/V * sum_c -log p_c, with sum_c -log p_c = V lse - sum_c z_c
            loss = (1.0 - eps) * loss + (eps / vocab) * (vocab * lse - sums[2])
        loss = loss * valid
        if bad is not None:             # such a target is in no rank's shard: only its loss needs marking
            loss = xp.where(bad, xp.asarray(np.nan, loss.dtype), loss)
        z /= s[:, None]
        ctx.save_for_backward(z, t - start, mine & valid, valid)
        ctx.reduction, ctx.shape, ctx.eps, ctx.vocab = reduction, logits.shape, eps, vocab
        if reduction == "none":
            return loss.reshape(targets.shape)
        total = loss.sum()
        if reduction == "sum":
            return total
        if bad is not None:             # the count stays an array: every target ignored gives 0/0 = NaN, as torch's
            count = valid.sum().astype(total.dtype)
            ctx.count = xp.maximum(count, 1)
            return total / xp.where(count == 0, xp.asarray(np.nan, total.dtype), count)
        ctx.count = int(valid.sum())
        if not ctx.count:  # every target ignored: NaN, as torch's 0/0
            return xp.full((), xp.nan, dtype=total.dtype)
        return total / ctx.count

    @staticmethod
    def backward(ctx, g):
        p, tl, hit, valid = ctx.saved_tensors
        xp = get_array_module(p)
        gx = p * valid[:, None]
        if xp is np and not ops_nn.checks_on_device(xp):
            rows = xp.arange(p.shape[0])[hit]
            gx[rows, tl[hit]] -= 1.0 - ctx.eps
        else:                           # no data-dependent shape (a host read on a GPU): every row, 0 where missed
            rows = xp.arange(p.shape[0])
            gx[rows, xp.where(hit, tl, 0)] -= (1.0 - ctx.eps) * hit.astype(gx.dtype)
        if ctx.eps:
            gx -= (ctx.eps / ctx.vocab) * valid[:, None]
        if ctx.reduction == "none":
            gx *= g.reshape(-1, 1)
        else:
            gx *= g if ctx.reduction == "sum" else g / (max(ctx.count, 1) if isinstance(ctx.count, int) else ctx.count)
        return gx.reshape(ctx.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, targets, group: Optional[ProcessGroup] = None, *,
                                 reduction: str = "mean", ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy of logits split over the vocabulary (last dim) without gathering them.

    Two small all-reduces over ``group``: the row maxima (with the shard widths, which must be
    equal), then the sums of exponentials and the target logits together; the backward is
    local (softmax shard minus the one-hot shard).  Matches :func:`~axonmpi.nn.functional.cross_entropy`
    on the gathered logits: ``ignore_index`` targets count nowhere and ``"mean"`` divides by the
    number of the others; a target outside ``[0, V)`` raises ``IndexError``.

    Args:
        logits_shard: (..., V/p), this rank's vocabulary slice ``[r*V/p, (r+1)*V/p)``.
        targets: integer class ids (...), the same on every rank.
        group: the tensor-parallel group the vocabulary is split over (default: the current
            grid's ``intra_group``).
        reduction: "mean" (default), "sum" or "none" (per-token losses).
        ignore_index: target id that contributes no loss and no gradient (torch's -100).
        label_smoothing: ``e`` in [0, 1], as torch's: ``(1-e)`` one-hot plus ``e/V`` uniform.

    Returns:
        The loss, identical on every rank of the group.

    Example:
        >>> loss = vocab_parallel_cross_entropy(head(h), targets, group=tp)
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    g = one_d_group(group)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"rank {g.world.rank}: label_smoothing must be in [0, 1], got {label_smoothing}")
    t = targets.data if isinstance(targets, Tensor) else targets
    if t.dtype.kind not in "iu":
        raise TypeError(f"rank {g.world.rank}: targets must be integer class ids, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"rank {g.world.rank}: targets shape {tuple(t.shape)} does not match logits "
                         f"shard shape {tuple(logits_shard.shape)}")
    return _VocabParallelCrossEntropy.apply(logits_shard, t, g, reduction, int(ignore_index), float(label_smoothing))


class TensorParallelMLP(_TensorParallelModule):
    """``proj(gelu(fc(x)))`` with ``fc`` column-parallel and ``proj`` row-parallel: one all-reduce forward.

    Parameter names match ``axonmpi.nn.transformer.MLP`` (``fc``, ``proj``).

    Args:
        embed_dim: input and output width.
        hidden_dim: hidden width (default ``4 * embed_dim``), must divide by the group size.
        bias: biases on both projections.
        group: the tensor-parallel group (default: the current grid's ``intra_group``).
        approximate: GELU variant ("tanh", the default of nn.MLP, or "none").
        dropout: dropout after ``proj`` (as nn.MLP; masks are drawn per rank).
        dtype: parameter dtype.
        sequence_parallel: input and output are sequence shards (``(b, s/p, h)``); dropout runs on them.

    Example:
        >>> mlp = TensorParallelMLP(64, group=tp, dtype="float64")
        >>> y = mlp(x)                            # (..., 64) on every rank
    """

    def __init__(self, embed_dim: int, hidden_dim: Optional[int] = None, bias: bool = True,
                 group: Optional[ProcessGroup] = None, approximate: str = "tanh", dropout: float = 0.0,
                 dtype=None, *, sequence_parallel: bool = False):
        super().__init__()
        hidden = 4 * embed_dim if hidden_dim is None else int(hidden_dim)
        group = one_d_group(group)
        sp = dict(sequence_parallel=sequence_parallel)
        self.fc = ColumnParallelLinear(embed_dim, hidden, bias=bias, group=group, dtype=dtype, **sp)
        self.act = GELU(approximate)
        self.proj = RowParallelLinear(hidden, embed_dim, bias=bias, group=group, dtype=dtype, **sp)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class _QKVParallelLinear(_AxisSharded):
    """The fused (3C, C) q/k/v projection with each of q, k, v split by rows (heads) over ``group``."""

    def __init__(self, embed_dim: int, bias: bool, group: ProcessGroup, dtype, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = bool(sequence_parallel)
        c = self.embed_dim = int(embed_dim)
        self.local = divide(c, group, "embed_dim")
        full = init_full((3 * c, c), dtype, _kaiming, [group])
        self.weight = _split(full, group, 0, parts=3)      # each of q, k, v split by heads
        if bias:
            self.bias = _split(init_full((3 * c,), dtype, _bias_init(c), [group]), group, 0, parts=3)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            return ops_nn.linear(gather_from_sequence_parallel_region(x, self.group, dim=-2), self.weight, self.bias)
        return ops_nn.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class _HeadSliceDropout(Function):
    """Dropout on this rank's heads with the mask the serial model would draw: the full
    (B, heads, T, T) uniforms are drawn (same generator calls as ``nn.Dropout``) and sliced."""

    @staticmethod
    def forward(ctx, x, p, heads, start):
        from ...random import generator_for

        xp = get_array_module(x)
        shape = (x.shape[0], heads) + tuple(x.shape[2:])
        u = generator_for(xp).random(shape, dtype=np.float32 if x.dtype.itemsize <= 4 else np.float64)
        mask = (u[:, start:start + x.shape[1]] >= p).astype(x.dtype)
        mask *= 1.0 / (1.0 - p)
        ctx.mask = mask
        return x * mask

    @staticmethod
    def backward(ctx, g):
        return g * ctx.mask, None, None, None


def _head_dropout(x: Tensor, p: float, training: bool, heads: int, start: int) -> Tensor:
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    return _HeadSliceDropout.apply(x, p, heads, start)


class TensorParallelAttention(_TensorParallelModule):
    """Multi-head causal self-attention with the heads split over ``group``.

    The fused ``qkv`` projection is column-parallel per head (rank ``r`` keeps heads
    ``[r*h/p, (r+1)*h/p)`` of q, k and v), attention runs locally on those heads, and the
    output ``proj`` is row-parallel: one all-reduce forward, one backward.  Names and full
    shapes match ``axonmpi.nn.transformer.CausalSelfAttention`` (``qkv``, ``proj``).

    Args:
        embed_dim: model width C.
        num_heads: heads; must divide by the group size (and C by ``num_heads``).
        group: the tensor-parallel group (default: the current grid's ``intra_group``).
        causal: mask future positions.
        dropout: dropout on attention weights and on the output.  With the same RNG state on every
            rank of the group (``axonmpi.manual_seed``), the masks are exactly those the serial
            ``CausalSelfAttention`` draws (each rank draws the full mask and keeps its heads).
        bias: biases on the projections.
        dtype: parameter dtype.
        sequence_parallel: input and output are sequence shards ``(B, T/p, C)``: ``qkv`` all-gathers
            the sequence, ``proj`` reduce-scatters it (the output dropout runs on the shard).

    Example:
        >>> attn = TensorParallelAttention(64, 4, group=tp, dtype="float64")
        >>> y = attn(x)                               # x, y: (B, T, 64)
    """

    def __init__(self, embed_dim: int, num_heads: int, group: Optional[ProcessGroup] = None, causal: bool = True,
                 dropout: float = 0.0, bias: bool = True, dtype=None, *, sequence_parallel: bool = False,
                 partial_grads: bool = False):
        super().__init__()
        group = one_d_group(group)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.causal = int(embed_dim), int(num_heads), bool(causal)
        self.local_heads = divide(self.num_heads, group, "num_heads")
        self.group = group
        self.sequence_parallel = bool(sequence_parallel)
        self.qkv = _QKVParallelLinear(embed_dim, bias, group, dtype, self.sequence_parallel)
        self.proj = RowParallelLinear(embed_dim, embed_dim, bias=bias, group=group, dtype=dtype,
                                      sequence_parallel=self.sequence_parallel, partial_grads=partial_grads)
        self.attn_dropout = Dropout(dropout)
        self.resid_dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)                      # sequence parallel: the whole sequence from here to proj
        B, T, C = qkv.shape[0], qkv.shape[1], x.shape[2]
        nh, hd = self.local_heads, C // self.num_heads
        q, k, v = ops.split(qkv, nh * hd, axis=2)
        q = ops.permute(ops.reshape(q, B, T, nh, hd), 0, 2, 1, 3)
        k = ops.permute(ops.reshape(k, B, T, nh, hd), 0, 2, 3, 1)
        v = ops.permute(ops.reshape(v, B, T, nh, hd), 0, 2, 1, 3)
        att = ops.matmul(q, k) * (1.0 / math.sqrt(hd))
        if self.causal:
            xp = get_array_module(x.data)
            att = ops_nn.masked_fill(att, xp.triu(xp.ones((T, T), dtype=bool), k=1), -np.inf)
        att = _head_dropout(ops_nn.softmax(att, -1), self.attn_dropout.p, self.training, self.num_heads,
                            self.group.rank * nh)
        y = ops.reshape(ops.permute(ops.matmul(att, v), 0, 2, 1, 3), B, T, nh * hd)
        return self.resid_dropout(self.proj(y))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads} (local {self.local_heads}), "
                f"causal={self.causal}, group size={self.group.size}")
