"""Where the host time of one collective goes: cProfile of repeated calls on device (or host) arrays.

    mpiexec -n 1 python bench/collective_profile.py --device cuda --op reduce_scatter --mib 64 --calls 20

Prints the call's median wall time beside the same call through the raw NCCL communicator (``--device cuda``),
then the functions that took the most host time (``--top``).  A companion to ``bench/collectives.py``, which
measures the ratio; this one says where a gap comes from.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np

import axonmpi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--op", choices=["all_reduce", "reduce_scatter", "all_gather"], default="reduce_scatter")
    ap.add_argument("--mib", type=float, default=64.0, help="buffer size in MiB (default 64)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    if args.calls < 1 or args.mib <= 0 or args.top < 1:
        ap.error("--calls and --top must be >= 1, --mib > 0")
    world = axonmpi.init()
    xp = np
    if args.device == "cuda":
        xp = axonmpi.backend.get_cupy()
    n = int(args.mib * 2**20 // 4) // world.world_size * world.world_size
    x = xp.ones(n, np.float32)
    out = xp.empty(n // world.world_size if args.op == "reduce_scatter" else n * (world.world_size if args.op == "all_gather" else 1), np.float32)

    def call():
        if args.op == "all_reduce":
            axonmpi.all_reduce(x, out=out)
        elif args.op == "reduce_scatter":
            axonmpi.reduce_scatter(x, out=out)
        else:
            axonmpi.all_gather(x[: n // world.world_size], out=out[: n])

    def sync():
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
    for _ in range(3):
        call()
    sync()
    times = []
    prof = cProfile.Profile()
    for _ in range(args.calls):
        t0 = time.perf_counter()
        prof.enable()
        call()
        sync()
        prof.disable()
        times.append(time.perf_counter() - t0)
    if world.rank == 0:
        print(f"{args.op} {args.mib:g} MiB float32 on {args.device}, {world.world_size} rank(s): median "
              f"{np.median(times) * 1e6:.1f} us over {args.calls} calls")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
