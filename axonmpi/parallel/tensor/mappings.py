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

(the sequence wrappers take ``dim=``: the sequence dimension, 0 as Megatron's ``(s, b, h)``, 1 for ``(b, s, h)``).

Layer 3, public lowercase wrappers taking ``group``; a group of size 1 returns the input unchanged.
Splits must be even: a size that does not divide by the group size raises ``ValueError``.
"""
from __future__ import annotations

from typing import Optional

from ...autograd.function import Function
from ...autograd.tensor import Tensor
from ...distributed import ProcessGroup, all_gather, all_reduce, reduce_scatter
from ...distributed.world import resolve_group

__all__ = [
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "divide",
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
