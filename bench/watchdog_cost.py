"""What the watchdog, the flight recorder and the always-on collective check cost: DDP step and small all-reduce.

Runs, interleaved (mode A, B, C, A, B, C, ...) so that load from other processes on a shared
machine hits every mode alike, ``--repeats`` times at ``--ranks`` ranks:

  * ``bench/ddp.py --worker`` (HIDDEN, BATCH, STEPS env vars; default here HIDDEN=1024) -> ms/step
  * ``bench/collectives.py --ops all_reduce --max-mib 1`` -> axonmpi's added latency over raw
    mpi4py per call (the "added us" column), per size

Modes: ``off`` (AXONMPI_WATCHDOG=0 AXONMPI_FLIGHT_RECORDER=0), ``recorder`` (recorder only:
AXONMPI_WATCHDOG=0, no check), ``both`` (watchdog and recorder, AXONMPI_CHECK_COLLECTIVES=0: the
watchdog alone), ``checked`` (the default: watchdog, recorder and the always-on collective check),
and on request ``polling`` (checked, in the fallback used below THREAD_MULTIPLE:
AXONMPI_WATCHDOG_POLLING=1). Prints best and median of each mode and the difference to ``off``.

Then, per call (``--per-call``, on by default), one ``mpiexec`` job that interleaves in one process
blocks of ``--calls`` small all-reduces on a group with the check and on a group without (both
watched) and raw mpi4py ``Allreduce`` on a duplicate communicator; the mean per call of each block
(the batched check's exchanges included), medians of ``--repeats`` rounds. ``bench/collective_check.py``
measures the check alone (8 B, 1 KiB, 1 MiB and a DDP step, on vs off interleaved).

    python bench/watchdog_cost.py --ranks 2 --repeats 7
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "off": {"AXONMPI_WATCHDOG": "0", "AXONMPI_FLIGHT_RECORDER": "0"},
    "recorder": {"AXONMPI_WATCHDOG": "0", "AXONMPI_FLIGHT_RECORDER": "1", "AXONMPI_CHECK_COLLECTIVES": "0"},
    "both": {"AXONMPI_WATCHDOG": "1", "AXONMPI_FLIGHT_RECORDER": "1", "AXONMPI_CHECK_COLLECTIVES": "0"},
    "checked": {"AXONMPI_WATCHDOG": "1", "AXONMPI_FLIGHT_RECORDER": "1", "AXONMPI_CHECK_COLLECTIVES": "1"},
    "polling": {"AXONMPI_WATCHDOG": "1", "AXONMPI_FLIGHT_RECORDER": "1", "AXONMPI_WATCHDOG_POLLING": "1"},
}


def per_call_worker(calls: int, rounds: int) -> None:
    """Under mpiexec: the mean time per call of blocks of small all-reduces, checked vs unchecked group vs raw
    mpi4py (blocks, not single calls: the batched check's exchanges every AXONMPI_CHECK_EVERY calls must be in
    the mean); rank 0 prints medians over ``rounds``. bench/collective_check.py measures the check alone."""
    import time
    import numpy as np
    from mpi4py import MPI
    import axonmpi

    w = axonmpi.init()
    wd = w.watchdog
    checked = w.new_group(list(range(w.world_size)), name="checked")
    wd.check = False
    plain = w.new_group(list(range(w.world_size)), name="unchecked")
    wd.check = True
    raw = MPI.COMM_WORLD.Dup()
    x = np.ones(1)
    axonmpi.all_reduce(x, group=checked)
    assert checked._watched.ck is not None and (plain._watched is None or plain._watched.ck is None)
    rows = {"raw mpi4py Allreduce": [], "axonmpi all_reduce, watchdog + recorder": [],
            "axonmpi all_reduce, + always-on check": []}
    clock = time.perf_counter

    def timed(label, call):
        raw.Barrier()
        t = clock()
        for _ in range(calls):
            call()
        rows[label].append((clock() - t) / calls)

    for _ in range(rounds):
        timed("raw mpi4py Allreduce", lambda: raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM))
        timed("axonmpi all_reduce, watchdog + recorder", lambda: axonmpi.all_reduce(x, group=plain, out=x))
        timed("axonmpi all_reduce, + always-on check", lambda: axonmpi.all_reduce(x, group=checked, out=x))
    raw.Free()
    if w.rank == 0:
        base = float(np.median(rows["axonmpi all_reduce, watchdog + recorder"]))
        print(f"per call, {w.world_size} ranks, {rounds} rounds x {calls} calls, mean of each block (us), "
              f"AXONMPI_CHECK_EVERY={wd.check_every}:")
        print(f"PERCALL {'':<42} {'median':>8} {'min':>8}")
        for k, v in rows.items():
            m, lo = float(np.median(v)), float(np.min(v))
            extra = f"  ({(m - base) * 1e6:+.2f} vs watchdog alone)" if "check" in k else ""
            print(f"PERCALL {k:<42} {m * 1e6:8.2f} {lo * 1e6:8.2f}{extra}")
    axonmpi.distributed.destroy()


def _run(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="off,recorder,both,checked")
    ap.add_argument("--skip-collectives", action="store_true")
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--per-call-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.per_call_worker:
        sys.path.insert(0, ROOT)
        per_call_worker(args.calls, args.repeats)
        return
    sys.path.insert(0, ROOT)
    from axonmpi.testing import mpiexec_env, mpiexec_path

    base = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "HIDDEN": os.environ.get("HIDDEN", "1024")}
    mpiexec = [mpiexec_path(), "-n", str(args.ranks), sys.executable]
    modes = args.modes.split(",")
    ddp = {m: [] for m in modes}
    added = {m: {} for m in modes}
    for _ in range(0 if args.skip_ddp else args.repeats):
        for m in modes:
            env = mpiexec_env({**base, **MODES[m]})
            out = _run(mpiexec + [os.path.join(ROOT, "bench", "ddp.py"), "--worker"], env)
            ddp[m].append(float(re.search(r"step=([0-9.]+) ms", out).group(1)))
            if not args.skip_collectives:
                out = _run(mpiexec + [os.path.join(ROOT, "bench", "collectives.py"), "--ops", "all_reduce",
                                      "--max-mib", "1", "--trials", "5"], env)
                for line in out.splitlines():
                    f = line.split()
                    if f and f[0] == "all_reduce":
                        added[m].setdefault(int(f[1]), []).append(float(f[4]))
    if not args.skip_ddp:
        print(f"{args.ranks} ranks, {args.repeats} interleaved repeats, HIDDEN={base['HIDDEN']}")
        print(f"{'mode':<10} {'DDP best ms':>11} {'median ms':>10} {'vs off (median)':>16} {'vs both':>8}")
        ref = statistics.median(ddp[modes[0]])
        wd_alone = statistics.median(ddp["both"]) if "both" in ddp else ref
        for m in modes:
            med = statistics.median(ddp[m])
            print(f"{m:<10} {min(ddp[m]):>11.2f} {med:>10.2f} {100 * (med / ref - 1):>+15.1f}% "
                  f"{100 * (med / wd_alone - 1):>+7.1f}%")
    if not args.skip_collectives and not args.skip_ddp:
        print("all_reduce added latency over raw mpi4py, us (median of repeats of best-of-5)")
        sizes = sorted(added[modes[0]])
        print(f"{'mode':<10} " + " ".join(f"{s:>9}" for s in sizes))
        for m in modes:
            print(f"{m:<10} " + " ".join(f"{statistics.median(added[m][s]):>9.2f}" for s in sizes))

    out = _run(mpiexec + [os.path.abspath(__file__), "--per-call-worker", "--calls", str(args.calls),
                          "--repeats", str(args.repeats)], mpiexec_env(base))
    print("\n".join(line.replace("PERCALL ", "") for line in out.splitlines()))


if __name__ == "__main__":
    main()
