"""Step time of each 8-rank N-D layout of the GPT through ``parallelize`` beside DDP on the same model and
batch, and the bytes each group moved beside the planner's ``group_bytes`` for the same layout.

Run: mpiexec -n 8 python bench/nd_layouts.py [--steps 5] [--repeats 3] [--layers 4] [--width 64] [--seq 64]

Every layout trains the same GPT (``axonmpi.models.GPT``, untied head, float32) on the same global batch
of token ids; the tensor-parallel plan splits the blocks (attention, MLP column / row) and leaves the
embeddings and the head whole.  ``ms/step``: a training step (forward, backward, clipping, AdamW) after
one warm-up step, the median over the steps of the slowest rank, then the median over ``--repeats``
interleaved rounds (other jobs on a shared machine come and go); ``vs DDP`` divides it by the DDP row's
(the MoE GPT's rows -- every MLP 4 experts, top-2 -- by its own DDP row).

Bytes: what one rank handed the backend during the last step (``count_traffic``: all-reduce and
reduce-scatter the send buffer, all-gather the gathered buffer, point-to-point sent + received), the
busiest rank's, per group -- data (``data_group`` / ``data_context_group`` / ``expert_data_group``),
tensor (``intra_group``, ``col_group``, ...), pipeline (``inter_group``), context, expert -- beside
:func:`axonmpi.planner.traffic.group_bytes` for the planner's layout (``--layout`` syntax, ``embeddings=
"replicated"``).  Scalar calls (loss, clip norm: at most 24 bytes a call) are left out of the measured
bytes, as the planner leaves them out.  Byte counts do not depend on the machine's load.  What the
ratios mean, row by row: docs/parallelize.md, "Speed and bytes".
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402
import axonmpi.nn.functional as F  # noqa: E402
from axonmpi.distributed.backends.counting import count_traffic  # noqa: E402
from axonmpi.models import GPT, GPTConfig  # noqa: E402
from axonmpi.optim import AdamW, clip_grad_norm_  # noqa: E402
from axonmpi.parallel import PipelinePlan, parallelize  # noqa: E402
from axonmpi.planner import ParallelLayout, TrainConfig, TransformerConfig  # noqa: E402
from axonmpi.planner.traffic import GROUP_NAMES, group_bytes  # noqa: E402

PLAN = {"blocks.*.attn": "attention", "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"}
M = 2      # micro-batches of a pipeline
# name: (grid sizes, parallelize options; "pipeline": (schedule, virtual stages), the planner's layout)
LAYOUTS = {
    "ddp": ({}, {}, "dp=8"),
    "fsdp": ({}, dict(data_parallel="fsdp"), "dp=8,zero=3"),
    "dp2 x pp2 x tp2 (1f1b)": ({"G_inter": 2, "G_intra_c": 2}, dict(tensor_parallel=PLAN, pipeline=("1f1b", None)),
                               "tp=2,pp=2,dp=2"),
    "dp2 x pp2 x tp2 sp (1f1b)": ({"G_inter": 2, "G_intra_c": 2},
                                  dict(tensor_parallel=PLAN, sequence_parallel=True, pipeline=("1f1b", None)),
                                  "tp=2,sp=1,pp=2,dp=2"),
    "dp2 x pp2 x tp2 (zb-h1)": ({"G_inter": 2, "G_intra_c": 2}, dict(tensor_parallel=PLAN, pipeline=("zb-h1", None)),
                                "tp=2,pp=2,dp=2,schedule=zb-h1"),
    "dp2 x pp2 x tp2 (zbv)": ({"G_inter": 2, "G_intra_c": 2}, dict(tensor_parallel=PLAN, pipeline=("zbv", None)),
                              "tp=2,pp=2,dp=2,schedule=zbv"),
    "dp2 x pp2 x tp2 (interleaved)": ({"G_inter": 2, "G_intra_c": 2},
                                      dict(tensor_parallel=PLAN, pipeline=("interleaved", 2)),
                                      "tp=2,pp=2,dp=2,vp=2,schedule=interleaved"),
    "fsdp2 x pp2 x tp2 (1f1b)": ({"G_inter": 2, "G_intra_c": 2},
                                 dict(tensor_parallel=PLAN, data_parallel="fsdp", pipeline=("1f1b", None)),
                                 "tp=2,pp=2,dp=2,zero=3"),
    "dp2 x tp2 x cp2 ring": ({"G_intra_c": 2, "G_context": 2}, dict(tensor_parallel=PLAN, context_parallel="ring"),
                             "tp=2,cp=2,dp=2"),
    "dp2 x tp2 x cp2 ulysses": ({"G_intra_c": 2, "G_context": 2},
                                dict(tensor_parallel=PLAN, context_parallel="ulysses"),
                                "tp=2,cp=2,dp=2,cp_kind=ulysses"),
    "fsdp2 x tp2 x cp2 ring": ({"G_intra_c": 2, "G_context": 2},
                               dict(tensor_parallel=PLAN, context_parallel="ring", data_parallel="fsdp"),
                               "tp=2,cp=2,dp=2,zero=3"),
    # the MoE GPT (every MLP 4 experts, top-2): its own DDP row, then Megatron's MoE shape
    "moe: ddp": ({}, {}, "dp=8"),
    "moe: dp2 (ep2) x pp2 x tp2 (1f1b)": ({"G_inter": 2, "G_intra_c": 2},
                                         dict(tensor_parallel={"blocks.*.attn": "attention"}, expert_parallel=2,
                                              pipeline=("1f1b", None)), "tp=2,pp=2,dp=2,ep=2"),
}
EXPERTS, TOP_K = 4, 2
GROUP_OF = {"data_group": "data", "data_context_group": "data", "expert_data_group": "data", "intra_group": "tensor",
            "col_group": "tensor", "row_group": "tensor", "depth_group": "tensor", "inter_group": "pipeline",
            "context_group": "context", "expert_group": "expert"}
SCALAR = 24        # calls of at most this many bytes carry a loss or a norm, not a tensor


def per_group(counter):
    out = {g: 0 for g in GROUP_NAMES}
    other = 0
    for (group, _method, _dtype), (nbytes, calls) in counter.table.items():
        if nbytes <= SCALAR * calls:
            continue
        if group in GROUP_OF:
            out[GROUP_OF[group]] += nbytes
        else:
            other += nbytes
    out["other"] = other
    return out


def run_layout(world, args, name, x, y):
    sizes, opts, _ = LAYOUTS[name]
    grid = axonmpi.ProcessGrid(world, **sizes, expert_parallel=opts.get("expert_parallel", 1))
    old, world.grid = world.grid, grid
    try:
        opts = dict(opts)
        if "pipeline" in opts:
            sched, v = opts["pipeline"]
            opts["pipeline"] = PipelinePlan(num_microbatches=M, schedule=sched, virtual_stages=v)
        axonmpi.manual_seed(0)
        moe = name.startswith("moe:")
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                        n_embd=args.width, moe_experts=EXPERTS if moe else 0, moe_top_k=TOP_K)
        pm = parallelize(GPT(cfg), grid=grid, **opts)
        opt = AdamW(pm.parameters(), lr=1e-3)
        xb, yb = pm.local_batch(x, y)
        times = []
        for s in range(args.steps + 1):
            world.barrier()
            with count_traffic() as counter:
                t0 = time.perf_counter()
                opt.zero_grad()
                if hasattr(pm, "step"):
                    pm.step(xb, yb)
                else:
                    _, loss = pm(xb, yb)
                    loss.backward()
                clip_grad_norm_(pm.parameters(), 1.0)
                opt.step()
                times.append(time.perf_counter() - t0)
        t = max(axonmpi.all_gather_object(float(np.median(times[1:]))))
        counted = axonmpi.all_gather_object(per_group(counter))
        busiest = {g: max(c[g] for c in counted) for g in list(GROUP_NAMES) + ["other"]}
        return t, busiest
    finally:
        world.grid = old
        grid.free()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the layouts; the median kept")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--only", nargs="+", metavar="LAYOUT", help="run only these layouts (and DDP)")
    args = ap.parse_args()
    world = axonmpi.init()
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab, (args.batch, args.seq))
    y = rng.integers(0, args.vocab, (args.batch, args.seq))
    names = [n for n in LAYOUTS if world.world_size % int(np.prod(list(LAYOUTS[n][0].values()) or [1])) == 0
             and (not args.only or n in args.only or n in ("ddp", "moe: ddp"))]
    times = {n: [] for n in names}
    counted = {}
    for _ in range(args.repeats):
        for n in names:
            t, c = run_layout(world, args, n, x, y)
            times[n].append(t)
            counted[n] = c           # deterministic: the same every round
    if world.rank != 0:
        return
    dense = TransformerConfig(layers=args.layers, width=args.width, heads=args.heads, seq=args.seq, vocab=args.vocab,
                              tied=False)
    moe = TransformerConfig(layers=args.layers, width=args.width, heads=args.heads, seq=args.seq, vocab=args.vocab,
                            tied=False, experts=EXPERTS, top_k=TOP_K)
    print(f"GPT {args.layers} layers x width {args.width}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, "
          f"global batch {args.batch}, float32, {world.world_size} ranks, {M} micro-batches with a pipeline; "
          f"median of {args.repeats} rounds x {args.steps} steps")
    print(f"{'layout':32s} {'planner layout':34s} {'ms/step':>8s} {'DDP ms':>7s} {'vs DDP':>6s}  "
          + "  ".join(f"{g + ' KiB meas/plan (ratio)':>31s}" for g in GROUP_NAMES))
    for n in names:
        t = float(np.median(times[n]))
        cfg = moe if n.startswith("moe:") else dense
        base = float(np.median(times["moe: ddp" if n.startswith("moe:") else "ddp"]))
        text = LAYOUTS[n][2].replace("dp=8", f"dp={world.world_size}")
        lay = ParallelLayout.parse(text)
        m = M if lay.pp > 1 else 1
        want = group_bytes(cfg, TrainConfig(global_batch=args.batch, micro_batch=args.batch // (lay.dp * m),
                                             precision="fp32"), lay, embeddings="replicated")
        cells = []
        for g in GROUP_NAMES:
            got, exp = counted[n][g], want[g]
            if not got and not exp:
                cells.append(f"{'-':>31s}")
            else:
                ratio = f"{got / exp:.2f}" if exp else "inf"
                cells.append(f"{got / 1024:>10.1f}/{exp / 1024:<10.1f} ({ratio:>5s})")
        extra = f"  other {counted[n]['other']} B" if counted[n]["other"] else ""
        print(f"{n:32s} {text:34s} {1e3 * t:8.1f} {1e3 * base:7.1f} {t / base:6.2f}  " + "  ".join(cells) + extra)


if __name__ == "__main__":
    main()
