"""A pipeline's data-parallel reduction overlapped with its schedule, beside the blocking reduction after it.

For each schedule in --schedules and each layout in --layouts (``PxD``: P pipeline ranks x D data ranks) this runs
``mpiexec -n P*D python bench/pipeline_overlap.py --worker``: ``parallelize(model, data_parallel="ddp",
pipeline=PipelinePlan(m, schedule))`` on --layers Linear(--width) + tanh layers, and every rank alternates steps with
``pm.pipeline.overlap`` True (each stage's reduction launched after its last backward, [Note: overlapped stage
reductions]) and False (every stage's reduction after the schedule), so load from other processes falls on both
alike.  Per step it keeps the slowest rank's step time and the largest ``timing().reduce_seconds`` (the
reduction's time outside the schedule's compute: launches plus the wait after it; blocking: the whole reduction),
and prints the medians over --steps steps after a warm-up and their ratio ("exposed / blocking"; the issue's aim
is at most 0.25).  Parity of the two paths is tested (tests/test_pipeline_runtime.py); timings never are.

    OMP_NUM_THREADS=1 python bench/pipeline_overlap.py
    python bench/pipeline_overlap.py --layouts 2x2 --schedules 1f1b zbv --width 1024
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(args) -> None:
    import numpy as np

    import axonmpi
    import axonmpi.nn as nn
    from axonmpi.distributed import ReduceOp, all_reduce, barrier
    from axonmpi.optim import SGD
    from axonmpi.parallel import PipelinePlan, parallelize
    p, d = (int(v) for v in args.layout.split("x"))
    world = axonmpi.init(G_inter=p, G_data=d)
    axonmpi.random.manual_seed(0)
    W = args.width
    layers = [nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(args.layers - 1)]
    layers.append(nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 10)))
    v = 2 if args.schedule in ("interleaved", "zbv") else 1
    pm = parallelize(nn.Sequential(*layers), data_parallel="ddp",
                     pipeline=PipelinePlan(args.micro, args.schedule, virtual_stages=v, split_by="layers"))
    opt = SGD(pm.parameters(), lr=1e-3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.batch, W)).astype(np.float32)
    y = rng.integers(0, 10, args.batch)
    xb, yb = pm.local_batch(x, y)
    out = {True: ([], []), False: ([], [])}
    order = [True, False, False, True]
    for k in range(2 * (args.steps + 1)):
        overlap = order[k % 4]
        pm.pipeline.overlap = overlap
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        pm.step(xb, yb)
        opt.step()
        dt = time.perf_counter() - t0
        worst = all_reduce(np.array([dt, pm.pipeline.timing().reduce_seconds]), ReduceOp.MAX)
        if k >= 2:
            out[overlap][0].append(float(worst[0]))
            out[overlap][1].append(float(worst[1]))
    if world.rank == 0:
        print("RESULT " + json.dumps({str(k): v for k, v in out.items()}), flush=True)


def _median(v):
    v = sorted(v)
    return 0.5 * (v[(len(v) - 1) // 2] + v[len(v) // 2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=["2x2"], help="PxD: pipeline x data ranks")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128, help="global batch")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each path (after a warm-up)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=ROOT)
    print(f"width {args.width}, {args.layers} layers, batch {args.batch} in {args.micro} micro-batches, float32, "
          f"{args.steps} steps of each path alternating; medians of the slowest rank per step (ms)", flush=True)
    print(f"{'layout':<7} {'schedule':<12} | {'step overlap':>12} {'blocking':>9} | {'reduce exposed':>14} "
          f"{'blocking':>9} {'exposed/blocking':>17}", flush=True)
    rows = []
    for layout in args.layouts:
        n = eval(layout.replace("x", "*"))
        for sched in args.schedules:
            cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--layout", layout,
                   "--schedule", sched, "--width", str(args.width), "--layers", str(args.layers),
                   "--batch", str(args.batch), "--micro", str(args.micro), "--steps", str(args.steps)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{layout:<7} {sched:<12} | failed: {(res.stderr or res.stdout)[-400:]}", flush=True)
                continue
            got = json.loads(line[7:])
            row = {"layout": layout, "schedule": sched,
                   "step_overlap": _median(got["True"][0]), "step_blocking": _median(got["False"][0]),
                   "reduce_exposed": _median(got["True"][1]), "reduce_blocking": _median(got["False"][1])}
            rows.append(row)
            print(f"{layout:<7} {sched:<12} | {1e3 * row['step_overlap']:>12.1f} {1e3 * row['step_blocking']:>9.1f} | "
                  f"{1e3 * row['reduce_exposed']:>14.1f} {1e3 * row['reduce_blocking']:>9.1f} "
                  f"{row['reduce_exposed'] / row['reduce_blocking']:>16.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
