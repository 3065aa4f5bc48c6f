"""DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back (the one differentiable
all-to-all of ``tensor/mappings.py``).

``seq_to_head``: each rank's ``(B, T_r, G, H, D)`` (``G`` fused groups, e.g. q/k/v) becomes
``(B, T, G, H/P, D)``: the whole sequence for this rank's ``H/P`` heads; its backward is
``head_to_seq``, and the other way round.  Per rank and layer the attention moves ``4 B T_r C``
elements forward (q, k, v in, the output back: ``4 N h / P``), as many backward.
Sequence shards may be uneven (the list form of ``all_to_all``); heads must divide by ``P``.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ...autograd.tensor import Tensor
from ...distributed import ProcessGroup
from ..tensor.mappings import all_to_all_along

__all__ = ["seq_to_head", "head_to_seq", "check_heads"]


def check_heads(num_heads: int, group: ProcessGroup) -> int:
    """``num_heads // P``; ``ValueError`` naming the heads, the group size, the rank and the fix when uneven."""
    if num_heads % group.size:
        raise ValueError(
            f"rank {group.world.rank}: Ulysses attention splits the {num_heads} heads over the {group.size} "
            f"context-parallel ranks, and {num_heads} is not divisible by {group.size}; use a number of heads "
            f"that is a multiple of {group.size}, another context-parallel size, or cp_algo='ring'")
    return num_heads // group.size


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
    return all_to_all_along(x, group, 3, 1, recv_sizes=lens)


def head_to_seq(y: Tensor, group: ProcessGroup, lens: Optional[Sequence[int]] = None) -> Tensor:
    """``(B, T, G, H/P, D)`` head shard -> ``(B, T_r, G, H, D)`` sequence shard (backward: the reverse).

    Example:
        >>> out = head_to_seq(attn_out, cp)       # (B, T_r, 1, H, D)
    """
    if group.size == 1:
        return y
    lens = tuple(int(n) for n in (lens if lens is not None else [y.shape[1] // group.size] * group.size))
    return all_to_all_along(y, group, 1, 3, send_sizes=lens)
