"""In-memory checkpoints (checkpoint/memory.py) on the demo's training job: the per-step copy's exposed cost as a
fraction of a step, the node memory it holds, and the time to resume from memory vs from HDF5, in one invocation.

    mpiexec -n 4 python bench/memory_checkpoint.py            # the demo (make demo): train_gpt.py's default size
    mpiexec -n 8 python bench/memory_checkpoint.py --steps 20

It runs ``examples/train_gpt.py`` (default model, DDP over the ranks, "nodes" of n/2 ranks) with
``--memory-checkpoint-every 1`` and times, on every rank, each ``MemoryCheckpointer.save`` (what the step waits for:
completing the previous exchange with the buddy, the copy into the slot, posting the next exchange; the transfer
itself overlaps the next step) against the step time the trainer logs (medians over the steps after the first 3,
slowest rank). At the last step the same state is saved to HDF5, then loaded back into the live arrays from node
memory (``find`` + ``load``) and from HDF5 (``checkpoint.load``; page cache warm: both read memory), best of
``--repeats``, slowest rank. Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import axonmpi  # noqa: E402
from axonmpi import checkpoint as ckpt  # noqa: E402
from axonmpi.checkpoint import memory  # noqa: E402


def _slowest(t: float) -> float:
    return float(axonmpi.all_reduce(np.array(t), op="max"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args, rest = ap.parse_known_args()
    world = axonmpi.init()
    if world.world_size >= 2:
        os.environ.setdefault("AXONMPI_MEMORY_NODE_SIZE", str(max(1, world.world_size // 2)))
    d = axonmpi.broadcast_object(tempfile.mkdtemp(prefix="axonmpi-memck-") if world.rank == 0 else None)
    times, out = [], {}
    save = memory.MemoryCheckpointer.save

    def timed(self, step, state):
        t0 = time.perf_counter()
        save(self, step, state)
        times.append(time.perf_counter() - t0)
        if step == args.steps:
            self.wait()
            out["bytes"] = self.memory_bytes()
            path = os.path.join(d, "h5")
            ckpt.save(path, state)
            t_mem, t_h5 = [], []
            for _ in range(args.repeats):
                axonmpi.barrier()
                t1 = time.perf_counter()
                copy = self.find()
                copy.load(state)
                copy.close()
                t_mem.append(_slowest(time.perf_counter() - t1))
                axonmpi.barrier()
                t1 = time.perf_counter()
                ckpt.load(path, state)
                t_h5.append(_slowest(time.perf_counter() - t1))
            out["mem"], out["h5"], out["source"] = min(t_mem), min(t_h5), str(copy)

    memory.MemoryCheckpointer.save = timed
    import train_gpt
    metrics = os.path.join(d, "metrics.jsonl")
    train_gpt.main(["--steps", str(args.steps), "--checkpoint-dir", os.path.join(d, "ckpt"), "--no-progress",
                    "--sample-chars", "0", "--eval-batches", "1", "--log-every", "1000", "--memory-checkpoint-every",
                    "1", "--metrics-json", metrics] + rest)
    copy_ms = _slowest(float(np.median(times[3:]))) * 1e3
    nbytes = axonmpi.all_reduce(np.array(out["bytes"], np.int64), op="max")
    if world.rank == 0:
        with open(metrics) as f:
            step_ms = float(np.median([json.loads(r)["step_s"] for r in f][3:])) * 1e3
        print(f"ranks {world.world_size}, nodes of {os.environ.get('AXONMPI_MEMORY_NODE_SIZE')} ranks, "
              f"train_gpt.py {' '.join(rest) or '(demo size)'}; resume: {out['source']}")
        print("| ranks | step ms | copy ms exposed | fraction | node memory per rank (own 2 + ward 2 slots) | "
              "resume from memory ms | resume from HDF5 ms |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {world.world_size} | {step_ms:.1f} | {copy_ms:.2f} | {copy_ms / step_ms * 100:.1f}% | "
              f"{int(nbytes) / 2**20:.1f} MiB | {out['mem'] * 1e3:.1f} | {out['h5'] * 1e3:.1f} |")
    axonmpi.barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
