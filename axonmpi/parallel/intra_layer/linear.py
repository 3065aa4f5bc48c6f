"""AxoNN's 3-D tensor-parallel ``Linear``: one weight split over a row x column x depth grid.

Storage (AxoNN's): rank (r, c, d) holds ``W[r*out/G_r:(r+1)*out/G_r, c*in/G_c:(c+1)*in/G_c]``
flattened row-major and cut into G_d chunks, keeping chunk d (a 1-D parameter); the bias holds
``b[r*out/G_r:(r+1)*out/G_r]`` (replicated over column and depth).  ``transpose=True`` swaps the
roles of row and column, so a pair (plain, transposed) chains with no re-layout.

Forward: all-gather the weight over depth -> local matmul -> all-reduce over the column group.
Backward: dX all-reduced over the row group, dW reduce-scattered over depth.

Easy mode (default): every rank passes its own rows with all ``in_features`` (any row count;
the layer is data parallel over all ranks, as AxoNN's); the rows of the row x column plane
are exchanged in and out around the matmul.  Expert mode: the caller passes the
``[rows, in/G_c]`` slice and gets ``[rows, out/G_r]`` (transposed: G_r and G_c swapped).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from ...autograd import ops, ops_nn
from ...autograd.tensor import Tensor
from ...distributed import all_gather
from ...distributed.placement import Cut, Placement, Shard, ShardKind, set_placement
from ...nn import init
from ...nn.parameter import Parameter
from ..tensor.groups import TensorParallelGroups, default_groups
from ..tensor.mappings import (
    all_to_all_along, copy_to_tensor_parallel_region, dropv, gather_bias, gather_from_sequence_parallel_region,
    gatherv, reduce_from_tensor_parallel_region, row_sizes,
)
from .. import placed
from ..tensor.state import _TensorParallelModule, init_full
from .overlap import overlapped_matmul

__all__ = ["Linear"]


def _default_init(w):
    return init.kaiming_uniform_(w, a=math.sqrt(5))


class Linear(_TensorParallelModule):
    """A Linear layer whose weight is split over the intra-layer grid (AxoNN's ``intra_layer.Linear``).

    Args:
        in_features, out_features: the full sizes.
        bias: keep a bias (initialised to zeros, as AxoNN does).
        transpose: swap the row and column roles (pairs with a plain layer before it).
        skip_bias_add: return ``(y, bias)`` and leave the add to the caller (easy mode: the full
            bias; expert mode: this rank's slice).
        init_method: initializer of the full (out, in) weight (default kaiming-uniform a=sqrt(5)).
        expert_mode: the caller passes the ``[rows, in/G_c]`` slice (see the module docstring).
        dtype: parameter dtype (default float32).
        groups: explicit :class:`TensorParallelGroups` (default: the current grid's).

    Raises:
        ValueError: ``out_features`` not divisible by G_r, ``in_features`` by G_c (swapped when
            transposed), or the block size ``out*in/(G_r*G_c)`` by G_d.

    Example:
        >>> fc = Linear(64, 256)                      # under a (G_r, G_c, G_d) grid
        >>> y = fc(x)                                 # easy mode: x (rows, 64) -> (rows, 256)
    """

    overlaps_communication = True    # optimize_communication(model=...) prefetches these layers in module order

    def __init__(self, in_features: int, out_features: int, bias: bool = True, transpose: bool = False,
                 skip_bias_add: bool = False, init_method: Optional[Callable] = None, expert_mode: bool = False,
                 *, dtype=None, groups: Optional[TensorParallelGroups] = None):
        super().__init__()
        g = default_groups() if groups is None else groups
        self.groups = g
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.transpose, self.skip_bias_add, self.expert_mode = bool(transpose), bool(skip_bias_add), bool(expert_mode)
        # inner splits in_features (its all-reduce completes the forward), outer splits out_features
        self.inner, self.outer = (g.row, g.col) if transpose else (g.col, g.row)
        self.depth = g.depth
        rank = g.rank
        for n, grp, what in ((self.in_features, self.inner, "in_features"),
                             (self.out_features, self.outer, "out_features")):
            if n % grp.size:
                raise ValueError(f"rank {rank}: {what}={n} is not divisible by the size {grp.size} of the "
                                 f"{grp.name} group (transpose={self.transpose})")
        self.local_in_features = self.in_features // self.inner.size
        self.local_out_features = self.out_features // self.outer.size
        block = self.local_in_features * self.local_out_features
        if block % self.depth.size:
            raise ValueError(f"rank {rank}: the weight block {self.local_out_features}x{self.local_in_features} "
                             f"= {block} elements is not divisible by G_intra_d={self.depth.size}")
        full = init_full((self.out_features, self.in_features), dtype, init_method or _default_init,
                         [self.depth, self.outer, self.inner])
        wpl = Placement(shards=(Shard(g.intra, ShardKind.BLOCK),), full_shape=(self.out_features, self.in_features),
                        cuts=(Cut(self.outer, 0), Cut(self.inner, 1), Cut(self.depth, None)))
        self.weight = set_placement(Parameter(placed.cut(full, wpl)), wpl)
        self.weight.needs_depth_parallel_gradient_sync = False
        if bias:
            self.bias = Parameter(np.zeros(self.local_out_features, self.weight.data.dtype))
            set_placement(self.bias, Placement(shards=(Shard(self.outer, ShardKind.DIM, 0),),
                                               replicas=(self.inner, self.depth), full_shape=(self.out_features,)))
            self.bias.needs_depth_parallel_gradient_sync = True
        else:
            self.register_parameter("bias", None)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: Tensor):
        lead = tuple(x.shape[:-1])
        if x.shape[-1] != (self.local_in_features if self.expert_mode else self.in_features):
            raise ValueError(
                f"rank {self.depth.world.rank}: input has {x.shape[-1]} features; expected "
                f"{self.local_in_features if self.expert_mode else self.in_features} "
                f"({'expert' if self.expert_mode else 'easy'} mode)")
        x = ops.reshape(x, -1, x.shape[-1])
        easy = not self.expert_mode and self.inner.size * self.outer.size > 1
        if easy:
            inner_sizes = row_sizes(x.shape[0], self.inner)
            x = all_to_all_along(x, self.inner, -1, 0, recv_sizes=inner_sizes)   # all rows, a column slice
            outer_sizes = row_sizes(x.shape[0], self.outer)
            x = gatherv(x, outer_sizes, self.outer)
        y = overlapped_matmul(x, self)
        if y is None:
            w = gather_from_sequence_parallel_region(self.weight, self.depth)
            w = ops.reshape(w, self.local_out_features, self.local_in_features)
            x = copy_to_tensor_parallel_region(x, self.outer)
            y = reduce_from_tensor_parallel_region(ops_nn.linear(x, w), self.inner)
        add_here = self.bias is not None and not self.skip_bias_add
        if add_here:
            y = y + self.bias
        if easy:
            y = all_to_all_along(y, self.outer, 0, -1, send_sizes=outer_sizes)  # own rows, all columns
            y = dropv(y, inner_sizes, self.inner)
        y = ops.reshape(y, *lead, y.shape[-1])
        if self.skip_bias_add:
            if self.bias is None:
                return y, None
            return y, (self.bias if self.expert_mode else gather_bias(self.bias, self.outer, self.inner))
        return y

    # -- full <-> shard ----------------------------------------------------------------------
    def _tp_init_groups(self):
        return [self.depth, self.outer, self.inner]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"transpose={self.transpose}, expert_mode={self.expert_mode}, "
                f"grid (inner, outer, depth)=({self.inner.size}, {self.outer.size}, {self.depth.size})")
