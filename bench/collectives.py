"""Latency and bus bandwidth of axonmpi collectives beside raw mpi4py on the same buffers.

Run: mpiexec -n 2 python bench/collectives.py [--max-mib 64] [--ops all_reduce,all_gather,...]
Bus bandwidth follows the nccl-tests convention: all_reduce 2(n-1)/n, all_gather and
reduce_scatter (n-1)/n of the algorithm bandwidth (bytes of the full buffer per second),
broadcast 1. "added" is axonmpi's time minus raw mpi4py's per call.
"""
import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402


def timeit(fn, reps, comm):
    fn()
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    comm.Barrier()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-mib", type=int, default=64, help="largest message in MiB (default 64)")
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    ap.add_argument("--trials", type=int, default=3, help="alternating trials per size; best is kept")
    args = ap.parse_args()
    world = axonmpi.init()
    comm = world.default_group.comm
    n, r = world.world_size, world.rank
    sizes = []
    b = 1024
    while b <= args.max_mib * (1 << 20):
        sizes.append(b)
        b *= 4
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "broadcast": 1.0}
    if r == 0:
        print(f"axonmpi {axonmpi.__version__} collectives vs raw mpi4py, {n} ranks, float32, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"{'op':<15}{'bytes':>10} {'raw us':>10} {'axon us':>10} {'added us':>9} "
              f"{'raw GB/s':>9} {'axon GB/s':>9} {'ratio':>6}")
    for op in args.ops.split(","):
        for nbytes in sizes:
            count = nbytes // 4
            reps = max(5, min(2000, int(2e8 // max(nbytes, 1) // 8)))
            if op == "all_reduce":
                x = np.ones(count, np.float32)
                raw = lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)   # noqa: E731
                axn = lambda: axonmpi.all_reduce(x, out=x)               # noqa: E731
            elif op == "all_gather":
                c = max(1, count // n)
                x = np.ones(c, np.float32)
                y = np.empty(c * n, np.float32)
                raw = lambda: comm.Allgather(x, y)                       # noqa: E731
                axn = lambda: axonmpi.all_gather(x, out=y)               # noqa: E731
            elif op == "reduce_scatter":
                c = max(1, count // n)
                x = np.ones(c * n, np.float32)
                y = np.empty(c, np.float32)
                raw = lambda: comm.Reduce_scatter_block(x, y, MPI.SUM)   # noqa: E731
                axn = lambda: axonmpi.reduce_scatter(x, out=y)           # noqa: E731
            elif op == "broadcast":
                x = np.ones(count, np.float32)
                raw = lambda: comm.Bcast(x, root=0)                      # noqa: E731
                axn = lambda: axonmpi.broadcast(x, src=0)                # noqa: E731
            else:
                raise SystemExit(f"unknown op {op!r}")
            t_raw, t_axn = [], []
            for _ in range(args.trials):
                t_raw.append(timeit(raw, reps, comm))
                t_axn.append(timeit(axn, reps, comm))
            tr, ta = min(t_raw), min(t_axn)
            full = nbytes if op in ("all_reduce", "broadcast") else (nbytes // n // 4) * 4 * n
            bw_r = full / tr * factor[op] / 1e9
            bw_a = full / ta * factor[op] / 1e9
            if r == 0:
                print(f"{op:<15}{full:>10d} {tr * 1e6:10.1f} {ta * 1e6:10.1f} {(ta - tr) * 1e6:9.1f} "
                      f"{bw_r:9.2f} {bw_a:9.2f} {tr / ta:6.2f}", flush=True)


if __name__ == "__main__":
    main()
