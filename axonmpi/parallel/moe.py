"""Expert parallelism for ``nn.MoE``: experts split over an expert group carved from the data dimension,
tokens dispatched with a variable-count all-to-all; or tensor-parallel experts with tokens gathered.

[Note: expert parallelism on the grid]
``expert_parallel = EP`` divides ``G_data`` (Megatron's and DeepSpeed's rule) and is the grid's, fixed
at init (``axonmpi.init(..., expert_parallel=EP)``): the grid builds two groups carved from the data
dimension (``group_for("expert")``, ``group_for("expert_data")``):
the *expert group* (EP consecutive data ranks; each holds ``E / EP`` experts) and the
*expert-data group* (``G_data / EP`` ranks holding the same experts). Non-expert parameters stay
replicated over ``G_data`` (DDP over the data group); expert parameters are placed as a ``DIM``
shard along axis 0 over the expert group, replicated over the expert-data group, so

* gradients: an expert's gradient already sums the contributions of every rank of its expert
  group (the all-to-all's backward brings them home); it is summed over the expert-data group
  and divided by ``G_data`` (the grad-sync table's rule for a shard over a subgroup of data),
  never over the expert group;
* clipping sums an expert's squares over the expert group once, and the checkpoint writes each
  expert's rows once, so a checkpoint saved at EP = 4 loads at EP = 2, 1 or serially.

[Note: the all-to-all dispatcher]
The MoE sorts its (token, choice) assignments by expert; experts ``[r*E/EP, (r+1)*E/EP)`` live on
expert rank ``r``, so each destination's rows are contiguous. Per forward: (1) the per-expert
counts are exchanged (``exchange_counts``: ``EP x E/EP`` int64); (2) ``all_to_all_v`` sends the
rows (no padding: dropless); (3) received rows are regrouped source-major -> expert-major, the
local experts run, the result is regrouped back; (4) ``all_to_all_v`` returns them with the
counts swapped. The backward is the same two exchanges with the counts swapped. Only rows that
leave a rank reach the backend, so the bytes moved per MoE layer are

    forward:  2 * (rows sent off-rank) * n_embd * itemsize     (dispatch + combine)
    backward: the same again,

summed over the expert group (a row is one (token, choice) assignment; a token sent to two
experts on one rank travels twice, as in Megatron's AlltoAll dispatcher).

[Note: tensor-parallel experts (AxoNN style)]
With ``expert_tensor_parallel=True`` every rank of the tensor group holds every expert, each a
column slice of ``fc`` and the matching row slice of ``proj`` (Megatron column/row split of the
hidden width). The ranks of the tensor group read different rows of the batch (the batch is split
over data x tensor); the dispatcher all-gathers the tokens over the tensor group, runs the local
slices on all of them and reduce-scatters the partial outputs back to their owners ("tokens
gathered rather than sent"): per layer and direction ``2 * (T - 1) * (rows per rank) * n_embd *
itemsize`` bytes per rank (an all-gather and a reduce-scatter, counted by the backend as
``T * (rows per rank) * n_embd * itemsize`` each). The tokens are gathered before routing, so a
token chosen by two experts travels once; every rank of the tensor group routes the same tokens,
and the routing statistics are summed over the data group.

[Note: both at once]
``expert_tensor_parallel=True`` with ``expert_parallel = EP > 1`` (Megatron's expert tensor parallelism
inside expert parallelism): expert ``e``'s weights live on the ranks of expert-group place
``e // (E / EP)``, each tensor rank holding its hidden slice (a ``DIM`` shard on axis 0 over the expert
group, then on the hidden axis over the tensor group; replicated over the expert-data group). The
expert group varies only the data coordinate, so its ranks share a tensor coordinate and hold the
same slices. A forward gathers the tensor group's tokens (every tensor rank then routes the same
rows), sends each routed row by all-to-all to its expert's rank of the expert group, runs the local
slices, returns the partial outputs by all-to-all, and reduce-scatters them over the tensor group.
An expert's gradient is summed over its expert-data group only (never over the tensor group, whose
ranks hold different slices; the grad-sync table leaves out a batch group that splits a parameter).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import kernels as K
from ..autograd import ops
from ..autograd.function import Function
from ..autograd.tensor import Tensor
from ..backend import get_array_module
from ..distributed import get_grid
from ..distributed.alltoallv import exchange_counts
from ..distributed.placement import Placement, Shard, ShardKind, placement_of, set_placement
from ..nn import Module
from ..nn.moe import ExpertLinear, MoE
from ..nn.parameter import Parameter
from . import placed
from .tensor.layers import _AxisSharded
from .tensor.mappings import (
    all_to_all_along, gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["AllToAllDispatcher", "GatherDispatcher", "GatheredAllToAllDispatcher", "ShardedExpertLinear", "expert_parallel",
           "expert_parameters"]


# -- dispatchers ----------------------------------------------------------------------------------
class AllToAllDispatcher:
    """Runs a MoE's experts split over ``group`` (see ``[Note: the all-to-all dispatcher]``).

    Attributes:
        group: the expert group; rank ``r`` holds experts ``[r*E/EP, (r+1)*E/EP)``.
        num_experts: E.
        last_rows_sent_off_rank / last_rows_received_off_rank: rows of the last forward's dispatch
            that left / reached this rank (the byte formula's count).
        last_rows_computed: rows the local experts ran on in the last forward.
    """

    def __init__(self, group, num_experts: int):
        if num_experts % group.size:
            raise ValueError(f"rank {group.world.rank}: num_experts={num_experts} does not divide over the "
                             f"expert group of {group.size} ranks {list(group.ranks)}")
        self.group, self.num_experts = group, num_experts
        self.last_rows_sent_off_rank = self.last_rows_received_off_rank = self.last_rows_computed = 0

    def __call__(self, rows: Tensor, counts: np.ndarray, experts: Module) -> Tensor:
        g = self.group
        p, me = g.size, g.rank
        local = self.num_experts // p
        cm = np.asarray(counts, np.int64).reshape(p, local)
        rcm = exchange_counts(cm, g)                                 # rows from source s for local expert l
        send, recv = cm.sum(1), rcm.sum(1)
        self.last_rows_computed = int(rcm.sum())            # rows this rank's experts ran on
        self.last_rows_sent_off_rank = int(send.sum() - send[me])
        self.last_rows_received_off_rank = int(recv.sum() - recv[me])
        xr = all_to_all_along(rows, g, 0, 0, send, recv)             # source-major
        start = np.concatenate([[0], np.cumsum(rcm.reshape(-1))[:-1]]).reshape(p, local)
        perm = np.concatenate([np.arange(start[s, l], start[s, l] + rcm[s, l])
                               for l in range(local) for s in range(p)] or [np.zeros(0, np.int64)])
        xp = get_array_module(rows.data)
        identity = bool(np.all(perm == np.arange(perm.size)))
        if identity:
            return all_to_all_along(experts(xr, rcm.sum(0)), g, 0, 0, recv, send)
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size)
        perm, inv = xp.asarray(perm), xp.asarray(inv)
        xl = _PermuteRows.apply(xr, perm, inv)                      # expert-major
        yr = _PermuteRows.apply(experts(xl, rcm.sum(0)), inv, perm)  # back to source-major
        return all_to_all_along(yr, g, 0, 0, recv, send)


class _PermuteRows(Function):
    """``x[perm]`` for a row permutation; backward the inverse gather (kernel layer: no scatter-add, no sort)."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.inverse = inverse
        return K.permute_rows_forward(x, perm)

    @staticmethod
    def backward(ctx, g):
        return K.permute_rows_backward(g, ctx.inverse), None, None


class GatherDispatcher:
    """Runs a MoE's tensor-parallel experts: the layer's tokens are all-gathered over ``group`` before
    routing, every rank routes all of them and runs its hidden slice of every expert, and the
    partial outputs are reduce-scattered back to the ranks that own the tokens (see
    ``[Note: tensor-parallel experts (AxoNN style)]``).
    """

    def __init__(self, group):
        self.group = group

    def before(self, x2: Tensor) -> Tensor:
        """This rank's tokens -> the tensor group's tokens (rank-major); backward reduce-scatters (sums)."""
        return gather_from_sequence_parallel_region(x2, self.group)

    def after(self, out: Tensor) -> Tensor:
        """Partial outputs of the group's tokens -> the full outputs of this rank's tokens; backward all-gathers."""
        return reduce_scatter_to_sequence_parallel_region(out, self.group)

    def __call__(self, rows: Tensor, counts: np.ndarray, experts: Module) -> Tensor:
        return experts(rows, counts)


class GatheredAllToAllDispatcher(AllToAllDispatcher):
    """Tensor-parallel experts that are split over an expert group too (``[Note: both at once]``): the tensor
    group's tokens are all-gathered before routing, the routed rows go by all-to-all over the expert group
    (each tensor rank to the ranks of its own tensor coordinate, which hold the same hidden slice of their
    experts), and the partial outputs are reduce-scattered back over the tensor group."""

    def __init__(self, group, num_experts: int, tensor_group):
        super().__init__(group, num_experts)
        gather = GatherDispatcher(tensor_group)
        self.before, self.after = gather.before, gather.after


# -- sharded expert weights ------------------------------------------------------------------------
class ShardedExpertLinear(_AxisSharded):
    """This rank's slice of an :class:`~axonmpi.nn.moe.ExpertLinear`: ``axis`` 0 (experts, expert
    parallelism) or 1 / 2 (an expert's hidden width, tensor-parallel experts) over ``group``; with
    ``then=(group2, axes2)`` the slice is cut again over ``group2`` (both: experts over the expert group,
    then each expert's hidden width over the tensor group).

    Serial names and shapes in state dicts (from the placements); placement: a ``DIM`` shard
    over each group that splits the parameter, replicated over ``replicas`` and the others.
    """

    def __init__(self, serial: ExpertLinear, group, axes: dict, replicas=(), then=None):
        super().__init__()
        self.group = group
        self._levels = [(group, axes)] + ([tuple(then)] if then is not None else [])
        self.num_experts, self.in_features, self.out_features = (serial.num_experts, serial.in_features,
                                                                 serial.out_features)
        for name in ("weight", "bias"):
            p = getattr(serial, name)
            if p is None:
                self.bias = None
                continue
            full = np.asarray(p.data)
            cuts = [(lv[name], g) for g, lv in self._levels if lv.get(name) is not None]
            whole = tuple(g for g, lv in self._levels if lv.get(name) is None)
            pl = Placement(shards=tuple(Shard(g, ShardKind.DIM, a) for a, g in cuts),
                           replicas=tuple(replicas) + whole, full_shape=tuple(full.shape))
            q = set_placement(Parameter(placed.cut(full, pl) if cuts else full.copy()), pl)
            setattr(self, name, q)

    def _tp_init_groups(self):
        return [g for g, _ in self._levels]

    def pieces(self):
        """Per local expert ``(weight, bias)``; a bias whole over a group that splits the hidden width (its
        partial outputs are summed) is added on that group's rank 0 only (times zero elsewhere, so every rank
        still gets a gradient and its reduction runs)."""
        out = ExpertLinear.pieces(self)
        if self.bias is not None and any(g.rank != 0 for g, lv in self._levels if lv.get("bias") is None):
            out = [(w, b * 0.0) for w, b in out]
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features="
                f"{self.out_features}, local={tuple(self.weight.data.shape)}, "
                f"groups={[list(g.ranks) for g, _ in self._levels]}")


