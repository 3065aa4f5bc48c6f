"""Mixture of experts: expert parallelism against tensor-parallel experts, per MoE layer and rank (``docs/moe.md``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

__all__ = ["MoEEstimate", "moe_estimate", "moe_options"]


@dataclass(frozen=True)
class MoEEstimate:
    """Per rank, one MoE layer, one training step (forward + backward); bytes as the backend counts them.

    Attributes:
        option: ``"expert_parallel"`` (all-to-all dispatcher over the expert group),
            ``"tensor_parallel_experts"`` (tokens all-gathered and outputs reduce-scattered over the
            tensor group) or ``"expert_parallel_x_tensor_parallel_experts"`` (both: the gathered
            tokens go by all-to-all).
        group_size: EP, T, or EP * T.
        bytes_forward / bytes_backward: the token traffic of the dispatcher (each direction).
        count_bytes: the per-expert counts exchanged before each all-to-all (EP only).
        expert_params: expert parameters held by the rank.
        expert_flops: expert GEMM flops of the rank (forward + backward, balanced routing).
    """
    option: str
    group_size: int
    bytes_forward: float
    bytes_backward: float
    count_bytes: float
    expert_params: int
    expert_flops: float

    @property
    def bytes_total(self) -> float:
        """Forward + backward token bytes + count exchanges."""
        return self.bytes_forward + self.bytes_backward + self.count_bytes


def moe_estimate(tokens: int, width: int, hidden: int, num_experts: int, top_k: int, *,
                 expert_parallel: int = 1, tensor_parallel: int = 1, itemsize: int = 4,
                 off_rank_fraction: Optional[float] = None, bias: bool = True) -> MoEEstimate:
    """Bytes, expert parameters and flops of one ``nn.MoE`` layer per rank (see ``docs/moe.md``).

    Expert parallelism (``expert_parallel = EP > 1``): each rank routes ``tokens`` tokens into
    ``r = tokens * top_k`` rows; a fraction ``f`` of them leave the rank (default ``(EP-1)/EP``:
    uniform routing); the rank sends ``f r`` rows at dispatch and, balanced, ``f r`` at combine:
    ``2 f r width itemsize`` bytes forward and as many backward (the formula the tests check with
    the measured ``f``), plus ``E * 8`` bytes of counts per exchange (one forward).

    Tensor-parallel experts (``tensor_parallel = T > 1``): the ``tokens`` are all-gathered over the
    tensor group (counted as the gathered buffer, ``T tokens width itemsize``) and the outputs
    reduce-scattered (the send buffer, as much): ``2 T tokens width itemsize`` each direction,
    independent of routing and of ``top_k``; each rank holds ``1/T`` of every expert.

    Both (``EP > 1`` and ``T > 1``): the gather's bytes, plus the all-to-all's on the gathered
    ``T tokens top_k`` rows (``2 f T r width itemsize`` each direction); each rank holds ``1/T`` of
    ``E / EP`` experts.

    Example:
        >>> ep = moe_estimate(4096, 1024, 4096, 8, 2, expert_parallel=8)
        >>> tp = moe_estimate(4096, 1024, 4096, 8, 2, tensor_parallel=8)
        >>> ep.bytes_forward < tp.bytes_forward
        True
    """
    per_expert = 2 * width * hidden + ((hidden + width) if bias else 0)
    rows = tokens * top_k
    flops = 6.0 * rows * 2 * width * hidden          # every row through fc and proj, forward + backward
    ep, t = max(1, int(expert_parallel)), max(1, int(tensor_parallel))
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} does not divide by expert_parallel={ep}")
    f = (ep - 1) / ep if off_rank_fraction is None else float(off_rank_fraction)
    v = 2.0 * t * tokens * width * itemsize if t > 1 else 0.0          # the gather and the reduce-scatter
    v += 2.0 * f * t * rows * width * itemsize if ep > 1 else 0.0     # the all-to-all of the (gathered) rows
    counts = 8.0 * num_experts if ep > 1 else 0.0
    local = num_experts // ep
    params = local * per_expert if t == 1 else \
        local * (2 * width * hidden + (hidden if bias else 0)) // t + (local * width if bias else 0)
    option = "expert_parallel" if t == 1 else "tensor_parallel_experts" if ep == 1 else \
        "expert_parallel_x_tensor_parallel_experts"
    return MoEEstimate(option, ep * t if ep > 1 and t > 1 else max(ep, t), v, v, counts, int(params), flops)


def moe_options(tokens: int, width: int, hidden: int, num_experts: int, top_k: int, group_size: int,
                itemsize: int = 4) -> List[MoEEstimate]:
    """Both options over ``group_size`` ranks (expert parallelism when ``num_experts`` divides), fewest bytes first."""
    out = [moe_estimate(tokens, width, hidden, num_experts, top_k, tensor_parallel=group_size,
                        itemsize=itemsize)]
    if num_experts % group_size == 0:
        out.append(moe_estimate(tokens, width, hidden, num_experts, top_k, expert_parallel=group_size,
                                itemsize=itemsize))
    return sorted(out, key=lambda e: e.bytes_total)
