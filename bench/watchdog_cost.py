"""What the watchdog and the flight recorder cost: DDP step and small all-reduce, off / recorder / both.

Runs, interleaved (mode A, B, C, A, B, C, ...) so that load from other processes on a shared
machine hits every mode alike, ``--repeats`` times at ``--ranks`` ranks:

  * ``bench/ddp.py --worker`` (HIDDEN, BATCH, STEPS env vars; default here HIDDEN=1024) -> ms/step
  * ``bench/collectives.py --ops all_reduce --max-mib 1`` -> axonmpi's added latency over raw
    mpi4py per call (the "added us" column), per size

Modes: ``off`` (AXONMPI_WATCHDOG=0 AXONMPI_FLIGHT_RECORDER=0), ``recorder`` (recorder only:
AXONMPI_WATCHDOG=0), ``both`` (the default: watchdog and recorder), and on request ``polling``
(both, in the fallback used below THREAD_MULTIPLE: AXONMPI_WATCHDOG_POLLING=1). Prints best and median of
each mode and the difference to ``off``.

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
    "recorder": {"AXONMPI_WATCHDOG": "0", "AXONMPI_FLIGHT_RECORDER": "1"},
    "both": {"AXONMPI_WATCHDOG": "1", "AXONMPI_FLIGHT_RECORDER": "1"},
    "polling": {"AXONMPI_WATCHDOG": "1", "AXONMPI_FLIGHT_RECORDER": "1", "AXONMPI_WATCHDOG_POLLING": "1"},
}


def _run(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="off,recorder,both")
    ap.add_argument("--skip-collectives", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from axonmpi.testing import mpiexec_env, mpiexec_path

    base = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "HIDDEN": os.environ.get("HIDDEN", "1024")}
    mpiexec = [mpiexec_path(), "-n", str(args.ranks), sys.executable]
    modes = args.modes.split(",")
    ddp = {m: [] for m in modes}
    added = {m: {} for m in modes}
    for _ in range(args.repeats):
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
    print(f"{args.ranks} ranks, {args.repeats} interleaved repeats, HIDDEN={base['HIDDEN']}")
    print(f"{'mode':<10} {'DDP best ms':>11} {'median ms':>10} {'vs off (median)':>16}")
    ref = statistics.median(ddp[modes[0]])
    for m in modes:
        med = statistics.median(ddp[m])
        print(f"{m:<10} {min(ddp[m]):>11.2f} {med:>10.2f} {100 * (med / ref - 1):>+15.1f}%")
    if not args.skip_collectives:
        print("all_reduce added latency over raw mpi4py, us (median of repeats of best-of-5)")
        sizes = sorted(added[modes[0]])
        print(f"{'mode':<10} " + " ".join(f"{s:>9}" for s in sizes))
        for m in modes:
            print(f"{m:<10} " + " ".join(f"{statistics.median(added[m][s]):>9.2f}" for s in sizes))


if __name__ == "__main__":
    main()