def expert_parameters(module: Module):
    """The parameters of ``module`` that are split over an expert group (``ShardedExpertLinear`` on axis 0)."""
    out = []
    for m in module.modules():
        if isinstance(m, ShardedExpertLinear) and getattr(m, "expert_parallel", False):
            out.extend(p for p in (m.weight, m.bias) if p is not None)
    return out


def expert_parallel(module: Module, expert_parallel: Optional[int] = None, *, grid=None,
                    expert_tensor_parallel: bool = False, stats_group=None) -> int:
    """Lay out every :class:`~axonmpi.nn.MoE` of ``module`` over the grid (in place); returns how many.

    Args:
        module: a model holding ``nn.MoE`` layers (built the same way on every rank).
        expert_parallel: EP, the grid's (``None``: the grid's; another value raises, naming the fix
            ``axonmpi.init(..., expert_parallel=EP)``); the experts of each MoE (E divisible by EP) are
            split over the grid's expert group, tokens go by all-to-all. 1: experts replicated.
        grid: the :class:`~axonmpi.distributed.ProcessGrid` (default: the current one); its expert
            groups were built at init (no communication here).
        expert_tensor_parallel: split every expert's hidden width over the grid's tensor group
            (AxoNN style; the batch is split over data x tensor, tokens are all-gathered over the
            tensor group); with ``expert_parallel > 1`` too (``[Note: both at once]``).
        stats_group: the ranks whose routing counts make the global batch's statistics (default:
            the data group; with ``expert_tensor_parallel`` each tensor group routes its gathered tokens).

    Example:
        >>> axonmpi.init(expert_parallel=2)                  # 4 ranks, G_data = 4
        >>> expert_parallel(model)                           # 2 expert groups of 2 ranks x 2 replicas
    """
    grid = get_grid() if grid is None else grid
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    if expert_parallel is None:
        expert_parallel = grid.expert_parallel
    ep_group, edp_group = grid.expert_groups(expert_parallel)
    data = grid.group_for("data")
    tp = None
    if expert_tensor_parallel:
        if grid.G_intra_r > 1 or grid.G_intra_d > 1:
            raise ValueError(f"rank {grid.rank}: tensor-parallel experts split over the grid's column group "
                             f"(G_intra_c); the grid has G_intra_r={grid.G_intra_r}, G_intra_d={grid.G_intra_d}")
        tp = grid.col_group
    ep = ep_group if ep_group.size > 1 else None
    # experts over the expert group (axis 0), then each expert's hidden width over the tensor group
    cuts = {"fc": ({"weight": 0, "bias": 0}, {"weight": 1, "bias": 1}), "proj": ({"weight": 0, "bias": 0}, {"weight": 2})}
    for m in moes:
        m.stats_group = stats_group if stats_group is not None else data
        if tp is not None and m.hidden % tp.size:
            raise ValueError(f"rank {grid.rank}: MoE hidden={m.hidden} does not divide over the tensor "
                             f"group of {tp.size} ranks")
        if ep is not None and m.num_experts % ep.size:
            raise ValueError(f"rank {grid.rank}: num_experts={m.num_experts} of {type(m).__name__} does not "
                             f"divide by expert_parallel={ep.size}")
        if ep is None and tp is None:
            m.dispatcher = None
            continue
        for name, (ep_axes, tp_axes) in cuts.items():
            serial = getattr(m.experts, name)
            if ep is None:
                lin = ShardedExpertLinear(serial, tp, tp_axes, (data,))
            elif tp is None:
                lin = ShardedExpertLinear(serial, ep, ep_axes, tuple(g for g in (edp_group, grid.group_for("tensor"))
                                                                     if g.size > 1))
            else:
                lin = ShardedExpertLinear(serial, ep, ep_axes, (edp_group,) if edp_group.size > 1 else (),
                                          then=(tp, tp_axes))
            lin.expert_parallel = ep is not None
            for q in (lin.weight, lin.bias):       # ZeRO-1 splits a tagged expert's state over its expert-data group
                if q is not None:
                    q.expert_parallel = ep is not None
            setattr(m.experts, name, lin)
        if ep is None:
            m.dispatcher = GatherDispatcher(tp) if tp.size > 1 else None
        elif tp is None or tp.size == 1:
            m.dispatcher = AllToAllDispatcher(ep, m.num_experts)
        else:
            m.dispatcher = GatheredAllToAllDispatcher(ep, m.num_experts, tp)
    return len(moes)
