"""What the always-on collective check costs: all_reduce of 8 B, 1 KiB and 1 MiB, and a DDP step, check on vs off.

One ``mpiexec`` job (``--ranks``, default 2) makes two groups of the same ranks in one process, one with
the check (``checked``) and one without (``unchecked``: made with the check switched off, as
``AXONMPI_CHECK_COLLECTIVES=0`` makes every group), both watched by the watchdog and the flight
recorder, so only the check differs. Then, interleaved (off, on, on, off, ... per round, so that load
from other processes hits both sides alike), ``--rounds`` times:

  * per size, a block of ``--calls`` all-reduces on each group, timed as a block: the mean per call
    includes the exchanges the check makes every ``AXONMPI_CHECK_EVERY`` calls (a per-call median
    would hide them);
  * a DDP step (MLP 784 -> HIDDEN -> HIDDEN -> 10, BATCH rows per rank, Adam) of one model on each
    group, ``--steps`` steps per block.

Prints the median over rounds of each side, the difference (us per call, ms per step) and the ratio,
and the spread (min..max of the per-round differences), with the load average.

    python bench/collective_check.py --ranks 2 --rounds 15
    AXONMPI_CHECK_EVERY=1 python bench/collective_check.py     # the per-call check (the old design)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (("8 B", 1), ("1 KiB", 128), ("1 MiB", 131072))   # float64 elements


def worker(calls: int, rounds: int, steps: int) -> None:
    import statistics
    import time

    import numpy as np

    sys.path.insert(0, ROOT)
    import axonmpi
    import axonmpi.nn as nn
    import axonmpi.nn.functional as F
    from axonmpi.optim import Adam

    w = axonmpi.init()
    wd = w.watchdog
    if wd is None:
        raise SystemExit("the watchdog and the flight recorder are off: nothing to compare")
    ranks = list(range(w.world_size))
    wd.check = True
    checked = w.new_group(ranks, name="checked")
    wd.check = False
    plain = w.new_group(ranks, name="unchecked")
    wd.check = True
    groups = {"off": plain, "on": checked}
    clock = time.perf_counter

    H = int(os.environ.get("HIDDEN", "1024"))
    B = int(os.environ.get("BATCH", "64"))
    models, opts = {}, {}
    for side, g in groups.items():
        axonmpi.manual_seed(0)
        models[side] = axonmpi.DDP(nn.Sequential(nn.Linear(784, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(),
                                                 nn.Linear(H, 10)), group=g)
        opts[side] = Adam(models[side].parameters(), lr=1e-3)
    rng = np.random.default_rng(w.rank)
    x = axonmpi.Tensor(rng.standard_normal((B, 784)).astype(np.float32))
    y = axonmpi.Tensor(rng.integers(0, 10, B))

    def ddp_step(side):
        opts[side].zero_grad()
        F.cross_entropy(models[side](x), y).backward()
        opts[side].step()


    def own_work(n):
        """The check's own work per call on the calling rank, without the MPI latency it overlaps: the
        window append of every call, plus a 1/AXONMPI_CHECK_EVERY share of one exchange (the window's hash,
        the lane sums, Start, and the Test and comparison of the previous exchange), each timed alone."""
        ck = checked._watched.ck
        e = wd.ring[0]
        sig = (1, 12, (1,), -1, 3)
        every = ck.every
        ck.settle(True)
        t = clock()
        for _ in range(n):                 # the per-call part, as in WatchedComm.Allreduce
            win = ck.win
            win.append((sig, e, e[12], None))
            if len(win) >= n + 1:
                pass
        per_call = (clock() - t) / n
        ck.win = []
        spent, k = 0.0, max(4, n // every)
        for _ in range(k):                 # the per-exchange part
            ck.win = [(sig, e, e[12], None)] * every
            w.barrier()
            t = clock()
            ck.exchange(e, False)
            spent += clock() - t
            ck.settle(True)                # not timed: the latency a real loop's calls overlap
        return per_call + spent / k / every

    bufs = {label: np.ones(n) for label, n in SIZES}
    own = []
    per_call = {(label, side): [] for label, _ in SIZES for side in groups}
    per_step = {side: [] for side in groups}
    colls = {side: [] for side in groups}
    for side in groups:                      # warm up: buffers, persistent requests, DDP buckets
        for label, _ in SIZES:
            for _ in range(2 * wd.check_every):
                axonmpi.all_reduce(bufs[label], group=groups[side], out=bufs[label])
        for _ in range(3):
            ddp_step(side)
    w.barrier()
    for rnd in range(rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        for label, _ in SIZES:
            n = calls if label != "1 MiB" else max(calls // 16, wd.check_every * 2)
            for side in order:
                g, b = groups[side], bufs[label]
                w.barrier()
                t = clock()
                for _ in range(n):
                    axonmpi.all_reduce(b, group=g, out=b)
                per_call[(label, side)].append((clock() - t) / n)
        w.barrier()
        own.append(own_work(calls))
        for side in order:
            ck = groups[side]._watched.ck if groups[side]._watched is not None else None
            c0 = ck.calls if ck is not None else 0
            w.barrier()
            t = clock()
            for _ in range(steps):
                ddp_step(side)
            per_step[side].append((clock() - t) / steps)
            if ck is not None:
                colls[side].append((ck.calls - c0) / steps)
    if w.rank == 0:
        med = statistics.median
        print(f"{w.world_size} ranks, {rounds} interleaved rounds, AXONMPI_CHECK_EVERY={wd.check_every}, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"BENCH {'':<12} {'median of rounds':^38} {'best round (least disturbed)':^38}")
        print(f"BENCH {'all_reduce':<12} {'off':>9} {'on':>9} {'on-off':>9} {'ratio':>7}   {'off':>9} {'on':>9} "
              f"{'on-off':>9} {'ratio':>7}")
        rows = [(label, per_call[(label, "off")], per_call[(label, "on")], 1e6, "us") for label, _ in SIZES]
        rows.append(("DDP step", per_step["off"], per_step["on"], 1e3, "ms"))
        for label, off, on, k, unit in rows:
            d = [(a - b) * k for a, b in zip(on, off)]
            print(f"BENCH {label:<12} {med(off) * k:>7.2f}{unit} {med(on) * k:>7.2f}{unit} {med(d):>+7.2f}{unit} "
                  f"{med(on) / med(off):>7.3f}   {min(off) * k:>7.2f}{unit} {min(on) * k:>7.2f}{unit} "
                  f"{(min(on) - min(off)) * k:>+7.2f}{unit} {min(on) / min(off):>7.3f}")
        nc = med(colls["on"]) if colls["on"] else 0
        print(f"BENCH (DDP: MLP 784-{H}-{H}-10, batch {B} per rank, {nc:.0f} checked collective(s) per step)")
        print(f"BENCH the check's own work per call on the calling rank: median {med(own) * 1e6:.2f} us, best round "
              f"{min(own) * 1e6:.2f} us (the window append, and a 1/{wd.check_every} share of one exchange: hash, lane sums, Start, Test, compare)")
    axonmpi.distributed.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2048, help="all-reduces per block (1 MiB: a 16th)")
    ap.add_argument("--steps", type=int, default=5, help="DDP steps per block")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.calls, args.rounds, args.steps)
        return
    sys.path.insert(0, ROOT)
    from axonmpi.testing import mpiexec_env, mpiexec_path
    env = mpiexec_env({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    cmd = [mpiexec_path(), "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker",
           "--calls", str(args.calls), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}")
    print("\n".join(line[6:] if line.startswith("BENCH ") else line for line in r.stdout.splitlines()
                    if "BLAS" not in line))


if __name__ == "__main__":
    main()
