"""Latency and bus bandwidth of axonmpi collectives beside raw mpi4py on the same buffers.

Run: mpiexec -n 2 python bench/collectives.py [--max-mib 64] [--ops all_reduce,all_gather,...]
     mpiexec -n <gpus> python bench/collectives.py --device cuda      # one rank per GPU

With --device cuda the buffers are CuPy arrays on each rank's GPU and axonmpi's NCCL backend is
compared with raw ``cupy.cuda.nccl`` calls on a communicator set up the same way (unique id from
rank 0 broadcast over MPI) in the same run, sizes 1 KiB .. --max-mib (default 256 MiB); "ratio"
is axonmpi's bus bandwidth over raw NCCL's (target >= 0.95 from 1 MiB). A "cuda-aware MPI"
column times mpi4py on the device buffers when the MPI is CUDA-aware (AXONMPI_CUDA_AWARE=1 to
declare it), else shows "-". Without CuPy, NCCL or a GPU it stops with a message.
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
    ap.add_argument("--max-mib", type=int, default=None, help="largest message in MiB (default 64; cuda: 256)")
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    ap.add_argument("--trials", type=int, default=3, help="alternating trials per size; best is kept")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: NumPy buffers over MPI; cuda: CuPy buffers, NCCL backend vs raw cupy.cuda.nccl")
    args = ap.parse_args()
    if args.device == "cuda":
        return main_cuda(args)
    args.max_mib = 64 if args.max_mib is None else args.max_mib
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


def _no_gpu_reason():
    """Why the cuda bench cannot run here, or None."""
    from axonmpi import backend
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return f"CuPy is not installed ({type(e).__name__}: {e}); pip install 'axonmpi[cuda12]'"
    if not backend.cupy_available():
        return "CuPy sees no CUDA GPU on this machine (run it on a GPU node, one rank per GPU)"
    from axonmpi.distributed.backends import nccl_available
    if not nccl_available():
        return "CuPy has no NCCL here (pip install nvidia-nccl-cu12)"
    return None


def main_cuda(args):
    reason = _no_gpu_reason()
    if reason is not None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"bench/collectives.py --device cuda: {reason}", file=sys.stderr)
        return 2
    import cupy as cp
    from cupy.cuda import nccl
    from axonmpi.distributed.backends import cuda_aware_mpi, nccl_version
    world = axonmpi.init(device="cuda", backend="nccl")
    comm = world.default_group.comm
    n, r = world.world_size, world.rank
    uid = comm.bcast(nccl.get_unique_id() if r == 0 else None, root=0)   # the backend's own bootstrap
    raw = nccl.NcclCommunicator(n, uid, r)
    aware = cuda_aware_mpi()
    stream = cp.cuda.get_current_stream()
    max_mib = 256 if args.max_mib is None else args.max_mib
    sizes, b = [], 1024
    while b <= max_mib * (1 << 20):
        sizes.append(b)
        b *= 4
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "broadcast": 1.0}
    F32, SUM = nccl.NCCL_FLOAT32, nccl.NCCL_SUM

    def timed(fn, reps):
        fn()
        stream.synchronize()
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        stream.synchronize()
        comm.Barrier()
        return (time.perf_counter() - t) / reps

    if r == 0:
        print(f"axonmpi {axonmpi.__version__} NCCL backend vs raw cupy.cuda.nccl, {n} rank(s) on "
              f"{cp.cuda.runtime.getDeviceProperties(world.device.index)['name'].decode()}, float32, "
              f"NCCL {nccl_version()}, CuPy {cp.__version__}, CUDA-aware MPI {'yes' if aware else 'no'}")
        print(f"{'op':<15}{'bytes':>11} {'raw us':>9} {'axon us':>9} {'raw GB/s':>9} {'axon GB/s':>9} "
              f"{'ratio':>6} {'mpi GB/s':>9}")
    worst = None
    for op in args.ops.split(","):
        for nbytes in sizes:
            count = nbytes // 4
            reps = max(5, min(1000, int(4e10 // max(nbytes, 1) // 8)))
            mpi = None
            if op == "all_reduce":
                x = cp.ones(count, cp.float32)
                p = x.data.ptr
                raw_fn = lambda: raw.allReduce(p, p, count, F32, SUM, stream.ptr)   # noqa: E731
                axn = lambda: axonmpi.all_reduce(x, out=x)                           # noqa: E731
                if aware:
                    mpi = lambda: (stream.synchronize(), comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM))  # noqa: E731
            elif op == "all_gather":
                c = max(1, count // n)
                x, y = cp.ones(c, cp.float32), cp.empty(c * n, cp.float32)
                raw_fn = lambda: raw.allGather(x.data.ptr, y.data.ptr, c, F32, stream.ptr)   # noqa: E731
                axn = lambda: axonmpi.all_gather(x, out=y)                                  # noqa: E731
                if aware:
                    mpi = lambda: (stream.synchronize(), comm.Allgather(x, y))              # noqa: E731
            elif op == "reduce_scatter":
                c = max(1, count // n)
                x, y = cp.ones(c * n, cp.float32), cp.empty(c, cp.float32)
                raw_fn = lambda: raw.reduceScatter(x.data.ptr, y.data.ptr, c, F32, SUM, stream.ptr)  # noqa: E731
                axn = lambda: axonmpi.reduce_scatter(x, out=y)                                      # noqa: E731
                if aware:
                    mpi = lambda: (stream.synchronize(), comm.Reduce_scatter_block(x, y, MPI.SUM))  # noqa: E731
            elif op == "broadcast":
                x = cp.ones(count, cp.float32)
                p = x.data.ptr
                raw_fn = lambda: raw.broadcast(p, p, count, F32, 0, stream.ptr)   # noqa: E731
                axn = lambda: axonmpi.broadcast(x, src=0)                           # noqa: E731
                if aware:
                    mpi = lambda: (stream.synchronize(), comm.Bcast(x, root=0))     # noqa: E731
            else:
                raise SystemExit(f"unknown op {op!r}")
            t_raw, t_axn, t_mpi = [], [], []
            for _ in range(args.trials):
                t_raw.append(timed(raw_fn, reps))
                t_axn.append(timed(axn, reps))
                if mpi is not None:
                    t_mpi.append(timed(mpi, reps))
            tr, ta = min(t_raw), min(t_axn)
            full = nbytes if op in ("all_reduce", "broadcast") else (nbytes // n // 4) * 4 * n
            bw = lambda t: full / t * factor[op] / 1e9   # noqa: E731
            ratio = tr / ta
            if op == "all_reduce" and nbytes >= (1 << 20):
                worst = ratio if worst is None else min(worst, ratio)
            mcol = f"{bw(min(t_mpi)):9.2f}" if t_mpi else f"{'-':>9}"
            if r == 0:
                print(f"{op:<15}{full:>11d} {tr * 1e6:9.1f} {ta * 1e6:9.1f} {bw(tr):9.2f} {bw(ta):9.2f} "
                      f"{ratio:6.3f} {mcol}", flush=True)
    if r == 0 and worst is not None:
        print(f"all_reduce >= 1 MiB: worst axonmpi/raw NCCL ratio {worst:.3f} "
              f"({'meets' if worst >= 0.95 else 'BELOW'} the 0.95 target)")
    raw.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
