"""Differentiable row exchanges of AxoNN's easy mode: between "each rank holds its own rows, all features"
and "the row x column plane's rows, this rank's feature slice"; plus the bias gather of ``skip_bias_add``.

``sizes`` lists the row count of every group rank (ranks may hold different counts).
"""
from __future__ import annotations

from typing import List

import numpy as np

from ...autograd.function import Function
from ...backend import get_array_module
from ...distributed import ProcessGroup, all_gather, all_gather_object, all_reduce, all_to_all, reduce_scatter

__all__ = ["row_sizes", "gather_batch_scatter_channels", "gather_channels_scatter_batch", "gatherv", "dropv",
           "gather_bias_easy"]


def row_sizes(n: int, group: ProcessGroup) -> List[int]:
    """Every group rank's row count (this rank's is ``n``)."""
    return [int(n)] if group.size == 1 else [int(v) for v in all_gather_object(int(n), group)]


def _offset(sizes, rank):
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


def _gbsc(x, sizes, group):
    """[m_me, k] on each rank -> [sum m, k/G]: rows of all ranks, this rank's column slice."""
    xp = get_array_module(x)
    k = x.shape[-1] // group.size
    pieces = [xp.ascontiguousarray(x[:, j * k:(j + 1) * k]) for j in range(group.size)]
    return xp.concatenate(all_to_all(pieces, group), axis=0)


def _gcsb(y, sizes, group):
    """[sum m, k'] -> [m_me, G*k']: inverse of :func:`_gbsc`."""
    xp = get_array_module(y)
    bounds = np.cumsum([0] + list(sizes))
    pieces = [xp.ascontiguousarray(y[bounds[j]:bounds[j + 1]]) for j in range(group.size)]
    return xp.concatenate(all_to_all(pieces, group), axis=-1)


class _GatherBatchScatterChannels(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gbsc(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _gcsb(g, ctx.sizes, ctx.group), None, None


class _GatherChannelsScatterBatch(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, y, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gcsb(y, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _gbsc(g, ctx.sizes, ctx.group), None, None


class _Gatherv(Function):
    _fresh_grads = True  # backward returns new arrays or the incoming gradient

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.bounds = _offset(sizes, group.rank)
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
        a, b = _offset(sizes, group.rank)
        return x[a:b].copy()

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, axis=0, group=ctx.group, uneven=True), None, None


class _GatherBiasEasy(Function):
    """Forward: the full bias from the row group's slices.  Backward: each plane rank added it to its
    own rows, so the gradient is summed over the column group and reduce-scattered over the row group."""

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


def gather_batch_scatter_channels(x, sizes, group):
    return x if group.size == 1 else _GatherBatchScatterChannels.apply(x, sizes, group)


def gather_channels_scatter_batch(y, sizes, group):
    return y if group.size == 1 else _GatherChannelsScatterBatch.apply(y, sizes, group)


def gatherv(x, sizes, group):
    return x if group.size == 1 else _Gatherv.apply(x, sizes, group)


def dropv(x, sizes, group):
    return x if group.size == 1 else _Dropv.apply(x, sizes, group)


def gather_bias_easy(b, outer, inner):
    return b if outer.size * inner.size == 1 else _GatherBiasEasy.apply(b, outer, inner)
