"""DDP training throughput beside the anchors: hand-written NumPy + MPI, and PyTorch DDP (gloo, CPU).

For each world size in --ranks (default 1 2 4) this runs, in one invocation and one after the
other, on the same MLP 784 -> HIDDEN -> HIDDEN -> 10 with BATCH samples per rank, Adam and one
BLAS thread per rank:

  * axonmpi   ``mpiexec -n N python bench/ddp.py --worker``  (DistributedDataParallel, OVERLAP)
  * numpy+mpi ``mpiexec -n N python ../shared/anchors/numpy_mpi_mlp.py``
  * torch     ``torchrun --nproc_per_node=N ../shared/anchors/torch_ddp_mlp.py`` (skipped without torch;
              ``pip install torch==2.13.0`` takes the CPU wheel)

and prints samples/s, the ratios axonmpi/numpy+mpi and axonmpi/torch, and scaling efficiency
(samples/s at N ranks / (N * samples/s at 1 rank)). The whole set is repeated --repeats times
and the best of each kept, which damps noise on a shared machine. Env vars HIDDEN, BATCH and
STEPS size the run (defaults 2048, 128, 30), as for the anchors.

    python bench/ddp.py                      # 1, 2 and 4 ranks
    python bench/ddp.py --ranks 2 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHORS = os.path.join(ROOT, "..", "shared", "anchors")


def worker() -> None:
    """One DDP run under mpiexec; prints a line in the anchors' format."""
    import numpy as np

    sys.path.insert(0, ROOT)
    import axonmpi
    import axonmpi.nn as nn
    import axonmpi.nn.functional as F
    from axonmpi.optim import Adam

    world = axonmpi.init()
    H = int(os.environ.get("HIDDEN", "2048"))
    B = int(os.environ.get("BATCH", "128"))
    STEPS = int(os.environ.get("STEPS", "30"))
    axonmpi.manual_seed(0)
    model = axonmpi.DDP(nn.Sequential(nn.Linear(784, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, 10)))
    opt = Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(world.rank)
    x = axonmpi.Tensor(rng.standard_normal((B, 784)).astype(np.float32))
    y = axonmpi.Tensor(rng.integers(0, 10, B))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    axonmpi.barrier()
    t = time.perf_counter()
    for _ in range(STEPS):
        step()
    axonmpi.barrier()
    dt = (time.perf_counter() - t) / STEPS
    if world.rank == 0:
        print(f"axonmpi ws={world.world_size} hidden={H} batch/rank={B} step={dt * 1e3:.1f} ms  "
              f"samples/s={B * world.world_size / dt:.0f}", flush=True)


def _env():
    sys.path.insert(0, ROOT)
    from axonmpi.testing import mpiexec_env

    env = mpiexec_env({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                       "THREADS": "1"})
    return env


def _samples(cmd, env, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    m = re.search(r"samples/s=(\d+)", r.stdout)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}")
    return float(m.group(1)), re.search(r"step=([0-9.]+) ms", r.stdout).group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    ap.add_argument("--repeats", type=int, default=2, help="repeat the whole set, keep the best (default 2)")
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    sys.path.insert(0, ROOT)
    from axonmpi.distributed.launch import mpiexec_path

    env = _env()
    mpiexec = mpiexec_path()
    torchrun = shutil.which("torchrun") or (os.path.join(os.path.dirname(sys.executable), "torchrun")
                                            if os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun"))
                                            else None)
    try:
        import torch  # noqa: F401
        have_torch = torchrun is not None
    except ImportError:
        have_torch = False
    have_anchors = os.path.isdir(ANCHORS)
    best = {}
    for _ in range(args.repeats):
        for n in args.ranks:
            runs = {"axonmpi": [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker"]}
            if have_anchors:
                runs["numpy+mpi"] = [mpiexec, "-n", str(n), sys.executable, os.path.join(ANCHORS, "numpy_mpi_mlp.py")]
            if have_torch and have_anchors:
                runs["torch"] = ([torchrun, f"--nproc_per_node={n}", "--master_port=29561",
                                  os.path.join(ANCHORS, "torch_ddp_mlp.py")] if n > 1
                                 else [sys.executable, os.path.join(ANCHORS, "torch_ddp_mlp.py")])
            for name, cmd in runs.items():
                sps, ms = _samples(cmd, env)
                key = (name, n)
                if key not in best or sps > best[key][0]:
                    best[key] = (sps, ms)
    H, B = os.environ.get("HIDDEN", "2048"), os.environ.get("BATCH", "128")
    print(f"MLP 784-{H}-{H}-10, batch {B}/rank, Adam, float32, 1 thread/rank, best of {args.repeats}")
    hdr = f"{'ranks':>5} | {'axonmpi':>16} | {'numpy+mpi':>16} | {'torch DDP':>16} | {'vs numpy':>8} | {'vs torch':>8} | {'scaling':>7}"
    print(hdr)
    print("-" * len(hdr))
    base = best.get(("axonmpi", args.ranks[0]))
    for n in args.ranks:
        a = best[("axonmpi", n)]
        m = best.get(("numpy+mpi", n), (float("nan"), "n/a"))
        t = best.get(("torch", n))
        eff = a[0] / (n / args.ranks[0] * base[0]) if base else float("nan")
        print(f"{n:>5} | {a[0]:>7.0f} ({a[1]:>5} ms) | {m[0]:>7.0f} ({m[1]:>5} ms) | "
              + (f"{t[0]:>7.0f} ({t[1]:>5} ms)" if t else f"{'n/a':>16}")
              + f" | {a[0] / m[0]:>8.2f} | " + (f"{a[0] / t[0]:>8.2f}" if t else f"{'n/a':>8}") + f" | {eff:>7.2f}")
    print("samples/s (step time); ratios are axonmpi / peer samples/s (higher is better for axonmpi); "
          "scaling = samples/s at N / (N x samples/s at the first size)")
    if not have_anchors:
        print(f"note: anchor comparison skipped: {os.path.normpath(ANCHORS)} not found (../shared/anchors "
              "beside the repository)")
    elif not have_torch:
        print("torch not installed: pip install torch==2.13.0 for the PyTorch DDP column")


if __name__ == "__main__":
    main()
