"""Tensor-parallel MLP block (E -> H -> E, GELU) at 1, 2 and 4 ranks: step time, speed-up, bytes per group.

One invocation runs everything (it re-launches itself under ``mpiexec -n N``):

    python bench/tensor_parallel.py                      # E=1024, H=4096, 64 tokens, float32
    python bench/tensor_parallel.py --embed 512 --tokens 64 --steps 5

Rows: the serial block (nn.Linear, 1 rank); Megatron's column+row pair (TensorParallelMLP) over
all N ranks; AxoNN's 3-D pair (intra_layer.Linear, then a transposed one, expert mode) for every
(G_r, G_c, G_d) with G_r*G_c*G_d = N.  Every rank sees the same 64 tokens (split over depth for
AxoNN), so a 2-way split halves each rank's GEMM work: the speed-up over the serial block is the
tensor-parallel efficiency.  Step = forward + backward, median of ``--steps`` after one warm-up.
Bytes per group are counted at the differentiable collectives, beside the closed-form prediction.
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

SHAPES = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)], 4: [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1),
                                                                   (2, 1, 2), (1, 2, 2)]}


def _counting():
    """Wrap the collectives the 3-D and 1-D layers call so bytes per group name are recorded
    (all-reduce and reduce-scatter: the input buffer; all-gather: the gathered buffer)."""
    import axonmpi.parallel.intra_layer.overlap as ov
    import axonmpi.parallel.tensor.mappings as mp
    counts = {}

    def wrap(fn, gathered):
        def inner(x, *a, **kw):
            g = kw["group"]
            counts[g.name] = counts.get(g.name, 0) + int(x.nbytes * (g.size if gathered else 1))
            return fn(x, *a, **kw)
        return inner

    for mod in (mp, ov):
        mod.all_reduce = wrap(mod.all_reduce, False)
        mod.all_gather = wrap(mod.all_gather, True)
        mod.reduce_scatter = wrap(mod.reduce_scatter, False)
    return counts


def _time(step, steps):
    step()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def worker(args) -> None:
    import axonmpi
    import axonmpi.nn as nn
    from axonmpi import Tensor
    from axonmpi.distributed import all_reduce
    from axonmpi.parallel import intra_layer
    from axonmpi.parallel.tensor import TensorParallelMLP
    from axonmpi.parallel.tensor import TensorParallelGroups

    world = axonmpi.init()
    n = world.world_size
    E, H, T = args.embed, args.hidden, args.tokens
    rng = np.random.default_rng(0)
    rows = []
    counts = _counting()

    def run(name, model_fwd, params, x, predicted):
        def step():
            for p in params + [x]:
                p.grad = None
            y = model_fwd(x)
            y.backward(Tensor(np.ones(y.shape, np.float32)))
        counts.clear()
        step()
        measured = dict(counts)
        world.barrier()
        t = _time(step, args.steps)
        t = float(all_reduce(np.array([t]), op="max")[0])
        rows.append({"name": name, "ranks": n, "time": t, "bytes": measured, "predicted": predicted})

    def run_overlapped(name, step_fn, params, x, predicted):
        def step():
            for p in params + [x]:
                p.grad = None
            step_fn(x)
        counts.clear()
        step()
        measured = dict(counts)
        world.barrier()
        t = float(all_reduce(np.array([_time(step, args.steps)]), op="max")[0])
        rows.append({"name": name, "ranks": n, "time": t, "bytes": measured, "predicted": predicted})

    if n == 1:
        fc, act, proj = nn.Linear(E, H), nn.GELU("tanh"), nn.Linear(H, E)
        x = Tensor(rng.standard_normal((T, E)).astype(np.float32), requires_grad=True)
        run("serial nn.Linear pair", lambda v: proj(act(fc(v))), [fc.weight, fc.bias, proj.weight, proj.bias], x, {})
    else:
        mlp = TensorParallelMLP(E, H, group=world.default_group)
        x = Tensor(rng.standard_normal((T, E)).astype(np.float32), requires_grad=True)
        run(f"Megatron column+row, p={n}", mlp, list(mlp.parameters()), x, {"world": 2 * 4 * T * E})
    for shape in SHAPES[n]:
        if n == 1:
            continue
        G_r, G_c, G_d = shape
        grid = axonmpi.ProcessGrid(world, G_intra_r=G_r, G_intra_c=G_c, G_intra_d=G_d)
        g = TensorParallelGroups.from_grid(grid)
        l1 = intra_layer.Linear(E, H, expert_mode=True, groups=g)
        l2 = intra_layer.Linear(H, E, transpose=True, expert_mode=True, groups=g)
        act = nn.GELU("tanh")
        t = T // G_d
        x = Tensor(rng.standard_normal((t, E // G_c)).astype(np.float32), requires_grad=True)
        pred = {}
        if G_c > 1:   # l1 forward all-reduce of t*H/G_r, l2 backward dX all-reduce of t*H/G_r
            pred[g.col.name] = 4 * 2 * t * H // G_r
        if G_r > 1:   # l1 backward dX all-reduce of t*E/G_c, l2 forward all-reduce of t*E/G_c
            pred[g.row.name] = 4 * 2 * t * E // G_c
        if G_d > 1:   # per layer: all-gather + reduce-scatter of E*H/(G_r*G_c)
            pred[g.depth.name] = 4 * 2 * 2 * E * H // (G_r * G_c)
        params = list(l1.parameters()) + list(l2.parameters())
        run(f"AxoNN 3-D (G_r,G_c,G_d)={shape}", lambda v: l2(act(l1(v))), params, x, pred)
        if G_d > 1:
            pair = nn.Sequential(l1, act, l2)

            def overlapped(v):
                with intra_layer.optimize_communication(True, True, True, model=pair):
                    y = pair(v)
                    y.backward(Tensor(np.ones(y.shape, np.float32)))
                return None
            run_overlapped(f"  + optimize_communication(all)", overlapped, params, x, pred)
        grid.free()
    if world.rank == 0:
        print("JSON" + json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
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
        cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--embed",
               str(args.embed), "--hidden", str(args.hidden), "--tokens", str(args.tokens), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows += json.loads([line for line in out.splitlines() if line.startswith("JSON")][0][4:])
    base = next(r["time"] for r in rows if r["ranks"] == 1)
    print(f"MLP block E={args.embed} H={args.hidden} tokens={args.tokens} float32, 1 BLAS thread per rank")
    print(f"{'layout':40s} {'ranks':>5s} {'step ms':>9s} {'speed-up':>8s}  bytes per group (measured / predicted)")
    for r in rows:
        b = ", ".join(f"{k}: {r['bytes'].get(k, 0)}/{v}" for k, v in r["predicted"].items()) or "-"
        print(f"{r['name']:40s} {r['ranks']:5d} {1e3 * r['time']:9.2f} {base / r['time']:8.2f}x  {b}")


if __name__ == "__main__":
    main()
