"""Differentiable collectives for tensor parallelism: conjugate pairs named for the region (Megatron's three layers).

Layer 1, pure communication on raw arrays (``_reduce``, ``_split_along_last_dim``, ...).
Layer 2, autograd ``Function`` pairs whose backward is the conjugate collective::

    copy_to        forward identity            backward all-reduce
    reduce_from    forward all-reduce          backward identity
    scatter_to     forward split last dim      backward all-gather last dim
    gather_from    forward all-gather last dim backward split last dim
    reduce_scatter_to_sequence  forward reduce-scatter dim 0   backward all-gather dim 0
    gather_from_sequence        forward all-gather dim 0       backward reduce-scatter dim 0
    scatter_to_sequence         forward split dim 0            backward all-gather dim 0
    all_to_all     forward pieces of one axis to the ranks, concatenated along another; backward the reverse
    gatherv        forward all-gather dim 0, uneven rows          backward keep this rank's rows
    dropv          forward keep this rank's rows of dim 0         backward all-gather dim 0, uneven rows
    gather_bias    forward all-gather dim 0 over ``outer``        backward all-reduce over ``inner``, reduce-scatter over ``outer``
    global_sum     forward all-reduce                             backward the gradient times the group size

(the sequence wrappers take ``dim=``: the sequence dimension, 0 as Megatron's ``(s, b, h)``, 1 for ``(b, s, h)``).

Layer 3, public lowercase wrappers taking ``group``; a group of size 1 returns the input unchanged.
Splits must be even: a size that does not divide by the group size raises ``ValueError``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ...autograd.function import Function
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...distributed import ProcessGroup, all_gather, all_gather_object, all_reduce, all_to_all, reduce_scatter
from ...distributed.alltoallv import all_to_all_v, exchange_counts
from ...distributed.world import resolve_group

__all__ = [
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "all_to_all_along", "gatherv", "dropv", "gather_bias",
    "global_sum", "row_sizes", "divide",
]


def divide(n: int, group: ProcessGroup, what: str) -> int:
    """``n // group.size``, raising ``ValueError`` naming ``what``, the sizes and the rank when uneven."""
    if n % group.size:
        raise ValueError(
            f"rank {group.world.rank}: {what}={n} is not divisible by the size {group.size} of "
            f"group {group.name!r}; tensor parallelism needs an even split")
    return n // group.size


# -- layer 1: communication on raw arrays -----------------------------------------------------
def _reduce(x, group: ProcessGroup):
    return x if group.size == 1 else all_reduce(x, group=group)


def _split_along_last_dim(x, group: ProcessGroup):
    if group.size == 1:
        return x
    k = divide(x.shape[-1], group, "last dimension")
    return x[..., group.rank * k:(group.rank + 1) * k].copy()


def _gather_along_last_dim(x, group: ProcessGroup):
    return x if group.size == 1 else all_gather(x, axis=-1, group=group)


def _split_along_first_dim(x, group: ProcessGroup):
    if group.size == 1:
        return x
    k = divide(x.shape[0], group, "first dimension")
    return x[group.rank * k:(group.rank + 1) * k].copy()


def _gather_along_first_dim(x, group: ProcessGroup):
    return x if group.size == 1 else all_gather(x, axis=0, group=group)


def _reduce_scatter_along_first_dim(x, group: ProcessGroup):
    if group.size == 1:
        return x
    divide(x.shape[0], group, "first dimension")
    return reduce_scatter(x, group=group)


def _seq_check(x, group, dim):
    if x.shape[dim] % group.size:
        raise ValueError(
            f"rank {group.world.rank}: sequence parallelism splits dimension {dim} (the sequence, length "
            f"{x.shape[dim]}) over the {group.size} ranks of group {group.name!r}, and {x.shape[dim]} is not "
            f"divisible by {group.size}; use a sequence length that is a multiple of {group.size}")


