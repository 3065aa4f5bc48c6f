"""One MLP training step (forward, cross-entropy, backward, Adam) beside the hand-written NumPy anchor.

Runs ``../shared/anchors/numpy_mpi_mlp.py`` as a subprocess and axonmpi's step in this
process, interleaved ``--repeats`` times, and prints the best step time of each, samples/s
and the ratio axonmpi / anchor (target <= 1.15). Both use one BLAS/OpenMP thread.

Usage:
    python bench/mlp_step.py                  # HIDDEN=2048 BATCH=128 STEPS=30 as the anchor
    HIDDEN=1024 STEPS=10 python bench/mlp_step.py --repeats 1
    python bench/mlp_step.py --profile        # also: where axonmpi's step time goes (cProfile)
"""
from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before NumPy loads BLAS, and inherited by the anchor
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ANCHOR = os.path.join(ROOT, "..", "shared", "anchors", "numpy_mpi_mlp.py")

import axonmpi.nn as nn  # noqa: E402
import axonmpi.nn.functional as F  # noqa: E402
from axonmpi.autograd import Tensor  # noqa: E402
from axonmpi.optim import Adam  # noqa: E402

D_IN, D_OUT = 784, 10
H = int(os.environ.get("HIDDEN", "2048"))
B = int(os.environ.get("BATCH", "128"))
STEPS = int(os.environ.get("STEPS", "30"))
WARMUP = 5


def run_anchor() -> float:
    """Step time in seconds reported by the anchor (one rank, no mpiexec needed)."""
    out = subprocess.run([sys.executable, ANCHOR], capture_output=True, text=True, check=True).stdout
    m = re.search(r"step=([0-9.]+) ms", out)
    if m is None:
        raise RuntimeError(f"could not find 'step=... ms' in the anchor's output:\n{out}")
    return float(m.group(1)) / 1e3


def make_step():
    """The axonmpi model, data and optimizer; returns a function doing one training step."""
    model = nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, D_OUT))
    opt = Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((B, D_IN)).astype(np.float32))
    y = rng.integers(0, D_OUT, B)

    def step(phases=None):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if phases is not None:
            phases += np.array([t1 - t0, t2 - t1, time.perf_counter() - t2])
        return loss

    return step


def time_axonmpi(step) -> float:
    for _ in range(WARMUP):
        step()
    t = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - t) / STEPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each; the best is reported")
    ap.add_argument("--profile", action="store_true", help="print a phase split and cProfile's top entries")
    ap.add_argument("--top", type=int, default=15, help="profile entries to print")
    args = ap.parse_args()

    step = make_step()
    n_params = 784 * H + H + H * H + H + H * D_OUT + D_OUT
    have_anchor = os.path.exists(ANCHOR)
    anchor, ours = [], []
    for _ in range(args.repeats):
        if have_anchor:
            anchor.append(run_anchor())
        ours.append(time_axonmpi(step))
    a, o = (min(anchor) if anchor else float("nan")), min(ours)
    print(f"MLP {D_IN}-{H}-{H}-{D_OUT} ({n_params / 1e6:.2f}M params, float32), batch {B}, "
          f"{STEPS} steps, best of {args.repeats}, OMP/OPENBLAS threads 1")
    print(f"{'implementation':<28}{'step ms':>10}{'samples/s':>12}{'ratio':>8}")
    if have_anchor:
        print(f"{'numpy anchor (hand-written)':<28}{a * 1e3:>10.1f}{B / a:>12.0f}{1.0:>8.2f}")
    print(f"{'axonmpi nn+autograd+Adam':<28}{o * 1e3:>10.1f}{B / o:>12.0f}"
          + (f"{o / a:>8.2f}" if have_anchor else f"{'n/a':>8}"))
    if not have_anchor:
        print(f"note: anchor comparison skipped: {os.path.normpath(ANCHOR)} not found (it lives in ../shared/anchors "
              "beside the repository)")

    if args.profile:
        phases = np.zeros(3)
        for _ in range(STEPS):
            step(phases)
        ms = phases / STEPS * 1e3
        print(f"\nper step: forward+loss {ms[0]:.1f} ms, backward {ms[1]:.1f} ms, Adam {ms[2]:.1f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(STEPS):
            step()
        prof.disable()
        print(f"\nwhere axonmpi's time goes ({STEPS} steps, sorted by own time):")
        pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
