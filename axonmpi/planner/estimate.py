"""One layout's step time, memory and breakdown: the cost model of every axis, per rank and per step.

[Note: the step]  For ``m = B / (dp b)`` micro-batches (AxoNN: ``B / (dp T b)``, every rank of a tensor
block reads its own rows), ``v`` chunks per pipeline rank of ``L / (p v)`` blocks:

* one chunk's forward ``F``, input-gradient backward ``B`` and weight-gradient backward ``W``
  (:mod:`.compute`; recomputation adds a forward, or its attention core, to ``B``) plus the tensor
  group's collectives (Megatron: 2 all-reduces forward, 2 backward, 2 more in a full recomputation:
  4 per block, 6 with full recomputation;
  with sequence parallelism all-gathers + reduce-scatters of the same time; AxoNN 3-D: the easy-mode
  volumes of ``axonmpi.plan.linear_volumes`` per group), the context group's (ring: ``cp - 1``
  exchanges of K and V forward, ``2 cp - 1`` backward (K/V on, dK/dV along, and dK/dV's hop home),
  hidden under the attention core as far as it lasts; Ulysses: 4 all-to-alls of the rank's ``n h / t``
  each way), the expert group's (dispatch and combine all-to-alls each way) and
  the point-to-point transfer to the next stage (Megatron's scatter/gather: ``1/t`` of the
  activation per rank over its own card, then an all-gather inside the node);
* the pipeline: ``m v (F + B + W)`` on the busiest rank (the last also runs the head and the loss)
  plus the bubble that ``schedules.simulate`` gives for the schedule (1F1B, interleaved, ZB-H1, ZBV);
* gradients over the data (x context) group: DDP all-reduce, ZeRO-1 reduce-scatter + all-gather,
  FSDP all-gather forward and backward and reduce-scatter per micro-batch (in a pipeline: one all-gather
  and one reduce-scatter of the stage a step, exposed); with ``overlap=1`` DDP's
  buckets are reduced during the last micro-batch's backward and FSDP's gathers prefetched under
  compute (the part that does not fit is exposed); ``overlap=0``: all after the backward;
* ``tp_overlap=1`` (Megatron since 2022's asynchronous tensor-parallel all-reduce): the backward's
  input-gradient all-reduces (or SP's collectives) run under the weight-gradient GEMMs;
* the tied embedding's gradient between the first and last stage, and the optimizer step
  (30 bytes of memory traffic per local parameter for mixed-precision Adam).

Memory: :mod:`.memory`.  ``tflops_per_gpu`` is Megatron's: model flops including recomputation's
(``96 B s l h^2 (1 + s/6h + V/16lh)`` for a dense GPT with full recomputation) over GPUs and step time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from .calibration import FITTED, Calibration
from .comm import collective_time
from .compute import block_ops, fwd_bwd, head_ops, ops_time
from .hardware import HardwareSpec
from .memory import block_activation_bytes, state_bytes_per_param
from .model import ParallelLayout, TrainConfig, TransformerConfig
from .pipeline import bubble_and_peak

__all__ = ["PlanEstimate", "estimate_layout", "check_layout", "model_flops"]

GIB = 2.0 ** 30


@dataclass
class PlanEstimate:
    """The prediction for one layout (seconds, bytes)."""
    layout: ParallelLayout
    microbatches: int
    step_time: float
    memory_bytes: float
    tflops_per_gpu: float
    breakdown: Dict[str, float] = field(default_factory=dict)
    memory: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, object]:
        """The JSON form ``axonmpi plan --json`` prints."""
        return {"layout": self.layout.as_dict(), "micro_batches": self.microbatches,
                "step_time_s": self.step_time, "memory_gib": self.memory_bytes / GIB,
                "tflops_per_gpu": self.tflops_per_gpu,
                "breakdown": {**{k: v for k, v in self.breakdown.items()},
                              **{f"memory_{k}_gib": v / GIB for k, v in self.memory.items()}}}


def model_flops(cfg: TransformerConfig, train: TrainConfig, recompute: bool = True) -> float:
    """Flops of one step: forward + backward (``3x`` forward), plus the recomputed forward when ``recompute``
    (full: all of it; selective: the attention core)."""
    h, s, f = cfg.width, cfg.seq, cfg.hidden
    tokens = float(train.global_batch) * s
    dense_mlp = 4.0 * h * f
    moe_mlp = 4.0 * h * f * max(cfg.top_k, 1)
    mlp = (cfg.layers - cfg.moe_layers) * dense_mlp + cfg.moe_layers * moe_mlp
    lin = cfg.layers * 8.0 * h * h + mlp                  # per token, forward: QKV + projection, MLPs
    attn = cfg.layers * 4.0 * s * h
    head = 2.0 * h * cfg.vocab
    fwd = tokens * (lin + attn + head)
    total = 3.0 * fwd
    if recompute and train.recompute == "full":
        total += tokens * (lin + attn)
    elif recompute and train.recompute == "selective":
        total += tokens * attn
    return total


def check_layout(cfg: TransformerConfig, train: TrainConfig, lay: ParallelLayout, world: Optional[int] = None) -> int:
    """Raise ``ValueError`` naming the value and the fix when ``lay`` cannot run; return ``m``."""
    if world is not None and lay.world != world:
        raise ValueError(f"layout {lay.label()} uses {lay.world} ranks (tensor {lay.tensor} x cp {lay.cp} x pp "
                         f"{lay.pp} x dp {lay.dp}), not --world {world}; change dp to {world // max(1, lay.world // lay.dp)}"
                         if world % max(1, lay.world // lay.dp) == 0 else
                         f"layout {lay.label()} uses {lay.world} ranks, not --world {world}")
    if cfg.heads % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide heads={cfg.heads}; pick a tp that divides the heads")
    if lay.cp > 1 and lay.cp_kind == "ulysses" and cfg.heads % (lay.tp * lay.cp):
        raise ValueError(f"Ulysses needs heads={cfg.heads} divisible by tp x cp = {lay.tp * lay.cp}; use cp_kind=ring")
    if cfg.seq % lay.cp:
        raise ValueError(f"cp={lay.cp} does not divide seq={cfg.seq}")
    if lay.axonn > 1:
        h, f = cfg.width, cfg.hidden
        for i, o in ((h, 3 * h), (h, h), (h, f), (f, h)):
            if o % lay.row or i % lay.col or (i * o // (lay.row * lay.col)) % lay.depth:
                raise ValueError(f"AxoNN row={lay.row}, col={lay.col}, depth={lay.depth} does not divide the "
                                 f"({i}, {o}) Linear (out % row, in % col, in out / (row col) % depth)")
    if cfg.experts:
        if cfg.experts % lay.ep:
            raise ValueError(f"ep={lay.ep} does not divide experts={cfg.experts}")
    elif lay.ep > 1:
        raise ValueError(f"ep={lay.ep} needs a mixture-of-experts model (--experts)")
    chunks = lay.pp * lay.chunks
    if chunks > cfg.layers:
        raise ValueError(f"pp x chunks = {chunks} exceeds layers={cfg.layers}; use fewer stages or vp")
    rows = lay.dp * lay.axonn * train.micro_batch
    if train.global_batch % rows:
        raise ValueError(f"global batch {train.global_batch} does not divide into dp x micro-batch"
                         f"{' x row x col x depth' if lay.axonn > 1 else ''} = {rows}; change --micro-batch or dp")
    m = train.global_batch // rows
    if lay.pipeline_schedule == "interleaved" and lay.pp > 1 and m % lay.pp:
        raise ValueError(f"the interleaved schedule needs micro-batches m = {m} to be a multiple of pp={lay.pp}; "
                         f"change --micro-batch or dp")
    return m


def estimate_layout(cfg: TransformerConfig, train: TrainConfig, lay: ParallelLayout, hw: HardwareSpec,
                    cal: Calibration = FITTED, world: Optional[int] = None) -> PlanEstimate:
    """Predicted step time, memory per rank and breakdown of ``lay`` (see the module's note)."""
    m = check_layout(cfg, train, lay, world)
    pr, pb = train.precision, train.bytes
    h, a, s, f = cfg.width, cfg.heads, cfg.seq, cfg.hidden
    t = lay.tp                                     # Megatron's split (1 under AxoNN: ranks hold whole rows)
    T = lay.tensor
    sp = bool(lay.sp)
    b = train.micro_batch
    n = b * s / lay.cp                             # tokens of one micro-batch on the rank
    s_loc = s / lay.cp
    v = lay.chunks
    per_chunk = cfg.layers / (lay.pp * v)
    lpc = math.ceil(per_chunk)                     # busiest chunk's blocks
    moe_frac = cfg.moe_layers / cfg.layers if cfg.experts else 0.0

    # -- compute of one block --------------------------------------------------------------------------
    dense = block_ops(n, s, h, a, f, t, sp, pb)
    Fd, Bd, Wd = fwd_bwd(dense, hw, pr, cal)
    core = ops_time(dense, hw, pr, cal, "core")
    full = ops_time(dense, hw, pr, cal)
    if cfg.experts:
        moe = block_ops(n, s, h, a, f, t, sp, pb, moe_experts_local=cfg.experts / lay.ep,
                        moe_tokens=n * cfg.top_k, moe_split=t)
        Fm, Bm, Wm = fwd_bwd(moe, hw, pr, cal)
        Fd, Bd, Wd = ((1 - moe_frac) * x + moe_frac * y for x, y in ((Fd, Fm), (Bd, Bm), (Wd, Wm)))
        full = (1 - moe_frac) * full + moe_frac * ops_time(moe, hw, pr, cal)
    rec = {"none": 0.0, "selective": core, "full": full}[train.recompute]

    # -- collectives of one block: forward, backward, and the forward again with full recomputation ---------
    # Megatron's f/g pair: each forward all-reduce has one backward all-reduce (of the input gradient),
    # and a full recomputation repeats the forward's: 2 + 2 (+ 2) all-reduces per block.  With sequence
    # parallelism: forward 2 all-gathers + 2 reduce-scatters; backward the all-gather of dY (g-bar's
    # backward), the reduce-scatter of dX (g's) and the re-gather of the sharded input X for the weight
    # gradient (Megatron keeps X sharded): 2 + 2 + 2.  ``tp_hideable``: what ``tp_overlap`` can run under
    # GEMMs (the dX reduction under the weight-gradient GEMM; SP's re-gather under the input-gradient GEMM).
    passes = 2.0 if train.recompute != "full" else 3.0   # forward, backward, recomputed forward
    act = n * h * pb
    tp_fwd = tp_bwd = 0.0
    tp_hideable = (0.0, 0.0)                  # (under the weight-gradient GEMMs, under the input-gradient GEMMs)
    if t > 1:
        if sp:
            ag = collective_time("allgather", act, t, 1, hw, cal, 2)
            rs = collective_time("reducescatter", act, t, 1, hw, cal, 2)
            tp_fwd, tp_bwd, tp_hideable = ag + rs, 2 * ag + rs, (rs, ag)
        else:
            tp_fwd = tp_bwd = collective_time("allreduce", act, t, 1, hw, cal, 2)
            tp_hideable = (tp_fwd, 0.0)
    if lay.axonn > 1:
        from ..plan import linear_volumes
        sizes = {"col": (lay.col, 1), "row": (lay.row, lay.col), "depth": (lay.depth, lay.col * lay.row)}
        for i, o in ((h, 3 * h), (h, h), (h, f), (f, h)):
            for g, kinds in linear_volumes(i, o, n, lay.row, lay.col, lay.depth).items():
                size, ip = sizes[g]
                for kind, vol in kinds.items():
                    k = "allreduce" if kind == "allreduce" else "allgather"
                    # the volumes are forward + backward: half of them one pass
                    tp_fwd += collective_time(k, vol * pb, size, ip, hw, cal) / 2.0
        tp_bwd = tp_fwd
    cp_fwd = cp_bwd = 0.0
    if lay.cp > 1:
        ip = T * lay.pp
        if lay.cp_kind == "ring":
            kv = 2.0 * n * h / t * pb
            ring = (lay.cp - 1) * collective_time("p2p", kv, 2, ip, hw, cal)
            back = (2 * lay.cp - 1) / (lay.cp - 1) * ring      # K/V on, dK/dV along, and dK/dV's hop home
            cp_fwd = max(0.0, ring - core if lay.overlap else ring)
            cp_bwd = max(0.0, back - 2 * core if lay.overlap else back)
        else:            # the rank's q, k, v and output (n h / t each) through all-to-alls
            cp_fwd = collective_time("alltoall", n * h / t * pb, lay.cp, ip, hw, cal, 4)
            cp_bwd = cp_fwd
    ep_fwd = 0.0
    if cfg.experts and lay.ep > 1:
        ep_fwd = moe_frac * collective_time("alltoall", n * cfg.top_k * h * pb, lay.ep, T * lay.pp * lay.cp, hw, cal, 2)
    tp_chunk = lpc * (tp_fwd * (passes - 1) + tp_bwd)
    cp_chunk = lpc * (cp_fwd * (passes - 1) + cp_bwd)
    ep_chunk = lpc * ep_fwd * passes

    # -- pipeline ---------------------------------------------------------------------------------------
    p2p = 0.0
    if lay.pp > 1:
        if T > 1 and lay.axonn == 1:           # scatter/gather: 1/t over each card, all-gather in the node
            p2p = collective_time("p2p", act / t, 2, T, hw, cal) + (0.0 if sp else collective_time(
                "allgather", act, t, 1, hw, cal))
        else:
            p2p = collective_time("p2p", act, 2, T, hw, cal)
    comm_f = lpc * (tp_fwd + cp_fwd + ep_fwd)
    F = lpc * Fd + comm_f + p2p
    comm_b = tp_chunk + cp_chunk + ep_chunk - comm_f
    tp_hidden = 0.0
    if lay.tp_overlap:       # the backward's dX reductions under the weight-gradient GEMMs (SP: re-gather under dX's)
        tp_hidden = lpc * (min(tp_hideable[0], Wd) + min(tp_hideable[1], Bd))
        comm_b -= tp_hidden
    W = lpc * Wd
    Bi = lpc * (Bd + rec) + comm_b + p2p
    hd = head_ops(n, h, cfg.vocab, t, pb)
    Hf, Hb, Hw = fwd_bwd(hd, hw, pr, cal)
    head_comm = collective_time("allreduce", 4.0 * n * 3, t, 1, hw, cal, 3) if t > 1 else 0.0   # loss's max/sum
    head_mb = Hf + Hb + Hw + head_comm
    split = lay.pipeline_schedule in ("zb-h1", "zbv")
    kind = lay.pipeline_schedule if lay.pp > 1 else "1f1b"
    bub, peak = bubble_and_peak(kind, lay.pp, m, v, F, Bi if split else Bi + W, W if split else 0.0)
    chunk_mb = F + Bi + W
    pipeline = m * (v * chunk_mb + head_mb) + bub

    # -- parameters and gradients -------------------------------------------------------------------------
    lrank = lpc * v
    dense_p = cfg.layer_params
    if cfg.experts:
        moe_p = dense_p - cfg.expert_params + cfg.experts / lay.ep * cfg.expert_params + h * cfg.experts
        moe_exp = cfg.experts / lay.ep * cfg.expert_params / t
    else:
        moe_p, moe_exp = dense_p, 0.0
    layer_local = ((1 - moe_frac) * dense_p + moe_frac * moe_p) / T
    emb = (cfg.vocab + s) * h / (t if lay.axonn == 1 else T)     # word + position embeddings (first stage)
    params_rank = lrank * layer_local + emb
    expert_rank = lrank * moe_frac * moe_exp
    dense_rank = params_rank - expert_rank
    gdp = lay.dp * lay.cp                      # ranks that replicate a dense parameter
    ip_dp = T * lay.pp
    gbytes = float(pb)              # gradients reduced in the compute precision (Megatron 2021's fp16 runs)
    dp_total = dp_exposed = 0.0
    if gdp > 1:
        def red(kind, nbytes, calls=1.0):
            x = collective_time(kind, nbytes * dense_rank / max(params_rank, 1), gdp, ip_dp, hw, cal, calls)
            if expert_rank and lay.dp // lay.ep > 1:
                x += collective_time(kind, nbytes * expert_rank / max(params_rank, 1), lay.dp // lay.ep,
                                     ip_dp * lay.cp * lay.ep, hw, cal, calls)
            return x
        last_bwd = v * (Bi + W)
        if lay.zero == 0:
            dp_total = red("allreduce", params_rank * gbytes)
            dp_exposed = max(dp_total * min(1.0, 25 * 2 ** 20 / max(params_rank * gbytes, 1)),
                             dp_total - last_bwd) if lay.overlap else dp_total
        elif lay.zero == 1:
            rs = red("reducescatter", params_rank * gbytes)
            ag = red("allgather", params_rank * pb)
            dp_total = rs + ag
            dp_exposed = (max(rs - last_bwd, 0.0) + max(ag - v * F, 0.0)) if lay.overlap else dp_total
        elif lay.pp > 1:       # a stage gathered once before its first micro-batch, reduce-scattered after its last
            dp_total = red("allgather", params_rank * pb) + red("reducescatter", params_rank * gbytes)
            dp_exposed = dp_total
        else:
            units = max(1.0, float(lrank))      # one gather per block forward and backward, a reduce-scatter each
            per_mb = (red("allgather", params_rank * pb / units, 2 * units)
                      + red("reducescatter", params_rank * gbytes / units, units))
            dp_total = m * per_mb
            if lay.overlap:
                first = red("allgather", layer_local * pb)          # the first unit cannot be prefetched
                dp_exposed = m * max(0.0, per_mb - v * chunk_mb) + first
            else:
                dp_exposed = dp_total
    emb_sync = 0.0
    if lay.pp > 1 and cfg.tied:
        emb_sync = collective_time("allreduce", cfg.vocab * h / t * gbytes, 2, T * (lay.pp - 1), hw, cal)
    opt_params = params_rank / (gdp if lay.zero else 1)
    optimizer = 30.0 * opt_params / (hw.memory_bw * cal.memory)
    step = pipeline + dp_exposed + emb_sync + optimizer

    # -- memory -------------------------------------------------------------------------------------------
    state = params_rank * state_bytes_per_param(pb, lay.zero, gdp)
    if lay.zero == 3:       # two gathered blocks at a time; in a pipeline the whole stage for the step
        state += (params_rank if lay.pp > 1 else 2 * layer_local) * (pb + gbytes)
    act_layer = block_activation_bytes(s_loc, s, b, h, a, t, sp, train.recompute, pb,
                                       cfg.top_k if cfg.experts else 0)
    acts = act_layer * lpc * peak
    if train.recompute == "full":
        acts += block_activation_bytes(s_loc, s, b, h, a, t, sp, "none", pb)
    memory = state + acts

    hw_flops = model_flops(cfg, train)
    tflops = hw_flops / (lay.world * step) / 1e12
    mfu = model_flops(cfg, train, recompute=False) / (lay.world * step * hw.peak_flops(pr))
    compute = m * v * lpc * (Fd + Bd + Wd) + m * (Hf + Hb + Hw)
    breakdown = {
        "compute_s": compute,
        "recompute_s": m * v * lpc * rec,
        "tp_comm_s": m * v * tp_chunk + m * head_comm,
        "tp_hidden_s": m * v * tp_hidden,
        "cp_comm_s": m * v * cp_chunk,
        "ep_comm_s": m * v * ep_chunk,
        "pp_p2p_s": m * v * 2 * p2p,
        "bubble_s": bub,
        "dp_comm_s": dp_total,
        "dp_exposed_s": dp_exposed,
        "embedding_sync_s": emb_sync,
        "optimizer_s": optimizer,
        "mfu": mfu,
        "params_per_rank": params_rank,
        "inflight_chunks": float(peak),
    }
    return PlanEstimate(lay, m, step, memory, tflops, breakdown,
                        {"state": state, "activations": acts})
