"""Step time of N-D layouts through ``parallelize`` beside DDP on the same model and global batch.

Run: mpiexec -n 8 python bench/nd_layouts.py [--steps 5] [--width 64] [--seq 64] [--batch 16]

Every layout trains the same transformer (embed -> 2 ``nn.TransformerBlock`` -> LayerNorm -> head, float32)
on the same global batch; "ms/step" is the median wall time of a training step (forward, backward,
clipping, AdamW) after one warm-up step, the slowest rank's; "vs DDP" divides it by the DDP row's.  On a
shared CPU machine the tensor / context / pipeline layouts move more bytes than they save in compute:
the table shows what each axis costs here, not what it buys on GPUs.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402
import axonmpi.nn as nn  # noqa: E402
import axonmpi.nn.functional as F  # noqa: E402
from axonmpi import Tensor  # noqa: E402
from axonmpi.optim import AdamW, clip_grad_norm_  # noqa: E402
from axonmpi.parallel import PipelinePlan, parallelize  # noqa: E402

PLAN = {"*.attn": "attention", "*.mlp.fc": "column", "*.mlp.proj": "row"}
LAYOUTS = {     # name: (grid sizes, parallelize options; "pipeline": (schedule, virtual stages))
    "ddp": ({}, {}),
    "fsdp": ({}, dict(data_parallel="fsdp")),
    "dp x pp2 x tp2 (sp, 1f1b)": ({"G_inter": 2, "G_intra_c": 2},
                                  dict(tensor_parallel=PLAN, sequence_parallel=True, pipeline=("1f1b", None))),
    "dp x pp2 x tp2 (zb-h1)": ({"G_inter": 2, "G_intra_c": 2}, dict(tensor_parallel=PLAN, pipeline=("zb-h1", None))),
    "dp x pp2 x tp2 (zbv)": ({"G_inter": 2, "G_intra_c": 2}, dict(tensor_parallel=PLAN, pipeline=("zbv", None))),
    "dp x pp2 x axonn2": ({"G_inter": 2, "G_intra_r": 2}, dict(tensor_parallel="axonn", pipeline=("1f1b", None))),
    "fsdp x tp2 (sp) x cp2 ring": ({"G_intra_c": 2, "G_context": 2},
                                   dict(tensor_parallel=PLAN, sequence_parallel=True, context_parallel="ring",
                                        data_parallel="fsdp")),
    "dp x tp2 x cp2 ulysses": ({"G_intra_c": 2, "G_context": 2},
                               dict(tensor_parallel=PLAN, context_parallel="ulysses")),
    "fsdp x pp2 x tp2 (sp) x cp2 (zb-h1)": ({"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                            dict(tensor_parallel=PLAN, sequence_parallel=True,
                                                 context_parallel="ring", data_parallel="fsdp",
                                                 pipeline=("zb-h1", None))),
}


def build(width, heads, vocab):
    axonmpi.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.TransformerBlock(width, heads), nn.TransformerBlock(width, heads),
                         nn.LayerNorm(width), nn.Linear(width, vocab))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    args = ap.parse_args()
    world = axonmpi.init()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.seq, 16)).astype(np.float32)
    y = rng.integers(0, args.vocab, (args.batch, args.seq))
    rows = []
    for name, (sizes, opts) in LAYOUTS.items():
        if world.world_size % int(np.prod(list(sizes.values()) or [1])):
            continue
        grid = axonmpi.ProcessGrid(world, **sizes)
        old, world.grid = world.grid, grid
        try:
            opts = dict(opts)
            if "pipeline" in opts:
                sched, v = opts["pipeline"]
                opts["pipeline"] = PipelinePlan(num_microbatches=2, schedule=sched, virtual_stages=v)
            pm = parallelize(build(args.width, args.heads, args.vocab), grid=grid, **opts)
            opt = AdamW(pm.parameters(), lr=1e-3)
            xb, yb = pm.local_batch(x, y)
            times = []
            for s in range(args.steps + 1):
                world.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                if hasattr(pm, "step"):
                    pm.step(xb, yb)
                else:
                    F.cross_entropy(pm(Tensor(xb)), yb).backward()
                clip_grad_norm_(pm.parameters(), 1.0)
                opt.step()
                times.append(time.perf_counter() - t0)
            t = max(axonmpi.all_gather_object(float(np.median(times[1:]))))
            rows.append((name, grid.sizes, t))
        finally:
            world.grid = old
            grid.free()
    if world.rank == 0:
        base = next(t for n, _, t in rows if n == "ddp")
        print(f"{world.world_size} ranks, batch {args.batch} x {args.seq} tokens, width {args.width}, float32")
        print(f"{'layout':40s} {'grid':44s} {'ms/step':>9s} {'vs DDP':>7s}")
        for n, sz, t in rows:
            grid_s = " ".join(f"{k[2:]}={v}" for k, v in sz.items() if v > 1)
            print(f"{n:40s} {grid_s:44s} {1e3 * t:9.1f} {t / base:7.2f}")


if __name__ == "__main__":
    main()
