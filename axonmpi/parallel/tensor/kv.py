"""Column-parallel key/value projections of grouped-query attention: heads split over the tensor group, or
replicated where the group is larger than the heads (Megatron's rule).

[Note: replicated key/value heads]  Grouped-query attention reads key/value head ``h // (n_head / n_kv_head)``
for query head ``h``.  A tensor group of ``p`` ranks gives rank ``r`` the query heads ``[r n_head/p, (r+1)
n_head/p)``.  When ``p`` divides ``n_kv_head`` each rank holds ``n_kv_head / p`` key/value heads (a plain
column split).  When ``n_kv_head < p`` (``p`` a multiple of it; Megatron's ``num_query_groups < tp``) the query
heads of rank ``r`` all read head ``r * n_kv_head // p``, so that rank holds that one head, and the
``rep = p / n_kv_head`` consecutive ranks sharing it hold the same rows.  Worked layout, ``n_kv_head = 2`` over
``p = 4`` (ranks t0..t3)::

    key/value head   0        0        1        1
    tensor rank      t0       t1       t2       t3
    shard group      [t0, t2] [t1, t3] [t0, t2] [t1, t3]    (ranks holding different heads: the cut)
    replica group    [t0, t1] [t0, t1] [t2, t3] [t2, t3]    (ranks holding the same head)

Each rank's gradient of its head comes from its own query heads only: a part of the serial gradient, so the
placement records the replica group as ``partial`` and the finalize step sums it there (bucketed with the
others); after it the replicas hold the same gradient and stay equal under the same optimizer.  The input's
gradient needs nothing more: the column layer's conjugate collective already sums it over the whole tensor
group (each rank's part through its own query heads).  The placement's cut (``Cut(shard group, 0)``) locates
each rank's rows in the serial weight, so the sharded state gathers, saves (each block once: the replicas hold
equal blocks) and restores it under any layout.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ...distributed import ProcessGroup
from ...distributed.placement import Cut, Placement, Shard, ShardKind, set_placement
from ...nn.parameter import Parameter
from .. import placed
from .groups import one_d_group
from .layers import ColumnParallelLinear, _bias_init, _kaiming, _split
from .state import init_full

__all__ = ["ColumnParallelKVLinear", "kv_head_groups"]


def kv_head_groups(group: ProcessGroup, heads: int) -> Tuple[ProcessGroup, ProcessGroup]:
    """``(shard group, replica group)`` of ``heads`` key/value heads over a larger tensor ``group`` (see [Note:
    replicated key/value heads]): the ranks holding different heads (its rank = this rank's head) and the ranks
    holding this rank's head.  Collective over ``group``."""
    p, r = group.size, group.rank
    if heads >= p or p % heads:
        raise ValueError(f"rank {group.world.rank}: kv_head_groups replicates {heads} key/value heads over a "
                         f"larger tensor group whose size is a multiple of them; got a group of {p}")
    rep = p // heads
    shard = group.world.split(r % rep, r, parent=group, name="kv_heads")
    replica = group.world.split(r // rep, r, parent=group, name="kv_head_replicas")
    return shard, replica


class ColumnParallelKVLinear(ColumnParallelLinear):
    """A key or value projection of grouped-query attention, column-parallel over key/value heads.

    ``weight`` (``heads * head_dim``, ``in``): with ``heads`` divisible by the group size each rank keeps its
    ``heads / p`` heads' rows (a :class:`ColumnParallelLinear`); with fewer heads than ranks (the group size a
    multiple of ``heads``) rank ``r`` keeps head ``r * heads // p``, replicated over the ranks that share it,
    its gradient summed over them by the owner's finalize step (the placement's ``partial``; [Note: replicated
    key/value heads]).  The output is never gathered: the attention reads the rank's heads from its width.

    Args:
        in_features: the input width.
        heads: the serial key/value heads (``n_kv_head``).
        head_dim: the width of a head.
        bias: a bias (cut like the rows).
        group: the tensor-parallel group (default: the grid's ``intra_group``).
        dtype: parameter dtype.
        kv_groups: ``(shard group, replica group)`` from :func:`kv_head_groups` (made here when left out; pass
            them to share two communicators between the layers of a model).
        sequence_parallel, sequence_dim: as :class:`ColumnParallelLinear`'s (the input all-gathered along the
            sequence).

    Example (2 key/value heads of width 8 over 4 tensor ranks: each holds 8 rows)::

        >>> k = ColumnParallelKVLinear(64, heads=2, head_dim=8, group=tp, dtype="float64")
        >>> k.weight.shape
        (8, 64)
    """

    def __init__(self, in_features: int, heads: int, head_dim: int, bias: bool = False,
                 group: Optional[ProcessGroup] = None, dtype=None, *, kv_groups=None,
                 sequence_parallel: bool = False, sequence_dim: int = -2):
        super(ColumnParallelLinear, self).__init__()
        self.group = g = one_d_group(group)
        p = g.size
        self.heads, self.head_dim = int(heads), int(head_dim)
        if self.heads % p and p % self.heads:
            raise ValueError(
                f"rank {g.world.rank}: {self.heads} key/value heads over a tensor group of {p}: each rank needs whole "
                f"heads, so either {p} divides the heads (split) or the heads divide {p} (each head replicated over "
                f"{p} / heads ranks, Megatron's rule); use a tensor size that divides or is a multiple of "
                f"n_kv_head={self.heads}")
        self.in_features, self.out_features = int(in_features), self.heads * self.head_dim
        self.gather_output = False
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        self.replicated = self.heads < p
        full = init_full((self.out_features, self.in_features), dtype, _kaiming, [g])
        fb = init_full((self.out_features,), dtype, _bias_init(self.in_features), [g]) if bias else None
        if not self.replicated:
            self.kv_groups = None
            self.weight = _split(full, g, 0)
            self.bias = None if fb is None else _split(fb, g, 0)
        else:
            self.kv_groups = shard, replica = kv_groups if kv_groups is not None else kv_head_groups(g, self.heads)
            if shard.size != self.heads or replica.size != p // self.heads:
                raise ValueError(f"rank {g.world.rank}: kv_groups of sizes {shard.size} x {replica.size} do not lay "
                                 f"{self.heads} heads over {p} tensor ranks (expected {self.heads} x "
                                 f"{p // self.heads})")
            self.weight = self._replicated_head(full, shard, replica)
            self.bias = None if fb is None else self._replicated_head(fb, shard, replica)
        if self.bias is None:
            self.register_parameter("bias", None)
        self.local_out_features = self.weight.data.shape[0]

    @staticmethod
    def _replicated_head(full, shard: ProcessGroup, replica: ProcessGroup) -> Parameter:
        pl = Placement(shards=(Shard(shard, ShardKind.DIM, 0),), replicas=(replica,), full_shape=tuple(full.shape),
                       cuts=(Cut(shard, 0),), partial=(replica,))
        return set_placement(Parameter(placed.cut(full, pl)), pl)

    @property
    def head(self) -> int:
        """The first serial key/value head this rank holds."""
        p, r = self.group.size, self.group.rank
        return r * self.heads // p

    def extra_repr(self) -> str:
        local = self.local_out_features // self.head_dim
        how = (f"head {self.head} replicated over {self.group.size // self.heads} ranks" if self.replicated
               else f"heads {self.head}..{self.head + local - 1}")
        return (f"in_features={self.in_features}, heads={self.heads} x {self.head_dim} ({how}), "
                f"bias={self.bias is not None}, group size={self.group.size}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))
