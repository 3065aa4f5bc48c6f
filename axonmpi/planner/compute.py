"""Compute time of one transformer block (and the head) on one rank, per micro-batch.

[Note: ops]  Per block and micro-batch, on a rank holding ``n`` tokens (``b s / cp``; AxoNN: the rank's
own rows), with a tensor split of ``t`` ranks (``u`` = ``t`` with sequence parallelism, else 1 for the
parts Megatron replicates over the tensor group):

* GEMMs (``2 M N K`` flops each): QKV ``n x h x 3h/t``, scores and context ``2 n s h / t`` each
  (batched over the ``a/t`` heads), projection ``n x h/t x h``, MLP ``n x h x f/t`` and back
  (MoE: ``top_k`` times the tokens through ``E/ep`` experts, split over ``t`` unless expert-parallel);
* element-wise (bytes moved, ``b`` bytes per element): two LayerNorms ``4 n h b / u`` each, softmax
  ``2 (a/t) n s b``, attention dropout ``2.5 (a/t) n s b``, GeLU ``2 n f b / t``, two
  dropout + residual adds ``3.5 n h b / u`` each.

Each op takes ``max(flops / (peak eff(flops)), bytes / (memory bandwidth x memory efficiency))``
(a roofline; ``eff`` grows with the GEMM's size, see :class:`~axonmpi.planner.calibration.Calibration`).
Backward: twice the forward's GEMM flops (input and weight gradients) and 1.5 times its element-wise bytes.
Recomputation adds a forward: all of it (``full``) or the attention core (``selective``: scores,
softmax, dropout, context -- Korthikanti et al. 2022).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from .calibration import Calibration
from .hardware import HardwareSpec

__all__ = ["Op", "block_ops", "head_ops", "ops_time", "gemm_efficiency"]


@dataclass(frozen=True)
class Op:
    """One kernel: ``flops`` (0 for element-wise), ``bytes`` moved through memory, in the attention core?"""
    name: str
    flops: float
    bytes: float
    core: bool = False
    count: float = 1.0


def gemm_efficiency(flops: float, cal: Calibration) -> float:
    """The fraction of peak a GEMM of ``flops`` reaches."""
    g = flops / 1e9
    return cal.gemm_max * g / (g + cal.gemm_half_gflop)


def block_ops(n: float, seq_kv: float, h: int, heads: int, ffn: int, t: int, sp: bool, b: int,
              moe_experts_local: float = 0.0, moe_tokens: float = 0.0, moe_split: int = 1) -> List[Op]:
    """The forward ops of one block on one rank (see the module's note).  ``seq_kv``: keys each query sees;
    ``moe_experts_local`` > 0: the MLP is ``moe_experts_local`` experts over ``moe_tokens`` routed tokens
    (split ``moe_split`` ways)."""
    u = t if sp else 1
    ops = [Op("qkv", 2.0 * n * h * 3 * h / t, b * (n * h + 3 * h * h / t + 3 * n * h / t)),
           Op("scores", 2.0 * n * seq_kv * h / t, b * (2 * n * h / t + heads / t * n * seq_kv), core=True),
           Op("softmax", 0.0, 2.0 * b * heads / t * n * seq_kv, core=True),
           Op("attn-dropout", 0.0, 2.5 * b * heads / t * n * seq_kv, core=True),
           Op("context", 2.0 * n * seq_kv * h / t, b * (heads / t * n * seq_kv + 2 * n * h / t), core=True),
           Op("proj", 2.0 * n * h * h / t, b * (n * h / t + h * h / t + n * h)),
           Op("layernorm", 0.0, 4.0 * b * n * h / u, count=2),
           Op("dropout-add", 0.0, 3.5 * b * n * h / u, count=2)]
    if moe_experts_local:
        rows = moe_tokens / max(moe_experts_local, 1.0)        # tokens per local expert (balanced routing)
        e = moe_experts_local
        ops += [Op("router", 2.0 * n * h * 8, b * n * h),
                Op("fc1", 2.0 * rows * h * ffn / moe_split, b * (rows * h + h * ffn / moe_split + rows * ffn / moe_split),
                   count=e),
                Op("gelu", 0.0, 2.0 * b * moe_tokens * ffn / moe_split),
                Op("fc2", 2.0 * rows * ffn / moe_split * h, b * (rows * ffn / moe_split + h * ffn / moe_split + rows * h),
                   count=e)]
    else:
        ops += [Op("fc1", 2.0 * n * h * ffn / t, b * (n * h + h * ffn / t + n * ffn / t)),
                Op("gelu", 0.0, 2.0 * b * n * ffn / t),
                Op("fc2", 2.0 * n * ffn / t * h, b * (n * ffn / t + h * ffn / t + n * h))]
    return ops


def head_ops(n: float, h: int, vocab: int, t: int, b: int) -> List[Op]:
    """The output layer and the loss on the last stage (forward)."""
    return [Op("logits", 2.0 * n * h * vocab / t, b * (n * h + h * vocab / t + n * vocab / t)),
            Op("cross-entropy", 0.0, 3.0 * 4 * n * vocab / t)]


def ops_time(ops: List[Op], hw: HardwareSpec, precision: str, cal: Calibration, which: str = "all") -> float:
    """Seconds for ``ops`` (``which``: ``all``, ``core`` (attention core only) or ``gemm`` (matrix work only))."""
    peak = hw.peak_flops(precision)
    mem = hw.memory_bw * cal.memory
    total = 0.0
    for op in ops:
        if which == "core" and not op.core:
            continue
        tc = op.flops / (peak * gemm_efficiency(op.flops, cal)) if op.flops else 0.0
        if which == "gemm":
            total += op.count * tc
            continue
        total += op.count * max(tc, op.bytes / mem)
    return total


def fwd_bwd(ops: List[Op], hw: HardwareSpec, precision: str, cal: Calibration) -> Tuple[float, float, float]:
    """(forward, backward-input, backward-weight) seconds: the backward runs each GEMM twice (input and weight
    gradients) and moves 1.5 times the forward's element-wise bytes (it reads the saved input and the incoming
    gradient and writes one gradient where the forward read one tensor and wrote one)."""
    f = ops_time(ops, hw, precision, cal)
    g = ops_time(ops, hw, precision, cal, "gemm")
    return f, g + 1.5 * (f - g), g
