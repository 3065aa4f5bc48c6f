"""Compute time of one transformer block (and the head) on one rank, per micro-batch.

[Note: ops]  Per block and micro-batch, on a rank holding ``n`` tokens (``b s / cp``; AxoNN: the rank's
own rows, on which it runs every Linear whole), with a tensor split of ``t`` ranks (``u`` = ``t`` with
sequence parallelism, else 1 for the parts Megatron replicates over the tensor group), ``kv`` key/value
heads of ``d = h / a`` (grouped-query attention when ``kv < a``):

* GEMMs (``2 M N K`` flops each): QKV ``n x h x (h + 2 kv d)/t``, scores and context ``2 n s h / t`` each
  (batched over the ``a/t`` heads), projection ``n x h/t x h``, the MLP ``n x h x f/t`` and back -- a
  SwiGLU MLP (``gated``) has two ``n x h x f/t`` (gate, up) -- (MoE: ``top_k`` times the tokens through
  ``E/ep`` experts, split over ``t`` unless expert-parallel);
* element-wise (bytes moved, ``b`` bytes per element; ``elements`` for a measured machine): two norms
  ``4 n h b / u`` each, softmax ``2 (a/t) n s b``, attention dropout ``2.5 (a/t) n s b`` (when the run has
  dropout), GeLU ``2 n f b / t`` (SwiGLU: SiLU and the product, ``3 n f b / t``), two (dropout +)
  residual adds ``3.5 n h b / u`` each, rotary embeddings on q and k ``2 n (h + kv d) b / t``.

On a datasheet machine each op takes ``max(flops / (peak eff(flops)), bytes / (memory bandwidth x memory
efficiency))`` (a roofline; ``eff`` grows with the GEMM's size, see
:class:`~axonmpi.planner.calibration.Calibration`); the backward runs twice the forward's GEMM flops
(input and weight gradients) and 1.5 times its element-wise bytes.  On a measured machine
(:attr:`HardwareSpec.is_measured`) the same ops take their measured rates: a GEMM's flops at the
measured GEMM rate (backward: 2x), the attention core's at its own measured rate (backward: 2x, no
weight), and each element-wise op its elements times the measured seconds per element of its kind
(forward + backward together, ``measure_kernels``: GELU for GeLU and SwiGLU, LayerNorm for either
norm, softmax for the scores and the cross-entropy, add for residuals and rotary), split 1 : 1.5 between
forward and backward.  Recomputation adds a forward: all of it (``full``) or the attention core
(``selective``: scores, softmax, dropout, context -- Korthikanti et al. 2022).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from .calibration import Calibration
from .hardware import HardwareSpec

__all__ = ["Op", "block_ops", "head_ops", "ops_time", "gemm_efficiency", "fwd_bwd", "MEMORY_BOUND"]

#: Element-wise kinds that stream memory (stretched by the cores in effect for memory-bound work on a CPU).
MEMORY_BOUND = ("add",)
#: The measured cost each element-wise kind takes (``measure_kernels``' names).
_MEASURED_AS = {"norm": "layernorm", "gelu": "gelu", "softmax": "softmax", "add": "add", "xent": "softmax",
                "dropout": ""}


@dataclass(frozen=True)
class Op:
    """One kernel: ``flops`` (0 for element-wise), ``bytes`` moved through memory, ``elements`` it touches,
    its ``kind`` (``gemm``, ``attn`` -- the attention core's batched matmuls --, ``norm``, ``gelu``,
    ``softmax``, ``dropout``, ``add``, ``xent``), in the attention core?"""
    name: str
    flops: float
    bytes: float
    core: bool = False
    count: float = 1.0
    kind: str = "gemm"
    elements: float = 0.0


def gemm_efficiency(flops: float, cal: Calibration) -> float:
    """The fraction of peak a GEMM of ``flops`` reaches."""
    g = flops / 1e9
    return cal.gemm_max * g / (g + cal.gemm_half_gflop)


def block_ops(n: float, seq_kv: float, h: int, heads: int, ffn: int, t: int, sp: bool, b: int,
              moe_experts_local: float = 0.0, moe_tokens: float = 0.0, moe_split: int = 1, *,
              kv_heads: int = 0, gated: bool = False, rotary: bool = False, dropout: bool = True) -> List[Op]:
    """The forward ops of one block on one rank (see the module's note).  ``seq_kv``: keys each query sees;
    ``moe_experts_local`` > 0: the MLP is ``moe_experts_local`` experts over ``moe_tokens`` routed tokens
    (split ``moe_split`` ways)."""
    u = t if sp else 1
    kv = kv_heads or heads
    qkv = h + 2 * kv * (h // heads)
    drop = 1.0 if dropout else 0.0
    ops = [Op("qkv", 2.0 * n * h * qkv / t, b * (n * h + h * qkv / t + n * qkv / t)),
           Op("scores", 2.0 * n * seq_kv * h / t, b * (2 * n * h / t + heads / t * n * seq_kv), core=True, kind="attn"),
           Op("softmax", 0.0, 2.0 * b * heads / t * n * seq_kv, core=True, kind="softmax",
              elements=heads / t * n * seq_kv),
           Op("attn-dropout", 0.0, 2.5 * b * heads / t * n * seq_kv * drop, core=True, kind="dropout",
              elements=heads / t * n * seq_kv * drop),
           Op("context", 2.0 * n * seq_kv * h / t, b * (heads / t * n * seq_kv + 2 * n * h / t), core=True,
              kind="attn"),
           Op("proj", 2.0 * n * h * h / t, b * (n * h / t + h * h / t + n * h)),
           Op("norm", 0.0, 4.0 * b * n * h / u, count=2, kind="norm", elements=n * h / u),
           Op("dropout-add", 0.0, (2.0 + 1.5 * drop) * b * n * h / u, count=2, kind="add", elements=n * h / u)]
    if rotary:
        ops.append(Op("rotary", 0.0, 2.0 * b * n * (h + kv * (h // heads)) / t, kind="add",
                      elements=n * (h + kv * (h // heads)) / t))
    ups = 2 if gated else 1
    act = Op("swiglu" if gated else "gelu", 0.0, (3.0 if gated else 2.0) * b * n * ffn / t, kind="gelu",
             elements=n * ffn / t)
    if moe_experts_local:
        rows = moe_tokens / max(moe_experts_local, 1.0)        # tokens per local expert (balanced routing)
        e = moe_experts_local
        f = ffn / moe_split
        ops += [Op("router", 2.0 * n * h * 8, b * n * h),
                Op("fc1", 2.0 * rows * h * f, b * (rows * h + h * f + rows * f), count=e * ups),
                Op(act.name, 0.0, act.bytes * moe_tokens / n * t / moe_split, kind="gelu",
                   elements=moe_tokens * f),
                Op("fc2", 2.0 * rows * f * h, b * (rows * f + h * f + rows * h), count=e)]
    else:
        ops += [Op("fc1", 2.0 * n * h * ffn / t, b * (n * h + h * ffn / t + n * ffn / t), count=ups), act,
                Op("fc2", 2.0 * n * ffn / t * h, b * (n * ffn / t + h * ffn / t + n * h))]
    return ops


def head_ops(n: float, h: int, vocab: int, t: int, b: int, split: bool = True) -> List[Op]:
    """The final norm, the output layer and the loss on the last stage (forward); ``split``: the head is
    split over the ``t`` tensor ranks (else each rank runs it whole)."""
    v = vocab / t if split else vocab
    return [Op("final-norm", 0.0, 4.0 * b * n * h, kind="norm", elements=n * h),
            Op("logits", 2.0 * n * h * v, b * (n * h + h * v + n * v)),
            Op("cross-entropy", 0.0, 3.0 * 4 * n * v, kind="xent", elements=n * v)]


def _measured(op: Op, hw: HardwareSpec) -> Tuple[float, float, float]:
    """(forward, backward-input, backward-weight) seconds of one op at the measured rates (no stretch)."""
    if op.kind == "gemm":
        f = op.flops / hw.kernel("flops")
        return f, f, f
    if op.kind == "attn":
        f = op.flops / (hw.kernel("attn_flops") or hw.kernel("flops"))
        return f, 2 * f, 0.0
    cost = hw.kernel(_MEASURED_AS.get(op.kind, "")) if _MEASURED_AS.get(op.kind) else 0.0
    total = op.elements * cost
    return total / 2.5, 1.5 * total / 2.5, 0.0


def _roofline(op: Op, hw: HardwareSpec, precision: str, cal: Calibration) -> Tuple[float, float, float]:
    peak = hw.peak_flops(precision)
    tc = op.flops / (peak * gemm_efficiency(op.flops, cal)) if op.flops else 0.0
    tm = op.bytes / (hw.memory_bw * cal.memory)
    if op.flops:        # the attention core's second matmul is booked as the "weight" part, as the fit had it
        f = max(tc, tm)
        return f, tc + 1.5 * (f - tc), tc
    return tm, 1.5 * tm, 0.0


def op_times(op: Op, hw: HardwareSpec, precision: str, cal: Calibration, stretch: Tuple[float, float] = (1.0, 1.0)
             ) -> Tuple[float, float, float]:
    """(forward, backward-input, backward-weight) seconds of ``op`` (times its count); ``stretch``: the
    factors for compute-bound and memory-bound work (ranks sharing a CPU's cores)."""
    f, bi, bw = _measured(op, hw) if hw.is_measured else _roofline(op, hw, precision, cal)
    s = (stretch[1] if op.kind in MEMORY_BOUND else stretch[0]) * op.count
    return f * s, bi * s, bw * s


def ops_time(ops: List[Op], hw: HardwareSpec, precision: str, cal: Calibration, which: str = "all",
             stretch: Tuple[float, float] = (1.0, 1.0)) -> float:
    """Forward seconds of ``ops`` (``which``: ``all``, ``core`` (attention core only) or ``gemm`` (the
    Linears' GEMMs only))."""
    total = 0.0
    for op in ops:
        if which == "core" and not op.core:
            continue
        if which == "gemm" and op.kind != "gemm":
            continue
        total += op_times(op, hw, precision, cal, stretch)[0]
    return total


def fwd_bwd(ops: List[Op], hw: HardwareSpec, precision: str, cal: Calibration,
            stretch: Tuple[float, float] = (1.0, 1.0)) -> Tuple[float, float, float]:
    """(forward, backward-input, backward-weight) seconds of ``ops``: the backward runs each GEMM twice
    (input and weight gradients) and moves 1.5 times the forward's element-wise bytes (it reads the saved
    input and the incoming gradient and writes one gradient where the forward read one tensor and wrote one)."""
    f = bi = bw = 0.0
    for op in ops:
        a, b, c = op_times(op, hw, precision, cal, stretch)
        f, bi, bw = f + a, bi + b, bw + c
    return f, bi, bw
