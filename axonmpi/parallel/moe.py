"""Expert parallelism for ``nn.MoE``: experts split over an expert group carved from the data dimension,
tokens dispatched with a variable-count all-to-all; or tensor-parallel experts with tokens gathered.

[Note: expert parallelism on the grid]
``expert_parallel = EP`` divides ``G_data`` (Megatron's and DeepSpeed's rule). The grid's
:meth:`~axonmpi.distributed.ProcessGrid.expert_groups` carves two groups from the data dimension:
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
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..autograd import ops
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

__all__ = ["AllToAllDispatcher", "GatherDispatcher", "ShardedExpertLinear", "expert_parallel",
           "expert_parameters", "hook_expert_gradients"]


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
        xl = xr if identity else ops.getitem(xr, xp.asarray(perm))  # expert-major
        yl = experts(xl, rcm.sum(0))
        yr = yl if identity else ops.getitem(yl, xp.asarray(np.argsort(perm, kind="stable")))
        return all_to_all_along(yr, g, 0, 0, recv, send)


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


# -- sharded expert weights ------------------------------------------------------------------------
class ShardedExpertLinear(_AxisSharded):
    """This rank's slice of an :class:`~axonmpi.nn.moe.ExpertLinear`: ``axis`` 0 (experts, expert
    parallelism) or 1 / 2 (an expert's hidden width, tensor-parallel experts) over ``group``.

    Serial names and shapes in state dicts (from the placements); placement: a ``DIM`` shard
    over ``group``, replicated over ``replicas``.
    """

    def __init__(self, serial: ExpertLinear, group, axes: dict, replicas=()):
        super().__init__()
        self.group = group
        self.num_experts, self.in_features, self.out_features = (serial.num_experts, serial.in_features,
                                                                 serial.out_features)
        for name in ("weight", "bias"):
            p = getattr(serial, name)
            if p is None:
                self.bias = None
                continue
            full = np.asarray(p.data)
            axis = axes.get(name)
            if axis is None:
                q = set_placement(Parameter(full.copy()), Placement(replicas=tuple(replicas) + (group,),
                                                                     full_shape=tuple(full.shape)))
            else:
                pl = Placement(shards=(Shard(group, ShardKind.DIM, axis),), replicas=tuple(replicas),
                               full_shape=tuple(full.shape))
                q = set_placement(Parameter(placed.cut(full, pl)), pl)
            setattr(self, name, q)

    def pieces(self):
        """Per local expert ``(weight, bias)``; a bias replicated over ``group`` is added on its rank 0
        only (times zero elsewhere, so every rank still gets a gradient and its reduction runs)."""
        out = ExpertLinear.pieces(self)
        if self.bias is not None and not placement_of(self.bias).layout and self.group.rank != 0:
            out = [(w, b * 0.0) for w, b in out]
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features="
                f"{self.out_features}, local={tuple(self.weight.shape)}, group={list(self.group.ranks)}")


def expert_parameters(module: Module):
    """The parameters of ``module`` that are split over an expert group (``ShardedExpertLinear`` on axis 0)."""
    out = []
    for m in module.modules():
        if isinstance(m, ShardedExpertLinear) and getattr(m, "expert_parallel", False):
            out.extend(p for p in (m.weight, m.bias) if p is not None)
    return out


def expert_parallel(module: Module, expert_parallel: int = 1, *, grid=None,
                    expert_tensor_parallel: bool = False, stats_group=None) -> int:
    """Lay out every :class:`~axonmpi.nn.MoE` of ``module`` over the grid (in place); returns how many.

    Args:
        module: a model holding ``nn.MoE`` layers (built the same way on every rank).
        expert_parallel: EP, dividing the grid's ``G_data``; the experts of each MoE (E divisible
            by EP) are split over the expert group, tokens go by all-to-all. 1: experts replicated.
        grid: the :class:`~axonmpi.distributed.ProcessGrid` (default: the current one). Collective:
            makes the grid's expert groups (:meth:`~axonmpi.distributed.ProcessGrid.expert_groups`).
        expert_tensor_parallel: split every expert's hidden width over the grid's tensor group
            instead (AxoNN style; the batch is split over data x tensor, tokens are all-gathered
            over the tensor group). Needs ``expert_parallel=1``.
        stats_group: the ranks whose routing counts make the global batch's statistics (default:
            the data group; with ``expert_tensor_parallel`` each tensor group routes its gathered tokens).

    Example:
        >>> axonmpi.init()                                   # 4 ranks, G_data = 4
        >>> expert_parallel(model, 2)                       # 2 experts groups of 2 ranks x 2 replicas
    """
    grid = get_grid() if grid is None else grid
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    ep_group, edp_group = grid.expert_groups(expert_parallel)
    data = grid.group_for("data")
    if expert_tensor_parallel:
        if expert_parallel != 1:
            raise NotImplementedError(f"rank {grid.rank}: expert_tensor_parallel with expert_parallel="
                                      f"{expert_parallel} is not built yet; use one of them")
        if grid.G_intra_r > 1 or grid.G_intra_d > 1:
            raise ValueError(f"rank {grid.rank}: tensor-parallel experts split over the grid's column group "
                             f"(G_intra_c); the grid has G_intra_r={grid.G_intra_r}, G_intra_d={grid.G_intra_d}")
        tp = grid.col_group
        stats = stats_group if stats_group is not None else data
        for m in moes:
            if m.hidden % tp.size:
                raise ValueError(f"rank {grid.rank}: MoE hidden={m.hidden} does not divide over the tensor "
                                 f"group of {tp.size} ranks")
            m.experts.fc = ShardedExpertLinear(m.experts.fc, tp, {"weight": 1, "bias": 1}, (data,))
            m.experts.proj = ShardedExpertLinear(m.experts.proj, tp, {"weight": 2}, (data,))
            m.dispatcher = GatherDispatcher(tp) if tp.size > 1 else None
            m.stats_group = stats
        return len(moes)
    tensor = grid.group_for("tensor")
    for m in moes:
        m.stats_group = stats_group if stats_group is not None else data
        if ep_group.size == 1:
            m.dispatcher = None
            continue
        if m.num_experts % ep_group.size:
            raise ValueError(f"rank {grid.rank}: num_experts={m.num_experts} of {type(m).__name__} does not "
                             f"divide by expert_parallel={ep_group.size}")
        reps = tuple(g for g in (edp_group, tensor) if g.size > 1)
        for name in ("fc", "proj"):
            lin = ShardedExpertLinear(getattr(m.experts, name), ep_group, {"weight": 0, "bias": 0}, reps)
            lin.expert_parallel = True
            setattr(m.experts, name, lin)
        m.dispatcher = AllToAllDispatcher(ep_group, m.num_experts)
    return len(moes)


def hook_expert_gradients(params, data_group, batch_shards: int) -> list:
    """Reduce expert gradients as each completes: summed over the groups of the grad-sync table (the
    expert-data group), divided by ``batch_shards`` (the data-parallel mean). Returns the hook handles.

    DDP over ``data_group`` takes the other parameters (``DistributedDataParallel(...,
    ignored_parameters=params)``).
    """
    from ..distributed import all_reduce
    from .grad_sync import reduction_groups
    scale = 1.0 / batch_shards

    def reduce(p):
        grad = p.grad.data
        for grp in reduction_groups(p, data_group):
            all_reduce(grad, group=grp, out=grad)
        if scale != 1.0:
            grad *= scale

    return [p.register_post_accumulate_grad_hook(reduce) for p in params]
