"""DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back, as a conjugate pair of autograd Functions.

``seq_to_head``: each rank's ``(B, T_r, G, H, D)`` (``G`` fused groups, e.g. q/k/v) becomes
``(B, T, G, H/P, D)``: the whole sequence for this rank's ``H/P`` heads; its backward is
``head_to_seq``, and the other way round.  Per rank and layer the attention moves ``4 B T_r C``
elements forward (q, k, v in, the output back: ``4 N h / P``), as many backward.
Sequence shards may be uneven (the list form of ``all_to_all``); heads must divide by ``P``.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ...autograd.function import Function
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...distributed import ProcessGroup, all_to_all

__all__ = ["seq_to_head", "head_to_seq", "check_heads"]


def check_heads(num_heads: int, group: ProcessGroup) -> int:
    """``num_heads // P``; ``ValueError`` naming the heads, the group size, the rank and the fix when uneven."""
    if num_heads % group.size:
        raise ValueError(
            f"rank {group.world.rank}: Ulysses attention splits the {num_heads} heads over the {group.size} "
            f"context-parallel ranks, and {num_heads} is not divisible by {group.size}; use a number of heads "
            f"that is a multiple of {group.size}, another context-parallel size, or cp_algo='ring'")
    return num_heads // group.size


def _exchange(pieces, group, axis, even):
    """Send ``pieces[j]`` to rank ``j``; concatenate what arrives along ``axis`` (source-rank order)."""
    xp = get_array_module(pieces[0])
    if even:        # one array: no shape exchange
        got = all_to_all(xp.ascontiguousarray(xp.stack(pieces)), group=group)
        return xp.concatenate(list(got), axis=axis)
    return xp.concatenate(all_to_all([xp.ascontiguousarray(c) for c in pieces], group=group), axis=axis)


def _s2h(x, group, lens):
    h = x.shape[3] // group.size
    pieces = [x[:, :, :, j * h:(j + 1) * h] for j in range(group.size)]
    return _exchange(pieces, group, 1, len(set(lens)) == 1)


def _h2s(y, group, lens):
    starts = [sum(lens[:j]) for j in range(group.size)]
    pieces = [y[:, s:s + n] for s, n in zip(starts, lens)]
    return _exchange(pieces, group, 3, len(set(lens)) == 1)


class _SeqToHead(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, group, lens):
        ctx.group, ctx.lens = group, lens
        return _s2h(x, group, lens)

    @staticmethod
    def backward(ctx, g):
        return _h2s(g, ctx.group, ctx.lens), None, None


class _HeadToSeq(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, y, group, lens):
        ctx.group, ctx.lens = group, lens
        return _h2s(y, group, lens)

    @staticmethod
    def backward(ctx, g):
        return _s2h(g, ctx.group, ctx.lens), None, None


def seq_to_head(x: Tensor, group: ProcessGroup, lens: Optional[Sequence[int]] = None) -> Tensor:
    """``(B, T_r, G, H, D)`` sequence shard -> ``(B, T, G, H/P, D)`` head shard (backward: the reverse).

    Args:
        x: this rank's tokens, heads on axis 3.
        group: the context-parallel group.
        lens: every rank's token count (default: all equal to this rank's).

    Example:
        >>> qkv_heads = seq_to_head(qkv.reshape(B, T_r, 3, H, D), cp)
    """
    if group.size == 1:
        return x
    check_heads(x.shape[3], group)
    lens = tuple(int(n) for n in (lens if lens is not None else [x.shape[1]] * group.size))
    return _SeqToHead.apply(x, group, lens)


def head_to_seq(y: Tensor, group: ProcessGroup, lens: Optional[Sequence[int]] = None) -> Tensor:
    """``(B, T, G, H/P, D)`` head shard -> ``(B, T_r, G, H, D)`` sequence shard (backward: the reverse).

    Example:
        >>> out = head_to_seq(attn_out, cp)       # (B, T_r, 1, H, D)
    """
    if group.size == 1:
        return y
    lens = tuple(int(n) for n in (lens if lens is not None else [y.shape[1] // group.size] * group.size))
    return _HeadToSeq.apply(y, group, lens)