def _on_dim(fn, x, group, dim, check=True):
    """``fn`` (an op on dimension 0) applied on dimension ``dim``."""
    if group.size == 1:
        return x
    if check:
        _seq_check(x, group, dim)
    if dim == 0:
        return fn(x, group)
    from ...backend import get_array_module
    xp = get_array_module(x)
    y = fn(xp.ascontiguousarray(xp.moveaxis(x, dim, 0)), group)
    return xp.ascontiguousarray(xp.moveaxis(y, 0, dim))


def _cut(x, axis, sizes):
    """``x`` cut along ``axis`` into consecutive pieces of ``sizes``."""
    bounds = np.cumsum([0] + list(sizes))
    head = (slice(None),) * axis
    return [x[head + (slice(int(bounds[j]), int(bounds[j + 1])),)] for j in range(len(sizes))]


def _all_to_all(x, group: ProcessGroup, split_axis, cat_axis, send_sizes, recv_sizes):
    """Cut ``x`` along ``split_axis`` into ``send_sizes`` (one piece per group rank), send piece ``j``
    to rank ``j`` and concatenate what arrives along ``cat_axis`` (``recv_sizes[j]`` from rank ``j``).

    Rows (both axes 0) go by ``all_to_all_v``: only the rows that leave a rank reach the backend.
    Pieces of one shape on every rank go as one array (no shape exchange); others as a list.
    """
    if split_axis == cat_axis == 0:
        return all_to_all_v(x, send_sizes, recv_sizes, group)[0]
    xp = get_array_module(x)
    pieces = _cut(x, split_axis, send_sizes)
    if len(set(send_sizes)) == 1 and len(set(recv_sizes)) == 1:
        got = all_to_all(xp.ascontiguousarray(xp.stack(pieces)), group=group)
        return xp.concatenate(list(got), axis=cat_axis)
    return xp.concatenate(all_to_all([xp.ascontiguousarray(c) for c in pieces], group=group), axis=cat_axis)


def row_sizes(n: int, group: ProcessGroup) -> List[int]:
    """Every group rank's row count (this rank's is ``n``)."""
    return [int(n)] if group.size == 1 else [int(v) for v in all_gather_object(int(n), group)]


def _own_rows(sizes, rank):
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


# -- layer 2: autograd pairs ------------------------------------------------------------------
class _CopyToTensorParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _reduce(g, ctx.group), None


class _ReduceFromTensorParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTensorParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_along_last_dim(g, ctx.group), None


class _GatherFromTensorParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_along_last_dim(g, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group, dim=0):
        ctx.group, ctx.dim = group, dim
        return _on_dim(_reduce_scatter_along_first_dim, x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _on_dim(_gather_along_first_dim, g, ctx.group, ctx.dim, False), None, None


class _GatherFromSequenceParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, dim=0):
        ctx.group, ctx.reduce, ctx.dim = group, tensor_parallel_output_grad, dim
        return _on_dim(_gather_along_first_dim, x, group, dim, False)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce:
            return _on_dim(_reduce_scatter_along_first_dim, g, ctx.group, ctx.dim), None, None, None
        return _on_dim(_split_along_first_dim, g, ctx.group, ctx.dim), None, None, None


