"""Dense MLP vs MoE at equal active parameters, at 1, 2 and 4 ranks: step time and bytes per group.

One invocation runs everything (it re-launches itself under ``mpiexec -n N``):

    python bench/moe.py                                    # C=128, 2 layers, 4 experts, 1024 tokens
    python bench/moe.py --width 256 --tokens 2048 --steps 5 --ranks 1,2,4

The model: ``--layers`` residual blocks ``x + f(LayerNorm(x))`` on a global batch of ``--tokens``
tokens, float32, AdamW. ``f`` is

* dense: ``nn.MLP(C, 4C)``, DDP over all ranks;
* MoE top-1: ``nn.MoE(C, E, top_k=1, hidden=4C)`` (each token runs one expert of the MLP's shape:
  the same active parameters, plus a ``C x E`` router), experts split over ``expert_parallel = N``
  ranks (all-to-all dispatcher), the rest DDP;
* MoE, tensor-parallel experts (AxoNN style): every expert's hidden width split over N ranks,
  tokens all-gathered.

Step = forward + backward + gradient reduction + AdamW, median of ``--steps`` after a warm-up.
Bytes per rank and step are counted through the MPI backend (``count_traffic``), per group; the
dispatcher's are printed beside the formula (``2 x rows sent off-rank x C x 4`` per layer and
direction for the all-to-all, ``2 T n C 4`` for the gather) and the planner's estimate
(:func:`axonmpi.plan.moe_estimate`, uniform routing).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(kind, args):
    import axonmpi.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(args.width)
            self.f = (nn.MLP(args.width) if kind == "dense"
                      else nn.MoE(args.width, args.experts, top_k=1, hidden=4 * args.width))

        def forward(self, x):
            return x + self.f(self.ln(x))

    return nn.Sequential(*[Block() for _ in range(args.layers)])


def _run(kind, args, world):
    import axonmpi
    import axonmpi.nn.functional as F
    from axonmpi import Tensor
    from axonmpi.distributed.backends.counting import count_traffic
    from axonmpi.parallel import parallelize
    from axonmpi.plan import moe_estimate

    n = world.world_size
    if kind == "moe-tp":
        if n == 1:
            return None
        grid = axonmpi.ProcessGrid(world, G_intra_c=n, G_data=1)
    else:
        grid = axonmpi.ProcessGrid(world, expert_parallel=n if kind == "moe-ep" else 1)
    axonmpi.manual_seed(0)
    model = _model("dense" if kind == "dense" else "moe", args)
    if kind == "dense":
        pm = parallelize(model, grid=grid)
    elif kind == "moe-ep":
        pm = parallelize(model, grid=grid, expert_parallel=n)
    else:
        pm = parallelize(model, grid=grid, tensor_parallel="axonn", expert_tensor_parallel=True)
    opt = axonmpi.optim.AdamW(pm.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.tokens, args.width)).astype(np.float32)
    y = rng.standard_normal((args.tokens, args.width)).astype(np.float32)
    xb, yb = pm.local_batch(x, y)

    def step():
        opt.zero_grad()
        out = pm(Tensor(xb, requires_grad=True))
        loss = F.mse_loss(out, Tensor(yb))
        aux = axonmpi.nn.moe_losses(pm.inner)
        if aux is not None:
            loss = loss + 1e-2 * aux[0]
        loss.backward()
        opt.step()

    step()
    ts = []
    for _ in range(args.steps):
        axonmpi.barrier()
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    with count_traffic() as c:
        step()
    moes = [m for m in pm.inner.modules() if isinstance(m, axonmpi.nn.MoE)]
    disp_group = "expert_group" if kind == "moe-ep" else "col_group"
    disp = c.bytes(group=disp_group, dtype="float32") if kind != "dense" else 0
    formula = predicted = 0.0
    rows = xb.shape[0]
    if kind == "moe-ep" and n > 1:
        sent = sum(m.dispatcher.last_rows_sent_off_rank for m in moes)
        formula = 2 * 2 * sent * args.width * 4                       # forward + backward
        predicted = 2 * len(moes) * moe_estimate(rows, args.width, 4 * args.width, args.experts, 1,
                                                 expert_parallel=n).bytes_forward
    elif kind == "moe-tp":
        formula = 2 * len(moes) * 2 * n * rows * args.width * 4
        predicted = 2 * len(moes) * moe_estimate(rows, args.width, 4 * args.width, args.experts, 1,
                                                 tensor_parallel=n).bytes_forward
    by_group = {}
    for (g, _m, _d), (b, _calls) in c.table.items():
        by_group[g] = by_group.get(g, 0) + b
    params = sum(int(p.numel()) for p in pm.parameters())
    res = {"kind": kind, "ranks": n, "time": float(np.median(ts)), "bytes": by_group, "dispatch": disp,
           "formula": formula, "predicted": predicted, "params": params}
    grid.free()
    return res


def worker(args):
    import axonmpi
    world = axonmpi.init()
    rows = []
    for kind in ("dense", "moe-ep", "moe-tp"):
        r = _run(kind, args, world)
        if r is None:
            continue
        from axonmpi.distributed import all_gather_object
        every = all_gather_object(r)
        if world.rank == 0:
            r["time"] = max(e["time"] for e in every)
            groups = {k for e in every for k in e["bytes"]}
            r["bytes"] = {k: sum(e["bytes"].get(k, 0) for e in every) / len(every) for k in groups}
            for key in ("dispatch", "formula", "predicted"):
                r[key] = sum(e[key] for e in every) / len(every)
            rows.append(r)
    if world.rank == 0:
        print("JSON" + json.dumps(rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    rows = []
    for n in [int(v) for v in args.ranks.split(",")]:
        cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--width",
               str(args.width), "--layers", str(args.layers), "--experts", str(args.experts), "--tokens",
               str(args.tokens), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows += json.loads([line for line in out.splitlines() if line.startswith("JSON")][0][4:])
    base = next(r["time"] for r in rows if r["ranks"] == 1 and r["kind"] == "dense")
    print(f"{args.layers} blocks, C={args.width}, MLP hidden {4 * args.width}, {args.experts} experts top-1, "
          f"{args.tokens} tokens per step, float32, 1 BLAS thread per rank")
    print(f"{'model':8s} {'ranks':>5s} {'step ms':>9s} {'vs dense@1':>10s} {'params/rank':>11s}  "
          f"{'dispatch B/rank (formula, planner)':36s} bytes per rank by group")
    for r in rows:
        d = (f"{r['dispatch']:.0f} ({r['formula']:.0f}, {r['predicted']:.0f})" if r["kind"] != "dense" and r["ranks"] > 1
             else "-")
        g = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(r["bytes"].items()) if v) or "-"
        print(f"{r['kind']:8s} {r['ranks']:5d} {1e3 * r['time']:9.2f} {base / r['time']:9.2f}x {r['params']:11d}  "
              f"{d:36s} {g}")


if __name__ == "__main__":
    main()
