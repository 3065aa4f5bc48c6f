"""Memory per rank: parameters, gradients and optimizer state, and activations (Korthikanti et al. 2022).

[Note: memory]  Model state, per parameter held by the rank: mixed precision (fp16/bf16) keeps the
16-bit weight (2 bytes), an fp32 gradient (4) and fp32 master weight and two Adam moments (12):
18 bytes (Korthikanti's count); fp32 training 16.  ZeRO-1 shards the 12 optimizer bytes over the data
ranks; FSDP (``zero=2`` and 3) shards all of it over its shard group, and holds gathered units on top:
``zero=3`` two at a time (the one computing and the prefetched one; in a pipeline the whole stage, which
stays gathered for the step), ``zero=2`` every unit from its forward to its backward (the whole model's
parameters at the peak) -- see ``estimate.py``.

Activations of one block and micro-batch (bytes, 16-bit; ``s`` the rank's sequence, ``b`` the
micro-batch, ``a`` heads, ``t`` tensor ranks), Korthikanti's Table 2:

| recompute | tensor parallel | + sequence parallel |
|---|---|---|
| none | ``s b h (10 + 24/t + 5 a s / (h t))`` | ``s b h (34/t + 5 a s / (h t))`` |
| selective | ``s b h (10 + 24/t)`` | ``s b h 34 / t`` |
| full | ``2 s b h`` | ``2 s b h / t`` |

(a MoE block holds its MLP's ``19 s b h`` part ``top_k`` times).  Rank 0 holds as many chunk
micro-batches at once as the schedule's simulation says (1F1B: ``p``; interleaved:
``2 (p-1) + (v-1) p + 1`` chunks of ``L / (p v)`` layers, i.e. Korthikanti's ``1 + (p-1)/(p v)``);
with full recomputation one block's activations are rebuilt at a time on top.
"""
from __future__ import annotations

__all__ = ["state_bytes_per_param", "block_activation_bytes"]


def state_bytes_per_param(precision_bytes: int, zero: int, dp: int) -> float:
    """Bytes of model and optimizer state per parameter the rank holds (before FSDP's gathered layers)."""
    mixed = precision_bytes == 2
    weight = 2.0 if mixed else float(precision_bytes)
    grad = 4.0 if mixed else float(precision_bytes)
    opt = 12.0 if mixed else 2.0 * precision_bytes
    if zero == 1:
        return weight + grad + opt / dp
    if zero in (2, 3):
        return (weight + grad + opt) / dp
    return weight + grad + opt


def block_activation_bytes(s: float, s_kv: float, b: float, h: int, a: int, t: int, sp: bool, recompute: str,
                           act_bytes: int = 2, moe_top_k: int = 0) -> float:
    """Bytes of one block's activations held for the backward, per micro-batch (see the note).
    ``s``: the rank's tokens per sequence; ``s_kv``: keys each query sees."""
    scale = act_bytes / 2.0
    sbh = s * b * h
    if recompute == "full":
        return scale * 2.0 * sbh / (t if sp else 1)
    mlp_extra = 19.0 * sbh * (moe_top_k - 1) / t if moe_top_k > 1 else 0.0
    lin = 34.0 / t if sp else 10.0 + 24.0 / t
    attn = 5.0 * a * s_kv * s * b / t if recompute == "none" else 0.0
    return scale * (sbh * lin + attn + mlp_extra)
