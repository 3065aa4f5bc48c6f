"""In-memory checkpoints (checkpoint/memory.py): the per-step copy's cost as a fraction of a step, the memory
it holds, and the time to resume from memory vs from the HDF5 checkpoint, in one invocation.

    mpiexec -n 4 python bench/memory_checkpoint.py                 # "nodes" of n/2 ranks (one machine)
    mpiexec -n 4 python bench/memory_checkpoint.py --hidden 1024

The model is a DDP MLP (``--layers`` Linear(hidden, hidden) + Tanh, float32) trained with Adam on a batch of
``--batch`` rows per rank; a step is forward, backward (DDP's all-reduce), Adam. "copy" is the step with
``MemoryCheckpointer.save`` after it (the blob copy and the exchange's posting; the node-local write and the
buddy transfer overlap the next step), timed as the median of ``--steps`` steps of each kind, alternating.
Resume times: ``resume`` from memory (every rank's blob on its node) and ``CheckpointManager.load_latest``
of the same state from HDF5 (page cache warm: both read memory), best of ``--repeats``, slowest rank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402
from axonmpi import nn, optim  # noqa: E402
from axonmpi.autograd import Tensor  # noqa: E402
from axonmpi.checkpoint import CheckpointManager, training_state  # noqa: E402
from axonmpi.checkpoint.memory import MemoryCheckpointer, resume  # noqa: E402
import axonmpi.nn.functional as F  # noqa: E402


def _slowest(t: float) -> float:
    return float(axonmpi.all_reduce(np.array(t), op="max"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    world = axonmpi.init()
    if world.world_size >= 2:
        os.environ.setdefault("AXONMPI_MEMORY_NODE_SIZE", str(max(1, world.world_size // 2)))
    d = axonmpi.broadcast_object(tempfile.mkdtemp(prefix="axonmpi-memck-") if world.rank == 0 else None)
    shm = axonmpi.broadcast_object(tempfile.mkdtemp(prefix="axonmpi-memck-", dir="/dev/shm" if os.path.isdir(
        "/dev/shm") else None) if world.rank == 0 else None)
    axonmpi.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
    model = axonmpi.DDP(nn.Sequential(*layers))
    opt = optim.Adam(model.parameters(), lr=1e-3)
    x = Tensor(np.random.default_rng(world.rank).standard_normal((args.batch, args.hidden)).astype(np.float32))
    y = Tensor(np.zeros((args.batch, args.hidden), np.float32))
    mgr = CheckpointManager(os.path.join(d, "ckpt"))
    mem = MemoryCheckpointer("bench", root=shm)

    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    plain, copy = [], []
    for i in range(1, args.steps + 1):
        axonmpi.barrier()
        t0 = time.perf_counter()
        step()
        plain.append(_slowest(time.perf_counter() - t0))
        axonmpi.barrier()
        t0 = time.perf_counter()
        step()
        mem.save(i, training_state(model, opt, step=i))
        copy.append(_slowest(time.perf_counter() - t0))
    mem.wait()
    state_bytes = sum(p.data.nbytes for p in model.parameters()) * 3     # weights + Adam's two moments
    held = sum(os.path.getsize(os.path.join(mem.folder, f)) for f in os.listdir(mem.folder))
    mgr.save(args.steps, training_state(model, opt, step=args.steps))
    t_mem, t_h5 = [], []
    for _ in range(args.repeats):
        axonmpi.barrier()
        t0 = time.perf_counter()
        _, src = resume(mgr, mem, training_state(model, opt))
        t_mem.append(_slowest(time.perf_counter() - t0))
        axonmpi.barrier()
        t0 = time.perf_counter()
        mgr.load_latest(training_state(model, opt))
        t_h5.append(_slowest(time.perf_counter() - t0))
    if world.rank == 0:
        p, c = float(np.median(plain)), float(np.median(copy))
        print(f"ranks {world.world_size}, nodes of {os.environ.get('AXONMPI_MEMORY_NODE_SIZE')} ranks, "
              f"{state_bytes / 2**20:.1f} MiB of state per rank ({args.layers} x Linear({args.hidden}), Adam)")
        print("| step | median ms | vs plain |")
        print("|---|---|---|")
        print(f"| plain | {p * 1e3:.2f} | 1.00x |")
        print(f"| with memory copy | {c * 1e3:.2f} | {c / p:.2f}x ({(c - p) / p * 100:+.1f}%) |")
        print(f"\nmemory held on node 0's folder: {held / 2**20:.1f} MiB (two steps of its ranks and their wards)")
        print("\n| resume | best ms |\n|---|---|")
        print(f"| from memory ({src}) | {min(t_mem) * 1e3:.1f} |")
        print(f"| from HDF5 | {min(t_h5) * 1e3:.1f} |")
    mem.close()
    mgr.release()
    axonmpi.barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
