"""One layout's step time, memory and breakdown: the cost model of every axis, per rank and per step.

This is the planner's only cost model.  The same formulas serve a datasheet machine (``dgx-a100`` ...: a
roofline with the efficiencies fitted on published runs, :mod:`.calibration`) and a measured one (``cpu``,
``--measure``: the rates measured on the allocation, :mod:`.measure`); only the rates differ
(:mod:`.compute`, :mod:`.comm`).

[Note: the step]  For ``m = B / (dp b)`` micro-batches (AxoNN: ``B / (dp T b)``, every rank of a tensor
block reads its own rows), ``v`` chunks per pipeline rank of ``L / (p v)`` blocks:

* one chunk's forward ``F``, input-gradient backward ``B`` and weight-gradient backward ``W``
  (:mod:`.compute`; recomputation adds a forward, or its attention core, to ``B``) plus the tensor
  group's collectives (Megatron: 2 all-reduces forward, 2 backward, 2 more in a full recomputation;
  with sequence parallelism all-gathers + reduce-scatters of the same time; AxoNN 3-D: the easy-mode
  volumes and calls of :mod:`.axonn` per Linear), the context group's (ring: ``cp - 1`` exchanges of K
  and V forward, ``2 cp - 1`` backward, hidden under the attention core as far as it lasts; Ulysses: 4
  all-to-alls of the rank's ``n h / t`` each way), the expert group's (dispatch and combine all-to-alls
  each way) and the point-to-point transfer to the next stage (Megatron's scatter/gather: ``1/t`` of
  the activation per rank over its own card, then an all-gather inside the node);
* the pipeline: ``m v (F + B + W)`` on the busiest rank (the last also runs the final norm, the head
  and the loss) plus the bubble ``schedules.simulate`` gives for the schedule (1F1B, interleaved,
  ZB-H1, ZBV);
* gradients and sharded state over the data (x context) group, as axonmpi runs them (:func:`_data`):
  DDP all-reduces in 25 MiB buckets (AxoNN: one call per gradient tensor; the replicated parameters
  -- norms, embeddings, Linears the grid does not divide -- over data and then over the tensor block's
  batch group, as ``parallel/grad_sync.py``'s table says); ZeRO-1 adds the all-gather of the updated
  chunks after the step; FSDP (``zero=2, 3``) gathers and reduce-scatters unit by unit every micro-batch (in a pipeline once a
  step: the stage stays gathered), hybrid shard also all-reduces each unit's shard over the replicas.
  What overlaps: with ``overlap=1`` on a machine whose collectives progress under compute, DDP's
  buckets during the last backward and FSDP's prefetched gathers and launched reduce-scatters under
  the units' compute -- except the first gather, the last reduce-scatter and whatever a unit's
  collectives take beyond its compute (a small layer's); ``overlap=0``, or a measured CPU (no
  progress thread), exposes all of it;
* ``tp_overlap=1`` (Megatron since 2022's asynchronous tensor-parallel all-reduce): the backward's
  input-gradient all-reduces (or SP's collectives) run under the weight-gradient GEMMs;
* the tied embedding's gradient between the first and last stage, the optimizer step (roofline: 30
  bytes of memory traffic per parameter the rank updates; measured: AdamW and the clipping norm per
  parameter) and DDP's two copies of each all-reduced gradient (into the flat buffer and back).

The step is the pipeline's time plus, for the first and for the last stage (they hold different
parameters: the embeddings, the head), what that stage's gradients, sharded state and optimizer add;
the slower of the two.  On a CPU whose ranks share cores, compute is stretched by ``ranks per node /
cores`` and memory-bound work (residual adds, AdamW, copies) by ``ranks per node / mem_cores``.

Memory: :mod:`.memory`.  ``tflops_per_gpu`` is Megatron's: model flops including recomputation's
(``96 B s l h^2 (1 + s/6h + V/16lh)`` for a dense GPT with full recomputation) over GPUs and step time.
``volumes``: bytes per step through each group (the busiest stage's), as the byte counter counts them
(``col``, ``row``, ``depth``: AxoNN's; ``tensor``: Megatron's; ``pipeline``, ``context``, ``expert``,
``data``, ``repl``: the replicated parameters' reduction over all ranks or the tensor block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .axonn import CALLS, block_units, divides, fsdp_replicated_shard, linear_volumes
from .calibration import FITTED, Calibration
from .comm import FACTORS, collective_time, group_bandwidth, latency
from .compute import block_ops, fwd_bwd, head_ops, ops_time
from .hardware import HardwareSpec
from .measure import BUCKET_BYTES     # DDP's bucket (``parallel.ddp``): one all-reduce per 25 MiB
from .memory import block_activation_bytes, state_bytes_per_param
from .model import ParallelLayout, TrainConfig, TransformerConfig
from .pipeline import bubble_and_peak

__all__ = ["PlanEstimate", "estimate_layout", "check_layout", "model_flops", "VOLUME_GROUPS", "BUCKET_BYTES"]

GIB = 2.0 ** 30
#: The groups ``PlanEstimate.volumes`` reports.
VOLUME_GROUPS = ("col", "row", "depth", "tensor", "pipeline", "context", "expert", "data", "repl")


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
    volumes: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, object]:
        """The JSON form ``axonmpi plan --json`` prints."""
        return {"layout": self.layout.as_dict(), "label": self.layout.label(), "micro_batches": self.microbatches,
                "step_time_s": self.step_time, "memory_gib": self.memory_bytes / GIB,
                "tflops_per_gpu": self.tflops_per_gpu,
                "breakdown": {**{k: v for k, v in self.breakdown.items()},
                              **{f"memory_{k}_gib": v / GIB for k, v in self.memory.items()}},
                "bytes_per_step": dict(self.volumes)}


def model_flops(cfg: TransformerConfig, train: TrainConfig, recompute: bool = True) -> float:
    """Flops of one step: forward + backward (``3x`` forward), plus the recomputed forward when ``recompute``
    (full: all of it; selective: the attention core)."""
    h, s, f = cfg.width, cfg.seq, cfg.hidden
    tokens = float(train.global_batch) * s
    ups = 3.0 if cfg.gated else 2.0
    dense_mlp = 2.0 * ups * h * f
    moe_mlp = dense_mlp * max(cfg.top_k, 1)
    mlp = (cfg.layers - cfg.moe_layers) * dense_mlp + cfg.moe_layers * moe_mlp
    lin = cfg.layers * 2.0 * (h * cfg.qkv_out + h * h) + mlp      # per token, forward: QKV + projection, MLPs
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
    if cfg.n_kv % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide kv_heads={cfg.n_kv}; pick a tp that divides the key/value heads")
    if lay.cp > 1 and lay.cp_kind == "ulysses" and cfg.heads % (lay.tp * lay.cp):
        raise ValueError(f"Ulysses needs heads={cfg.heads} divisible by tp x cp = {lay.tp * lay.cp}; use cp_kind=ring")
    if cfg.seq % lay.cp:
        raise ValueError(f"cp={lay.cp} does not divide seq={cfg.seq}")
    if lay.axonn > 1:
        for i, o in cfg.linears():
            if not divides(i, o, lay.row, lay.col, lay.depth):
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


# -- the parameters a rank holds ------------------------------------------------------------------------
@dataclass
class _Params:
    """Parameters of a piece of the model on one rank, by how their gradients are reduced."""
    split: float = 0.0            # sharded over the tensor group (or no tensor split): reduced over data
    repl: float = 0.0             # whole on every tensor rank (AxoNN: norms, embeddings, undivided Linears)
    split_tensors: float = 0.0    # gradient tensors of each part (AxoNN reduces one call per tensor)
    repl_tensors: float = 0.0
    depth: float = 0.0            # AxoNN: biases replicated over depth (all-reduced over it)
    depth_tensors: float = 0.0
    expert: float = 0.0           # MoE experts (reduced over the expert-data ranks)

    @property
    def local(self) -> float:
        return self.split + self.repl

    def __add__(self, o: "_Params") -> "_Params":
        return _Params(*(a + b for a, b in zip(self.__dict__.values(), o.__dict__.values())))

    def scale(self, k: float) -> "_Params":
        return _Params(*(a * k for a in self.__dict__.values()))


def _linear(i: int, o: int, bias: bool, lay: ParallelLayout, row_parallel: bool = False) -> _Params:
    """One Linear on a rank: AxoNN (split when the grid divides it, else whole), or Megatron's column-parallel
    (weight and bias split over ``tp``) or row-parallel (weight split, bias whole: ``row_parallel``)."""
    if lay.axonn > 1:
        if divides(i, o, lay.row, lay.col, lay.depth):
            b = o / lay.row if bias else 0.0
            return _Params(split=i * o / lay.axonn + b, split_tensors=2 if bias else 1,
                           depth=b if lay.depth > 1 else 0.0, depth_tensors=1 if bias and lay.depth > 1 else 0)
        return _Params(repl=i * o + (o if bias else 0), repl_tensors=2 if bias else 1)
    t = lay.tp
    if row_parallel:
        return _Params(split=i * o / t, split_tensors=1, repl=o if bias else 0, repl_tensors=1 if bias else 0)
    return _Params(split=(i * o + (o if bias else 0)) / t, split_tensors=2 if bias else 1)


def _block(cfg: TransformerConfig, lay: ParallelLayout) -> _Params:
    """One dense block: Megatron splits QKV and the MLP's up projections by columns (their biases too) and the
    attention's and the MLP's output projections by rows (their biases whole); AxoNN every Linear the grid
    divides; the norms stay whole."""
    out = _Params(repl=2 * cfg.norm_params, repl_tensors=4 if cfg.bias else 2)
    lin = cfg.linears()
    for k, (i, o) in enumerate(lin):
        out = out + _linear(i, o, cfg.bias, lay, row_parallel=k in (1, len(lin) - 1))
    return out


def _stage_params(cfg: TransformerConfig, lay: ParallelLayout, blocks: int, first: bool, last: bool) -> _Params:
    """The parameters of a pipeline rank with ``blocks`` blocks and, on the first stage, the embeddings, on the
    last the final norm and the head (untied, or a tied copy in a pipeline)."""
    h = cfg.width
    dense = _block(cfg, lay)
    moe_frac = cfg.moe_layers / cfg.layers if cfg.experts else 0.0
    out = dense.scale(blocks)
    if cfg.experts:            # the MLP becomes a router (whole) and E / ep experts (split like the MLP)
        mlp = cfg.expert_params / lay.tensor
        exp = cfg.experts / lay.ep * mlp
        out.split += blocks * moe_frac * (h * cfg.experts - mlp)
        out.expert += blocks * moe_frac * exp
    if first:
        if lay.axonn > 1:          # HybridGPT keeps its embeddings whole (replicated over the tensor block)
            out = out + _Params(repl=cfg.embedding_params, repl_tensors=1 if cfg.rotary else 2)
        else:                      # Megatron: the word embedding vocab-parallel, the position table whole
            out = out + _Params(split=cfg.vocab * h / lay.tp, split_tensors=1,
                                repl=0.0 if cfg.rotary else cfg.seq * h, repl_tensors=0 if cfg.rotary else 1)
    if last:
        out = out + _Params(repl=cfg.norm_params, repl_tensors=2 if cfg.bias else 1)
        if not cfg.tied or (lay.pp > 1 and not first):
            out = out + _linear(h, cfg.vocab, False, lay)
    return out


# -- sharded data parallelism -------------------------------------------------------------------------
@dataclass
class _DataCost:
    total: float = 0.0            # seconds of every collective
    exposed: float = 0.0          # seconds not hidden under compute
    after_step: float = 0.0       # ZeRO-1's all-gather of the updated chunks (after the optimizer)
    copies: float = 0.0           # gradient elements copied twice (DDP's flat buffer)
    volumes: Dict[str, float] = field(default_factory=dict)


def _after_backward(hw: HardwareSpec) -> HardwareSpec:
    """The rates of the reductions that run after the backward, every rank of the group arriving from the same
    backward and the calls back to back, in place (DDP's buckets, AxoNN's per-tensor all-reduces, the
    replicated parameters', ZeRO-1's gather after the step): on a measured machine the ``bucket`` bandwidth
    and ``bucket_latency`` ``--measure`` measured in that regime (:func:`.measure._after_backward`), inside a
    node; elsewhere (a datasheet machine, a hardware file measured before them) ``hw`` itself."""
    bw = hw.kernel("bucket") if hw.is_measured else 0.0
    if bw <= 0:
        return hw
    return hw.with_(intra_bw=bw, intra_latency=hw.kernel("bucket_latency"))


def _data(cfg, lay, hw, cal, P: _Params, unit_params: List[float], unit_F: List[float], unit_B: List[float],
          m: int, pb: int, last_bwd: float, overlap: bool) -> _DataCost:
    """Gradients and sharded state over the data group (see the module's note)."""
    out = _DataCost(volumes={"data": 0.0, "repl": 0.0, "depth": 0.0})
    sharded = hw                                           # FSDP's collectives: between the units' compute
    hw = _after_backward(hw)                               # the rest: after the backward, back to back
    gdp = lay.dp * lay.cp                                  # ranks that replicate a dense parameter
    T = lay.tensor
    ip = T * lay.pp                                        # data ranks are the outermost axis
    exp_dp = lay.dp // lay.ep
    dense = P.local - P.expert
    if lay.zero in (0, 1):
        if gdp > 1:
            if lay.axonn > 1:            # one all-reduce per gradient tensor; the replicated ones too (grad_sync's
                vol = P.local - P.expert  # table: over data, then over the tensor block's batch group)
                calls = P.split_tensors + P.repl_tensors
            else:                        # DDP's buckets
                vol = dense
                calls = 1 + (dense * pb) // BUCKET_BYTES
            t = collective_time("allreduce", vol * pb / max(calls, 1), gdp, ip, hw, cal, calls)
            if P.expert and exp_dp > 1:
                t += collective_time("allreduce", P.expert * pb, exp_dp, ip * lay.cp * lay.ep, hw, cal)
            out.volumes["data"] += (vol + (P.expert if exp_dp > 1 else 0.0)) * pb
            out.copies += vol + P.expert
            out.total += t
            if overlap and lay.reduce_overlap and lay.axonn == 1:     # buckets reduced during the last backward
                out.exposed += max(t * min(1.0, BUCKET_BYTES / max(dense * pb, 1)), t - last_bwd)
            else:
                out.exposed += t
            if lay.zero == 1:            # ZeroRedundancyOptimizer: the updated chunks all-gathered after step()
                out.after_step = collective_time("allgather", P.local * pb, gdp, ip, hw, cal)
                out.volumes["data"] += P.local * pb
                out.total += out.after_step
    else:
        S = lay.shard_size
        rep = lay.dp // S
        full = lay.zero == 3
        per_unit_calls = 3 if full else 2
        if S > 1 or rep > 1:
            ag = [collective_time("allgather", u * pb, S, ip, sharded, cal) for u in unit_params]
            rs = [collective_time("reducescatter", u * pb, S, ip, sharded, cal)
                  + collective_time("allreduce", u * pb / S, rep, ip * S, sharded, cal) for u in unit_params]
            if lay.pp > 1:           # a stage gathered once before its first micro-batch, reduced after its last
                out.total = sum(ag) + sum(rs)
                out.exposed = out.total
            else:
                per_mb = sum(ag) * (2 if full else 1) + sum(rs)
                out.total = m * per_mb
                if overlap:
                    k = len(ag)
                    rsh = 1.0 if lay.reduce_overlap else 0.0          # reduce-scatters under the backward?
                    fwd = ag[0] + sum(max(0.0, ag[i] - unit_F[i - 1]) for i in range(1, k))
                    bwd = (ag[-1] if full else 0.0) + (rs[0] if rsh else sum(rs))
                    for u in range(k - 1, -1, -1):    # under unit u's backward: the previous unit's gather, the
                        hide = (ag[u - 1] if full and u >= 1 else 0.0) + (rsh * rs[u + 1] if u + 1 < k else 0.0)
                        bwd += max(0.0, hide - unit_B[u])     # next unit's reduce-scatter
                    out.exposed = m * (fwd + bwd)
                else:
                    out.exposed = out.total
            times = 1 if lay.pp > 1 else m          # gathers (2 with FULL_SHARD) + a reduce-scatter per unit
            gathers = 1 if lay.pp > 1 else per_unit_calls - 1
            out.volumes["data"] += times * ((gathers + 1) * P.local + (P.local / S if rep > 1 else 0.0)) * pb
    # AxoNN: the replicated parameters, and the biases replicated over depth
    if T > 1 and lay.axonn > 1:
        if lay.zero >= 2:              # on this rank's FSDP shard only
            units = ([[(cfg.vocab * cfg.width, "repl")]] + ([] if cfg.rotary else [[(cfg.seq * cfg.width, "repl")]])
                     + [block_units(cfg.linears(), cfg.norm_params, cfg.bias, T, lay.row, lay.depth,
                                    lambda i, o: divides(i, o, lay.row, lay.col, lay.depth))] * cfg.layers
                     + [[(cfg.norm_params, "repl")]]
                     + [block_units([(cfg.width, cfg.vocab)], 0, False, T, lay.row, lay.depth,
                                    lambda i, o: divides(i, o, lay.row, lay.col, lay.depth))[1:]])
            sh = fsdp_replicated_shard(units, lay.shard_size)
            repl, depth = sh["repl"], sh["depth"]
        else:
            repl, depth = P.repl, P.depth
        g = T                          # the block's batch (intra) group
        t = collective_time("allreduce", repl * pb / max(P.repl_tensors, 1), g, 1, hw, cal, P.repl_tensors)
        t += collective_time("allreduce", depth * pb / max(P.depth_tensors, 1), lay.depth, lay.col * lay.row, hw,
                             cal, P.depth_tensors)
        out.volumes["repl"] += repl * pb
        out.volumes["depth"] += depth * pb
        out.copies += repl if lay.zero < 2 else 0.0
        out.total += t
        out.exposed += t
    return out


# -- one layout ----------------------------------------------------------------------------------------
def _axonn_linear(i: int, o: int, n: float, lay: ParallelLayout, hw, cal, pb: int) -> Tuple[float, Dict[str, float]]:
    """Seconds (forward + backward, one micro-batch) and bytes by group of one easy-mode Linear."""
    where = {"col": (lay.col, 1), "row": (lay.row, lay.col), "depth": (lay.depth, lay.col * lay.row)}
    secs, vols = 0.0, {}
    for g, kinds in linear_volumes(i, o, n, lay.row, lay.col, lay.depth).items():
        size, ip = where[g]
        if size <= 1:
            continue
        for kind, vol in kinds.items():
            k = "allreduce" if kind == "allreduce" else "allgather"
            secs += FACTORS[k](size) * vol * pb / group_bandwidth(size, ip, hw, cal, k)
            vols[g] = vols.get(g, 0.0) + vol * pb
        secs += CALLS[g] * latency("allgather", size, ip, hw)
    return secs, vols


def _stretch(lay: ParallelLayout, hw: HardwareSpec) -> Tuple[float, float]:
    """Compute-bound and memory-bound stretch: more ranks on a node than it has cores (in effect)."""
    ranks = min(lay.world, hw.gpus_per_node)
    mc = hw.mem_cores()
    return (max(1.0, ranks / hw.cores) if hw.cores else 1.0, max(1.0, ranks / mc) if mc else 1.0)


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
    lpc = math.ceil(cfg.layers / (lay.pp * v))     # busiest chunk's blocks
    moe_frac = cfg.moe_layers / cfg.layers if cfg.experts else 0.0
    stretch = _stretch(lay, hw)
    overlap = bool(lay.overlap) and hw.overlaps
    shape = dict(kv_heads=cfg.kv_heads, gated=cfg.gated, rotary=cfg.rotary, dropout=train.dropout)
    vols = {g: 0.0 for g in ("col", "row", "depth", "tensor", "pipeline", "context", "expert")}

    # -- compute of one block --------------------------------------------------------------------------
    dense = block_ops(n, s, h, a, f, t, sp, pb, **shape)
    Fd, Bd, Wd = fwd_bwd(dense, hw, pr, cal, stretch)
    core = ops_time(dense, hw, pr, cal, "core", stretch)
    full = Fd
    if cfg.experts:
        moe = block_ops(n, s, h, a, f, t, sp, pb, moe_experts_local=cfg.experts / lay.ep,
                        moe_tokens=n * cfg.top_k, moe_split=t, **shape)
        Fm, Bm, Wm = fwd_bwd(moe, hw, pr, cal, stretch)
        full = (1 - moe_frac) * Fd + moe_frac * Fm
        Fd, Bd, Wd = ((1 - moe_frac) * x + moe_frac * y for x, y in ((Fd, Fm), (Bd, Bm), (Wd, Wm)))
    rec = {"none": 0.0, "selective": core, "full": full}[train.recompute]
    if lay.zero == 3 and not hw.is_measured and train.recompute != "full" and lay.dp > 1:
        rec = full        # axonmpi's FULL_SHARD on GPUs recomputes each unit's forward in backward (unit.py)

    # -- collectives of one block: forward, backward, and the forward again with full recomputation ---------
    # Megatron's f/g pair: each forward all-reduce has one backward all-reduce (of the input gradient),
    # and a full recomputation repeats the forward's: 2 + 2 (+ 2) all-reduces per block.  With sequence
    # parallelism: forward 2 all-gathers + 2 reduce-scatters; backward the all-gather of dY, the
    # reduce-scatter of dX and the re-gather of the sharded input X for the weight gradient (Megatron
    # keeps X sharded): 2 + 2 + 2.  ``tp_hideable``: what ``tp_overlap`` can run under GEMMs.
    passes = 2.0 if train.recompute != "full" else 3.0   # forward, backward, recomputed forward
    act = n * h * pb
    tp_fwd = tp_bwd = 0.0
    tp_hideable = (0.0, 0.0)
    if t > 1:
        if sp:
            ag = collective_time("allgather", act, t, 1, hw, cal, 2)
            rs = collective_time("reducescatter", act, t, 1, hw, cal, 2)
            tp_fwd, tp_bwd, tp_hideable = ag + rs, 2 * ag + rs, (rs, ag)
        else:
            tp_fwd = tp_bwd = collective_time("allreduce", act, t, 1, hw, cal, 2)
            tp_hideable = (tp_fwd, 0.0)
    if lay.axonn > 1:
        for i, o in cfg.linears():
            secs, gv = _axonn_linear(i, o, n, lay, hw, cal, pb)
            tp_fwd += secs / 2.0          # the volumes and calls are forward + backward: half of them one pass
            for g, x in gv.items():
                vols[g] += x
        tp_bwd = tp_fwd
    cp_fwd = cp_bwd = 0.0
    if lay.cp > 1:
        ip = T * lay.pp
        if lay.cp_kind == "ring":
            kv = 2.0 * n * h / t * pb
            ring = (lay.cp - 1) * collective_time("p2p", kv, 2, ip, hw, cal)
            back = (2 * lay.cp - 1) / (lay.cp - 1) * ring      # K/V on, dK/dV along, and dK/dV's hop home
            cp_fwd = max(0.0, ring - core if overlap else ring)
            cp_bwd = max(0.0, back - 2 * core if overlap else back)
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
        if t > 1:                              # scatter/gather: 1/t over each card, all-gather in the node
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
    head_split = t > 1 or (lay.axonn > 1 and divides(h, cfg.vocab, lay.row, lay.col, lay.depth))
    hd = head_ops(n, h, cfg.vocab, t, pb, split=t > 1)
    Hf, Hb, Hw = fwd_bwd(hd, hw, pr, cal, stretch)
    head_comm = collective_time("allreduce", 4.0 * n * 3, t, 1, hw, cal, 3) if t > 1 else 0.0   # loss's max/sum
    head_vols: Dict[str, float] = {}
    if lay.axonn > 1 and head_split:
        head_comm_axonn, head_vols = _axonn_linear(h, cfg.vocab, n, lay, hw, cal, pb)
        head_comm += head_comm_axonn
    head_mb = Hf + Hb + Hw + head_comm
    split = lay.pipeline_schedule in ("zb-h1", "zbv")
    kind = lay.pipeline_schedule if lay.pp > 1 else "1f1b"
    bub, peak = bubble_and_peak(kind, lay.pp, m, v, F, Bi if split else Bi + W, W if split else 0.0)
    chunk_mb = F + Bi + W
    pipeline = m * (v * chunk_mb + head_mb) + bub
    for g in ("col", "row", "depth", "tensor"):        # per block and micro-batch so far; the head's once
        vols[g] = vols[g] * m * lpc * v + m * head_vols.get(g, 0.0)
    from .traffic import group_bytes          # the byte counts of Megatron's groups: traffic.py's, once
    counted = group_bytes(cfg, train, lay, embeddings="vocab" if lay.axonn == 1 else "replicated")
    for g in ("pipeline", "context", "expert") + (("tensor",) if lay.axonn == 1 else ()):
        vols[g] = counted[g]

    # -- parameters, gradients, sharded state, optimizer: the first and the last stage --------------------
    lrank = lpc * v
    zbv = lay.pipeline_schedule == "zbv" and lay.pp > 1
    stages = [(True, True)] if lay.pp == 1 or zbv else [(True, False), (False, True)]
    blk_F = Fd + (tp_fwd + cp_fwd + ep_fwd)
    blk_B = Bd + Wd + rec + (tp_chunk + cp_chunk + ep_chunk) / max(lpc, 1) - (tp_fwd + cp_fwd + ep_fwd)
    worst = None
    stage_vols = dict(vols)
    gbytes = float(pb)              # gradients reduced in the compute precision (Megatron 2021's fp16 runs)
    for first, last in stages:
        P = _stage_params(cfg, lay, lrank, first, last)
        blockP = _stage_params(cfg, lay, 1, False, False).local
        units, uF, uB = [], [], []          # FSDP's units in forward order: embeddings, blocks, final norm + head
        if first:
            units.append(_stage_params(cfg, lay, 0, True, False).local)
            uF.append(0.0)
            uB.append(0.0)
        units += [blockP] * lrank
        uF += [blk_F] * lrank
        uB += [blk_B] * lrank
        if last:
            units.append(_stage_params(cfg, lay, 0, False, True).local)
            uF.append(Hf)
            uB.append(Hb + Hw)
        dc = _data(cfg, lay, hw, cal, P, units, uF, uB, m, pb, v * (Bi + W), overlap)
        emb_sync = 0.0
        if lay.pp > 1 and cfg.tied and (first or last) and not zbv:
            emb_sync = collective_time("allreduce", cfg.vocab * h / t * gbytes, 2, T * (lay.pp - 1), hw, cal)
        S = lay.shard_size if lay.zero >= 2 else (lay.dp * lay.cp if lay.zero == 1 else 1)
        opt_params = P.local / S
        if hw.is_measured:
            optimizer = (opt_params * hw.kernel("adam") + 2.0 * dc.copies * hw.kernel("copy")) * stretch[1]
        else:
            optimizer = (30.0 * opt_params + 2.0 * dc.copies * 2 * pb) / (hw.memory_bw * cal.memory)
        step = pipeline + dc.exposed + emb_sync + optimizer + dc.after_step

        # -- memory ---------------------------------------------------------------------------------------
        state = P.local * state_bytes_per_param(pb, lay.zero, S if lay.zero else lay.dp)
        if lay.zero == 3:       # two gathered units at a time; in a pipeline the whole stage for the step
            state += (P.local if lay.pp > 1 else 2 * max(units)) * (pb + gbytes)
        elif lay.zero == 2:     # every unit gathered from its forward to its backward
            state += P.local * pb + 2 * max(units) * gbytes
        act_layer = block_activation_bytes(s_loc, s, b, h, a, t, sp, train.recompute, pb,
                                           cfg.top_k if cfg.experts else 0)
        acts = act_layer * lpc * peak
        if train.recompute == "full":
            acts += block_activation_bytes(s_loc, s, b, h, a, t, sp, "none", pb)
        if lay.depth > 1:                  # the largest depth-gathered weight
            acts += max(i * o for i, o in cfg.linears()) / (lay.row * lay.col) * pb
        memory = state + acts
        blocks_state = lrank * blockP * state_bytes_per_param(pb, lay.zero, S if lay.zero else lay.dp)
        if worst is None or step > worst[0]:
            worst = (step, dc, emb_sync, optimizer, memory, state, acts, P, blocks_state)
        elif step == worst[0]:
            worst = worst[:4] + (max(memory, worst[4]),) + worst[5:]
        for g, x in dc.volumes.items():          # the busiest stage's, per group
            vols[g] = max(vols.get(g, 0.0), stage_vols.get(g, 0.0) + x)
    step, dc, emb_sync, optimizer, memory, state, acts, P, blocks_state = worst

    hw_flops = model_flops(cfg, train)
    tflops = hw_flops / (lay.world * step) / 1e12
    peak_flops = hw.kernel("flops") if hw.is_measured else hw.peak_flops(pr)
    mfu = model_flops(cfg, train, recompute=False) / (lay.world * step * peak_flops)
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
        "dp_comm_s": dc.total,
        "dp_exposed_s": dc.exposed + dc.after_step,
        "embedding_sync_s": emb_sync,
        "optimizer_s": optimizer,
        "mfu": mfu,
        "params_per_rank": P.local,
        "inflight_chunks": float(peak),
    }
    return PlanEstimate(lay, m, step, memory, tflops, breakdown,
                        {"state": state, "activations": acts, "state_blocks": blocks_state},
                        {g: vols.get(g, 0.0) for g in VOLUME_GROUPS})
