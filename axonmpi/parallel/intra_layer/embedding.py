"""AxoNN's intra-layer ``Embedding``: the table's columns (embedding_dim) split over the row group
(column group when ``transpose``), each rank's block flattened and cut into G_d depth chunks."""
from __future__ import annotations
from ...distributed.placement import Cut, Placement, Shard, ShardKind, set_placement

from typing import Callable, Optional

import numpy as np

from ...autograd import ops, ops_nn
from ...autograd.tensor import Tensor
from ...distributed import all_gather
from ...nn import init
from ...nn.parameter import Parameter
from ..tensor.groups import TensorParallelGroups, default_groups
from ..tensor.mappings import all_to_all_along, gather_from_sequence_parallel_region, gatherv, row_sizes
from .. import placed
from ..tensor.state import _TensorParallelModule, init_full

__all__ = ["Embedding"]


class Embedding(_TensorParallelModule):
    """A lookup table (num_embeddings, embedding_dim) whose columns are split over the row group.

    Rank (r, d) stores ``W[:, r*D/G_r:(r+1)*D/G_r]`` flattened row-major, chunk d of G_d.  The
    column group must have size 1 (``transpose=True``: the row group, and the columns are split
    over the column group).  Easy mode: every rank passes its own ids and gets (..., D); the ids
    of the row group are exchanged so ranks may hold different rows.  Expert mode: returns the
    (..., D/G_r) slice.

    Args:
        num_embeddings, embedding_dim: the full table size.
        transpose: split over the column group instead.
        init_method: initializer of the full table (default N(0, 1), like ``nn.Embedding``).
        expert_mode: return this rank's feature slice.
        dtype: parameter dtype.
        groups: explicit :class:`TensorParallelGroups`.

    Example:
        >>> emb = Embedding(1000, 64)                 # G_c = 1 grid
        >>> h = emb(ids)                              # (..., 64)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, transpose: bool = False,
                 init_method: Optional[Callable] = None, expert_mode: bool = False, *, dtype=None,
                 groups: Optional[TensorParallelGroups] = None):
        super().__init__()
        g = default_groups() if groups is None else groups
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.transpose, self.expert_mode = bool(transpose), bool(expert_mode)
        self.split, other = (g.col, g.row) if transpose else (g.row, g.col)
        self.depth = g.depth
        rank = g.rank
        if other.size != 1:
            raise ValueError(f"rank {rank}: intra_layer.Embedding needs the {other.name} group of size 1 "
                             f"(transpose={self.transpose}), got size {other.size}")
        if self.embedding_dim % self.split.size:
            raise ValueError(f"rank {rank}: embedding_dim={self.embedding_dim} is not divisible by the size "
                             f"{self.split.size} of the {self.split.name} group")
        self.local_dim = self.embedding_dim // self.split.size
        if (self.num_embeddings * self.local_dim) % self.depth.size:
            raise ValueError(f"rank {rank}: the block {self.num_embeddings}x{self.local_dim} is not divisible "
                             f"by G_intra_d={self.depth.size}")
        full = init_full((self.num_embeddings, self.embedding_dim), dtype, init_method or init.normal_,
                         [self.depth, self.split])
        wpl = Placement(shards=(Shard(g.intra, ShardKind.BLOCK),), full_shape=(self.num_embeddings, self.embedding_dim),
                        cuts=(Cut(self.split, 1), Cut(self.depth, None)))
        self.weight = set_placement(Parameter(placed.cut(full, wpl)), wpl)
        self.weight.needs_depth_parallel_gradient_sync = False

    def forward(self, idx) -> Tensor:
        idx = idx.data if isinstance(idx, Tensor) else idx
        if idx.dtype.kind not in "iu":
            raise TypeError(f"embedding indices must be integers, got dtype {idx.dtype}")
        lead = tuple(idx.shape)
        w = gather_from_sequence_parallel_region(self.weight, self.depth)
        w = ops.reshape(w, self.num_embeddings, self.local_dim)
        if self.expert_mode or self.split.size == 1:
            return ops_nn.embedding(idx, w)
        flat = idx.reshape(-1)
        sizes = row_sizes(flat.shape[0], self.split)
        plane = all_gather(flat, axis=0, group=self.split, uneven=True)
        h = all_to_all_along(ops_nn.embedding(plane, w), self.split, 0, -1, send_sizes=sizes)
        return ops.reshape(h, *lead, self.embedding_dim)

    def _tp_init_groups(self):
        return [self.depth, self.split]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, transpose={self.transpose}, "
                f"expert_mode={self.expert_mode}")
