"""GPT training step time on GPUs: axonmpi's GPT + DDP (NCCL) + AdamW on CuPy at 1..N GPUs.

For each rank count in --ranks (default 1 .. number of GPUs) this launches
``mpiexec -n K python bench/gpu.py --worker`` (one rank per GPU, bound by local rank), trains the
char-GPT shape of examples/train_gpt.py (sizes below) on random tokens with a fixed local batch
per GPU (weak scaling), and prints ms/step (median of the timed steps, the device synchronized
at each step's end), tokens/s over all GPUs and the scaling efficiency against one GPU.
Without CuPy, NCCL or a GPU it stops with a message (exit status 2).

    python bench/gpu.py                         # 1 .. all GPUs of this node
    python bench/gpu.py --ranks 1 4 --n-layer 8 --n-embd 512 --batch 32
    mpiexec -n 2 python bench/gpu.py --worker   # one run, one result line
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="one run under mpiexec (prints one result line)")
    ap.add_argument("--ranks", type=int, nargs="*", default=None, help="rank counts (default 1 .. GPUs)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=96, help="vocabulary size (characters)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    return ap.parse_args(argv)


def no_gpu_reason():
    """Why this bench cannot run here, or None."""
    from axonmpi import backend
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return f"CuPy is not installed ({type(e).__name__}: {e}); pip install 'axonmpi[cuda12]'"
    if not backend.cupy_available():
        return "CuPy sees no CUDA GPU on this machine (run it on a GPU node)"
    from axonmpi.distributed.backends import nccl_available
    if not nccl_available():
        return "CuPy has no NCCL here (pip install nvidia-nccl-cu12)"
    return None


def worker(a) -> int:
    import numpy as np
    from mpi4py import MPI
    reason = no_gpu_reason()
    if reason is not None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"bench/gpu.py: {reason}", file=sys.stderr)
        return 2
    import cupy as cp
    import axonmpi
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.parallel import DDP
    world = axonmpi.init(device="cuda")
    n, r = world.world_size, world.rank
    axonmpi.random.manual_seed(0)
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    model = GPT(cfg, dtype=getattr(np, a.dtype)).to(world.device)
    model = DDP(model) if n > 1 else model
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rng = cp.random.default_rng(1 + r)
    stream = cp.cuda.get_current_stream()
    times = []
    for step in range(a.warmup + a.steps):
        x = rng.integers(0, a.vocab, (a.batch, a.block_size))
        y = rng.integers(0, a.vocab, (a.batch, a.block_size))
        stream.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        stream.synchronize()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
    slowest = world.default_group.comm.allreduce(float(np.median(times)), op=MPI.MAX)
    params = sum(p.data.size for p in model.parameters())
    if r == 0:
        name = cp.cuda.runtime.getDeviceProperties(world.device.index)["name"].decode()
        print(f"RESULT ranks={n} ms_per_step={slowest * 1e3:.2f} tokens_per_s={n * a.batch * a.block_size / slowest:.0f} "
              f"params={params} gpu={name.replace(' ', '_')}", flush=True)
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"bench/gpu.py: {reason}", file=sys.stderr)
        return 2
    from axonmpi.backend import device_count
    ranks = a.ranks or list(range(1, device_count() + 1))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else "mpiexec"
    passthru = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("worker", "ranks")]
    print(f"GPT {a.n_layer} layers x {a.n_embd} wide, {a.n_head} heads, context {a.block_size}, "
          f"{a.batch} sequences per GPU, {a.dtype}, DDP over NCCL, AdamW + clipping; median of {a.steps} steps")
    print(f"{'GPUs':>5} {'ms/step':>9} {'tokens/s':>11} {'efficiency':>10}  gpu")
    base = None
    for k in ranks:
        res = subprocess.run([mpiexec, "-n", str(k), sys.executable, os.path.abspath(__file__), "--worker", *passthru],
                             capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
        if res.returncode != 0 or line is None:
            print(f"{k:>5} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
            return 1
        f = dict(kv.split("=", 1) for kv in line.split()[1:])
        tps = float(f["tokens_per_s"])
        base = tps if base is None and k == ranks[0] else base
        eff = tps / (base * k / ranks[0]) if base else float("nan")
        print(f"{k:>5} {float(f['ms_per_step']):9.2f} {tps:11.0f} {eff:10.2f}  {f['gpu']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