class _ScatterToSequenceParallelRegion(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group, dim=0):
        ctx.group, ctx.dim = group, dim
        return _on_dim(_split_along_first_dim, x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _on_dim(_gather_along_first_dim, g, ctx.group, ctx.dim, False), None, None


class _AllToAll(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, group, split_axis, cat_axis, send_sizes, recv_sizes):
        ctx.args = group, cat_axis, split_axis, recv_sizes, send_sizes
        return _all_to_all(x, group, split_axis, cat_axis, send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, g):
        return (_all_to_all(g, *ctx.args),) + (None,) * 5


class _Gatherv(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.bounds = _own_rows(sizes, group.rank)
        return all_gather(x, axis=0, group=group, uneven=True)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.bounds
        return g[a:b].copy(), None, None


class _Dropv(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.group = group
        a, b = _own_rows(sizes, group.rank)
        return x[a:b].copy()

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, axis=0, group=ctx.group, uneven=True), None, None


class _GatherBias(Function):
    """Forward: the full bias from the ``outer`` group's slices.  Backward: each rank of the plane added it
    to its own rows, so the gradient is summed over ``inner`` and reduce-scattered over ``outer``."""

    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, b, outer, inner):
        ctx.outer, ctx.inner = outer, inner
        return b if outer.size == 1 else all_gather(b, axis=0, group=outer)

    @staticmethod
    def backward(ctx, g):
        if ctx.inner.size > 1:
            g = all_reduce(g, group=ctx.inner)
        if ctx.outer.size > 1:
            g = reduce_scatter(g, group=ctx.outer)
        return g, None, None


class _GlobalSum(Function):
    """Forward: sum over ``group`` (an all-reduce); backward: the gradient times the group size.

    Every rank adds the same global loss, and the data-parallel mean divides by the group size,
    so each rank's share of the serial gradient is ``size * d(global)/d(local)``.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.size = 1 if group is None else group.size
        if ctx.size == 1:
            return x.copy()
        return all_reduce(x, group=group)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.size, None


# -- layer 3: public wrappers -----------------------------------------------------------------
def _apply(fn, x, group, *extra):
    g = resolve_group(group)
    if g.size == 1:
        return x
    if not isinstance(x, Tensor):
        x = Tensor(x)
    return fn.apply(x, g, *extra)


def copy_to_tensor_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None) -> Tensor:
    """Identity forward, all-reduce of the gradient over ``group`` in backward.

    Use where a replicated input enters column-parallel work (each rank's gradient is partial).

    Args:
        x: the replicated activation.
        group: the tensor-parallel group (default: all ranks).

    Returns:
        ``x`` (the same values), recorded so the backward sums gradients over the group.

    Example:
        >>> y = copy_to_tensor_parallel_region(x, group=tp)
    """
    return _apply(_CopyToTensorParallelRegion, x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None) -> Tensor:
    """All-reduce (sum) over ``group`` forward, identity backward (output of a row-parallel matmul).

    Example:
        >>> y = reduce_from_tensor_parallel_region(partial_sum, group=tp)
    """
    return _apply(_ReduceFromTensorParallelRegion, x, group)


def scatter_to_tensor_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None) -> Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward.

    Raises:
        ValueError: the last dimension does not divide by the group size.

    Example:
        >>> x_local = scatter_to_tensor_parallel_region(x, group=tp)   # (..., in / p)
    """
    return _apply(_ScatterToTensorParallelRegion, x, group)


def gather_from_tensor_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None) -> Tensor:
    """All-gather along the last dimension forward (group-rank order); keep this rank's slice backward.

    Example:
        >>> y = gather_from_tensor_parallel_region(y_local, group=tp)  # (..., out)
    """
    return _apply(_GatherFromTensorParallelRegion, x, group)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None, *,
                                               dim: int = 0) -> Tensor:
    """Sum over ``group`` and keep this rank's block of dimension ``dim`` forward; all-gather it backward.

    Raises:
        ValueError: the sequence length does not divide by the group size (names both and the rank).

    Example:
        >>> y_seq = reduce_scatter_to_sequence_parallel_region(partial, group=tp)  # (s / p, b, h)
    """
    return _apply(_ReduceScatterToSequenceParallelRegion, x, group, int(dim))


def scatter_to_sequence_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None, *,
                                        dim: int = 0) -> Tensor:
    """Keep this rank's block of dimension ``dim`` forward (input replicated); all-gather the gradient backward.

    Example:
        >>> x_seq = scatter_to_sequence_parallel_region(embeddings, group=tp, dim=1)   # (b, s / p, h)
    """
    return _apply(_ScatterToSequenceParallelRegion, x, group, int(dim))


def gather_from_sequence_parallel_region(x: Tensor, group: Optional[ProcessGroup] = None, *,
                                         tensor_parallel_output_grad: bool = True, dim: int = 0) -> Tensor:
    """All-gather along dimension 0 forward; backward reduce-scatters the gradient (or only splits it).

    Args:
        x: this rank's sequence block ``(s / p, ...)``.
        group: the tensor-parallel group.
        tensor_parallel_output_grad: the gathered output feeds tensor-parallel work whose gradient
            is partial on each rank (reduce-scatter backward, Megatron's default); ``False`` when
            the gradient is replicated (split backward).
        dim: the sequence dimension (0: Megatron's ``(s, b, h)``; 1: ``(b, s, h)``).

    Example:
        >>> x_full = gather_from_sequence_parallel_region(x_seq, group=tp)  # (s, b, h)
    """
    return _apply(_GatherFromSequenceParallelRegion, x, group, bool(tensor_parallel_output_grad), int(dim))


def all_to_all_along(x: Tensor, group: ProcessGroup, split_axis: int, cat_axis: int,
                     send_sizes: Optional[Sequence[int]] = None,
                     recv_sizes: Optional[Sequence[int]] = None) -> Tensor:
    """The differentiable all-to-all: cut ``x`` along ``split_axis``, send piece ``j`` to group rank ``j``,
    concatenate the pieces received along ``cat_axis`` (source-rank order); backward the reverse exchange.

    Args:
        x: this rank's array.
        group: the group of the exchange.
        split_axis / cat_axis: the axis cut into pieces / the axis the received pieces are joined on.
        send_sizes: the piece for each rank along ``split_axis`` (default: an even split, which must divide).
        recv_sizes: the extent along ``cat_axis`` coming from each rank (default: with both axes 0 the
            counts are exchanged; otherwise every rank sends ``x.shape[cat_axis]``).

    Example:
        >>> heads = all_to_all_along(x, cp, split_axis=3, cat_axis=1, recv_sizes=lens)   # Ulysses
        >>> rows = all_to_all_along(tokens, ep, 0, 0, send_sizes=counts)                 # MoE dispatch
    """
    if group.size == 1:
        return x
    p = group.size
    split_axis, cat_axis = split_axis % x.ndim, cat_axis % x.ndim
    if send_sizes is None:
        k = divide(x.shape[split_axis], group, f"axis {split_axis}")
        send_sizes = [k] * p
    send_sizes = tuple(int(n) for n in send_sizes)
    if recv_sizes is None:
        recv_sizes = exchange_counts(np.asarray(send_sizes, np.int64).reshape(p, 1), group).reshape(p) \
            if split_axis == cat_axis == 0 else [x.shape[cat_axis]] * p
    recv_sizes = tuple(int(n) for n in recv_sizes)
    return _AllToAll.apply(x, group, split_axis, cat_axis, send_sizes, recv_sizes)


def gatherv(x: Tensor, sizes: Sequence[int], group: ProcessGroup) -> Tensor:
    """All-gather rows (dimension 0; ``sizes[j]`` rows on rank ``j``) forward; keep this rank's rows backward."""
    return x if group.size == 1 else _Gatherv.apply(x, sizes, group)


def dropv(x: Tensor, sizes: Sequence[int], group: ProcessGroup) -> Tensor:
    """Keep this rank's rows of dimension 0 (``sizes[j]`` for rank ``j``) forward; all-gather them backward."""
    return x if group.size == 1 else _Dropv.apply(x, sizes, group)


def gather_bias(b: Tensor, outer: ProcessGroup, inner: ProcessGroup) -> Tensor:
    """The full bias from ``outer``'s slices forward; backward its gradient summed over ``inner`` and
    reduce-scattered over ``outer`` (AxoNN's easy-mode bias of ``skip_bias_add``)."""
    return b if outer.size * inner.size == 1 else _GatherBias.apply(b, outer, inner)


def global_sum(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Sum over ``group`` forward (``None``: a copy); the gradient times the group size backward
    (a global statistic each data-parallel rank adds to its local-mean loss)."""
    return _GlobalSum.apply(x, group)
